"""Varlen causal prefill attention, tiled flash-attention style (reference candidate for kevo).

What it does
    Sequences are packed back to back (cu_seqlens). The grid is
    (query tile, query head, sequence); the tile count comes from max_seqlen
    and programs whose tile starts at or past their sequence's length exit at
    once. Query tiles are visited longest-work-first (reversed tile index) so
    the heavy tiles near the end of long sequences start early. Each program
    keeps an fp32 online softmax in the exp2 domain (sm_scale pre-multiplied by
    log2(e)) over BLOCK_N-token K/V tiles of kv head h // (Hq // Hkv).
    With CAUSAL_SKIP the loop only visits KV tiles up to the diagonal and only
    the diagonal tile(s) pay for the causal mask; without it every KV tile of
    the sequence is visited and masked (a baseline for the proposer).

Knobs (module constants below, one per line)
    BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, CAUSAL_SKIP. NUM_STAGES is lowered
    on CUDA if Q plus the K/V ring buffer would not fit in shared memory.

What bounds it
    Tensor-core FLOPs: ~ 4 * head_dim * sum(L_i^2) / 2 * num_q_heads for the
    causal half (plus the wasted half of each diagonal tile). K/V bytes are
    re-read once per query tile and per query head (GQA siblings hit in L2).
    Measured (H200, bf16, 32q/8kv heads, d=128, default knobs, causal FLOPs):
    1 x 8k 417-426 TFLOP/s; 4 x 2k ~337; 16 x 512 ~190.

Known limits
    * No K/V sharing across the query heads of a GQA group inside a program.
    * Diagonal tiles are computed in full and masked; with BLOCK_N < BLOCK_M
      several KV tiles per query tile are on the diagonal.
    * Short sequences in a batch with a long max_seqlen launch programs that
      exit immediately.
    * No persistent scheduling / warp specialisation (plain Triton loops).
"""
import torch
import triton
import triton.language as tl

BLOCK_M = 128  # query rows per program (power of two, 16..128)
BLOCK_N = 64  # KV tokens per inner-loop iteration (power of two, 16..128)
NUM_WARPS = 8  # warps per program
NUM_STAGES = 3  # software-pipelining depth of the K/V loads
CAUSAL_SKIP = True  # True: stop at the diagonal, mask only diagonal tiles; False: visit and mask all tiles

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_tiles(
    acc, l_i, m_i, q,
    k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
    lo, hi, offs_m, seq_len, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    APPLY_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        offs_n64 = offs_n.to(tl.int64)
        k = tl.load(k_base + offs_n64[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                    mask=mask_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if APPLY_MASK:
            keep = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
            qk = tl.where(keep, qk, float("-inf"))
        # The first tile any row visits holds a key <= that row's index (key 0,
        # or the diagonal tile start <= m_start), so m_i is finite from then on
        # and exp2(-inf - finite) = 0 never produces NaN.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n64[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                    mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr,
    qk_scale, num_m_tiles,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_SKIP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = num_m_tiles - 1 - tl.program_id(0)  # heaviest tiles first
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2)

    seq_start = tl.load(cu_ptr + pid_b)
    seq_len = tl.load(cu_ptr + pid_b + 1) - seq_start
    m_start = pid_m * BLOCK_M
    if m_start >= seq_len:
        return

    kvh = pid_h // GROUP
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < seq_len
    rows = (seq_start + offs_m).to(tl.int64)

    q = tl.load(q_ptr + rows[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_m[:, None], other=0.0)

    seq_start64 = seq_start.to(tl.int64)
    k_base = k_ptr + seq_start64 * stride_kt + kvh * stride_kh
    v_base = v_ptr + seq_start64 * stride_vt + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if CAUSAL_SKIP:
        # KV tiles entirely at or below the diagonal of this query tile: no mask.
        full_end = (m_start // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
            0, full_end, offs_m, seq_len, qk_scale,
            HEAD_DIM, BLOCK_N, False, DOT_PRECISION)
        # Diagonal tile(s): causal + length mask; stop at the last query row.
        hi = tl.minimum(seq_len, m_start + BLOCK_M)
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
            full_end, hi, offs_m, seq_len, qk_scale,
            HEAD_DIM, BLOCK_N, True, DOT_PRECISION)
    else:
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
            0, seq_len, offs_m, seq_len, qk_scale,
            HEAD_DIM, BLOCK_N, True, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :] * stride_od,
             o.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])


def _fit_stages(device, stages, smem_per_stage, smem_fixed):
    """Lower the pipelining depth until Q plus the K/V ring buffer fit in shared memory."""
    stages = max(1, int(stages))
    if device.type != "cuda":
        return stages
    props = torch.cuda.get_device_properties(device)
    budget = getattr(props, "shared_memory_per_block_optin", 0) or 101376
    budget = int(budget * 0.9)  # headroom for layout-conversion scratch
    while stages > 1 and smem_fixed + stages * smem_per_stage > budget:
        stages -= 1
    return stages


def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
    total_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, head_dim_k = k.shape
    assert head_dim_k == head_dim and v.shape == k.shape
    assert num_q_heads % num_kv_heads == 0
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, "head_dim must be a power of two >= 16"
    group = num_q_heads // num_kv_heads
    batch = cu_seqlens.shape[0] - 1

    out = torch.empty_like(q)
    max_seqlen = int(max_seqlen)
    if batch <= 0 or max_seqlen <= 0 or total_tokens == 0:
        return out

    num_m_tiles = triton.cdiv(max_seqlen, BLOCK_M)
    elem = k.element_size()
    stages = _fit_stages(q.device, NUM_STAGES, 2 * BLOCK_N * head_dim * elem,
                         BLOCK_M * head_dim * elem)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(sm_scale) * _LOG2E

    _prefill_kernel[(num_m_tiles, num_q_heads, batch)](
        q, k, v, out, cu_seqlens,
        qk_scale, num_m_tiles,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        CAUSAL_SKIP=CAUSAL_SKIP, DOT_PRECISION=dot_precision,
        num_warps=NUM_WARPS, num_stages=stages,
    )
    return out
