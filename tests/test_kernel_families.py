"""Issue 16's kernel families (knowledge/attention/decode_paged_gqa.py, prefill_causal_tma.py), tested
like code: each file imported by path with knob lines rewritten, run at tiny shapes (Triton's
interpreter in float32 on a machine without CUDA) and compared with the float64 references of
tests/test_reference_kernels_standalone.py, at the lengths that break kernels: 1, a page or tile
either side, mixed lengths in one batch, NaN in every unused cache slot, shuffled and over-wide block
tables, peaky queries. Speed is measured on the H200 by tests/bench/vs_library.py, not here. The Gluon prefill,
which the interpreter cannot run, is tested in tests/test_gluon_prefill.py."""
import gc
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pathlib  # noqa: E402
import weakref  # noqa: E402

import pytest  # noqa: E402

from test_reference_kernels_standalone import (  # noqa: E402
    TOL, _load, decode_reference, make_decode_inputs, run_decode, run_prefill,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECODE = ROOT / "knowledge" / "attention" / "decode_paged_gqa.py"
PREFILL = ROOT / "knowledge" / "attention" / "prefill_causal_tma.py"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# many small splits on device: 16-token steps and splits, a grid of up to 64 splits per sequence
MANY_SPLITS = {"BLOCK_N": 16, "MIN_TOKENS_PER_SPLIT": 16, "SPLIT_POLICY": 0, "PROGRAMS_PER_SM": 64}


@pytest.fixture(scope="module")
def knob_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("family_variants")



SM90_COMPILE = ROOT / "tests" / "bench" / "sm90_compile.py"
LEAN = ROOT / "knowledge" / "attention" / "decode_paged_lean.py"


@pytest.mark.parametrize("spec, batch, per_sm", [
    (f"{LEAN}", 64, 3),                                   # uncapped: 185 registers, 2 per SM (H200, 2026-12-04)
    (f"{LEAN}:MERGE_LAUNCH=True,PROGRAMS_PER_SM=4", 8, 4),  # uncapped: 145 registers, 3 per SM
    (f"{DECODE}:PAGE_LOADS=True,RESIDENCY_CAP=True", 64, 4),  # uncapped: 236 registers, 2 per SM (sm90 compile)
    (f"{DECODE}:PERSISTENT=4,NUM_WARPS=8,RESIDENCY_CAP=True", 32, 4),
    (f"{DECODE}:PREFETCH=True,PROGRAMS_PER_SM=2", 32, 2),     # 200 registers (sm90 compile, 2026-12-05)
], ids=["lean-defaults-batch-64", "lean-merge-launch-4-per-sm-batch-8", "gqa-page-loads", "gqa-persistent-8-warps",
        "gqa-prefetch-2-per-sm"])
def test_decode_kernel_compiled_for_sm90_keeps_the_programs_its_grid_counts_on_resident(spec, batch, per_sm):
    """The lean grid is SMs x PROGRAMS_PER_SM programs, one wave of equal stretches; the GQA family's policy 1
    and PERSISTENT plans count on as many per SM. Compiled for sm90 (Triton's own ptxas, no GPU needed) as a
    launch at `batch` sequences specialises it, the kernel's registers must let that many programs reside on an
    SM, or the ones that do not fit run their work after the others."""
    line = sm90_figures(spec, batch)
    assert int(line.split("at most ")[1].split()[0]) >= per_sm, line


def test_the_tma_prefill_compiles_for_sm90_two_programs_an_sm_and_its_warp_specialize_knob_is_a_compile_kill():
    """The TMA prefill family's defaults, compiled for sm90 at the bench shape: two programs fit an SM (the
    catalog's figures were measured so), and WARP_SPECIALIZE at the file's 4 warps fails in the compiler, as the
    catalog's `kill: compile` for it says."""
    line = sm90_figures(str(PREFILL))
    assert int(line.split("at most ")[1].split()[0]) == 2 and "wgmma" in line, line
    from agent.knowledge import load_catalog
    ws = next(e for e in load_catalog().entries if e.id == "prefill-causal-tma").family.knobs["WARP_SPECIALIZE"]
    assert ws.kill == "compile"
    with pytest.raises(AssertionError, match="TaskIdPropagation|PassManager"):
        sm90_figures(f"{PREFILL}:WARP_SPECIALIZE=True")


def test_sm90_compiles_same_code_check_tells_swapped_operands_apart_and_ignores_source_locations():
    """`sm90_compile.py --same-code-as` says whether a figure's PTX survived a change. A comparison inverted compiles
    to the same setp with its selp's operands exchanged (seen on the Gluon decode's split choice), so the check
    must keep register numbers; moved source lines and comments alone leave the code the same."""
    import subprocess
    import sys
    timed = "\t.loc\t1 269 42\n\tsetp.lt.s32 \t%p149, %r5, %r6;\n\tselp.b32 \t%r308, %r77, %r78, %p149; // x\n"
    swapped = timed.replace("%r77, %r78", "%r78, %r77")
    moved = timed.replace("269 42", "270 42").replace("// x", "// another comment")
    probe = ("import json, sys; sys.path.insert(0, sys.argv[1]); import sm90_compile as m; a, b, c = json.load("
             "sys.stdin); print(m.code_lines(a) == m.code_lines(b), m.code_lines(a) == m.code_lines(c))")
    done = subprocess.run([sys.executable, "-c", probe, str(SM90_COMPILE.parent)], capture_output=True, text=True,
                          input=json.dumps([timed, swapped, moved]), timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]


def sm90_figures(spec: str, batch: int = 32) -> str:
    """tests/bench/sm90_compile.py's line for `spec`: registers, stack, shared memory, programs per SM."""
    return sm90_lines([spec], batch)[0]


def sm90_lines(specs: list[str], batch: int = 32, options: tuple[str, ...] = ()) -> list[str]:
    """tests/bench/sm90_compile.py's lines for `specs` (with its `options`), compiled in one call of it, in the
    suite's one child process for it (tests/sm90_child.py: one import of torch and triton for every call)."""
    import sm90_child
    out = sm90_child.run(["--batch", str(batch), *options, *specs])
    lines = out.strip().splitlines()[-len(specs):]
    assert len(lines) == len(specs), out
    return lines


def softmax_steps(line: str) -> list[tuple[int, int]]:
    """sm90_compile.py's softmax steps in its line (innermost SASS loops holding ex2), in code order:
    (instructions, ex2)."""
    return [(int(step.split()[0]), int(step.split("(")[1].split()[0]))
            for step in line.split("softmax steps ")[1].split(" instructions")[0].split(", ")]


@pytest.mark.parametrize("path", [DECODE, LEAN, ROOT / "knowledge" / "attention" / "decode_paged_splitkv.py"],
                         ids=["gqa", "lean", "reference"])
def test_the_catalog_offers_the_depth_at_which_a_decode_familys_kv_tiles_first_get_a_second_buffer(path):
    """The catalog says why each NUM_STAGES is offered: the page index loads a stage ahead of the K/V tiles it
    addresses, so the tiles get a second buffer a depth later than the depth suggests (5 in Triton 3.6). The
    catalog must offer that depth, not only the ones below it, which all keep one buffer (compiled for sm90 by
    Triton's own ptxas: shared memory per program against two K and two V tiles)."""
    import yaml
    catalog = yaml.safe_load((ROOT / "knowledge" / "catalog.yaml").read_text())
    rel = str(path.relative_to(ROOT / "knowledge"))
    knobs = next(e["family"]["knobs"] for e in catalog["entries"] if rel in e.get("files", []) and "family" in e)
    depths = knobs["NUM_STAGES"]["values"]
    block_n = int(next(line.split("=")[1].split("#")[0] for line in path.read_text().splitlines()
                       if line.startswith("BLOCK_N =")))
    double = 2 * 2 * block_n * 128 * 2 / 1024                  # two K and two V tiles, bf16, head_dim 128, KB
    compiled = sorted(set(depths) | {d - 1 for d in depths if d > 1})
    lines = sm90_lines([f"{path}:NUM_STAGES={d}" for d in compiled])
    shared = {d: float(line.split(" KB shared")[0].split()[-1]) for d, line in zip(compiled, lines)}
    first = next((d for d in depths if shared[d] >= double), None)      # the shallowest offered with two
    assert first is not None and first > depths[0], (shared, double)
    assert shared[first - 1] < double, (shared, double)          # offered where the second buffer first appears


# ------------------------------------------------------------------ decode

@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_decode_default_knobs_match_reference_at_page_edge_lengths(hq, hkv):
    page = 8
    run_decode(_load(DECODE), [1, page - 1, page, page + 1, 45], hq, hkv, 16, page, seed=hq * 10 + hkv)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_combine", "combine_kernel"])
def test_decode_splits_sized_on_device_merge_correctly_for_mixed_lengths(knob_dir, fused):
    # A block table far wider than most lengths: the grid has splits that only the long sequence
    # fills; the short ones retire them on the device, and length 1 gets a single split.
    mod = _load(DECODE, {**MANY_SPLITS, "FUSED_COMBINE": fused}, knob_dir)
    run_decode(mod, [1, 7, 8, 9, 100], 4, 2, 16, 8, extra_pages=4, q_scale=3.0, seed=31)


def test_decode_fused_combine_leaves_every_ticket_at_zero(knob_dir):
    mod = _load(DECODE, {**MANY_SPLITS, "FUSED_COMBINE": True}, knob_dir)
    q, kc, vc, bt, sl = make_decode_inputs([3, 50, 17], 4, 1, 16, 8, extra_pages=3, seed=37)
    first = mod.decode(q, kc, vc, bt, sl, 0.25)
    assert mod._TICKETS[q.device] and all(int(t.abs().sum()) == 0 for t in mod._TICKETS[q.device])
    again = mod.decode(q, kc, vc, bt, sl, 0.25)                  # the next call sees clean tickets
    assert torch.equal(first, again)


@pytest.mark.parametrize("family", ["decode_paged_gqa.py", "decode_paged_lean.py", "decode_gluon_sm90.py"])
def test_a_grown_ticket_buffer_keeps_the_smaller_one_alive_for_a_graph_captured_on_it(knob_dir, family):
    """A CUDA graph captured on a call launches on that call's ticket address: a larger batch later must not free the
    buffer it holds (a replay would then count in freed memory). The smaller buffer lives on; the call gets the
    larger, big enough."""
    mod = _load(ROOT / "knowledge" / "attention" / family, None, knob_dir)
    small = mod._tickets(torch.device("cpu"), 8)
    seen = weakref.ref(small)
    del small
    big = mod._tickets(torch.device("cpu"), 5000)
    gc.collect()
    assert seen() is not None and big.numel() >= 5000 and mod._tickets(torch.device("cpu"), 10) is big


@pytest.mark.parametrize("knobs", [{}, {"PREFETCH": True, "MIN_TOKENS_PER_SPLIT": 32}], ids=["pipelined", "prefetch"])
def test_decode_ignores_nan_in_unused_slots_of_a_wide_table(knob_dir, knobs):
    mod = _load(DECODE, {**MANY_SPLITS, **knobs}, knob_dir)
    q, kc, vc, bt, sl = make_decode_inputs([3, 9, 17], 4, 2, 16, 8, extra_pages=5, seed=41)
    assert torch.isnan(kc).any() and torch.isnan(vc).any()
    assert torch.isfinite(mod.decode(q, kc, vc, bt, sl, 0.25)).all()
    run_decode(mod, [3, 9, 17], 4, 2, 16, 8, extra_pages=5, seed=41)


@pytest.mark.parametrize(
    "knobs",
    [
        {"PAGE_LOADS": True, "BLOCK_N": 16, "MIN_TOKENS_PER_SPLIT": 16, "PROGRAMS_PER_SM": 16},
        {"PAGE_LOADS": True, "BLOCK_N": 32},                        # page 8 divides 32: 4 pages a step
        {"BLOCK_N": 32, "NUM_WARPS": 2, "NUM_STAGES": 1, "MIN_TOKENS_PER_SPLIT": 32, "WAVES": 3},
        {"MAX_SPLITS": 1},
        {"KV_TMA": True, "NUM_STAGES": 8},                         # page 8 divides 64: a page a step
        {"KV_TMA": True, "BLOCK_N": 16, "MIN_TOKENS_PER_SPLIT": 16, "PROGRAMS_PER_SM": 16},
        {"PREFETCH": True, "BLOCK_N": 16, "MAX_SPLITS": 1},       # the next tile in registers: up to 4 a sequence
        {"PREFETCH": True, "PAGE_LOADS": True, "BLOCK_N": 16, "MIN_TOKENS_PER_SPLIT": 32, "PROGRAMS_PER_SM": 16},
    ],
    ids=["page_loads_bn16", "page_loads_bn32", "bn32_waves3", "single_split", "kv_tma", "kv_tma_many_splits",
         "prefetch_one_split", "prefetch_page_loads_two_tiles_a_split"],
)
def test_decode_knob_variants_stay_correct(knob_dir, knobs):
    run_decode(_load(DECODE, knobs, knob_dir), [1, 7, 8, 64, 33], 4, 2, 16, 8, q_scale=3.0, seed=43)


def test_decode_takes_whole_pages_through_tensor_descriptors_where_the_cache_allows_and_masks_the_last(knob_dir):
    """KV_TMA: the launch is specialised for descriptors (the compiled-launch record says so) on a cache whose rows
    TMA can address, pointer loads on one whose heads are a strided view; the unused rows of a sequence's last page
    hold NaN here (make_decode_inputs), which must not reach the output."""
    mod = _load(DECODE, {"KV_TMA": True, "MAX_SPLITS": 1}, knob_dir)
    q, kc, vc, bt, sl = make_decode_inputs([3, 9, 17], 4, 2, 16, 8, extra_pages=2, seed=53)
    assert torch.isnan(kc).any() and torch.isnan(vc).any()
    run_decode(mod, [3, 9, 17], 4, 2, 16, 8, extra_pages=2, seed=53)
    assert [dict(key[0])["KV_TMA"] for key in mod._DEPTHS] == [True]
    def spread(c):                                              # the same values, each head 2 x head_dim apart
        return torch.stack([c, c], dim=3).flatten(2, 3)[:, :, ::2]
    assert mod._page_rows_ok(kc) and not mod._page_rows_ok(spread(kc))
    out = mod.decode(q, spread(kc), spread(vc), bt, sl, 0.25)
    assert (out.double() - decode_reference(q, kc, vc, bt, sl, 0.25)).abs().max().item() < TOL
    assert sorted(dict(key[0])["KV_TMA"] for key in mod._DEPTHS) == [False, True]


def test_decode_is_stable_for_peaky_queries_and_head_dim_32_page_4(knob_dir):
    run_decode(_load(DECODE, MANY_SPLITS, knob_dir), [5, 4, 13, 1, 40], 4, 2, 32, 4, q_scale=20.0, seed=47)


def test_decode_grid_splits_come_from_shapes_and_fill_the_last_wave(knob_dir):
    cpu = torch.device("cpu")
    mod = _load(DECODE, {"SPLIT_POLICY": 1, "PROGRAMS_PER_SM": 4, "CPU_SM_COUNT": 132}, knob_dir)
    # H200-like: 132 SMs x 4 = 528 slots; 16 x 8 kv heads = 128 programs a split -> 4 splits (512)
    assert mod.grid_splits(16, 8, 32768, cpu) == 4
    assert mod.grid_splits(64, 8, 32768, cpu) == 1             # 512 programs already fill a wave
    assert mod.grid_splits(8, 8, 32768, cpu) == 8
    assert mod.grid_splits(8, 8, 256, cpu) == 1                # a table of one split's tokens
    policy0 = _load(DECODE, {"SPLIT_POLICY": 0, "PROGRAMS_PER_SM": 4, "CPU_SM_COUNT": 132}, knob_dir)
    assert policy0.grid_splits(16, 8, 32768, cpu) == 5         # cdiv(528, 128)


# a persistent grid on a pretend 1-SM device: 2 programs loop over every (split, kv head, sequence) item
PERSISTENT_KNOBS = {**MANY_SPLITS, "CPU_SM_COUNT": 1, "PERSISTENT": 2}
# ragged lengths in a table far wider than most of them: length 1 twice, a page either side, one long
RAGGED = [1, 9, 1, 70, 7, 16]


def _persistent_against_per_item(knob_dir, knobs, seq_lens, hq, hkv, seed):
    """The persistent grid's output, checked against float64 and equal to one program per item's; the
    launch has fewer programs than items, so each program loops over several."""
    persistent = _load(DECODE, {**PERSISTENT_KNOBS, **knobs}, knob_dir)
    per_item = _load(DECODE, {**PERSISTENT_KNOBS, **knobs, "PERSISTENT": 0}, knob_dir)
    q, kc, vc, bt, sl = make_decode_inputs(seq_lens, hq, hkv, 16, 8, extra_pages=6, q_scale=3.0, seed=seed)
    splits = persistent.grid_splits(len(seq_lens), hkv, bt.shape[1] * 8, q.device)
    items, programs = persistent.launch_plan(len(seq_lens), hkv, splits, q.device)
    assert programs == 2 and items >= 3 * programs
    assert per_item.launch_plan(len(seq_lens), hkv, splits, q.device) == (items, items)
    out = persistent.decode(q, kc, vc, bt, sl, 0.25)
    assert (out.double() - decode_reference(q, kc, vc, bt, sl, 0.25)).abs().max().item() < TOL
    assert torch.equal(out, per_item.decode(q, kc, vc, bt, sl, 0.25))
    return persistent, q


@pytest.mark.parametrize("hq,hkv,fused", [(4, 4, True), (4, 2, False), (4, 1, True), (4, 1, False)],
                         ids=["gqa1_fused", "gqa2_combine_kernel", "gqa4_fused", "gqa4_combine_kernel"])
def test_decode_persistent_grid_loops_over_every_item_of_ragged_lengths(knob_dir, hq, hkv, fused):
    mod, q = _persistent_against_per_item(knob_dir, {"FUSED_COMBINE": fused}, RAGGED, hq, hkv, seed=61 + hkv)
    if fused:
        # every item's split arrived at its ticket
        assert mod._TICKETS[q.device] and all(int(t.abs().sum()) == 0 for t in mod._TICKETS[q.device])


def test_decode_persistent_grid_with_one_split_writes_every_output(knob_dir):
    _persistent_against_per_item(knob_dir, {"MAX_SPLITS": 1}, RAGGED, 4, 2, seed=67)


def test_decode_launch_plan_caps_the_persistent_grid_at_sms_times_its_knob(knob_dir):
    cpu = torch.device("cpu")
    h200 = _load(DECODE, {"CPU_SM_COUNT": 132, "PERSISTENT": 4}, knob_dir)
    assert h200.launch_plan(128, 8, 1, cpu) == (1024, 528)     # 128 x 1k: two items for most programs
    assert h200.launch_plan(32, 8, 2, cpu) == (512, 512)       # fewer items than slots: one each
    assert _load(DECODE, {"CPU_SM_COUNT": 132}, knob_dir).launch_plan(128, 8, 1, cpu) == (1024, 1024)


# ------------------------------------------------------------------ prefill

@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_prefill_matches_reference_for_mixed_lengths_and_gqa(knob_dir, tma, hq, hkv):
    mod = _load(PREFILL, {"BLOCK_M": 16, "BLOCK_N": 16, "USE_TMA": tma, "TMA_MIN_TOKENS": 0}, knob_dir)
    run_prefill(mod, [1, 17, 5, 40, 16], hq, hkv, 16, seed=hq * 10 + hkv)


def test_prefill_uses_tensor_descriptors_where_it_can():
    mod = _load(PREFILL)
    t = torch.randn(64, 4, 16)
    assert mod.TensorDescriptor is not None and mod._tma_ok(t, t[:, :2].contiguous())
    assert not mod._tma_ok(t[:, :2])                            # a strided view: pointer loads


def test_prefill_default_knobs_handle_length_one_and_long_sequences():
    run_prefill(_load(PREFILL), [70, 1, 3, 65], 4, 2, 16, seed=51)


@pytest.mark.parametrize(
    "knobs",
    [
        {"BLOCK_M": 16, "BLOCK_N": 16, "LAZY_RESCALE": True, "TMA_MIN_TOKENS": 0},
        {"BLOCK_M": 32, "BLOCK_N": 16, "LAZY_RESCALE": True, "USE_TMA": False},
        {"BLOCK_M": 32, "BLOCK_N": 16, "HEAVY_FIRST": False, "TMA_MIN_TOKENS": 0},
        {"BLOCK_M": 16, "BLOCK_N": 32, "TMA_MIN_TOKENS": 0},
    ],
    ids=["lazy_tma", "lazy_pointers", "tile_order_reference", "bn_wider_than_bm"],
)
def test_prefill_knob_variants_stay_correct_for_peaky_queries(knob_dir, knobs):
    run_prefill(_load(PREFILL, knobs, knob_dir), [33, 2, 64, 1], 4, 2, 32, q_scale=20.0, seed=53)
