"""The Gluon decode family (knowledge/attention/decode_gluon_sm90.py), tested like code. Gluon has no CPU
interpreter: on a machine without CUDA the kernel is compiled for sm90 with Triton's own ptxas
(tests/bench/sm90_compile.py) and its host side is checked; on a GPU (`pytest -m cuda`) every variant is compared
with the float64 reference. Speed is measured on the GPU by tests/bench/vs_library.py, not here."""
import pathlib

import pytest
import torch

from test_kernel_families import sm90_lines, softmax_steps
from test_reference_kernels_standalone import DEVICE, _load, decode_reference, make_decode_inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
GLUON_DECODE = ROOT / "knowledge" / "attention" / "decode_gluon_sm90.py"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def knob_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gluon_decode_variants")


def ptx_lines(path: pathlib.Path) -> list[str]:
    """A PTX file sm90_compile.py wrote (`--ptx`), its lines without comments."""
    return [line.split("//")[0].strip() for line in path.read_text().splitlines()]


def test_the_gluon_decode_compiled_for_sm90_holds_its_ring_in_shared_memory_without_spills():
    """What the family is for: NUM_STAGES K/V tiles of 32 KB (BLOCK_N 64, d 128) in flight a program, nothing
    spilled at the registers it launches with; at its 3 stages two programs fit an SM (PROGRAMS_PER_SM 2), at 6
    one."""
    shallow, deep = sm90_lines([str(GLUON_DECODE), f"{GLUON_DECODE}:NUM_STAGES=6"])
    for line, per_sm in ((deep, 1), (shallow, 2)):
        assert " 0 B stack" in line and f"at most {per_sm} programs per SM" in line, line
    assert float(shallow.split(" KB shared")[0].split()[-1]) >= 3 * 32, shallow
    assert "wgmma 2 in the code" in shallow, shallow


def test_the_gluon_decodes_split_plan_fills_the_programs_rounds_with_the_fewest_splits(knob_dir):
    """From shapes only: no split (and no merge) once batch x kv heads fills the programs' rounds to ROUND_FILL
    (128 or 512 pairs on 132 programs: 97%); at 8 x 8 pairs two splits (128 items), where more would fill no
    better; one sequence takes as many as fill them, but never more than the table's width allows at
    MIN_TOKENS_PER_SPLIT, and where none fills them, the count that fills them best."""
    mod = _load(GLUON_DECODE, None, knob_dir)
    assert mod.grid_splits(16, 8, 8192, 132) == 1
    assert mod.grid_splits(64, 8, 4096, 132) == 1
    assert mod.grid_splits(8, 8, 32768, 132) == 2
    assert mod.grid_splits(1, 8, 32768, 132) == 15        # 120 items: the first count past 90% of one round
    assert mod.grid_splits(1, 8, 512, 132) == 2          # 512 tokens: at most two splits of 256
    assert mod.grid_splits(1, 8, 100, 132) == 1
    assert mod.grid_splits(23, 8, 4096, 132) == 2         # 184 pairs: 70% of two rounds; 368 items 93% of three


def test_the_gluon_decodes_split_plan_at_min_rounds_2_splits_until_the_items_take_two_rounds(knob_dir):
    """MIN_ROUNDS 2 (for a ragged batch's deal to balance): 8 x 8 pairs take 4 splits (256 items, two rounds 97%
    full) where one round of 128 would do; 16 x 8 take 2; pairs that take two rounds unsplit stay unsplit; where no
    count reaches two rounds, the one that fills them best."""
    mod = _load(GLUON_DECODE, {"MIN_ROUNDS": 2}, knob_dir)
    assert mod.grid_splits(8, 8, 32768, 132) == 4
    assert mod.grid_splits(16, 8, 8192, 132) == 2
    assert mod.grid_splits(64, 8, 4096, 132) == 1
    assert mod.grid_splits(32, 8, 4096, 132) == 1         # 256 pairs: two rounds, 97%
    assert mod.grid_splits(1, 8, 512, 132) == 2           # 16 items at most: one round whatever the count


