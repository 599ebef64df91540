"""Paged GQA decode for Hopper in Gluon: a loader warp keeps a ring of whole K/V pages in flight by TMA, one
consumer warpgroup a persistent program (a kernel family for kevo's proposer; sm90 only).

Why
    The Triton GQA family (decode_paged_gqa.py) reads 0.95-0.99x cuDNN SDPA on issue 16's rows. Measured under
    CUDA graphs on an H100 its time fits a fixed cost plus a stream 1.5-2.3% slower than cuDNN's, and about 7 us
    a call more where sequences split (the partials' merge after the last split). Triton 3.6's pipeliner keeps one
    K/V buffer a program at NUM_STAGES 2-4 (the page-table load is what it runs ahead), so a program has little in
    flight and the family needs 4 programs an SM, and splits at batch 16, to stream. cuDNN's decode keeps 86 KB a
    program in flight, 2 programs an SM (ncu, H200). Here one program an SM keeps NUM_STAGES tiles of K and V
    (32 KB each at BLOCK_N 64) in shared memory, filled by a one-warp loader a whole page a copy (TMA; no
    per-token address in any register), so that one program streams alone: batch x kv heads >= the SM count
    needs no split and no merge.

What it does
    A work item is (split, sequence, kv head): the GQA group's query heads, padded to 64 rows (one wgmma's M),
    against tokens [start, end) of the sequence. Programs (min(items, SMs)) take items in rounds, longest
    sequence first (LONGEST_FIRST, below); the ring's count and its barriers' phases run on across items, so the
    loader fills the next
    item's stages while the consumer finishes this one. The loader issues one TMA per page (PAGE rows of one kv
    head, [blocks x PAGE, kv heads x d] seen as rows), BLOCK_N / PAGE pages a stage on one mbarrier, their
    block-table entries read together a tile ahead; pages past the sequence's last are its last page again
    (masked). The consumer: S = Q K^T (wgmma, Q in registers), an exp2 online softmax with sm_scale * log2 e
    folded into one multiply, O += P V (P in registers); tokens at or past `end` are masked, and a stage holding
    rows past the sequence has its V rows there zeroed in shared memory first (a page's unused slots may hold
    anything, NaN included, and 0 x NaN is NaN). Splits: the grid's split count is from shapes (the fewest whose
    items fill the programs' rounds to ROUND_FILL), or where that is one round of items, chosen by the programs
    from the real lengths (SPLITS_FROM_LENGTHS, below); each item sizes its sequence's splits from the real length
    on the device, as the GQA family does. With more than one split in the grid every item writes a
    partial (unnormalised O, max, sum; an item past its sequence's splits writes a max of -inf) and a small Triton
    kernel merges them (FUSED_COMBINE: the last split to finish); with one, the consumer writes O.

Knobs (module constants below, one per line)
    BLOCK_N, NUM_STAGES, MIN_TOKENS_PER_SPLIT, MAX_SPLITS, ROUND_FILL, MIN_ROUNDS, PROGRAMS_PER_SM, LONGEST_FIRST
    (on), SPLITS_FROM_LENGTHS (1) and ITEM_COST_TOKENS, and four designs off by default: OVERLAP_TILES, ALL_HEADS,
    FUSED_COMBINE and LEAN (their GPU tests pass; timed below):
    * LONGEST_FIRST (on): before the partitions start, the consumer's warps rank the batch's sequences by their
      real length (every pair compared; ties by index) into shared memory, and each partition deals itself items
      in that order (sequence, then split, then kv head): round k takes items k x programs on, to programs 0..P-1
      in even rounds and P-1..0 in odd ones, so that the program with one round's longest item has the next
      round's shortest. Why: by index, a ragged batch's programs that draw the longest sequences finish last
      (SMs busy 312k-502k cycles of 524k at 64 x 4k ragged, ncu). Equal lengths keep the index order (one split)
      or put a sequence's splits together. Off (or past 256 sequences, or with LEAN): items by index, split-major.
      Timed (H100 under CUDA graphs, 2026-12-06, forty-seventh session): 0.968/0.979/0.942x cuDNN on the served
      shapes (ragged 0.5) against 0.886/0.906/0.946x by index and LEAN's 0.926/0.955/0.960x; 0.978-0.990x on the
      issue's equal rows against 0.982-0.991x. One round of items (8 x 32k: 128 items on 132 programs) it cannot
      balance: there the longest split sets the time, as before. Compiled: 128 registers, nothing spilled, up to
      1 KB more shared. Its cost grows with the batch (H100 under CUDA graphs, 2026-12-07, equal lengths): 4.5 us a
      call at 256 x 512 against by index (0.937x cuDNN against 0.959x), 1.3 us at 128 x 1k, under 0.6 us at 64 x 2k
      and 32 x 4k; the keys read from shared memory rather than a global load a step took 1.2 us of the 4.5.
    * SPLITS_FROM_LENGTHS (1; not with ALL_HEADS): where the shapes' plan is one round of items (few sequences:
      8 x 32k takes 2 splits, 128 items) and the batch is ranked in one warp's 32 lanes, the grid is one program an
      item of that plan and each program, after the ranks, chooses that count or twice it (two whole rounds, which the
      deal can balance) from the real lengths: one round takes the longest sequence's first split; in two, program p
      holds items p and 2P - 1 - p, so the busiest holds about the mean of those pairs; an item costs its tokens and
      ITEM_COST_TOKENS (a guess). Equal lengths keep one round, ragged ones take two. The partials past the chosen
      count are marked dead before the items, for the merge. At 2 also where the plan has no split (16 x 8k), which
      then pays partials and their merge either way. Why: one round cannot be balanced, and MIN_ROUNDS 2 (splits from
      shapes until two rounds) costs equal rows the round's remainder and the merge. Timed (H100 under CUDA graphs,
      2026-12-06, forty-eighth session): ragged 0.5 8 x 32k 0.972x cuDNN against 0.944x, 4 x 32k 0.961x against 0.910x
      (2: 16 x 16k 0.965x against 0.893x, 16 x 8k 0.950x against 0.908x); equal rows within 0.5% of the plan's except
      8 x 8k, 0.977x against 0.991x (2: 16 x 8k 0.970x against 0.990x): about 1.5 us a call, from the choice made
      before the loader starts and the merge over twice the slots (not profiled). On 2026-12-07 (another H100) 2 read
      0.971x against 0.992x at 16 x 8k equal and 0.956x against 0.910x ragged; with O written directly where the
      programs chose one split (no partials, the merge skipped: GPU-tested, not kept) 0.975x and 0.955x, so the
      partials and merge are under 1 us of the 3-4 us it costs there. Compiled: 128 registers, nothing
      spilled. MIN_ROUNDS 2 read 0.966x at ragged 8 x 32k and 0.959-0.977x on the equal rows it splits (16 x 8k,
      8 x 32k).
    * OVERLAP_TILES: the consumer in FlashAttention-3's two-stage order. Tile j's Q K^T is issued with tile j-1's
      P V and j's softmax runs beside that product; a stage is released a softmax later (2+ stages, else the plain
      loop). Why: the plain loop waits for each product, so a tile costs the consumer two wgmma latencies and a
      515-instruction softmax in series (sm90_compile.py), near the time a 32 KB tile streams into an SM on an
      H200 (4.8 TB/s over 132 SMs: about 1 us). Compiled: one wait leaves a product in flight, 128 registers.
    * ALL_HEADS: a work item is (split, sequence), its rows every query head (up to 64), and a ring stage whole
      pages of every kv head as the cache lays them out ([tokens, kv heads, d]: 16 tokens x 8 heads x 128 is 32 KB
      of K in one place), as many pages as make 128 keys (BLOCK_N unused). Each row's scores are masked to its own
      kv head's keys: the tensor cores do 8x the products (idle otherwise in a stream) and a thread twice the
      exponentials a step, for twice the bytes. Partials keep the GQA layout, so the merge is the same. Why: under
      ncu the defaults stream at 90% of DRAM's peak against cuDNN's 91-92%, each copy 16 rows of 256 bytes 2 KB
      apart; here a copy is 32 KB contiguous. More rows split (32 sequences fill 132 programs at 4 splits) and pay
      the merge. Compiled: 232 registers, 200 KB shared at 3 stages (one program an SM).
    Neither spills. Timed (H100 under CUDA graphs, 2026-12-06, the
    issue's rows in one call): OVERLAP_TILES 0.972-0.984x cuDNN against the defaults' 0.978-0.987x (the consumer
    does not bound the stream there); ALL_HEADS at 2 stages 0.995x at 128 x 1k (defaults 0.978x), 0.953-0.974x on
    the rows whose few sequences split. The merge launched as the decode's programmatic dependent (PDL: resident
    early, waiting on griddepcontrol.wait) was tried the same day and taken out: 0.978-0.987x with the defaults, no
    gain, and 0.913-0.994x with ALL_HEADS, slower than its plain launch (docs/BENCHMARKS.md).
    FUSED_COMBINE (off): no merge kernel. As in the GQA family, the last split of
    a (sequence, kv head) to finish merges: after its partial the consumer warpgroup syncs, one thread takes a
    ticket (atom.acq_rel.gpu add on a per-device int32 buffer, one a pair), and the split that draws n_split - 1
    resets it to 0 and merges the n_split live partials (SPLIT_CHUNK splits a load, read .cg, reductions over splits
    in-thread); dead items write nothing. With ALL_HEADS a ticket is a sequence's, the merge every head's. Why: where
    sequences split, the partials and their merge kernel cost 1-4% (above). Risk: a launch killed mid-way leaves
    its tickets non-zero, and later calls then merge early (before every partial is written) or never, until
    _TICKETS is dropped. Compiled: nothing spilled, the same registers and shared memory (a split chunk times the
    item's rows kept <= 32 a thread: past that, spills). Timed (H100 under CUDA graphs, 2026-12-06, forty-fifth
    session): 0.983-0.993x cuDNN on the issue's rows against the defaults' 0.984-0.989x in the same call, and
    0.888/0.909/0.948x on the served shapes (ragged 0.5) against 0.887/0.907/0.946x: within the noise, so off.
    LEAN (off): the batch's K/V as one line of tiles (sequence by sequence, kv head by kv head, BLOCK_N tokens a
    tile, from the real lengths on the device), one equal stretch of it a program (at least MIN_TOKENS_PER_SPLIT; a
    short line takes fewer programs), as the Triton lean family (decode_paged_lean.py) cuts it. A stretch's pieces
    are the (sequence, kv head)s it touches: a whole one writes its O, a piece of one its partial at [program, first
    or last piece], and the last piece of a (sequence, kv head) to finish merges them by the ticket FUSED_COMBINE
    takes. Both partitions read the lengths a chunk at a time (the first chunk once; one walk finds both ends of
    the stretch) and visit the same pieces in the same order: the stretch's first and last (the cut ones) before
    the whole ones between, so that a merge's partners both come early and the merge runs mid-stream, where the
    ring hides it. Why: on the served shapes (ragged lengths) the defaults read 0.89-0.95x cuDNN against
    0.98-0.99x on equal lengths: an item is a whole (sequence, kv head), taken by index, so the programs holding
    the longest finish last (ncu at 64 x 4k ragged: SMs busy 312k-502k cycles of 524k; LEAN 451k-488k of 491k).
    Timed (H100 under CUDA graphs, 2026-12-06, forty-sixth session): 0.928/0.956/0.961x cuDNN on the served shapes
    against the defaults' 0.886/0.907/0.947x, but 0.944-0.959x on the issue's equal rows against 0.983-0.991x, so
    it stays off (a catalog knob). Where its time goes, measured the same day: stretches that are whole segments
    (16 x 8k, 128 programs) read 0.979x against the defaults' 0.988x (the plan and the piece loop: about 1%);
    cutting segments costs 2-3% more (the partials, the tickets and a merge that ends a program whose pieces are
    all cut); at 85-110 us a call (32 x 1.5k-2k, equal) it reads 0.93x against the defaults' 0.98x, the pieces'
    own costs (Q load, the last tile's zeroed V rows, the epilogue) weighing more; the first version, which walked
    the lengths three times and visited pieces in line order, read 0.907/0.946/0.957x served. Risk: the ticket's
    (above). Compiled: 128 registers, nothing spilled, 104.1 KB shared, as the defaults.

Measured (H100, 2026-12-05, tests/bench/vs_library.py under CUDA graphs, issue 16's rows 32 x 4k / 64 x 4k /
    128 x 1k / 8 x 32k / 16 x 8k): 0.983/0.986/0.982/0.990/0.990x cuDNN SDPA, against the GQA family's
    0.964/0.983/0.994/0.972/0.959x in the same call; its GPU test passes. More bytes in flight was slower, not
    faster: 6 stages 0.925-0.939x, 4 0.966-0.976x, 3 (the default) 0.983-0.990x, 2 0.973-0.984x; 128-token stages
    at 2 0.983-0.992x. Pages laid out in order changed little (0.980-0.996x), nor did taking one kv head's
    sequences one after another (0.964-0.994x). Under ncu (H100) it reads the same bytes as cuDNN, with as many
    programs at 16 x 8k, at 90% of DRAM's peak against cuDNN's 91-92% (6 stages: 87%): the last 1-2% is how its TMA
    copies (16 rows x 128 bytes, each 256-byte row split at the swizzle) use DRAM.

Compiled for sm90 (Triton 3.6's ptxas, 32 q / 8 kv heads, d 128): 128 registers, nothing spilled, 104 KB shared
    (3 stages: two programs fit an SM; 6 stages 200 KB, one). One block-table load a stage; each page's copy two
    TMA messages (split at the 128-byte swizzle); the consumer's loop two wgmma groups and no byte permute. Its GPU
    test is `pytest -m cuda tests/test_gluon_decode.py`, its bench row tests/bench/vs_library.py with this file as
    a SPEC.

Known limits
    * bf16 on CUDA only (TMA and wgmma); head_dim 64 or 128; the page size must divide BLOCK_N; GQA groups up to 64
      heads. A cache a tensor descriptor cannot read ([blocks, page, kv heads, d] contiguous, 16-byte aligned) is
      refused (a copy of the whole cache a call would cost more than the call).
    * Equal split counts for every sequence of a batch (as the GQA family): dealt longest first, items balance
      where they take two rounds or more; a one-round plan takes two where its programs find that sooner
      (SPLITS_FROM_LENGTHS, batches of up to 32); otherwise in one round a ragged batch's longest chunk sets the
      time (LEAN: equal stretches instead; not with ALL_HEADS).
    * The group's rows are padded to 64: the tensor cores do 16x the work a group of 4 needs (cheap beside the
      stream: about a fifth of a tile's load time at 3 TB/s).
    * An item costs about 0.5 us beyond its bytes (H100 under CUDA graphs, 2026-12-07: the same 131k tokens as
      256 x 512 / 128 x 1k / 64 x 2k / 32 x 4k read 0.946 / 0.974 / 0.978 / 0.980x cuDNN, whose time moved 1.8%).
      Part of that is LONGEST_FIRST's ranking, which grows with the batch: by index the same rows read 0.959 /
      0.974 / 0.978 / 0.976x (fifty-eighth session, another H100).
      Not the item's start: Q brought by the loader's TMA an item ahead and the length loaded an item ahead (a knob,
      Q_AHEAD, commit 2263052; right in 6 of its 7 GPU tests, too big for shared memory with ALL_HEADS) read within
      0.3% of the defaults on issue 16's rows, +0.6% at 256 x 512; a ring of 2 or 4 stages, or OVERLAP_TILES, did
      not absorb it either.
    * The last 1-3% against cuDNN is what the decode adds to its stream, not the copies: the loader's TMA stream
      alone (tests/bench/tma_rows.py) runs at cuDNN's rate, 2.82-2.84 TB/s against 2.80-2.83 (H100, 2026-12-07).
      cuDNN's decode (ncu) is a 128-thread block a (sequence, kv head), two resident an SM, so one block's start
      and end run beside the other's stream; here one program an SM has only its ring across an item's end.
"""
import torch
import triton
import triton.language as tl
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language.nvidia.hopper.mbarrier as mbarrier
import triton.experimental.gluon.language.nvidia.hopper.tma as tma
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

