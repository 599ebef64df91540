"""Stage 5 on the CPU (tiny preset, Triton's interpreter, float32). The gates, on every served token: the
project's reference kernels pass them; kernels wrong only in serving (a window of recent tokens, views of
one buffer across ops, NaN as the mask, the newest token dropped) fail them; a candidate whose shapes fall
back, or whose server crashes, is not accepted. Each replay draws fresh prompts and weights. The head is
served beside the candidate; the paired score accepts only a gain beyond its own noise band. On a CPU the
stage runs the gates and times nothing."""
from __future__ import annotations

import logging
import math
import random
import sys

import pytest
import torch

import candidates as C
from conftest import CPU_GATES, CUDA, ROOT, config_with
from harness.errors import HarnessError
from harness.records import Verdict
from harness.served.client import Completion, ReplayRun
from harness.served.score import compare_forced, paired, parting
from harness.stages.common import EvalContext, Rejected
from harness.stages.arms import Servers, send, warm_lengths
from harness.stages.replay import (continuation_pass, draw, judge, replay_stage, run_gates, run_replay, segments,
                                   warm_pass)
from harness.targets.attention import TARGET

CFG = config_with(**CPU_GATES)
GATES_ALONE = config_with(**CPU_GATES, **{"served.spot_share": 0.0})    # the spot checks would reject these first
ADVERSARIAL = ROOT / "tests" / "adversarial"


@pytest.fixture(scope="module")
def references():
    """The gates' verdict on each reference kernel, each replay with its own secret draw."""
    return {"decode": run_gates(CFG, "cpu", C.REF_DECODE), "prefill": run_gates(CFG, "cpu", C.REF_PREFILL)}


@pytest.mark.parametrize("own, other", [("decode", "prefill"), ("prefill", "decode")])
def test_reference_kernel_passes_the_gates_on_every_served_token(references, own, other):
    outcome = references[own]
    assert outcome.gate.passed, outcome.reason
    assert outcome.metrics["gate_coverage"] == 1.0 and outcome.gate.compared == outcome.gate.generated > 0
    assert outcome.metrics["fallback_share"] == 0.0 and f"{other} not implemented" in outcome.reason
    assert "nothing timed and nothing accepted" in outcome.reason and not outcome.accepted
    result = outcome.stage_result()
    assert result.status == "passed" and not Verdict.of([result]).accepted


def test_each_replay_draws_its_own_prompts_and_weights(references):
    a, b = (references[op].reference for op in ("decode", "prefill"))
    assert [c.tokens for c in a.completions] != [c.tokens for c in b.completions]
    lines = [len(r.prompt) for r in draw(CFG, "cpu", random.Random(1))]
    assert set(lines) <= set(warm_lengths(CFG, "cpu"))      # lengths from the trace's window, ids fresh


@pytest.mark.parametrize("source", [
    pytest.param(C.recent_window(8), id="attends-to-the-last-8-tokens"),
    pytest.param((ADVERSARIAL / "shared_output_buffer.py").read_text(), id="views-of-one-buffer-across-ops"),
    pytest.param((ADVERSARIAL / "masks_unused_by_nan.py").read_text(), id="masks-by-nan"),
    pytest.param(C.DROPS_NEWEST_TOKEN, id="drops-the-newest-token"),
])
def test_kernel_wrong_only_in_serving_fails_the_gates(source):
    outcome = run_gates(GATES_ALONE, "cpu", source)
    assert not outcome.gate.passed and not outcome.accepted
    assert outcome.reason.startswith("the served tokens differ from the reference's: ")
    with pytest.raises(Rejected) as err:
        outcome.stage_result()
    assert err.value.metrics["gate_passed"] == 0.0 and err.value.failure == "wrong_output"     # wrong, not slow


SOMETIMES_DECLINES = C.REF_DECODE + """

def supports(op, **shape):
    return shape["max_seq_len"] <= 12
"""


