"""Stage 5 on the CPU (tiny preset, Triton's interpreter, float32): the project's reference kernels pass
the correctness gates; a kernel that drops the newest token fails them; a candidate whose shapes
fall back, or whose server crashes, is not accepted; only a faster candidate beyond noise is; and
the stage itself says it needs CUDA instead of scoring a CPU run."""
from __future__ import annotations

import math
import sys
import time

import pytest
import torch

import candidates as C
from conftest import CUDA, ROOT, config_with
from harness.records import Verdict
from harness.served.client import Completion, ReplayRun
from harness.served.launch import ServerFailure
from harness.served.score import compare
from harness.stages.common import EvalContext, Rejected
from harness.stages.replay import judge, replay_once, replay_stage, run_replay, served_requests
from harness.targets.attention import TARGET

CFG = config_with()


@pytest.fixture(scope="module")
def requests():
    return served_requests(CFG, "cpu")


@pytest.fixture(scope="module")
def baselines(requests):
    return replay_once(CFG, "cpu", None, requests, "baseline")[0], replay_once(CFG, "cpu", None, requests, "baseline again")[0]


@pytest.mark.parametrize("source, own, other", [(C.REF_DECODE, "decode", "prefill"), (C.REF_PREFILL, "prefill", "decode")],
                         ids=["decode", "prefill"])
def test_reference_kernel_passes_the_gates_on_the_served_path(requests, baselines, source, own, other):
    cand, stats = replay_once(CFG, "cpu", source, requests, "candidate")
    assert stats["ops"][own]["candidate"] == stats["ops"][own]["calls"] > 0
    outcome = judge(CFG, "float32", baselines[0], cand, baselines[1], stats)
    assert outcome.gate.passed, outcome.reason
    assert outcome.metrics["gate_tokens_compared"] >= 0.8 * sum(r.output_len for r in requests)
    assert outcome.metrics["fallback_share"] == 0.0
    assert f"{other} not implemented" in outcome.reason and "the served tokens differ" not in outcome.reason


def test_the_replay_records_how_long_each_server_took_to_start_and_warm_up(requests, baselines):
    t = time.monotonic()
    cand, stats = replay_once(CFG, "cpu", C.REF_DECODE, requests, "candidate")
    wall = time.monotonic() - t
    assert 0 < cand.server_ready_s < wall - cand.duration_s          # ready before the first request was sent
    metrics = judge(CFG, "float32", baselines[0], cand, baselines[1], stats).metrics
    assert metrics["candidate_server_ready_s"] == cand.server_ready_s
    assert metrics["baseline_server_ready_s"] > 0 and metrics["baseline_again_server_ready_s"] > 0


def test_kernel_that_drops_the_newest_token_fails_the_gates():
    outcome = run_replay(CFG, "cpu", C.DROPS_NEWEST_TOKEN)           # the stage's own path: baseline, candidate, baseline
    assert not outcome.gate.passed and not outcome.accepted
    assert outcome.reason.startswith("the served tokens differ from the baseline's: request ")
    with pytest.raises(Rejected) as err:
        outcome.stage_result()
    assert err.value.metrics["accepted"] == 0.0 and err.value.metrics["gate_passed"] == 0.0


SOMETIMES_DECLINES = C.REF_DECODE + """

def supports(op, **shape):
    return shape["max_seq_len"] <= 12
"""


def test_candidate_whose_served_shapes_fall_back_is_not_accepted(requests, baselines):
    cand, stats = replay_once(CFG, "cpu", SOMETIMES_DECLINES, requests, "candidate")
    outcome = judge(CFG, "float32", baselines[0], cand, baselines[1], stats)
    assert outcome.gate.passed and not outcome.accepted
    assert 0 < outcome.metrics["fallback_share"] < 1 and "calls fell back" in outcome.reason


@pytest.fixture(scope="module")
def warm_calls(requests) -> int:
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
                         torch.device("cpu"), AttentionOps(SimpleNamespace(decode=decode)))
    warm_up(engine, [len(r.prompt) for r in requests], served.warm_requests)
    return calls[0]


