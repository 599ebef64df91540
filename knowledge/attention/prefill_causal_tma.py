"""Varlen causal prefill for Hopper: tensor descriptors, heaviest tiles first (a kernel family for kevo).

What it does
    Sequences are packed back to back (cu_seqlens). One program owns BLOCK_M query
    rows of one query head and streams BLOCK_N-token K/V tiles of kv head
    h // (Hq // Hkv) through an fp32 online softmax in the exp2 domain (the row
    max is taken on raw scores and sm_scale * log2 e folded into one FMA).
    Off-band tiles (wholly below the diagonal) run with no mask at all; only the
    diagonal tile(s) pay for the causal mask, which also hides keys past the
    sequence (a key past it is past every valid query row).
    USE_TMA: Q/K/V tiles come through host-built tensor descriptors over the
    packed [tokens, heads * head_dim] views (TMA on sm90; rows past the tensor are
    zero-filled, rows of the next sequence are masked as above); else plain
    pointer loads. The output is a masked pointer store either way (a tile must
    not write the next sequence's rows).
    HEAVY_FIRST: the grid is (head, query tile, sequence) with the query tile
    reversed, so every head's heaviest (last) tile of a sequence starts first and
    light tiles fill the tail, while the programs in flight share one sequence's
    K/V in L2; else (query tile, head, sequence) as in the reference kernel.
    (A (head x sequence, tile) order, heaviest first across all sequences, was
    measured slower at 8 x 4096, 395 against 439 TFLOP/s for (tile, head, sequence);
    likely because its programs in flight span every sequence's K/V.)
    WARP_SPECIALIZE asks Triton's Hopper pass to split the off-band loop into
    producer/consumer warps. LAZY_RESCALE skips the acc x alpha rescale of an
    off-band tile unless some row's max grew by more than 2^8 (one branch per
    tile; p then stays <= 256, exact after the final division), meant to cut
    the FP32 work beside the tensor cores; measured slower (the catalog says by
    how much).

Knobs (module constants below, one per line)
    BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, USE_TMA, TMA_MIN_TOKENS, HEAVY_FIRST,
    WARP_SPECIALIZE, LAZY_RESCALE.
    NUM_STAGES is lowered on CUDA if Q plus the K/V ring would not fit.

What bounds it
    Tensor-core FLOPs: 4 x head_dim x sum(L_i (L_i + 1) / 2) x num_q_heads, plus
    the masked half of each diagonal tile.
    Measured (H200, 2026-12-01, tests/bench/vs_library.py, bf16, 32 q / 8 kv
    heads, d 128, causal FLOPs), default knobs: 4 x 2k 446 TFLOP/s (0.86x cuDNN
    SDPA), 1 x 8k 479 (0.84x), 8 x 4k 497 (0.90x); 1 x 1k 247 (0.99x) in the
    sweep before. The reference kernel: 337, 425, 399. Plain Triton here has no
    working warp specialisation for this loop on sm90 (Triton 3.6: within 5% at
    8 warps, a compiler assertion at 4), so softmax and the two dots of a tile
    do not overlap across warpgroups as in FlashAttention-3 / cuDNN.

Known limits
    * Programs of short sequences in a batch with a long max_seqlen exit at once
      (launched, not free).
    * No K/V sharing across the query heads of a GQA group inside a program
      (consecutive heads run side by side, so the siblings hit in L2).
"""
import torch
import triton
import triton.language as tl

BLOCK_M = 64  # query rows per program (power of two, 16..128)
BLOCK_N = 64  # KV tokens per inner-loop step (power of two, 16..128)
NUM_WARPS = 4  # warps per program
NUM_STAGES = 3  # software-pipelining depth of the K/V loads
USE_TMA = True  # True: tensor-descriptor (TMA) tile loads; False: pointer loads
TMA_MIN_TOKENS = 4096  # use TMA only from this many packed tokens (host-side descriptors cost launch time)
HEAVY_FIRST = True  # True: grid (head, reversed q tile, seq), heaviest first; False: (q tile, head, seq)
WARP_SPECIALIZE = False  # True: ask Triton to warp-specialise the off-band loop (producer/consumer)
LAZY_RESCALE = False  # True: off-band tiles rescale acc only when a row max grows by > 2^8 (tile-uniform)

_LOG2E = 1.4426950408889634

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: pointer loads only
    TensorDescriptor = None


