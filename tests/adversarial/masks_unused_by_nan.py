"""Adversarial fixture (parity): finds the unused cache slots by testing for NaN (x != x).

It reads every slot of a sequence's blocks, the tail of the last block too, and leaves out those
holding NaN instead of those at or past seq_lens. The old parity filled every unused slot with NaN,
so this passed compile, dispatch and parity on the H200; a served cache holds zeros and the stale
values of recycled blocks. Parity now fills unused slots with NaN, zeros, other sequences' stale
values or finite randoms, drawn per check: rejected at parity.
"""
import torch
import triton
import triton.language as tl

BLOCK_N = 32


@triton.jit
def _decode(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, scale, bt_stride,
            H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(len_ptr + b)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * H + h) * D + d).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    end = tl.cdiv(n, BS) * BS                          # whole blocks, the last one's tail included
    for start in range(0, end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        inside = t < end
        block = tl.load(bt_ptr + b * bt_stride + t // BS, mask=inside, other=0).to(tl.int64)
        row = ((block * BS + t % BS) * KVH + h // (H // KVH)) * D
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=inside[:, None], other=float("nan")).to(tl.float32)
        ok = tl.max((k != k).to(tl.int32), 1) == 0      # the flaw: "unused" means "holds NaN"
        k = tl.where(ok[:, None], k, 0.0)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.where(ok[:, None], v, 0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(o_ptr + (b * H + h) * D + d, (acc / l_i).to(o_ptr.dtype.element_ty))


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    B, H, D = q.shape
    out = torch.empty_like(q)
    _decode[(B, H)](q, k_cache, v_cache, block_table, seq_lens, out, sm_scale, block_table.stride(0),
                    H=H, KVH=k_cache.shape[2], D=D, BS=k_cache.shape[1], BLOCK_N=BLOCK_N)
    return out