def test_candidate_that_crashes_its_server_is_a_failure_saying_how(requests, warm_calls):
    crashes_when_serving = C.wrap_decode(f"""
_calls = [0]

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    _calls[0] += 1
    if _calls[0] > {warm_calls + 4}:      # past the warm-up: while serving the trace
        __import__("ctypes").string_at(0)
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")
    with pytest.raises(ServerFailure) as err:
        replay_once(CFG, "cpu", crashes_when_serving, requests, "candidate")
    assert "the server killed by signal 11 (SIGSEGV) during the replay" in str(err.value)
    assert "requests did not complete" in str(err.value)


def test_a_candidate_call_that_holds_the_host_in_the_window_is_named_in_the_verdict(requests, baselines, warm_calls):
    # torch's decode, fast on the tiny model; one call past the warm-up sleeps as a compile would
    stalls_once = f"""
import time
from harness.targets.attention import decode_baseline
_calls = [0]

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    _calls[0] += 1
    if _calls[0] == {warm_calls + 3}:
        time.sleep(0.4)
    return decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
"""
    cand, stats = replay_once(CFG, "cpu", stalls_once, requests, "candidate")
    assert stats["ops"]["decode"]["stalls"] >= 1 and stats["ops"]["decode"]["worst_stall_ms"] >= 400
    outcome = judge(CFG, "float32", baselines[0], cand, baselines[1], stats)
    assert outcome.metrics["candidate_stalls"] >= 1 and outcome.metrics["candidate_stall_ms"] >= 400
    assert "held the host over 50 ms in the window" in outcome.reason


def _run(label: str, ttft_ms: list[float], tpot_ms: list[float], tokens: int = 5) -> ReplayRun:
    comps = []
    for i, (ttft, tpot) in enumerate(zip(ttft_ms, tpot_ms)):
        times = [(i + ttft / 1e3) + k * tpot / 1e3 for k in range(tokens)]
        comps.append(Completion(i, float(i), tokens, sent_s=float(i), token_times=times, tokens=[f"t{k}" for k in range(tokens)],
                                logprobs=[-0.1] * tokens, top=[[(f"t{k}", -0.1), ("x", -3.0)] for k in range(tokens)]))
    return ReplayRun(label, comps, duration_s=len(ttft_ms) + 1.0, max_send_lag_s=0.0)


ALL_CANDIDATE = {"ops": {"decode": {"calls": 10, "candidate": 10, "unsupported": 0, "not_implemented": 0, "implemented": True},
                         "prefill": {"calls": 4, "candidate": 0, "unsupported": 0, "not_implemented": 4, "implemented": False}}}


def test_only_a_candidate_faster_beyond_noise_is_accepted():
    ttft, tpot = [10.0 + i for i in range(20)], [20.0 + (7 * i) % 10 for i in range(20)]
    base, again = _run("baseline", ttft, tpot), _run("baseline again", ttft[::-1], tpot[::-1])
    fast = _run("candidate", [t * 0.7 for t in ttft], [t * 0.7 for t in tpot])
    faster = judge(CFG, "float32", base, fast, again, ALL_CANDIDATE)
    assert faster.accepted and faster.metrics["accepted"] == 1.0 and faster.metrics["tpot_p90_speedup"] > 1.4
    assert faster.metrics["slo_score"] > 1.3 * faster.metrics["slo_score_baseline"]
    assert faster.metrics["attainment"] == 1.0 and faster.metrics["attainment_baseline"] < 0.9
    assert Verdict.of([faster.stage_result()]).accepted
    same = judge(CFG, "float32", base, _run("candidate", ttft, tpot), again, ALL_CANDIDATE)
    assert not same.accepted and "not better than the baseline beyond noise" in same.reason
    with pytest.raises(Rejected):
        same.stage_result()
    unaccounted = judge(CFG, "float32", base, fast, again, None)
    assert not unaccounted.accepted and "reports no fallback accounting" in unaccounted.reason
    eager = judge(CFG, "float32", base, fast, again, ALL_CANDIDATE | {"graphs": {
        "on": False, "fell_back": True, "reason": "off: capturing the decode step at batch 4, width 8 failed (...)"}})
    assert eager.accepted and eager.metrics["candidate_cuda_graphs"] == 0.0      # said, not held against it
    assert "the candidate's server decoded eagerly: CUDA graphs off: capturing the decode step at batch 4" in eager.reason
    assert "decoded eagerly" not in faster.reason


def test_a_baseline_two_percent_slower_moves_the_score_two_percent_where_attainment_collapses():
    # Requests batched together share step times, so their TPOTs bunch just under the first baseline's p90.
    ttft, tpot = [200.0 + 5 * (i % 7) for i in range(40)], [30.0 + 0.1 * (i % 5) for i in range(40)]
    base, again = _run("baseline", ttft, tpot), _run("baseline again", [t * 1.02 for t in ttft], [t * 1.02 for t in tpot])
    faster = judge(CFG, "float32", base, _run("candidate", ttft, [t * 0.8 for t in tpot]), again, ALL_CANDIDATE)
    m = faster.metrics
    assert m["attainment_baseline_again"] == 0.0 and m["attainment_baseline"] >= 0.8      # the knife edge
    assert abs(m["noise"] - 0.02) < 1e-9 and faster.accepted
    assert abs(m["gain"] - ((1 / 0.8 * 1.02) ** 0.5 - 1)) < 1e-9     # TPOT 1.25x over a mean 1.01x slower baseline
    within_noise = judge(CFG, "float32", base, _run("candidate", ttft, [t * 0.995 for t in tpot]), again, ALL_CANDIDATE)
    assert not within_noise.accepted and "needs +2.0%" in within_noise.reason


def test_a_faster_decode_does_not_hide_a_ttft_far_over_its_bar():
    ttft, tpot = [200.0 + 5 * (i % 7) for i in range(40)], [30.0 + 0.1 * (i % 5) for i in range(40)]
    base, again = _run("baseline", ttft, tpot), _run("baseline again", ttft, tpot)
    slow_first = judge(CFG, "float32", base, _run("candidate", [t * 3 for t in ttft], [t * 0.5 for t in tpot]), again,
                       ALL_CANDIDATE)
    assert slow_first.metrics["tpot_p90_speedup"] > 1.9 and not slow_first.accepted
    assert slow_first.metrics["slo_score"] < slow_first.metrics["slo_score_baseline"]


def _tokens(label: str, tokens: list[str], lps: list[float], leads: list[float]) -> ReplayRun:
    top = [[(t, lp), ("runner-up", lp - lead)] for t, lp, lead in zip(tokens, lps, leads)]
    return ReplayRun(label, [Completion(0, 0.0, len(tokens), 0.0, list(range(len(tokens))), tokens, lps, top)], 1.0, 0.0)


def test_gates_tolerate_a_divergence_only_at_a_near_tie():
    base = _tokens("baseline", ["a", "b", "c", "d"], [-0.5, -0.2, -0.9, -0.1], [2.0, 0.004, 3.0, 1.0])
    at_tie = compare(base, _tokens("candidate", ["a", "x", "y", "z"], [-0.5, -0.21, -1.0, -1.0], [1, 1, 1, 1]), 1e-3, 1e-2)
    assert at_tie.passed and at_tie.near_ties == 1 and at_tie.compared == 1
    clear = compare(base, _tokens("candidate", ["a", "b", "y", "d"], [-0.5, -0.2, -1.0, -0.1], [1, 1, 1, 1]), 1e-3, 1e-2)
    assert not clear.passed and "request 1, token 3: chose y where the baseline chose c" in clear.detail
    drift = compare(base, _tokens("candidate", ["a", "b", "c", "d"], [-0.5, -0.2, -0.95, -0.1], [1, 1, 1, 1]), 1e-3, 1e-2)
    assert not drift.passed and "token 3: logprob -0.95000 where the baseline has -0.90000" in drift.detail
    assert math.isclose(drift.max_logprob_diff, 0.05)


@pytest.mark.skipif(CUDA, reason="checks the CPU-only behaviour of the replay stage")
def test_replay_stage_says_it_needs_cuda_instead_of_scoring_a_cpu_run():
    ctx = EvalContext(cfg=CFG, target=TARGET, shapes=CFG.targets.attention.cpu, device=torch.device("cpu"),
                      dtype=torch.float32, pool=None, source=C.REF_DECODE)
    result = replay_stage(ctx)
    assert result.status == "skipped" and "needs CUDA" in result.reason and result.metrics == {}


def test_an_external_server_command_replays_the_same_trace_with_the_candidate_it_is_given(requests):
    command = [sys.executable, str(ROOT / "tests" / "served_external.py"), "{port}"]
    cfg = config_with(**{"served.external": {"command": command, "model": "kevo-tiny", "start_timeout_s": 120,
                                             "env_passthrough": []}})
    run, stats = replay_once(cfg, "cpu", C.REF_DECODE, requests, "candidate")
    assert run.failures() == [] and len(run.completions) == len(requests)
    assert stats["ops"]["decode"]["candidate"] == stats["ops"]["decode"]["calls"] > 0     # $KEVO_CANDIDATE reached it
