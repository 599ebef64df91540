"""One loader of candidate code (harness/candidate.py) for the worker and the served process: an op whose
parameters are not the contract's is refused in both, naming it; the reference kernels load."""
from __future__ import annotations

import pytest

import candidates as C
from harness.candidate import load_candidate
from harness.served.ops import load_candidate as served_load
from harness.targets.attention import TARGET

MISNAMED = C.REF_DECODE.replace("\ndef decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):",
                                "\ndef decode(q, k_cache, v_cache, block_table, lengths, sm_scale):")


def test_the_reference_kernels_load_with_their_ops(tmp_path):
    for source, op in ((C.REF_DECODE, "decode"), (C.REF_PREFILL, "prefill")):
        path = tmp_path / f"{op}.py"
        path.write_text(source)
        loaded = load_candidate(path, TARGET)
        assert loaded.ops == (op,) and loaded.error == "" and callable(getattr(loaded.module, op))
        assert callable(served_load(path).__dict__[op])


def test_an_op_with_other_parameters_is_refused_by_the_worker_and_by_the_served_process(tmp_path):
    assert MISNAMED != C.REF_DECODE
    path = tmp_path / "candidate.py"
    path.write_text(MISNAMED)
    assert load_candidate(path, TARGET).error == ("decode(q, k_cache, v_cache, block_table, lengths, sm_scale) must be "
                                                    "decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)")
    with pytest.raises(TypeError, match=r"the candidate decode\(q, k_cache, v_cache, block_table, lengths, sm_scale\) must be"):
        served_load(path)


def test_a_file_defining_no_op_says_which_it_could_define(tmp_path):
    path = tmp_path / "candidate.py"
    path.write_text("X = 1\n")
    assert load_candidate(path, TARGET).error == "defines none of: " + ", ".join(TARGET.ops)