def test_the_gluon_decodes_longest_first_deal_ranks_a_batch_of_up_to_256_in_lanes_and_deals_larger_by_index(
        knob_dir):
    """LONGEST_FIRST ranks the batch's sequences in a power of two of lanes (at least a warp's 32), and compiled
    for sm90 at 32 and at 256 sequences spills nothing and keeps the defaults' registers; past 256 sequences (every
    pair compared in every program would cost more than it saves), with LEAN, or off, items are dealt by index."""
    longest = _load(GLUON_DECODE, {"LONGEST_FIRST": True}, knob_dir)
    assert [longest.rank_lanes(b) for b in (1, 32, 33, 64, 200, 256, 257)] == [32, 32, 64, 64, 256, 256, 0]
    assert _load(GLUON_DECODE, {"LONGEST_FIRST": False}, knob_dir).rank_lanes(64) == 0
    assert _load(GLUON_DECODE, {"LONGEST_FIRST": True, "LEAN": True}, knob_dir).rank_lanes(64) == 0
    by_index, at_32 = sm90_lines([f"{GLUON_DECODE}:LONGEST_FIRST=False", f"{GLUON_DECODE}:LONGEST_FIRST=True"])
    at_256, = sm90_lines([f"{GLUON_DECODE}:LONGEST_FIRST=True"], batch=256)
    regs = (lambda text: text.split(" registers")[0].split()[-1])
    for line in (at_32, at_256):
        assert " 0 B stack" in line and regs(line) == regs(by_index), (line, by_index)


def test_the_gluon_decode_may_choose_one_round_more_of_splits_only_where_its_plan_splits_a_batch_of_32_or_fewer(
        knob_dir):
    """SPLITS_FROM_LENGTHS: 8 x 8 pairs on 132 SMs may take 2 splits (one round of 128 programs) or 4 (two); a plan
    without a split (16 x 8) only at 2 (it then pays a merge either way), and a table too narrow for twice the
    splits, a plan of more than one round, a batch past one warp's lanes of ranks, or the knob off leaves none; and
    the kernel that chooses compiles for sm90 without a spill, in the registers of the kernel that does not."""
    choosing = _load(GLUON_DECODE, {"SPLITS_FROM_LENGTHS": 1}, knob_dir)
    assert choosing.split_range(8, 8, 32768, 132) == (2, 4)
    assert choosing.split_range(16, 8, 8192, 132) == (1, 1)
    assert _load(GLUON_DECODE, {"SPLITS_FROM_LENGTHS": 2}, knob_dir).split_range(16, 8, 8192, 132) == (1, 2)
    assert choosing.split_range(20, 8, 32768, 132) == (3, 3)        # 480 items: four rounds already
    assert choosing.split_range(33, 1, 32768, 132) == (4, 4)        # 33 sequences: ranked in 64 lanes
    assert choosing.split_range(8, 1, 4096, 132) == (15, 15)          # 8 pairs: at most 16 splits of 256
    assert _load(GLUON_DECODE, {"SPLITS_FROM_LENGTHS": 0}, knob_dir).split_range(8, 8, 32768, 132) == (2, 2)
    plain, chooses = sm90_lines([f"{GLUON_DECODE}:SPLITS_FROM_LENGTHS=0", str(GLUON_DECODE)], batch=8)
    regs = (lambda text: text.split(" registers")[0].split()[-1])
    assert " 0 B stack" in chooses and regs(chooses) == regs(plain), (chooses, plain)


