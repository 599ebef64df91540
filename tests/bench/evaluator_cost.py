"""Benchmark (not a test): the evaluator's own cost, stage by stage, and the reference kernels' figures.

    python tests/bench/evaluator_cost.py [--json PATH]

Starts one warm worker pool, then evaluates the reference kernels and one candidate rejected at each
stage, through microbench (the replay has its own script: `kevo-agent profile` and
tests/test_served_gpu.py), printing seconds per stage and the microbench summary. On a CPU-only machine microbench is
skipped and no speed figure is printed. Results go to docs/BENCHMARKS.md by hand, with the date.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import candidates as C  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.evaluate import evaluate, open_pool  # noqa: E402

RUNS = [
    ("reference decode", C.REF_DECODE),
    ("decode candidate, warm (BLOCK_N=32)", C.with_knobs(C.REF_DECODE, BLOCK_N=32)),
    ("reference prefill", C.REF_PREFILL),
    ("reject at compile (Triton error)", C.TRITON_COMPILE_ERROR),
    ("reject at dispatch (SDPA wrapper)", C.SDPA_WRAPPER),
    ("reject at parity (drops newest token)", C.DROPS_NEWEST_TOKEN),
    ("reject at microbench (patched timer)", C.PATCHED_TIMER),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config()
    t0 = time.perf_counter()
    pool = open_pool(cfg, "attention")
    start_s = time.perf_counter() - t0
    print(f"worker pool ({pool.device}, torch {pool.info['torch']}, triton {pool.info['triton']}) warm in {start_s:.2f} s")
    rows = []
    try:
        for name, source in RUNS:
            t0 = time.perf_counter()
            v = evaluate(source, "attention", cfg, pool, until="microbench")
            total = time.perf_counter() - t0
            stages = {s.name: s.seconds for s in v.stages}
            waits = {s.name: s.metrics.get("worker_s", 0.0) for s in v.stages}
            outcome = "ok" if v.ok else f"rejected at {v.failed_stage}"
            print(f"\n{name}: {outcome} in {total:.2f} s  ("
                  + ", ".join(f"{k} {s:.2f} (worker {waits[k]:.2f})" for k, s in stages.items()) + ")")
            for s in v.stages:
                parts: dict[str, float] = {}
                for key, val in s.metrics.items():
                    if key.endswith("_s") and key != "worker_s":
                        part = key.rpartition(".")[2] if s.name == "microbench" else key   # summed over cases (<case key>.<figure>)
                        parts[part] = parts.get(part, 0.0) + val
                if parts:
                    print(f"  {s.name} time: " + ", ".join(f"{k} {x:.2f}" for k, x in parts.items()))
            for s in v.stages:
                if s.name == "microbench" or s.status == "failed":
                    print(f"  {s.name}: {s.reason[:1500]}")
            rows.append({"name": name, "ok": v.ok, "failed_stage": v.failed_stage, "total_s": total,
                         "stages": [s.model_dump() for s in v.stages]})
    finally:
        pool.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"pool_start_s": start_s, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
