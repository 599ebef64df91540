"""The evaluator on a real GPU: real compiles, kernel names read by the profiler, the microbench and
its cheats. Skipped without CUDA (run on the H200; results in docs/BENCHMARKS.md)."""
from __future__ import annotations

import re

import pytest
import torch

import candidates as C
from harness.gpu_memory import release, reserve
from harness.stages.microbench import case_figures
from conftest import CUDA, runtime_only

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")]


def test_reference_decode_kernel_passes_through_microbench_with_real_figures(evaluate_source):
    v = evaluate_source(C.REF_DECODE, until="microbench")  # the replay has its own GPU tests (test_served_gpu)
    assert v.ok, v.reason
    bench = v.stages[-1]
    assert bench.name == "microbench" and bench.status == "passed"
    assert bench.metrics["speedup"] > bench.metrics["bar"]
    # the cuDNN anchor of every served case, timed in the evaluator's process (anchor_s) or reused from an earlier
    # draw of the same shapes in the process, at a bandwidth the device can have
    cases = case_figures(bench.metrics, "decode")
    assert cases, bench.metrics
    for key, fig in cases:
        assert 0 < fig["anchor_rate"] < 4.8 and (fig["anchor_reused"] == 1.0 or fig["anchor_s"] > 0), (key, fig)
        # what its kernels hold, as the worker's driver loaded them (shown to the planner, never judged by)
        assert 16 <= fig["kernel_registers"] <= 255 and 1 <= fig["kernel_programs_per_sm"] <= 32, (key, fig)
    # the part that held the GPU alone (from its timing's grant: not the draws and warm before it) is a run's pace
    assert 0 < bench.metrics["alone_s"] < bench.seconds and bench.metrics["lease_wait_s"] >= 0, bench.metrics
    assert not any("alone_s" in s.metrics for s in v.stages[:-1])          # the shared stages hold it with others
    print(bench.reason)


def test_microbench_compiles_the_candidate_for_its_timed_inputs_before_it_holds_the_gpu_alone(evaluate_source):
    """No Triton compile inside a timed request: a kernel compiled anew for every input drawn (parity's draws are
    other draws) finds its variants for the very input sets timed compiled in the stage's shared part (the warm,
    then the round of first calls), so the GPU is not held alone while a compiler runs."""
    bench = evaluate_source(C.SPECIALIZES_PER_DRAW, until="microbench").stages[-1]
    assert bench.name == "microbench", bench.reason
    compiles = {key: fig["worker_compiles"] for key, fig in case_figures(bench.metrics, "decode")}
    assert len(compiles) == 3 and not any(compiles.values()), compiles
    # and it did compile for them, before: the warm (or the first calls) met variants parity had not
    assert bench.metrics["worker_timed_warm_compiles"] + bench.metrics["worker_first_calls_compiles"] > 0, bench.metrics


def test_a_kernel_faster_than_torch_but_not_than_its_parent_stops_at_microbench(evaluate_source):
    """The parent's speedup is the bar: the reference decode against a parent as fast as itself (its own
    measured speedup) is not replayed, and the reason says it beat the baseline, not the parent."""
    first = evaluate_source(C.REF_DECODE, until="microbench").stages[-1]
    assert first.status == "passed", first.reason
    v = evaluate_source(C.REF_DECODE, until="microbench", beat=first.metrics["speedup"])
    bench = v.stages[-1]
    assert bench.status == "failed" and v.failed_stage == "microbench"
    assert bench.metrics["beat"] == first.metrics["speedup"] and bench.metrics["bar"] > bench.metrics["beat"]
    assert bench.reason.startswith("faster than the baseline but not than its parent beyond noise"), bench.reason
    print(bench.reason)


def test_two_candidates_are_timed_on_the_same_work_and_the_second_reuses_every_cudnn_anchor(evaluate_source):
    """Microbench pins each served set's lengths (stages.microbench.lengths_seed): two candidates' cases are the same
    work (their bytes and FLOPs), so a candidate's speedup and its parent's bar compare like with like; and the
    cuDNN anchor timed for the first is reused by the second, whose sets have the same shapes (harness/stages/anchor.py;
    before 2026-12-07 the second drew other lengths and was handed the first's rate)."""
    figures = []
    for _ in range(2):
        v = evaluate_source(C.REF_DECODE, until="microbench")
        assert v.ok, v.reason
        figures.append(dict(case_figures(v.stages[-1].metrics, "decode")))
    first, second = figures
    assert first.keys() == second.keys() and len(first) == 3, figures
    for key, fig in second.items():
        assert (fig["bytes"], fig["flops"]) == (first[key]["bytes"], first[key]["flops"]), key
        assert fig["anchor_reused"] == 1.0 and fig["anchor_ms"] == first[key]["anchor_ms"], (key, fig)


