"""Benchmark (not a test): candidate calls that stall inside the served window, with the fixed warm-up
against the warm-up that also meets the served prompt lengths (harness/served/engine.py `warm_up`).

    python tests/bench/served_stalls.py [--window 20]

Each mode runs in a fresh process with an empty Triton cache: the 0.6B-shaped engine on CUDA with
both reference kernels (knowledge/attention/), the warm-up, then the trace's requests at their arrival
times, in this process (no HTTP). The served ops count every candidate call that holds the host over
config served.stall_ms (harness/served/ops.py; a launch is asynchronous, so such a call compiled, autotuned or waited
on the GPU), as the served server does. Prints, per mode: the warm-up's seconds, the stalled calls in
the window and their total, and the p50 / p99 / max of the time between one step's end and the next's:
that includes the engine's idle waits for arrivals, the first one among them (2.08 s into the
long-context trace), so the max is a wait, not a step, unless it is above that.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def one_mode(mode: str, window: float) -> dict:
    import torch

    from harness.config import PROJECT_ROOT, load_config
    from harness.served.engine import make_engine, run_requests, warm_up
    from harness.served.ops import AttentionOps, load_candidate
    from harness.stages.replay import served_requests
    from harness.transport import DTYPES
    cfg = load_config()
    served, section = cfg.served.cuda, cfg.targets.attention.cuda
    dec = load_candidate(ROOT / "knowledge/attention/decode_paged_splitkv.py")
    pre = load_candidate(ROOT / "knowledge/attention/prefill_causal_tiled.py")
    ops = AttentionOps(SimpleNamespace(decode=dec.decode, prefill=pre.prefill), section.dtype, stall_ms=cfg.served.stall_ms)
    engine = make_engine(cfg.served.presets[served.preset], section.block_size, DTYPES[section.dtype], torch.device("cuda"),
                         ops, init=cfg.served.random_init, top_k=cfg.served.logprobs, root=PROJECT_ROOT)
    requests = served_requests(cfg, "cuda", window)
    t = time.perf_counter()
    warm_up(engine, [len(r.prompt) for r in requests] if mode == "served" else (), served.warm_requests)  # ends with ops.reset()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t
    steps: list[float] = []
    last = [time.perf_counter()]

    def on_step(_events) -> None:
        now = time.perf_counter()
        steps.append((now - last[0]) * 1e3)
        last[0] = now

    run_requests(engine, requests, realtime=True, on_step=on_step)
    stalls = [(op, ms) for op, found in ops.stalls.items() for ms in found]
    q = statistics.quantiles(steps, n=100, method="inclusive")
    return {"mode": mode, "warm_up_s": round(warm_s, 1), "requests": len(requests), "steps": len(steps),
            "stalled_calls": len(stalls), "stalled_ms": round(sum(ms for _, ms in stalls)),
            "worst_stalls": [(n, round(ms)) for n, ms in sorted(stalls, key=lambda s: -s[1])[:5]],
            "step_ms_p50": round(q[49], 1), "step_ms_p99": round(q[98], 1), "step_ms_max": round(max(steps), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=20.0)
    ap.add_argument("--mode", choices=["fixed", "served"], default=None, help="one mode, in this process (used by the parent)")
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(one_mode(a.mode, a.window)))
        return
    for mode in ("fixed", "served"):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--window", str(a.window)],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"{mode}: exit {out.returncode}\n{out.stderr[-3000:]}")
                continue
            print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
