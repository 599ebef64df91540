"""Compile once, in parallel (stages.parity.warm_threads): before parity's first check the candidate's kernels
are compiled for every shape class of its plan at once in its own worker, with nothing launched. On the CPU
the interpreter compiles nothing, so this proves what holds everywhere: the warm leaves the verdict as it
was, covers each shape class once, and its calls are watched like every call (library compute there is a
rejection). While the worker compiles, the trusted side draws the first checks (within a memory bound); the
worker is still sent the same requests in the same order, and a warm that hangs or kills its worker is reported as
it was. Its speed shows on a GPU only: tests/bench/parity_warm.py."""
from __future__ import annotations

import random

import pytest
import torch

import candidates as C
from conftest import CUDA, RUNTIME_ONLY, config_with
from harness.gpu_memory import Reserve
from harness.stages.common import draw
from harness.stages.parity import AHEAD_SHARE, _ahead_bytes, _draw_ahead, plan_checks
from harness.targets.base import UNFILLED
from test_parity import CPU, _ctx

WARM = {"stages.parity.warm_threads": {"cuda": 8, "cpu": 2}, "stages.parity.warm_draws": {"cuda": 4, "cpu": 3},
        "stages.parity.checks_per_shape": 1, "stages.parity.twins": 1.0}   # every served check twinned: a fixed plan
# The reference decode, but with a library matmul on the served-limit batches (16 sequences and more), shapes the
# compile stage's one call never shows it: only a watched call on those shapes sees it.
LIBRARY_ON_LARGE_BATCHES = C.wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if q.shape[0] >= 16:
        torch.matmul(q[0], q[0].transpose(0, 1))
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")


def test_the_warm_calls_each_shape_class_on_fresh_lengths_and_the_verdict_is_unchanged(evaluate_source, seen):
    cfg = config_with(**WARM)
    verdict = evaluate_source(C.REF_DECODE, until="parity", config=cfg)
    assert verdict.ok, verdict.reason
    parity = verdict.stages[-1].metrics
    ctx = _ctx(cfg, ops=("decode",))
    classes = {check.case.label for check in plan_checks(ctx)}
    assert parity["warm_classes"] == len(classes) and parity["warm_failed"] == 0
    later, _ = seen()
    warm = [msg for kind, _, msg in later if kind == "send" and msg.get("cmd") == "warm"]
    assert len(warm) == 1 and parity["warm_calls"] == len(warm[0]["calls"]) == 3 * len(classes)
    shape = lambda label: label.split(";")[0]           # noqa: E731  (a draw's label adds its sm_scale and slots)
    by_class: dict[str, list] = {}
    for call in warm[0]["calls"]:
        by_class.setdefault(shape(call["case"].label), []).append(call)
    assert set(by_class) == {shape(c) for c in classes} and all(len(calls) == 3 for calls in by_class.values())
    assert len({call["seed"] for call in warm[0]["calls"]}) == len(warm[0]["calls"])      # each drawn afresh


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


@pytest.fixture
def seen(monkeypatch):
    """What parity draws and what the worker that gets the warm is sent, and when its replies are read, in the
    order they happen: recorded by wrappers that hand every call on unchanged."""
    import harness.stages.parity as parity
    from harness.worker_handle import WorkerHandle
    events: list[tuple] = []
    send, collect, draw, draw_twin = WorkerHandle.send, WorkerHandle.collect, parity.draw, parity.draw_twin

    def spy_send(self, msg, doing):
        events.append(("send", self, msg))
        return send(self, msg, doing)

    def spy_collect(self, timeout, doing):
        events.append(("collect", self, doing))           # before it waits: what was drawn by then came first
        return collect(self, timeout, doing)

    def spying(drawing):
        def spy_draw(*args, **kwargs):
            trial = drawing(*args, **kwargs)
            events.append(("draw", None, trial))
            return trial
        return spy_draw

    monkeypatch.setattr(WorkerHandle, "send", spy_send)
    monkeypatch.setattr(WorkerHandle, "collect", spy_collect)
    monkeypatch.setattr(parity, "draw", spying(draw))
    monkeypatch.setattr(parity, "draw_twin", spying(draw_twin))

    def from_the_warm() -> tuple[list[tuple], list]:
        """The events from the warm request on: the draws and the warmed worker's sends and collects."""
        start = next(i for i, (what, _, msg) in enumerate(events) if what == "send" and msg["cmd"] == "warm")
        worker = events[start][1]
        later = [e for e in events[start:] if e[1] is worker or e[0] == "draw"]
        return later, [e[2] for e in later if e[0] == "draw"]
    from_the_warm.events = events                          # all of them, from the evaluation's start
    return from_the_warm


