"""Profiling target (not a test): one call each of kevo's kernels and cuDNN SDPA on issue 16's rows, for Nsight
Compute. Every call runs twice first (compiles, cuDNN's plan), then once more between cudaProfilerStart and Stop,
in the order printed (`CALL <label>` lines), so that ncu profiles exactly those calls:

    ncu --clock-control none --profile-from-start off --target-processes all \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        --metrics sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg,dram__bytes_read.sum \
        --csv --page details --log-file ncu.csv \
        python3 tests/bench/profile_rows.py [SPEC ...] [--decode 32x4096,16x8192] [--ragged LO] [--prefill 1x8192]

SPEC as in vs_library.py (path[:KNOB=VALUE,...]); default: the GQA decode and TMA prefill families. The data are
vs_library.py's (bf16, 32 q / 8 kv heads, d 128; decode paged with block 16 and shuffled pages, cuDNN on
contiguous K/V of the same values, or of the mean length with --ragged). `--clock-control none` leaves the
clocks as the timed runs meet them (the device library's METHOD.md). --dry-run checks the script on the CPU
(Triton's interpreter, float32, tiny rows, no profiler, no cuDNN).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import vs_library as V      # sets TRITON_INTERPRET itself under --dry-run

import torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT = [str(ROOT / "knowledge" / "attention" / "decode_paged_gqa.py"),
           str(ROOT / "knowledge" / "attention" / "prefill_causal_tma.py")]


def rows(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in r.split("x")) for r in text.split(",") if r]


def calls(kernels, decode_rows, prefill_rows, ragged, gen, library: bool):
    """(label, fn) for each kernel that has the op, then the library, per row."""
    out = []
    for B, L in decode_rows:
        x = V.decode_data(B, L, max(L for _, L in decode_rows), gen, ragged)
        args = (x["q"], x["kc"], x["vc"], x["table"], x["seq_lens"], x["scale"])
        out += [(f"{label} decode {B}x{L} ragged={ragged}", lambda m=mod, a=args: m.decode(*a))
                for label, mod in kernels if hasattr(mod, "decode")]
        if library:
            out.append((f"cudnn decode {B}x{L} ragged={ragged} length={x['lib_len']}",
                        lambda lib=x["lib"], s=x["scale"]: V.cudnn_sdpa(*lib, False, s)))
    for B, N in prefill_rows:
        x = V.prefill_data(B, N, gen)
        args = (x["q"], x["k"], x["v"], x["cu"], N, x["scale"])
        out += [(f"{label} prefill {B}x{N}", lambda m=mod, a=args: m.prefill(*a))
                for label, mod in kernels if hasattr(mod, "prefill")]
        if library:
            out.append((f"cudnn prefill {B}x{N}", lambda lib=x["lib"], s=x["scale"]: V.cudnn_sdpa(*lib, True, s)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", help="kernel file[:KNOB=VALUE,...]; default: the GQA and TMA families")
    ap.add_argument("--decode", default="32x4096,16x8192", help="decode rows BxL ('' for none)")
    ap.add_argument("--prefill", default="1x8192", help="prefill rows BxN ('' for none)")
    ap.add_argument("--ragged", type=float, default=None, metavar="LO", help="decode lengths from [LO x L, L]")
    ap.add_argument("--dry-run", action="store_true", help="check the script on the CPU (no profiler, no cuDNN)")
    args = ap.parse_args(argv)
    decode_rows, prefill_rows = rows(args.decode), rows(args.prefill)
    if args.dry_run:
        V.DEV, V.DT = "cpu", torch.float32
        decode_rows, prefill_rows = [(2, 48)] if decode_rows else [], [(2, 40)] if prefill_rows else []
    elif not torch.cuda.is_available():
        print("profile_rows.py needs a CUDA GPU (or --dry-run)")
        return 0
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="profile_rows_"))
    kernels = [V.load_spec(s, tmp) for s in (args.specs or DEFAULT)]
    gen = torch.Generator(device=V.DEV).manual_seed(0)
    todo = calls(kernels, decode_rows, prefill_rows, args.ragged, gen, library=not args.dry_run)
    for _, fn in todo:
        fn()
        fn()
    V.sync()
    if not args.dry_run:
        torch.cuda.profiler.start()
    for label, fn in todo:
        print("CALL", label, flush=True)
        fn()
        V.sync()
    if not args.dry_run:
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
