"""Benchmark (not a test): candidates per hour on one GPU against two (issue 6's bar: at least 1.8x).

    python tests/bench/gpu_scaling.py [--candidates 24] [--window 10] [--json PATH]
    TRITON_INTERPRET=1 python tests/bench/gpu_scaling.py --cpu      # the script itself, on CPU slots (no speed figure)
    python tests/bench/gpu_scaling.py --runs 1 --json a.json; ...; python tests/bench/gpu_scaling.py --runs 2 --json b.json
    python tests/bench/gpu_scaling.py --combine a.json b.json       # the two runs made apart, compared

Two runs of `kevo-agent run` (the real command line) on the same scripted proposals — the fake OpenAI
service of tests/bench/h200_run.py, decode knob variants of the reference kernel in a fixed order —
one with `executor.gpus: [0]` (the serial loop), one with `[0, 1]` (a slot per GPU, several candidates
in flight). Each run evaluates its own heads first; the rate counts only the candidates: from the
first claim answered to the run's end. While they run, `nvidia-smi` is sampled every 500 ms for each
GPU's busy share (a kernel running, not SM occupancy). Also printed: how long each slot held a job,
from the ledger's `Evaluated-On` trailers and the records' seconds; per stage, the mean of its time and
of every metric it records, among them the time spent waiting on the worker, the CPU its processes used
(`cpu_s`) and the thread-seconds they waited for a core (`cpu_wait_s`: where a job is slower with two
slots, this says whether CPU contention is why), and each mean with two slots over one
(`two_slots_over_one`); and each run's stage mix, since a
candidate that reaches the replay costs minutes where one rejected at microbench costs seconds: the
two rates compare only if the mixes match.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200_run import DECODE_STEPS, ROOT, Sampler, Service, launch, write_config  # noqa: E402

import candidates as C  # noqa: E402

from agent.ledger.repository import Ledger  # noqa: E402


def steps() -> list[tuple[str, str, str, float]]:
    return [("decode", C.with_knobs(C.REF_DECODE, **knobs), text, s) for knobs, text, s in DECODE_STEPS] * 20


def one_run(run_id: str, executor: dict, *, n: int, window: float, cpu: bool, sampler: Sampler) -> dict:
    shutil.rmtree(ROOT / "runs" / run_id, ignore_errors=True)
    service = Service(steps(), None)
    service.fake.__enter__()
    try:
        path = write_config(run_id, None, service.fake.openai_url, 60.0, window)
        cfg = yaml.safe_load(path.read_text())
        cfg["agent"]["ops"] = ["decode"]
        cfg["executor"].update(executor)
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")} | {"OPENAI_API_KEY": "sk-fake-local"}
        proc = launch(path, ["--target", "attention", "--provider", "openai", "--run-id", run_id,
                             "--max-candidates", str(n)], env)
        rc = proc.wait()
        t_end = time.monotonic()
    finally:
        service.fake.__exit__(None, None, None)
    history = Ledger(ROOT / "runs" / run_id).history()
    t_first = service.first_answer or t_end
    wall = t_end - t_first
    held: dict[str, float] = defaultdict(float)
    log = subprocess.run(["git", "log", "--format=%(trailers:key=Candidate,key=Evaluated-On,valueonly,separator=%x09)"],
                         cwd=ROOT / "runs" / run_id, capture_output=True, text=True).stdout
    where = dict(line.split("\t", 1) for line in log.splitlines() if "\t" in line)
    for r in history:
        held[where.get(r.id, "the loop's own pool")] += r.seconds
    stages: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in history:
        for rnd in r.rounds:
            for st in rnd.verdict.stages:
                if st.status != "skipped":
                    stages[st.name].append({"s": st.seconds} | st.metrics)
    per_stage = {name: {"n": len(rows)} | {f"mean_{k}": round(sum(row.get(k, 0.0) for row in rows) / len(rows), 3)
                                           for k in sorted(set().union(*rows))}
                 for name, rows in stages.items()}
    return {"run": run_id, "rc": rc, "executor": executor, "candidates": len(history),
            "stages": per_stage,
            "stage_mix": dict(Counter(f"{r.outcome} at {r.stage}" for r in history)),
            "candidate_wall_s": round(wall, 1), "candidates_per_hour": round(len(history) / wall * 3600, 1) if wall else None,
            "slot_busy_share": {slot: round(s / wall, 3) for slot, s in sorted(held.items())} if wall else {},
            "gpu_busy_percent": sampler.busy(t_first, t_end), "device": "cpu slots" if cpu else "cuda"}


def main() -> None:
    ap = argparse.ArgumentParser()
    # 24: at 12 (6 a slot) filling and draining the two slots cost 3-5% of the run (2026-11-30, fourth session)
    ap.add_argument("--candidates", type=int, default=24)
    ap.add_argument("--window", type=float, default=10.0, help="served.cuda.window_s for the replays")
    ap.add_argument("--cpu", action="store_true", help="one CPU slot against two (tests the script; no speed figure)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--slot-cores", default=None, choices=["blocks", "interleaved", "none"],
                    help="executor.slot_cores for both runs (default: config.yaml's)")
    ap.add_argument("--runs", default="1,2", help="which of the two runs to make now: 1, 2 or 1,2")
    ap.add_argument("--combine", nargs=2, metavar="JSON", default=None,
                    help="no run: read the two runs' --json outputs (of --runs 1 and --runs 2) and compare them")
    args = ap.parse_args()
    if args.combine:
        runs = [json.loads(Path(f).read_text())["runs"][0] for f in args.combine]
    else:
        sampler = Sampler()
        cores = {"slot_cores": args.slot_cores} if args.slot_cores else {}
        plan = {"1": ("scaling-1", ({"cpu_slots": 1} if args.cpu else {"gpus": [0]}) | cores),
                "2": ("scaling-2", ({"cpu_slots": 2} if args.cpu else {"gpus": [0, 1]}) | cores)}
        try:
            runs = [one_run(*plan[k], n=args.candidates, window=args.window, cpu=args.cpu, sampler=sampler)
                    for k in args.runs.split(",")]
        finally:
            sampler.close()
        if len(runs) == 1:
            print(json.dumps({"runs": runs}, indent=1))
            if args.json:
                Path(args.json).write_text(json.dumps({"runs": runs}, indent=1))
            return
    a, b = (r["candidates_per_hour"] for r in runs)
    growth = {name: {k: round(v / runs[0]["stages"][name][k], 3) for k, v in st.items()
                     if k != "n" and runs[0]["stages"].get(name, {}).get(k)}
              for name, st in runs[1]["stages"].items()}
    out = {"runs": runs, "ratio": round(b / a, 2) if a and b else None,
           "same_stage_mix": runs[0]["stage_mix"] == runs[1]["stage_mix"],
           "two_slots_over_one": growth}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