BLOCK_N = 64  # KV tokens a ring stage (whole pages)
NUM_STAGES = 3  # ring stages of K and V (2 x BLOCK_N x d x 2 bytes each: 32 KB at 64 x 128)
MIN_TOKENS_PER_SPLIT = 256  # on device: never split a sequence finer than this many tokens
MAX_SPLITS = 16  # upper bound on splits per sequence
ROUND_FILL = 0.9  # the fewest splits whose items fill the programs' rounds this well (see grid_splits)
MIN_ROUNDS = 1  # ... and take at least this many rounds (2: a ragged batch's items can be dealt to balance)
PROGRAMS_PER_SM = 1  # persistent programs an SM (2 needs NUM_STAGES <= 3 at d 128 to fit two in shared memory)
ALL_HEADS = False  # a program takes every kv head of its sequence: a stage is whole pages, contiguous (see above)
OVERLAP_TILES = False  # tile j's Q K^T issued with tile j-1's P V, j's softmax run beside that product (2+ stages)
FUSED_COMBINE = False  # the last split of a (sequence, kv head) to finish merges (atomic ticket), no merge kernel
LEAN = False  # the batch's tiles cut into one equal stretch a program, from the real lengths (see above)
LONGEST_FIRST = True  # items dealt longest sequence first, every other round reversed (see above; batch <= 256)
SPLITS_FROM_LENGTHS = 1  # the split count chosen on device from the real lengths: one round of items or two (1 or 2)
ITEM_COST_TOKENS = 256  # ... by an estimate of the deal, an item costing its tokens and this many more (a guess)

_LOG2E = 1.4426950408889634
ROWS = 64  # the consumer's rows: one warpgroup's wgmma M (the group's query heads, padded)
_ROWS = gl.constexpr(ROWS)
_OVERLAP_TILES = gl.constexpr(OVERLAP_TILES and NUM_STAGES >= 2)   # one stage: tile j's would be j-1's, still held
_TICKETS = {}  # device -> its int32 ticket buffers, the largest last, none freed (FUSED_COMBINE, LEAN)
_CHOSEN = {}  # device -> int32[1]: the split count the last call that chose one chose (SPLITS_FROM_LENGTHS)


