"""The Gluon prefill family (knowledge/attention/prefill_gluon_sm90.py), tested like code. Gluon has no CPU
interpreter: on a machine without CUDA the family is compiled for sm90 with Triton's own ptxas
(tests/bench/sm90_compile.py) and its host side is held to Triton's binder; on a GPU (`pytest -m cuda`) every
variant is compared with the float64 reference and its launch paths with each other. Speed is measured on the GPU
by tests/bench/vs_library.py, not here."""
import pathlib

import pytest
import torch

from test_kernel_families import sm90_lines, softmax_steps
from test_reference_kernels_standalone import _load, prefill_reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
PREFILL = ROOT / "knowledge" / "attention" / "prefill_causal_tma.py"
GLUON_PREFILL = ROOT / "knowledge" / "attention" / "prefill_gluon_sm90.py"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def knob_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gluon_variants")


def _waits(line: str) -> dict[int, int]:
    """sm90_compile.py's count of wgmma waits by how many products each leaves in flight."""
    import ast
    text = line.split("waits by pendings ")[1].split(";")[0]
    return {} if text == "none" else ast.literal_eval(text)


def test_the_gluon_prefill_compiled_for_sm90_keeps_a_tiles_pv_in_flight_through_the_next_tiles_softmax():
    """What the Gluon prefill family is for (knowledge/attention/prefill_gluon_sm90.py): with one warpgroup a program,
    each step of its two tile loops waits for the new tile's scores with one product (the tile before's P V) left in
    flight, which plain Triton's TMA family never does (its every wait leaves none), and at 64-token tiles it still
    fits two programs an SM. At the family's defaults (a loader warp, PRODUCER_WARP) each of its two consumer
    warpgroups waits so, and at its register split (the loader's 24, each consumer's CONSUMER_REGS) nothing
    spills."""
    tma, gluon, ws = sm90_lines([str(PREFILL), f"{GLUON_PREFILL}:PRODUCER_WARP=False,Q_REGS=False,BLOCK_N=64",
                               str(GLUON_PREFILL)])
    assert set(_waits(tma)) == {0}, tma
    assert _waits(gluon).get(1) == 2 and int(gluon.split("at most ")[1].split()[0]) >= 2, gluon
    assert _waits(ws).get(1, 0) >= 4 and " 0 B stack" in ws, ws


def test_the_gluon_prefills_packed_conversion_of_p_leaves_no_byte_permute_and_no_more_registers():
    """PACKED_CVT converts P to bf16 a pair of values an instruction, packed as the P V wgmma reads them. Compiled
    for sm90 at the defaults and with one warpgroup a program: no byte permute (PRMT) is left in the SASS, the
    kernel has fewer instructions than without the knob, and its registers, spills and shared memory are the same."""
    plain, packed, plain1, packed1 = sm90_lines([f"{GLUON_PREFILL}:{knobs}" for knobs in (
        "PACKED_CVT=False", "PACKED_CVT=True", "PRODUCER_WARP=False,PACKED_CVT=False",
        "PRODUCER_WARP=False,PACKED_CVT=True")])
    for before, after in ((plain, packed), (plain1, packed1)):
        sass = [int(line.split("SASS ")[1].split()[0]) for line in (before, after)]
        assert " 0 byte permutes" in after and sass[1] < sass[0], (before, after)
        assert before.split(" -> ")[0].split()[1:] == after.split(" -> ")[0].split()[1:], (before, after)


def test_the_gluon_prefills_item_overlap_keeps_an_items_last_pv_in_flight_beside_the_next_items_first_qk():
    """OVERLAP_ITEMS issues a work item's last P V and the next item's first Q K^T together and waits for the first
    alone (O is stored while the second runs): compiled for sm90, each consumer warpgroup has one more wait that
    leaves a product in flight than without it, and at 64-token tiles nothing spills (at 128, 8 bytes do); at
    NUM_STAGES 2, where the next item's first tile could wait on a stage this item has not released, the knob falls
    back to the defaults' code."""
    plain, overlap, plain2, overlap2 = sm90_lines([f"{GLUON_PREFILL}:BLOCK_N=64", f"{GLUON_PREFILL}:BLOCK_N=64,"
                                                   "OVERLAP_ITEMS=True", f"{GLUON_PREFILL}:NUM_STAGES=2",
                                                   f"{GLUON_PREFILL}:NUM_STAGES=2,OVERLAP_ITEMS=True"])
    assert _waits(overlap).get(1, 0) == _waits(plain).get(1, 0) + 2 and " 0 B stack" in overlap, (plain, overlap)
    assert plain2.split(" -> ")[1] == overlap2.split(" -> ")[1], (plain2, overlap2)


