"""The policy config.yaml holds for the evaluator and the served scenario (issue 20): a bad value of each key is
one line naming it, and the value configured is the one used where it applies (the decode baseline, the
plumbing ops, the clock check's calls per graph, the served logprobs, stall_ms, the random weights' gains,
the profiler's cycle). The microbench's trusted_baseline_reps is timed on CUDA only (tests/test_gpu.py)."""
from __future__ import annotations

import time
import math
import typing
from types import SimpleNamespace

import pytest
import torch

import candidates as C
from conftest import config_with
from harness.config import AttentionConfig, ConfigError, load_config
from harness.profile import profile_served
from harness.served.engine import make_engine, run_requests
from harness.served.launch import embedded_spec
from harness.served.model import random_weights
from harness.probes import Probes
from harness.served.ops import AttentionOps
from harness.served.traces import TraceRequest
from harness.stages.clock_check import burst_ms
from harness.targets import TARGETS, configured
from harness.targets.attention_baselines import DECODE_BASELINES, decode_clamped, decode_masked
from test_config import edited, write

CFG = config_with()
TINY = CFG.served.presets["tiny"]
CPU = torch.device("cpu")


@pytest.mark.parametrize("old, new, words", [
    ("plumbing_ops: [empty,", "plumbing_ops: [mm, empty,",
     "stages.dispatch: plumbing_ops: 'mm' is a forbidden op (forbidden_ops); it cannot also be free"),
    ("plumbing_ops: [empty,", "plumbing_ops: ['aten::empty', empty,", "plumbing_ops: 'aten::empty' is not an aten op name"),
    ("trusted_baseline_reps: 20", "trusted_baseline_reps: 2",
     "stages.microbench.trusted_baseline_reps: Input should be greater than or equal to 5"),
    ("calls_per_graph: 10", "calls_per_graph: 0", "stages.microbench.calls_per_graph: Input should be greater than or equal to 1"),
    ("decode_baseline: clamped", "decode_baseline: fastest",
     "targets.attention.decode_baseline: Input should be 'masked', 'clamped' or 'per_sequence'"),
    ("\n  logprobs: 2\n", "\n  logprobs: 1\n", "served.logprobs: Input should be greater than or equal to 2"),
    ("stall_ms: 50", "stall_ms: 0", "served.stall_ms: Input should be greater than 0"),
    ("query_gain: 2.0", "query_gain: -1", "served.random_init.query_gain: Input should be greater than 0"),
    ("random_init: {logit_std: 6.0, ", "random_init: {", "served.random_init.logit_std: missing key"),
    ("cuda: {wait: 20, warmup: 1, active: 2}", "cuda: {wait: 20, warmup: 1, active: 0}",
     "served.profile_cycle.cuda.active: Input should be greater than or equal to 1"),
    ("cuda: {wait: 20, warmup: 1, active: 2}, cpu: null}", "cuda: {wait: 20, warmup: 1, active: 2}, cpu: {wait: 1}}",
     "served.profile_cycle.cpu.warmup: missing key"),
])
def test_a_bad_policy_value_is_one_line_naming_its_key(tmp_path, old, new, words):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, edited(old, new)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_config_offers_exactly_the_decode_baselines_the_target_has():
    assert set(typing.get_args(AttentionConfig.model_fields["decode_baseline"].annotation)) == set(DECODE_BASELINES)


def test_the_decode_baseline_the_config_names_is_the_one_judged_against_and_served(tmp_path):
    cfg = config_with(**{"targets.attention.decode_baseline": "masked"})
    decode = configured("attention", cfg).ops["decode"]
    assert decode.baseline is decode_masked and decode.baseline_name == "masked"
    assert configured("attention", CFG).ops["decode"].baseline is decode_clamped
    assert TARGETS["attention"].ops["decode"].baseline is decode_clamped      # the registry's own is left as it was
    spec = embedded_spec(cfg, "cpu", None, tmp_path)                          # what the served process is told
    assert TARGETS["attention"].configured(spec["baselines"]).ops["decode"].baseline is decode_masked
    with pytest.raises(ValueError, match="decode has no baseline 'fastest'; it has masked, clamped, per_sequence"):
        decode.with_baseline("fastest")


def test_the_clock_check_captures_and_bursts_in_the_configured_calls_per_graph():
    cfg = config_with(**{"stages.microbench.calls_per_graph": 7, "targets.attention.decode_baseline": "masked"})
    sent: list[dict] = []

    def request(msg, what, kind):
        sent.append(msg)
        time.sleep(msg.get("n", 0) * 5e-3)  # a fake worker whose calls take 5 ms each: 2n clearly longer than n, however loaded
        return SimpleNamespace(ok=True, graph=True, error="", get=lambda key, default=None: default)

    ctx = SimpleNamespace(cfg=cfg, target=configured("attention", cfg), request=request)
    burst_ms(ctx, "decode", "baseline", per_call_ms=1.0)
    prepare, *bursts = sent
    assert prepare["prepare"] and prepare["per_graph"] == 7 and prepare["baseline"] == "masked"
    assert len(bursts) == 2 * cfg.stages.microbench.clock_check_rounds
    assert all(b["n"] % 7 == 0 and b["baseline"] == "masked" for b in bursts)