@gluon.jit
def _seq_ranks(seqlens_ptr, batch, RB: gl.constexpr):
    """LONGEST_FIRST: each sequence's place when the batch is sorted longest first (ties by index), a lane each
    of RB (RB for a lane past the batch), and its length (0 past the batch). Each sequence's key (its length, then
    its index reversed, in one int32: distinct, larger first) goes to shared memory once; then every pair is
    compared, a chunk of keys read from there a step (not a global load a step, in series before the loader's first
    copy: 1.2 us less at 256 x 512 on an H100), counted in place and summed once; none where every length is the
    same (the index is the rank). The steps are unrolled, RB / JC of them (the compile stage's allowlist refuses the
    private reinterpret a dynamic row index would need). The pairs, 16 a thread of the consumer's 128: i (the ranked
    sequence) over lanes, j (the one it is compared with) over warps."""
    pairs: gl.constexpr = gl.BlockedLayout([RB // 32, 512 // RB], [32, 1], [1, 4], [1, 0])
    JC: gl.constexpr = 4 * (512 // RB)
    NK: gl.constexpr = max(RB, JC)
    keys_smem = gl.allocate_shared_memory(gl.int32, [NK], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    offs_k = gl.arange(0, NK, layout=gl.BlockedLayout([1], [32], [4], [0]))
    keys_smem.store(_rank_key(gl.load(seqlens_ptr + offs_k, mask=offs_k < batch, other=0), offs_k, batch))
    offs_i = gl.arange(0, RB, layout=gl.SliceLayout(1, pairs))
    len_i = gl.load(seqlens_ptr + offs_i, mask=offs_i < batch, other=0)
    key_i = _rank_key(len_i, offs_i, batch)
    # equal lengths rank by index: no comparison to make
    equal = gl.min(gl.where(offs_i < batch, len_i, 0x7FFFFFFF), 0) == gl.max(len_i, 0)
    gl.thread_barrier()
    ahead = gl.zeros([RB, JC], gl.int32, pairs)
    if not equal:
        for c in gl.static_range(NK // JC):        # (past the batch a key is -1: ahead of none)
            key_j = keys_smem.slice(c * JC, JC).load(gl.SliceLayout(0, pairs))
            ahead += (key_j[None, :] > key_i[:, None]).to(gl.int32)
    return gl.where(offs_i < batch, gl.where(equal, offs_i, gl.sum(ahead, 1)), RB), len_i


@gluon.jit
def _rank_key(lens, offs, batch):
    """A sequence's sort key: its length (capped at 2^22 - 1 tokens) above its index reversed (a batch of at most
    512), so that keys are distinct and a longer sequence, or an equal one earlier in the batch, has the larger; -1
    past the batch (ahead of none)."""
    key = (gl.minimum(lens, (1 << 22) - 1) << 9) | (511 - offs)
    return gl.where(offs < batch, key, -1)


@gluon.jit
def _dealt(k, ranks_smem, batch, num_kv_heads, max_splits, RB: gl.constexpr, WARPS: gl.constexpr):
    """A program's k-th work item: (its index in the deal, split, sequence, kv head). By index (RB 0): items
    program_id, program_id + programs, ..., split-major, so that a program's first item holds work. LONGEST_FIRST
    (RB lanes of ranks in shared memory, read by each of a partition's WARPS whole): items in order of their
    sequence's rank, then split, then kv head, dealt program 0 to the last in even rounds and back in odd ones, so
    that a program holding one round's longest holds the next round's shortest."""
    programs = gl.num_programs(0)
    if RB > 0:
        r = k * programs + gl.where(k % 2 == 0, gl.program_id(0), programs - 1 - gl.program_id(0))
        per_seq = max_splits * num_kv_heads
        place = r // per_seq
        lanes: gl.constexpr = gl.BlockedLayout([RB // 32], [32], [WARPS], [0])
        offs = gl.arange(0, RB, layout=lanes)
        pid_b = gl.sum(gl.where(ranks_smem.load(lanes) == place, offs, 0), 0)
        rest = r - place * per_seq
        pid_s = rest // num_kv_heads
        pid_kvh = rest - pid_s * num_kv_heads
    else:
        r = k * programs + gl.program_id(0)
        per_split = batch * num_kv_heads
        pid_s = r // per_split
        rest = r - pid_s * per_split
        pid_b = rest // num_kv_heads
        pid_kvh = rest - pid_b * num_kv_heads
    return r, pid_s, pid_b, pid_kvh


@gluon.jit
def _item(pid_s, pid_b, seqlens_ptr, max_splits, min_tokens, BLOCK_N: gl.constexpr):
    """A work item's sequence length, its sequence's split count and the split's tokens [start, end): the split
    count and chunk come from the real length, as the GQA family sizes them."""
    seq_len = gl.load(seqlens_ptr + pid_b)
    chunk = _chunk(seq_len, max_splits, min_tokens, BLOCK_N)
    n_split = gl.cdiv(seq_len, chunk)
    start = pid_s * chunk
    return seq_len, n_split, start, gl.minimum(start + chunk, seq_len)


@gluon.jit
def _chunk(length, splits, min_tokens, BLOCK_N: gl.constexpr):
    """A split's tokens for a sequence of `length` when the batch takes `splits`: the count from the real length
    (MIN_TOKENS_PER_SPLIT a split at least), its chunk whole tiles."""
    n = gl.maximum(gl.minimum(splits, gl.cdiv(length, min_tokens)), 1)
    return gl.maximum(gl.cdiv(gl.cdiv(length, n), BLOCK_N) * BLOCK_N, BLOCK_N)


@gluon.jit
def _split_choice(lens, batch, ranks, lo, hi, num_kv_heads, min_tokens, ITEM_COST: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """SPLITS_FROM_LENGTHS (a batch of up to 32, ranked; `lo` splits one round of items, one program an item, and
    `hi` = 2 lo two whole rounds): `hi` where the deal would finish it sooner, as split_estimates finds it on the
    host. An item costs its tokens and ITEM_COST. One round takes the longest sequence's first split; in two, program
    p holds items p and 2P - 1 - p (P programs, items ranked longest first), so the busiest holds about the mean of
    those pairs (or the longest's first split, if more). A lane a sequence (its rank, its splits' items summed over
    where they fall; with two whole rounds every item is in a pair)."""
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 32, layout=lanes)
    lens = gl.convert_layout(lens, lanes)
    ranks = gl.convert_layout(ranks, lanes)
    longest = gl.max(lens, 0)
    programs = gl.num_programs(0)
    per_seq = hi * num_kv_heads
    n_items = batch * per_seq
    first = 2 * programs - n_items          # the first item that shares its program with another
    chunk = _chunk(lens, hi, min_tokens, BLOCK_N)
    paired = gl.zeros_like(lens)
    for j in range(hi):
        tokens = gl.minimum(chunk, lens - j * chunk)
        at = ranks * per_seq + j * num_kv_heads
        count = gl.maximum(gl.minimum(at + num_kv_heads, n_items) - gl.maximum(at, first), 0)
        paired += gl.where((offs < batch) & (tokens > 0), count * (tokens + ITEM_COST), 0)
    one_round = _chunk(longest, lo, min_tokens, BLOCK_N) + ITEM_COST
    two_rounds = gl.maximum(_chunk(longest, hi, min_tokens, BLOCK_N) + ITEM_COST,
                            gl.sum(paired, 0) // gl.maximum(n_items - programs, 1))
    return lo + (hi - lo) * (two_rounds < one_round).to(gl.int32)


@gluon.jit
def _plan_now(plan_smem, max_splits, n_items, batch, num_kv_heads, CHOOSE: gl.constexpr, WARPS: gl.constexpr):
    """The batch's (split count, items): the count its programs chose into shared memory (SPLITS_FROM_LENGTHS),
    else the grid's."""
    if CHOOSE:
        splits = gl.max(plan_smem.load(gl.BlockedLayout([1], [32], [WARPS], [0])), 0)
        return splits, batch * num_kv_heads * splits
    else:
        return max_splits, n_items


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _stretch_start(p, programs, total):
    """LEAN: the first tile of program p's stretch of the line's `total` tiles."""
    return ((p.to(gl.int64) * total) // programs).to(gl.int32)


@gluon.jit
def _owner(x, programs, total):
    """LEAN: the program whose stretch holds tile x."""
    return (((x + 1).to(gl.int64) * programs + total - 1) // total - 1).to(gl.int32)


@gluon.jit
def _tiles(lens, BLOCK_N: gl.constexpr):
    """LEAN: the tiles a kv head of sequences of these lengths take on the line (at least one each)."""
    return gl.maximum(gl.cdiv(lens, BLOCK_N), 1)


@gluon.jit
def _tiles_of(seqlens_ptr, b, batch, BLOCK_N: gl.constexpr):
    """LEAN: the tiles a kv head of each of a chunk's sequences b (a lane each) takes; none past the batch."""
    live = b < batch
    return gl.where(live, _tiles(gl.load(seqlens_ptr + b, mask=live, other=0), BLOCK_N), 0)


@gluon.jit
def _hit(x, upto, steps, b, num_kv_heads):
    """LEAN: of a chunk's sequences b (tiles through their kv heads `upto`, `steps` a head), the one whose tiles
    hold tile x, as sums over the chunk (all zero where none does): (its index, its first tile, its tiles a head)."""
    lo = upto - steps * num_kv_heads
    hit = (lo <= x) & (x < upto)
    return gl.sum(gl.where(hit, b, 0), 0), gl.sum(gl.where(hit, lo, 0), 0), gl.sum(gl.where(hit, steps, 0), 0)


@gluon.jit
def _lean_plan(seqlens_ptr, batch, num_kv_heads, min_tokens, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr,
               layout: gl.constexpr):
    """LEAN: the batch's K/V as one line of tiles (sequence by sequence, kv head by kv head, BLOCK_N tokens a tile,
    from the real lengths), cut into one equal stretch a program, each at least min_tokens (fewer programs
    where the line is short; the rest idle). The lengths are read CHUNK at a time (a lane each in `layout`), the
    first chunk once (a batch of up to CHUNK: one load in all), and one walk finds the segments (numbered sequence
    x kv heads + kv head) of both ends of the stretch. (This program's stretch [u0, u1), the programs in use, the
    line's length, the segments it touches [s_lo, s_hi), the first one's first tile, the last one's.)"""
    offs = gl.arange(0, CHUNK, layout=layout)
    steps0 = _tiles_of(seqlens_ptr, offs, batch, BLOCK_N)
    total = gl.sum(steps0, 0)
    for b0 in range(CHUNK, batch, CHUNK):
        total += gl.sum(_tiles_of(seqlens_ptr, b0 + offs, batch, BLOCK_N), 0)
    total = total * num_kv_heads
    programs = gl.maximum(gl.minimum(gl.num_programs(0), gl.cdiv(total, gl.cdiv(min_tokens, BLOCK_N))), 1)
    pid = gl.program_id(0)
    u0 = _stretch_start(gl.minimum(pid, programs), programs, total)
    u1 = _stretch_start(gl.minimum(pid + 1, programs), programs, total)   # a program past `programs`: empty
    x1 = gl.maximum(u1 - 1, 0)
    upto = gl.associative_scan(steps0, 0, _add) * num_kv_heads            # tiles through sequence b's kv heads
    b_lo, lo_lo, n_lo = _hit(u0, upto, steps0, offs, num_kv_heads)
    b_hi, lo_hi, n_hi = _hit(x1, upto, steps0, offs, num_kv_heads)
    carry = gl.sum(steps0, 0)
    for b0 in range(CHUNK, batch, CHUNK):
        steps = _tiles_of(seqlens_ptr, b0 + offs, batch, BLOCK_N)
        upto = (gl.associative_scan(steps, 0, _add) + carry) * num_kv_heads
        b, lo, n = _hit(u0, upto, steps, b0 + offs, num_kv_heads)
        b_lo, lo_lo, n_lo = b_lo + b, lo_lo + lo, n_lo + n
        b, lo, n = _hit(x1, upto, steps, b0 + offs, num_kv_heads)
        b_hi, lo_hi, n_hi = b_hi + b, lo_hi + lo, n_hi + n
        carry += gl.sum(steps, 0)
    h_lo = (u0 - lo_lo) // gl.maximum(n_lo, 1)        # an empty stretch past the line: no hit, never walked
    h_hi = (x1 - lo_hi) // gl.maximum(n_hi, 1)
    s_lo = b_lo * num_kv_heads + h_lo
    s_hi = gl.where(u1 > u0, b_hi * num_kv_heads + h_hi + 1, s_lo)
    return u0, u1, programs, total, s_lo, s_hi, lo_lo + h_lo * n_lo, lo_hi + h_hi * n_hi


@gluon.jit
def _visit(i, s_lo, s_hi, start_lo, start_hi, mid):
    """LEAN: the i-th segment a stretch visits and its first tile: its first segment, its last, then those between
    (from `mid`, the first tile past the ones visited between). A cut segment's pieces are a stretch's first or
    last, so both partners of a merge come early in their programs, and the merge runs mid-stream, where the ring
    hides it, not at a program's end."""
    seg = gl.where(i == 0, s_lo, gl.where(i == 1, s_hi - 1, s_lo + i - 1))
    return seg, gl.where(i == 0, start_lo, gl.where(i == 1, start_hi, mid))


@gluon.jit
def _lean_piece(seg, seg_start, u0, u1, seqlens_ptr, num_kv_heads, BLOCK_N: gl.constexpr):
    """LEAN: segment seg (first tile on the line seg_start) as this stretch sees it: (its sequence, kv head, the
    sequence's length, the piece's tokens [start, end), its tiles on the line [u, piece_end), the segment's end)."""
    pid_b = seg // num_kv_heads
    pid_kvh = seg - pid_b * num_kv_heads
    seq_len = gl.load(seqlens_ptr + pid_b)
    seg_end = seg_start + _tiles(seq_len, BLOCK_N)
    u = gl.maximum(u0, seg_start)
    piece_end = gl.minimum(u1, seg_end)
    end = gl.minimum((piece_end - seg_start) * BLOCK_N, seq_len)
    return pid_b, pid_kvh, seq_len, (u - seg_start) * BLOCK_N, end, u, piece_end, seg_end


@gluon.jit
def _loader(q_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale, max_splits,
            min_tokens, num_kv_heads, batch, n_items, stride_qb, stride_qh, stride_btb, stride_ob, stride_oh, k_smem,
            v_smem, ready, empty, ranks_smem, plan_smem, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
            BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, SINGLE: gl.constexpr,
            KV_HEADS: gl.constexpr, FUSED: gl.constexpr, GP: gl.constexpr, SPLIT_CHUNK: gl.constexpr,
            LEAN: gl.constexpr, RB: gl.constexpr, CHOOSE: gl.constexpr):
    """The loader warp: each live item's tiles, a page a TMA copy, into the ring (its arguments are the
    consumer's: Gluon gives every partition one signature)."""
    slot = 0
    if LEAN:
        lanes: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
        u0, u1, programs, total, s_lo, s_hi, start_lo, start_hi = _lean_plan(seqlens_ptr, batch, num_kv_heads,
                                                                             min_tokens, BLOCK_N, 64, lanes)
        mid = start_lo
        for i in range(s_hi - s_lo):
            seg, seg_start = _visit(i, s_lo, s_hi, start_lo, start_hi, mid)
            pid_b, pid_kvh, seq_len, start, end, _, _, seg_end = _lean_piece(seg, seg_start, u0, u1, seqlens_ptr,
                                                                             num_kv_heads, BLOCK_N)
            slot = _load_tiles(k_desc, v_desc, bt_ptr, stride_btb, k_smem, v_smem, ready, empty, slot, pid_b,
                               pid_kvh, seq_len, start, end, HEAD_DIM, BLOCK_N, PAGE, STAGES, KV_HEADS)
            mid = gl.where(i == 1, mid, seg_end)
    else:
        splits, n_items = _plan_now(plan_smem, max_splits, n_items, batch, num_kv_heads, CHOOSE, 1)
        for k in range(gl.cdiv(n_items, gl.num_programs(0))):
            r, pid_s, pid_b, pid_kvh = _dealt(k, ranks_smem, batch, num_kv_heads, splits, RB, 1)
            seq_len, n_split, start, end = _item(pid_s, pid_b, seqlens_ptr, splits, min_tokens, BLOCK_N)
            if (r < n_items) & (pid_s < n_split):
                slot = _load_tiles(k_desc, v_desc, bt_ptr, stride_btb, k_smem, v_smem, ready, empty, slot, pid_b,
                                   pid_kvh, seq_len, start, end, HEAD_DIM, BLOCK_N, PAGE, STAGES, KV_HEADS)


@gluon.jit
def _load_tiles(k_desc, v_desc, bt_ptr, stride_btb, k_smem, v_smem, ready, empty, slot, pid_b, pid_kvh, seq_len,
                start, end, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
                KV_HEADS: gl.constexpr):
    """The loader's share of one item: tokens [start, end) of a sequence's kv head (ALL_HEADS: every kv head) into
    the ring, a page a TMA copy, from the ring's count `slot` on (returned past them)."""
    PAGE_ROWS: gl.constexpr = PAGE * KV_HEADS     # a page's rows: one kv head's, or (ALL_HEADS) every kv head's
    bt_row = bt_ptr + pid_b.to(gl.int64) * stride_btb
    last_page = (seq_len - 1) // PAGE
    col = pid_kvh * HEAD_DIM
    offs_p = gl.arange(0, BLOCK_N // PAGE, layout=gl.BlockedLayout([1], [32], [1], [0]))
    pages_next = gl.load(bt_row + gl.minimum(start // PAGE + offs_p, last_page))
    for tile in range(gl.cdiv(end - start, BLOCK_N)):
        # this tile's block-table entries, read one tile ahead (past the last, clamped to the last page)
        pages = pages_next
        pages_next = gl.load(bt_row + gl.minimum((start + (tile + 1) * BLOCK_N) // PAGE + offs_p, last_page))
        s = slot % STAGES
        mbarrier.wait(empty.index(s), ((slot // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * (BLOCK_N // PAGE) * k_desc.block_type.nbytes)
        for p in gl.static_range(BLOCK_N // PAGE):
            row = gl.sum(gl.where(offs_p == p, pages, 0), axis=0) * PAGE_ROWS
            tma.async_copy_global_to_shared(k_desc, [row, col], bar, k_smem.index(s).slice(p * PAGE_ROWS, PAGE_ROWS))
            tma.async_copy_global_to_shared(v_desc, [row, col], bar, v_smem.index(s).slice(p * PAGE_ROWS, PAGE_ROWS))
        slot += 1
    return slot


@gluon.jit
def _p_bf16(p):
    """P in bf16, two values an instruction (cvt.rn.bf16x2.f32, the low half the first), packed as the P V wgmma
    reads them: `.to` converts one value at a time and ptxas then swaps the halves of each register."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [p], dtype=gl.bfloat16, is_pure=True,
                                     pack=2)


@gluon.jit
def _zero_rows_from(v_tile, valid, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """V rows `valid` and on of a ring stage set to zero in shared memory, seen by the next wgmma (its async proxy)
    once every consumer thread has written."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = v_tile.load(layout)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    v_tile.store(gl.where((rows < valid)[:, None], v, gl.zeros_like(v)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _ready_stage(k_smem, v_smem, ready, slot, pos0, seq_len, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr, KV_HEADS: gl.constexpr):
    """Wait for the ring's stage of `slot` (tokens pos0 on) to land; where it runs past the sequence, its V rows
    there are zeroed first. (Its K tile, its V tile.)"""
    s_idx = slot % STAGES
    mbarrier.wait(ready.index(s_idx), (slot // STAGES) & 1)
    k_tile = k_smem.index(s_idx)
    v_tile = v_smem.index(s_idx)
    if pos0 + BLOCK_N > seq_len:
        _zero_rows_from(v_tile, (seq_len - pos0) * KV_HEADS, BLOCK_N * KV_HEADS, HEAD_DIM)
    return k_tile, v_tile


@gluon.jit
def _online_softmax(s, m_i, l_i, pos0, end, qk_scale, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                    GROUP: gl.constexpr, KV_HEADS: gl.constexpr):
    """One tile's step of the online softmax from its raw scores (tokens pos0 on; at or past `end` masked; with
    ALL_HEADS also a key of another kv head than the row's, a row past GROUP keeping every live key):
    (P, the new max, the new sum, the factor the old O takes)."""
    if KV_HEADS > 1:
        keys = gl.arange(0, BLOCK_N * KV_HEADS, layout=gl.SliceLayout(0, s_layout))
        rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
        own = (keys % KV_HEADS)[None, :] == (rows // (GROUP // KV_HEADS))[:, None]
        live = own | (rows >= GROUP)[:, None]
        s = gl.where(live & ((pos0 + keys // KV_HEADS) < end)[None, :], s, float("-inf"))
    else:
        offs_n = pos0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where((offs_n < end)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _tiles_overlapped(q_op, k_smem, v_smem, ready, empty, acc, m_i, l_i, slot, start, end, seq_len, qk_scale,
                      s_layout: gl.constexpr, o_layout: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, GROUP: gl.constexpr, KV_HEADS: gl.constexpr):
    """OVERLAP_TILES: an item's tiles (the first in the ring's stage for `slot`) in FlashAttention-3's two-stage
    order. Step j issues S_j = Q K_j^T, then P_{j-1} V_{j-1}, and waits for S_j alone: tile j's softmax runs while
    the tensor cores compute the product before it; then that product is waited for, its stage released, and O
    rescaled. A stage is held until the next tile's softmax is done. (O, max, sum)."""
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    zero = gl.zeros([_ROWS, BLOCK_N * KV_HEADS], gl.float32, s_layout)
    k_tile, _ = _ready_stage(k_smem, v_smem, ready, slot, start, seq_len, BLOCK_N, HEAD_DIM, STAGES, KV_HEADS)
    s_tok = warpgroup_mma(q_op, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
    s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_op, k_tile))
    p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, start, end, qk_scale, s_layout, BLOCK_N, GROUP, KV_HEADS)
    p_prev = gl.convert_layout(_p_bf16(p), p_layout)
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    for tile in range(1, n_tiles):
        k_tile, _ = _ready_stage(k_smem, v_smem, ready, slot + tile, start + tile * BLOCK_N, seq_len, BLOCK_N,
                                 HEAD_DIM, STAGES, KV_HEADS)
        v_prev = v_smem.index((slot + tile - 1) % STAGES)
        s_tok = warpgroup_mma(q_op, k_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
        acc_tok = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
        # this tile's scores; the product before it may still run (its operands kept alive to its wait)
        s, _, _ = warpgroup_mma_wait(1, deps=(s_tok, q_op, k_tile))
        p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, start + tile * BLOCK_N, end, qk_scale, s_layout, BLOCK_N,
                                             GROUP, KV_HEADS)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_prev, v_prev))
        mbarrier.arrive(empty.index((slot + tile - 1) % STAGES), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_prev = gl.convert_layout(_p_bf16(p), p_layout)
    v_last = v_smem.index((slot + n_tiles - 1) % STAGES)
    acc_tok = warpgroup_mma(p_prev, v_last, acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_prev, v_last))
    mbarrier.arrive(empty.index((slot + n_tiles - 1) % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _partial_rows(partial, pid_b, pid_s, offs_g, max_splits, GROUP: gl.constexpr, KV_HEADS: gl.constexpr):
    """The rows of the partials [sequence, kv head, split, group] a program's query rows write: its GQA group's from
    `partial`, its (sequence, kv head, split), or (ALL_HEADS) query head h's at (sequence, h's kv head, split)."""
    if KV_HEADS > 1:
        group: gl.constexpr = GROUP // KV_HEADS
        rows = ((pid_b.to(gl.int64) * KV_HEADS + offs_g // group) * max_splits + pid_s) * group + offs_g % group
    else:
        rows = partial * GROUP + offs_g
    return rows


@gluon.jit
def _merge_fused(out_ptr, po_ptr, pm_ptr, pair, max_splits, n_split, pid_b, pid_kvh, stride_ob, stride_oh, first,
                 seg_start, programs, total, GROUP: gl.constexpr, GP: gl.constexpr, HEAD_DIM: gl.constexpr,
                 SPLIT_CHUNK: gl.constexpr, KV_HEADS: gl.constexpr, LEAN: gl.constexpr):
    """FUSED: log-sum-exp merge of one item's n_split partials [pair, split, group] (its query rows: one GQA group,
    partials from pair `pair` on; ALL_HEADS: every head, pair `pair` + its kv head), SPLIT_CHUNK splits a load:
    splits and rows in each thread's registers (reductions over splits in-thread), d over the warpgroup's lanes.
    LEAN: the pieces of programs first.. (n_split of them) of the segment from tile seg_start, each at [program,
    0 where its stretch starts in the segment else 1, group]. Read past L1 (.cg): other SMs wrote them in this
    launch."""
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 1, 32], [1, 1, 4], [2, 1, 0])
    sg: gl.constexpr = gl.SliceLayout(2, l3)                  # [split, group]
    gd: gl.constexpr = gl.SliceLayout(0, l3)                  # [group, d]
    offs_c = gl.arange(0, SPLIT_CHUNK, layout=gl.SliceLayout(1, sg))
    offs_g = gl.arange(0, GP, layout=gl.SliceLayout(0, sg))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gd))
    offs_d3 = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))    # (expanded at 0, then 1)
    mask_g = offs_g < GROUP
    group: gl.constexpr = GROUP // KV_HEADS                 # query heads a kv head's partial rows hold
    m_run = gl.full([GP], float("-inf"), gl.float32, gl.SliceLayout(0, sg))
    l_run = gl.zeros([GP], gl.float32, gl.SliceLayout(0, sg))
    acc = gl.zeros([GP, HEAD_DIM], gl.float32, gd)
    for s0 in range(0, n_split, SPLIT_CHUNK):
        msk = ((s0 + offs_c) < n_split)[:, None] & mask_g[None, :]
        if LEAN:
            progs = first + s0 + offs_c
            part = progs.to(gl.int64) * 2 + (_stretch_start(progs, programs, total) < seg_start).to(gl.int64)
            at = part[:, None] * GROUP + offs_g[None, :]
        else:
            at = ((pair + offs_g // group) * max_splits)[None, :] * group + (s0 + offs_c)[:, None] * group \
                + (offs_g % group)[None, :]
        m_s = gl.load(pm_ptr + 2 * at, mask=msk, other=float("-inf"), cache_modifier=".cg")
        l_s = gl.load(pm_ptr + 2 * at + 1, mask=msk, other=0.0, cache_modifier=".cg")
        o_s = gl.load(po_ptr + at[:, :, None] * HEAD_DIM + offs_d3[None, None, :], mask=msk[:, :, None], other=0.0,
                      cache_modifier=".cg")
        m_new = gl.maximum(m_run, gl.max(m_s, 0))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_run - m_ref)
        w = gl.exp2(m_s - m_ref[None, :])
        l_run = l_run * alpha + gl.sum(w * l_s, 0)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, gd))[:, None] + gl.sum(w[:, :, None] * o_s, 0)
        m_run = m_new
    o = acc * gl.convert_layout(1.0 / gl.where(l_run > 0.0, l_run, 1.0), gl.SliceLayout(1, gd))[:, None]
    offs_h = gl.arange(0, GP, layout=gl.SliceLayout(1, gd))
    heads = pid_kvh * GROUP + offs_h
    gl.store(out_ptr + pid_b.to(gl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(gl.bfloat16), mask=(offs_h < GROUP)[:, None])


@gluon.jit
def _consumer(q_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale, max_splits,
              min_tokens, num_kv_heads, batch, n_items, stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
              k_smem, v_smem, ready, empty, ranks_smem, plan_smem, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
              BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, SINGLE: gl.constexpr,
              KV_HEADS: gl.constexpr, FUSED: gl.constexpr, GP: gl.constexpr, SPLIT_CHUNK: gl.constexpr,
              LEAN: gl.constexpr, RB: gl.constexpr, CHOOSE: gl.constexpr):
    """The consumer warpgroup: each live item's online softmax over the ring's stages, then its O (one split in the
    grid) or its partial; an item past its sequence's splits writes a max of -inf (FUSED: nothing; the last of a
    (sequence, kv head)'s splits to finish merges its partials). LEAN: each piece of its stretch, the whole of a
    (sequence, kv head) its O, else a partial, and the last piece of a (sequence, kv head) to finish merges."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N * KV_HEADS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_g = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, rows_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
    slot = 0
    if LEAN:
        mine = offs_g < GROUP
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        u0, u1, programs, total, s_lo, s_hi, start_lo, start_hi = _lean_plan(seqlens_ptr, batch, num_kv_heads,
                                                                             min_tokens, BLOCK_N, 128, lanes)
        mid = start_lo
        for i in range(s_hi - s_lo):
            seg, seg_start = _visit(i, s_lo, s_hi, start_lo, start_hi, mid)
            pid_b, pid_kvh, seq_len, start, end, u, piece_end, seg_end = _lean_piece(seg, seg_start, u0, u1,
                                                                                     seqlens_ptr, num_kv_heads,
                                                                                     BLOCK_N)
            heads = pid_kvh * GROUP + offs_g
            o, m_r, l_r, slot = _attend_item(q_ptr, pid_b, heads, offs_g, offs_d, stride_qb, stride_qh, k_smem,
                                             v_smem, ready, empty, slot, start, end, seq_len, qk_scale, s_layout,
                                             o_layout, rows_layout, GROUP, HEAD_DIM, BLOCK_N, STAGES, KV_HEADS)
            if (u == seg_start) & (piece_end == seg_end):      # the whole (sequence, kv head): its output
                o = o * (1.0 / gl.where(l_r > 0.0, l_r, 1.0))[:, None]
                gl.store(out_ptr + pid_b.to(gl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         o.to(gl.bfloat16), mask=mine[:, None])
            else:
                # a piece: its partial at [program, 0 (the stretch's first piece) or 1 (its last), group]
                rows = (gl.program_id(0).to(gl.int64) * 2 + (u != u0).to(gl.int64)) * GROUP + offs_g
                gl.store(po_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mine[:, None])
                gl.store(pm_ptr + 2 * rows, m_r, mask=mine)
                gl.store(pm_ptr + 2 * rows + 1, l_r, mask=mine)
                gl.thread_barrier()     # the warpgroup's partial stores precede the ticket (release, gpu scope)
                first = _owner(seg_start, programs, total)
                last = _owner(seg_end - 1, programs, total)
                ticket = ticket_ptr + pid_b * num_kv_heads + pid_kvh
                done = gl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
                if done == last - first:
                    gl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")      # reset for the next call
                    _merge_fused(out_ptr, po_ptr, pm_ptr, 0, 0, last - first + 1, pid_b, pid_kvh, stride_ob,
                                 stride_oh, first, seg_start, programs, total, GROUP, GP, HEAD_DIM, SPLIT_CHUNK,
                                 KV_HEADS, True)
            mid = gl.where(i == 1, mid, seg_end)
    else:
        _consume_items(q_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale, max_splits, min_tokens,
                       num_kv_heads, batch, n_items, stride_qb, stride_qh, stride_ob, stride_oh, k_smem, v_smem,
                       ready, empty, ranks_smem, plan_smem, offs_g, offs_d, s_layout, o_layout, rows_layout, GROUP,
                       HEAD_DIM, BLOCK_N, STAGES, SINGLE, KV_HEADS, FUSED, GP, SPLIT_CHUNK, RB, CHOOSE)


@gluon.jit
def _attend_item(q_ptr, pid_b, heads, offs_g, offs_d, stride_qb, stride_qh, k_smem, v_smem, ready, empty, slot, start,
                 end, seq_len, qk_scale, s_layout: gl.constexpr, o_layout: gl.constexpr, rows_layout: gl.constexpr,
                 GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 KV_HEADS: gl.constexpr):
    """The consumer's online softmax of one item (tokens [start, end) of a sequence) over the ring's stages from
    its count `slot` on: (unnormalised O, max, sum, in `rows_layout`; the ring's count past the item)."""
    q = gl.load(q_ptr + pid_b.to(gl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0)
    q_op = gl.convert_layout(q, gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    m_i = gl.full([_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([_ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([_ROWS, HEAD_DIM], gl.float32, o_layout)
    if _OVERLAP_TILES:
        acc, m_i, l_i = _tiles_overlapped(q_op, k_smem, v_smem, ready, empty, acc, m_i, l_i, slot, start, end,
                                          seq_len, qk_scale, s_layout, o_layout, BLOCK_N, HEAD_DIM, STAGES,
                                          GROUP, KV_HEADS)
        slot += gl.cdiv(end - start, BLOCK_N)
    else:
        for tile in range(gl.cdiv(end - start, BLOCK_N)):
            k_tile, v_tile = _ready_stage(k_smem, v_smem, ready, slot, start + tile * BLOCK_N, seq_len,
                                          BLOCK_N, HEAD_DIM, STAGES, KV_HEADS)
            s_tok = warpgroup_mma(q_op, k_tile.permute((1, 0)),
                                  gl.zeros([_ROWS, BLOCK_N * KV_HEADS], gl.float32, s_layout), use_acc=False,
                                  is_async=True)
            s, _, _ = warpgroup_mma_wait(0, deps=(s_tok, q_op, k_tile))
            p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, start + tile * BLOCK_N, end, qk_scale,
                                                 s_layout, BLOCK_N, GROUP, KV_HEADS)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(_p_bf16(p), gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                                     k_width=2))
            acc_tok = warpgroup_mma(p_op, v_tile, acc, is_async=True)
            acc, _, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op, v_tile))
            mbarrier.arrive(empty.index(slot % STAGES), count=1)
            slot += 1
    return (gl.convert_layout(acc, rows_layout), gl.convert_layout(m_i, gl.SliceLayout(1, rows_layout)),
            gl.convert_layout(l_i, gl.SliceLayout(1, rows_layout)), slot)


@gluon.jit
def _consume_items(q_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale, max_splits, min_tokens,
                   num_kv_heads, batch, n_items, stride_qb, stride_qh, stride_ob, stride_oh, k_smem, v_smem, ready,
                   empty, ranks_smem, plan_smem, offs_g, offs_d, s_layout: gl.constexpr, o_layout: gl.constexpr,
                   rows_layout: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, SINGLE: gl.constexpr, KV_HEADS: gl.constexpr, FUSED: gl.constexpr,
                   GP: gl.constexpr, SPLIT_CHUNK: gl.constexpr, RB: gl.constexpr, CHOOSE: gl.constexpr):
    """The consumer over its items (split, sequence, kv head) as _dealt deals them (not LEAN); partials are
    max_splits a (sequence, kv head) apart, and where the batch chose fewer (CHOOSE), program p first marks the
    rest of (sequence, kv head) p's dead for the merge."""
    slot = 0
    splits, n_items = _plan_now(plan_smem, max_splits, n_items, batch, num_kv_heads, CHOOSE, 4)
    if CHOOSE and not FUSED:
        # the partials past the count chosen, of (sequence, kv head) pid (one a program at most: one round), dead
        pid = gl.program_id(0)
        pid_b = pid // num_kv_heads
        for j in range(splits, gl.where(pid < batch * num_kv_heads, max_splits, splits)):
            rows = _partial_rows(pid.to(gl.int64) * max_splits + j, pid_b, j, offs_g, max_splits, GROUP, KV_HEADS)
            gl.store(pm_ptr + 2 * rows, gl.full([_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, rows_layout)),
                     mask=offs_g < GROUP)
    for k in range(gl.cdiv(n_items, gl.num_programs(0))):
        r, pid_s, pid_b, pid_kvh = _dealt(k, ranks_smem, batch, num_kv_heads, splits, RB, 4)
        seq_len, n_split, start, end = _item(pid_s, pid_b, seqlens_ptr, splits, min_tokens, BLOCK_N)
        heads = pid_kvh * GROUP + offs_g
        partial = (pid_b.to(gl.int64) * num_kv_heads + pid_kvh) * max_splits + pid_s    # its row of partials
        live = r < n_items
        if live & (pid_s < n_split):
            o, m_r, l_r, slot = _attend_item(q_ptr, pid_b, heads, offs_g, offs_d, stride_qb, stride_qh, k_smem,
                                             v_smem, ready, empty, slot, start, end, seq_len, qk_scale, s_layout,
                                             o_layout, rows_layout, GROUP, HEAD_DIM, BLOCK_N, STAGES, KV_HEADS)
            mine = offs_g < GROUP
            if SINGLE:
                o = o * (1.0 / gl.where(l_r > 0.0, l_r, 1.0))[:, None]
                gl.store(out_ptr + pid_b.to(gl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                         o.to(gl.bfloat16), mask=mine[:, None])
            else:
                rows = _partial_rows(partial, pid_b, pid_s, offs_g, max_splits, GROUP, KV_HEADS)
                gl.store(po_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mine[:, None])
                gl.store(pm_ptr + 2 * rows, m_r, mask=mine)
                gl.store(pm_ptr + 2 * rows + 1, l_r, mask=mine)
                if FUSED:
                    gl.thread_barrier()     # the warpgroup's partial stores precede the ticket (release, gpu scope)
                    ticket = ticket_ptr + pid_b * num_kv_heads + pid_kvh
                    done = gl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
                    if done == n_split - 1:
                        gl.atomic_xchg(ticket, 0, sem="relaxed", scope="gpu")      # reset for the next call
                        _merge_fused(out_ptr, po_ptr, pm_ptr, (pid_b.to(gl.int64) * num_kv_heads + pid_kvh) * KV_HEADS,
                                     max_splits, n_split, pid_b, pid_kvh, stride_ob, stride_oh, 0, 0, 1, 1, GROUP, GP,
                                     HEAD_DIM, SPLIT_CHUNK, KV_HEADS, False)
        elif not SINGLE and not FUSED:
            rows = _partial_rows(partial, pid_b, pid_s, offs_g, max_splits, GROUP, KV_HEADS)
            gl.store(pm_ptr + 2 * rows, gl.full([_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, rows_layout)),
                     mask=(offs_g < GROUP) & live)


@gluon.jit
def _decode_kernel(q_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, chosen_ptr,
                   qk_scale, max_splits, min_splits, min_tokens, num_kv_heads, batch, n_items, stride_qb, stride_qh,
                   stride_btb, stride_ob, stride_oh, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                   BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, SINGLE: gl.constexpr,
                   KV_HEADS: gl.constexpr, FUSED: gl.constexpr, GP: gl.constexpr, SPLIT_CHUNK: gl.constexpr,
                   LEAN: gl.constexpr, RB: gl.constexpr, CHOOSE: gl.constexpr, ITEM_COST: gl.constexpr):
    """One program an SM: the consumer warpgroup (the default partition: the registers the loader's 24 leave) and
    the loader warp over its items (LONGEST_FIRST: the sequences' ranks found first, by all warps of the consumer,
    into shared memory; CHOOSE: then the batch's split count, min_splits or max_splits, the grid's)."""
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N * KV_HEADS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N * KV_HEADS, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    # LONGEST_FIRST's ranks; by index (RB 0) 32 unused slots, as both partitions take the buffer either way
    ranks_smem = gl.allocate_shared_memory(gl.int32, [max(RB, 32)], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    plan_smem = gl.allocate_shared_memory(gl.int32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if RB > 0:
        ranks, lens = _seq_ranks(seqlens_ptr, batch, RB)
        ranks_smem.store(ranks)
        if CHOOSE:
            splits = _split_choice(lens, batch, ranks, min_splits, max_splits, num_kv_heads, min_tokens, ITEM_COST,
                                   BLOCK_N)
            lanes: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            plan = gl.zeros([32], gl.int32, lanes) + splits
            plan_smem.store(plan)
            offs = gl.arange(0, 32, layout=lanes)
            gl.store(chosen_ptr + offs, plan, mask=(offs == 0) & (gl.program_id(0) == 0))
    # the argument tuples are written out in the call: a tuple assigned to a name first has its constexprs made tensors
    gl.warp_specialize([
        (_consumer, (q_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale,
                     max_splits, min_tokens, num_kv_heads, batch, n_items, stride_qb, stride_qh, stride_btb, stride_ob,
                     stride_oh, k_smem, v_smem, ready, empty, ranks_smem, plan_smem, GROUP, HEAD_DIM, BLOCK_N, PAGE,
                     STAGES, SINGLE, KV_HEADS, FUSED, GP, SPLIT_CHUNK, LEAN, RB, CHOOSE)),
        (_loader, (q_ptr, k_desc, v_desc, bt_ptr, seqlens_ptr, out_ptr, po_ptr, pm_ptr, ticket_ptr, qk_scale,
                   max_splits, min_tokens, num_kv_heads, batch, n_items, stride_qb, stride_qh, stride_btb, stride_ob,
                   stride_oh, k_smem, v_smem, ready, empty, ranks_smem, plan_smem, GROUP, HEAD_DIM, BLOCK_N, PAGE,
                   STAGES, SINGLE, KV_HEADS, FUSED, GP, SPLIT_CHUNK, LEAN, RB, CHOOSE)),
    ], [1], [24])


@triton.jit
def _merge_kernel(out_ptr, po_ptr, pm_ptr, splits, stride_ob, stride_oh, GROUP: tl.constexpr, GP: tl.constexpr,
                  HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """Log-sum-exp merge of one (sequence, kv head)'s `splits` partials [split, group, d] (a max of -inf: none)."""
    pid_kvh, pid_b = tl.program_id(0), tl.program_id(1)
    row = (pid_b.to(tl.int64) * tl.num_programs(0) + pid_kvh) * splits
    offs_c, offs_g, offs_d = tl.arange(0, SPLIT_CHUNK), tl.arange(0, GP), tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    m_run = tl.full([GP], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, splits, SPLIT_CHUNK):
        msk = ((s0 + offs_c)[:, None] < splits) & mask_g[None, :]
        at = (row + s0 + offs_c)[:, None] * GROUP + offs_g[None, :]
        m_s = tl.load(pm_ptr + 2 * at, mask=msk, other=float("-inf"))
        live = m_s > float("-inf")
        l_s = tl.load(pm_ptr + 2 * at + 1, mask=msk & live, other=0.0)
        o_s = tl.load(po_ptr + at[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=(msk & live)[:, :, None],
                      other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(live, tl.exp2(m_s - m_ref[None, :]), 0.0)
        alpha = tl.exp2(m_run - m_ref)
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 0)
        m_run = m_new
    o = acc * (1.0 / tl.where(l_run > 0.0, l_run, 1.0))[:, None]
    heads = pid_kvh * GROUP + offs_g
    tl.store(out_ptr + pid_b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


def launch_options():
    """num_warps (the consumer's) and the registers a thread launches with: the loader's warp rounds up to a
    warpgroup, so 8 warps share an SM's 65,536 registers at 128 a thread until setmaxnreg moves them (the loader
    24, the consumer what is left). ALL_HEADS holds a 64 x 128 score tile beside O: 232 (one program an SM)."""
    return {"num_warps": 4, "maxnreg": 232 if ALL_HEADS else 128}


def launch_warps():
    """Warps a program launches with, the loader's partition rounded up to a warpgroup."""
    return 8


def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_cap(table_tokens):
    """The most splits a sequence of the table's width can take (MIN_TOKENS_PER_SPLIT a split, MAX_SPLITS)."""
    return max(1, min(MAX_SPLITS, -(-max(1, table_tokens) // max(BLOCK_N, MIN_TOKENS_PER_SPLIT))))


def grid_splits(batch, num_kv_heads, table_tokens, programs):
    """The grid's splits per sequence, from shapes only: of the counts a sequence of the table's width can take
    (split_cap), the fewest whose items take at least MIN_ROUNDS rounds of the programs and fill them (items /
    (rounds x programs)) at least ROUND_FILL, else the one that fills them best, rounds enough first (ties to
    fewer): each split more costs a partial and its merge."""
    pairs = max(1, batch * num_kv_heads)
    cap = split_cap(table_tokens)
    best, best_key = 1, (False, 0.0)
    for s in range(1, cap + 1):
        items = pairs * s
        rounds = -(-items // programs)
        fill, enough = items / (rounds * programs), rounds >= MIN_ROUNDS
        if enough and fill >= ROUND_FILL:
            return s
        if (enough, fill) > (best_key[0], best_key[1] + 1e-9):
            best, best_key = s, (enough, fill)
    return best


def split_range(batch, num_kv_heads, table_tokens, programs):
    """(fewest, most) splits a sequence the batch may take: the grid's plan (grid_splits), and with
    SPLITS_FROM_LENGTHS, where that plan is one round of items and the batch is ranked in one warp's lanes (<= 32),
    twice as many (where the table's width allows them): the grid is then one program an item of the fewer, and the
    programs choose between one round and two whole ones from the real lengths (_split_choice). At 1 only where
    the plan splits (a merge either way); at 2 also where it does not, which then pays partials and their merge
    whichever count the programs choose."""
    lo, pairs = grid_splits(batch, num_kv_heads, table_tokens, programs), batch * num_kv_heads
    if SPLITS_FROM_LENGTHS < (2 if lo == 1 else 1) or lo * pairs > programs or rank_lanes(batch) != 32:
        return lo, lo
    if ALL_HEADS:       # (its partials' rows are written for it, but no GPU test has run a choice with it)
        return lo, lo
    return lo, 2 * lo if 2 * lo <= split_cap(table_tokens) else lo


def item_tokens(length, split, splits):
    """Tokens of split `split` of a sequence of `length` when the batch takes `splits` (0: past its own), as the
    kernel sizes them (_chunk)."""
    min_tokens = max(BLOCK_N, MIN_TOKENS_PER_SPLIT)
    n = max(min(splits, -(-length // min_tokens)), 1)
    chunk = max(-(-(-(-length // n)) // BLOCK_N) * BLOCK_N, BLOCK_N)
    return max(0, min(chunk, length - split * chunk))


def split_estimates(lengths, num_kv_heads, lo, hi, programs):
    """SPLITS_FROM_LENGTHS: the busiest program's load (tokens, and ITEM_COST_TOKENS an item) as the kernel
    estimates it (_split_choice) for `lo` splits (one round of items) and for `hi` (two rounds of `programs`): the
    longest sequence's first split, or in two rounds that or the mean load of the programs holding two items."""
    order = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))
    per_seq, n_items, cost = hi * num_kv_heads, len(lengths) * hi * num_kv_heads, ITEM_COST_TOKENS
    first, paired = 2 * programs - n_items, 0
    for rank, b in enumerate(order):
        for j in range(hi):
            at, tokens = rank * per_seq + j * num_kv_heads, item_tokens(lengths[b], j, hi)
            paired += max(0, min(at + num_kv_heads, n_items) - max(at, first)) * (tokens + cost) if tokens else 0
    longest = max(lengths)
    return (item_tokens(longest, 0, lo) + cost,
            max(item_tokens(longest, 0, hi) + cost, paired // max(n_items - programs, 1)))


def chosen_splits(lengths, num_kv_heads, lo, hi, programs):
    """SPLITS_FROM_LENGTHS: the split count a batch of these lengths takes on `programs` programs, as the kernel
    chooses it: `hi` where its estimate finishes sooner than `lo`'s."""
    one_round, two_rounds = split_estimates(lengths, num_kv_heads, lo, hi, programs)
    return hi if two_rounds < one_round else lo


def kernel_shape(num_q_heads, num_kv_heads, page):
    """(query heads a program owns, kv heads a ring stage holds, kv heads a work item names, tokens a stage): one
    GQA group against BLOCK_N tokens of its kv head's rows, or (ALL_HEADS) every query head of the sequence against
    whole pages (each row masked to its own kv head's keys), as many as make 128 keys a stage (at least one)."""
    if ALL_HEADS:
        return num_q_heads, num_kv_heads, 1, max(page, 128 // num_kv_heads)
    return num_q_heads // num_kv_heads, 1, num_kv_heads, BLOCK_N


def cache_rows(cache):
    """A [blocks, page, kv heads, d] cache as TMA reads it, [blocks x page, kv heads x d] rows (ALL_HEADS:
    [blocks x page x kv heads, d]), or None where a tensor descriptor cannot (not contiguous, or not 16-byte
    aligned)."""
    blocks, page, heads, d = cache.shape
    if not cache.is_contiguous() or cache.data_ptr() % 16:
        return None
    return cache.view(blocks * page * heads, d) if ALL_HEADS else cache.view(blocks * page, heads * d)


def fused_merge_shape(rows, splits):
    """FUSED_COMBINE's merge: (its rows padded to a power of two, splits a load). A thread holds splits x rows of
    each partial a load, at most 32: ALL_HEADS' 32 rows at 2 splits spill beside its 64 x 128 scores, and 16 rows
    at 8 splits at the defaults."""
    gp = triton.next_power_of_2(rows)
    return gp, max(1, min(8, triton.next_power_of_2(splits), 32 // gp))


def rank_lanes(batch):
    """LONGEST_FIRST's lanes of sequence ranks (a power of two, 32 to 256), or 0: items dealt by index (off, LEAN,
    or a batch past 256, where comparing every pair of sequences in each program would cost more than it saves)."""
    if not LONGEST_FIRST or LEAN or batch > 256:
        return 0
    return max(32, triton.next_power_of_2(batch))


def _tickets(device, n):
    """At least n zeroed tickets on `device`; a smaller buffer stays alive (a CUDA graph may launch on it)."""
    bufs = _TICKETS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    batch, num_q_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    rows, kv_heads, item_heads, block_n = kernel_shape(num_q_heads, num_kv_heads, page)
    assert q.dtype == torch.bfloat16 and q.is_cuda and head_dim in (64, 128), "bf16 on CUDA, head_dim 64 or 128"
    assert block_n % page == 0 and page & (page - 1) == 0, "pages of 2^k tokens dividing BLOCK_N"
    assert rows <= ROWS and block_n * kv_heads <= 256, f"{rows} query heads a program (<= {ROWS}), <= 256 keys a stage"
    assert q.stride(2) == 1 and block_table.stride(1) == 1
    k_rows, v_rows = cache_rows(k_cache), cache_rows(v_cache)
    assert k_rows is not None and v_rows is not None, "a contiguous, 16-byte aligned [blocks, page, kv heads, d] cache"
    out = torch.empty_like(q)
    if batch == 0:
        return out
    sms = _sm_count(q.device) * PROGRAMS_PER_SM
    layout = gl.NVMMASharedLayout.get_default_for([block_n * kv_heads, head_dim], gl.bfloat16)
    k_desc, v_desc = (TensorDescriptor(r, list(r.shape), [r.stride(0), 1], [page * kv_heads, head_dim], layout)
                      for r in (k_rows, v_rows))
    group = num_q_heads // num_kv_heads
    f32 = dict(dtype=torch.float32, device=q.device)
    fewest = 0
    if LEAN:
        # every program a stretch; a piece's partial at [program, its first or last piece, group]
        assert not ALL_HEADS, "LEAN cuts one kv head's tiles a segment (not built with ALL_HEADS)"
        splits, items, programs, single, fused = 1, 0, sms, False, False
        po, pm = torch.empty((sms, 2, group, head_dim), **f32), torch.empty((sms, 2, group, 2), **f32)
        tickets = _tickets(q.device, batch * num_kv_heads)
        fused_gp, fused_chunk = fused_merge_shape(rows, 8)
    else:
        fewest, splits = split_range(batch, item_heads, block_table.shape[1] * page, sms)
        items = splits * item_heads * batch
        programs, single = min(fewest * item_heads * batch, sms), splits == 1
        po = out if single else torch.empty((batch, num_kv_heads, splits, group, head_dim), **f32)
        pm = out if single else torch.empty((batch, num_kv_heads, splits, group, 2), **f32)
        fused = bool(FUSED_COMBINE) and not single
        tickets = _tickets(q.device, batch * item_heads) if fused else seq_lens
        fused_gp, fused_chunk = fused_merge_shape(rows, splits) if fused else (1, 1)
    choose = 0 < fewest < splits
    if choose and q.device not in _CHOSEN:
        _CHOSEN[q.device] = torch.zeros(1, dtype=torch.int32, device=q.device)
    chosen = _CHOSEN[q.device] if choose else seq_lens
    _decode_kernel[(programs,)](
        q, k_desc, v_desc, block_table, seq_lens, out, po, pm, tickets, chosen, float(sm_scale) * _LOG2E, splits,
        fewest, max(block_n, MIN_TOKENS_PER_SPLIT), item_heads, batch, items, q.stride(0), q.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=rows, HEAD_DIM=head_dim, BLOCK_N=block_n, PAGE=page, STAGES=NUM_STAGES, SINGLE=single,
        KV_HEADS=kv_heads, FUSED=fused, GP=fused_gp, SPLIT_CHUNK=fused_chunk, LEAN=bool(LEAN),
        RB=rank_lanes(batch), CHOOSE=choose, ITEM_COST=ITEM_COST_TOKENS, **launch_options())
    if not LEAN and not single and not fused:
        gp, split_chunk = triton.next_power_of_2(group), max(2, min(8, triton.next_power_of_2(splits)))
        _merge_kernel[(num_kv_heads, batch)](out, po, pm, splits, out.stride(0), out.stride(1), GROUP=group, GP=gp,
                                             HEAD_DIM=head_dim, SPLIT_CHUNK=split_chunk, num_warps=4)
    return out