def test_the_gluon_prefills_128_token_tiles_run_fewer_instructions_a_key_in_each_step():
    """BLOCK_N 128 (FlashAttention-3's tile for d 128) spreads a step's fixed work (O's rescale, the row max's
    shuffles, the barriers) over twice the keys: compiled for sm90 with the loader warp and Q in registers, every
    step variant of the consumers' loop runs fewer instructions a key than at 64-token tiles, as many variants,
    and nothing spills. A step is one tile: a thread's share of 64 rows x BLOCK_N exponentials (BLOCK_N / 2) and
    its two rows' rescale factors. 128 is the default (3 stages)."""
    narrow, wide = sm90_lines([f"{GLUON_PREFILL}:BLOCK_N=64", str(GLUON_PREFILL)])
    steps = {64: softmax_steps(narrow), 128: softmax_steps(wide)}
    assert all(ex2 == block_n // 2 + 2 for block_n, found in steps.items() for _, ex2 in found), (narrow, wide)
    assert len(steps[64]) == len(steps[128]) >= 3, (narrow, wide)
    assert all(w / 128 < n / 64 for (n, _), (w, _) in zip(steps[64], steps[128])), (narrow, wide)
    assert " 0 B stack" in wide, wide


ONE_WARPGROUP = {"PRODUCER_WARP": False, "Q_REGS": False}
ONE_ITEM = {"PERSISTENT": False}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): Gluon has no CPU interpreter")
@pytest.mark.parametrize("knobs, d", [
    ({}, 128),
    (ONE_WARPGROUP, 128), ({**ONE_WARPGROUP, "BLOCK_M": 128, "NUM_WARPS": 8, "NUM_STAGES": 2}, 128),
    ({**ONE_WARPGROUP, "BLOCK_N": 128, "NUM_STAGES": 2}, 64), ({"PRODUCER_WARP": False}, 128),
    ({**ONE_ITEM, "Q_REGS": False}, 128), ({**ONE_ITEM, "Q_REGS": False, "BLOCK_N": 128, "NUM_STAGES": 2}, 128),
    (ONE_ITEM, 64), ({**ONE_ITEM, "Q_REGS": False, "PINGPONG": True}, 128),
    ({"Q_REGS": False, "PINGPONG": True}, 64), ({"SEQUENCE_MAJOR": True}, 128),
    ({"DYNAMIC": True}, 128), ({"DYNAMIC": True, "SEQUENCE_MAJOR": True, "PINGPONG": True, "Q_REGS": False}, 64),
    ({"RESCALE_THRESHOLD": 8.0}, 128), ({"RESCALE_THRESHOLD": 0.5, **ONE_WARPGROUP}, 64),
    ({"PACKED_CVT": False}, 128), ({"PACKED_CVT": False, **ONE_WARPGROUP}, 64),
    ({"OVERLAP_ITEMS": True}, 128), ({"OVERLAP_ITEMS": True, "Q_REGS": False, "PINGPONG": True, "NUM_STAGES": 4}, 64),
    ({"ALTERNATE": True}, 128), ({"ALTERNATE": True, "OVERLAP_ITEMS": True, "SEQUENCE_MAJOR": True}, 64),
    ({"BALANCED": True}, 128), ({"BALANCED": True, "OVERLAP_ITEMS": True, "SEQUENCE_MAJOR": True}, 64),
    ({"BLOCK_N": 128, "NUM_STAGES": 2}, 128), ({"BLOCK_N": 64}, 128),
    ({"BLOCK_N": 128, "NUM_STAGES": 3, "RESCALE_THRESHOLD": 8.0}, 64),
], ids=["defaults-d128", "one-warpgroup-d128", "two-warpgroups-d128", "wide-kv-d64", "q-in-registers-d128",
        "loader-warp-d128", "loader-warp-wide-kv-d128", "loader-warp-q-in-registers-d64", "loader-warp-turns-d128",
        "persistent-turns-d64", "persistent-sequence-major-d128", "dynamic-q-in-registers-d128",
        "dynamic-sequence-major-turns-d64", "rescale-threshold-d128", "one-warpgroup-rescale-often-d64",
        "plain-cvt-d128", "one-warpgroup-plain-cvt-d64", "overlap-items-d128", "overlap-items-q-shared-turns-d64",
        "alternate-d128", "alternate-overlap-sequence-major-d64", "balanced-d128",
        "balanced-overlap-sequence-major-d64", "wide-kv-two-stages-d128", "narrow-kv-d128",
        "wide-kv-three-stages-rescale-threshold-d64"])
