"""Benchmark (not a test): the evaluator's own cost, stage by stage, and the reference kernels' figures.

    python tests/bench/evaluator_cost.py [--json PATH]
    python tests/bench/evaluator_cost.py --cold N [--file PATH] [--until STAGE] [--json PATH]

Without --cold: starts one warm worker pool, then evaluates the reference kernels and one candidate rejected at each
stage, through microbench (the replay has its own script: `kevo-agent profile` and
tests/test_served_gpu.py), printing seconds per stage and the microbench summary. On a CPU-only machine microbench is
skipped and no speed figure is printed. Results go to docs/BENCHMARKS.md by hand, with the date.

`--cold N`: N cold `kevo-agent evaluate` processes one after another (the real command line, `python -m
agent.cli evaluate --until STAGE --json FILE`, each with a fresh, empty verdict cache (config
`agent.runs_dir` in a temporary folder), so every run is judged by the stages and pays the cache's look-up;
default: the split-KV decode kernel through microbench), each printed as its breakdown (the `spans` its
--json gives: the steps one after another from the interpreter's start, then what ran beside them) with the
wall time seen from outside (which adds the pool's close and the interpreter's exit), then the median of
each step over the N. The first run on a fresh machine also pays a cold page cache; the later ones do not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

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


ROOT = Path(__file__).resolve().parent.parent.parent


def cold(n: int, file: str, until: str, out: str | None) -> None:
    cfg = load_config()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        for i in range(n):              # each run with a fresh, empty verdict cache: looked up and written, never a hit
            agent = cfg.agent.model_copy(update={"runs_dir": str(Path(tmp) / f"runs{i + 1}")})
            path.write_text(yaml.safe_dump(cfg.model_copy(update={"agent": agent}).model_dump(mode="json"), sort_keys=False))
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "agent.cli", "--config", str(path), "evaluate", "--until", until,
                                   "--json", file], cwd=ROOT, capture_output=True, text=True, timeout=600)
            outside = time.perf_counter() - t0
            lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode not in (0, 1) or not lines or "spans" not in lines[0]:
                sys.exit(f"run {i + 1}: exit {done.returncode}: {done.stderr.strip()[-2000:] or done.stdout[-2000:]}")
            got = lines[0]
            steps = {s["name"]: s["end"] - s["start"] for s in got["spans"] if "." not in s["name"]}
            beside = [(s["name"], s["start"], s["end"]) for s in got["spans"] if "." in s["name"]]
            other = got["wall_s"] - sum(steps.values())
            print(f"\nrun {i + 1}: {got['reason']}; wall {got['wall_s']:.2f} s to the verdict, {outside:.2f} s from outside")
            print("  steps: " + ", ".join(f"{k} {x:.2f}" for k, x in steps.items()) + f", other {other:.2f}")
            print("  beside: " + ", ".join(f"{k} {a:.2f}-{b:.2f}" for k, a, b in beside))
            runs.append({"wall_s": got["wall_s"], "outside_s": outside, "steps": steps, "other_s": other,
                         "spans": got["spans"], "stages": got["stages"]})
    names = list(dict.fromkeys(k for r in runs for k in r["steps"]))
    med = {k: statistics.median(r["steps"].get(k, 0.0) for r in runs) for k in names}
    print(f"\nmedian of {n}: wall {statistics.median(r['wall_s'] for r in runs):.2f} s to the verdict, "
          f"{statistics.median(r['outside_s'] for r in runs):.2f} s from outside; "
          + ", ".join(f"{k} {x:.2f}" for k, x in med.items())
          + f", other {statistics.median(r['other_s'] for r in runs):.2f}")
    if out:
        Path(out).write_text(json.dumps({"file": file, "until": until, "runs": runs}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--cold", type=int, default=0, metavar="N", help="N cold `kevo-agent evaluate` processes instead")
    ap.add_argument("--file", default="knowledge/attention/decode_paged_splitkv.py")
    ap.add_argument("--until", default="microbench")
    args = ap.parse_args()
    if args.cold:
        return cold(args.cold, args.file, args.until, args.json)
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
