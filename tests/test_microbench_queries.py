"""Microbench times every call on a query of its own (harness/worker_timing.py `per_call_seed`,
`redraw_per_call`; the attention ops' `per_call` argument): an output kept for inputs seen before and handed back
(tests/adversarial/content_cache_prefill.py, right on every call) never answers a timed call, and the call
microbench checks is on the query its float64 reference was computed with. The timing itself needs CUDA; the
schedule of queries, the references and the cache's hits are the same code on a CPU."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from conftest import CUDA, ROOT, config_with  # noqa: E402
from harness.evaluate import device_shapes  # noqa: E402
from harness.stages.common import EvalContext  # noqa: E402
from harness.stages.microbench_prepare import case_draws, draw_sets  # noqa: E402
from harness.stages.microbench_prepare import time_request  # noqa: E402
from harness.targets.attention import TARGET as ATTENTION  # noqa: E402
from harness.worker_timing import per_call_seed, redraw_per_call  # noqa: E402
from test_reference_kernels_standalone import _load  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CFG = config_with()
CPU = torch.device("cpu")
CACHE = ROOT / "tests" / "adversarial" / "content_cache_prefill.py"


def _ctx(cfg=CFG) -> EvalContext:
    return EvalContext(cfg=cfg, target=ATTENTION, shapes=device_shapes(cfg, "attention", CPU), device=CPU,
                       dtype=torch.float32, pool=None, source="", ops=["decode", "prefill"])


def _schedule(msg: dict) -> list[tuple[int, bool]]:
    """The calls a `time` request makes on each set, in order, as (call index, whether it is the checked rep)."""
    reps = msg["reps"]
    return [(reps + w, False) for w in range(msg["warmup"])] + [(r, r == msg["check_rep"]) for r in range(reps)]


def _timed_case(op: str):
    ctx = _ctx()
    case = next(c for c in ctx.cases(op, boundary=False))
    trials = draw_sets(ctx, case)
    return ctx, case, trials, time_request(ctx, case, trials, warmup=2, reps=CFG.stages.microbench.reps)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_every_call_of_a_time_request_is_on_a_query_of_its_own_and_the_checked_rep_on_its_references(op):
    ctx, case, trials, msg = _timed_case(op)
    spec = ATTENTION.ops[op]
    for s, t in enumerate(trials):
        args = spec.make_inputs(t.case, t.dist, t.seed, CPU, torch.float32)      # as the worker rebuilds the set
        seen = [args["q"].clone()]
        checked = 0
        for call, is_checked in _schedule(msg):
            redraw_per_call(args, "q", per_call_seed(msg, s, call, is_checked))
            seen.append(args["q"].clone())
            if is_checked:
                checked += 1
                assert torch.equal(spec.reference(**args), t.ref)    # the trusted side's reference, for this query
        assert checked == 1
        assert not any(torch.equal(a, b) for i, a in enumerate(seen) for b in seen[i + 1:])
    again = time_request(ctx, case, trials, warmup=2, reps=msg["reps"])     # the same sets asked again: other queries
    assert per_call_seed(again, 0, 0, False) != per_call_seed(msg, 0, 0, False)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_a_try_after_a_disagreement_is_timed_on_sets_of_its_own_so_no_checked_query_comes_back(op):
    """A candidate can make a try disagree, and sees the try's checked query in the clock's burst: each try after the
    first times sets drawn afresh (the same lengths), whose checked query and reference are new."""
    ctx, case, trials, msg = _timed_case(op)
    tries = case_draws(ctx, case, trials)
    first, second, third = next(tries), next(tries), next(tries)
    assert first is trials
    asked = [time_request(ctx, case, t, warmup=2, reps=msg["reps"]) for t in (first, second, third)]
    checked = [[per_call_seed(m, s, m["check_rep"], True) for s in range(len(t))]
               for m, t in zip(asked, (first, second, third))]
    assert len({seed for seeds in checked for seed in seeds}) == 3 * len(trials)   # no checked query twice
    for a, b in zip(first, second):
        assert _lengths(op, a.inputs) == _lengths(op, b.inputs) and not torch.equal(a.ref, b.ref)


def test_an_output_cache_answers_repeated_inputs_and_no_call_of_a_time_request():
    """The cache is right on every call and hits on inputs that repeat (as each set's reps once did); on the
    queries a time request calls it with, it never hits, and the checked rep's output is the reference's."""
    ctx, case, trials, msg = _timed_case("prefill")
    cache, spec = _load(CACHE), ATTENTION.ops["prefill"]
    hits = lambda: int(next(iter(cache._STATE.values()))[2])     # noqa: E731  the hit flag of its last call
    t = trials[0]
    args = spec.make_inputs(t.case, t.dist, t.seed, CPU, torch.float32)
    first = cache.prefill(*(args[n] for n in spec.arg_names))
    assert hits() == 0 and torch.equal(cache.prefill(*(args[n] for n in spec.arg_names)), first) and hits() == 1
    for call, is_checked in _schedule(msg):
        redraw_per_call(args, "q", per_call_seed(msg, 0, call, is_checked))
        out = cache.prefill(*(args[n] for n in spec.arg_names))
        assert hits() == 0, f"call {call} was answered from the cache"
        if is_checked:
            assert (out.double() - t.ref).abs().max() <= t.tol.max_abs


def test_an_output_cache_passes_parity_where_every_check_draws_fresh_inputs(evaluate_source):
    """Why microbench must not repeat inputs: no check of parity's meets a hit, so it passes."""
    v = evaluate_source(CACHE.read_text(), until="parity")
    assert v.ok, v.reason


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA): microbench times on it")
def test_an_output_cache_is_timed_as_the_same_kernel_without_it_on_gpu(evaluate_source):
    """Each set's reps on inputs of their own: the cache's microbench figure is its kernel's, within the noise (before,
    every rep after the first was a checksum and a copy)."""
    figures = {}
    for cache in (True, False):
        source = CACHE.read_text().replace("CACHE = True", f"CACHE = {cache}")
        v = evaluate_source(source, until="microbench")
        stage = v.stages[-1]
        assert stage.name == "microbench" and "speedup" in stage.metrics, v.reason
        figures[cache] = stage.metrics["speedup"]
    assert figures[True] <= 1.1 * figures[False], figures