def test_the_gluon_decodes_estimate_of_its_deal_keeps_one_round_for_equal_lengths_and_takes_two_for_ragged_ones(
        knob_dir):
    """The estimate the programs choose by (here on the host; 128 programs, one an item at 2 splits): 8 equal
    sequences of 4k at 2 splits are one round of 2k-token items, at 4 two rounds of 1k items, later by an item's
    cost; of 8 drawn from [2k, 4k], at 2 splits the longest's 2k sets the time, at 4 the deal pairs long items with
    short ones and they finish sooner: a program's load is about the mean of its pair's."""
    mod = _load(GLUON_DECODE, {"SPLITS_FROM_LENGTHS": 1}, knob_dir)
    cost = mod.ITEM_COST_TOKENS
    assert mod.split_estimates([4096] * 8, 8, 2, 4, 128) == (2048 + cost, 2 * (1024 + cost))
    assert mod.chosen_splits([4096] * 8, 8, 2, 4, 128) == 2
    ragged = [4096, 2100, 3000, 2500, 3900, 2048, 2800, 3500]
    one_round, two_rounds = mod.split_estimates(ragged, 8, 2, 4, 128)
    assert one_round == 2048 + cost and two_rounds < one_round
    assert mod.chosen_splits(ragged, 8, 2, 4, 128) == 4
    # 64 programs, 4 x 8 x 4 = 128 items, two full rounds: each program a 1k item of a long sequence, a 256 of a short
    assert mod.split_estimates([1024, 4096, 1024, 4096], 8, 2, 4, 64)[1] == (1024 + cost) + (256 + cost)


def test_the_gluon_decode_refuses_a_cache_a_tensor_descriptor_cannot_read(knob_dir):
    """A cache that is not [blocks, page, kv heads, d] contiguous is refused, not copied (a copy of the whole cache
    every call): cache_rows says None for it and the contiguous rows view otherwise."""
    mod = _load(GLUON_DECODE, None, knob_dir)
    cache = torch.zeros(6, 16, 8, 128, dtype=torch.bfloat16)
    assert mod.cache_rows(cache).shape == (96, 1024)
    assert mod.cache_rows(cache.transpose(1, 2)) is None
    assert mod.cache_rows(cache[:, :, :4]) is None


def test_the_gluon_decodes_merge_weighs_each_live_split_and_ignores_dead_ones_whatever_they_hold(knob_dir):
    """The split grid's merge (a plain Triton kernel: the CPU runs it in Triton's interpreter): partials as the
    consumer writes them (per split, the exp2-domain max of its scaled scores, the sum of exp2 of the rest, the
    unnormalised P V), the splits past a sequence's own marked by a max of -inf and their sum and O left as NaN
    (never written). The merged rows equal softmax(scores) V of each (sequence, query head) over the live splits'
    tokens alone."""
    mod = _load(GLUON_DECODE, None, knob_dir)
    g = torch.Generator().manual_seed(5)
    batch, hkv, group, d, splits, chunk = 3, 2, 4, 64, 4, 16
    live = [4, 1, 3]                                          # splits each sequence uses; the rest are dead
    po = torch.full((batch, hkv, splits, group, d), float("nan"), dtype=torch.float64)
    pm = torch.full((batch, hkv, splits, group, 2), float("nan"), dtype=torch.float64)
    want = torch.empty(batch, hkv * group, d, dtype=torch.float64)
    for b in range(batch):
        for h in range(hkv):
            s = torch.randn(group, live[b] * chunk, generator=g, dtype=torch.float64) * 3
            v = torch.randn(live[b] * chunk, d, generator=g, dtype=torch.float64)
            want[b, h * group:(h + 1) * group] = torch.softmax(s, 1) @ v
            z = s * 1.4426950408889634                        # the exp2 domain
            for k in range(splits):
                if k >= live[b]:
                    pm[b, h, k, :, 0] = float("-inf")
                    continue
                zk, vk = z[:, k * chunk:(k + 1) * chunk], v[k * chunk:(k + 1) * chunk]
                m = zk.max(1).values
                p = torch.exp2(zk - m[:, None])
                pm[b, h, k, :, 0], pm[b, h, k, :, 1], po[b, h, k] = m, p.sum(1), p @ vk
    out = torch.zeros(batch, hkv * group, d, dtype=torch.float32, device=DEVICE)
    mod._merge_kernel[(hkv, batch)](out, po.float().to(DEVICE), pm.float().to(DEVICE), splits, out.stride(0),
                                    out.stride(1), GROUP=group, GP=group, HEAD_DIM=d, SPLIT_CHUNK=2, num_warps=4)
    assert torch.isfinite(out).all()
    assert (out.double().cpu() - want).abs().max() < 1e-5