@triton.jit
def _tiles(acc, l_i, m_i, q, k_src, v_src, k_col, lo, hi, row0, offs_m, seq_len, qk_scale,
           stride_kt, stride_vt,
           HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
           TMA: tl.constexpr, WS: tl.constexpr, LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr,
           DOT_PRECISION: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            k = k_src.load([row0 + start_n, k_col])
        else:
            rows = (row0 + offs_n).to(tl.int64)
            if MASK:
                k = tl.load(k_src + rows[:, None] * stride_kt + offs_d[None, :],
                            mask=(offs_n < seq_len)[:, None], other=0.0)
            else:
                k = tl.load(k_src + rows[:, None] * stride_kt + offs_d[None, :])
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK:
            qk = qk * qk_scale
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_new[:, None]
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if LAZY and not MASK:
            # Rescale only when some row's max grew by more than 2^LAZY_LOG2 (tile-uniform branch);
            # otherwise keep the stale max: p <= 2^LAZY_LOG2, and acc, l_i stay relative to m_i.
            if tl.max(m_new - m_i, 0) > LAZY_LOG2:
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            p = tl.exp2(qk * qk_scale - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            if not MASK:
                qk = qk * qk_scale - m_new[:, None]
            # The first tile of every row holds key 0 <= its index, so m_new is finite: no NaN.
            p = tl.exp2(qk)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            m_i = m_new
        if TMA:
            v = v_src.load([row0 + start_n, k_col])
        else:
            if MASK:
                v = tl.load(v_src + rows[:, None] * stride_vt + offs_d[None, :],
                            mask=(offs_n < seq_len)[:, None], other=0.0)
            else:
                v = tl.load(v_src + rows[:, None] * stride_vt + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_src, k_src, v_src, o_ptr, cu_ptr,
    qk_scale, num_m_tiles, num_q_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr, HEAVY_FIRST: tl.constexpr, WS: tl.constexpr,
    LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    if HEAVY_FIRST:
        pid_h = tl.program_id(0)
        pid_m = num_m_tiles - 1 - tl.program_id(1)
        pid_b = tl.program_id(2)
    else:
        pid_m = num_m_tiles - 1 - tl.program_id(0)
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
    if TMA:
        q = q_src.load([seq_start + m_start, pid_h * HEAD_DIM])
        k_base = k_src
        v_base = v_src
    else:
        rows_q = (seq_start + offs_m).to(tl.int64)
        q = tl.load(q_src + rows_q[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None], other=0.0)
        k_base = k_src + kvh * stride_kh
        v_base = v_src + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = (m_start // BLOCK_N) * BLOCK_N  # tiles wholly below the diagonal: no mask
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, k_base, v_base, kvh * HEAD_DIM, 0, full_end, seq_start,
                           offs_m, seq_len, qk_scale, stride_kt, stride_vt,
                           HEAD_DIM, BLOCK_N, False, TMA, WS, LAZY, LAZY_LOG2, DOT_PRECISION)
    hi = tl.minimum(seq_len, m_start + BLOCK_M)
    acc, l_i, m_i = _tiles(acc, l_i, m_i, q, k_base, v_base, kvh * HEAD_DIM, full_end, hi, seq_start,
                           offs_m, seq_len, qk_scale, stride_kt, stride_vt,
                           HEAD_DIM, BLOCK_N, True, TMA, False, LAZY, LAZY_LOG2, DOT_PRECISION)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    rows_o = (seq_start + offs_m).to(tl.int64)
    tl.store(o_ptr + rows_o[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=mask_m[:, None])


def _fit_stages(device, stages, smem_per_stage, smem_fixed):
    """Lower the pipelining depth until Q plus the K/V ring buffer fit in shared memory."""
    stages = max(1, int(stages))
    if device.type != "cuda":
        return stages
    props = torch.cuda.get_device_properties(device)
    budget = int((getattr(props, "shared_memory_per_block_optin", 0) or 101376) * 0.9)
    while stages > 1 and smem_fixed + stages * smem_per_stage > budget:
        stages -= 1
    return stages


def _tma_ok(*tensors):
    if TensorDescriptor is None:
        return False
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) == t.shape[1] * t.shape[2]
               and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
    total_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, head_dim_k = k.shape
    assert head_dim_k == head_dim and v.shape == k.shape
    assert num_q_heads % num_kv_heads == 0
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, "head_dim must be a power of two >= 16"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    group = num_q_heads // num_kv_heads
    batch = cu_seqlens.shape[0] - 1
    out = torch.empty_like(q)
    max_seqlen = int(max_seqlen)
    if batch <= 0 or max_seqlen <= 0 or total_tokens == 0:
        return out

    num_m_tiles = triton.cdiv(max_seqlen, BLOCK_M)
    elem = k.element_size()
    stages = _fit_stages(q.device, NUM_STAGES, 2 * BLOCK_N * head_dim * elem, BLOCK_M * head_dim * elem)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    tma = bool(USE_TMA) and total_tokens >= TMA_MIN_TOKENS and _tma_ok(q, k, v)
    if tma:
        q_src = TensorDescriptor(q.view(total_tokens, -1), [total_tokens, num_q_heads * head_dim],
                                 [num_q_heads * head_dim, 1], [BLOCK_M, head_dim])
        k_src = TensorDescriptor(k.view(total_tokens, -1), [total_tokens, num_kv_heads * head_dim],
                                 [num_kv_heads * head_dim, 1], [BLOCK_N, head_dim])
        v_src = TensorDescriptor(v.view(total_tokens, -1), [total_tokens, num_kv_heads * head_dim],
                                 [num_kv_heads * head_dim, 1], [BLOCK_N, head_dim])
    else:
        q_src, k_src, v_src = q, k, v
    if HEAVY_FIRST:
        grid = (num_q_heads, num_m_tiles, batch)
    else:
        grid = (num_m_tiles, num_q_heads, batch)
    _prefill_kernel[grid](
        q_src, k_src, v_src, out, cu_seqlens,
        float(sm_scale) * _LOG2E, num_m_tiles, num_q_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        TMA=tma, HEAVY_FIRST=bool(HEAVY_FIRST), WS=bool(WARP_SPECIALIZE) and q.device.type == "cuda",
        LAZY=bool(LAZY_RESCALE), LAZY_LOG2=8.0,
        DOT_PRECISION=dot_precision, num_warps=NUM_WARPS, num_stages=stages,
    )
    return out
