"""Paged GQA decode with the batch's work cut evenly by tokens (a kernel family for kevo's proposer).

What it does
    One query token per sequence attends over its paged KV cache, the GQA group of
    query heads in one tile (padded to 16 rows for tensor cores), as in
    decode_paged_gqa.py. What differs is how work reaches programs. The batch's
    K/V is laid out as one line of steps: sequence by sequence, kv head by kv head,
    BLOCK_N tokens a step (a sequence of L tokens: cdiv(L, BLOCK_N) steps per kv
    head). A fixed grid of SMs x PROGRAMS_PER_SM programs each takes an equal
    stretch of that line, read from the real lengths on the device: a stretch may
    end inside one (sequence, kv head), cover several whole ones, and start inside
    another. A piece that covers a whole (sequence, kv head) writes its output; a
    piece of one writes a partial (unnormalised output, running max and sum, exp2
    domain), and the last program of that (sequence, kv head) to finish, found with
    an atomic ticket, merges its pieces in the same launch. So a ragged batch
    loads every program with the same number of steps (within one), where equal
    split counts per sequence leave the longest chunk to set the time.
    MIN_STEPS_PER_PROGRAM: a batch with few steps uses fewer programs (each at
    least that many steps), so short contexts do not pay a merge per few tokens.
    MERGE_LAUNCH: every piece writes one tile (normalised output; max and sum in
    the padding rows) and a second launch merges each (sequence, kv head): one
    store in the loop, fewer registers (see Known limits).
    The grid and every buffer come from shapes; nothing is read on the host, so a
    call can be captured in a CUDA graph.

Knobs (module constants below, one per line)
    BLOCK_N, NUM_WARPS, NUM_STAGES, PROGRAMS_PER_SM, MIN_STEPS_PER_PROGRAM, MERGE_CHUNK, MAX_REGISTERS,
    MERGE_LAUNCH, CPU_SM_COUNT.

Why (measured, H200, 2026-12-04, ncu 2025.3.1 and tests/bench/vs_library.py)
    cuDNN's SDPA decode splits long sequences and merges them in a second kernel
    (cudnn::lean_reduction_kernel, seen in ncu on a ragged 8 x 32768 row). On
    ragged 32 x 4096 rows (lengths 0.5-1 x L) the equal-split GQA family's SMs
    were busy 55-97% of the kernel (sm__cycles_active min/max 114k/201k cycles
    of 207k) and drew 73% of DRAM peak, against 85% on equal lengths; this
    family's SMs 83-95% (173k/197k).

Measured (H200 2026-12-04, tests/bench/vs_library.py: bf16, 32 q / 8 kv heads, d 128,
page 16, shuffled pages, a 32768-token table; do_bench median, L2 flushed), defaults
with the register cap, us and x cuDNN SDPA (contiguous K/V; ragged: of the mean length):
    equal  32 x 4k 152.4 (0.87x; GQA family 0.95x), 64 x 4k 277.9 (0.90x; 0.99x),
           128 x 1k 154.1 (0.88x; 0.99x), 8 x 32k 273.7 (0.92x; 0.97x), 16 x 8k 150.8 (0.88x; 0.93x)
    ragged 32 x 4k 114.9 (0.87x; 0.86x), 64 x 4k 213.9 (0.89x; 0.90x), 128 x 1k 124.6
           (0.86x; 0.91x), 8 x 32k 214.9 (0.92x; 0.90x), 16 x 8k 117.7 (0.90x; 0.86x)
    So it evens out ragged batches (ahead of the GQA family on three of five
    ragged rows) but loses 6-13% to it on equal lengths: see the first limit.

Known limits
    * Registers decide how many programs reside, and the grid is one wave of
      SMs x PROGRAMS_PER_SM: a program that does not fit runs its stretch after
      the others. The compiler's count moves with each launch's specialisation
      (BLOCK_B, the batch a multiple of 16): 157-185 a thread at the defaults,
      117-157 with MERGE_LAUNCH (sm90, tests/bench/sm90_compile.py --batch B,
      equal to the H200's). So the kernel is launched with maxnreg =
      register_cap(): 168 for 3 per SM, 128 for 4 (0-24 spilled words). Before
      the cap, batch 64 compiled to 185 (2 per SM): 395.5 us at 64 x 4k against
      277.9 with it (tests/bench/kernel_variants.py, H200 2026-12-04); other rows
      within 1%. MERGE_LAUNCH with PROGRAMS_PER_SM 4: 0.90-0.94x cuDNN on four
      equal rows, 0.83x at 128 x 1k (not profiled: 1024 segments, one tile each).
    * The ticket buffer (one int32 per (sequence, kv head)) is reset to zero by
      the merging program; a launch killed mid-way would leave tickets behind.
    * Pieces are cut at BLOCK_N steps, so programs differ by at most one step;
      a (sequence, kv head) cut into many pieces pays one partial per piece, and
      short sequences (128 x 1k) pay a merge for most of them.
    * The block table is read once per token (one gather per K and V row).
"""
import torch
import triton
import triton.language as tl

