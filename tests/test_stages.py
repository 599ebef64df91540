"""Each stage rejects what it should, at the right stage, and passes what it should (CPU: Triton's
interpreter, float32). Microbench needs CUDA: here it must say so, never stand in a CPU figure."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import candidates as C
from conftest import CPU_GATES, CUDA, RUNTIME_ONLY, config_with, runtime_only
from harness.candidate import load_candidate
from harness.evaluate import sched_s
from harness.stages import STAGE_NAMES
from harness.targets import TARGETS


def stage_of(verdict):
    return verdict.failed_stage


def test_reference_decode_kernel_passes_every_stage(evaluate_source):
    """On a CPU, microbench says it needs CUDA and the replay runs its gates alone, timing nothing; on a GPU, microbench times it faster than the
    served baseline (its replay is tests/test_served_gpu.py's, over a window of its own)."""
    v = evaluate_source(C.REF_DECODE, until="microbench" if CUDA else None, config=config_with(**CPU_GATES))
    assert v.ok and not v.accepted, v.reason     # only the full scored replay accepts
    assert [s.name for s in v.stages] == list(STAGE_NAMES[:4] if CUDA else STAGE_NAMES)
    assert [s.status for s in v.stages[:3]] == ["passed"] * 3 and v.stages[2].metrics["checks"] >= 8
    if CUDA:
        bench = v.stages[3]
        assert bench.status == "passed" and bench.metrics["speedup"] > bench.metrics["bar"] > 1, bench.reason
    else:
        assert v.stages[3].status == "skipped" and "needs CUDA" in v.stages[3].reason
        assert v.stages[4].status == "passed" and "nothing timed and nothing accepted" in v.stages[4].reason
        assert v.stages[4].metrics["gate_coverage"] == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA): microbench times kernels only there")
def test_a_kernel_faster_than_the_baseline_but_not_than_its_parent_is_rejected_at_microbench(evaluate_source):
    """The reference decode is several times the served baseline; a parent 50x the baseline is beyond it, so
    it stops at microbench, saying so, and never reaches the replay."""
    v = evaluate_source(C.REF_DECODE, beat=50.0)
    bench = v.stages[-1]
    assert v.failed_stage == "microbench" and bench.name == "microbench", v.reason
    assert "faster than the baseline but not than its parent" in bench.reason, bench.reason
    assert 1 < bench.metrics["speedup"] < 50 and bench.metrics["beat"] == 50.0


def test_reference_prefill_kernel_passes_every_stage(evaluate_source):
    v = evaluate_source(C.REF_PREFILL)
    assert v.ok, v.reason


@pytest.mark.skipif(CUDA, reason="checks the CPU-only behaviour of microbench")
def test_microbench_says_it_needs_cuda_instead_of_reporting_a_cpu_figure(evaluate_source):
    v = evaluate_source(C.REF_DECODE, until="microbench")
    bench = v.stages[-1]
    assert bench.name == "microbench" and bench.status == "skipped"
    assert "needs CUDA" in bench.reason and bench.metrics == {}


def test_a_stage_says_how_long_its_processes_waited_for_a_core(evaluate_source):
    """Twice as many busy loops as there are cores: parity's processes spend much of the stage waiting."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2 * len(os.sched_getaffinity(0)))]
    try:
        parity = evaluate_source(C.REF_DECODE, until="parity").stages[2]
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert parity.name == "parity" and parity.status == "passed", parity.reason
    assert parity.metrics["cpu_wait_s"] >= 0.3 * parity.seconds, (parity.metrics, parity.seconds)


def test_the_wait_counts_processes_below_this_one_found_by_their_host_pids():
    """A grandchild (as a worker is, below the pool and its zygote) pinned to one core beside another busy
    loop waits about half the time; sched_s finds it by walking down from this process."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, "
                               "'-c', 'while True: pass']); print(p.pid, flush=True); p.wait()"],
                              stdout=subprocess.PIPE, text=True)
    rival = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        grandchild = int(parent.stdout.readline())
        core = min(os.sched_getaffinity(0))
        for pid in (grandchild, rival.pid):
            os.sched_setaffinity(pid, {core})
        before = sched_s()
        time.sleep(1.5)
        after = sched_s()
    finally:
        for p in (parent, rival):
            p.kill()
            p.wait()
        os.kill(grandchild, 9)
    assert grandchild in before and grandchild in after
    assert after[grandchild][1] - before[grandchild][1] >= 0.4, (before[grandchild], after[grandchild])
    ran, waited = (after[grandchild][i] - before[grandchild][i] for i in (0, 1))
    assert ran >= 0.1 and ran + waited >= 1.2, (ran, waited)    # a busy loop is always either on a core or waiting for one


