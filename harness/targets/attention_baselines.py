"""The attention target's torch baselines and cuDNN anchors: what a user runs today with torch alone
(three ways to the paged decode, by name, and the per-sequence causal prefill), and the strongest library
kernel on equivalent contiguous shapes, for the microbench's anchor figure.

Not here: which decode way the harness runs (config `targets.attention.decode_baseline`, applied by
harness.targets.configured), references, inputs, cases and the cost model (harness/targets/attention.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.targets.base import Inputs


# ---------------------------------------------------------------------------------------------
# baselines: what a user runs today with torch alone
# ---------------------------------------------------------------------------------------------

def decode_masked(q, k_cache, v_cache, block_table, seq_lens, sm_scale, lengths=None) -> torch.Tensor:
    """Gather the paged cache through the block table, zero what lies past each length, and make one
    masked SDPA call in which each KV head's group of query heads stands as that many query rows —
    so KV is never expanded per query head, and SDPA's fused memory-efficient kernel (float32
    softmax inside) applies."""
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    L = block_table.shape[1] * bs
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]                 # [B, L]
    table = block_table.long()
    k = k_cache[table].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0).transpose(1, 2)
    v = v_cache[table].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.reshape(B, KVH, H // KVH, D), k, v,
                                         attn_mask=valid[:, None, None, :], scale=sm_scale)
    return out.reshape(B, H, D)


def decode_clamped(q, k_cache, v_cache, block_table, seq_lens, sm_scale, lengths=None) -> torch.Tensor:
    """As `decode_masked`, but gathered token by token with every position past a sequence's end
    pointed at its first token (finite, then masked out), so no `masked_fill` pass over the copy."""
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    L = block_table.shape[1] * bs
    pos = torch.arange(L, device=q.device)
    valid = pos[None, :] < seq_lens[:, None]                                              # [B, L]
    token = block_table.long().repeat_interleave(bs, dim=1) * bs + (pos % bs)[None, :]     # [B, L] flat slot
    token = torch.where(valid, token, token[:, :1])
    k = k_cache.reshape(-1, KVH, D)[token].transpose(1, 2)                                 # [B, KVH, L, D]
    v = v_cache.reshape(-1, KVH, D)[token].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.reshape(B, KVH, H // KVH, D), k, v,
                                         attn_mask=valid[:, None, None, :], scale=sm_scale)
    return out.reshape(B, H, D)


def decode_per_sequence(q, k_cache, v_cache, block_table, seq_lens, sm_scale, lengths=None) -> torch.Tensor:
    """One unmasked SDPA call per sequence on exactly its tokens, the group of query heads as query
    rows; no mask, so SDPA's flash or cuDNN kernels may apply. `lengths` are the lengths as the
    serving engine holds them on the host (without them, they are read from `seq_lens`)."""
    B, H, D = q.shape
    _, bs, KVH, _ = k_cache.shape
    lengths = lengths if lengths is not None else seq_lens.tolist()
    out = torch.empty_like(q)
    for b, n in enumerate(lengths):
        blocks = block_table[b, :(n + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, KVH, D)[:n].transpose(0, 1)[None]                 # [1, KVH, n, D]
        v = v_cache[blocks].reshape(-1, KVH, D)[:n].transpose(0, 1)[None]
        out[b] = F.scaled_dot_product_attention(q[b].reshape(1, KVH, H // KVH, D), k, v, scale=sm_scale).reshape(H, D)
    return out


# Three torch-only ways to the paged decode; tests/bench/decode_baselines.py times them on the served
# shapes, and the fastest correct one (docs/BENCHMARKS.md) is the baseline the served engine runs.
# config.yaml's `targets.attention.decode_baseline` names the one the harness runs (harness.targets.configured).
DECODE_BASELINES = {"masked": decode_masked, "clamped": decode_clamped, "per_sequence": decode_per_sequence}


def prefill_baseline(q, k, v, cu_seqlens, max_seqlen, sm_scale, bounds: list[int] | None = None) -> torch.Tensor:
    """One causal SDPA call per sequence (SDPA has no varlen entry point), 4-D and with the KV heads
    expanded to the query heads, so that SDPA's fused flash/cuDNN kernels apply. `bounds` are the
    sequence bounds as the serving engine holds them on the host (the timed stages pass them, so no
    device-to-host read stalls the launches); without them they are read from `cu_seqlens`."""
    out = torch.empty_like(q)
    cu = bounds if bounds is not None else cu_seqlens.tolist()
    group = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1], cu[1:]):
        ks = k[s:e].repeat_interleave(group, dim=1) if group > 1 else k[s:e]
        vs = v[s:e].repeat_interleave(group, dim=1) if group > 1 else v[s:e]
        out[s:e] = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            is_causal=True, scale=sm_scale)[0].transpose(0, 1)
    return out


def prefill_calibration(q, k, v, cu_seqlens, max_seqlen, sm_scale) -> torch.Tensor:
    """`prefill_baseline` with SDPA's cuDNN kernel left out: what sets parity's prefill tolerance. cuDNN builds
    a plan for each sequence length it has not met, and a check's lengths are fresh: 20-45 ms a sequence on
    the H200, 4.8 s for the 129 prompts of the served-limit check; SDPA's flash kernel builds none, and its
    error against float64 on the same inputs was cuDNN's (max_abs equal, rel L2 0.05-0.4% lower; H200,
    2026-12-04, docs/BENCHMARKS.md). The timed baseline and the served engine still run SDPA as chosen."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return prefill_baseline(q, k, v, cu_seqlens, max_seqlen, sm_scale)


# ---------------------------------------------------------------------------------------------
# anchors: cuDNN SDPA on equivalent contiguous shapes (same bytes / same FLOPs), CUDA only
# ---------------------------------------------------------------------------------------------

def _cudnn_sdpa(q, k, v, causal: bool, sm_scale: float) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
                                              enable_gqa=q.shape[1] != k.shape[1])


def decode_anchor_inputs(inputs: Inputs) -> Inputs:
    """Contiguous K/V of every sequence's mean length: the bytes the paged call must read."""
    q, kc = inputs["q"], inputs["k_cache"]
    B, H, D = q.shape
    n = max(1, round(inputs["seq_lens"].float().mean().item()))
    gen = torch.Generator(device=q.device).manual_seed(0)
    k = torch.randn(B, kc.shape[2], n, D, device=q.device, dtype=q.dtype, generator=gen)
    return {"q": q[:, :, None, :].contiguous(), "k": k, "v": torch.randn_like(k), "sm_scale": inputs["sm_scale"]}


def decode_anchor(q, k, v, sm_scale) -> torch.Tensor:
    return _cudnn_sdpa(q, k, v, causal=False, sm_scale=sm_scale)


def prefill_anchor_inputs(inputs: Inputs) -> Inputs:
    cu = inputs["cu_seqlens"].tolist()
    to_bhd = lambda t, s, e: t[s:e].transpose(0, 1)[None].contiguous()   # noqa: E731
    return {"seqs": [(to_bhd(inputs["q"], s, e), to_bhd(inputs["k"], s, e), to_bhd(inputs["v"], s, e))
                     for s, e in zip(cu[:-1], cu[1:])], "sm_scale": inputs["sm_scale"]}


def prefill_anchor(seqs, sm_scale) -> torch.Tensor:
    outs = [_cudnn_sdpa(q, k, v, causal=True, sm_scale=sm_scale) for q, k, v in seqs]
    return outs[-1]
