"""The profile evidence a planner reasons from: each op's share f of the served step, and figures.

When config names a recorded served profile (`served.recorded_shapes`: a `kevo-agent profile --json`
file, which also sets the served shapes), the op shares are that profile's measurements. Otherwise
a stand-in, which says so: op shares are the assumptions in config (agent.standin_op_share), the
shapes are the config's served placeholders. Either way the heads' own microbench figures are added
(when this machine has CUDA).
Not covered: measuring where a served step's time goes — that is harness/profile.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.evaluate import device_shapes
from harness.stages import STAGE_NAMES
from harness.targets import TARGETS

from agent.records import Kernel, OpEvidence, Profile


def kernel_figures(kernel: Kernel, cfg: Config, target: str, device: torch.device) -> list[str]:
    """The kernel's measured figures per served case, as lines with numbers; or why there are none."""
    verdict = kernel.verdict
    bench = next((s for s in verdict.stages if s.name == "microbench"), None) if verdict else None
    if bench is None or not bench.metrics:
        why = bench.reason if bench is not None else (verdict.reason if verdict else "not evaluated")
        return [f"{kernel.ref}: no timing ({why.splitlines()[0][:160]})"]
    m, op = bench.metrics, kernel.op
    unit = TARGETS[target].ops[op].unit
    cases = [c for c in TARGETS[target].served_cases(device_shapes(cfg, target, device)) if c.op == op]
    lines = [f"{kernel.ref}: served-mix speedup {m.get('speedup', float('nan')):.3f}x over the torch baseline "
             f"(noise bar {m.get('bar', float('nan')):.3f}x)"]
    for i, case in enumerate(cases):
        k = f"{op}{i}_"
        if k + "candidate_ms" not in m:
            continue
        anchor = f", cuDNN {m[k + 'anchor_rate']:.2f} {unit}" if k + "anchor_rate" in m else ""
        lines.append(f"{kernel.ref} on {case.label} (weight {case.weight:.2f}): {m[k + 'candidate_ms'] * 1e3:.1f} us, "
                     f"{m[k + 'candidate_rate']:.2f} {unit} vs torch {m[k + 'baseline_rate']:.2f} {unit}{anchor}")
    return lines


def standin_profile(cfg: Config, target: str, device: torch.device, arch: str, heads: dict[str, Kernel],
                    why: str = "") -> Profile:
    shapes = device_shapes(cfg, target, device)
    ops = {}
    for op in cfg.agent.ops:
        share = cfg.agent.standin_op_share[op]
        groups = getattr(shapes, op)
        q, kv = shapes.heads[0]
        lines = [f"{op} share of the served step f = {share:.2f} (ASSUMED in config agent.standin_op_share, not measured)"]
        lines += [f"served {op} shapes (config placeholders): batch {g.batch}, lengths {g.lengths[0]}..{g.lengths[1]}, "
                  f"{q} q / {kv} kv heads, head_dim {shapes.head_dim}, {shapes.dtype}, weight {g.weight:g}" for g in groups]
        if op in heads:
            lines += kernel_figures(heads[op], cfg, target, device)
        ops[op] = OpEvidence(share=share, lines=lines)
    note = ("stand-in profile: no served profile exists yet (issue 3's `kevo-agent profile`); op shares are "
            "assumptions from config, shapes are the config's placeholders, the figures are the heads' microbench")
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
    ops = {}
    for op in cfg.agent.ops:
        share = float(shares.get(op, 0.0))
        lines = [f"{op} share of the served step f = {share:.3f} (MEASURED: {where})",
                 f"largest parts of the step: {largest}",
                 f"end-to-end ceiling if {op} became s times faster: " + ", ".join(
                     f"s={s} -> {v:.3f}x" for s, v in data.get("op_ceilings", {}).get(op, {}).items())]
        lines += [f"served {op} shapes (recorded): batch {g.batch}, lengths {g.lengths[0]}..{g.lengths[1]}, "
                  f"{q} q / {kv} kv heads, head_dim {shapes.head_dim}, {shapes.dtype}, weight {g.weight:.3f}"
                  for g in getattr(shapes, op)]
        if op in heads:
            lines += kernel_figures(heads[op], cfg, target, device)
        ops[op] = OpEvidence(share=max(share, 1e-6), lines=lines)
    note = f"served profile {path.name}: op shares measured ({where})"
    return Profile(source="served", note=note + (f"; {why}" if why else ""), device=device.type, arch=arch, ops=ops)


def run_profile(cfg: Config, target: str, device: torch.device, arch: str, heads: dict[str, Kernel],
                why: str = "") -> Profile:
    """The measured profile when config names one (served.recorded_shapes), else the stand-in."""
    if cfg.served.recorded_shapes is None:
        return standin_profile(cfg, target, device, arch, heads, why)
    path = Path(cfg.served.recorded_shapes)
    return measured_profile(cfg, target, device, arch, heads, path if path.is_absolute() else PROJECT_ROOT / path, why)


def baseline_replay_note() -> dict:
    """What the ledger's first commit says about the baseline replay."""
    if "replay" in STAGE_NAMES:
        return {"status": "per-candidate", "note": "the replay stage replays the baseline beside each candidate it scores"}
    return {"status": "not run", "note": "this evaluator has no full scored replay yet (stage 5, issue 3): "
                                         "nothing can be accepted, and no served figure exists to record"}
