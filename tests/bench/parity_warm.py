"""Benchmark (not a test): the parity stage's time with and without compiling every shape class at once first.

    python tests/bench/parity_warm.py [--rounds 3] [--threads 8] [FILE ...]

Each kernel file (default: the reference decode and prefill kernels) is judged through parity `rounds`
times with `stages.parity.warm_threads.<device>` set to `--threads` and as many times with 0 (no warm),
alternating, in one worker pool. Every evaluation has a fresh worker, so a fresh Triton cache (its private
/kevo): each parity compiles the kernel from nothing, as a new candidate's does. Printed per evaluation:
parity's wall time, the warm's share (warm_s: the request, worker_warm_compiles_s: the worker waiting for
the compiles after its calls) and the checks' first calls (worker_first_calls_s, where the JIT compiles
what the warm did not); then the medians, and the load average. GPU: on a CPU the interpreter compiles
nothing and the warm is off by default.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.config import DEFAULT_CONFIG, Config  # noqa: E402
from harness.evaluate import evaluate, open_pool  # noqa: E402

DEFAULT_FILES = ["knowledge/attention/decode_paged_splitkv.py", "knowledge/attention/prefill_causal_tiled.py"]


def config(device: str, threads: int) -> Config:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["stages"]["parity"]["warm_threads"][device] = threads
    return Config.model_validate(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    args = ap.parse_args()
    base = config("cuda", 0)
    with open_pool(base, "attention") as pool:
        cfgs = {"warm": config(pool.device, args.threads), "no warm": config(pool.device, 0)}
        first = Path(args.files[0])
        evaluate((first if first.is_absolute() else ROOT / first).read_text(), "attention", base, pool,
                 until="parity")                                         # the pool's own first costs
        for name in args.files:
            path = Path(name) if Path(name).is_absolute() else ROOT / name
            source = path.read_text()
            seen: dict[str, list[float]] = {k: [] for k in cfgs}
            for r in range(args.rounds):
                for label, cfg in (list(cfgs.items()) if r % 2 == 0 else list(cfgs.items())[::-1]):
                    parity = evaluate(source, "attention", cfg, pool, until="parity").stages[-1]
                    if parity.status != "passed":
                        print(f"{path.name} ({label}): {parity.status}: {parity.reason[:300]}", flush=True)
                        continue
                    m = parity.metrics
                    seen[label].append(parity.seconds)
                    print(f"{path.name} round {r + 1} {label:>7}: parity {parity.seconds:6.2f} s; warm_s "
                          f"{m.get('warm_s', 0.0):5.2f} (compiles {m.get('worker_warm_compiles_s', 0.0):5.2f}, "
                          f"{m.get('warm_classes', 0):.0f} classes, {m.get('warm_failed', 0):.0f} failed); first calls "
                          f"{m.get('worker_first_calls_s', 0.0):5.2f} s; {m['checks']:.0f} checks", flush=True)
            medians = {k: statistics.median(v) for k, v in seen.items() if v}
            print(f"{path.name} ({pool.device}, {args.threads} threads): parity median "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items())
                  + f"; load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