def test_candidate_whose_served_shapes_fall_back_is_not_accepted():
    outcome = run_gates(CFG, "cpu", SOMETIMES_DECLINES)
    assert outcome.gate.passed and not outcome.accepted
    assert 0 < outcome.metrics["fallback_share"] < 1 and "calls fell back" in outcome.reason
    with pytest.raises(Rejected):
        outcome.stage_result()


@pytest.fixture(scope="module")
def warm_calls() -> int:
    """How many decode calls the served server's warm-up makes before the trace: the same warm-up,
    run here on the same preset with a counting candidate (it is deterministic)."""
    from types import SimpleNamespace

    from harness.served.engine import make_engine, warm_up
    from harness.served.ops import AttentionOps
    from harness.targets.attention import decode_baseline
    calls = [0]

    def decode(*args):
        calls[0] += 1
        return decode_baseline(*args)

    served = CFG.served.cpu
    engine = make_engine(CFG.served.presets[served.preset], CFG.targets.attention.cpu.block_size, torch.float32,
                         torch.device("cpu"), AttentionOps(SimpleNamespace(decode=decode)), init=CFG.served.random_init,
                         top_k=CFG.served.logprobs)
    warm_up(engine, warm_lengths(CFG, "cpu"), served.warm_requests)
    return calls[0]


