"""Check (not a test): one decode tile of one kv head computed from K and V copied as whole 256-byte rows, the
design `tests/bench/tma_rows.py`'s `rows3d` copy would need (issue 16), against torch on a GPU, or compiled for sm90
on a machine without one.

A page of one kv head is viewed as [16 tokens, 2 halves, 64] and lands by one TMA copy as rows 2t + h of a [2N, 64]
tile in the 128-byte swizzle wgmma reads. Then S = Q0 T^T (its even columns) + Q1 T^T (its odd columns): in the
accumulator layout a thread holds each pair, so the sum needs no data movement (reshape, split). And O_h = P'_h T,
with P'_h holding P in the columns of half h and zeros in the others (join, reshape). That is twice the products
of the split copy, on tensor cores a decode leaves mostly idle.

    python3 tests/bench/rows_tile.py             # on an sm90 GPU: max abs error against torch, two kv heads
    python3 tests/bench/rows_tile.py compile     # here: shared memory, wgmma, shuffles and shared stores in the PTX
    python3 tests/bench/rows_tile.py ir          # here: the TTGIR's layout conversions and the products
"""
from __future__ import annotations

import os
import re
import sys

import torch
import triton
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language.nvidia.hopper.mbarrier as mbarrier
import triton.experimental.gluon.language.nvidia.hopper.tma as tma
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

PAGE, KV, D = 16, 8, 128


@gluon.jit
def _tile_kernel(q_ptr, k_desc, v_desc, bt_ptr, o_ptr, head, qk_scale, BLOCK_N: gl.constexpr):
    PAGES: gl.constexpr = BLOCK_N // 16
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 2, 64], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, 2, 64], v_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, 2 * PAGES * k_desc.block_type.nbytes)
    for p in gl.static_range(PAGES):
        row = gl.load(bt_ptr + p) * 16
        tma.async_copy_global_to_shared(k_desc, [row, head * 2, 0], bar, k_smem.slice(p * 16, 16))
        tma.async_copy_global_to_shared(v_desc, [row, head * 2, 0], bar, v_smem.slice(p * 16, 16))
    mbarrier.wait(bar, 0)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 2 * BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_m = gl.arange(0, 64, layout=gl.SliceLayout(1, rows))
    offs_d = gl.arange(0, 64, layout=gl.SliceLayout(0, rows))
    q0 = gl.load(q_ptr + offs_m[:, None] * 128 + offs_d[None, :])
    q1 = gl.load(q_ptr + offs_m[:, None] * 128 + 64 + offs_d[None, :])
    q0_op = gl.convert_layout(q0, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    q1_op = gl.convert_layout(q1, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    k2 = k_smem.reshape([2 * BLOCK_N, 64])
    s0 = warpgroup_mma(q0_op, k2.permute((1, 0)), gl.zeros([64, 2 * BLOCK_N], gl.float32, s_layout), use_acc=False)
    s1 = warpgroup_mma(q1_op, k2.permute((1, 0)), gl.zeros([64, 2 * BLOCK_N], gl.float32, s_layout), use_acc=False)
    e0, _ = gl.split(gl.reshape(s0, [64, BLOCK_N, 2]))
    _, o1 = gl.split(gl.reshape(s1, [64, BLOCK_N, 2]))
    s = e0 + o1
    m = gl.max(s, 1) * qk_scale
    p = gl.exp2(s * qk_scale - m[:, None])
    lsum = gl.sum(p, 1)
    zero = gl.zeros_like(p)
    p0 = gl.reshape(gl.join(p, zero), [64, 2 * BLOCK_N]).to(gl.bfloat16)
    p1 = gl.reshape(gl.join(zero, p), [64, 2 * BLOCK_N]).to(gl.bfloat16)
    p0_op = gl.convert_layout(p0, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    p1_op = gl.convert_layout(p1, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    v2 = v_smem.reshape([2 * BLOCK_N, 64])
    a0 = warpgroup_mma(p0_op, v2, gl.zeros([64, 64], gl.float32, o_layout), use_acc=False)
    a1 = warpgroup_mma(p1_op, v2, gl.zeros([64, 64], gl.float32, o_layout), use_acc=False)
    inv = gl.convert_layout(1.0 / lsum, gl.SliceLayout(1, rows))
    a0 = gl.convert_layout(a0, rows) * inv[:, None]
    a1 = gl.convert_layout(a1, rows) * inv[:, None]
    gl.store(o_ptr + offs_m[:, None] * 128 + offs_d[None, :], a0)
    gl.store(o_ptr + offs_m[:, None] * 128 + 64 + offs_d[None, :], a1)


def desc(cache):
    view = cache.view(-1, KV * 2, D // 2)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    return TensorDescriptor(view, list(view.shape), [view.stride(0), view.stride(1), 1], [PAGE, 2, D // 2], layout)


def main(block_n=64):
    dev = torch.device("cuda")
    blocks = 64
    k = torch.randn(blocks, PAGE, KV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(64, D, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(blocks, device=dev)[: block_n // PAGE].to(torch.int32)
    o = torch.empty(64, D, device=dev, dtype=torch.float32)
    scale = D ** -0.5
    for head in (0, 5):
        _tile_kernel[(1,)](q, desc(k), desc(v), bt, o, head, scale * 1.4426950408889634, BLOCK_N=block_n,
                           num_warps=4)
        kt = k[bt.long()].reshape(-1, KV, D)[:, head].float()
        vt = v[bt.long()].reshape(-1, KV, D)[:, head].float()
        ref = torch.softmax(q.float() @ kt.T * scale, -1) @ vt
        print(f"head {head}: max abs error {(o - ref).abs().max().item():.3e}")


def _compiled(block_n):
    """The kernel compiled for sm90 with Triton's bundled tools (no GPU needed)."""
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
    d = f"tensordesc<bf16[16, 2, 64],{layout!r}>"
    fn = _tile_kernel
    sig = {"q_ptr": "*bf16", "k_desc": d, "v_desc": d, "bt_ptr": "*i32", "o_ptr": "*fp32", "head": "i32",
           "qk_scale": "fp32", "BLOCK_N": "constexpr"}
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index("BLOCK_N"),): block_n}, attrs={})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_check(block_n=64):
    """Shared memory, wgmma issued, and the PTX's shuffles and shared-memory stores (the layout conversions)."""
    k = _compiled(block_n)
    ptx = k.asm["ptx"]
    print("shared", k.metadata.shared, "wgmma", ptx.count("wgmma.mma_async"), "shfl", ptx.count("shfl.sync"),
          "st.shared", ptx.count("st.shared"), "ld.shared", ptx.count("ld.shared"))


def ir_check(block_n=64):
    """The TTGIR's layout conversions, reshapes, splits, joins and products (after the compiler's own passes)."""
    for line in _compiled(block_n).asm["ttgir"].splitlines():
        if re.search(r"convert_layout|local_alloc|split|join|reshape|warp_group_dot ", line):
            print(line.strip()[:230])


if __name__ == "__main__":
    {"compile": compile_check, "ir": ir_check}.get((sys.argv[1:] or ["run"])[0], main)()
