"""Paged GQA decode with device-side split sizing (a kernel family for kevo's proposer).

What it does
    One query token per sequence attends over its paged KV cache. One program per (split, kv head, sequence) holds
    the whole GQA group of query heads (padded up to 16 rows so `tl.dot` runs on tensor cores), so K/V are read once
    per kv head. The grid's split count is an upper bound from shapes alone (block-table width, batch x kv heads
    against the SM count); each program then sizes its sequence's splits from the *real* length on the device: n =
    min(grid splits, cdiv(seq_len, MIN_TOKENS_PER_SPLIT)), equal BLOCK_N-aligned chunks over [0, seq_len), and
    programs past n exit at once (no host sync).
    PAGE_LOADS: one block-table read per page (pages x slots offsets), instead of one per token (needs the page size
    to divide BLOCK_N; else per token).
    KV_TMA: K/V come a whole page at a time through host-built tensor descriptors over the cache seen as [blocks x
    page, kv heads x head_dim] (TMA on sm90: one thread issues each copy, no per-token addresses in registers), one
    page per inner step; only a sequence's last, partial page is masked (its unused rows are zeroed before they meet
    V). Needs the page size to divide BLOCK_N and a cache whose rows are 16-byte aligned; else the pointer loads.
    Partials (unnormalised output, running max, sum; exp2 domain, sm_scale folded with log2 e) are merged by a
    log-sum-exp merge over all heads of the group at once: FUSED_COMBINE lets the last split program of each (sequence,
    kv head), found with an atomic ticket, merge them in the same launch (no second kernel); otherwise a small
    second kernel merges them. A sequence with one split writes its output directly.
    PREFETCH: the pointer loads of the next tile's K and V are issued before this tile's products, into registers
    (two tiles in flight a program, as cuDNN's decode keeps its next K/V in flight), instead of Triton's pipeliner,
    which keeps one K/V buffer at NUM_STAGES 2-4 (the block table's load is what it runs ahead); not with KV_TMA.
    PERSISTENT k > 0: the same work items (split, kv head, sequence), a 1-D grid of min(items, SMs x k) programs, each
    taking items p, p + grid, ... split-major, so a program's first item holds work. Grid, items and buffers come
    from shapes, as before (capturable). NUM_STAGES deeper than the device's shared memory holds is lowered.

Knobs (module constants below, one per line)
    BLOCK_N, NUM_WARPS, NUM_STAGES, SPLIT_POLICY, PROGRAMS_PER_SM, WAVES, MIN_TOKENS_PER_SPLIT, MAX_SPLITS,
    PAGE_LOADS, KV_TMA, PREFETCH, FUSED_COMBINE, PERSISTENT, RESIDENCY_CAP, CPU_SM_COUNT.

What bounds it
    Memory bandwidth: sum(seq_lens) x kv_heads x head_dim x 2 x elem bytes of K/V plus partials (G x head_dim x 4
    bytes per split program: < 1% at >= 256 tokens per split).
    Measured (H200, 2026-12-01, tests/bench/vs_library.py: bf16, 32 q / 8 kv heads, d 128, page 16, shuffled pages;
    do_bench median, L2 flushed), default knobs, TB/s (x cuDNN SDPA on contiguous KV): 32 x 4k 3.86 (0.96), 64 x 4k
    4.26 (1.00), 8 x 32k 4.14 (0.98), 16 x 8k 3.80 (0.94), 128 x 1k 3.90 (0.99).
    Not the page layout (H100, 2026-12-05): pages in order, and pages stored head-major (a kv head's 16 tokens 4 KB
    contiguous, as the library's rows are), read within 1% of shuffled [16, kv heads, d] pages. Time against length
    under CUDA graphs (H100, table 32k tokens) fits a fixed cost plus a stream: batch 16 (4 splits, the combine)
    23.5 us + bytes / 3.03 TB/s against cuDNN's 16.5 us + bytes / 3.10 TB/s (0.82x at 16 x 1k, 0.97x at 16 x 32k);
    batch 64 (no split) 17.6 us + bytes / 3.04 TB/s against 16.9 us + bytes / 3.09 TB/s (0.98x from 1k to 8k).
    So: a stream 1.5-2.3% slower everywhere, and about 7 us a call more where sequences split. One program a
    (sequence, kv head) (MAX_SPLITS 1) 0.67-0.78x at batch 16; a separate combine kernel within 1-3% of the fused.

Known limits
    * The grid is sized from the block-table width; a batch whose lengths are far under that width still launches
      (and instantly retires) the empty programs. PERSISTENT hands out items by index, not by cost.
    * FUSED_COMBINE keeps a per-device ticket buffer that the last program of each (sequence, kv head) resets to
      zero; a launch killed mid-way would leave tickets behind (the next call would then mis-merge).
    * Ragged batches (the served shapes): equal split counts per sequence, so the longest chunk sets the time
      (0.86-0.95x cuDNN on rows of lengths 0.5-1 x L against 0.94-0.99x at equal lengths, H200 2026-12-04). A
      balanced plan (chunks of total tokens x kv heads / slots, persistent grid) read 0.65-0.78x: dropped.
    * Residency: uncapped, PAGE_LOADS, BLOCK_N 128 or NUM_WARPS 8 fit 2 programs per SM where policy 1 counts 4.
      RESIDENCY_CAP fits them by registers (not yet timed); shared memory can still bound it
      (tests/bench/sm90_compile.py).
"""
import torch
import triton
import triton.language as tl

