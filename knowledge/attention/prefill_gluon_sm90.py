"""Varlen causal prefill for Hopper in Gluon: FlashAttention-3's loader warp, two consumer warpgroups and the
two-stage order within each.

A kernel family for sm90 only (catalog arch sm90): Gluon is Triton's explicit dialect, on the compile stage's
allowlist, and it does not run in Triton's CPU interpreter. On the CPU it is compiled for sm90
(tests/bench/sm90_compile.py), never run. On a GPU its test is `pytest -m cuda tests/test_gluon_prefill.py`,
and its bench row is tests/bench/vs_library.py with this file as a SPEC (docs/BENCHMARKS.md). On an
H100 it passed every stage of the evaluator against the tiled head: accepted at +3.3% served (docs/BENCHMARKS.md).

Why Gluon
    The TMA family (prefill_causal_tma.py) measured 0.84-0.90x cuDNN SDPA at 4 x 2k, 1 x 8k and 8 x 4k on the
    H200. Compiled for sm90, its plain Triton 3.6 loop waits on every Q K^T wgmma at once, so a tile's softmax
    never runs beside a product on the tensor cores, and the two-stage order written in plain Triton compiles
    to the same waits (knowledge/attention/prefill.md).
    Gluon states the waits: `warpgroup_mma(..., is_async=True)` and `warpgroup_mma_wait(num_outstanding=N)`.

What it does with one warpgroup a program (PRODUCER_WARP off)
    One program owns BLOCK_M query rows of one query head of one sequence (cu_seqlens), heaviest query tiles
    first, and reads K/V tiles of its kv head (h // (Hq // Hkv)) through a ring of NUM_STAGES shared-memory
    stages filled by TMA, one mbarrier a stage. Step j issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, then
    waits for S_j alone (one wgmma group left in flight): tile j's softmax (exp2, sm_scale * log2 e folded into
    one multiply, row max on raw scores) runs while the tensor cores compute P_{j-1} V_{j-1}. Then it waits for
    that product, rescales O by the row max's change, keeps P_j in registers (bf16, the wgmma A operand), and
    refills the stage tile j-1 used. Each wait names the operands of the products it covers (P's registers among
    them), as Triton's own pipeliner does, so that none is reused while a product still reads it. Tiles wholly
    below the diagonal run with no mask; the diagonal ones mask keys past the query (which also hides keys past
    the sequence). Rows past the sequence are computed and not stored.

With a loader warp (PRODUCER_WARP; the defaults: PRODUCER_WARP, Q_REGS and PERSISTENT on)
    One program owns 2 x BLOCK_M rows: two consumer warpgroups (the default partition and a worker) run the loop
    above on one K/V ring, and a one-warp worker fills it (FlashAttention-3's producer). A stage is refilled once
    both consumers have released it (an `empty` mbarrier counting two arrivals), so neither waits for the other
    and no warpgroup issues loads. Each K/V tile in shared memory serves 128 rows, not 64. A work item is the
    program's 128 rows of one head of one sequence: one item a program, or (PERSISTENT) one program an SM taking
    items program_id, program_id + programs, ..., or (DYNAMIC) one an SM taking each next item from a counter all
    programs share (the loader takes it and writes its number to shared memory before Q's barrier). The ring's
    count and the barriers' phases run on across items, so the loader fills the next item's stages while the
    consumers finish this one. Items go heaviest query tiles first: of every sequence at once, or (SEQUENCE_MAJOR)
    one sequence after another, so that the items in flight read one sequence's K/V. L2_ORDER (on) chooses the
    second, with the plain stride, where the batch's K and V are more bytes than the GPU's L2 cache holds: then
    heaviest-first over every sequence reads every sequence's K/V at once, and mostly from DRAM.

Why shared memory bounds it (arithmetic, not a measurement)
    An sm90 SM's shared memory moves 128 B a cycle; its tensor cores do about 4,096 bf16 FLOP a cycle (989
    TFLOP/s over 132 SMs near 1.8 GHz). A wgmma reads its shared-memory operands each time: a 64 x 64 x 16 Q K^T
    step with both operands there reads 4 KB (32 cycles) for 32 cycles of products. Per K/V tile of a 64-row
    program (BLOCK_N 64, d 128): products 512 cycles; shared memory 640 (the TMA writes of K and V, 256; Q K^T
    reading Q and K, 256; P V reading V, 128). Q_REGS drops the Q reads (512: even); two warpgroups sharing a tile
    write it once for both (PRODUCER_WARP: 768 for 1,024 cycles of products with Q_REGS, 1,024 without).
    Measured, Q_REGS alone made the one-warpgroup kernel no faster; with PRODUCER_WARP it added about 2% (H100).

Knobs (module constants below, one per line)
    BLOCK_M (64 rows a warpgroup: NUM_WARPS = BLOCK_M / 16), BLOCK_N, NUM_STAGES, NUM_WARPS, Q_REGS, PRODUCER_WARP,
    CONSUMER_REGS, PINGPONG, PERSISTENT, SEQUENCE_MAJOR, ALTERNATE (on: odd rounds of the persistent walk reversed,
    so that the program that took a round's heaviest item takes the next round's lightest), L2_ORDER (on: above;
    where it applies, ALTERNATE does not: sequence-major with the reversal measured slower), BALANCED (each program
    walks the items the host dealt it: heaviest first to the least loaded program, from shapes, once a shape; on an
    H100 (2026-12-05) over four passes 1.127-1.156x / 0.970-0.979x / 1.047-1.083x cuDNN at 1 x 1k /
    4 x 2k / 1 x 8k against the plain stride's 1.009-1.028x / 0.960-0.972x / 0.994-1.035x, with each shape's deal made
    before the timing: a served mix of new shapes pays it, untimed, so it is a knob and not the default), DYNAMIC,
    RESCALE_THRESHOLD (FlashAttention-4's conditional rescaling: O and l keep their scale until some row's max grows
    by more than 2^threshold, one decision a warpgroup), PACKED_CVT (below), OVERLAP_ITEMS (a persistent consumer
    issues an item's last P V with the next item's first Q K^T and stores O while that product runs; needs 3+
    stages); DIRECT_LAUNCH on the host.

Compiled for sm90 (2026-12-05, Triton 3.6's ptxas, 32 q / 8 kv heads, d 128): one warpgroup a program, 160
    registers, 112 KB shared, two programs an SM; per step two wgmma groups, `wgmma.wait_group 1` before the 34
    ex2, `wait_group 0` after them, no shared-memory round trip for P. PRODUCER_WARP (the defaults): launched at
    168 registers a thread for 12 warps (the loader's partition rounds up to a warpgroup); `setmaxnreg` gives
    each consumer warpgroup 240 and the loader 24; 128-192 KB shared at 64-token tiles (3-5 stages), 224 KB at
    the default 128 (3 stages), one program an SM, nothing spilled. In SASS at 64-token tiles a consumer's step is
    309 instructions unmasked and 405 on the diagonal, 16 and 32 of them byte permutes (PRMT) swapping the halves
    of P's registers; with PACKED_CVT (the defaults since 2026-12-05) 297 and 377 (at 128: 450 and 692, 3.52
    instructions a key against 4.64), and no PRMT in the kernel (tests/bench/sm90_compile.py counts them);
    registers and shared memory unchanged. O is normalised by one reciprocal a row and a product a value: a
    division a value cost ptxas four instructions (3,824 -> 3,456 in the kernel).

Measured (docs/BENCHMARKS.md, 2026-12-05; x cuDNN SDPA at 4 x 2k / 1 x 8k / 8 x 4k, eager, each call on a new
    query): on the H200, PRODUCER_WARP, Q_REGS, PERSISTENT 0.95 / 0.99 / 0.90 (NUM_STAGES 4 or PINGPONG within
    the run's noise). On an H100 (thirty-fifth session) 0.93 / 1.00 / 0.92; DYNAMIC 0.89 / 0.97 / 0.89, with
    SEQUENCE_MAJOR 0.94 / 1.02 / 0.88; FlashAttention-3's tile (BLOCK_N 128, 2 stages, Q from shared memory)
    0.76 / 0.86 / 0.74. Under ncu at 8 x 4k it runs 9% more instructions than cuDNN's kernel (same grid: 132
    programs of three warpgroups) at the same rate, and reads 41% of DRAM's peak against cuDNN's 11%.
    Thirty-ninth session (H100, eager, one process per pass): PACKED_CVT against the plain conversion 1.008 /
    0.951 / 1.036 / 0.935 against 0.982 / 0.942 / 1.034 / 0.898 at 1 x 1k / 4 x 2k / 1 x 8k / 8 x 4k; with the
    reciprocal (the defaults), 0.96-0.97 / 1.00-1.03 / 0.93-0.96 at 4 x 2k / 1 x 8k / 8 x 4k over six passes
    (1 x 1k eager is the host's launch: 0.34-1.05). NUM_STAGES 4 or 5 0.98-0.99 at 4 x 2k and 0.82-0.95 at
    8 x 4k; PINGPONG 0.89-0.92 and SEQUENCE_MAJOR 0.91-0.94 at 8 x 4k; OVERLAP_ITEMS 1-3% slower on every row.
    Forty-third session (H100, CUDA graphs, tests/bench/vs_library.py): 128-token tiles at 3 stages (the defaults
    since; 224 KB shared, 168 registers, no spill) over five passes 0.986-1.006 / 1.045-1.093 / 0.949-1.009 at
    4 x 2k / 1 x 8k / 8 x 4k (median 0.996 / 1.062 / 0.993) and 1.031-1.034 at 1 x 1k, against 64-token tiles'
    0.958-0.968 / 0.995-1.054 / 0.895-0.948. At 2 stages the same tile read 0.78-0.90: the two-stage order keeps
    a tile's stage until the next tile's softmax is done, so with two stages the loader has none to refill. On
    the 128-token tile RESCALE_THRESHOLD 8.0 and OVERLAP_ITEMS (8 bytes spilled there) are slower; ALTERNATE,
    SEQUENCE_MAJOR, DYNAMIC, BALANCED and PINGPONG within the noise at 4 x 2k and 8 x 4k, 1.06-1.14 at 1 x 8k.
    Fifty-eighth session (H100, CUDA graphs, five calls): SEQUENCE_MAJOR 1.015-1.019x cuDNN at 8 x 4k (134 MB of
    K/V, over the 50 MB L2) against the plain stride's 0.944-0.996x, but 0.959-0.967x at 4 x 2k (34 MB) against
    0.990-1.001x; ALTERNATE 1.154 / 1.000-1.007 / 1.120 / 0.949-0.967x at 1 x 1k / 4 x 2k / 1 x 8k / 8 x 4k
    against the stride's 1.024-1.032 / 0.990-1.001 / 1.082-1.104 / 0.944-0.996x; both together 0.990x at 8 x 4k.
    Hence the defaults since: ALTERNATE on and L2_ORDER, which read 1.149-1.152 / 0.992-1.007 / 1.114-1.125 /
    0.997-1.071x over four calls on two H100s. Under ncu at 8 x 4k L2_ORDER's kernel read 453 MB from DRAM with
    91.6% of L2 sectors hit, heaviest-first 2,383 MB at 63.9%, cuDNN 403 MB at 92.9%; at 4 x 2k it reads 211 MB
    (L2 73%) against cuDNN's 101 MB (87%), the DRAM 30% busy.

Known limits
    * bf16 on CUDA only (TMA and wgmma); head_dim 64 or 128. Inputs a tensor descriptor cannot read (not
      contiguous, or not 16-byte aligned) are copied first.
    * The loader warp's program is one per SM (registers), so its consumers' softmax overlaps only each other's
      products and their own P V. PINGPONG orders the two consumers' products with two mbarriers (FlashAttention-3
      uses named barriers) over the tiles both run unmasked, where both take the same number of steps.
    * Programs of short sequences in a batch with a long max_seqlen exit at once (launched, not free); a
      persistent program skips such items.
    * Launching from Python costs tens of microseconds (descriptors, the launcher): at 1 x 1k it is 0.3-0.6x
      cuDNN called eagerly and 1.03-1.09x replayed from a CUDA graph (H200). DIRECT_LAUNCH (host side, off; not a
      catalog knob: microbench hides the host's time) skips the JIT's argument binding for a specialization met
      before: the kernel Triton compiled for it is kept under what Triton 3.6 specializes on (_specialization) and
      launched itself. Its outputs equal the JIT launch's bit for bit across specializations (GPU test, H100).
      Whether it saves host time is not settled: one pass of tests/bench/launch_cost.py (H100) read 131 -> 100 us
      a call at 1 x 1k and 77 -> 100 us at 4 x 2k (the reference tiled kernel 74 and 40 us); the rest of the cost
      is the three descriptors (their checks) and the launcher encoding them.
    * Triton 3.6 mis-compiles a consumer that carries wgmma operands or results through an `if` (a branch that
      issues or waits for a product, or yields an MMA-layout tensor): OVERLAP_ITEMS written so gave wrong outputs
      and out-of-range shared addresses on an H100 (compute-sanitizer at the branch's wgmma) though its TTGIR read
      right. Its loop now walks live items only and issues its products unconditionally (a product of zeros
      before the first item); only the store and the barrier arrivals are under `if`.
    * BALANCED deals each new shape (heads, batch, query tiles) on the host: 0.6 ms at 4 x 2k, 2.6 ms at 8 x 4k on
      one CPU core, then a copy to the device; the last 256 shapes are kept. Past 32 items a program it walks the
      plain stride (or ALTERNATE's): at 8 x 4k (63) the dealt walk measured 0.907-0.946x cuDNN over five passes
      against the stride's 0.890-0.956x (H100), no better for its 2.6 ms deal. A CUDA graph captured around such a
      call reads its shape's walk from the device buffer kept here, which is released 256 shapes later (the served
      engine runs prefill eagerly). Compiled for sm90 it has the defaults' registers and shared memory (168, 128
      KB) and 56 more SASS instructions (the walk's loads). A ragged batch is dealt as if every sequence filled
      max_seqlen's query tiles.
    * DYNAMIC gives wrong outputs now and then on an H100 (2026-12-06), never seen alone: a replay's spot check
      (one served call of 38: a few rows checked of a sequence of 3,968 in a batch of 3, s50's c022), and in
      tests/bench/repeat_check.py's three processes sharing the GPU, rows left unwritten (NaN from the poisoned
      allocator) or wrong. Always a DYNAMIC kernel's first call on a shape, and only when it was the first kernel
      called on that shape after the float32 reference: so in at least 5 of 13 such runs; called second on each
      shape, the same compiled kernel was wrong in none of 4 runs, nor was a kernel without DYNAMIC in any. 4,800
      calls alone (40 shapes, 16 and 32 query heads) were right, as are parity and the GPU tests.
      Unwritten rows mean work skipped (an item, or a part of its store), not wrong arithmetic. The sm90 compile
      shows the loader's atomic broadcast through a shared word of its own (the unused turn barriers' space), the
      item's number stored by every lane before the one arrival on Q's barrier, and the consumers reading it after
      that barrier completes; racecheck flags that word, which only mbarrier waits order (racecheck may not follow
      them). Until explained it is not a catalog knob.
"""
import heapq
from functools import lru_cache

