"""Adversarial fixture (parity): a prefill right only up to the longest prompt the old parity ran.

For prompts longer than LONG (8192 on CUDA, the old parity's longest prefill; 128 on the CPU, where
it was 65) it attends to the last LONG keys only, a sliding window no served model asked for. It
passed compile, dispatch and parity on the H200; served prompts reach 16384. Parity now runs a
prefill step of max_prefill_tokens and one prompt of the longest served length: rejected at parity.
Otherwise a plain, correct causal varlen prefill: one program per (query tile, head, sequence).
"""
import torch
import triton
import triton.language as tl

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


def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
    T, H, D = q.shape
    out = torch.empty_like(q)
    long = 8192 if q.device.type == "cuda" else 128
    window = long if max_seqlen > long else max_seqlen       # the flaw: long prompts see a window of keys
    grid = (triton.cdiv(max_seqlen, BLOCK), H, cu_seqlens.shape[0] - 1)
    _prefill[grid](q, k, v, cu_seqlens, out, sm_scale, window, H=H, KVH=k.shape[1], D=D, BLOCK=BLOCK)
    return out
