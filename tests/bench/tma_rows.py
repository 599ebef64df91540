"""Bench (not a test): how fast a loader warp streams a paged KV cache into shared memory by TMA, a page a copy,
with the copy's shape the only thing that changes (issue 16: what bounds the Gluon decode).

The Gluon decode (knowledge/attention/decode_gluon_sm90.py) copies each page of one kv head, 16 rows of 256 bytes
2 KB apart, into a shared layout with the 128-byte swizzle that wgmma reads; TMA cannot swizzle past 128 bytes, so
each copy is two messages, each reading half of every row. Under ncu the decode streamed at 90% of DRAM's peak
against cuDNN's 91-92%. This bench takes the consumer's compute away and keeps only the stream: a persistent
program an SM, a one-warp loader filling a ring of NUM_STAGES stages of BLOCK_N tokens (K and V), a consumer
warpgroup that only waits for each stage and releases it. Four copy shapes:

    split    [16, 128] into the 128-byte swizzle: two messages a page (what the decode does)
    rows3d   the cache seen as [rows, 2, 64], box [16, 2, 64], 128-byte swizzle: one message a page, whole rows
             (a row's halves side by side: a [2 x tokens, 64] tile, read with twice the products)
    flat     [16, 128] unswizzled: one message a page, whole rows, no swizzle (wgmma cannot read it either)
    halves   the cache seen as [2 halves, rows, 64] (strides out of order), box [2, 16, 64]: one message a page,
             the same shared layout and DRAM order as `split` (does the count of messages matter?)

If `rows3d` or `flat` streams faster than `split`, whole-row copies can pay; if not, the copy's shape does not
bound it. (2026-12-07, H100: the four streamed within 0.5% of each other, and a whole-rows decode, WHOLE_ROWS in
commit e9007f8, was slower than the defaults on every row; it was taken out: docs/BENCHMARKS.md.) Printed per
row: the bytes a call reads over the median time (do_bench), and that over a device-to-device copy of the cache
in the same process; beside them cuDNN SDPA's decode on the same shape (contiguous K and V, 32 query heads) and
the catalog's Gluon decode (knowledge/attention/decode_gluon_sm90.py, its defaults, on the same shuffled pages),
each one's bytes of K and V over its median time: the decode near `split`'s rate means the stream, not its
consumer, bounds it.

    python3 tests/bench/tma_rows.py [--rows 32x4096,16x8192,...] [--stages 3] [--block-n 64]
Needs an sm90 GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib

import torch
import torch.nn.functional as F
import triton
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language.nvidia.hopper.mbarrier as mbarrier
import triton.experimental.gluon.language.nvidia.hopper.tma as tma
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from torch.nn.attention import SDPBackend, sdpa_kernel

PAGE, KV_HEADS, HEAD_DIM = 16, 8, 128
GLUON_DECODE = pathlib.Path(__file__).resolve().parents[2] / "knowledge" / "attention" / "decode_gluon_sm90.py"
MODES = ("split", "rows3d", "flat", "halves")
_PAGE, _KV_HEADS, _HALF = gl.constexpr(PAGE), gl.constexpr(KV_HEADS), gl.constexpr(HEAD_DIM // 2)


@gluon.jit
def _consume(k_desc, v_desc, bt_ptr, stride_btb, n_items, tiles, k_smem, v_smem, ready, empty,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ROWS3D: gl.constexpr, HALVES: gl.constexpr):
    slot = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        for t in range(tiles):
            s = slot % STAGES
            mbarrier.wait(ready.index(s), (slot // STAGES) & 1)
            mbarrier.arrive(empty.index(s), count=1)
            slot += 1


@gluon.jit
def _load(k_desc, v_desc, bt_ptr, stride_btb, n_items, tiles, k_smem, v_smem, ready, empty,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ROWS3D: gl.constexpr, HALVES: gl.constexpr):
    PAGES: gl.constexpr = BLOCK_N // _PAGE
    offs_p = gl.arange(0, PAGES, layout=gl.BlockedLayout([1], [32], [1], [0]))
    slot = 0
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        seq = item // _KV_HEADS
        head = item % _KV_HEADS
        bt_row = bt_ptr + seq.to(gl.int64) * stride_btb
        for t in range(tiles):
            pages = gl.load(bt_row + t * PAGES + offs_p)
            s = slot % STAGES
            mbarrier.wait(empty.index(s), ((slot // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, 2 * PAGES * k_desc.block_type.nbytes)
            for p in gl.static_range(PAGES):
                row = gl.sum(gl.where(offs_p == p, pages, 0), axis=0) * _PAGE
                if ROWS3D:
                    k_dst = k_smem.index(s).slice(p * _PAGE, _PAGE)
                    v_dst = v_smem.index(s).slice(p * _PAGE, _PAGE)
                    tma.async_copy_global_to_shared(k_desc, [row, head * 2, 0], bar, k_dst)
                    tma.async_copy_global_to_shared(v_desc, [row, head * 2, 0], bar, v_dst)
                elif HALVES:
                    tma.async_copy_global_to_shared(k_desc, [head * 2, row, 0], bar,
                                                    k_smem.index(s).slice(p * _PAGE, _PAGE, dim=1))
                    tma.async_copy_global_to_shared(v_desc, [head * 2, row, 0], bar,
                                                    v_smem.index(s).slice(p * _PAGE, _PAGE, dim=1))
                else:
                    col = head * 2 * _HALF
                    tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_smem.index(s).slice(p * _PAGE, _PAGE))
                    tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_smem.index(s).slice(p * _PAGE, _PAGE))
            slot += 1


@gluon.jit
def _stream_kernel(k_desc, v_desc, bt_ptr, stride_btb, n_items, tiles, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, ROWS3D: gl.constexpr, HALVES: gl.constexpr):
    if ROWS3D:      # a stage: BLOCK_N tokens, each row's two halves side by side
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 2, _HALF], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 2, _HALF], v_desc.layout)
    elif HALVES:    # a stage: the tokens' first halves, then their second
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2, BLOCK_N, _HALF], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 2, BLOCK_N, _HALF], v_desc.layout)
    else:
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 2 * _HALF], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 2 * _HALF], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consume, (k_desc, v_desc, bt_ptr, stride_btb, n_items, tiles, k_smem, v_smem, ready, empty, BLOCK_N,
                    STAGES, ROWS3D, HALVES)),
        (_load, (k_desc, v_desc, bt_ptr, stride_btb, n_items, tiles, k_smem, v_smem, ready, empty, BLOCK_N,
                 STAGES, ROWS3D, HALVES)),
    ], [1], [24])


def descriptors(cache, mode, block_n):
    """The K or V cache's descriptor for `mode`: a page a copy, into a ring stage of block_n tokens."""
    blocks = cache.shape[0]
    rows = cache.view(blocks * PAGE, KV_HEADS * HEAD_DIM)
    if mode == "rows3d":
        view = rows.view(blocks * PAGE, KV_HEADS * 2, HEAD_DIM // 2)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        return TensorDescriptor(view, list(view.shape), [view.stride(0), view.stride(1), 1], [PAGE, 2, HEAD_DIM // 2],
                                layout)
    if mode == "halves":
        view = rows.view(blocks * PAGE, KV_HEADS * 2, HEAD_DIM // 2).permute(1, 0, 2)
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [2, PAGE, HEAD_DIM // 2], layout)
    layout = (gl.NVMMASharedLayout.get_default_for([block_n, HEAD_DIM], gl.bfloat16) if mode == "split"
              else gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
    return TensorDescriptor(rows, list(rows.shape), [rows.stride(0), 1], [PAGE, HEAD_DIM], layout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32x4096,64x4096,128x1024,8x32768,16x8192")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name(dev)}; {sms} programs; {args.stages} stages of {args.block_n} tokens; "
          f"page {PAGE}, {KV_HEADS} kv heads, d {HEAD_DIM}, bf16; shuffled pages")
    spec = importlib.util.spec_from_file_location("decode_gluon_sm90", GLUON_DECODE)
    gluon_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gluon_decode)
    print(f"{'batch x context':>16} {'copy TB/s':>10} {'cuDNN':>16} {'Gluon decode':>16} "
          + " ".join(f"{m:>16}" for m in MODES))
    for shape in args.rows.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        per_seq = context // PAGE
        blocks = batch * per_seq
        k = torch.randn(blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        bt = torch.randperm(blocks, generator=gen).view(batch, per_seq).to(torch.int32).to(dev)
        nbytes = 2 * k.numel() * k.element_size()
        copy_ms = triton.testing.do_bench(lambda: k.clone(), warmup=25, rep=200)
        copy = nbytes / copy_ms / 1e9          # one cache read and written: the bytes the stream reads of two
        q = torch.randn(batch, 4 * KV_HEADS, 1, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        kc, vc = (x.view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous() for x in (k, v))

        def library():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
        lib = nbytes / triton.testing.do_bench(library, warmup=25, rep=200) / 1e9
        del kc, vc
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        ours = nbytes / triton.testing.do_bench(
            lambda: gluon_decode.decode(q.view(batch, 4 * KV_HEADS, HEAD_DIM), k, v, bt, lens, HEAD_DIM ** -0.5),
            warmup=25, rep=200) / 1e9
        line = f"{shape:>16} {copy:10.2f}  {lib:7.2f} ({lib / copy:5.3f})  {ours:7.2f} ({ours / copy:5.3f})"
        for mode in MODES:
            kd, vd = descriptors(k, mode, args.block_n), descriptors(v, mode, args.block_n)
            grid = (min(sms, batch * KV_HEADS),)

            def call():
                _stream_kernel[grid](kd, vd, bt, bt.stride(0), batch * KV_HEADS, context // args.block_n,
                                     BLOCK_N=args.block_n, STAGES=args.stages, ROWS3D=mode == "rows3d",
                                     HALVES=mode == "halves", num_warps=4)
            try:
                ms = triton.testing.do_bench(call, warmup=25, rep=200)
            except Exception as e:              # a shape the driver's tensor map refuses: say so, go on
                print(f"{mode}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                line += f" {'failed':>16}"
                continue
            tbs = nbytes / ms / 1e9
            line += f" {tbs:7.2f} ({tbs / copy:5.3f})"
        print(line, flush=True)
        del k, v


if __name__ == "__main__":
    main()