import torch
import triton
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language.nvidia.hopper.mbarrier as mbarrier
import triton.experimental.gluon.language.nvidia.hopper.tma as tma
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

BLOCK_M = 64  # query rows per program (16 per warp: 64 with 4 warps, 128 with 8)
BLOCK_N = 128  # KV tokens per step
NUM_STAGES = 3  # K/V tiles in the TMA ring
NUM_WARPS = 4  # warps per program: BLOCK_M // 16
Q_REGS = True  # Q K^T with Q in registers (read from shared memory once) rather than from shared memory each step
PRODUCER_WARP = True  # two consumer warpgroups (2 x BLOCK_M rows) share each K/V tile a loader warp fills
CONSUMER_REGS = 240  # registers a consumer warpgroup's threads get (PRODUCER_WARP; the loader gets 24)
PINGPONG = False  # PRODUCER_WARP: the two consumer warpgroups take turns to issue their products
PERSISTENT = True  # PRODUCER_WARP: one program an SM walks the work items, loading the next one's tiles early
SEQUENCE_MAJOR = False  # PRODUCER_WARP: work items one sequence after another (else heaviest tiles of all first)
ALTERNATE = True  # PERSISTENT, not DYNAMIC: every odd round of the programs' walk over the items runs in reverse
L2_ORDER = True  # where the batch's K and V outgrow the GPU's L2 cache: items sequence-major, the plain stride
BALANCED = False  # PERSISTENT, not DYNAMIC: each program walks items dealt it on the host, heaviest to least loaded
DYNAMIC = False  # PRODUCER_WARP: one program an SM, each taking its next item from a counter all programs share
RESCALE_THRESHOLD = 0.0  # log2 units: O is rescaled only on a step where some row's max grew by more; 0: every step
OVERLAP_ITEMS = False  # PRODUCER_WARP, 3+ stages, not DYNAMIC: an item's last P V beside the next one's first Q K^T
PACKED_CVT = True  # P to bf16 two values an instruction (cvt.rn.bf16x2.f32), packed as the P V wgmma reads them
DIRECT_LAUNCH = False  # host: a specialization met before is launched as compiled, without the JIT's argument binding