def test_the_cpu_of_a_child_that_ran_and_ended_within_the_stage_counts_in_its_parent():
    """As a compiler's ptxas does under the worker: one second of busy child, reaped, shows in the parent."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; sys.stdin.readline(); "
                               f"subprocess.run([sys.executable, '-c', {busy!r}]); print('done', flush=True); sys.stdin.readline()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)                                   # the parent's own start is not what is measured
        before = sched_s()
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "done"
        after = sched_s()
    finally:
        parent.kill()
        parent.wait()
    assert after[parent.pid][0] - before[parent.pid][0] >= 0.9, (before[parent.pid], after[parent.pid])


def test_correct_kernel_with_other_blocking_and_summation_order_passes(evaluate_source):
    v = evaluate_source(C.REBLOCKED, until="parity")
    assert v.ok, v.reason


def test_each_stage_records_its_wait_for_the_grant_apart_from_its_own_seconds(cfg, pool):
    """A slot's stage starts once `on_stage` returns (the executor grants its GPU's lease there): that wait is the
    stage's `lease_wait_s`, never part of its seconds or its timeout (agent/reading/pace.py reads both)."""
    from harness.evaluate import evaluate

    def granted_late(name: str) -> None:
        if name == "dispatch":
            time.sleep(1.5)
    t0 = time.monotonic()
    v = evaluate(C.REF_DECODE, "attention", cfg, pool, until="dispatch", on_stage=granted_late)
    wall = time.monotonic() - t0
    assert v.ok, v.reason
    compile_, dispatch = v.stages
    assert dispatch.metrics["lease_wait_s"] >= 1.5 and compile_.metrics["lease_wait_s"] < 1.0
    assert dispatch.seconds < wall - 1.5 - compile_.seconds
    assert "alone_s" not in dispatch.metrics          # a shared stage, on a CPU besides


def test_until_stops_after_the_named_stage(evaluate_source):
    v = evaluate_source(C.REF_DECODE, until="compile")
    assert [s.name for s in v.stages] == ["compile"] and v.ok


@pytest.mark.parametrize("source, stage, words, config", [
    (C.UNWRITTEN_OUTPUT, "parity", "first mismatches", None),
    (C.SDPA_WRAPPER, "compile", "torch.nn.functional: imports a module outside the allowlist", None),
    (C.SDPA_WRAPPER, "compile", "library compute instead of the candidate's kernel: aten::_scaled_dot_product", RUNTIME_ONLY),
    (C.TORCH_ELEMENTWISE, "compile", "torch ops outside the kernel", None),     # its very first call
    (C.DECOY_KERNEL, "compile", "numpy: imports a module outside the allowlist", None),
    (C.DECOY_KERNEL, "dispatch", "every Triton launch skipped", RUNTIME_ONLY),
    (C.POINTER_CACHE, "dispatch", "returned from a cache", None),
    (C.DROPS_NEWEST_TOKEN, "parity", "max abs error", None),
    (C.WRITES_INPUTS, "parity", "wrote to its inputs ['k_cache']", None),
    (C.NONDETERMINISTIC, "parity", "disagrees with call 1", None),
], ids=["unwritten-output", "sdpa-wrapper", "sdpa-wrapper-runtime", "torch-elementwise", "decoy-kernel",
        "decoy-kernel-runtime", "pointer-cache", "drops-newest-token", "writes-inputs", "nondeterministic"])
