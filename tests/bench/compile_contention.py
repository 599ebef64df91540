"""Benchmark (not a test): is a Triton compile slower while another runs beside it, on other cores and another GPU?

    python tests/bench/compile_contention.py [--rounds 2]

Issue 6's two-GPU run finds each evaluation about 12% slower than in the one-GPU run, in the stages that
are mostly Triton compiles (compile, parity's first calls), although the slots have separate GPUs and
separate core shares and their processes wait no longer for a core (`cpu_wait_s`). This separates the
host from kevo: it runs tests/bench/jit_first_calls.py (the reference kernels' first calls on 13 shape
classes: nearly all compile time) once alone and then twice at once, one per GPU, each process pinned
to its slot's core share (harness.executors.core_shares, as the evaluation slots are) with its own empty
Triton cache, and prints each process's summed first-call time. Rounds alternate alone / side by side
so that a neighbour's load on the host shows as spread between rounds. GPU only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.executors import core_shares  # noqa: E402

FIRST_CALLS = ROOT / "tests" / "bench" / "jit_first_calls.py"


def first_calls_ms(n: int) -> list[float]:
    """n processes at once, process i on GPU i and core share i; each one's summed first-call ms."""
    procs, caches = [], []
    for i, cpus in enumerate(core_shares(n)):
        cache = tempfile.TemporaryDirectory()
        caches.append(cache)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), TRITON_CACHE_DIR=cache.name)
        procs.append(subprocess.Popen([sys.executable, str(FIRST_CALLS)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      text=True, preexec_fn=lambda cpus=cpus: os.sched_setaffinity(0, cpus)))
    totals = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        if p.returncode:
            raise SystemExit(f"{FIRST_CALLS.name} exited with {p.returncode}: no figure from this round")
        rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
        totals.append(sum(float(r[-2]) for r in rows))
    for c in caches:
        c.cleanup()
    return totals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    alone, beside = [], []
    for r in range(a.rounds):
        t = time.perf_counter()
        alone += first_calls_ms(1)
        beside += first_calls_ms(2)
        print(f"round {r}: alone {alone[-1]:.0f} ms; side by side {beside[-2]:.0f} and {beside[-1]:.0f} ms "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
    ma, mb = sum(alone) / len(alone), sum(beside) / len(beside)
    print(f"mean first-call time: alone {ma:.0f} ms, side by side {mb:.0f} ms: {mb / ma:.3f}x")


if __name__ == "__main__":
    main()
