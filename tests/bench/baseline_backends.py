"""Benchmark (not a test): the torch prefill baseline at the served batch-4 case, by SDPA backend, timed as the worker
times it.

    python tests/bench/baseline_backends.py [--draws 3] [--seed 5] [--quick]

In run s62 (docs/BENCHMARKS.md, sixty-second session) the worker read this case's baseline (`prefill_baseline`: one
causal SDPA call per sequence) at 2.0-2.2x the evaluator's own timing of it, three tries in a row for one candidate.
Here, in one plain process, for `--draws` draws of four lengths in 512..2048 (16 query / 8 KV heads, head_dim 128,
bf16): the CUDA kernels SDPA launches by default, then the median per-call time by the worker's protocol (the L2
flushed, a spin kernel covering the launch, CUDA events; harness/worker_timing.py `timed`) and the host's time to
launch a call, with SDPA's default choice and with each backend forced; with two Python threads spinning beside the
calls (the GIL); and with half the spin cover. `--quick`: the default choice only. GPU only.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.targets.attention_baselines import prefill_baseline  # noqa: E402

COVER = 2_000_000        # config.yaml stages.microbench.cover_cycles
FLUSH_BYTES = 256 << 20  # stages.microbench.l2_flush_bytes


def inputs(lengths: list[int], device: str = "cuda") -> dict:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, k, v = (torch.randn(bounds[-1], heads, 128, device=device, dtype=torch.bfloat16) for heads in (16, 8, 8))
    return dict(q=q, k=k, v=v, cu_seqlens=torch.tensor(bounds, device=device, dtype=torch.int32),
                max_seqlen=max(lengths), sm_scale=128 ** -0.5, bounds=bounds)


def timed(fn, flush: torch.Tensor, reps: int = 30, cover: int = COVER) -> tuple[float, float, float]:
    """Median device ms a call, median host ms to launch it, and the slowest call's device ms."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    device_ms, host_ms = [], []
    for i in range(reps + 3):
        flush.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(cover)
        ev[0].record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        ev[1].record()
        torch.cuda.synchronize()
        if i >= 3:
            device_ms.append(ev[0].elapsed_time(ev[1]))
            host_ms.append(1e3 * host)
    return statistics.median(device_ms), statistics.median(host_ms), max(device_ms)


def kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in p.events() if e.device_type.name == "CUDA"})


def line(what: str, figures: tuple[float, float, float]) -> str:
    return f"  {what:<18} {figures[0]:.4f} ms a call (host {figures[1]:.3f} ms, slowest {figures[2]:.4f} ms)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("baseline_backends.py: needs a CUDA device")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    rng = random.Random(args.seed)
    for _ in range(args.draws):
        lengths = [rng.randint(512, 2048) for _ in range(4)]
        a = inputs(lengths)
        call = lambda: prefill_baseline(**a)   # noqa: E731
        call()
        torch.cuda.synchronize()
        print(f"lengths {lengths}; SDPA's default launches: {kernels(call)}")
        print(line("default", timed(call, flush)))
        if args.quick:
            continue
        for name, backend in (("cuDNN only", SDPBackend.CUDNN_ATTENTION), ("flash only", SDPBackend.FLASH_ATTENTION),
                              ("efficient only", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    call()
                    print(line(name, timed(call, flush)))
            except RuntimeError as e:
                print(f"  {name:<18} not run: {str(e)[:100]}")
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                pass
        spinners = [threading.Thread(target=spin) for _ in range(2)]
        for t in spinners:
            t.start()
        try:
            print(line("two GIL spinners", timed(call, flush)))
        finally:
            stop.set()
            for t in spinners:
                t.join()
        print(line("half the cover", timed(call, flush, cover=COVER // 2)))


if __name__ == "__main__":
    main()