def test_plumbing_ops_are_what_dispatch_counts_as_free(evaluate_source):
    source = C.REF_DECODE               # a loose torch-work bound, so the audit counts the ops without rejecting them
    loose = {"stages.dispatch.aux_work_fraction": 1.0}
    free = evaluate_source(source, until="dispatch", config=config_with(**loose))
    allocation = {"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "full", "full_like"}
    fewer = [op for op in CFG.stages.dispatch.plumbing_ops if op not in allocation]   # the interpreter's copies stay free
    counted = evaluate_source(source, until="dispatch", config=config_with(**loose, **{"stages.dispatch.plumbing_ops": fewer}))
    assert free.ok and counted.ok, (free.reason, counted.reason)
    key = "decode_torch_compute_elements"
    assert counted.stages[1].metrics[key] > free.stages[1].metrics[key], (counted.stages[1].metrics, free.stages[1].metrics)


def _decode_call(ops: AttentionOps) -> None:
    q, kv = torch.zeros(1, 4, 16), torch.zeros(2, 4, 2, 16)
    ops.decode(q, kv, kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.25, lens=[1])


def test_a_candidate_call_is_a_stall_over_stall_ms_and_not_under_it(tmp_path):
    candidate = SimpleNamespace(decode=lambda q, *rest: torch.zeros_like(q))
    every, never = AttentionOps(candidate, stall_ms=0.0), AttentionOps(candidate, stall_ms=math.inf)
    for ops in (every, never):
        _decode_call(ops)
    assert every.stats()["decode"]["stalls"] == 1 and never.stats()["decode"]["stalls"] == 0
    assert embedded_spec(config_with(**{"served.stall_ms": 7.5}), "cpu", None, tmp_path)["stall_ms"] == 7.5


def test_served_calls_are_audited_all_through_the_warm_up_and_at_the_configured_share_after():
    """AttentionOps in a served process: every candidate call's launches counted; its aten ops audited on every call
    until serving begins (`audit_all`), then on `audit_share` of the calls (0 and 1 here, so the count is exact)."""
    candidate = SimpleNamespace(decode=lambda q, *rest: (q * 2.0).clone())      # torch work, no Triton launch
    ops = AttentionOps(candidate, probes=Probes(), audit_share=0.0)
    for _ in range(3):
        _decode_call(ops)
    ops.audit_all = False
    for share, calls in ((0.0, 5), (1.0, 4)):
        ops.audit_share = share
        for _ in range(calls):
            _decode_call(ops)
    books = ops.stats()["decode"]
    assert (books["audited"], books["no_launch"], books["op_calls"]["mul"]) == (7, 12, 7), books
    assert books["audit_madds"] == 7 * 2.0 * 1 * 4 * 16 and books["op_elements"]["mul"] == 7 * 64, books


def test_the_random_weights_take_the_configured_gains(tmp_path):
    init = CFG.served.random_init
    base = random_weights(TINY, torch.float32, CPU, init)
    sharp = random_weights(TINY, torch.float32, CPU, init.model_copy(update={"logit_std": 2 * init.logit_std, "query_gain": 3.0}))
    wide = random_weights(TINY, torch.float32, CPU, init.model_copy(update={"embed_per_output_gain": init.embed_per_output_gain / 2}))
    assert torch.allclose(sharp["model.embed_tokens.weight"], 2 * base["model.embed_tokens.weight"])
    assert torch.all(sharp["model.layers.0.self_attn.q_norm.weight"] == 3.0)
    assert torch.all(base["model.layers.0.self_attn.q_norm.weight"] == init.query_gain)
    # TINY's output gain is over 1 (embedding std 6/8 over 0.19): halving embed_per_output_gain doubles it
    assert torch.allclose(wide["model.layers.0.self_attn.o_proj.weight"], 2 * base["model.layers.0.self_attn.o_proj.weight"])
    cfg = config_with(**{"served.random_init.query_gain": 3.0})
    assert embedded_spec(cfg, "cpu", None, tmp_path)["random_init"]["query_gain"] == 3.0


def test_the_engine_reports_as_many_top_logprobs_as_it_is_configured_to(tmp_path):
    engine = make_engine(TINY, CFG.targets.attention.cpu.block_size, torch.float32, CPU, AttentionOps(),
                         init=CFG.served.random_init, top_k=3)
    events = run_requests(engine, [TraceRequest(0, 0.0, [3, 1, 4], 4)], realtime=False)[0]
    assert len(events) == 4 and all(len(ev.top) == 3 for ev in events)
    assert embedded_spec(config_with(**{"served.logprobs": 4}), "cpu", None, tmp_path)["logprobs"] == 4


def test_the_served_profile_records_the_configured_cycle():
    cycle = config_with(**{"served.profile_cycle.cpu": {"wait": 1, "warmup": 1, "active": 1}})
    report = profile_served(cycle, "attention", device=CPU, window_s=1.0)
    assert 0 < report["steps_profiled"] < report["steps"], (report["steps_profiled"], report["steps"])