_LOG2E = 1.4426950408889634
_RESCALE_THRESHOLD = gl.constexpr(RESCALE_THRESHOLD)
_PACKED_CVT = gl.constexpr(PACKED_CVT)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, ready, slot, tile, n_tiles, row0, col,
             STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA loads of K/V tile `tile` into the ring's stage for `slot` (the ring's running count), if the tile
    exists."""
    s = slot % STAGES
    pred = tile < n_tiles
    bar = ready.index(s)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row0 + tile * BLOCK_N, col], bar, k_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row0 + tile * BLOCK_N, col], bar, v_smem.index(s), pred=pred)


@gluon.jit
def _p_bf16(p):
    """P in bf16, rounded to nearest even either way. PACKED_CVT: one cvt.rn.bf16x2.f32 a pair of neighbouring
    values (the low half the first, as Triton packs them), so the loop carries P in the 32-bit registers the P V wgmma
    reads; `.to` leaves Triton 3.6 converting one value at a time, and ptxas then swaps the halves of each register
    (16 byte permutes a step, sm90 SASS)."""
    if _PACKED_CVT:
        return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return p.to(gl.bfloat16)


@gluon.jit
def _masked(s, m_start, tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    offs_m = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    return gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))


@gluon.jit
def _first_tile(q_op, k_smem, slot, m_start, qk_scale, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr):
    """Tile 0's scores and softmax (masked: cheap once, and needed when it is the diagonal tile), its K in the
    ring's stage for `slot`: (P, m, l)."""
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_tile = k_smem.index(slot % STAGES)
    s_tok = warpgroup_mma(q_op, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_op, k_tile))
    return _first_softmax(s, m_start, qk_scale, BLOCK_M, BLOCK_N, s_layout, p_layout)


@gluon.jit
def _first_softmax(s, m_start, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                   p_layout: gl.constexpr):
    """Tile 0's softmax from its scores `s`: (P, m, l)."""
    s = _masked(s, m_start, 0, BLOCK_M, BLOCK_N, s_layout)
    m_i = gl.max(s, 1) * qk_scale
    p = gl.exp2(s * qk_scale - m_i[:, None])
    return gl.convert_layout(_p_bf16(p), p_layout), m_i, gl.sum(p, 1)


@gluon.jit
def _last_pv(p_prev, v_smem, acc, slot, STAGES: gl.constexpr):
    """The last tile's P V (its V in the ring's stage for `slot`), waited for."""
    v_last = v_smem.index(slot % STAGES)
    acc_tok = warpgroup_mma(p_prev, v_last, acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_prev, v_last))
    return acc


@gluon.jit
def _store(acc, l_i, o_ptr, seq_start, seq_len, m_start, pid_h, stride_ot, stride_oh, BLOCK_M: gl.constexpr,
           HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
    """O = acc / l for the rows inside the sequence: one reciprocal a row, then a product a value (a division a value
    costs ptxas four instructions: range scalings around the shared reciprocal)."""
    inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
    o = acc * inv_l[:, None]
    offs_m = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    rows = (seq_start + offs_m).to(gl.int64)
    ptrs = o_ptr + rows[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :]
    gl.store(ptrs, o.to(gl.bfloat16), mask=(offs_m < seq_len)[:, None])


@gluon.jit
def _step(q_op, k_smem, v_smem, ready, empty, k_desc, v_desc, p_prev, m_i, l_i, acc, tile, n_tiles, row0, col,
          m_start, qk_scale, MASK: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
          RELEASE: gl.constexpr, turns, WG: gl.constexpr, TURN: gl.constexpr, slot0, turn0):
    """Tile `tile` (>= 1): its scores issued, then tile-1's P V, whose product runs while this tile's softmax does.
    Then the stage tile-1 used is refilled (one warpgroup, its own loads) or released to the loader warp (RELEASE).
    TURN: the two consumer warpgroups take turns to issue their products (warpgroup WG waits for `turns[WG]`,
    warpgroup 0 first, and passes the turn on once its two are issued), so that one's softmax runs beside the
    other's products. The ring's running count is slot0 at tile 0, the turns' turn0 at tile 1."""
    s_idx = (slot0 + tile) % STAGES
    mbarrier.wait(ready.index(s_idx), ((slot0 + tile) // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    k_tile = k_smem.index(s_idx)
    if TURN:
        mbarrier.wait(turns.index(WG), ((turn0 + tile - 1) & 1) ^ (1 - WG))
    s_tok = warpgroup_mma(q_op, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    v_prev = v_smem.index((slot0 + tile - 1) % STAGES)
    acc_tok = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
    if TURN:
        mbarrier.arrive(turns.index(1 - WG), count=1)
    # this tile's scores; tile-1's P V may still run (its operands, P's registers among them, kept alive to its wait)
    s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_op, k_tile))
    if MASK:
        s = _masked(s, m_start, tile, BLOCK_M, BLOCK_N, s_layout)
    m_tile = gl.max(s, 1) * qk_scale
    if _RESCALE_THRESHOLD > 0:
        # FlashAttention-4's conditional rescaling: the warpgroup keeps its rows' maxima, and so O's scale, until
        # one grows by more than the threshold; P stays under 2^threshold meanwhile. One decision a warpgroup.
        rescale = gl.max(m_tile - m_i, 0) > _RESCALE_THRESHOLD
        m_new = gl.where(rescale, gl.maximum(m_i, m_tile), m_i)
    else:
        m_new = gl.maximum(m_i, m_tile)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_prev, v_prev))
    if _RESCALE_THRESHOLD > 0:
        if rescale:
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    else:
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_prev = gl.convert_layout(_p_bf16(p), p_layout)
    if RELEASE:
        mbarrier.arrive(empty.index((slot0 + tile - 1) % STAGES), count=1)
    else:
        _load_kv(k_desc, v_desc, k_smem, v_smem, ready, tile - 1 + STAGES, tile - 1 + STAGES, n_tiles, row0, col,
                 STAGES, BLOCK_N)
    return p_prev, m_new, l_i, acc


