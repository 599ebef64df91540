"""Benchmark (not a test): is a Triton compile slower while another runs beside it, on other cores and another GPU?

    python tests/bench/compile_contention.py [--rounds 2] [--layouts]

Issue 6's two-GPU run in the sixth session found each evaluation about 12% slower than in the one-GPU
run, in the stages that are mostly Triton compiles (compile, parity's first calls), although the slots
have separate GPUs and separate core shares and their processes waited no longer for a core
(`cpu_wait_s`); the seventh session's found none (docs/BENCHMARKS.md). This separates the
host from kevo: it runs tests/bench/jit_first_calls.py (the reference kernels' first calls on 13 shape
classes: nearly all compile time) alone on every core and then twice at once, one per GPU, each process
pinned to its slot's core share (harness.pins.core_shares, as the evaluation slots are) with its
own empty Triton cache, and prints each process's summed first-call time. With --layouts it also runs
alone on slot 0's share and on one core, and side by side on halves and on every other core. Each
round runs every layout once, starting one layout later than the round before, so that a layout's
place in the round (the host's state after the last one) does not pass for its effect; the spread
between rounds is the bench's noise. GPU only.
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

from harness.pins import core_locality, core_shares  # noqa: E402

FIRST_CALLS = ROOT / "tests" / "bench" / "jit_first_calls.py"


def topology() -> str:
    """The CPU model, and each (NUMA node, last-level cache group) with its cores as the slots' dealer sees
    them (harness.pins.core_locality; a VM may hide the groups)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    groups: dict[tuple[int, int], list[int]] = {}
    for c in sorted(os.sched_getaffinity(0)):
        groups.setdefault(core_locality(c), []).append(c)
    return f"{model}; (NUMA node, L3 group): cores " + "; ".join(f"{g}: {v[0]}..{v[-1]} ({len(v)})" for g, v in groups.items())


def first_calls_ms(shares: list[tuple[int, ...]]) -> list[float]:
    """One process per share at once, process i on GPU i and pinned to shares[i]; each one's summed first-call ms."""
    procs, caches = [], []
    for i, cpus in enumerate(shares):
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


def layouts(every: bool) -> dict[str, list[tuple[int, ...]]]:
    """The default pair (alone on every core against the slots' shares), and with --layouts the others
    that tell a shared host from a smaller share or a layout: alone on half the cores or on one, and
    the two ways of dealing the cores side by side."""
    cores = tuple(sorted(os.sched_getaffinity(0)))
    out = {"alone, every core": [cores], "side by side, the slots' shares": core_shares(2)}
    more = {"alone, slot 0's share": [core_shares(2)[0]], "side by side, halves": core_shares(2, "blocks"),
            "side by side, every other core": core_shares(2, "interleaved"), "alone, one core": [cores[:1]]}
    for name, shares in more.items() if every and len(cores) >= 2 else ():
        if shares not in out.values():                  # the slots' shares are one of the two ways
            out[name] = shares
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layouts", action="store_true",
                    help="also: alone on slot 0's share or one core, and side by side on halves and on every other core")
    a = ap.parse_args()
    print(topology(), flush=True)
    plan = layouts(a.layouts)
    for name, shares in plan.items():
        print(f"{name}: cores {[f'{s[0]}..{s[-1]} ({len(s)})' for s in shares]}", flush=True)
    got: dict[str, list[list[float]]] = {name: [] for name in plan}
    names = list(plan)
    for r in range(a.rounds):            # each round goes through every layout, starting one later each time
        t = time.perf_counter()
        for name in names[r % len(names):] + names[:r % len(names)]:
            got[name].append(first_calls_ms(plan[name]))
        print(f"round {r} ({time.perf_counter() - t:.0f} s): " +
              "; ".join(f"{name} {' and '.join(f'{v:.0f}' for v in got[name][-1])} ms" for name in plan), flush=True)
    base = sum(v[0] for v in got["alone, every core"]) / a.rounds
    print("mean summed first-call time, and against alone on every core:")
    for name, rounds in got.items():
        each = [sum(col) / a.rounds for col in zip(*rounds)]
        print(f"  {name}: {' and '.join(f'{v:.0f} ms ({v / base:.3f}x)' for v in each)}; "
              f"mean {sum(each) / len(each) / base:.3f}x")


if __name__ == "__main__":
    main()