def test_bad_candidate_is_rejected_at_the_right_stage(evaluate_source, source, stage, words, config):
    v = evaluate_source(source, config=config_with(**config) if config else None)
    assert not v.ok
    assert stage_of(v) == stage, v.reason
    assert words in v.stages[-1].reason, v.stages[-1].reason


def test_parity_feedback_names_shape_errors_and_first_mismatches(evaluate_source):
    reason = evaluate_source(C.DROPS_NEWEST_TOKEN).stages[-1].reason
    assert "decode" in reason and "output shape [" in reason
    assert "relative L2 error" in reason and "first mismatches [" in reason and "tolerance" in reason


def test_crash_on_a_boundary_shape_is_a_verdict_naming_the_signal(evaluate_source):
    v = evaluate_source(C.CRASH_ON_BOUNDARY, config=runtime_only())
    assert stage_of(v) == "parity", v.reason
    assert "SIGSEGV" in v.stages[-1].reason and v.stages[-1].failure == "crashed"


def test_hang_is_cut_by_the_stage_timeout(evaluate_source):
    v = evaluate_source(C.HANG_ON_BOUNDARY, config=config_with(**{"stages.parity.timeout_s": 8}))   # its other shapes: ~3 s here
    assert stage_of(v) == "parity", v.reason
    assert v.stages[-1].failure == "timeout"
    assert v.stages[-1].seconds < 16


def test_evaluator_survives_and_reuses_the_pool_after_a_crash_and_a_hang(evaluate_source):
    evaluate_source(C.CRASH_ON_BOUNDARY, config=runtime_only())
    v = evaluate_source(C.REF_DECODE, until="dispatch")
    assert v.ok, v.reason


@pytest.mark.parametrize("source, words", [
    (C.RAISES_AT_IMPORT, "deliberate: tile shape 48 is not a power of two"),
    (C.TRITON_COMPILE_ERROR, "no_such_builtin"),
    (C.WRONG_SHAPE, "expected"),
    ("def decode(q, k_cache, v_cache, seq_lens, block_table, sm_scale):\n    return q\n",
     "must be decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)"),
    ("import numpy\ndef decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):\n    return q\n",
     "line 1: numpy: imports a module outside the allowlist"),
    ("def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)\n    return q\n", "syntax error at line 1"),
    ("import torch\n", "defines none of the contract's functions"),
    (C.FORGES_REPLIES, "line 3: os: imports a module outside the allowlist"),
], ids=["raises-at-import", "triton-compile-error", "wrong-shape", "wrong-signature", "forbidden-import",
        "syntax-error", "no-contract-function", "forged-replies"])
def test_compile_stage_rejects_with_feedback_for_the_coder(evaluate_source, source, words):
    v = evaluate_source(source)
    assert stage_of(v) == "compile", v.reason
    assert words in v.stages[-1].reason, v.stages[-1].reason


@pytest.mark.parametrize("args, error", [
    ("q, k_cache, v_cache, block_table, seq_lens, sm_scale", ""),
    ("q, k_cache, v_cache, seq_lens, block_table, sm_scale",
     "decode(q, k_cache, v_cache, seq_lens, block_table, sm_scale) must be decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)"),
], ids=["contract", "swapped"])
def test_the_one_candidate_loader_refuses_an_op_whose_arguments_are_not_the_contracts(tmp_path, monkeypatch, args, error):
    monkeypatch.setitem(sys.modules, "candidate", None)          # the loader registers the module; put back after
    path = tmp_path / "candidate.py"
    path.write_text(f"def decode({args}):\n    return q\n")
    loaded = load_candidate(path, TARGETS["attention"])
    assert (loaded.ops, loaded.error) == (("decode",), error)


def test_forged_replies_past_the_allowlist_are_a_protocol_failure_at_compile(evaluate_source):
    v = evaluate_source(C.FORGES_REPLIES, config=runtime_only())
    assert stage_of(v) == "compile" and "malformed reply" in v.stages[-1].reason, v.reason
