"""Benchmark (not a test): the parity stage's time with and without compiling every shape class at once first,
and with and without drawing the first checks while the worker compiles.

    python tests/bench/parity_warm.py [--rounds 3] [--threads 8] [FILE ...]

Each kernel file (default: the reference decode and prefill kernels) is judged through parity `rounds`
times in each of three ways, in rotating order, in one worker pool: "overlap", the warm with
`stages.parity.warm_threads.<device>` set to `--threads` and the first checks drawn meanwhile (as
evaluated); "warm only", the same warm with nothing drawn before its reply (the draws' memory bound,
harness/stages/parity.py `_ahead_bytes`, set to 0 in this process); "no warm", warm_threads 0. Every
evaluation has a fresh worker, so a fresh Triton cache (its private /kevo): each parity compiles the kernel
from nothing, as a new candidate's does. Printed per evaluation: parity's wall time, the warm's share (warm_s:
from the request to its reply read, worker_warm_inputs_s: the worker making its calls' unfilled inputs,
worker_warm_compiles_s: the worker waiting for the compiles after its calls), the draws (draw_s: all of parity's, of them draw_during_warm_s before the warm's reply was read, and
how many checks) and the checks' first calls (worker_first_calls_s, where the JIT compiles what the warm
did not); then the medians, and the load average. GPU: on a CPU the interpreter compiles nothing and the warm
is off by default.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.config import DEFAULT_CONFIG, Config  # noqa: E402
from harness.evaluate import evaluate, open_pool  # noqa: E402
from harness.stages import parity as parity_module  # noqa: E402

DEFAULT_FILES = ["knowledge/attention/decode_paged_splitkv.py", "knowledge/attention/prefill_causal_tiled.py"]


def config(device: str, threads: int) -> Config:
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["stages"]["parity"]["warm_threads"][device] = threads
    return Config.model_validate(raw)


@contextlib.contextmanager
def drawn_ahead(on: bool):
    """Without `on`, parity draws nothing before the warm's reply is read (its memory bound 0, on either device)."""
    saved = parity_module.AHEAD_SHARE, parity_module.AHEAD_HOST_BYTES
    if not on:
        parity_module.AHEAD_SHARE, parity_module.AHEAD_HOST_BYTES = 0.0, 0
    try:
        yield
    finally:
        parity_module.AHEAD_SHARE, parity_module.AHEAD_HOST_BYTES = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    args = ap.parse_args()
    base = config("cuda", 0)
    with open_pool(base, "attention") as pool:
        warm, cold = config(pool.device, args.threads), config(pool.device, 0)
        arms = {"overlap": (warm, True), "warm only": (warm, False), "no warm": (cold, True)}
        first = Path(args.files[0])
        evaluate((first if first.is_absolute() else ROOT / first).read_text(), "attention", base, pool,
                 until="parity")                                         # the pool's own first costs
        for name in args.files:
            path = Path(name) if Path(name).is_absolute() else ROOT / name
            source = path.read_text()
            seen: dict[str, list[float]] = {k: [] for k in arms}
            for r in range(args.rounds):
                order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
                for label in order:
                    cfg, ahead = arms[label]
                    with drawn_ahead(ahead):
                        parity = evaluate(source, "attention", cfg, pool, until="parity").stages[-1]
                    if parity.status != "passed":
                        print(f"{path.name} ({label}): {parity.status}: {parity.reason[:300]}", flush=True)
                        continue
                    m = parity.metrics
                    seen[label].append(parity.seconds)
                    print(f"{path.name} round {r + 1} {label:>9}: parity {parity.seconds:6.2f} s; warm_s "
                          f"{m.get('warm_s', 0.0):5.2f} (inputs {m.get('worker_warm_inputs_s', 0.0):5.2f}, compiles "
                          f"{m.get('worker_warm_compiles_s', 0.0):5.2f}, "
                          f"{m.get('warm_classes', 0):.0f} classes, {m.get('warm_failed', 0):.0f} failed); draws "
                          f"{m.get('draw_s', 0.0):5.2f} s, {m.get('draw_during_warm_s', 0.0):5.2f} s of them during the "
                          f"warm ({m.get('drawn_during_warm', 0):.0f} checks); first calls "
                          f"{m.get('worker_first_calls_s', 0.0):5.2f} s; {m['checks']:.0f} checks", flush=True)
            medians = {k: statistics.median(v) for k, v in seen.items() if v}
            print(f"{path.name} ({pool.device}, {args.threads} threads): parity median "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in medians.items())
                  + f"; load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
