"""Benchmark (not a test): the served step with decode from CUDA graphs against the eager engine
(harness/served/graphs.py; config `served.cuda_graphs`).

    python tests/bench/served_graphs.py [--window 5] [--modes eager,graphs]

Each mode (eager, graphs) runs in a fresh process, on the 0.6B-shaped preset in bf16, in this process
(no HTTP), and prints one JSON line:
- the served profile (harness/profile.py) of the torch baseline over `--window` seconds of the
  long-context trace: the idle share (launch and host gaps: the figure CUDA graphs should cut, from
  51-65% eager toward under 15%), the attention decode share f, the mean step, the unattributed share,
  and how the graphs fared (captured, replayed, capture seconds, or why they were off);
- the decode-only step time (median wall time of 20 steps, each ending in the engine's device-to-host
  read of the sampled tokens) at batch 4 x 2048 tokens and batch 16 x 8192 tokens, for the torch
  baseline decode and the reference decode kernel (knowledge/attention/decode_paged_splitkv.py); here
  the engine captures batch buckets 4 and 16 only, at the widths these contexts need.
About 90 s a mode on an H200 (estimated), most of it the profile's drain of long outputs (the window's
requests run to their end) and the warm-ups; `--modes graphs` runs one.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ((4, 2048), (16, 8192))
STEPS = 20


def decode_step_ms(engine, batch: int, context: int) -> tuple[float, int]:
    """Median wall ms of a decode-only step with `batch` sequences of `context` tokens; and how many of
    the timed steps were graph replays."""
    from harness.served.engine import Request
    vocab = engine.model.p.vocab
    for i in range(batch):
        engine.add(Request(f"t{i}", [(7 * i + 3 * j + 1) % vocab for j in range(context)], STEPS + 5))
    while engine.waiting or any(not s.generated for s in engine.running):     # admitted and prefilled
        engine.step()
    before = engine.graphs.replays if engine.graphs is not None else 0
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    replays = (engine.graphs.replays if engine.graphs is not None else 0) - before
    while engine.has_work():
        engine.step()
    return statistics.median(times), replays


def one_mode(mode: str, window: float) -> dict:
    import torch

    from conftest import config_with
    from harness.config import PROJECT_ROOT
    from harness.profile import profile_served
    from harness.served.engine import make_engine, warm_up
    from harness.served.limits import GraphPlan
    from harness.served.ops import AttentionOps, load_candidate
    from harness.transport import DTYPES
    cfg = config_with(**{"served.cuda_graphs.enabled": mode == "graphs"})
    t0 = time.perf_counter()
    report = profile_served(cfg, "attention", device=torch.device("cuda"), window_s=window)
    b = report["buckets"]
    out = {"mode": mode, "profile_s": round(time.perf_counter() - t0, 1), "window_s": window,
           "steps_profiled": report["steps_profiled"], "step_ms_mean": round(report["step_ms_mean"], 2),
           "idle_share": round(b["idle"]["share"], 4), "decode_share": round(b["attention_decode"]["share"], 4),
           "gemm_share": round(b["gemm"]["share"], 4), "unattributed_share": round(report["unattributed_share"], 4),
           "kernels_traced_by": report["kernels_traced_by"], "graphs": report["cuda_graphs"]}
    del report
    served, section = cfg.served.cuda, cfg.targets.attention.cuda
    ref = load_candidate(ROOT / "knowledge/attention/decode_paged_splitkv.py").decode
    for name, decode in (("baseline", None), ("reference", ref)):
        gc.collect()
        torch.cuda.empty_cache()
        ops = AttentionOps(None if decode is None else SimpleNamespace(decode=decode), section.dtype)
        plan = GraphPlan(mode == "graphs", tuple(b for b, _ in SHAPES), min(c for _, c in SHAPES), max(c for _, c in SHAPES) + STEPS + 8)
        engine = make_engine(cfg.served.presets[served.preset], section.block_size, DTYPES[section.dtype],
                             torch.device("cuda"), ops, init=cfg.served.random_init, top_k=cfg.served.logprobs,
                             root=PROJECT_ROOT, graphs=plan)
        t = time.perf_counter()
        warm_up(engine)
        out[f"{name}_warm_up_s"] = round(time.perf_counter() - t, 1)
        if engine.graphs.reason and mode == "graphs":
            out[f"{name}_graphs"] = engine.graphs.reason
        for batch, context in SHAPES:
            ms, replays = decode_step_ms(engine, batch, context)
            out[f"{name}_decode_ms_{batch}x{context}"] = round(ms, 3)
            out[f"{name}_replays_{batch}x{context}"] = replays
        del engine
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--modes", default="eager,graphs", help="the modes to run, each in a fresh process")
    ap.add_argument("--mode", choices=["eager", "graphs"], default=None, help="one mode, in this process (used by the parent)")
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(one_mode(a.mode, a.window)))
        return
    for mode in a.modes.split(","):
        t = time.perf_counter()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--window", str(a.window)], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        if res.returncode:
            print(f"{mode}: exit {res.returncode} after {time.perf_counter() - t:.0f} s\n{res.stderr[-3000:]}")
            continue
        print(res.stdout.strip().splitlines()[-1])
        print(f"# {mode}: {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
