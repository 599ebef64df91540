"""The profile evidence a planner reasons from: each op's share f of the served step, and figures.

When config names a recorded served profile (`served.recorded_shapes`: a `kevo-agent profile --json`
file, which also sets the served shapes), the base shares are that profile's measurements: the share
of each op in the step of the torch baseline engine. Otherwise a stand-in, which says so: the base
shares are the assumptions in config (agent.standin_op_share), the shapes are the config's served
placeholders. The share f a claim uses is the current heads': derived from the base shares and each
head's measured microbench served-mix speedup S over that same torch baseline (`head_shares`), so
after an accepted kernel the rebuilt profile moves f. Each head's own figures are added (when this
machine has CUDA), its full scored replay's served figures beside the derivation as a check.
Not covered: measuring where a served step's time goes — that is harness/profile.py; a new served
profile of the new head (the step's other parts are taken as they were measured on the baseline).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.evaluate import device_shapes
from harness.targets import TARGETS

from agent.reading.figures import microbench_cases, speed, vs_cudnn
from agent.records import Kernel, OpEvidence, Profile


def head_shares(base: dict[str, float], heads: dict[str, Kernel]) -> dict[str, float]:
    """Each op's share of the served step with the current heads serving it. Measured (or assumed): the
    base share f of each op in the torch baseline's step. Measured: each head's microbench served-mix
    speedup S over the same torch baseline (S = 1 for a head never timed). Derived: the op's time
    becomes f/S, the step 1 - Σf + Σf/S, and every op's share f' = (f/S) / (1 - Σf + Σf/S)."""
    scale = {op: (heads[op].speedup if op in heads and heads[op].speedup else 1.0) for op in base}
    step = 1.0 - sum(base.values()) + sum(f / scale[op] for op, f in base.items())
    return {op: (f / scale[op]) / step for op, f in base.items()}


def derivation_lines(op: str, base: dict[str, float], heads: dict[str, Kernel], shares: dict[str, float]) -> list[str]:
    """What the planner is told about how f came to be, and what the head's replay measured to check it."""
    k = heads.get(op)
    if k is None or not k.speedup:
        return [f"{op} share for the current head f = {shares[op]:.3f} (its base share: no head speedup timed here)"]
    step = 1.0 - sum(base.values()) + sum(f / (heads[o].speedup if o in heads and heads[o].speedup else 1.0)
                                          for o, f in base.items())
    lines = [f"{op} share for the current head {k.ref} f = {shares[op]:.3f} (DERIVED: base f {base[op]:.3f} of the torch "
             f"baseline's step, the head's microbench {k.speedup:.3f}x over torch; the step with every head is "
             f"{step:.3f} of the baseline's, f = (f_base/S) / that)"]
    replay = next((s for s in k.verdict.stages if s.name == "replay" and "tpot_p90_speedup" in s.metrics), None) if k.verdict else None
    if replay is not None:
        m = replay.metrics
        lines.append(f"{k.ref}'s full scored replay measured p90 TPOT {m['tpot_p90_speedup']:.3f}x and throughput "
                     f"{m.get('throughput_ratio', float('nan')):.3f}x over torch, against {1 / step:.3f}x the derived step "
                     "predicts (the replay's figures are served latencies, not the step's time, so f is not taken from them)")
    return lines


def kernel_figures(kernel: Kernel, cfg: Config, target: str, device: torch.device) -> list[str]:
    """The kernel's measured figures per served shape its microbench timed, kevo/cuDNN first, as lines with
    numbers (with its kernels' registers and programs per SM where the worker reported them); or why there are
    none. Each shape is named as the record that timed it names it, and one that is not among the config's served
    shapes now says so: figures are never paired with today's shapes by place."""
    verdict = kernel.verdict
    bench = next((s for s in verdict.stages if s.name == "microbench"), None) if verdict else None
    if bench is None or not bench.metrics:
        why = bench.reason if bench is not None else (verdict.reason if verdict else "not evaluated")
        return [f"{kernel.ref}: no timing ({why.splitlines()[0][:160]})"]
    m, op = bench.metrics, kernel.op
    unit = TARGETS[target].ops[op].unit
    now = {c.key for c in TARGETS[target].served_cases(device_shapes(cfg, target, device)) if c.op == op}
    lines = [f"{kernel.ref}: served mix {speed(verdict, op).words()} (torch noise bar {m.get('bar', float('nan')):.3f}x)"]
    for c in microbench_cases(m, bench.reason, op):
        lib = vs_cudnn([c])
        anchor = f"{lib:.3f}x cuDNN ({c['anchor_rate']:.2f} {unit}), " if lib is not None and "anchor_rate" in c else "no cuDNN anchor timed, "
        where = ("" if c["key"] in now else " (not a served shape of the config now)" if c["key"] is not None
                 else " (an older kevo's record, its figures kept by place: the shape as that record names it)")
        lines.append(f"{kernel.ref} on {c['label']}{where} (weight {c.get('weight', float('nan')):.2f}): {anchor}"
                     f"{c['baseline_ms'] / c['candidate_ms']:.3f}x torch; {c['candidate_ms'] * 1e3:.1f} us, "
                     f"{c['candidate_rate']:.2f} {unit} vs torch {c['baseline_rate']:.2f} {unit}"
                     + (f"; its kernels (the worker's report): up to {c['kernel_registers']:.0f} registers a thread, "
                        f"{c['kernel_spills']:.0f} spilled words, {c['kernel_programs_per_sm']:.0f} programs per SM (the tightest kernel)"
                        if "kernel_programs_per_sm" in c else ""))
    return lines


