"""Benchmark (not a test): the parity stage's cost on the reference kernels, three times each.

    python tests/bench/parity_cost.py [--odds TWINS,LAYERS ...]   # each pair of stages.parity.twins and .layers in
                                                                  # turn (default: config's)

One warm worker pool; a first evaluation warms it (first compiles, the served model's q/k/v
capture); then each reference kernel is judged through parity three times, and the stage's wall
time and CPU time (its processes', cpu_s) are printed, min and median, with the load average.
"""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import candidates as C  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.evaluate import evaluate, open_pool  # noqa: E402


def main() -> None:
    base = load_config()
    odds = [tuple(float(x) for x in pair.split(",")) for pair in sys.argv[sys.argv.index("--odds") + 1:]] \
        if "--odds" in sys.argv else [None]
    cfg = base
    with open_pool(base, "attention") as pool:
        evaluate(C.REF_DECODE, "attention", base, pool, until="parity")
        for pair, (name, source) in ((t, k) for t in odds for k in (("decode_paged_splitkv", C.REF_DECODE),
                                                                    ("prefill_causal_tiled", C.REF_PREFILL))):
            if pair is not None:
                parity = base.stages.parity.model_copy(update={"twins": pair[0], "layers": pair[1]})
                cfg = base.model_copy(update={"stages": base.stages.model_copy(update={"parity": parity})})
            wall, cpu, checks = [], [], 0
            for _ in range(3):
                parity = evaluate(source, "attention", cfg, pool, until="parity").stages[-1]
                assert parity.status == "passed", parity.reason
                wall.append(parity.seconds)
                cpu.append(parity.metrics.get("cpu_s", 0.0))
                checks = int(parity.metrics["checks"])
            p = cfg.stages.parity
            print(f"{name} ({pool.device}, twins {p.twins}, layers {p.layers}): {checks} checks; parity wall s min "
                  f"{min(wall):.2f} median {statistics.median(wall):.2f}; cpu_s min {min(cpu):.2f} median "
                  f"{statistics.median(cpu):.2f}; load average {os.getloadavg()[0]:.2f}", flush=True)

if __name__ == "__main__":
    main()