def test_the_gluon_prefill_matches_float64_at_mixed_lengths_on_gpu(knob_dir, knobs, d):
    """bf16 at lengths around its tiles (1, one short of a tile, a tile, one past, several, a long one) in one packed
    batch, 32 q / 8 kv heads, every output row written (the allocator poisoned with NaN first); within parity's
    bf16 floors doubled of the float64 reference."""
    mod = _load(GLUON_PREFILL, knobs, knob_dir)
    lens, hq, hkv = [1, 17, 63, 64, 65, 130, 700, 2049], 32, 8
    g = torch.Generator().manual_seed(71)
    q, k, v = (torch.randn(sum(lens), h, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1.0 / d ** 0.5
    dev = [x.to("cuda", torch.bfloat16) for x in (q, k, v)]
    poison = torch.full_like(dev[0], float("nan"))          # what the output's allocation gets next
    del poison
    out = mod.prefill(*dev, cu.cuda(), max(lens), scale).double().cpu()
    ref = prefill_reference(*(x.cpu() for x in dev), cu, scale)     # float64 on the inputs the kernel got
    assert torch.isfinite(out).all(), "an output row unwritten or not finite"
    assert (out - ref).abs().max() < 3.2e-2 and (out - ref).norm() / ref.norm() < 1.2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): Gluon has no CPU interpreter")
@pytest.mark.parametrize("knobs", [{}, {"DYNAMIC": True}], ids=["persistent", "dynamic"])
def test_the_gluon_prefill_launched_as_compiled_gives_the_jit_launchs_outputs_across_specializations_on_gpu(
        knob_dir, knobs):
    """DIRECT_LAUNCH reuses a compiled kernel for a call whose arguments Triton would specialize alike. Calls whose
    int arguments move between Triton's classes (1, multiples of 16, others: the query tiles, the batch, the work
    items) and whose cu_seqlens is or is not 16-byte aligned, each made twice (the second launched as compiled),
    give bit for bit the outputs of the same file launched through the JIT every time."""
    jit = _load(GLUON_PREFILL, knobs, knob_dir)
    direct = _load(GLUON_PREFILL, {**knobs, "DIRECT_LAUNCH": True}, knob_dir)
    g = torch.Generator(device="cuda").manual_seed(5)
    cases = [[100], [90], [1], [2048], [2000], [1900, 17], [128, 128], [3000, 5, 700], [16 * 128], [40] * 16,
             [700, 1]]
    for n, lens in enumerate(cases):
        total, hq, hkv, d = sum(lens), 32, 8, 128
        bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
        cu = torch.tensor([7, *bounds], dtype=torch.int32, device="cuda")[1:] if n % 2 else \
            torch.tensor(bounds, dtype=torch.int32, device="cuda")
        for _ in range(2):
            q, k, v = (torch.randn(total, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
                       for h in (hq, hkv, hkv))
            want = jit.prefill(q, k, v, cu, max(lens), 0.088)
            got = direct.prefill(q, k, v, cu, max(lens), 0.088)
            assert torch.equal(got, want), f"lengths {lens}, cu_seqlens aligned: {cu.data_ptr() % 16 == 0}"
    assert len(direct._compiled) >= 4, "the calls met one specialization only: nothing tested the key"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA): Gluon has no CPU interpreter")
@pytest.mark.parametrize("knobs, knob, d", [
    ({}, "PACKED_CVT", 128), (ONE_WARPGROUP, "PACKED_CVT", 64), ({}, "OVERLAP_ITEMS", 128),
    ({"Q_REGS": False, "SEQUENCE_MAJOR": True}, "OVERLAP_ITEMS", 64), ({}, "ALTERNATE", 128),
    ({"OVERLAP_ITEMS": True}, "ALTERNATE", 64), ({}, "BALANCED", 128), ({"OVERLAP_ITEMS": True}, "BALANCED", 64),
], ids=["packed-cvt-d128", "packed-cvt-one-warpgroup-d64", "overlap-items-d128", "overlap-items-q-shared-d64",
        "alternate-d128", "alternate-overlap-d64", "balanced-d128", "balanced-overlap-d64"])
def test_the_gluon_prefills_exact_knobs_give_the_defaults_outputs_bit_for_bit_on_gpu(knob_dir, knobs, knob, d):
    """Knobs that change how the same arithmetic is issued, not the arithmetic, give the outputs without them exactly.
    PACKED_CVT rounds P to bf16 as `.to` does (to nearest even) and packs each pair in the order the P V wgmma reads
    it: a swapped pair would pair each P with the wrong key's V. OVERLAP_ITEMS finishes an item's last P V and
    stores its O while the next item's first Q K^T runs: a stage released early, an O stored before its last product
    or to the next item's rows would show. ALTERNATE and BALANCED hand the same items to other programs: an item
    left out or taken twice would show. Batches of many items a program (an SM walks 132 programs' worth), with
    items past a short sequence's end skipped between held ones, and rounds the items do not fill."""
    plain = _load(GLUON_PREFILL, {**knobs, knob: False}, knob_dir)
    changed = _load(GLUON_PREFILL, {**knobs, knob: True}, knob_dir)
    g = torch.Generator(device="cuda").manual_seed(11)
    for lens in ([1, 17, 64, 65, 700], [2049], [128] * 8, [3000, 5, 700, 1, 260], [40] * 48):
        q, k, v = (torch.randn(sum(lens), h, d, device="cuda", generator=g, dtype=torch.bfloat16) for h in (32, 8, 8))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        want = plain.prefill(q, k, v, cu, max(lens), d ** -0.5)
        assert torch.equal(changed.prefill(q, k, v, cu, max(lens), d ** -0.5), want), f"lengths {lens}"


@pytest.mark.parametrize("knobs", [{}, {"DYNAMIC": True}, {"PRODUCER_WARP": False, "Q_REGS": False},
                                   {"BALANCED": True}], ids=["persistent", "dynamic", "one-warpgroup", "balanced"])
def test_the_gluon_prefills_direct_launch_key_never_joins_calls_triton_specializes_apart(knob_dir, knobs):
    """DIRECT_LAUNCH keeps a compiled kernel under `_specialization` and launches it for any call with that key, so
    two calls with one key must be ones Triton's own binder (3.6, sm90, no GPU needed) specializes alike: else a
    kernel compiled for one query tile (an int of 1) or an aligned cu_seqlens would run another call. Lengths and
    cu_seqlens offsets cross Triton's classes; the positional launch must also follow the kernel's signature."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    mod = _load(GLUON_PREFILL, {**knobs, "DIRECT_LAUNCH": True}, knob_dir)
    kern = mod.kernel()
    binder = create_function_from_signature(kern.signature, kern.params, make_backend(GPUTarget("cuda", 90, 32)))
    seen = {}
    for lens in ([100], [90], [1], [128], [129], [2048], [2000, 48], [16 * 128], [40] * 16, [3000, 5, 700], [1] * 17):
        for offset in (0, 1, 4):
            total, hq, hkv, d = sum(lens), 32, 8, 128
            q, k, v = (torch.empty(total, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
            cu = torch.tensor([0] * offset + [0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)[offset:]
            grid, args, consts = mod.launch_args(q, k, v, cu, max(lens), 0.088, torch.empty_like(q), 132, 50 << 20)
            assert list(kern.arg_names) == [*kern.arg_names[:len(args)], *consts, "num_warps"]
            _, spec, _ = binder(*args, **consts, **mod.launch_options())
            key = mod._specialization(q.device, args, consts)
            assert seen.setdefault(key, spec) == spec, f"lengths {lens}, cu_seqlens offset {offset}: {key}"
    assert len(seen) >= 6, "the calls met few specializations: nothing tested the key"


@pytest.mark.parametrize("sequence_major", [False, True], ids=["heaviest-first", "sequence-major"])
def test_the_gluon_prefills_dealt_walk_gives_every_item_once_and_evens_the_programs_work(knob_dir, sequence_major):
    """BALANCED's walk (`deal`, made on the host from shapes): each program's items in the kernel's layout (the
    walk's length, then round by round each program's next item, num_items where it has none left) hold every work
    item exactly once, each program's heaviest first; and the busiest program's work (its items' K/V tiles, as the
    kernel walks them) is within 1% of the mean at 4 x 2k, 1 x 8k and 8 x 4k on 132 programs, where the plain stride's
    is 3%, 6% and 1.6% over it (and 3 x 3000, 4.8%)."""
    mod = _load(GLUON_PREFILL, {"BALANCED": True, "SEQUENCE_MAJOR": sequence_major}, knob_dir)
    rows = 2 * mod.BLOCK_M
    for batch, length, plain_over in ((4, 2048, 1.03), (1, 8192, 1.06), (8, 4096, 1.015), (3, 3000, 1.04)):
        tiles, programs, heads = -(-length // rows), 132, 32
        items = heads * batch * tiles
        walk = mod.deal(heads, batch, tiles, programs)
        assert walk[0] == len(walk) - 1 and walk[0] % programs == 0
        dealt = walk[1:]
        assert sorted(i for i in dealt if i != items) == list(range(items)), f"{batch} x {length}: items lost or twice"

        def cost(item):        # the item's K/V tiles, from where the kernel puts its rows (_ws_item)
            rest = item // heads
            tile = tiles - 1 - (rest % tiles if sequence_major else rest // batch)
            return -(-min(length, (tile + 1) * rows) // mod.BLOCK_N)
        work = [sum(cost(i) for i in dealt[p::programs] if i != items) for p in range(programs)]
        plain = [sum(cost(i) for i in range(p, items, programs)) for p in range(programs)]
        mean = sum(work) / programs
        for p in range(programs):
            mine = [cost(i) for i in dealt[p::programs] if i != items]
            assert mine == sorted(mine, reverse=True), f"program {p}: not heaviest first"
        assert max(work) / mean < 1.01 and max(plain) / mean >= plain_over, (batch, length, max(work) / mean)


def test_the_gluon_prefill_deals_shapes_of_up_to_32_items_a_program_and_walks_the_stride_past_them(knob_dir):
    """BALANCED's host deal grows with the items (2.6 ms at 8 x 4k's 8,192 on one core) and measured no faster than
    the stride there: a launch deals its walk, and hands the kernel WALK 2 with it, only up to 32 items a program
    (4 x 2k: 2,048 items, 16 a program); past that (8 x 4k: 63) it walks the plain stride (WALK 0), or ALTERNATE's
    where that knob is on, and no walk is made."""
    for alternate, past in ((False, 0), (True, 1)):
        mod = _load(GLUON_PREFILL, {"BALANCED": True, "ALTERNATE": alternate}, knob_dir)
        for batch, max_len, kind in ((4, 2048, 2), (8, 4096, past)):    # 2,048 and 8,192 items on 132 programs
            q, k, v = (torch.empty(batch, h, 64, dtype=torch.bfloat16) for h in (32, 8, 8))
            cu = torch.arange(batch + 1, dtype=torch.int32)
            mod._DEALT.clear()
            _, args, consts = mod.launch_args(q, k, v, cu, max_len, 0.125, torch.empty_like(q), 132, 50 << 20)
            assert consts["WALK"] == kind, (batch, max_len, alternate)
            assert (args[-1] is cu) == (kind != 2) and len(mod._DEALT) == (kind == 2)


def test_the_gluon_prefill_goes_sequence_major_with_the_plain_stride_only_where_the_batchs_kv_outgrows_l2(knob_dir):
    """L2_ORDER: a batch whose K and V are more bytes than the GPU's L2 cache (8 x 4k's 134 MB on a 50 MB L2) gets
    its items sequence-major and the plain stride; one whose K/V fit (4 x 2k's 34 MB) keeps heaviest-first over every
    sequence with ALTERNATE's walk, unless the L2 is smaller than it (16 MB); the knob off keeps the file's order
    everywhere; and BALANCED deals the order the launch chose."""
    def chosen(mod, batch, length, l2_bytes):
        total = batch * length
        q, k, v = (torch.empty(total, h, 128, dtype=torch.bfloat16) for h in (32, 8, 8))
        cu = torch.arange(0, total + 1, length, dtype=torch.int32)
        mod._DEALT.clear()
        _, args, consts = mod.launch_args(q, k, v, cu, length, 0.088, torch.empty_like(q), 132, l2_bytes)
        return consts["SEQUENCE_MAJOR"], consts["WALK"], args[-1]

    on, off = _load(GLUON_PREFILL, {}, knob_dir), _load(GLUON_PREFILL, {"L2_ORDER": False}, knob_dir)
    assert on.ALTERNATE and on.L2_ORDER and not on.SEQUENCE_MAJOR
    assert chosen(on, 8, 4096, 50 << 20)[:2] == (True, 0)
    assert chosen(on, 4, 2048, 50 << 20)[:2] == (False, 1)
    assert chosen(on, 4, 2048, 16 << 20)[:2] == (True, 0)
    assert chosen(off, 8, 4096, 50 << 20)[:2] == (False, 1)
    balanced = _load(GLUON_PREFILL, {"BALANCED": True}, knob_dir)
    for l2_bytes, major in ((50 << 20, False), (16 << 20, True)):
        _, kind, work = chosen(balanced, 4, 2048, l2_bytes)
        tiles = -(-2048 // (2 * balanced.BLOCK_M))
        assert kind == 2 and work.tolist() == balanced.deal(32, 4, tiles, 132, major), l2_bytes
