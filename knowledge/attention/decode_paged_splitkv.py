"""Paged split-KV decode attention (reference candidate for kevo).

What it does
    One query token per sequence attends over that sequence's paged KV cache.
    Stage 1 (`_decode_split_kernel`): one program per (sequence, kv head, split).
    Each program loads the whole GQA group of query heads that share its kv head
    (padded up to >= 16 rows so `tl.dot` can use tensor cores; padded rows are
    zero and never stored), walks its slice of the context BLOCK_N tokens at a
    time through the block table, and keeps an fp32 online softmax in the exp2
    domain (sm_scale is pre-multiplied by log2(e)). It writes an unnormalised
    partial output plus its running max and sum. A split that starts at or past
    seq_lens[b] writes the neutral partial (max = -inf, sum = 0, out = 0).
    Stage 2 (`_decode_combine_kernel`): one program per (sequence, query head)
    merges the partials with a log-sum-exp merge and casts to q.dtype.
    With a single split, stage 1 normalises and writes the output directly and
    stage 2 is skipped.

Split count (host side, no device sync)
    Computed only from shapes: programs_per_split = batch * num_kv_heads, the
    target is SM_count * SPLITS_PER_SM_TARGET programs, the max context is
    max_blocks_per_seq * block_size, each split covers at least
    MIN_TOKENS_PER_SPLIT tokens (rounded up to a multiple of BLOCK_N), and the
    count is capped by MAX_SPLITS. On CPU (interpreter) the SM count is
    CPU_SM_COUNT.

Knobs (module constants below, one per line)
    BLOCK_N, NUM_WARPS, NUM_STAGES, SPLITS_PER_SM_TARGET, MIN_TOKENS_PER_SPLIT,
    MAX_SPLITS, CPU_SM_COUNT. NUM_STAGES is lowered on CUDA if the K/V ring
    buffer would not fit in shared memory.

What bounds it
    Memory bandwidth: bytes moved ~= the K and V actually read
    (sum(seq_lens) * num_kv_heads * head_dim * 2 * elem_size) plus the small
    partial buffers. FLOPs are negligible.
    Measured (H200, bf16, 32q/8kv heads, d=128, page 16, default knobs, do_bench
    median incl. Python launch cost): batch 64 x 32k ctx 1.96 ms = 4.4 TB/s;
    batch 16 x 32k 4.1 TB/s; batch 8 x 8k 3.1 TB/s; batch 1 x 32k 77 us =
    1.7 TB/s (small cases are bounded by the two launches' host overhead).

Known limits
    * Split count is sized from the *maximum* context (tensor shape), not the
      real seq_lens, so a batch of short sequences in a big block table gets
      splits that exit immediately (cheap, but not free).
    * The GQA group is padded to 16 rows; for group size 1..4 most of the
      tensor-core work is wasted (harmless: decode is bandwidth bound).
    * Block-table entries are gathered per token (cached, but not vectorised
      per page).
    * Group sizes > 128 are not tuned (the padded row count grows with them).
"""
import math

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # KV tokens per inner-loop iteration (power of two, 16..128)
NUM_WARPS = 4  # warps per stage-1 program
NUM_STAGES = 2  # software-pipelining depth of the stage-1 K/V loads
SPLITS_PER_SM_TARGET = 2  # aim for this many stage-1 programs per SM
MIN_TOKENS_PER_SPLIT = 256  # never split the context finer than this many tokens
MAX_SPLITS = 64  # upper bound on splits per sequence (1 disables split-KV)
CPU_SM_COUNT = 4  # pretend SM count when running on the CPU interpreter

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seqlens_ptr,
    out_ptr, po_ptr, pm_ptr, pl_ptr,
    qk_scale, tokens_per_split,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btp,
    stride_ob, stride_oh, stride_od,
    stride_pob, stride_poh, stride_pos, stride_pod,
    stride_pmb, stride_pmh, stride_pms,
    max_pages,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_kvh = tl.program_id(1)
    pid_s = tl.program_id(2)

    seq_len = tl.load(seqlens_ptr + pid_b)
    split_start = pid_s * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    heads = pid_kvh * GROUP + offs_g  # query heads of this GQA group

    q_ptrs = (q_ptr + pid_b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=mask_g[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    bt_row = bt_ptr + pid_b.to(tl.int64) * stride_btb
    k_head = k_ptr + pid_kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + pid_kvh.to(tl.int64) * stride_vh

    # Empty range (split past the end of the sequence) -> zero iterations and
    # the neutral partial (m=-inf, l=0, acc=0) is written below.
    # Every tile entered holds >= 1 valid token (its first one), so m_i is
    # finite after the first iteration and exp2(-inf - finite) = 0 is safe.
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        page = offs_n // PAGE_SIZE
        slot = offs_n % PAGE_SIZE
        phys = tl.load(bt_row + page * stride_btp, mask=mask_n & (page < max_pages), other=0)
        phys = phys.to(tl.int64)

        k_ptrs = (k_head + phys[:, None] * stride_kb + slot[:, None] * stride_ks
                  + offs_d[None, :] * stride_kd)
        k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        v_ptrs = (v_head + phys[:, None] * stride_vb + slot[:, None] * stride_vs
                  + offs_d[None, :] * stride_vd)
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if SINGLE_SPLIT:
        # seq_len >= 1, so l_i > 0 for every real row.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = (out_ptr + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        po_ptrs = (po_ptr + pid_b.to(tl.int64) * stride_pob + heads[:, None] * stride_poh
                   + pid_s * stride_pos + offs_d[None, :] * stride_pod)
        tl.store(po_ptrs, acc, mask=mask_g[:, None])
        pm_off = pid_b.to(tl.int64) * stride_pmb + heads * stride_pmh + pid_s * stride_pms
        tl.store(pm_ptr + pm_off, m_i, mask=mask_g)
        tl.store(pl_ptr + pm_off, l_i, mask=mask_g)


@triton.jit
def _decode_combine_kernel(
    out_ptr, po_ptr, pm_ptr, pl_ptr,
    num_splits,
    stride_ob, stride_oh, stride_od,
    stride_pob, stride_poh, stride_pos, stride_pod,
    stride_pmb, stride_pmh, stride_pms,
    HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    pm_base = pid_b.to(tl.int64) * stride_pmb + pid_h * stride_pmh
    po_base = po_ptr + pid_b.to(tl.int64) * stride_pob + pid_h * stride_poh

    m_run = tl.full([1], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        offs_s = s0 + offs_c
        mask_s = offs_s < num_splits
        m_s = tl.load(pm_ptr + pm_base + offs_s * stride_pms, mask=mask_s, other=float("-inf"))
        l_s = tl.load(pl_ptr + pm_base + offs_s * stride_pms, mask=mask_s, other=0.0)
        o_s = tl.load(po_base + offs_s[:, None] * stride_pos + offs_d[None, :] * stride_pod,
                      mask=mask_s[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        # Guard -inf - (-inf): if every split so far is empty, use 0 as the
        # reference max (all weights are then exp2(-inf) = 0).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m_s - m_ref)
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o_s, 0)
        m_run = m_new

    l_safe = tl.where(l_run > 0.0, l_run, 1.0)
    o = acc / l_safe
    o_ptrs = out_ptr + pid_b.to(tl.int64) * stride_ob + pid_h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _sm_count(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def _fit_stages(device, stages, smem_per_stage, smem_fixed):
    """Lower the pipelining depth until the K/V ring buffer fits in shared memory."""
    stages = max(1, int(stages))
    if device.type != "cuda":
        return stages
    props = torch.cuda.get_device_properties(device)
    budget = getattr(props, "shared_memory_per_block_optin", 0) or 101376
    budget = int(budget * 0.9)  # headroom for layout-conversion scratch
    while stages > 1 and smem_fixed + stages * smem_per_stage > budget:
        stages -= 1
    return stages


def _num_splits(batch, num_kv_heads, max_context, device):
    """Splits per sequence, from shapes only (never reads tensor values)."""
    block_n = BLOCK_N
    programs_per_split = max(1, batch * num_kv_heads)
    target_programs = max(1, _sm_count(device) * max(1, SPLITS_PER_SM_TARGET))
    want = -(-target_programs // programs_per_split)
    min_tokens = max(block_n, MIN_TOKENS_PER_SPLIT)
    max_by_len = max(1, -(-max_context // min_tokens))
    splits = max(1, min(want, max_by_len, max(1, MAX_SPLITS)))
    tokens_per_split = -(-max_context // splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n  # align to BLOCK_N
    splits = max(1, -(-max_context // tokens_per_split))  # drop splits that are always empty
    return splits, tokens_per_split


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    batch, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, head_dim_k = k_cache.shape
    assert head_dim_k == head_dim and v_cache.shape == k_cache.shape
    assert num_q_heads % num_kv_heads == 0
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, "head_dim must be a power of two >= 16"
    group = num_q_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    max_pages = block_table.shape[1]
    max_context = max(1, max_pages * page_size)

    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out

    splits, tokens_per_split = _num_splits(batch, num_kv_heads, max_context, q.device)
    single = splits == 1
    if single:
        po = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        pm = out.new_empty((1, 1, 1), dtype=torch.float32)
        pl = pm
    else:
        po = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        pm = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)

    elem = k_cache.element_size()
    stages = _fit_stages(q.device, NUM_STAGES, 2 * BLOCK_N * head_dim * elem,
                         block_g * head_dim * elem)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(sm_scale) * _LOG2E

    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens,
        out, po, pm, pl,
        qk_scale, tokens_per_split,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_table.stride(0), block_table.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        po.stride(0), po.stride(1), po.stride(2), po.stride(3),
        pm.stride(0), pm.stride(1), pm.stride(2),
        max_pages,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N,
        PAGE_SIZE=page_size, SINGLE_SPLIT=single, DOT_PRECISION=dot_precision,
        num_warps=NUM_WARPS, num_stages=stages,
    )
    if not single:
        _decode_combine_kernel[(batch, num_q_heads)](
            out, po, pm, pl,
            splits,
            out.stride(0), out.stride(1), out.stride(2),
            po.stride(0), po.stride(1), po.stride(2), po.stride(3),
            pm.stride(0), pm.stride(1), pm.stride(2),
            HEAD_DIM=head_dim, SPLIT_CHUNK=min(16, triton.next_power_of_2(splits)),
            num_warps=4 if head_dim >= 128 else 2, num_stages=1,
        )
    return out
