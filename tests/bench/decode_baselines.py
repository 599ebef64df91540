"""Benchmark (not a test): torch-only paged decode, written three ways, to choose the baseline (issue 3).

    python tests/bench/decode_baselines.py [--profile docs/data/profile-h200-qwen3-0.6b-long-10s.json] [--json PATH]
    python tests/bench/decode_baselines.py --cpu       # correctness only: float32, small shapes, no timing

On the H200 (2026-11-30) the baseline in harness/targets/attention.py read 0.13-0.23 TB/s on the served
shapes, 13x under cuDNN SDPA on the same bytes, so speedups over it overstate. Each way here is checked
against the float64 reference on every served case (NaN in every unused cache slot, as the evaluator
draws them), then timed two ways:
  - device: one call captured in a CUDA graph, replayed between L2 flushes, CUDA events (ms);
  - host: the eager call and a synchronize, by the host's clock (ms): what an eager engine pays.
Ways:
  - masked: gather the padded block table, zero the garbage with masked_fill, one masked SDPA call;
  - clamped: gather token by token with past-the-end positions pointed at the sequence's first
    token (finite, then masked), so no masked_fill pass; one masked SDPA call;
  - per_sequence: one unmasked SDPA call per sequence on exactly its tokens (the host knows the
    lengths, as a serving engine does), so SDPA's flash or cuDNN kernels may apply.
The ways live in harness/targets/attention_baselines.py (DECODE_BASELINES); the fastest correct one over the
served mix is chosen in config.yaml as targets.attention.decode_baseline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.config import load_config  # noqa: E402
from harness.evaluate import device_shapes  # noqa: E402
from harness.targets.attention import DECODE_BASELINES, decode_cost, decode_inputs, decode_reference  # noqa: E402
from harness.targets import TARGETS  # noqa: E402


WAYS = DECODE_BASELINES


def device_ms(fn, flush: torch.Tensor, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                    # warm: allocations, kernel selection
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_ms(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="docs/data/profile-h200-qwen3-0.6b-long-10s.json")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config()
    device = torch.device("cpu" if args.cpu else "cuda")
    if not args.cpu:
        cfg = cfg.model_copy(update={"served": cfg.served.model_copy(update={"recorded_shapes": args.profile})})
    shapes = device_shapes(cfg, "attention", device)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    cases = [c for c in TARGETS["attention"].served_cases(shapes) if c.op == "decode"]
    flush = None if args.cpu else torch.empty(256 << 20, dtype=torch.uint8, device=device)
    rows, mix, mix_host = [], dict.fromkeys(WAYS, 0.0), dict.fromkeys(WAYS, 0.0)
    for case in cases:
        x = decode_inputs(case, "normal", 7, device, dtype)
        args_ = (x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], x["sm_scale"])
        ref = decode_reference(*args_)
        lengths = x["seq_lens"].tolist()
        nbytes = decode_cost(x).bytes
        row = {"case": case.label, "weight": case.weight}
        for name, way in WAYS.items():
            fn = (lambda w=way, a=args_, n=lengths: w(*a, lengths=n))
            got = fn()
            finite = bool(torch.isfinite(got).all())
            row[f"{name}_max_abs_err"] = (got.double() - ref).abs().max().item() if finite else float("nan")
            if not args.cpu:
                d = device_ms(fn, flush)
                row.update({f"{name}_device_ms": d, f"{name}_TBps": nbytes / d / 1e9, f"{name}_host_ms": host_ms(fn)})
                mix[name] += case.weight * d
                mix_host[name] += case.weight * row[f"{name}_host_ms"]
        rows.append(row)
        print(json.dumps(row))
    if not args.cpu:
        summary = {name: round(ms, 4) for name, ms in mix.items()}
        host = {name: round(ms, 4) for name, ms in mix_host.items()}
        print(json.dumps({"served_mix_device_ms": summary, "fastest_device": min(summary, key=summary.get),
                          "served_mix_host_ms": host, "fastest_host": min(host, key=host.get)}))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