def test_reference_prefill_kernel_is_timed_honestly_against_a_baseline_without_host_stalls(evaluate_source):
    """Whether the reference prefill beats per-sequence SDPA is a measurement (on the H200 it does not
    at 8k tokens); what must hold is that it is timed, never refused by a timer check, and that the
    baseline's time is device time: with the sequence bounds given on the host, the worker's events
    and the evaluator's clock agree on it, on the input set the clock replays (the sets' lengths differ: on the
    H200 the median over both sets read 0.208 ms at batch 4, the first set's clock 0.138 ms)."""
    v = evaluate_source(C.REF_PREFILL, until="microbench")
    bench = v.stages[-1]
    print(bench.reason)
    assert bench.name == "microbench", v.reason
    assert "not to be believed" not in bench.reason and "tampered" not in bench.reason, bench.reason
    assert bench.status == "passed" or bench.reason.startswith("not faster than the baseline"), bench.reason
    cases = case_figures(bench.metrics, "prefill")
    assert len(cases) == 3, [key for key, _ in cases]
    for key, fig in cases:
        events, clock = fig["baseline_clocked_set_events_ms"], fig["baseline_clock_ms"]
        assert 0.75 < clock / events < 1.33, (key, events, clock)


def test_a_kernel_the_power_cap_slows_in_bursts_is_counted_at_its_slower_figure_and_not_called_a_liar(evaluate_source):
    """The TMA prefill drew the H200 to its 700 W cap in the clock check's 60 ms back-to-back bursts and its SM
    clock fell (1545-1830 MHz against 1950 for the tiled kernel, fifteenth session): 0.51 ms a call by the events,
    0.79-0.91 ms by the clock at 1 x 8192, and it was rejected as a liar. The bursts are now short rounds after a
    rest; it must be timed, and counted at the slower of its two speedups on each served case."""
    v = evaluate_source(C.TMA_PREFILL, until="microbench")
    bench = v.stages[-1]
    print(bench.reason)
    assert bench.name == "microbench" and "not to be believed" not in bench.reason, bench.reason
    for key, fig in case_figures(bench.metrics, "prefill"):
        counted = min(fig["speedup_by_events"], fig["speedup_by_clock"])
        assert fig["speedup"] == pytest.approx(counted, rel=1e-9), (key, fig)
        assert fig["candidate_ms"] >= fig["candidate_events_ms"], (key, fig)


@pytest.mark.parametrize("source, words", [
    (C.SIDE_STREAM, "escapes the timed stream"),
    (C.PATCHED_TIMER, "not to be believed|under the physical floor"),
    # the clock would agree with the flattered events if the graph it replays were not checked
    (C.SKIPS_WORK_IN_GRAPHS, "the calls clocked are not the calls timed"),
], ids=["side-stream", "patched-timer", "skips-work-in-graphs"])
def test_measurement_cheat_is_rejected_at_microbench(evaluate_source, source, words):
    """Past the allowlist (which refuses each by name: test_measurement_cheat_is_refused_by_the_allowlist)."""
    v = evaluate_source(source, until="microbench", config=runtime_only())
    assert v.failed_stage == "microbench", v.reason
    assert re.search(words, v.stages[-1].reason), v.stages[-1].reason


def test_a_baseline_slowed_in_the_worker_counts_at_the_evaluators_own_timing_of_it(evaluate_source):
    """SLOWS_THE_BASELINE past the allowlist: a 2 ms host sleep after each SDPA call of the worker's process, so the
    worker's events read the torch baseline far slower (H200 2026-12-01: 25.65x by the events, 4.35x by the clock).
    Every served case's baseline counts at the evaluator's own timing of it, on every input set: the cheat gains
    nothing. (Until 2026-12-07 the case was rejected as tampering, which honest kernels met too: docs/EVALUATOR.md.)"""
    v = evaluate_source(C.SLOWS_THE_BASELINE, until="microbench", config=runtime_only())
    bench, sets = v.stages[-1], runtime_only().stages.microbench.input_sets
    assert bench.name == "microbench" and "not to be believed" not in bench.reason, bench.reason
    for key, fig in case_figures(bench.metrics, "decode"):
        assert fig["baseline_sets_counted_here"] == sets, (key, fig)
        assert fig["baseline_ms"] <= 1.25 * fig["baseline_in_evaluator_ms"], (key, fig)
    assert "counted at the evaluator's" in bench.reason, bench.reason