def test_the_gluon_decodes_tile_overlap_keeps_the_tile_befores_pv_in_flight_through_the_next_tiles_softmax():
    """OVERLAP_TILES issues tile j's Q K^T and tile j-1's P V together and waits for the first alone: compiled for
    sm90, one wait leaves a product in flight (at the defaults none does) and nothing spills; with one ring stage,
    where tile j's stage would be tile j-1's, still held, the knob falls back to the defaults' code."""
    plain, overlap, plain1, overlap1 = sm90_lines([str(GLUON_DECODE), f"{GLUON_DECODE}:OVERLAP_TILES=True",
                                                   f"{GLUON_DECODE}:NUM_STAGES=1",
                                                   f"{GLUON_DECODE}:NUM_STAGES=1,OVERLAP_TILES=True"])
    assert "waits by pendings {0: 2}" in plain and "{0: 3, 1: 1}" in overlap and " 0 B stack" in overlap, overlap
    assert plain1.split(" -> ")[1] == overlap1.split(" -> ")[1], (plain1, overlap1)


def test_the_gluon_decodes_all_heads_step_scores_every_query_head_against_a_whole_page_of_every_kv_head():
    """ALL_HEADS: a program takes every query head of a sequence (32 rows of the wgmma's 64) and a ring stage holds
    whole pages, every kv head's rows (a page of 16 tokens x 8 kv heads: 128 keys, 32 KB of K contiguous in the
    cache), each row masked to its own kv head's keys. Compiled for sm90: a thread's share of a step's scores is
    64 x 128 / 128 = 64 exponentials (and its two rows' rescale factors), against 34 at the defaults, nothing
    spills at the registers it launches with, and one program fits an SM."""
    plain, all_heads = sm90_lines([str(GLUON_DECODE), f"{GLUON_DECODE}:ALL_HEADS=True"])
    for line, ex2 in ((plain, 34), (all_heads, 66)):
        steps = softmax_steps(line)
        assert steps and all(n == ex2 for _, n in steps), line
    assert " 0 B stack" in all_heads and "at most 1 programs per SM" in all_heads, all_heads