def test_the_workers_timing_loop_calls_each_rep_on_its_own_query_and_checks_the_one_the_reference_is_for(tmp_path):
    """`timed` itself, run on a CPU in a process of its own with CUDA's timing calls stood in for
    (tests/fakes/cuda_timing.py): the output cache is called on a new query every time and never hits; the checked
    rep's output is within the tolerance of the trusted side's reference; the sets are left on the checked query."""
    import subprocess
    import sys
    cfg = config_with(**{"stages.microbench.reps": 5, "stages.microbench.input_sets": 2})
    ctx = _ctx(cfg)
    case = next(c for c in ctx.cases("prefill", boundary=False))
    trials = draw_sets(ctx, case)
    msg = time_request(ctx, case, trials, warmup=2, reps=5)
    torch.save({"msg": msg, "source": CACHE.read_text()}, tmp_path / "request.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "fakes" / "cuda_timing.py"), str(tmp_path / "request.pt"),
                           str(tmp_path / "result.pt")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    calls = result["calls"]
    assert len(calls) == 2 * (2 + 5) and not any(c["hit"] for c in calls), [c["hit"] for c in calls]
    assert not any(torch.equal(a["q"], b["q"]) for i, a in enumerate(calls) for b in calls[i + 1:])
    spec = ATTENTION.ops["prefill"]
    for s, t in enumerate(trials):
        out = result["outputs"][f"set{s}"]
        assert (out.double() - t.ref).abs().max() <= t.tol.max_abs
        checked = {**t.inputs, "q": result["left"][s]}
        assert torch.equal(spec.reference(**checked), t.ref)       # left on the checked query, for the bursts


def _lengths(op: str, inputs: dict) -> list[int]:
    if op == "decode":
        return inputs["seq_lens"].tolist()
    cu = inputs["cu_seqlens"].tolist()
    return [e - s for s, e in zip(cu[:-1], cu[1:])]


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_microbench_times_every_candidate_on_the_same_lengths_with_fresh_payloads(op):
    """A candidate's speedup and its parent's (the bar) are of the same work: each timed set of a served shape has
    lengths fixed by `lengths_seed`, the shape and the set's place, for every candidate; its queries, keys, values and
    block table are drawn fresh from the set's secret seed; the worker, rebuilding the set from its recipe, gets the
    same lengths. Another seed, other lengths."""
    ctx = _ctx()
    case = next(c for c in ctx.cases(op, boundary=False) if c.params["length_range"][0] < c.params["length_range"][1])
    spec = ATTENTION.ops[op]
    one, other = draw_sets(ctx, case), draw_sets(ctx, case)        # two candidates' draws
    for a, b in zip(one, other):
        assert _lengths(op, a.inputs) == _lengths(op, b.inputs)
        assert a.seed != b.seed and not torch.equal(a.inputs["k_cache" if op == "decode" else "k"],
                                                    b.inputs["k_cache" if op == "decode" else "k"])
        rebuilt = spec.make_inputs(b.case, b.dist, b.seed, CPU, torch.float32)
        assert _lengths(op, rebuilt) == _lengths(op, a.inputs)
    assert _lengths(op, one[0].inputs) != _lengths(op, one[1].inputs)   # the sets are two draws of the shape
    seeded = draw_sets(_ctx(config_with(**{"stages.microbench.lengths_seed": 1})), case)
    assert [_lengths(op, t.inputs) for t in seeded] != [_lengths(op, t.inputs) for t in one]
