"""Compile once, in parallel (stages.parity.warm_threads): before parity's first check the candidate's kernels
are compiled for every shape class of its plan at once in its own worker, with nothing launched. On the CPU
the interpreter compiles nothing, so this proves what holds everywhere: the warm leaves the verdict as it
was, covers each shape class once, and its calls are watched like every call (library compute there is a
rejection). Its speed shows on a GPU only: tests/bench/parity_warm.py."""
from __future__ import annotations

import pytest

import candidates as C
from conftest import CUDA, RUNTIME_ONLY, config_with
from harness.stages.parity import _plan
from test_parity import _ctx

WARM = {"stages.parity.warm_threads": {"cuda": 8, "cpu": 2}, "stages.parity.checks_per_shape": 1}
# The reference decode, but with a library matmul on the served-limit batches (16 sequences and more), shapes the
# compile stage's one call never shows it: only a watched call on those shapes sees it.
LIBRARY_ON_LARGE_BATCHES = C.wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if q.shape[0] >= 16:
        torch.matmul(q[0], q[0].transpose(0, 1))
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")


def test_the_warm_compiles_each_shape_class_once_and_the_verdict_is_unchanged(evaluate_source):
    cfg = config_with(**WARM)
    verdict = evaluate_source(C.REF_DECODE, until="parity", config=cfg)
    assert verdict.ok, verdict.reason
    parity = verdict.stages[-1].metrics
    ctx = _ctx(cfg, ops=("decode",))
    assert parity["warm_classes"] == len({c.label for c, _ in _plan(ctx)}) and parity["warm_failed"] == 0


def test_library_compute_in_a_warm_call_is_a_rejection_naming_it(evaluate_source):
    verdict = evaluate_source(LIBRARY_ON_LARGE_BATCHES, until="parity", config=config_with(**WARM, **RUNTIME_ONLY))
    assert verdict.failed_stage == "parity", verdict.reason
    assert "compiling the" in verdict.reason and "shape classes" in verdict.reason and "aten::mm" in verdict.reason


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA): the interpreter compiles nothing")
def test_on_a_gpu_the_reference_kernels_compile_for_every_class_without_a_failure(evaluate_source):
    """Triton's real compiler, in a thread pool, with nothing launched: every class compiles, parity passes."""
    for source in (C.REF_DECODE, C.REF_PREFILL):
        verdict = evaluate_source(source, until="parity", config=config_with())
        assert verdict.ok, verdict.reason
        m = verdict.stages[-1].metrics
        assert m["warm_classes"] > 0 and m["warm_failed"] == 0, m