def test_the_gluon_decodes_in_kernel_merges_take_one_gpu_scope_ticket_after_the_partials_stores(tmp_path):
    """FUSED_COMBINE (on its own and with ALL_HEADS) and LEAN: compiled for sm90, nothing spills and the registers
    and shared memory are those without it (LEAN's: those of items dealt by index); the PTX takes one ticket, an
    acq_rel add at gpu scope, after a barrier that follows the partial's stores (the release covers every thread's),
    resets it with one relaxed exchange and reads the partials past L1 (.cg). The defaults take none."""
    specs = [str(GLUON_DECODE), f"{GLUON_DECODE}:FUSED_COMBINE=True", f"{GLUON_DECODE}:ALL_HEADS=True",
             f"{GLUON_DECODE}:ALL_HEADS=True,FUSED_COMBINE=True", f"{GLUON_DECODE}:LEAN=True",
             f"{GLUON_DECODE}:LONGEST_FIRST=False"]      # (LEAN deals no items: no ranks in shared memory)
    lines = sm90_lines(specs, options=("--ptx", str(tmp_path)))
    for plain, merged in ((lines[0], lines[1]), (lines[2], lines[3]), (lines[5], lines[4])):
        regs = (lambda line: line.split(" registers")[0].split()[-1])
        assert " 0 B stack" in merged and regs(merged) == regs(plain), (plain, merged)
        assert merged.split(" B stack")[1].split("->")[0] == plain.split(" B stack")[1].split("->")[0], (plain, merged)
    for i in (1, 3, 4):
        ptx = ptx_lines(tmp_path / f"{i}.ptx")
        atoms = [i for i, line in enumerate(ptx) if " atom." in f" {line}"]
        adds = [i for i in atoms if "atom.global.gpu.acq_rel.add" in ptx[i]]
        assert len(adds) == 1 and len(atoms) == 2, [ptx[i] for i in atoms]
        assert "atom.global.gpu.relaxed.exch" in ptx[max(set(atoms) - set(adds))]
        before = ptx[:adds[0]]
        last_store = max(i for i, line in enumerate(before) if "st.global" in line)
        assert any(line.startswith("bar.sync") for line in before[last_store:]), before[last_store:]
        assert any("ld.global.cg" in line for line in ptx[adds[0]:])
    assert not any(" atom." in f" {line}" for line in ptx_lines(tmp_path / "0.ptx"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): Gluon has no CPU interpreter")
@pytest.mark.parametrize("knobs, lens, hq, hkv, d", [
    ({}, [1, 15, 16, 17, 63, 64, 65, 300, 1000, 2049], 32, 8, 128),       # several splits: partials and the merge
    ({}, [300] * 63 + [1, 33, 2100], 16, 4, 128),       # 264 items, no split: two a program, ties, dealt back
    ({}, [5, 130, 3000], 16, 2, 64),                                        # a group of 8, d 64
    ({"NUM_STAGES": 2}, [1, 17, 64, 65, 1500], 32, 8, 128),               # the ring wraps every other tile
    ({"BLOCK_N": 32, "NUM_STAGES": 8}, [3, 31, 32, 33, 900], 32, 8, 128),
    ({"BLOCK_N": 128, "NUM_STAGES": 3}, [1, 127, 128, 129, 2000], 32, 8, 128),
    ({"MIN_TOKENS_PER_SPLIT": 64, "MAX_SPLITS": 32}, [70, 640, 2500], 32, 4, 128),
    ({"PROGRAMS_PER_SM": 2, "BLOCK_N": 128, "NUM_STAGES": 1}, [1, 129, 700, 4000], 32, 8, 128),
    ({"OVERLAP_TILES": True}, [1, 15, 16, 17, 63, 64, 65, 300, 1000, 2049], 32, 8, 128),
    ({"OVERLAP_TILES": True, "NUM_STAGES": 2}, [300] * 63 + [1, 33, 2100], 16, 4, 128),
    ({"OVERLAP_TILES": True, "BLOCK_N": 128, "NUM_STAGES": 2}, [5, 127, 128, 129, 3000], 16, 2, 64),
    ({"ALL_HEADS": True}, [1, 15, 16, 17, 63, 64, 65, 300, 1000, 2049], 32, 8, 128),    # a page a stage
    ({"ALL_HEADS": True, "OVERLAP_TILES": True}, [300] * 63 + [1, 33, 2100], 16, 4, 128),   # two pages a stage
    ({"ALL_HEADS": True, "NUM_STAGES": 2}, [5, 130, 3000], 16, 2, 64),                  # four, a group of 8
    ({"FUSED_COMBINE": True}, [1, 15, 16, 17, 63, 64, 65, 300, 1000, 2049], 32, 8, 128),   # the last split merges
    ({"FUSED_COMBINE": True, "MIN_TOKENS_PER_SPLIT": 64, "MAX_SPLITS": 32}, [70, 640, 2500], 32, 4, 128),
    ({"FUSED_COMBINE": True, "ALL_HEADS": True}, [1, 15, 16, 17, 63, 64, 65, 300, 1000, 2049], 32, 8, 128),
    ({"FUSED_COMBINE": True, "ALL_HEADS": True, "NUM_STAGES": 2}, [5, 130, 3000], 16, 2, 64),
    ({"LEAN": True}, [1, 15, 16, 17, 63, 64, 65, 300, 1000, 2049], 32, 8, 128),   # pieces of 4 tiles, merged
    ({"LEAN": True}, [300] * 63 + [1, 33, 2100], 16, 4, 128),       # stretches of whole (sequence, kv head)s
    ({"LEAN": True}, [5, 130, 3000], 16, 2, 64),
    ({"LEAN": True, "OVERLAP_TILES": True, "NUM_STAGES": 2}, [1, 17, 64, 65, 1500], 32, 8, 128),
    ({"LEAN": True, "MIN_TOKENS_PER_SPLIT": 4096}, [70, 640, 2500, 1], 32, 4, 128),   # 4 programs, the rest idle
    ({"LEAN": True}, [(i * 37) % 700 + 1 for i in range(300)], 16, 2, 128),  # lengths read in several chunks
    ({}, [(i * 37) % 700 + 1 for i in range(200)], 16, 2, 128),            # ranks in 256 lanes, two rounds
    ({}, [(i * 37) % 700 + 1 for i in range(300)], 16, 2, 128),            # past 256 sequences: by index
    ({}, [333] * 200, 16, 2, 128),                                          # equal lengths: ranked by index
    ({"ALL_HEADS": True}, [5, 130, 3000, 64, 65], 16, 2, 64),
    ({"LONGEST_FIRST": False}, [1, 15, 16, 17, 63, 64, 65, 300, 1000, 2049], 32, 8, 128),   # by index
    ({"LONGEST_FIRST": False}, [300] * 63 + [1, 33, 2100], 16, 4, 128),
    ({"MIN_ROUNDS": 2}, [5000, 16000, 9000, 12000, 1, 700], 32, 8, 128),     # 5 splits (132 SMs): two rounds
], ids=["splits", "no-split-many-items", "group8-d64", "two-stages", "block32", "block128", "fine-splits",
        "two-programs-an-sm", "overlap-splits", "overlap-two-stages-many-items", "overlap-block128-group8-d64",
        "all-heads-splits", "all-heads-overlap-many-items", "all-heads-two-stages-group8-d64", "fused-splits",
        "fused-fine-splits", "fused-all-heads-splits", "fused-all-heads-two-stages-group8-d64", "lean-pieces",
        "lean-whole-segments", "lean-group8-d64", "lean-overlap-two-stages", "lean-few-programs", "lean-batch-300",
        "batch-200", "batch-300-by-index", "batch-200-equal", "all-heads-group8-d64-five", "by-index-splits",
        "by-index-no-split-many-items", "two-rounds-of-splits"])
def test_the_gluon_decode_matches_float64_with_nan_in_unowned_slots_on_gpu(knob_dir, knobs, lens, hq, hkv, d):
    """bf16 at lengths around its pages and tiles, every slot no sequence owns NaN (a page's unused tail, which the
    kernel loads whole, among them): finite, and within parity's bf16 floors doubled of the float64 reference."""
    mod = _load(GLUON_DECODE, knobs, knob_dir)
    q, k, v, table, lens_t = make_decode_inputs(lens, hq, hkv, d, 16, extra_pages=2, seed=len(lens) * 7 + d)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))        # (NaN stays NaN)
    out = mod.decode(q, k, v, table, lens_t, d ** -0.5).double().cpu()
    ref = decode_reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens_t.cpu(), d ** -0.5)
    assert torch.isfinite(out).all(), "an output row unwritten or not finite"
    assert (out - ref).abs().max() < 3.2e-2 and (out - ref).norm() / ref.norm() < 1.2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): Gluon has no CPU interpreter")
