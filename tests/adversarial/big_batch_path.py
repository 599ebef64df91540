"""Adversarial fixture (parity): a second, buggy path for batches larger than any the old parity ran.

Above 64 sequences on CUDA (the largest batch any stage ran) or 8 on the CPU (where the old
parity's largest decode batch was 5) it reads kv head h % kv_heads instead of h // group: the kind
of bug a second tiling for large batches brings. It passed compile, dispatch and parity on the
H200. Parity now runs the served engine's max_running and one past it (the CPU's tiny preset:
16, 17; qwen3-0.6b on CUDA: 128, 129): rejected at parity.
"""
import torch
import triton
import triton.language as tl

BLOCK_N = 32


@triton.jit
def _decode(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, scale, bt_stride,
            H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
            BLOCK_N: tl.constexpr, WRONG_HEADS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(len_ptr + b)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * H + h) * D + d).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for start in range(0, n, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        ok = t < n
        block = tl.load(bt_ptr + b * bt_stride + t // BS, mask=ok, other=0).to(tl.int64)
        kvh = h % KVH if WRONG_HEADS else h // (H // KVH)
        row = ((block * BS + t % BS) * KVH + kvh) * D
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(o_ptr + (b * H + h) * D + d, (acc / l_i).to(o_ptr.dtype.element_ty))


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    B, H, D = q.shape
    out = torch.empty_like(q)
    big = B > (64 if q.device.type == "cuda" else 8)          # the flaw: only the large-batch path is wrong
    _decode[(B, H)](q, k_cache, v_cache, block_table, seq_lens, out, sm_scale, block_table.stride(0),
                    H=H, KVH=k_cache.shape[2], D=D, BS=k_cache.shape[1], BLOCK_N=BLOCK_N, WRONG_HEADS=big)
    return out
