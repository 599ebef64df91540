"""Adversarial fixture (parity): decode and prefill return views of one shared buffer.

Each op alone is right, and so is every call of either, read at once. But in a served step the
engine holds the prefill output while decode runs (they are concatenated afterwards), and decode
writes over it. It passed compile, dispatch and parity on the H200 (the old parity ran every decode
check, then every prefill check, and read each output at once); the replay's gates caught it.
Parity now interleaves the ops in one worker and reads every output again after later calls:
rejected at parity.
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
    for start in range(0, n, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        ok = t < n
        block = tl.load(bt_ptr + b * bt_stride + t // BS, mask=ok, other=0).to(tl.int64)
        row = ((block * BS + t % BS) * KVH + h // (H // KVH)) * D
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


BLOCK = 64


@triton.jit
def _prefill(q_ptr, k_ptr, v_ptr, cu_ptr, o_ptr, scale, window,
             H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK
    h = tl.program_id(1)
    first = tl.load(cu_ptr + tl.program_id(2))
    n = tl.load(cu_ptr + tl.program_id(2) + 1) - first
    if m0 < n:
        rows = m0 + tl.arange(0, BLOCK)
        d = tl.arange(0, D)
        live = rows < n
        q = tl.load(q_ptr + ((first + rows).to(tl.int64)[:, None] * H + h) * D + d[None, :], mask=live[:, None], other=0.0)
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, D], tl.float32)
        lo = tl.maximum(0, m0 - window) // BLOCK * BLOCK
        for n0 in range(lo, tl.minimum(n, m0 + BLOCK), BLOCK):
            cols = n0 + tl.arange(0, BLOCK)
            kv = ((first + cols).to(tl.int64)[:, None] * KVH + h // (H // KVH)) * D + d[None, :]
            k = tl.load(k_ptr + kv, mask=(cols < n)[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            s = tl.where((rows[:, None] >= cols[None, :]) & (cols < n)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + kv, mask=(cols < n)[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.where(live, l_i, 1.0)[:, None]
        tl.store(o_ptr + ((first + rows).to(tl.int64)[:, None] * H + h) * D + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=live[:, None])


_shared = [torch.empty(0)]


def _output(like):
    """The flaw: every output is a view of the front of one buffer, grown as needed."""
    buf = _shared[0]
    if buf.numel() < like.numel() or buf.dtype != like.dtype or buf.device != like.device:
        buf = _shared[0] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
    return buf[: like.numel()].view(like.shape)


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    B, H, D = q.shape
    out = _output(q)
    _decode[(B, H)](q, k_cache, v_cache, block_table, seq_lens, out, sm_scale, block_table.stride(0),
                    H=H, KVH=k_cache.shape[2], D=D, BS=k_cache.shape[1], BLOCK_N=BLOCK_N)
    return out


def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
    T, H, D = q.shape
    out = _output(q)
    grid = (triton.cdiv(max_seqlen, BLOCK), H, cu_seqlens.shape[0] - 1)
    _prefill[grid](q, k, v, cu_seqlens, out, sm_scale, max_seqlen, H=H, KVH=k.shape[1], D=D, BLOCK=BLOCK)
    return out