BLOCK_N = 64  # KV tokens per inner-loop step (power of two, 16..256)
NUM_WARPS = 4  # warps per split program
NUM_STAGES = 2  # software-pipelining depth of the K/V loads
SPLIT_POLICY = 1  # 0: splits = cdiv(SMs x PROGRAMS_PER_SM, batch x kv heads); 1: fullest waves (see grid_splits)
PROGRAMS_PER_SM = 4  # policy 0: split programs aimed at per SM; policy 1: programs resident per SM
WAVES = 1  # policy 1: the most waves of SMs x PROGRAMS_PER_SM programs the split plan may fill
MIN_TOKENS_PER_SPLIT = 256  # on device: never split a sequence finer than this many tokens
MAX_SPLITS = 32  # upper bound on splits per sequence (1: no split, no merge)
PAGE_LOADS = False  # True: one block-table read per page (reshaped offsets); False: one per token
KV_TMA = False  # True: K/V a whole page a step through tensor descriptors (TMA); False: pointer loads
PREFETCH = False  # True: pointer loads one tile ahead into registers, no pipeliner (NUM_STAGES unused)
FUSED_COMBINE = True  # True: last split program merges (atomic ticket); False: a second kernel merges
PERSISTENT = 0  # 0: one program per work item; k > 0: min(items, SMs x k) programs loop over the items
RESIDENCY_CAP = False  # True: registers capped so the programs counted on per SM fit (see register_cap)
CPU_SM_COUNT = 4  # pretend SM count when running on the CPU interpreter

_LOG2E = 1.4426950408889634
_TICKETS = {}  # device -> its int32 ticket buffers, the largest last, none freed
_DEPTHS = {}

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # older Triton: pointer loads only
    TensorDescriptor = None


@triton.jit
def _num_splits_of(seq_len, max_splits, min_tokens, BLOCK_N: tl.constexpr):
    """Splits of one sequence and their token chunk, from its real length (device side)."""
    n = tl.minimum(max_splits, tl.cdiv(seq_len, min_tokens))
    n = tl.maximum(n, 1)
    chunk = tl.cdiv(tl.cdiv(seq_len, n), BLOCK_N) * BLOCK_N
    n = tl.cdiv(seq_len, chunk)
    return n, chunk


