"""Correctness soak (not a test; it asserts nothing): prefill kernels called again and again on the same inputs,
the allocator poisoned with NaN before every call, each output held to a float32 reference and to the kernel's
first output on those inputs, bit for bit. It looks for what parity's few repeats can miss: a fault that comes and
goes (a race, a work item a persistent kernel skips now and then). `--procs N` runs N copies at once on one GPU,
as a replay's three servers share it.

    python tests/bench/repeat_check.py SPEC [SPEC ...] [--reps 30] [--heads 16,32] [--procs 1]
    SPEC as in vs_library.py: path/to/kernel.py[:KNOB=VALUE,...]

Shapes: batches holding a sequence of 3,968 tokens (the length a replay's spot check found wrong on 2026-12-06),
8 x 4k, 4 x 2k, 1 x 8k and 12 batches drawn with seed 7 (1-6 sequences of 1-4,096 tokens); bf16, head_dim 128,
8 KV heads. A line per shape and kernel: the calls wrong (some row's max abs error over 0.05 against the float32
reference; NaN counts as wrong), the calls with NaN (rows left unwritten), the calls unlike the first, the worst
error, the first wrong calls' numbers (0: the first call on that shape).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import random
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vs_library import load_spec  # noqa: E402

WRONG = 0.05         # a row's max abs error against float32 that counts a call wrong (bf16 outputs: ~0.01)


def shapes() -> list[list[int]]:
    rng = random.Random(7)
    return ([[1024, 3968, 512], [3968], [2048, 3968, 1536], [100, 3968, 4000], [3968] * 3, [8192], [4096] * 8,
             [2048] * 4] + [[rng.randint(1, 4096) for _ in range(rng.randint(1, 6))] for _ in range(12)])


def reference(q, k, v, cu):
    """float32, each sequence alone; K and V repeated over their query heads, so that on a GPU torch takes its
    memory-efficient kernel and not the one that holds every score (about 30 GB at 32 heads x 8k, which left three
    copies short of an 80 GB card's memory on 2026-12-06)."""
    out, group = [], q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[s:e].float().transpose(0, 1).repeat_interleave(n, 0)[None]
                      for x, n in ((q, 1), (k, group), (v, group)))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
    return torch.cat(out)


def soak(kernels, lens: list[int], hq: int, reps: int) -> str:
    g = torch.Generator(device="cuda").manual_seed(sum(lens) + hq)
    q, k, v = (torch.randn(sum(lens), h, 128, device="cuda", generator=g).to(torch.bfloat16) for h in (hq, 8, 8))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    ref = reference(q, k, v, cu)
    line = f"{hq}/8 {lens}:"
    for label, mod in kernels:
        first, wrong, nan, unlike, worst = None, [], 0, 0, 0.0
        for r in range(reps):
            poison = torch.full((q.numel() + 4096,), float("nan"), dtype=q.dtype, device="cuda")
            del poison                                  # what the output's allocation gets next
            out = mod.prefill(q, k, v, cu, max(lens), 128 ** -0.5)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().amax(dim=(1, 2)).nan_to_num(float("inf"))
            nan += bool(out.isnan().any())
            worst = max(worst, float(err.max()))
            if bool((err > WRONG).any()):
                wrong.append(r)
            if first is None:
                first = out.clone()
            elif not torch.equal(first.nan_to_num(), out.nan_to_num()) or not torch.equal(first.isnan(), out.isnan()):
                unlike += 1
        line += (f"  {label}: wrong {len(wrong)}/{reps}, NaN {nan}, unlike the first {unlike}, worst {worst:.3g}"
                 + (f", calls {wrong[:5]}" if wrong else ""))
    return line


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Call prefill kernels again and again; count wrong and varying outputs")
    ap.add_argument("specs", nargs="+", help="kernel file[:KNOB=VALUE,...]")
    ap.add_argument("--reps", type=int, default=30, help="calls a shape and kernel")
    ap.add_argument("--heads", default="16,32", help="query head counts, comma-separated (KV heads: 8)")
    ap.add_argument("--procs", type=int, default=1, help="copies run at once on the GPU")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("repeat_check: needs a CUDA GPU (the kernels it soaks are Hopper kernels)")
    if args.procs > 1:
        alone = [sys.executable, __file__, *args.specs, "--reps", str(args.reps), "--heads", args.heads]
        procs = [subprocess.Popen(alone, stdout=subprocess.PIPE, text=True) for _ in range(args.procs)]
        for i, p in enumerate(procs):
            out, _ = p.communicate()
            print("".join(f"[copy {i + 1}] {line}\n" for line in out.splitlines()) + f"[copy {i + 1}] exit {p.returncode}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        kernels = [load_spec(spec, pathlib.Path(tmp), "/".join(pathlib.Path(spec.partition(":")[0]).parts[-2:]))
                   for spec in args.specs]              # labelled by folder and file: runs' candidate.py files
        print(torch.cuda.get_device_name(), f"torch {torch.__version__}", f"pid {os.getpid()}", flush=True)
        for hq in (int(h) for h in args.heads.split(",")):
            for lens in shapes():
                print(soak(kernels, lens, hq, args.reps), flush=True)


if __name__ == "__main__":
    main()