@pytest.mark.parametrize("knobs, batch", [({"SPLITS_FROM_LENGTHS": 1}, 8),
                                          ({"SPLITS_FROM_LENGTHS": 1, "FUSED_COMBINE": True}, 8),
                                          ({"SPLITS_FROM_LENGTHS": 2}, 16)], ids=["merge-kernel", "fused", "unsplit"])
def test_the_gluon_decode_chooses_its_split_count_from_the_real_lengths_as_its_model_does_on_gpu(knob_dir, knobs,
                                                                                                 batch):
    """SPLITS_FROM_LENGTHS on 8 sequences of up to 4k (2 splits or 4, on 128 programs; 16: 1 or 2): each batch's
    programs choose the count the host's model of the deal picks, the equal batch the fewer and a ragged one (a
    sequence of one token among them) the more, and either way the output is the float64 reference's (the
    partials past a fewer count marked dead for the merge, whatever they held)."""
    mod = _load(GLUON_DECODE, knobs, knob_dir)
    chosen = set()
    ragged = [4096, 1, 3000, 2500, 3900, 2048, 2800, 3500, 1000, 4000, 2222, 3333, 1500, 3700, 2900, 2600][:batch]
    for lens in ([4096] * batch, ragged):
        q, k, v, table, lens_t = make_decode_inputs(lens, 32, 8, 128, 16, extra_pages=2, seed=len(set(lens)))
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        _, _, item_heads, _ = mod.kernel_shape(32, 8, 16)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count * mod.PROGRAMS_PER_SM
        lo, hi = mod.split_range(batch, item_heads, table.shape[1] * 16, sms)
        assert lo < hi, (lo, hi)
        mod._CHOSEN.pop(q.device, None)
        out = mod.decode(q, k, v, table, lens_t, 128 ** -0.5).double().cpu()
        expect = mod.chosen_splits(lens, item_heads, lo, hi, min(batch * item_heads * lo, sms))
        assert int(mod._CHOSEN[q.device]) == expect
        chosen.add(expect == hi)
        ref = decode_reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens_t.cpu(), 128 ** -0.5)
        assert torch.isfinite(out).all() and (out - ref).abs().max() < 3.2e-2, lens
        assert (out - ref).norm() / ref.norm() < 1.2e-2, lens
    assert chosen == {False, True}, "both counts chosen"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): Gluon has no CPU interpreter")