def test_candidate_that_crashes_its_server_is_rejected_saying_how(warm_calls):
    crashes_when_serving = C.wrap_decode(f"""
_calls = [0]

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    _calls[0] += 1
    if _calls[0] > {warm_calls + 4}:      # past the warm-up: while serving the trace
        __import__("ctypes").string_at(0)
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")
    with pytest.raises(Rejected) as err:
        run_gates(CFG, "cpu", crashes_when_serving)
    assert "the candidate's server: the server killed by signal 11 (SIGSEGV) during the replay" in str(err.value)
    assert "requests did not complete" in str(err.value) and err.value.failure == "server_failed"


def test_a_candidate_call_that_holds_the_host_in_the_window_is_named_in_the_verdict(warm_calls):
    # the reference decode (its served calls must launch a kernel); one call past the warm-up sleeps as a compile would
    stalls_once = C.wrap_decode(f"""
import time
_calls = [0]

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    _calls[0] += 1
    if _calls[0] == {warm_calls + 3}:
        time.sleep(0.4)
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")
    outcome = run_gates(CFG, "cpu", stalls_once)
    assert outcome.metrics["candidate_stalls"] >= 1 and outcome.metrics["candidate_stall_ms"] >= 400
    assert "held the host over served.stall_ms in the window" in outcome.reason


def test_the_head_is_served_beside_the_candidate_and_judged_by_the_same_gates(caplog):
    with caplog.at_level(logging.INFO, logger="harness"):
        outcome = run_replay(CFG, "cpu", C.REF_DECODE, head=C.DROPS_NEWEST_TOKEN)
    m = outcome.metrics
    assert m["gate_passed"] == 1.0 and m["head_gate_passed"] == 0.0 and m["head_is_torch"] == 0.0
    assert "the head FAILS its gates" in outcome.reason and m["segments"] >= 2
    assert m["continuation_from_head"] == 0.0 and "the head's continuation parted: request" in outcome.reason
    assert m["gate_coverage"] == 1.0 and m["stage_s"] >= m["arms_ready_s"] >= m["reference_done_s"] > 0
    # its progress lines (evaluate --progress): each server up, the reference's pass, every timed segment
    said = [r.getMessage() for r in caplog.records]
    for label in ("reference", "head", "candidate"):
        assert sum(f"the {label} server is up" in line for line in said) == 1, said
    assert any("the reference decoded its own continuation" in line for line in said), said
    n = int(m["segments"])
    assert [line for line in said if "timed segment" in line] == [
        f"replay: timed segment {j} of {n} served to both arms" for j in range(1, n + 1)], said


def test_a_heads_continuation_is_scored_by_the_reference_as_its_own_greedy_pass_would_be():
    # (a head whose continuation parts from the reference's path: the broken head's replay above)
    with Servers(CFG, "cpu", {"reference": None, "good": None}, 7) as servers:
        requests = draw(CFG, "cpu", random.Random(5))
        own = continuation_pass(CFG, "cpu", servers, requests)                 # the reference's own greedy tokens
        good = continuation_pass(CFG, "cpu", servers, requests, source="good")
    assert (own.source, good.source, good.parted) == ("reference", "good", "")
    by_index = {c.index: c for c in own.ref.completions}
    for c in good.ref.completions:                # torch's float32 baselines both: the same path, the same logprobs
        assert c.tokens == by_index[c.index].tokens
        assert max(abs(a - b) for a, b in zip(c.logprobs, by_index[c.index].logprobs)) < 1e-4
        assert [x[0][0] for x in c.top] == [x[0][0] for x in by_index[c.index].top]       # its own choices


def test_a_continuation_parts_where_it_leaves_the_references_choice_beyond_a_near_tie():
    near = _tokens("reference", ["a", "b", "c"], [-0.5, -0.2, -0.9], ["a", "x", "c"], [1.0, 0.3, 1.0])
    clear = _tokens("reference", ["a", "b", "c"], [-0.5, -0.2, -0.9], ["a", "b", "y"], [1.0, 0.3, 2.5])
    assert parting(near, 0.5) == ""
    assert parting(clear, 0.5) == "request 1, token 3: c where the reference would choose y by a lead of 2.5 (a near-tie is within 0.5)"


def test_a_head_that_cannot_be_served_is_a_harness_error_naming_its_cause_on_the_first_line():
    with pytest.raises(HarnessError) as err:
        run_replay(CFG, "cpu", C.REF_DECODE, head="raise RuntimeError('no room for the cache')\n")
    first = str(err.value).splitlines()[0]            # what the command line's one-line error shows
    assert first.startswith("the head server: the server exited with code 1 before it was ready"), first
    assert first.endswith("RuntimeError: no room for the cache; its last output:"), first


OUT_OF_MEMORY = "import torch\nraise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 14.00 GiB')\n"


def test_a_server_that_runs_out_of_memory_is_said_to_have_done_so_in_its_own_share():
    """The candidate's: its rejection, the head's share the same; the head's: a harness error saying what to change."""
    with pytest.raises(Rejected) as err:
        run_replay(CFG, "cpu", OUT_OF_MEMORY)
    assert err.value.failure == "server_failed"
    assert str(err.value).startswith("the candidate's server: it ran out of GPU memory in its share, "
                                     "served.gpu_memory_fraction 0.29 of the GPU (the head gets the same): "), str(err.value)
    with pytest.raises(HarnessError) as err:
        run_replay(CFG, "cpu", C.REF_DECODE, head=OUT_OF_MEMORY)
    assert str(err.value).startswith("the head server: it ran out of GPU memory in its share"), str(err.value)
    assert "(raise it, or lower the cache)" in str(err.value).splitlines()[0]


def _seg(label: str, start: int, ttft_ms: list[float], tpot_ms: list[float], tokens: int = 5) -> ReplayRun:
    comps = []
    for i, (ttft, tpot) in enumerate(zip(ttft_ms, tpot_ms)):
        times = [(i + ttft / 1e3) + k * tpot / 1e3 for k in range(tokens)]
        comps.append(Completion(start + i, float(i), tokens, sent_s=float(i), token_times=times,
                                tokens=[f"token_id:{k}" for k in range(tokens)], logprobs=[-0.1] * tokens,
                                top=[[(f"token_id:{k}", -0.1), ("x", -3.0)] for k in range(tokens)]))
    return ReplayRun(label, comps, duration_s=len(ttft_ms) + 1.0, max_send_lag_s=0.0)


def _arms(head_scale: list[float], cand_scale: list[float], ttft_scale: float = 1.0):
    """Segments of 10 requests each; each arm's latencies scaled per segment."""
    ttft, tpot = [100.0 + 3 * i for i in range(10)], [20.0 + (7 * i) % 5 for i in range(10)]
    head = [_seg("head", 10 * j, [t * s for t in ttft], [t * s for t in tpot]) for j, s in enumerate(head_scale)]
    cand = [_seg("candidate", 10 * j, [t * s * ttft_scale for t in ttft], [t * s for t in tpot]) for j, s in enumerate(cand_scale)]
    return merged_reference(head), head, cand


def merged_reference(head: list[ReplayRun]) -> ReplayRun:
    return ReplayRun("reference", [c for r in head for c in r.completions], 1.0, 0.0)


ALL_CANDIDATE = {"ops": {"decode": {"calls": 10, "candidate": 10, "unsupported": 0, "not_implemented": 0, "implemented": True},
                         "prefill": {"calls": 4, "candidate": 0, "unsupported": 0, "not_implemented": 4, "implemented": False}}}


def test_only_a_candidate_faster_than_its_head_beyond_the_noise_band_is_accepted():
    ref, head, fast = _arms([1.0, 1.02, 0.99, 1.01], [0.9, 0.92, 0.89, 0.91])      # 10% faster in every segment
    faster = judge(CFG, "float32", ref, head, fast, ALL_CANDIDATE)
    assert faster.accepted and faster.metrics["accepted"] == 1.0 and Verdict.of([faster.stage_result()]).accepted
    expected = math.exp(sum(math.log(h / c) for h, c in zip([1.0, 1.02, 0.99, 1.01], [0.9, 0.92, 0.89, 0.91])) / 4) - 1
    assert math.isclose(faster.metrics["gain"], expected, rel_tol=1e-9) and faster.metrics["gain_lower"] > 0.05
    ref, head, noisy = _arms([1.0, 1.0, 1.0, 1.0], [0.9, 1.1, 0.92, 1.08])        # as fast on average, noisy
    same = judge(CFG, "float32", ref, head, noisy, ALL_CANDIDATE)
    assert not same.accepted and "not faster than the head beyond noise" in same.reason
    assert same.metrics["noise_band"] > 0.05 and same.metrics["gain_lower"] < 0
    with pytest.raises(Rejected) as slow:
        same.stage_result()
    assert slow.value.failure is None                               # slow, not wrong: a kernel still to build on
    unaccounted = judge(CFG, "float32", ref, *_arms([1.0] * 4, [0.9] * 4)[1:], None)
    assert not unaccounted.accepted and "reports no fallback accounting" in unaccounted.reason
    ref, head, fast = _arms([1.0, 1.02, 0.99, 1.01], [0.9, 0.92, 0.89, 0.91])
    eager = judge(CFG, "float32", ref, head, fast, ALL_CANDIDATE | {"graphs": {
        "on": False, "fell_back": True, "reason": "off: capturing the decode step at batch 4, width 8 failed (...)"}})
    assert eager.accepted and eager.metrics["candidate_cuda_graphs"] == 0.0      # said, not held against it
    assert "the candidate's server decoded eagerly: CUDA graphs off: capturing the decode step at batch 4" in eager.reason
    assert "decoded eagerly" not in faster.reason
    both_stats = {"ops": {}, "graphs": {"on": False, "fell_back": True, "left_out": 3,
                                        "reason": "off: capturing the decode step at batch 8, width 4 failed (...)"}}
    both = judge(CFG, "float32", ref, head, fast, ALL_CANDIDATE, head_stats=both_stats)
    assert "; the head's server decoded eagerly: CUDA graphs off: capturing the decode step at batch 8" in both.reason
    assert both.metrics["head_cuda_graphs"] == 0.0 and both.metrics["head_graph_keys_left_out"] == 3.0
    graphed = ALL_CANDIDATE | {"graphs": {"on": True, "fell_back": False, "left_out": 0}}
    starved = {"ops": {}, "graphs": {"on": False, "fell_back": True, "left_out": 3, "reason": "off: capturing the decode "
                                     "step at batch 64, width 256 failed (OutOfMemoryError: CUDA out of memory. ...)"}}
    crippled = judge(CFG, "float32", ref, head, fast, graphed, head_stats=starved)     # the candidate's memory, perhaps
    assert not crippled.accepted and "the arms are not comparable" in crippled.reason, crippled.reason
    assert judge(CFG, "float32", ref, head, fast, graphed, head_stats=both_stats).accepted   # the head's own, said
    odd = judge(CFG, "float32", ref, head, fast, ALL_CANDIDATE | {"graphs": {"on": True, "left_out": "all of them"}})
    assert math.isnan(odd.metrics["candidate_graph_keys_left_out"]) and odd.accepted    # a server's word, not a number



def test_the_heads_own_spot_checks_are_said_and_counted_beside_a_verdict_they_do_not_decide():
    """Both arms' servers check a secret share of their calls. A head found wrong there (2026-12-06, H100: s50's
    c022, accepted by one replay, failed a spot check in a later one) is said in the reason; the candidate is
    judged on its own checks and its speed."""
    ref, head, fast = _arms([1.0, 1.02, 0.99, 1.01], [0.9, 0.92, 0.89, 0.91])
    checked = {"calls": 40, "candidate": 40, "unsupported": 0, "not_implemented": 0, "implemented": True,
               "spot_checked": 38, "spot_failed": 0}
    wrong = {"ops": {"prefill": checked | {"spot_failed": 1, "spot_first": "prefill of 3 sequences, sequence 2 of "
                                                                          "length 3968, 17 of its rows"}}}
    outcome = judge(CFG, "float32", ref, head, fast, {"ops": {"prefill": checked}}, head_stats=wrong)
    assert outcome.accepted and outcome.metrics["head_spot_failed_ops"] == 1.0, outcome.reason
    assert ("; the head FAILS its spot checks: prefill in the head's served process: 1 of the 38 served calls checked"
            in outcome.reason and "sequence 2 of length 3968" in outcome.reason), outcome.reason
    right = judge(CFG, "float32", ref, head, fast, {"ops": {"prefill": checked}}, head_stats={"ops": {"prefill": checked}})
    assert right.metrics["head_spot_failed_ops"] == 0.0 and "spot checks" not in right.reason, right.reason
    with pytest.raises(Rejected) as e:                       # the same failure in the candidate's server rejects it
        judge(CFG, "float32", ref, head, fast, wrong, head_stats={"ops": {"prefill": checked}})
    assert e.value.failure == "wrong_output" and str(e.value).startswith("prefill in the candidate's served process")


def test_the_verdict_says_how_long_each_arms_eager_calls_held_the_host():
    """2026-12-05, H100: a prefill 18% faster on the device (one process) lost 21% of p90 TTFT in the replay with no
    call over served.stall_ms; a call's host time, each arm's, is what the verdict now says."""
    ref, head, cand = _arms([1.0] * 4, [1.1] * 4)
    timed = {"calls": 2100, "candidate": 2100, "unsupported": 0, "not_implemented": 0, "implemented": True}
    stats = {"ops": {"prefill": timed | {"host_calls": 2000, "host_ms": 8200.0}}}
    head_stats = {"ops": {"prefill": timed | {"host_calls": 2000, "host_ms": 180.0}}}
    outcome = judge(CFG, "float32", ref, head, cand, stats, head_stats=head_stats)
    assert "; host time an eager call: prefill 4.100 ms (the head's 0.090 ms)" in outcome.reason, outcome.reason
    assert outcome.metrics["candidate_prefill_host_ms_per_call"] == 4.1 and outcome.metrics["head_prefill_host_ms_per_call"] == 0.09
    alone = judge(CFG, "float32", ref, head, cand, stats)
    assert "; host time an eager call: prefill 4.100 ms" in alone.reason and "(the head's" not in alone.reason


def test_a_faster_decode_does_not_hide_a_ttft_three_times_the_heads():
    ref, head, cand = _arms([1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5], ttft_scale=6.0)
    outcome = judge(CFG, "float32", ref, head, cand, ALL_CANDIDATE)
    assert outcome.metrics["tpot_p90_speedup"] > 1.9 and not outcome.accepted and outcome.metrics["gain"] < 0


def test_the_paired_bound_widens_with_fewer_segments():
    a = paired(*_arms([1.0] * 2, [0.95, 0.97])[1:], 0.05)
    b = paired(*_arms([1.0] * 8, [0.95, 0.97] * 4)[1:], 0.05)
    assert a.band > 3 * b.band and len(b.segments) == 8


def _tokens(label: str, tokens: list[str], lps: list[float], own: list[str], leads: list[float]) -> ReplayRun:
    top = [[(o, lp + lead if o != t else lp), (t if o != t else "runner-up", lp if o != t else lp - lead)]
           for t, lp, o, lead in zip(tokens, lps, own, leads)]
    return ReplayRun(label, [Completion(0, 0.0, len(tokens), 0.0, list(range(len(tokens))), tokens, lps, top)], 1.0, 0.0)


REF = _tokens("reference", ["a", "b", "c", "d"], [-0.5, -0.2, -0.9, -0.1], ["a", "b", "c", "d"], [2.0, 0.004, 3.0, 1.0])


def test_gates_compare_every_forced_token_and_tolerate_another_choice_only_at_a_near_tie():
    at_tie = compare_forced(REF, _tokens("c", ["a", "b", "c", "d"], [-0.5, -0.2, -0.9, -0.1], ["a", "x", "c", "d"], [1] * 4),
                            1e-3, 1e-3, 1e-2)
    assert at_tie.passed and at_tie.flips == 1 and at_tie.compared == 4 and at_tie.coverage == 1.0
    clear = compare_forced(REF, _tokens("c", ["a", "b", "c", "d"], [-0.5, -0.2, -0.9, -0.1], ["a", "b", "y", "d"], [1] * 4),
                           1e-3, 1e-3, 1e-2)
    assert not clear.passed and "request 1, token 3: would choose y where the reference chose c" in clear.detail
    drift = compare_forced(REF, _tokens("c", ["a", "b", "c", "d"], [-0.5, -0.2, -0.95, -0.1], ["a", "b", "c", "d"], [1] * 4),
                           1e-3, 1.0, 1e-2)
    assert not drift.passed and "token 3: logprob -0.95000 where the reference has -0.90000" in drift.detail


def test_on_the_heads_continuation_an_arm_is_held_to_the_references_own_choice_not_the_heads():
    # the reference scored a continuation the head chose: at token 3 the head took c where the reference's own
    # top choice was q, by a clear lead of 3.0
    scored = _tokens("reference", ["a", "b", "c", "d"], [-0.5, -0.2, -0.9, -0.1], ["a", "b", "q", "d"], [2.0, 0.004, 3.0, 1.0])
    as_reference = compare_forced(scored, _tokens("c", ["a", "b", "c", "d"], [-0.5, -0.2, -0.9, -0.1], ["a", "b", "q", "d"],
                                                  [1] * 4), 1e-3, 1e-3, 1e-2)
    assert as_reference.passed and as_reference.flips == 0
    as_head = compare_forced(scored, _tokens("head", ["a", "b", "c", "d"], [-0.5, -0.2, -0.9, -0.1], ["a", "b", "c", "d"], [1] * 4),
                             1e-3, 1e-3, 1e-2)
    assert not as_head.passed and "token 3: would choose c where the reference chose q" in as_head.detail


def test_gates_fail_a_small_drift_on_every_token_through_its_mean():
    small = compare_forced(REF, _tokens("c", ["a", "b", "c", "d"], [-0.51, -0.21, -0.91, -0.11], ["a", "b", "c", "d"], [1] * 4),
                           0.05, 0.005, 1e-2)
    assert not small.passed and "the mean logprob difference over 4 tokens is 0.01 > mean_abs 0.005" in small.detail


def test_gates_fail_a_nan_logprob_and_tokens_that_were_not_forced():
    nan = compare_forced(REF, _tokens("c", ["a", "b", "c", "d"], [-0.5, float("nan"), -0.9, -0.1], ["a", "b", "c", "d"], [1] * 4),
                         1e-3, 1e-3, 1e-2)
    assert not nan.passed and "token 2" in nan.detail and nan.max_abs == math.inf
    unforced = compare_forced(REF, _tokens("c", ["a", "z", "c", "d"], [-0.5, -0.2, -0.9, -0.1], ["a", "z", "c", "d"], [1] * 4),
                              1e-3, 1e-3, 1e-2)
    assert not unforced.passed and "did not return the forced tokens" in unforced.detail


def test_segments_cut_the_window_by_arrival_and_every_request_is_in_one():
    reqs = draw(CFG, "cpu", random.Random(3))
    cut = segments(reqs, CFG.served.cpu.window_s, 4)
    assert sorted(r.index for seg in cut for r in seg) == [r.index for r in reqs]
    assert all(0 <= r.arrival_s < CFG.served.cpu.window_s / 4 + 1e-9 for seg in cut for r in seg)



def test_the_candidates_warm_pass_serves_the_scored_requests_shapes_and_none_of_their_prompts():
    """A server that had served another draw of the trace's lengths ran the scored requests 10% slower than one that
    had served them (an A/A on an H100, 2026-12-05): the warm pass sends twins of the scored requests, segment by
    segment the same arrivals, prompt and output lengths, with fresh token ids."""
    class Recorder:                   # the servers' side of `send`: what each label was sent, segment by segment
        def __init__(self):
            self.sent = []

        def send(self, label, requests, burst=False):
            self.sent.append((label, burst, list(requests)))

    scored = draw(CFG, "cpu", random.Random(11))
    servers = Recorder()
    warm_pass(CFG, "cpu", servers, ("candidate",), scored)
    shape = lambda seg: [(r.index, r.arrival_s, len(r.prompt), r.output_len) for r in seg]      # noqa: E731
    expected = segments(scored, CFG.served.cpu.window_s, CFG.stages.replay.segments)
    assert len(expected) >= 2 and len({len(r.prompt) for r in scored}) >= 3
    assert [(label, shape(seg)) for label, _, seg in servers.sent] == [("candidate", shape(seg)) for seg in expected]
    assert all(burst == (CFG.stages.replay.load == "burst") for _, burst, _ in servers.sent)
    prompts = {tuple(r.prompt) for r in scored}
    assert not any(tuple(r.prompt) in prompts or r.forced for _, _, seg in servers.sent for r in seg)

def test_replay_stage_on_a_cpu_runs_the_gates_and_times_nothing():
    ctx = EvalContext(cfg=GATES_ALONE, target=TARGET, shapes=CFG.targets.attention.cpu, device=torch.device("cpu"),
                      dtype=torch.float32, pool=None, source=C.recent_window(8))
    with pytest.raises(Rejected, match="the served tokens differ from the reference's"):
        replay_stage(ctx)


def test_an_external_server_command_replays_the_requests_with_the_candidate_it_is_given():
    command = [sys.executable, str(ROOT / "tests" / "served_external.py"), "{port}"]
    cfg = config_with(**{"served.external": {"command": command, "model": "kevo-tiny", "start_timeout_s": 120,
                                             "env_passthrough": []}})
    with Servers(cfg, "cpu", {"candidate": C.REF_DECODE}, 0) as servers:
        requests = draw(cfg, "cpu", random.Random(0))
        run = send(cfg, servers.handles["candidate"], requests, "candidate")
        stats = servers.handles["candidate"].stats()
    assert run.failures() == [] and len(run.completions) == len(requests)
    assert stats["ops"]["decode"]["candidate"] == stats["ops"]["decode"]["calls"] > 0     # $KEVO_CANDIDATE reached it
