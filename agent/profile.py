"""The profile evidence a planner reasons from: each op's share f of the served step, and figures.

Until the served scenario's profile exists (issue 3, `kevo-agent profile`), this builds a stand-in
and says so: op shares are the assumptions in config (agent.standin_op_share), the shapes are the
config's served placeholders, and the only measurements are the head kernels' own microbench figures
(when this machine has CUDA). The baseline replay is likewise a note until stage 5 exists.
Not covered: measuring where a served step's time goes — that is issue 3's profiler.
"""
from __future__ import annotations

import torch

from harness.config import Config
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


def baseline_replay_note() -> dict:
    """What the ledger's first commit says about the baseline replay."""
    if "replay" in STAGE_NAMES:
        return {"status": "per-candidate", "note": "the replay stage replays the baseline beside each candidate it scores"}
    return {"status": "not run", "note": "this evaluator has no full scored replay yet (stage 5, issue 3): "
                                         "nothing can be accepted, and no served figure exists to record"}