def test_checks_drawn_during_the_warm_leave_what_the_worker_is_sent_as_it_was(evaluate_source, seen, monkeypatch):
    """Parity is begun by the compile stage once the candidate is imported: the worker gets the warm before the
    compile stage's own first call. The first check is drawn while the worker compiles (the memory bound set to
    one byte: only it), the rest in parity's loop as before; after the compile and dispatch stages' requests the
    worker gets each check in plan order with its own seed, one request at a time, keeping, rechecking and
    dropping outputs as the loop always did."""
    import harness.stages.parity as parity
    monkeypatch.setattr(parity, "AHEAD_HOST_BYTES", 1)
    cfg = config_with(**WARM)
    verdict = evaluate_source(C.REF_DECODE, until="parity", config=cfg)
    assert verdict.ok, verdict.reason
    events, trials = seen()
    n = len(plan_checks(_ctx(cfg, ops=("decode",))))
    assert len(trials) == n
    first_collect = next(i for i, e in enumerate(events) if e[0] == "collect")
    assert [e[0] for e in events[:first_collect]] == ["send", "draw"]          # drawn before the warm's reply is read
    sent = [msg["cmd"] for what, _, msg in seen.events if what == "send"]
    assert sent[:4] == ["source", "load", "warm", "call"], sent    # the warm before the compile stage's call
    to_worker = [(what, msg["cmd"] if what == "send" else msg, msg) for what, _, msg in events if what != "draw"]
    assert [e[:2] for e in to_worker[:3]] == [("send", "warm"), ("collect", "compiling the shape classes"),
                                              ("send", "call")]                # then the compile stage's first call
    checks = to_worker[-2 * n:]                                              # after the compile and dispatch stages'
    assert [e[:2] for e in checks] == [e for t in trials for e in (("send", "call"), ("collect", f"running {t.case.label}"))]
    calls = [msg for what, _, msg in checks if what == "send"]
    assert [c["inputs"]["seed"] for c in calls] == [t.seed for t in trials]
    assert [c["inputs"]["case"].label for c in calls] == [t.case.label for t in trials]
    assert [(c["keep"], c["recheck"], c["drop"]) for c in calls] == \
        [(i, list(range(max(0, i - 2), i)), [i - 2] if i >= 2 else []) for i in range(n)]
    m = verdict.stages[-1].metrics
    assert m["drawn_during_warm"] == 1 and 0 < m["draw_during_warm_s"] <= m["draw_s"], m


def test_a_warm_that_hangs_is_cut_by_the_stage_timeout_after_every_check_was_drawn(evaluate_source, seen):
    cfg = config_with(**WARM, **{"stages.compile.timeout_s": 6})        # the warm is sent by the compile stage
    v = evaluate_source(C.HANG_ON_BOUNDARY, until="parity", config=cfg)
    assert v.failed_stage == "compile" and v.stages[-1].failure == "timeout", v.reason
    assert "while compiling the shape classes" in v.stages[-1].reason, v.stages[-1].reason
    events, trials = seen()
    assert [e[0] for e in events] == ["send"] + ["draw"] * len(plan_checks(_ctx(cfg, ops=("decode",)))) + ["collect"]


def test_a_worker_that_dies_in_the_warm_is_a_verdict_naming_the_signal_and_the_warm(evaluate_source, seen):
    v = evaluate_source(C.CRASH_ON_BOUNDARY, until="parity", config=config_with(**WARM, **RUNTIME_ONLY))
    assert v.failed_stage == "compile" and v.stages[-1].failure == "crashed", v.reason
    assert "SIGSEGV" in v.stages[-1].reason and "while compiling the shape classes" in v.stages[-1].reason, v.reason
    events, trials = seen()
    assert [e[0] for e in events if e[0] != "draw"] == ["send", "collect"] and trials     # no check sent after it


def test_the_checks_drawn_during_the_warm_stop_at_the_memory_bound_or_when_its_reply_waits(cfg):
    ctx = _ctx(cfg, ops=("decode",))
    plan = plan_checks(ctx)
    trials = [draw(ctx, check.case, check.dist, vary=True) for check in plan]
    drawn = trials.__getitem__
    assert list(_draw_ahead(len(plan), drawn, 1 << 40, lambda: False)) == trials          # all of them, in order
    two = trials[0].nbytes() + 1                          # over the first's bytes: the second reaches the bound
    assert list(_draw_ahead(len(plan), drawn, two, lambda: False)) == trials[:2]
    assert list(_draw_ahead(len(plan), drawn, 1 << 40, lambda: True)) == trials[:1]      # the first is needed anyway
    assert not _draw_ahead(len(plan), drawn, 0, lambda: False)


def test_on_cuda_the_checks_drawn_during_the_warm_may_hold_a_share_of_the_evaluators_reserved_memory(cfg):
    ctx = _ctx(cfg, ops=("decode",))
    ctx.device = torch.device("cuda")
    ctx.reserved = Reserve(flush=torch.empty(0), working_bytes=cfg.worker.trusted_gpu_bytes)
    assert _ahead_bytes(ctx) == int(AHEAD_SHARE * cfg.worker.trusted_gpu_bytes) > 0
    ctx.reserved = None                                   # nothing reserved: nothing drawn ahead on the GPU
    assert _ahead_bytes(ctx) == 0


def test_the_warms_unfilled_inputs_hold_every_shape_and_host_fact_of_each_distributions_draw(cfg):
    """The warm compiles for what a drawn call will meet, so its inputs (targets.base.UNFILLED: no payload
    written, nothing launched on them) must agree with every distribution's draw from the same seed on all a
    kernel can specialize on or a wrapper can read on the host: the arguments, their shapes and dtypes, every
    integer tensor (block tables, lengths, offsets) and every scalar."""
    ctx = _ctx(cfg)
    checked = 0
    for case, *_ in plan_checks(ctx):
        for dist in ("normal", "peaky", "shifted_keys", "served"):
            seed = random.Random(f"{case.label}{dist}").getrandbits(62)
            varied = ctx.target.vary(case, dist, random.Random(seed), ctx)
            drawn = ctx.target.ops[case.op].make_inputs(varied, dist, seed, CPU, torch.float32)
            bare = ctx.target.ops[case.op].make_inputs(varied, UNFILLED, seed, CPU, torch.float32)
            assert drawn.keys() == bare.keys(), (case.label, dist)
            for name, value in drawn.items():
                other = bare[name]
                if not isinstance(value, torch.Tensor):
                    assert other == value, (case.label, dist, name)
                elif value.dtype.is_floating_point:
                    assert (other.shape, other.dtype, other.device) == (value.shape, value.dtype, value.device)
                else:
                    assert torch.equal(other, value), (case.label, dist, name)
            checked += 1
    assert checked >= 4 * 8