@pytest.mark.parametrize("knobs", [{"FUSED_COMBINE": True, "MIN_TOKENS_PER_SPLIT": 64, "MAX_SPLITS": 32},
                                   {"LEAN": True, "MIN_TOKENS_PER_SPLIT": 64}], ids=["fused", "lean"])
def test_the_gluon_decodes_in_kernel_merge_leaves_its_tickets_at_zero_for_the_next_call_on_gpu(knob_dir, knobs):
    """FUSED_COMBINE (fine splits: sequences with fewer live splits than the grid) or LEAN (pieces of one tile)
    twice on the same inputs: each (sequence, kv head)'s last split or piece resets its ticket, so the second call
    merges as the first did, bit for bit (the merging program reads every partial in order, whichever it is), and
    the tickets end at zero."""
    mod = _load(GLUON_DECODE, knobs, knob_dir)
    q, k, v, table, lens_t = make_decode_inputs([70, 640, 2500, 1], 32, 4, 128, 16, extra_pages=2, seed=11)
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    first = mod.decode(q, k, v, table, lens_t, 128 ** -0.5)
    second = mod.decode(q, k, v, table, lens_t, 128 ** -0.5)
    ref = decode_reference(q.cpu(), k.cpu(), v.cpu(), table.cpu(), lens_t.cpu(), 128 ** -0.5)
    assert torch.equal(first, second)
    assert torch.isfinite(second).all() and (second.double().cpu() - ref).abs().max() < 3.2e-2
    assert mod._TICKETS and all(int(t.count_nonzero()) == 0 for bufs in mod._TICKETS.values() for t in bufs)
