"""Benchmark (not a test): what one parity check's draw costs the trusted side, part by part, per case of the plan.

    python tests/bench/parity_draws.py [--rounds 2] [--json PATH]

The trusted side draws every parity check itself (harness/stages/common.py `draw`): the inputs from a fresh
seed (`make_inputs`, with the check's varied sm_scale and unused slots), the float64 reference, the torch way
that sets the tolerance (the op's `calibrate`: its baseline, or for prefill the baseline without cuDNN) and the
tolerance it earns (its `diff` against the reference). In a cold `kevo-agent evaluate` these
draws were most of the compile stage (14 draws, 4.0 s on the H200, eighteenth session). This times each part,
synchronized, for every case and distribution of parity's plan on the configured device, `rounds` times
(the first round pays first calls: allocations, cuBLAS/cuDNN handles), and prints per case the median seconds
of each part, then the totals per part over one plan. No candidate and no worker: only the trusted side.
"""
from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.config import load_config  # noqa: E402
from harness.evaluate import device_shapes, resolve_device  # noqa: E402
from harness.stages.common import EvalContext, diff, tolerance  # noqa: E402
from harness.stages.parity import plan_checks  # noqa: E402
from harness.targets import TARGETS, configured  # noqa: E402
from harness.transport import DTYPES  # noqa: E402

PARTS = ("inputs", "reference", "calibration", "tolerance")


def timed(device: torch.device, fn):
    """fn's result and its seconds, the device synchronized before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def one_draw(ctx: EvalContext, case, dist: str) -> dict[str, float]:
    """The parts of `draw(ctx, case, dist, vary=True)`, each timed."""
    op = ctx.target.ops[case.op]
    seed = secrets.randbits(62)
    if ctx.target.vary is not None:
        case = ctx.target.vary(case, dist, random.Random(seed), ctx)
    inputs, t_in = timed(ctx.device, lambda: op.make_inputs(case, dist, seed, ctx.device, ctx.dtype))
    ref, t_ref = timed(ctx.device, lambda: op.reference(**inputs))
    base, t_base = timed(ctx.device, lambda: op.calibrate(inputs))
    _, t_tol = timed(ctx.device, lambda: tolerance(ctx, diff(base, ref)))
    return dict(zip(PARTS, (t_in, t_ref, t_base, t_tol)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config()
    device = resolve_device(cfg)
    target = TARGETS["attention"]
    shapes = device_shapes(cfg, "attention", device)
    ctx = EvalContext(cfg=cfg, target=configured("attention", cfg), shapes=shapes, device=device,
                      dtype=DTYPES[shapes.dtype], pool=None, source="", ops=list(target.ops))
    plan = plan_checks(ctx)
    seconds: dict[str, list[dict[str, float]]] = defaultdict(list)
    rounds = []
    for r in range(args.rounds):
        total = defaultdict(float)
        for case, dist in plan:
            parts = one_draw(ctx, case, dist)
            seconds[f"{case.label} [{dist}]"].append(parts)
            for k, v in parts.items():
                total[k] += v
        rounds.append(dict(total))
        print(f"round {r + 1}: {len(plan)} draws, " + ", ".join(f"{k} {v:.3f} s" for k, v in total.items())
              + f", all {sum(total.values()):.3f} s", flush=True)
    for label, runs in seconds.items():
        med = {k: statistics.median(p[k] for p in runs) for k in PARTS}
        print(f"{sum(med.values()):7.3f} s  " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()) + f"  {label}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "rounds": rounds,
                                               "per_case": seconds}, indent=1))


if __name__ == "__main__":
    main()
