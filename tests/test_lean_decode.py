"""The lean decode family (knowledge/attention/decode_paged_lean.py), tested like code: the batch's K/V cut into
equal stretches of steps over a fixed grid, whatever the lengths. Each case is built so that the stretches cut
(sequence, kv head) segments in a known way: whole segments, a segment's first or last piece, a segment cut into
many pieces; each output is compared with the float64 reference (Triton's interpreter in float32 on a machine
without CUDA). Speed is measured on the H200 by tests/bench/vs_library.py, not here."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pathlib  # noqa: E402

import pytest  # noqa: E402

from test_reference_kernels_standalone import (  # noqa: E402
    TOL, _load, decode_reference, make_decode_inputs, run_decode,
)

LEAN = pathlib.Path(__file__).resolve().parents[1] / "knowledge" / "attention" / "decode_paged_lean.py"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# 16-token steps, every program used however little work it gets
FINE = {"BLOCK_N": 16, "MIN_STEPS_PER_PROGRAM": 1}
# where the pieces merge: by the last to finish, in the launch (the default), or in a second launch (MERGE_LAUNCH)
LAUNCHES = pytest.mark.parametrize("launch", [{}, {"MERGE_LAUNCH": True}], ids=["merge-in-launch", "merge-launch"])


@pytest.fixture(scope="module")
def knob_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lean_variants")


def _against_reference(mod, seq_lens, hq, hkv, *, d=16, page=8, seed=0, q_scale=3.0, extra_pages=2):
    q, kc, vc, bt, sl = make_decode_inputs(seq_lens, hq, hkv, d, page, extra_pages=extra_pages,
                                           q_scale=q_scale, seed=seed)
    out = mod.decode(q, kc, vc, bt, sl, d ** -0.5)
    err = (out.double().cpu() - decode_reference(q, kc, vc, bt, sl, d ** -0.5)).abs().max().item()
    assert torch.isfinite(out).all() and err < TOL, f"max abs error {err:.3e}"
    # every piece arrived at its ticket; all reset
    assert mod._TICKETS[q.device] and all(int(t.abs().sum()) == 0 for t in mod._TICKETS[q.device])
    return out, (q, kc, vc, bt, sl)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_lean_default_knobs_match_reference_at_page_edge_lengths(hq, hkv):
    run_decode(_load(LEAN), [1, 7, 8, 9, 45], hq, hkv, 16, 8, seed=hq * 10 + hkv)


@LAUNCHES
def test_lean_stretches_that_start_and_end_inside_segments_merge_correctly(knob_dir, launch):
    # One kv head, four sequences of 40 tokens: 3 steps each, 12 in all, over 3 programs of 4 steps:
    # program 0 = sequence 0 whole + sequence 1's first step (its last piece: partial slot 1);
    # program 1 = sequence 1's steps 1-2 (its first piece: slot 0) + sequence 2's steps 0-1 (slot 1);
    # program 2 = sequence 2's step 2 (slot 0) + sequence 3 whole.
    mod = _load(LEAN, {**FINE, "CPU_SM_COUNT": 1, "PROGRAMS_PER_SM": 3, **launch}, knob_dir)
    _against_reference(mod, [40, 40, 40, 40], 4, 1, seed=71)


@LAUNCHES
def test_lean_one_segment_cut_into_many_pieces_merges_in_chunks(knob_dir, launch):
    # 200 tokens, one kv head: 13 steps over 13 programs of one step each; the merge reads them 2 at a time
    mod = _load(LEAN, {**FINE, "CPU_SM_COUNT": 4, "PROGRAMS_PER_SM": 4, "MERGE_CHUNK": 2, **launch}, knob_dir)
    _against_reference(mod, [200], 4, 1, seed=73)


@LAUNCHES
@pytest.mark.parametrize("programs", [1, 2, 3, 5, 7, 16])
def test_lean_output_does_not_depend_on_the_grid_for_ragged_lengths(knob_dir, programs, launch):
    # length 1 twice, a page either side, one long sequence, in a table far wider than most of them
    mod = _load(LEAN, {**FINE, "CPU_SM_COUNT": 1, "PROGRAMS_PER_SM": programs, **launch}, knob_dir)
    out, _ = _against_reference(mod, [1, 9, 1, 70, 7, 16], 4, 2, seed=79, extra_pages=6)
    one = _load(LEAN, {**FINE, "CPU_SM_COUNT": 1, "PROGRAMS_PER_SM": 1}, knob_dir)
    again, _ = _against_reference(one, [1, 9, 1, 70, 7, 16], 4, 2, seed=79, extra_pages=6)
    assert (out.double() - again.double()).abs().max().item() < TOL


@LAUNCHES
def test_lean_is_right_and_repeats_exactly_when_the_minimum_steps_leave_most_programs_idle(knob_dir, launch):
    # 6 steps in all (2 + 1 per kv head), at least 2 a program: 3 of the 64 programs take work, the rest none
    mod = _load(LEAN, {"BLOCK_N": 16, "MIN_STEPS_PER_PROGRAM": 2, "CPU_SM_COUNT": 16, "PROGRAMS_PER_SM": 4, **launch},
                knob_dir)
    first, args = _against_reference(mod, [20, 11], 4, 2, seed=83)
    assert torch.equal(first, mod.decode(*args, 16 ** -0.5))   # clean tickets: the same output again


@LAUNCHES
def test_lean_gives_a_sequence_of_no_tokens_zeros_beside_whole_and_cut_ones(knob_dir, launch):
    mod = _load(LEAN, {**FINE, "CPU_SM_COUNT": 1, "PROGRAMS_PER_SM": 3, **launch}, knob_dir)
    out, _ = _against_reference(mod, [0, 5, 33, 0], 8, 2, seed=47)
    assert not out[0].any() and not out[3].any()


@LAUNCHES
def test_lean_ignores_nan_in_unused_slots_of_a_wide_table(knob_dir, launch):
    mod = _load(LEAN, {**FINE, "CPU_SM_COUNT": 2, "PROGRAMS_PER_SM": 3, **launch}, knob_dir)
    _, (q, kc, vc, bt, sl) = _against_reference(mod, [3, 9, 17], 4, 2, seed=41, extra_pages=5)
    assert torch.isnan(kc).any() and torch.isnan(vc).any()      # the unused slots it ignored hold NaN


@pytest.mark.parametrize(
    "knobs",
    [
        {"BLOCK_N": 32, "NUM_WARPS": 2, "NUM_STAGES": 1, "MERGE_CHUNK": 4},
        {"BLOCK_N": 16, "MIN_STEPS_PER_PROGRAM": 16, "PROGRAMS_PER_SM": 6},
        {"MAX_REGISTERS": 128, "PROGRAMS_PER_SM": 2},
        {"MERGE_LAUNCH": True, "BLOCK_N": 32, "MERGE_CHUNK": 2, "PROGRAMS_PER_SM": 4},
    ],
    ids=["bn32_2warps_1stage", "coarse_programs", "register_cap", "merge_launch"],
)
def test_lean_knob_variants_stay_correct_for_peaky_queries_and_head_dim_32_page_4(knob_dir, knobs):
    run_decode(_load(LEAN, knobs, knob_dir), [5, 4, 13, 1, 40, 64], 8, 2, 32, 4, q_scale=20.0, seed=89)