@triton.jit
def _scores(q, k, m_i, l_i, qk_scale, mask_n, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One K tile's online-softmax step (exp2 domain): (p, the rescale of acc, the new max, the new sum); MASKED:
    tokens off mask_n weigh nothing."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _kv_rows(bt_row, start_n, end, n_pages, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N: tl.constexpr,
             PAGE_SIZE: tl.constexpr, PAGES: tl.constexpr, PAGE_LOADS: tl.constexpr):
    """The cache offsets of the K and V rows of tokens [start_n, start_n + BLOCK_N) and which are < end. PAGE_LOADS: one
    block-table read per page; else one per token."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    if PAGE_LOADS:
        pages = start_n // PAGE_SIZE + tl.arange(0, PAGES)
        phys = tl.load(bt_row + pages, mask=pages < n_pages, other=0).to(tl.int64)
        slots = tl.arange(0, PAGE_SIZE)
        k_rows = tl.reshape(phys[:, None] * stride_kb + slots[None, :] * stride_ks, [BLOCK_N])
        v_rows = tl.reshape(phys[:, None] * stride_vb + slots[None, :] * stride_vs, [BLOCK_N])
    else:
        phys = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k_rows = phys * stride_kb + slot * stride_ks
        v_rows = phys * stride_vb + slot * stride_vs
    return k_rows, v_rows, mask_n


@triton.jit
def _merge_store(
    po_base, pm_base, out_ptr, n_split, stride_ob, stride_oh, pid_b, pid_kvh, GROUP: tl.constexpr, GP: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """Log-sum-exp merge of n_split partials [split, group, d] of one (sequence, kv head)."""
    offs_c = tl.arange(0, SPLIT_CHUNK)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    m_run = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, n_split, SPLIT_CHUNK):
        offs_s = s0 + offs_c
        msk = (offs_s[:, None] < n_split) & mask_g[None, :]
        ml_off = offs_s[:, None] * GROUP + offs_g[None, :]
        # .cg: from L2, past this SM's L1 (the fused merge reads partials other SMs wrote in this launch)
        m_s = tl.load(pm_base + 2 * ml_off, mask=msk, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(pm_base + 2 * ml_off + 1, mask=msk, other=0.0, cache_modifier=".cg")
        o_s = tl.load(po_base + ml_off[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=msk[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # every split holds >= 1 token; guard anyway
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m_s - m_ref[None, :])
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 0)
        m_run = m_new
    l_safe = tl.where(l_run > 0.0, l_run, 1.0)
    o = acc / l_safe[:, None]
    heads = pid_kvh * GROUP + offs_g
    o_ptrs = out_ptr + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


@triton.jit
def _split_item(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale, max_splits,
    num_kv_heads, pid_s, pid_kvh, pid_b, seq_len, n_split, chunk, stride_qb, stride_qh, stride_kb, stride_ks,
    stride_kh, stride_vb, stride_vs, stride_vh, stride_btb, stride_ob, stride_oh, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGES: tl.constexpr, PAGE_LOADS: tl.constexpr, KV_TMA: tl.constexpr, PREFETCH: tl.constexpr,
    SINGLE: tl.constexpr, FUSED: tl.constexpr, SPLIT_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One work item: split pid_s (< n_split) of kv head pid_kvh of sequence pid_b, then its partial (or, with one
    split, its output; with FUSED, the merge if it is the item's last split to finish)."""
    start = pid_s * chunk
    end = tl.minimum(start + chunk, seq_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    heads = pid_kvh * GROUP + offs_g
    q = tl.load(q_ptr + pid_b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + pid_b.to(tl.int64) * stride_btb
    k_head = k_ptr + pid_kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + pid_kvh.to(tl.int64) * stride_vh
    n_pages = tl.cdiv(seq_len, PAGE_SIZE)
    # Every step holds >= 1 valid token (its first), so m_i is finite after the first step.
    if KV_TMA:  # whole pages (start is page-aligned): unmasked, then the last page's valid rows
        col = pid_kvh * HEAD_DIM
        pos = tl.arange(0, PAGE_SIZE)
        full = start + (end - start) // PAGE_SIZE * PAGE_SIZE
        for p0 in range(start, full, PAGE_SIZE):
            kv_row = tl.load(bt_row + p0 // PAGE_SIZE) * PAGE_SIZE
            p, alpha, m_i, l_i = _scores(q, k_desc.load([kv_row, col]), m_i, l_i, qk_scale, pos, False, DOT_PRECISION)
            v = v_desc.load([kv_row, col])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        if full < end:
            kv_row = tl.load(bt_row + full // PAGE_SIZE) * PAGE_SIZE
            mask_p = full + pos < end
            p, alpha, m_i, l_i = _scores(q, k_desc.load([kv_row, col]), m_i, l_i, qk_scale, mask_p, True, DOT_PRECISION)
            v = tl.where(mask_p[:, None], v_desc.load([kv_row, col]), 0.0)  # unused rows may hold NaN
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    elif PREFETCH:  # tile i + 1's K and V loaded into registers before tile i is computed (no pipeliner)
        k_rows, v_rows, mask_n = _kv_rows(bt_row, start, end, n_pages, stride_kb, stride_ks, stride_vb, stride_vs,
                                          BLOCK_N, PAGE_SIZE, PAGES, PAGE_LOADS)
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        for start_n in range(start, end, BLOCK_N):
            # the next tile's K and V, masked off past `end` (past the last tile, all of them)
            nk_rows, nv_rows, n_mask = _kv_rows(bt_row, start_n + BLOCK_N, end, n_pages, stride_kb, stride_ks,
                                                stride_vb, stride_vs, BLOCK_N, PAGE_SIZE, PAGES, PAGE_LOADS)
            k_next = tl.load(k_head + nk_rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            v_next = tl.load(v_head + nv_rows[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
            p, alpha, m_i, l_i = _scores(q, k, m_i, l_i, qk_scale, mask_n, True, DOT_PRECISION)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            k, v, mask_n = k_next, v_next, n_mask
    else:
        for start_n in range(start, end, BLOCK_N):
            k_rows, v_rows, mask_n = _kv_rows(bt_row, start_n, end, n_pages, stride_kb, stride_ks, stride_vb,
                                              stride_vs, BLOCK_N, PAGE_SIZE, PAGES, PAGE_LOADS)
            k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            p, alpha, m_i, l_i = _scores(q, k, m_i, l_i, qk_scale, mask_n, True, DOT_PRECISION)
            v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    if SINGLE:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        # partials: po [B, KVH, S, GROUP, D], pm [B, KVH, S, GROUP, 2] (max, sum)
        row = (pid_b.to(tl.int64) * num_kv_heads + pid_kvh) * max_splits
        po_base = po_ptr + row * (GROUP * HEAD_DIM)
        pm_base = pm_ptr + row * (GROUP * 2)
        ml_off = pid_s * GROUP + offs_g
        tl.store(po_base + ml_off[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_g[:, None])
        tl.store(pm_base + 2 * ml_off, m_i, mask=mask_g)
        tl.store(pm_base + 2 * ml_off + 1, l_i, mask=mask_g)
        if FUSED:
            tl.debug_barrier()  # every thread's partial stores precede the ticket (release, gpu scope)
            ticket = ticket_ptr + pid_b.to(tl.int64) * num_kv_heads + pid_kvh
            done = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
            if done == n_split - 1:
                tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # reset for the next call
                _merge_store(po_base, pm_base, out_ptr, n_split, stride_ob, stride_oh, pid_b, pid_kvh,
                             GROUP, GP, HEAD_DIM, SPLIT_CHUNK)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale,
    max_splits, min_tokens, num_kv_heads, batch, n_items, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_btb, stride_ob, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGES: tl.constexpr,
    PAGE_LOADS: tl.constexpr, KV_TMA: tl.constexpr, PREFETCH: tl.constexpr, SINGLE: tl.constexpr, FUSED: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr, PERSISTENT: tl.constexpr,
):
    # Work items in split-major order, item = (split x batch + sequence) x kv heads + kv head. PERSISTENT: taken with a
    # plain stride of the grid: the first batch x kv heads items (every sequence's first split) all hold work, later
    # ones only the longer sequences' splits (a split-fastest order would hand program p only split p mod splits).
    per_layer = batch * num_kv_heads
    if PERSISTENT:
        first, stop, step = tl.program_id(0), n_items, tl.num_programs(0)
    else:
        first = (tl.program_id(0) * batch + tl.program_id(2)) * num_kv_heads + tl.program_id(1)
        stop, step = first + 1, 1
    for item in range(first, stop, step):
        pid_s = item // per_layer
        rest = item - pid_s * per_layer
        pid_b = rest // num_kv_heads
        pid_kvh = rest - pid_b * num_kv_heads
        seq_len = tl.load(seqlens_ptr + pid_b)
        n_split, chunk = _num_splits_of(seq_len, max_splits, min_tokens, BLOCK_N)
        if pid_s < n_split:
            _split_item(q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr,
                        qk_scale, max_splits, num_kv_heads, pid_s, pid_kvh, pid_b, seq_len, n_split, chunk,
                        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                        stride_btb, stride_ob, stride_oh,
                        GROUP, BLOCK_G, GP, HEAD_DIM, BLOCK_N, PAGE_SIZE, PAGES, PAGE_LOADS, KV_TMA, PREFETCH, SINGLE,
                        FUSED, SPLIT_CHUNK, DOT_PRECISION)


@triton.jit
def _combine_kernel(
    seqlens_ptr, out_ptr, po_ptr, pm_ptr, max_splits, min_tokens, num_kv_heads, stride_ob, stride_oh,
    GROUP: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    pid_kvh = tl.program_id(0)
    pid_b = tl.program_id(1)
    seq_len = tl.load(seqlens_ptr + pid_b)
    n_split, chunk = _num_splits_of(seq_len, max_splits, min_tokens, BLOCK_N)
    row = (pid_b.to(tl.int64) * num_kv_heads + pid_kvh) * max_splits
    _merge_store(po_ptr + row * (GROUP * HEAD_DIM), pm_ptr + row * (GROUP * 2), out_ptr, n_split,
                 stride_ob, stride_oh, pid_b, pid_kvh, GROUP, GP, HEAD_DIM, SPLIT_CHUNK)


def _sm_count(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def _launch_fitted(kernel, grid, args, consts, stages, **options):
    """Launch at the deepest pipelining from `stages` down whose shared memory the device holds: the compiler's own
    verdict (its OutOfResources before anything launches), remembered per launch specialization."""
    key = (tuple(consts.items()), tuple(options.items()), stages)
    depth = _DEPTHS.get(key, max(1, int(stages)))
    while True:
        try:
            kernel[grid](*args, **consts, num_stages=depth, **options)
            _DEPTHS[key] = depth
            return
        except triton.runtime.OutOfResources:
            if depth == 1:
                raise
            depth -= 1


def grid_splits(batch, num_kv_heads, table_tokens, device):
    """The grid's splits per sequence, from shapes only (never reads tensor values).

    Policy 0 aims at SMs x PROGRAMS_PER_SM programs. Policy 1 takes PROGRAMS_PER_SM as the programs
    resident per SM and picks, among the split counts that fill at most WAVES waves, the one whose
    last wave is fullest (programs / (waves x slots); ties to fewer splits): equal-length sequences
    then finish together instead of leaving a part-empty last wave."""
    per_split = max(1, batch * num_kv_heads)
    by_len = -(-max(1, table_tokens) // max(BLOCK_N, MIN_TOKENS_PER_SPLIT))
    cap = max(1, min(by_len, MAX_SPLITS))
    slots = max(1, _sm_count(device) * PROGRAMS_PER_SM)
    if SPLIT_POLICY == 0:
        return max(1, min(-(-slots // per_split), cap))
    best, best_fill = 1, 0.0
    for s in range(1, cap + 1):
        waves = -(-per_split * s // slots)
        if waves > max(1, WAVES) and s > 1:
            break
        fill = per_split * s / (waves * slots)
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def launch_plan(batch, num_kv_heads, splits, device):
    """(work items, programs launched): items = splits x kv heads x batch (from shapes; the items past a sequence's
    real splits retire on the device). PERSISTENT 0 launches one program per item; PERSISTENT k > 0 at most SMs x
    k programs, each looping over the items with the grid's stride."""
    items = splits * num_kv_heads * batch
    if not PERSISTENT:
        return items, items
    return items, max(1, min(items, _sm_count(device) * int(PERSISTENT)))


def register_cap():
    """RESIDENCY_CAP's maxnreg: the most registers a thread (65,536 an SM, to a multiple of 8) at which the programs
    the grid counts on per SM are resident (policy 1: PROGRAMS_PER_SM; PERSISTENT k: k); None if off, none is
    counted on or no cap binds. Uncapped, PAGE_LOADS compiled to 236 and BLOCK_N 128 to 181."""
    per_sm = int(PERSISTENT) or (int(PROGRAMS_PER_SM) if SPLIT_POLICY == 1 else 0)
    fit = min(255, 65536 // (max(1, per_sm) * NUM_WARPS * 32) // 8 * 8) if per_sm and RESIDENCY_CAP else 255
    return fit if fit < 255 else None


def _page_rows_ok(cache):
    """KV_TMA's view of a [blocks, page, kv heads, d] cache as [blocks x page, kv heads x d] rows: each page's rows
    one stride apart, each row's heads contiguous, 16-byte aligned (TMA's rule)."""
    blocks, page, heads, d = cache.shape
    return TensorDescriptor is not None and cache.stride(3) == 1 and cache.stride(2) == d \
        and cache.stride(0) == page * cache.stride(1) and cache.data_ptr() % 16 == 0 \
        and (cache.stride(1) * cache.element_size()) % 16 == 0


def _tickets(device, n):
    """At least n zeroed tickets on `device`; a smaller buffer stays alive (a CUDA graph may launch on it)."""
    bufs = _TICKETS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    batch, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, head_dim_k = k_cache.shape
    assert head_dim_k == head_dim and v_cache.shape == k_cache.shape and num_q_heads % num_kv_heads == 0
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, "head_dim must be a power of two >= 16"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_table.stride(1) == 1
    group = num_q_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group))
    gp = triton.next_power_of_2(group)
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out

    splits = grid_splits(batch, num_kv_heads, block_table.shape[1] * page_size, q.device)
    single = splits == 1
    page_loads = bool(PAGE_LOADS) and page_size <= BLOCK_N and BLOCK_N % page_size == 0 \
        and (page_size & (page_size - 1)) == 0
    fused = bool(FUSED_COMBINE) and not single
    k_src, v_src = k_cache, v_cache
    if KV_TMA and BLOCK_N % page_size == 0 and _page_rows_ok(k_cache) and _page_rows_ok(v_cache):
        k_src, v_src = (TensorDescriptor(c, [num_blocks * page_size, num_kv_heads * head_dim], [c.stride(1), 1],
                                         [page_size, head_dim]) for c in (k_cache, v_cache))
    if single:
        po = pm = tickets = out
    else:
        po = torch.empty((batch, num_kv_heads, splits, group, head_dim), dtype=torch.float32, device=q.device)
        pm = torch.empty((batch, num_kv_heads, splits, group, 2), dtype=torch.float32, device=q.device)
        tickets = _tickets(q.device, batch * num_kv_heads) if fused else out
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    split_chunk = max(2, min(8, triton.next_power_of_2(splits)))
    items, programs = launch_plan(batch, num_kv_heads, splits, q.device)
    grid = (programs,) if PERSISTENT else (splits, num_kv_heads, batch)
    cap = register_cap()
    limits = {"maxnreg": cap} if cap and q.device.type == "cuda" else {}
    args = (q, k_cache, v_cache, k_src, v_src, block_table, seq_lens, out, po, pm, tickets, float(sm_scale) * _LOG2E,
            splits, max(BLOCK_N, MIN_TOKENS_PER_SPLIT), num_kv_heads, batch, items, q.stride(0), q.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0), out.stride(0), out.stride(1))
    consts = dict(GROUP=group, BLOCK_G=block_g, GP=gp, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, PAGE_SIZE=page_size,
                  PAGES=max(1, BLOCK_N // page_size), PAGE_LOADS=page_loads, KV_TMA=k_src is not k_cache,
                  PREFETCH=bool(PREFETCH) and k_src is k_cache,
                  SINGLE=single, FUSED=fused, SPLIT_CHUNK=split_chunk,
                  DOT_PRECISION=dot_precision, PERSISTENT=bool(PERSISTENT))
    stages = 1 if consts["PREFETCH"] else NUM_STAGES        # PREFETCH is its own pipeline
    _launch_fitted(_split_kernel, grid, args, consts, stages, num_warps=NUM_WARPS, **limits)
    if not single and not fused:
        _combine_kernel[(num_kv_heads, batch)](
            seq_lens, out, po, pm, splits, max(BLOCK_N, MIN_TOKENS_PER_SPLIT), num_kv_heads, out.stride(0),
            out.stride(1), GROUP=group, GP=gp, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, SPLIT_CHUNK=split_chunk,
            num_warps=4, num_stages=1)
    return out