BLOCK_N = 64  # KV tokens per step (power of two, 16..256): the unit work is cut in
NUM_WARPS = 4  # warps per program
NUM_STAGES = 2  # software-pipelining depth of the K/V loads
PROGRAMS_PER_SM = 3  # the grid: SMs x this many programs, each an equal stretch of the batch's steps
MIN_STEPS_PER_PROGRAM = 4  # on device: fewer programs when the batch has fewer steps than this per program
MERGE_CHUNK = 8  # partials read per step of the merge loop (power of two)
MAX_REGISTERS = 0  # a lower cap per thread than register_cap() derives from PROGRAMS_PER_SM (0: that one)
MERGE_LAUNCH = False  # True: every piece writes one tile and a second launch merges each (sequence, kv head)
CPU_SM_COUNT = 4  # pretend SM count when running on the CPU interpreter

_LOG2E = 1.4426950408889634
_TICKETS = {}  # device -> its int32 ticket buffers, the largest last, none freed


@triton.jit
def _owner(x, programs, total):
    """The program whose stretch [p x total // programs, (p + 1) x total // programs) holds step x."""
    return (((x + 1).to(tl.int64) * programs + total - 1) // total - 1).to(tl.int32)


@triton.jit
def _segment_of(x, offs_b, live_b, steps, upto, num_kv_heads):
    """The (sequence, kv head) segment, numbered sequence x kv heads + kv head, that holds step x."""
    b = tl.sum(tl.where(live_b & (upto <= x), 1, 0), 0)
    here = offs_b == b
    n_b = tl.sum(tl.where(here, steps, 0), 0)
    before = tl.sum(tl.where(here, upto, 0), 0) - n_b * num_kv_heads
    return b * num_kv_heads + (x - before) // tl.maximum(n_b, 1)   # x = the total (an idle program): unused


@triton.jit
def _stretch_start(p, programs, total):
    return ((p.to(tl.int64) * total) // programs).to(tl.int32)


@triton.jit
def _attend(q, k_head, v_head, bt_row, lo, hi, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
            BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    """Online softmax of one group's queries over tokens [lo, hi) of one sequence and kv head."""
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        phys = tl.load(bt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k = tl.load(k_head + (phys * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :],
                    mask=mask_n[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (phys * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :],
                    mask=mask_n[:, None], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fold(m_run, l_run, acc, m_s, l_s, o_s):
    """Log-sum-exp fold of a chunk of partials (max m_s, sum l_s, unnormalised output o_s; [chunk, rows(, D)])
    into the running (max, sum, output) of one (sequence, kv head)."""
    m_new = tl.maximum(m_run, tl.max(m_s, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_run - m_ref)
    w = tl.exp2(m_s - m_ref[None, :])
    return m_new, l_run * alpha + tl.sum(w * l_s, 0), acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 0)


@triton.jit
def _merge(po_ptr, pm_ptr, first, last, seg_start, programs, total, whole_at,
           GROUP: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_CHUNK: tl.constexpr,
           CG: tl.constexpr, TILES: tl.constexpr):
    """Log-sum-exp merge of the partials programs first..last wrote for one (sequence, kv head): slot 0 of
    a program whose stretch starts inside the segment (its first piece), slot 1 of the one before it. TILES
    (MERGE_LAUNCH): the partials are `_lean_kernel`'s SEPARATE tiles in po, a whole segment's at `whole_at`."""
    offs_c = tl.arange(0, MERGE_CHUNK)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    m_run = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, HEAD_DIM], dtype=tl.float32)
    for p0 in range(first, last + 1, MERGE_CHUNK):
        progs = p0 + offs_c
        live = progs <= last
        starts = ((progs.to(tl.int64) * total) // programs).to(tl.int32)
        part = progs.to(tl.int64) * 2 + tl.where(starts >= seg_start, 0, 1)
        msk = live[:, None] & mask_g[None, :]
        if TILES:
            row = tl.where(first == last, whole_at, part)[:, None] * (2 * GROUP) + offs_g[None, :]
            m_s = tl.load(po_ptr + (row + GROUP) * HEAD_DIM, mask=msk, other=float("-inf"))
            l_s = tl.load(po_ptr + (row + GROUP) * HEAD_DIM + 1, mask=msk, other=0.0)
            o_s = tl.load(po_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=msk[:, :, None],
                          other=0.0) * l_s[:, :, None]                   # a tile holds the normalised output
        else:
            ml_off = part[:, None] * GROUP + offs_g[None, :]
            if CG:
                m_s = tl.load(pm_ptr + 2 * ml_off, mask=msk, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(pm_ptr + 2 * ml_off + 1, mask=msk, other=0.0, cache_modifier=".cg")
                o_s = tl.load(po_ptr + ml_off[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                              mask=msk[:, :, None], other=0.0, cache_modifier=".cg")
            else:
                m_s = tl.load(pm_ptr + 2 * ml_off, mask=msk, other=float("-inf"))
                l_s = tl.load(pm_ptr + 2 * ml_off + 1, mask=msk, other=0.0)
                o_s = tl.load(po_ptr + ml_off[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                              mask=msk[:, :, None], other=0.0)
        m_run, l_run, acc = _fold(m_run, l_run, acc, m_s, l_s, o_s)
    return acc, l_run


@triton.jit
def _plan(seqlens_ptr, batch, num_kv_heads, grid_programs, min_steps, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """The plan, from the real lengths: steps per (sequence, kv head); the line's total; the programs in use."""
    offs_b = tl.arange(0, BLOCK_B)
    live_b = offs_b < batch
    lens = tl.load(seqlens_ptr + offs_b, mask=live_b, other=0)
    steps = tl.where(live_b, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0)   # a length-0 sequence: one empty step
    upto = tl.cumsum(steps, 0) * num_kv_heads                            # steps through sequence b's heads
    total = tl.sum(steps, 0) * num_kv_heads
    programs = tl.maximum(tl.minimum(grid_programs, tl.cdiv(total, min_steps)), 1)
    return offs_b, live_b, lens, steps, upto, total, programs


@triton.jit
def _lean_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr,
    qk_scale, batch, num_kv_heads, grid_programs, min_steps,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_btb, stride_ob, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_B: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    CG: tl.constexpr, DOT_PRECISION: tl.constexpr, SEPARATE: tl.constexpr,
):
    offs_b, live_b, lens, steps, upto, total, programs = _plan(seqlens_ptr, batch, num_kv_heads, grid_programs,
                                                               min_steps, BLOCK_N, BLOCK_B)
    pid = tl.program_id(0)
    u0 = _stretch_start(tl.minimum(pid, programs), programs, total)
    u1 = _stretch_start(tl.minimum(pid + 1, programs), programs, total)   # programs past `programs`: empty

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    # The (sequence, kv head) segments the stretch touches, in order: that of step u0 to that of step u1 - 1.
    s_lo = _segment_of(u0, offs_b, live_b, steps, upto, num_kv_heads)
    s_hi = tl.where(u1 > u0, _segment_of(u1 - 1, offs_b, live_b, steps, upto, num_kv_heads) + 1, s_lo)
    for s in range(s_lo, s_hi):
        b = s // num_kv_heads
        h = s - b * num_kv_heads
        here = offs_b == b
        n_b = tl.sum(tl.where(here, steps, 0), 0)
        len_b = tl.sum(tl.where(here, lens, 0), 0)
        seg_start = tl.sum(tl.where(here, upto, 0), 0) - (num_kv_heads - h) * n_b
        seg_end = seg_start + n_b
        u = tl.maximum(u0, seg_start)
        piece_end = tl.minimum(u1, seg_end)

        if SEPARATE:                                  # rows GROUP..2 GROUP-1: the same heads again
            heads = h * GROUP + offs_g % GROUP
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=(offs_g < 2 * GROUP)[:, None], other=0.0)
        else:
            heads = h * GROUP + offs_g
            q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=mask_g[:, None], other=0.0)
        acc, m_i, l_i = _attend(q, k_ptr + h.to(tl.int64) * stride_kh, v_ptr + h.to(tl.int64) * stride_vh,
                                bt_ptr + b.to(tl.int64) * stride_btb, (u - seg_start) * BLOCK_N,
                                tl.minimum((piece_end - seg_start) * BLOCK_N, len_b), qk_scale,
                                stride_kb, stride_ks, stride_vb, stride_vs,
                                BLOCK_G, HEAD_DIM, BLOCK_N, PAGE_SIZE, DOT_PRECISION)
        whole = (u == seg_start) & (piece_end == seg_end)     # the piece is the whole (sequence, kv head)
        if SEPARATE:
            # One store of one tile (a second store in this loop costs ~30 registers a thread on sm90): rows below
            # GROUP the normalised output, rows GROUP..2 GROUP-1 (the same heads) the max in column 0, the sum in
            # column 1; at row block 2 x pid + 0 (the stretch's first piece) or 1 (its last), or, for a whole
            # segment (its only piece), at 2 x grid programs + the segment.
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            tile = tl.where(offs_g[:, None] < GROUP, acc / l_safe[:, None],
                            tl.where(offs_d[None, :] == 0, m_i[:, None], l_i[:, None]))
            at = tl.where(whole, 2 * grid_programs + s, pid * 2 + tl.where(u == u0, 0, 1)).to(tl.int64)
            keep = (offs_g[:, None] < GROUP) | ((offs_g[:, None] < 2 * GROUP) & (offs_d[None, :] < 2))
            tl.store(po_ptr + (at * (2 * GROUP) + offs_g)[:, None] * HEAD_DIM + offs_d[None, :], tile, mask=keep)
        else:
            o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            if whole:
                l_safe = tl.where(l_i > 0.0, l_i, 1.0)
                tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
            else:
                # partials: po [grid programs, 2, GROUP, D], pm [grid programs, 2, GROUP, 2] (max, sum)
                part = pid.to(tl.int64) * 2 + tl.where(u == u0, 0, 1)
                ml_off = part * GROUP + offs_g
                tl.store(po_ptr + ml_off[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_g[:, None])
                tl.store(pm_ptr + 2 * ml_off, m_i, mask=mask_g)
                tl.store(pm_ptr + 2 * ml_off + 1, l_i, mask=mask_g)
                tl.debug_barrier()  # every thread's partial stores precede the ticket (release, gpu scope)
                first = _owner(seg_start, programs, total)
                last = _owner(seg_end - 1, programs, total)
                ticket = ticket_ptr + b.to(tl.int64) * num_kv_heads + h
                done = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
                if done == last - first:
                    tl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")  # reset for the next call
                    o, l_run = _merge(po_ptr, pm_ptr, first, last, seg_start, programs, total, 0,
                                      GROUP, GP, HEAD_DIM, MERGE_CHUNK, CG, False)
                    l_safe = tl.where(l_run > 0.0, l_run, 1.0)
                    offs_gp = tl.arange(0, GP)
                    m_ptrs = out_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + offs_gp)[:, None] * stride_oh \
                        + offs_d[None, :]
                    tl.store(m_ptrs, (o / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                             mask=(offs_gp < GROUP)[:, None])



@triton.jit
def _merge_kernel(po_ptr, out_ptr, seqlens_ptr, batch, num_kv_heads, grid_programs, min_steps, stride_ob, stride_oh,
                  GROUP: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_B: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """MERGE_LAUNCH: one program per (sequence, kv head) merges the tiles its pieces wrote (each normalised, with
    its max and sum) by log-sum-exp, and writes the output."""
    offs_b, live_b, lens, steps, upto, total, programs = _plan(seqlens_ptr, batch, num_kv_heads, grid_programs,
                                                               min_steps, BLOCK_N, BLOCK_B)
    s = tl.program_id(0)
    b = s // num_kv_heads
    h = s - b * num_kv_heads
    here = offs_b == b
    n_b = tl.sum(tl.where(here, steps, 0), 0)
    seg_start = tl.sum(tl.where(here, upto, 0), 0) - (num_kv_heads - h) * n_b
    first = _owner(seg_start, programs, total)
    last = _owner(seg_start + n_b - 1, programs, total)
    acc, l_run = _merge(po_ptr, po_ptr, first, last, seg_start, programs, total, 2 * grid_programs + s,
                        GROUP, GP, HEAD_DIM, MERGE_CHUNK, False, True)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    l_safe = tl.where(l_run > 0.0, l_run, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + offs_g)[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


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
    budget = int((getattr(props, "shared_memory_per_block_optin", 0) or 101376) * 0.9)
    while stages > 1 and smem_fixed + stages * smem_per_stage > budget:
        stages -= 1
    return stages


def grid_programs(device):
    """The programs launched: SMs x PROGRAMS_PER_SM (from the device only; the lengths decide on the device
    how many of them take work)."""
    return max(1, _sm_count(device) * int(PROGRAMS_PER_SM))


def register_cap():
    """Triton's maxnreg for the lean kernel: the most registers a thread at which the grid's PROGRAMS_PER_SM
    programs are all resident (65,536 an SM, to a multiple of 8), lowered by MAX_REGISTERS; None if no cap binds.
    The grid is one wave of equal stretches: a program that does not fit runs its stretch after the others."""
    fit = min(255, 65536 // (max(1, int(PROGRAMS_PER_SM)) * NUM_WARPS * 32) // 8 * 8)
    cap = min(fit, int(MAX_REGISTERS)) if MAX_REGISTERS else fit
    return cap if cap < 255 else None


def _tickets(device, n):
    """At least n zeroed tickets on `device`; a smaller buffer stays alive (a CUDA graph may launch on it)."""
    bufs = _TICKETS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    batch, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, head_dim_k = k_cache.shape
    assert head_dim_k == head_dim and v_cache.shape == k_cache.shape
    assert num_q_heads % num_kv_heads == 0
    assert head_dim >= 16 and (head_dim & (head_dim - 1)) == 0, "head_dim must be a power of two >= 16"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_table.stride(1) == 1
    group = num_q_heads // num_kv_heads
    separate = bool(MERGE_LAUNCH)
    block_g = max(16, triton.next_power_of_2(2 * group if separate else group))
    gp = triton.next_power_of_2(group)
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    programs = grid_programs(q.device)
    if separate:    # tiles: 2 per program (a stretch's first and last pieces), then 1 per (sequence, kv head)
        po = pm = torch.empty((2 * programs + batch * num_kv_heads, 2 * group, head_dim), dtype=torch.float32,
                              device=q.device)
    else:
        po = torch.empty((programs, 2, group, head_dim), dtype=torch.float32, device=q.device)
        pm = torch.empty((programs, 2, group, 2), dtype=torch.float32, device=q.device)
    tickets = _tickets(q.device, batch * num_kv_heads)
    elem = k_cache.element_size()
    stages = _fit_stages(q.device, NUM_STAGES, 2 * BLOCK_N * head_dim * elem, block_g * head_dim * elem)
    cap = register_cap()
    limits = {"maxnreg": cap} if cap and q.device.type == "cuda" else {}
    _lean_kernel[(programs,)](
        q, k_cache, v_cache, block_table, seq_lens, out, po, pm, tickets,
        float(sm_scale) * _LOG2E, batch, num_kv_heads, programs, max(1, int(MIN_STEPS_PER_PROGRAM)),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=block_g, GP=gp, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, PAGE_SIZE=page_size,
        BLOCK_B=triton.next_power_of_2(batch), MERGE_CHUNK=MERGE_CHUNK,
        CG=q.device.type == "cuda", DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SEPARATE=separate,
        num_warps=NUM_WARPS, num_stages=stages, **limits,
    )
    if separate:
        _merge_kernel[(batch * num_kv_heads,)](
            po, out, seq_lens, batch, num_kv_heads, programs, max(1, int(MIN_STEPS_PER_PROGRAM)),
            out.stride(0), out.stride(1), GROUP=group, GP=gp, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N,
            BLOCK_B=triton.next_power_of_2(batch), MERGE_CHUNK=MERGE_CHUNK, num_warps=4,
        )
    return out