def standin_profile(cfg: Config, target: str, device: torch.device, arch: str, heads: dict[str, Kernel],
                    why: str = "") -> Profile:
    shapes = device_shapes(cfg, target, device)
    base = {op: cfg.agent.standin_op_share[op] for op in cfg.agent.ops}
    shares = head_shares(base, heads)
    ops = {}
    for op in cfg.agent.ops:
        groups = getattr(shapes, op)
        q, kv = shapes.heads[0]
        lines = [f"{op} base share of the torch baseline's served step f = {base[op]:.2f} (ASSUMED in config "
                 "agent.standin_op_share, not measured)", *derivation_lines(op, base, heads, shares)]
        lines += [f"served {op} shapes (config placeholders): batch {g.batch}, lengths {g.lengths[0]}..{g.lengths[1]}, "
                  f"{q} q / {kv} kv heads, head_dim {shapes.head_dim}, {shapes.dtype}, weight {g.weight:g}" for g in groups]
        if op in heads:
            lines += kernel_figures(heads[op], cfg, target, device)
        ops[op] = OpEvidence(share=shares[op], lines=lines)
    note = ("stand-in profile: config names no served profile (served.recorded_shapes; write one with "
            "`kevo-agent profile --json`); base op shares are assumptions from config, shapes are the config's "
            "placeholders, the figures are the heads' microbench")
    return Profile(source="stand-in", note=note + (f"; {why}" if why else ""), device=device.type, arch=arch, ops=ops)


def measured_profile(cfg: Config, target: str, device: torch.device, arch: str, heads: dict[str, Kernel],
                     path: Path, why: str = "") -> Profile:
    """The evidence of a recorded served profile (a `kevo-agent profile --json` file): measured op
    shares, where the rest of the step goes, the ceilings, the recorded shapes, and the heads' figures."""
    try:
        data = json.loads(path.read_text())
        shares, buckets = data["op_shares"], data["buckets"]
        where = (f"{data['preset']} on {data['trace']}, {data['steps_profiled']} of {data['steps']} steps profiled "
                 f"on {data['device']}, mean step {data['step_ms_mean']:.2f} ms; {data['clock']}")
        largest = ", ".join(f"{b['label']} {b['share']:.1%}" for b in sorted(buckets.values(), key=lambda b: -b["share"])[:4])
    except FileNotFoundError:
        raise HarnessError(f"served.recorded_shapes: {path}: no such profile (write one with kevo-agent profile --json)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HarnessError(f"served.recorded_shapes: {path}: not a kevo profile ({type(e).__name__}: {e})") from None
    shapes = device_shapes(cfg, target, device)
    q, kv = shapes.heads[0]
    base = {op: max(float(shares.get(op, 0.0)), 1e-6) for op in cfg.agent.ops}
    current = head_shares(base, heads)
    ops = {}
    for op in cfg.agent.ops:
        share = base[op]
        lines = [f"{op} base share of the torch baseline's served step f = {share:.3f} (MEASURED: {where})",
                 *derivation_lines(op, base, heads, current),
                 f"largest parts of the step: {largest}",
                 f"end-to-end ceiling if {op} became s times faster than the torch baseline: " + ", ".join(
                     f"s={s} -> {v:.3f}x" for s, v in data.get("op_ceilings", {}).get(op, {}).items())]
        lines += [f"served {op} shapes (recorded): batch {g.batch}, lengths {g.lengths[0]}..{g.lengths[1]}, "
                  f"{q} q / {kv} kv heads, head_dim {shapes.head_dim}, {shapes.dtype}, weight {g.weight:.3f}"
                  for g in getattr(shapes, op)]
        if op in heads:
            lines += kernel_figures(heads[op], cfg, target, device)
        ops[op] = OpEvidence(share=current[op], lines=lines)
    note = f"served profile {path.name}: base op shares measured on the torch baseline ({where}), f derived for the heads"
    return Profile(source="served", note=note + (f"; {why}" if why else ""), device=device.type, arch=arch, ops=ops)


def run_profile(cfg: Config, target: str, device: torch.device, arch: str, heads: dict[str, Kernel],
                why: str = "") -> Profile:
    """The measured profile when config names one (served.recorded_shapes), else the stand-in."""
    if cfg.served.recorded_shapes is None:
        return standin_profile(cfg, target, device, arch, heads, why)
    path = Path(cfg.served.recorded_shapes)
    return measured_profile(cfg, target, device, arch, heads, path if path.is_absolute() else PROJECT_ROOT / path, why)


def baseline_replay_note() -> dict:
    """What the ledger's first commit says about the baseline replay (the replay stage is always there)."""
    return {"status": "per-candidate", "note": "the replay stage replays the baseline beside each candidate it scores"}