def test_dispatch_reads_launched_kernel_names_on_cuda(evaluate_source):
    v = evaluate_source(C.REF_DECODE, until="dispatch")
    assert v.ok and v.stages[-1].metrics["decode_own_device_share"] >= 0.6, v.reason


@pytest.mark.parametrize("source", [C.SIDE_STREAM, C.PATCHED_TIMER, C.SLOWS_THE_BASELINE],
                         ids=["side-stream", "patched-timer", "slows-the-baseline"])
def test_measurement_cheat_is_refused_by_the_allowlist(evaluate_source, source):
    v = evaluate_source(source, until="microbench")
    assert v.failed_stage == "compile" and v.stages[-1].failure == "allowlist", v.reason


def test_sdpa_wrapper_is_rejected_at_compile_on_cuda_by_the_allowlist_and_past_it_by_the_audit(evaluate_source):
    v = evaluate_source(C.SDPA_WRAPPER)
    assert v.failed_stage == "compile" and "torch.nn.functional" in v.stages[-1].reason, v.reason
    v = evaluate_source(C.SDPA_WRAPPER, config=runtime_only())
    assert v.failed_stage == "compile" and "library compute" in v.stages[-1].reason, v.reason


def test_illegal_memory_access_is_a_verdict_and_the_next_candidate_still_runs(evaluate_source):
    v = evaluate_source(C.ILLEGAL_ADDRESS)
    assert v.failed_stage == "compile", v.reason
    assert "illegal" in v.stages[-1].reason.lower() or v.stages[-1].failure == "crashed", v.reason
    assert evaluate_source(C.REF_DECODE, until="dispatch").ok


def test_the_evaluator_hands_its_working_memory_back_for_the_replay_and_takes_it_again(cfg):
    """What the replay's servers need the evaluator holds between candidates (worker.trusted_gpu_bytes in torch's
    cache): `release` gives it back to the device, and the next `reserve`, before any worker, takes it again."""
    dev = torch.device("cuda")
    want = cfg.worker.trusted_gpu_bytes
    reserve(cfg, dev)
    assert torch.cuda.memory_reserved(dev) >= want
    held = release(dev)
    assert held < want // 4, held
    assert reserve(cfg, dev).working_bytes == want and torch.cuda.memory_reserved(dev) >= want


def test_prefill_calibration_errs_as_the_timed_baseline_does_on_fresh_lengths(cfg):
    """Parity's prefill tolerance comes from SDPA without its cuDNN kernel (no plan per new length): on the same
    fresh mixed-length inputs, in the served dtype, its error against float64 is the timed baseline's (whichever
    kernel SDPA picks for that) within 2% on max-abs and relative L2, so the tolerance is the same bar."""
    from harness.evaluate import device_shapes
    from harness.stages.common import EvalContext, diff
    from harness.targets import TARGETS
    from harness.transport import DTYPES

    dev = torch.device("cuda")
    shapes = device_shapes(cfg, "attention", dev)
    target = TARGETS["attention"]
    op = target.ops["prefill"]
    ctx = EvalContext(cfg=cfg, target=target, shapes=shapes, device=dev, dtype=DTYPES[shapes.dtype], pool=None,
                      source="", ops=["prefill"])
    for seed, case in enumerate(ctx.cases("prefill", limits=True)):
        x = op.make_inputs(case, "normal", seed, dev, DTYPES[shapes.dtype])
        ref = op.reference(**x)
        timed, calibrated = diff(op.baseline(**x), ref), diff(op.calibrate(x), ref)
        assert calibrated.max_abs == pytest.approx(timed.max_abs, rel=0.02), case.label
        assert calibrated.rel_l2 == pytest.approx(timed.rel_l2, rel=0.02), case.label
