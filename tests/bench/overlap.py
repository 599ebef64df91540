"""Benchmark (not a test): does sharing a GPU between slots change what microbench measures?

    python tests/bench/overlap.py [--rounds 4] [--fillers 3] [--gpu 0] [--kernel FILE] [--json PATH]

For `executor.slots_per_gpu` 1, then 2, on one GPU: a local executor judges `--rounds` copies of one
kernel (the reference decode unless --kernel names a file) through microbench, each after `--fillers`
other candidates sent through parity only, so that with 2 slots the fillers' compile, dispatch and
parity run on the GPU beside the kernel's cheap stages and wait while its microbench times
(harness/lease.py). Prints, per mode, each round's microbench figures (the candidate's and baseline's
time per served case, the noise band, the served-mix speedup), the wall time and jobs per hour, and
whether any stage ran beside a timed stage (Done.spans: it must be none); then, per served case, the
two modes' median candidate times and whether they differ by less than the noise band. The verdict
cache is off (every round is measured). On a CPU microbench is skipped: nothing to compare.
Results go to docs/BENCHMARKS.md by hand, with the date and the command.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import candidates as C  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.executors import InOrder  # noqa: E402
from harness.local_executor import LocalExecutor  # noqa: E402
from harness.slot import Job  # noqa: E402
from harness.stages import TIMED_STAGES  # noqa: E402
from harness.stages.microbench import case_figures  # noqa: E402

FILLERS = [C.REF_PREFILL, C.with_knobs(C.REF_DECODE, BLOCK_N=32), C.REBLOCKED]     # each worker compiles afresh


def beside_timed(done: list) -> int:
    """Pairs of stages of different slots that ran at once, one of them timed (must be 0)."""
    spans = [(d.slot, s) for d in done for s in d.spans]
    return sum(1 for i, (sa, a) in enumerate(spans) for sb, b in spans[i + 1:]
               if sa != sb and (a.name in TIMED_STAGES or b.name in TIMED_STAGES) and a.start < b.end and b.start < a.end)


def run(cfg, slots: int, gpu: int, kernel: str, rounds: int, fillers: int) -> dict:
    ex_cfg = cfg.executor.model_copy(update={"slots_per_gpu": slots, "gpus": [gpu], "verdict_cache": False})
    mode_cfg = cfg.model_copy(update={"executor": ex_cfg})
    jobs = []
    for r in range(rounds):
        jobs += [Job(id=f"f{r}.{k}", source=FILLERS[(r + k) % len(FILLERS)], until="parity") for k in range(fillers)]
        jobs.append(Job(id=f"k{r}", source=kernel, until="microbench"))
    with LocalExecutor(mode_cfg, "attention") as ex:
        t0 = time.perf_counter()
        queue = InOrder(ex)
        for job in jobs:
            queue.submit(job)
        done = []
        while len(queue):
            done.append(queue.next())
        wall = time.perf_counter() - t0
    rows = []
    for d in done:
        if not d.id.startswith("k"):
            continue
        bench = next((s for s in d.verdict.stages if s.name == "microbench"), None)
        if bench is None or bench.status == "skipped":
            print(f"  {d.id}: no microbench figures ({d.verdict.failed_stage or 'skipped'}: {d.verdict.reason[:200]})")
            continue
        m = bench.metrics
        figures = [(key or f"{op}{i}", f) for op in ("decode", "prefill") for i, (key, f) in enumerate(case_figures(m, op))]
        row = {"id": d.id, "slot": d.slot, "speedup": m.get("speedup"), "noise": m.get("noise"), "seconds": bench.seconds,
               "cases": {c: {"candidate_ms": f["candidate_ms"], "baseline_ms": f["baseline_ms"], "noise": f["noise"]}
                         for c, f in figures if {"candidate_ms", "baseline_ms", "noise"} <= f.keys()}}
        rows.append(row)
        print(f"  {d.id} on {d.slot}: served mix {row['speedup']:.3f}x, noise {row['noise']:.3f}, microbench {bench.seconds:.1f} s; "
              + "; ".join(f"{c} {v['candidate_ms']:.4f} vs {v['baseline_ms']:.4f} ms" for c, v in row["cases"].items()))
    clash = beside_timed(done)
    print(f"  {len(done)} jobs in {wall:.1f} s ({3600 * len(done) / wall:.0f} per hour); stages beside a timed stage: {clash}")
    return {"slots": slots, "wall_s": wall, "jobs": len(done), "beside_timed": clash, "rounds": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--fillers", type=int, default=3)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--kernel", default=None, help="a kernel file (default: the reference decode)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config()
    kernel = Path(args.kernel).read_text() if args.kernel else C.REF_DECODE
    modes = []
    for slots in (1, 2):
        print(f"slots_per_gpu {slots}: {args.rounds} rounds of the kernel, each after {args.fillers} fillers through parity")
        modes.append(run(cfg, slots, args.gpu, kernel, args.rounds, args.fillers))
    print("\nper served case: median candidate time, 1 slot vs 2 slots, against the noise band")
    for case in sorted({c for r in modes[0]["rounds"] for c in r["cases"]}):
        med = [statistics.median(r["cases"][case]["candidate_ms"] for r in m["rounds"] if case in r["cases"]) for m in modes]
        band = max(r["cases"][case]["noise"] for m in modes for r in m["rounds"] if case in r["cases"])
        diff = abs(med[1] - med[0]) / med[0]
        print(f"  {case}: {med[0]:.4f} vs {med[1]:.4f} ms: differ by {diff:.1%}, noise band {band:.1%}: "
              + ("within" if diff <= band else "OUTSIDE"))
    if args.json:
        Path(args.json).write_text(json.dumps(modes, indent=1))


if __name__ == "__main__":
    main()
