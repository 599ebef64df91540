"""Benchmark (not a test): what parity's warm pays to make its calls' unfilled inputs, call by call.

    python tests/bench/warm_inputs.py [--op decode] [--rounds 2] [--expandable]

Parity's warm (harness/stages/parity.py `send_warm`, harness/worker.py `warm`) makes `warm_draws` calls per shape
class, each on inputs whose payload is left unwritten (targets.base.UNFILLED), and the worker's reply counts the
time as `inputs_s`: 4.7-4.8 s for the Gluon decode's 44 calls on an H100, with or without the trusted side drawing
beside it (docs/BENCHMARKS.md, sixtieth session). Here the same calls (harness/stages/parity.py `warm_calls`, from
parity's own plan) are made in this process, each timed to its end on the device, with the bytes it allocated and
the allocator's reserve after it; then the calls' host profile (cProfile, the ten costliest functions by their own
time). `--expandable`: the allocator's expandable segments on first, as the evaluator's reserve and the served
server set them (harness/gpu_memory.py). GPU: on a CPU the figures are host work, not the worker's.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.config import load_config  # noqa: E402
from harness.evaluate import device_shapes  # noqa: E402
from harness.gpu_memory import expandable_segments  # noqa: E402
from harness.stages.common import EvalContext  # noqa: E402
from harness.stages.parity import plan_checks, warm_calls  # noqa: E402
from harness.targets import TARGETS  # noqa: E402
from harness.targets.base import UNFILLED  # noqa: E402
from harness.transport import DTYPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--expandable", action="store_true")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.expandable and device.type == "cuda":
        expandable_segments()
    cfg = load_config()
    ctx = EvalContext(cfg=cfg, target=TARGETS["attention"], shapes=device_shapes(cfg, "attention", device), device=device,
                      dtype=DTYPES[getattr(cfg.targets.attention, device.type).dtype], pool=None, source="", ops=[a.op])
    make = ctx.target.ops[a.op].make_inputs
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prof = cProfile.Profile()
    for r in range(a.rounds):
        _, calls = warm_calls(ctx, plan_checks(ctx))         # as parity's warm sends them
        total = 0.0
        for case, seed in ((call["case"], call["seed"]) for call in calls):
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            sync()
            t0 = time.perf_counter()
            prof.enable()
            args = make(case, UNFILLED, seed, device, ctx.dtype)
            prof.disable()
            sync()
            took = time.perf_counter() - t0
            total += took
            if device.type == "cuda":
                held = torch.cuda.memory_allocated(device) - before
                reserved = torch.cuda.memory_reserved(device)
            else:
                held = sum(v.untyped_storage().nbytes() for v in args.values() if isinstance(v, torch.Tensor))
                reserved = 0
            print(f"round {r + 1}: {took * 1e3:7.1f} ms  {held / 2**30:6.2f} GiB held  {reserved / 2**30:6.2f} GiB reserved  "
                  f"{case.label[:110]}", flush=True)
            del args
        print(f"round {r + 1}: {len(calls)} calls, {total:.2f} s", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)


if __name__ == "__main__":
    main()
