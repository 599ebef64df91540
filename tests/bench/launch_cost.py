"""Benchmark (not a test): the host's cost of one prefill call — what an eager served step pays in Python and
launches per layer, beside the kernel's device time.

    python tests/bench/launch_cost.py [SPEC ...] [--rows 1x1024,4x2048] [--calls 200] [--rounds 7] [--profile]
    SPEC = path/to/kernel.py[:KNOB=VALUE,...]   (as tests/bench/vs_library.py; default: the prefill families)

For each row (bf16, 32 query / 8 kv heads, head_dim 128, causal, equal lengths) and each kernel, and for cuDNN
SDPA on the same data: the GPU is first held by a spin kernel long enough to queue every call, then `--calls` calls
are made back to back and timed on the host (perf_counter; nothing waits on the GPU, so this is the host's own
time: the Python, argument binding, descriptors, the driver's launch). That is taken in `--rounds` rounds, the
implementations in turn, and printed as the median and the range: one pass on an H100 read 77 and 131 us for
the same kernel's calls at two rows. Beside it, the device time of one call (events, median of 20, the calls
queued behind a spin so that the host's time stays outside them). A call's host time above its device time is
what an eager engine with no other work queued would wait on it. `--profile` prints cProfile's top functions of
the calls for each kevo kernel.

Prints numbers; asserts nothing. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import vs_library  # noqa: E402  (its kernel loading, data and cuDNN call)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_SPECS = [str(ROOT / "knowledge" / "attention" / name)
                 for name in ("prefill_causal_tiled.py", "prefill_causal_tma.py", "prefill_gluon_sm90.py")]


def host_us(call, calls: int) -> float:
    """Host microseconds a call, the GPU held busy meanwhile so that no call waits on it."""
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))          # ~0.2 s of spinning at H100/H200 clocks: longer than the calls take to queue
    t = time.perf_counter()
    for _ in range(calls):
        call()
    spent = time.perf_counter() - t
    torch.cuda.synchronize()
    return spent / calls * 1e6


def device_us(call, reps: int = 20) -> float:
    """The GPU's microseconds for a call (median): the calls and their events are queued behind a spin kernel, so
    each call's kernels run back to back between its events, the host's time outside them."""
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))          # ~0.1 s: longer than the host takes to queue the calls
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs) * 1e3


def profile(call, calls: int, top: int = 14) -> str:
    prof = cProfile.Profile()
    torch.cuda._sleep(int(4e8))
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", help="kernel file[:KNOB=VALUE,...]; default: the prefill families")
    ap.add_argument("--rows", default="1x1024,4x2048", help="comma list of BxN")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7, help="host timings of each implementation, taken in turn")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_cost.py needs a CUDA GPU")
        return 0
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="launch_cost_"))
    kernels = [vs_library.load_spec(s, tmp) for s in (args.specs or DEFAULT_SPECS)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  calls {args.calls}")
    for row in args.rows.split(","):
        B, N = (int(x) for x in row.split("x"))
        data = vs_library.prefill_data(B, N, gen)
        q, k, v, cu, scale = data["q"], data["k"], data["v"], data["cu"], data["scale"]
        calls = {"cudnn": lambda: vs_library.cudnn_sdpa(*data["lib"], True, scale)}
        for label, module in kernels:
            calls[label] = (lambda m: lambda: m.prefill(q, k, v, cu, N, scale))(module)
        print(f"\n{B} x {N}: host us/call, median of {args.rounds} rounds (min-max) | device us/call")
        host = {label: [] for label in calls}
        for _ in range(args.rounds):           # the implementations in turn each round: drift reaches all alike
            for label, call in list(calls.items()):
                try:
                    host[label].append(host_us(call, args.calls))
                except Exception as exc:      # a kernel that cannot run here: its row says why, the others go on
                    print(f"  {label:60s} error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    del calls[label], host[label]
        for label, call in calls.items():
            h = host[label]
            print(f"  {label:60s} {statistics.median(h):8.1f} ({min(h):6.1f}-{max(h):6.1f}) | {device_us(call):8.1f}")
        if args.profile:
            for label, module in kernels:
                print(f"\n--- cProfile, {label}, {B} x {N}, {args.calls} calls")
                print(profile(calls[label], args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