@gluon.jit
def _prefill_kernel(q_desc, k_desc, v_desc, o_ptr, cu_ptr, qk_scale, num_m_tiles, stride_ot, stride_oh,
                    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, Q_REGS: gl.constexpr, num_warps: gl.constexpr):
    pid_h = gl.program_id(0)
    pid_m = num_m_tiles - 1 - gl.program_id(1)
    pid_b = gl.program_id(2)
    seq_start = gl.load(cu_ptr + pid_b)
    seq_len = gl.load(cu_ptr + pid_b + 1) - seq_start
    m_start = pid_m * BLOCK_M
    if m_start >= seq_len:
        return

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    col = (pid_h // GROUP) * HEAD_DIM
    hi = gl.minimum(seq_len, m_start + BLOCK_M)      # keys 0..hi-1
    n_tiles = gl.cdiv(hi, BLOCK_N)
    n_off = m_start // BLOCK_N                        # tiles wholly below the diagonal: no mask
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [seq_start + m_start, pid_h * HEAD_DIM], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_smem, v_smem, ready, i, i, n_tiles, seq_start, col, STAGES, BLOCK_N)
    mbarrier.wait(q_bar, 0)
    if Q_REGS:
        q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q_op = q_smem

    mbarrier.wait(ready.index(0), 0)
    p_prev, m_i, l_i = _first_tile(q_op, k_smem, 0, m_start, qk_scale, STAGES, BLOCK_M, BLOCK_N, s_layout, p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    for tile in range(1, n_off):
        p_prev, m_i, l_i, acc = _step(q_op, k_smem, v_smem, ready, ready, k_desc, v_desc, p_prev, m_i, l_i, acc, tile,
                                      n_tiles, seq_start, col, m_start, qk_scale, False, STAGES, BLOCK_M, BLOCK_N,
                                      s_layout, o_layout, p_layout, False, ready, 0, False, 0, 0)
    for tile in range(gl.maximum(n_off, 1), n_tiles):
        p_prev, m_i, l_i, acc = _step(q_op, k_smem, v_smem, ready, ready, k_desc, v_desc, p_prev, m_i, l_i, acc, tile,
                                      n_tiles, seq_start, col, m_start, qk_scale, True, STAGES, BLOCK_M, BLOCK_N,
                                      s_layout, o_layout, p_layout, False, ready, 0, False, 0, 0)
    acc = _last_pv(p_prev, v_smem, acc, n_tiles - 1, STAGES)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(q_bar)
    _store(acc, l_i, o_ptr, seq_start, seq_len, m_start, pid_h, stride_ot, stride_oh, BLOCK_M, HEAD_DIM, o_layout)


@gluon.jit
def _ws_item(item, cu_ptr, num_heads, batch, num_m_tiles, BLOCK_M: gl.constexpr, SEQUENCE_MAJOR: gl.constexpr):
    """Work item -> (query head, sequence start, its length, first row), heads fastest (a kv head's query heads
    side by side). SEQUENCE_MAJOR: one sequence's items after another's, each sequence's heaviest query tiles
    first, so that the items in flight read one sequence's K/V (L2 holds it); else the heaviest query tiles of
    every sequence first."""
    pid_h = item % num_heads
    rest = item // num_heads
    if SEQUENCE_MAJOR:
        pid_b = rest // num_m_tiles
        m0 = (num_m_tiles - 1 - rest % num_m_tiles) * 2 * BLOCK_M
    else:
        pid_b = rest % batch
        m0 = (num_m_tiles - 1 - rest // batch) * 2 * BLOCK_M
    seq_start = gl.load(cu_ptr + pid_b)
    return pid_h, seq_start, gl.load(cu_ptr + pid_b + 1) - seq_start, m0


@gluon.jit
def _ws_live(item, cu_ptr, num_heads, batch, num_m_tiles, num_items, BLOCK_M: gl.constexpr,
             SEQUENCE_MAJOR: gl.constexpr):
    """Whether `item` is a work item with rows in its sequence (False past the last item)."""
    _, _, seq_len, m0 = _ws_item(gl.minimum(item, num_items - 1), cu_ptr, num_heads, batch, num_m_tiles, BLOCK_M,
                                 SEQUENCE_MAJOR)
    return (item < num_items) & (m0 < seq_len)


@gluon.jit
def _ws_walk_end(num_items, work_ptr, WALK: gl.constexpr):
    """Where each program's walk over positions program_id, program_id + programs, ... ends: num_items, or (WALK 1,
    ALTERNATE) a whole number of rounds, positions past the last item mapping to none, or (WALK 2, BALANCED) the
    dealt walk's length, its first entry."""
    if WALK == 2:
        return gl.load(work_ptr)
    elif WALK == 1:
        return gl.cdiv(num_items, gl.num_programs(0)) * gl.num_programs(0)
    else:
        return num_items


@gluon.jit
def _ws_nth(k, work_ptr, WALK: gl.constexpr):
    """Position k (program_id + round x programs) -> its work item: k, or (WALK 1, ALTERNATE) on odd rounds the item
    of the mirrored program, so that the program that took a round's heaviest item takes the next round's lightest
    (items go heaviest first: a plain walk gives program 0 the heavier item of every round), or (WALK 2, BALANCED)
    the dealt walk's entry (num_items where a program has no item left)."""
    if WALK == 2:
        return gl.load(work_ptr + 1 + k)
    elif WALK == 1:
        programs = gl.num_programs(0)
        r = k // programs
        return k + (r & 1) * (programs - 1 - 2 * (k - r * programs))
    else:
        return k


@gluon.jit
def _ws_grab(work_ptr, cu_ptr, num_heads, batch, num_m_tiles, num_items, BLOCK_M: gl.constexpr,
             SEQUENCE_MAJOR: gl.constexpr):
    """DYNAMIC: the next item with rows in its sequence from the counter all programs share, or one past the last
    (the atomic runs on one lane; the warp gets its result)."""
    item = gl.atomic_add(work_ptr, 1)
    while (item < num_items) & (not _ws_live(item, cu_ptr, num_heads, batch, num_m_tiles, num_items, BLOCK_M,
                                             SEQUENCE_MAJOR)):
        item = gl.atomic_add(work_ptr, 1)
    return item


@gluon.jit
def _ws_item_id(item_smem):
    """DYNAMIC: the item the loader wrote to `item_smem`, read by a consumer warpgroup."""
    return gl.max(item_smem.load(gl.BlockedLayout([1], [32], [4], [0])), 0)


@gluon.jit
def _ws_load_item(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, item_smem, item,
                  pid_h, seq_start, seq_len, m0, slot, done, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DYNAMIC: gl.constexpr):
    """The loader's part of one item: its Q tiles once both warpgroups have released the last ones (`q_empty`;
    DYNAMIC: the item's number to `item_smem` first), then its K/V tiles, each into a stage both warpgroups have
    released (`empty` completes when both arrive; a fresh barrier counts as released). (slot, done) after it."""
    n_tiles, _, _ = _ws_rows(seq_len, m0, BLOCK_M, BLOCK_N, 0)
    mbarrier.wait(q_empty, (done & 1) ^ 1)
    if DYNAMIC:
        item_smem.store(gl.zeros([1], gl.int32, gl.BlockedLayout([1], [32], [1], [0])) + item)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [seq_start + m0, pid_h * HEAD_DIM], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [seq_start + m0 + BLOCK_M, pid_h * HEAD_DIM], q_bar, q_smem.index(1))
    for tile in range(n_tiles):
        mbarrier.wait(empty.index((slot + tile) % STAGES), (((slot + tile) // STAGES) & 1) ^ 1)
        _load_kv(k_desc, v_desc, k_smem, v_smem, ready, slot + tile, tile, n_tiles, seq_start,
                 (pid_h // GROUP) * HEAD_DIM, STAGES, BLOCK_N)
    return slot + n_tiles, done + 1


@gluon.jit
def _ws_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns, item_smem,
               o_ptr, cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, qk_scale, stride_ot, stride_oh,
               GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, Q_REGS: gl.constexpr, PINGPONG: gl.constexpr, SEQUENCE_MAJOR: gl.constexpr,
               DYNAMIC: gl.constexpr, OVERLAP_ITEMS: gl.constexpr, WALK: gl.constexpr, WG: gl.constexpr):
    """The loader warp, over the program's work items (items program_id, program_id + programs, ...; DYNAMIC:
    taken from the shared counter, then an end mark, num_items, with a bare arrival on Q's barrier). Its
    arguments are the consumers': Gluon gives every worker partition the same signature. The ring's
    count runs on across items, so the next item's first tiles load while the consumers finish this one."""
    slot = 0
    done = 0
    if DYNAMIC:
        item = _ws_grab(work_ptr, cu_ptr, num_heads, batch, num_m_tiles, num_items, BLOCK_M, SEQUENCE_MAJOR)
        while item < num_items:
            pid_h, seq_start, seq_len, m0 = _ws_item(item, cu_ptr, num_heads, batch, num_m_tiles, BLOCK_M,
                                                     SEQUENCE_MAJOR)
            slot, done = _ws_load_item(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty,
                                       item_smem, item, pid_h, seq_start, seq_len, m0, slot, done, GROUP, HEAD_DIM,
                                       BLOCK_M, BLOCK_N, STAGES, DYNAMIC)
            item = _ws_grab(work_ptr, cu_ptr, num_heads, batch, num_m_tiles, num_items, BLOCK_M, SEQUENCE_MAJOR)
        mbarrier.wait(q_empty, (done & 1) ^ 1)              # the consumers have read the last item's number
        item_smem.store(gl.zeros([1], gl.int32, gl.BlockedLayout([1], [32], [1], [0])) + num_items)
        mbarrier.arrive(q_bar, count=1)
    else:
        for k in range(gl.program_id(0), _ws_walk_end(num_items, work_ptr, WALK), gl.num_programs(0)):
            item = _ws_nth(k, work_ptr, WALK)
            pid_h, seq_start, seq_len, m0 = _ws_item(gl.minimum(item, num_items - 1), cu_ptr, num_heads, batch,
                                                     num_m_tiles, BLOCK_M, SEQUENCE_MAJOR)
            if (item < num_items) & (m0 < seq_len):
                slot, done = _ws_load_item(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready,
                                           empty, item_smem, item, pid_h, seq_start, seq_len, m0, slot, done, GROUP,
                                           HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, DYNAMIC)


@gluon.jit
def _ws_rows(seq_len, m0, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WG: gl.constexpr):
    """An item's K/V tiles (both warpgroups'), warpgroup WG's first row and its own tile count."""
    m_start = m0 + WG * BLOCK_M
    return (gl.cdiv(gl.minimum(seq_len, m0 + 2 * BLOCK_M), BLOCK_N), m_start,
            gl.cdiv(gl.minimum(seq_len, m_start + BLOCK_M), BLOCK_N))


@gluon.jit
def _ws_turns(m0, my_n, BLOCK_N: gl.constexpr):
    """PINGPONG turns an item takes: its steps over tiles unmasked for both warpgroups."""
    return gl.maximum(gl.minimum(m0 // BLOCK_N, my_n) - 1, 0)


@gluon.jit
def _ws_q(q_smem, q_bar, q_empty, done, s_layout: gl.constexpr, Q_REGS: gl.constexpr, WAIT_Q: gl.constexpr,
          WG: gl.constexpr):
    """This warpgroup's Q operand for the program's `done`-th item: in registers, Q released at once (Q_REGS), or
    its shared-memory tile. WAIT_Q: wait for Q's barrier first."""
    q_w = q_smem.index(WG)
    if WAIT_Q:
        mbarrier.wait(q_bar, done & 1)
    if Q_REGS:
        q_op = q_w.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
        fence_async_shared()                        # these reads before the loader's next TMA write
        mbarrier.arrive(q_empty, count=1)
    else:
        q_op = q_w
    return q_op


@gluon.jit
def _ws_steps(q_op, k_smem, v_smem, ready, empty, k_desc, v_desc, turns, p_prev, m_i, l_i, acc, seq_start, m0,
              m_start, my_n, n_tiles, slot, turn, qk_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Tiles 1 .. my_n - 1 of an item on the shared ring (each stage released once its P V is done): unmasked for
    both warpgroups (PINGPONG's turns there), unmasked for this one, then its diagonal. (P, m, l, acc) after them,
    the last tile's P V not yet issued."""
    n_off = gl.minimum(m_start // BLOCK_N, my_n)    # tiles wholly below this warpgroup's diagonal: no mask
    n_both = gl.minimum(m0 // BLOCK_N, my_n)        # unmasked for both warpgroups: the same count
    for tile in range(1, n_both):
        p_prev, m_i, l_i, acc = _step(q_op, k_smem, v_smem, ready, empty, k_desc, v_desc, p_prev, m_i, l_i, acc,
                                      tile, n_tiles, seq_start, 0, m_start, qk_scale, False, STAGES, BLOCK_M,
                                      BLOCK_N, s_layout, o_layout, p_layout, True, turns, WG, PINGPONG, slot, turn)
    for tile in range(gl.maximum(n_both, 1), n_off):
        p_prev, m_i, l_i, acc = _step(q_op, k_smem, v_smem, ready, empty, k_desc, v_desc, p_prev, m_i, l_i, acc,
                                      tile, n_tiles, seq_start, 0, m_start, qk_scale, False, STAGES, BLOCK_M,
                                      BLOCK_N, s_layout, o_layout, p_layout, True, turns, WG, False, slot, turn)
    for tile in range(gl.maximum(n_off, 1), my_n):
        p_prev, m_i, l_i, acc = _step(q_op, k_smem, v_smem, ready, empty, k_desc, v_desc, p_prev, m_i, l_i, acc,
                                      tile, n_tiles, seq_start, 0, m_start, qk_scale, True, STAGES, BLOCK_M,
                                      BLOCK_N, s_layout, o_layout, p_layout, True, turns, WG, False, slot, turn)
    return p_prev, m_i, l_i, acc


@gluon.jit
def _ws_retire(acc, l_i, ready, empty, o_ptr, last, stop, seq_start, seq_len, m_start, pid_h, stride_ot, stride_oh,
               STAGES: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
    """An item whose last P V is done: its last stage (ring count `last`) released, the other warpgroup's tiles
    past it (counts last + 1 .. stop - 1) waited for and released, so that both warpgroups release every stage
    once, and O stored."""
    mbarrier.arrive(empty.index(last % STAGES), count=1)
    for count in range(last + 1, stop):
        mbarrier.wait(ready.index(count % STAGES), (count // STAGES) & 1)
        mbarrier.arrive(empty.index(count % STAGES), count=1)
    _store(acc, l_i, o_ptr, seq_start, seq_len, m_start, pid_h, stride_ot, stride_oh, BLOCK_M, HEAD_DIM, o_layout)


@gluon.jit
def _ws_consume_item(k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns, o_ptr, pid_h,
                     seq_start, seq_len, m0, slot, done, turn, qk_scale, stride_ot, stride_oh, HEAD_DIM: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_REGS: gl.constexpr,
                     PINGPONG: gl.constexpr, WAIT_Q: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG's part of one item: rows m0 + WG * BLOCK_M onward, the two-stage loop on the shared
    K/V ring, releasing each stage once its P V is done, and Q once it no longer reads it (in registers at once
    with Q_REGS, else after its last Q K^T). Past its own diagonal it only waits for and releases the item's last
    tiles, so that both warpgroups release every stage once. A warpgroup whose rows start past the sequence
    computes tiles up to the sequence's end and stores nothing. WAIT_Q: wait for Q's barrier first (DYNAMIC
    waits before reading the item's number). (slot, done, turn) after it."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    n_tiles, m_start, my_n = _ws_rows(seq_len, m0, BLOCK_M, BLOCK_N, WG)
    q_op = _ws_q(q_smem, q_bar, q_empty, done, s_layout, Q_REGS, WAIT_Q, WG)
    mbarrier.wait(ready.index(slot % STAGES), (slot // STAGES) & 1)
    p_prev, m_i, l_i = _first_tile(q_op, k_smem, slot, m_start, qk_scale, STAGES, BLOCK_M, BLOCK_N, s_layout,
                                   p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    p_prev, m_i, l_i, acc = _ws_steps(q_op, k_smem, v_smem, ready, empty, k_desc, v_desc, turns, p_prev, m_i, l_i,
                                      acc, seq_start, m0, m_start, my_n, n_tiles, slot, turn, qk_scale, BLOCK_M,
                                      BLOCK_N, STAGES, PINGPONG, WG, s_layout, o_layout, p_layout)
    acc = _last_pv(p_prev, v_smem, acc, slot + my_n - 1, STAGES)
    if not Q_REGS:
        mbarrier.arrive(q_empty, count=1)
    _ws_retire(acc, l_i, ready, empty, o_ptr, slot + my_n - 1, slot + n_tiles, seq_start, seq_len, m_start, pid_h,
               stride_ot, stride_oh, STAGES, BLOCK_M, HEAD_DIM, o_layout)
    return slot + n_tiles, done + 1, turn + _ws_turns(m0, my_n, BLOCK_N)


@gluon.jit
def _ws_next_live(k, step, end, cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, BLOCK_M: gl.constexpr,
                  SEQUENCE_MAJOR: gl.constexpr, WALK: gl.constexpr):
    """The first of positions k, k + step, ... (before `end`) whose item has rows in its sequence, or one at or past
    `end`."""
    while (k < end) & (not _ws_live(_ws_nth(k, work_ptr, WALK), cu_ptr, num_heads, batch, num_m_tiles, num_items,
                                    BLOCK_M, SEQUENCE_MAJOR)):
        k += step
    return k


@gluon.jit
def _ws_consumer_overlapped(k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns, o_ptr,
                            cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, qk_scale, stride_ot, stride_oh,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, Q_REGS: gl.constexpr, PINGPONG: gl.constexpr,
                            SEQUENCE_MAJOR: gl.constexpr, WALK: gl.constexpr, WG: gl.constexpr):
    """OVERLAP_ITEMS: consumer warpgroup WG over its live items of program_id, program_id + programs, ..., each
    item's last P V issued together with the next item's first Q K^T, its stage released and its O stored once the
    first is done (the previous item's P, acc, l and where its rows go carried into the next iteration). Needs
    STAGES >= 3: the next item's first tile is waited for before this item's last stage is released.
    No product is issued or waited for under a branch, and no branch yields a tensor (Triton 3.6 gave wrong
    outputs and out-of-range shared addresses on an H100 when this loop carried its tensors through `if`s): the
    loop walks live items only, and before the first item (and at the end of a program with none) the P V is a
    product of zeros, its result unused."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    slot = 0
    done = 0
    turn = 0
    held = False                                   # an item's last P V and store are still to do
    p_prev = gl.zeros([BLOCK_M, BLOCK_N], gl.bfloat16, p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    last = 0                                       # the held item's: its last stage's ring count, the ring count
    stop = 0                                       # after it, and where its rows go
    out_start = 0
    out_len = 0
    out_m = 0
    out_h = 0
    end = _ws_walk_end(num_items, work_ptr, WALK)
    k = _ws_next_live(gl.program_id(0), gl.num_programs(0), end, cu_ptr, work_ptr, num_heads, batch, num_m_tiles,
                      num_items, BLOCK_M, SEQUENCE_MAJOR, WALK)
    while k < end:
        pid_h, seq_start, seq_len, m0 = _ws_item(_ws_nth(k, work_ptr, WALK), cu_ptr, num_heads, batch, num_m_tiles,
                                                 BLOCK_M, SEQUENCE_MAJOR)
        n_tiles, m_start, my_n = _ws_rows(seq_len, m0, BLOCK_M, BLOCK_N, WG)
        q_op = _ws_q(q_smem, q_bar, q_empty, done, s_layout, Q_REGS, True, WG)
        mbarrier.wait(ready.index(slot % STAGES), (slot // STAGES) & 1)
        k_tile = k_smem.index(slot % STAGES)
        v_last = v_smem.index(last % STAGES)
        acc_tok = warpgroup_mma(p_prev, v_last, acc, is_async=True)
        s_tok = warpgroup_mma(q_op, k_tile.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)
        acc, p_prev, v_last = warpgroup_mma_wait(1, deps=(acc_tok, p_prev, v_last))
        if held:
            _ws_retire(acc, l_i, ready, empty, o_ptr, last, stop, out_start, out_len, out_m, out_h, stride_ot,
                       stride_oh, STAGES, BLOCK_M, HEAD_DIM, o_layout)
        s, q_op, k_tile = warpgroup_mma_wait(0, deps=(s_tok, q_op, k_tile))
        p_prev, m_i, l_i = _first_softmax(s, m_start, qk_scale, BLOCK_M, BLOCK_N, s_layout, p_layout)
        p_prev, m_i, l_i, acc = _ws_steps(q_op, k_smem, v_smem, ready, empty, k_desc, v_desc, turns, p_prev, m_i, l_i,
                                          gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout), seq_start, m0,
                                          m_start, my_n, n_tiles, slot, turn, qk_scale, BLOCK_M, BLOCK_N, STAGES,
                                          PINGPONG, WG, s_layout, o_layout, p_layout)
        if not Q_REGS:
            mbarrier.arrive(q_empty, count=1)          # its last Q K^T is done: the next item's Q may load
        held = True
        last = slot + my_n - 1
        stop = slot + n_tiles
        out_start = seq_start
        out_len = seq_len
        out_m = m_start
        out_h = pid_h
        slot = stop
        done += 1
        turn += _ws_turns(m0, my_n, BLOCK_N)
        k = _ws_next_live(k + gl.num_programs(0), gl.num_programs(0), end, cu_ptr, work_ptr, num_heads, batch,
                          num_m_tiles, num_items, BLOCK_M, SEQUENCE_MAJOR, WALK)
    acc = _last_pv(p_prev, v_smem, acc, last, STAGES)
    if held:
        _ws_retire(acc, l_i, ready, empty, o_ptr, last, stop, out_start, out_len, out_m, out_h, stride_ot, stride_oh,
                   STAGES, BLOCK_M, HEAD_DIM, o_layout)


@gluon.jit
def _ws_consumer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns, item_smem,
                 o_ptr, cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, qk_scale, stride_ot, stride_oh,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, Q_REGS: gl.constexpr, PINGPONG: gl.constexpr, SEQUENCE_MAJOR: gl.constexpr,
                 DYNAMIC: gl.constexpr, OVERLAP_ITEMS: gl.constexpr, WALK: gl.constexpr, WG: gl.constexpr):
    """Consumer warpgroup WG over the program's work items (DYNAMIC: each item's number read from `item_smem`
    once Q's barrier completes, until the end mark)."""
    slot = 0
    done = 0
    turn = 0
    if DYNAMIC:
        mbarrier.wait(q_bar, 0)
        item = _ws_item_id(item_smem)
        while item < num_items:
            pid_h, seq_start, seq_len, m0 = _ws_item(item, cu_ptr, num_heads, batch, num_m_tiles, BLOCK_M,
                                                     SEQUENCE_MAJOR)
            slot, done, turn = _ws_consume_item(k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty,
                                                turns, o_ptr, pid_h, seq_start, seq_len, m0, slot, done, turn,
                                                qk_scale, stride_ot, stride_oh, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                                                Q_REGS, PINGPONG, False, WG)
            mbarrier.wait(q_bar, done & 1)
            item = _ws_item_id(item_smem)
    elif OVERLAP_ITEMS and STAGES >= 3:      # (it waits for the next item's first tile before releasing a stage)
        _ws_consumer_overlapped(k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns, o_ptr,
                                cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, qk_scale, stride_ot,
                                stride_oh, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, Q_REGS, PINGPONG, SEQUENCE_MAJOR, WALK,
                                WG)
    else:
        for k in range(gl.program_id(0), _ws_walk_end(num_items, work_ptr, WALK), gl.num_programs(0)):
            item = _ws_nth(k, work_ptr, WALK)
            pid_h, seq_start, seq_len, m0 = _ws_item(gl.minimum(item, num_items - 1), cu_ptr, num_heads, batch,
                                                     num_m_tiles, BLOCK_M, SEQUENCE_MAJOR)
            if (item < num_items) & (m0 < seq_len):
                slot, done, turn = _ws_consume_item(k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready,
                                                    empty, turns, o_ptr, pid_h, seq_start, seq_len, m0, slot, done,
                                                    turn, qk_scale, stride_ot, stride_oh, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                    STAGES, Q_REGS, PINGPONG, True, WG)


@gluon.jit
def _prefill_ws_kernel(q_desc, k_desc, v_desc, o_ptr, cu_ptr, qk_scale, num_m_tiles, stride_ot, stride_oh, num_heads,
                       batch, num_items, work_ptr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_REGS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr, SEQUENCE_MAJOR: gl.constexpr,
                       DYNAMIC: gl.constexpr, OVERLAP_ITEMS: gl.constexpr, WALK: gl.constexpr,
                       num_warps: gl.constexpr):
    """PRODUCER_WARP: a work item is 2 x BLOCK_M query rows of one head of one sequence; a program takes items
    program_id, program_id + programs, ... (one each unless PERSISTENT; DYNAMIC: from a shared counter). Its
    default partition and a worker partition are one consumer warpgroup each, a one-warp worker loads."""
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_smem = gl.allocate_shared_memory(gl.int32, [1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)          # one arrival a consumer warpgroup
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    # the argument tuples are written out in the call: a tuple assigned to a name first has its constexprs made tensors
    gl.warp_specialize([
        (_ws_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns,
                        item_smem, o_ptr, cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, qk_scale,
                        stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, Q_REGS, PINGPONG,
                        SEQUENCE_MAJOR, DYNAMIC, OVERLAP_ITEMS, WALK, 0)),
        (_ws_consumer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns,
                        item_smem, o_ptr, cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, qk_scale,
                        stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, Q_REGS, PINGPONG,
                        SEQUENCE_MAJOR, DYNAMIC, OVERLAP_ITEMS, WALK, 1)),
        (_ws_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, ready, empty, turns,
                      item_smem, o_ptr, cu_ptr, work_ptr, num_heads, batch, num_m_tiles, num_items, qk_scale,
                      stride_ot, stride_oh, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, Q_REGS, PINGPONG,
                      SEQUENCE_MAJOR, DYNAMIC, OVERLAP_ITEMS, WALK, 1)),
    ], [4, 1], [CONSUMER_REGS, 24])


@lru_cache(maxsize=None)
def layouts(head_dim):
    """The shared-memory layouts of the Q and K/V tiles (the TMA descriptors' and the wgmma operands')."""
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M, head_dim], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], gl.bfloat16))


def _packed(t):
    """`t` itself where a tensor descriptor can read it ([tokens, heads, d] contiguous, 16-byte aligned), else a
    contiguous copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
    total, hq, d = q.shape
    assert q.dtype == torch.bfloat16 and q.is_cuda and d in (64, 128), "bf16 on CUDA, head_dim 64 or 128"
    assert (4 if PRODUCER_WARP else NUM_WARPS) * 16 == BLOCK_M, "16 query rows a warp"
    q, k, v = _packed(q), _packed(k), _packed(v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cu_seqlens.shape[0] <= 1 or total == 0:
        return out
    grid, args, consts = launch_args(q, k, v, cu_seqlens, max_seqlen, sm_scale, out, *_gpu(q.device))
    compiled = _compiled.get(_specialization(q.device, args, consts)) if DIRECT_LAUNCH else None
    if compiled is not None:
        compiled[(*grid, 1, 1)[:3]](*args, *consts.values(), launch_options()["num_warps"])
        return out
    compiled = kernel()[grid](*args, **consts, **launch_options())
    if DIRECT_LAUNCH and hasattr(compiled, "metadata"):       # (nothing comes back from a call that only compiled)
        _compiled[_specialization(q.device, args, consts)] = compiled
    return out


def launch_args(q, k, v, cu_seqlens, max_seqlen, sm_scale, out, sm_count, l2_bytes):
    """(grid, the kernel's arguments in its signature's order, its constexprs by name in that order) for a call of the
    kernel the knobs select on a GPU of `sm_count` SMs and an L2 cache of `l2_bytes`; `num_warps` follows the
    constexprs."""
    total, hq, d = q.shape
    hkv = k.shape[1]
    batch = cu_seqlens.shape[0] - 1
    q_layout, kv_layout = layouts(d)
    q_desc = TensorDescriptor(q.view(total, hq * d), [total, hq * d], [hq * d, 1], [BLOCK_M, d], q_layout)
    k_desc = TensorDescriptor(k.view(total, hkv * d), [total, hkv * d], [hkv * d, 1], [BLOCK_N, d], kv_layout)
    v_desc = TensorDescriptor(v.view(total, hkv * d), [total, hkv * d], [hkv * d, 1], [BLOCK_N, d], kv_layout)
    num_m_tiles = triton.cdiv(int(max_seqlen), BLOCK_M * (2 if PRODUCER_WARP else 1))
    args = [q_desc, k_desc, v_desc, out, cu_seqlens, float(sm_scale) * _LOG2E, num_m_tiles, out.stride(0),
            out.stride(1)]
    consts = dict(GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=NUM_STAGES, Q_REGS=Q_REGS)
    if not PRODUCER_WARP:
        return (hq, num_m_tiles, batch), args, consts
    num_items = hq * batch * num_m_tiles
    programs = min(num_items, sm_count) if PERSISTENT or DYNAMIC else num_items
    by_l2 = outgrows_l2(k.numel() * k.element_size() + v.numel() * v.element_size(), l2_bytes)
    kind = walk(triton.cdiv(num_items, programs), by_l2)
    sequence_major = SEQUENCE_MAJOR or by_l2
    if DYNAMIC:
        work = torch.zeros(1, dtype=torch.int32, device=q.device)          # the counter all programs take items from
    elif kind == 2:
        work = _dealt(q.device, hq, batch, num_m_tiles, programs, sequence_major)
    else:
        work = cu_seqlens                                                  # (not read)
    return (programs, ), [*args, hq, batch, num_items, work], \
        dict(consts, CONSUMER_REGS=CONSUMER_REGS, PINGPONG=PINGPONG, SEQUENCE_MAJOR=sequence_major, DYNAMIC=DYNAMIC,
             OVERLAP_ITEMS=OVERLAP_ITEMS, WALK=kind)


def outgrows_l2(kv_bytes, l2_bytes):
    """L2_ORDER: whether a batch whose K and V are `kv_bytes` goes sequence-major on a GPU of `l2_bytes` of L2."""
    return L2_ORDER and kv_bytes > l2_bytes


def walk(rounds=1, by_l2=False):
    """The kernel's WALK over a persistent program's positions: 0 the plain stride, 1 ALTERNATE (not where L2_ORDER
    made the items sequence-major: `by_l2`), 2 BALANCED (the dealt walk, for up to _DEAL_ROUNDS items a program:
    past that the host's deal costs more than evening the programs saves, and the plain stride measured as fast;
    its busiest program within 2% of the mean); 0 unless PERSISTENT and not DYNAMIC."""
    if DYNAMIC or not PERSISTENT:
        return 0
    if BALANCED and rounds <= _DEAL_ROUNDS:
        return 2
    return 1 if ALTERNATE and not by_l2 else 0


_ITEM_TILES = 1   # BALANCED: what an item costs beyond its K/V tiles (its Q, its O's store), in tiles
_DEAL_ROUNDS = 32  # BALANCED: the most items a program a shape is dealt for (4 x 2k and 1 x 8k: 16; 8 x 4k's 63 not)
_DEALT = {}       # BALANCED: (device, shape) -> the dealt walk on the host and on that device
_DEALT_KEPT = 256


def deal(num_heads, batch, num_m_tiles, programs, sequence_major=SEQUENCE_MAJOR):
    """BALANCED's walk: the work items dealt heaviest first to the programs with the least work so far, an item
    costing its K/V tiles as if its sequence filled all num_m_tiles query tiles, plus _ITEM_TILES (longest
    processing time first; ties to the lower program, items of equal cost in their order). Returned as the kernel
    reads it: the walk's length (rounds x programs), then, round by round, each program's next item (num_items where
    it has none left). Shapes only: the items past a shorter sequence's end are skipped where they fall."""
    num_items = num_heads * batch * num_m_tiles
    rows = 2 * BLOCK_M
    by_tile = [[] for _ in range(num_m_tiles)]
    for item in range(num_items):
        rest = item // num_heads
        by_tile[num_m_tiles - 1 - (rest % num_m_tiles if sequence_major else rest // batch)].append(item)
    loads = [(0, p) for p in range(programs)]          # a heap: (work so far, program)
    walks = [[] for _ in range(programs)]
    for tile in range(num_m_tiles - 1, -1, -1):
        cost = triton.cdiv((tile + 1) * rows, BLOCK_N) + _ITEM_TILES
        for item in by_tile[tile]:
            load, p = loads[0]
            walks[p].append(item)
            heapq.heapreplace(loads, (load + cost, p))
    rounds = max(len(w) for w in walks)
    return [rounds * programs] + [w[r] if r < len(w) else num_items for r in range(rounds) for w in walks]


def _dealt(device, num_heads, batch, num_m_tiles, programs, sequence_major):
    """deal(...) on `device`, made once per shape (the last _DEALT_KEPT kept): copied from pinned host memory without
    waiting for the GPU (a copy from pageable memory would wait for the work queued before it); the host copy is
    kept with it."""
    key = (device, num_heads, batch, num_m_tiles, programs, sequence_major)
    if key not in _DEALT:
        if len(_DEALT) >= _DEALT_KEPT:
            _DEALT.pop(next(iter(_DEALT)))                                  # the oldest shape's
        host = torch.tensor(deal(num_heads, batch, num_m_tiles, programs, sequence_major), dtype=torch.int32)
        if device.type == "cuda":
            host = host.pin_memory()
        _DEALT[key] = (host, host.to(device, non_blocking=True))
    return _DEALT[key][1]


_compiled = {}   # DIRECT_LAUNCH: _specialization(...) -> the kernel compiled for it


def _specialization(device, args, consts):
    """What selects the compiled kernel, as Triton 3.6 specializes a call: the device, the constexprs, and each
    argument's class: an int's (1, a multiple of 16, other; 32 or 64 bits), a tensor's dtype and 16-byte alignment,
    a descriptor's dtype and block (its layout follows from HEAD_DIM). tests/test_gluon_prefill.py holds Triton's
    own binder to it: calls with one key get one specialization."""
    def cls(a):
        if isinstance(a, TensorDescriptor):
            return (a.base.dtype, tuple(a.block_shape))
        if isinstance(a, torch.Tensor):
            return (a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, float):
            return float
        return (a == 1, a % 16 == 0, -2 ** 31 <= a < 2 ** 31)      # an int
    return (device, tuple(cls(a) for a in args), tuple(consts.values()))


@lru_cache(maxsize=None)
def _gpu(device):
    """(SMs, bytes of L2 cache) of `device`."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.L2_cache_size


def kernel():
    """The kernel the knobs select."""
    return _prefill_ws_kernel if PRODUCER_WARP else _prefill_kernel


def launch_options():
    """num_warps (the default partition's) and, with PRODUCER_WARP, the register cap a thread launches with: the
    partitions' warps round up to whole warpgroups (4 + 4 + 4), which share the SM's 65,536 registers."""
    if not PRODUCER_WARP:
        return {"num_warps": NUM_WARPS}
    return {"num_warps": 4, "maxnreg": 65536 // (12 * 32) // 8 * 8}


def launch_warps():
    """Warps a program launches with, the partitions' included."""
    return 12 if PRODUCER_WARP else NUM_WARPS
