"""The served process's spot checks (harness/served/spot.py): a secret share of a candidate's served calls, one
sequence each, held to parity's tolerance against the float64 reference, judged by the replay; decode calls
replayed from CUDA graphs too (on the CPU through the stand-in for graphs, tests/fakes/cuda_graphs.py; on the GPU,
tests/test_served_gpu.py)."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import candidates as C
from conftest import config_with
from fakes.cuda_graphs import EagerGraphs
from harness.served.engine import make_engine, run_requests, warm_up
from harness.served.graphs import DecodeGraphs
from harness.served.limits import GraphPlan
from harness.served.ops import AttentionOps
from harness.served.spot import SpotChecks
from harness.served.traces import TraceRequest
from harness.stages.common import Rejected
from harness.stages.replay import run_gates
from harness.targets import TARGETS
from harness.targets.base import Case

ATTENTION = TARGETS["attention"]
CPU = torch.device("cpu")
UNSEEN_ROWS = C.wrap(C.REF_PREFILL, "prefill",
                     (Path(__file__).resolve().parent / "adversarial" / "unseen_rows_body.py").read_text())


def test_a_prefill_wrong_only_in_rows_no_gate_sees_passes_parity_and_the_gates_and_is_caught_by_spot_checks(
        evaluate_source):
    """It corrupts the last layer's rows but each sequence's last, and only where the calls share what a served step's
    layers share: those rows reach no logit, and parity sends that only in its checks of a step's next layer (off
    here: tests/test_parity_twins.py shows them catching it)."""
    assert evaluate_source(UNSEEN_ROWS, until="parity", config=config_with(**{"stages.parity.layers": 0.0})).ok
    unchecked = run_gates(config_with(**{"served.spot_share": 0.0}), "cpu", UNSEEN_ROWS)
    assert unchecked.gate.passed and unchecked.metrics["served_prefill_spot_checked"] == 0, unchecked.reason
    with pytest.raises(Rejected) as e:
        run_gates(config_with(**{"served.spot_share": 1.0}), "cpu", UNSEEN_ROWS)
    words = str(e.value)
    assert words.startswith("prefill in the candidate's served process: ") and "float64 reference" in words, words
    assert "(the last among them): max abs error" in words, words
    assert e.value.failure == "wrong_output"                        # the search never builds on it (agent/run/state.py)


def _call(op: str, seed: int):
    """A served-looking call: inputs drawn as parity draws them, and the host lengths the engine would hold."""
    params = {"q_heads": 4, "kv_heads": 2, "head_dim": 16, "block_size": 4, "batch": 3, "length_range": (1, 30)}
    x = ATTENTION.ops[op].make_inputs(Case(op, op, params), "normal", seed, CPU, torch.float32)
    lens = x["seq_lens"].tolist() if op == "decode" else torch.diff(x["cu_seqlens"]).tolist()
    return tuple(x[name] for name in ATTENTION.ops[op].arg_names), lens


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_spot_checks_pass_an_honest_output_and_fail_one_wrong_in_a_row_they_drew(op):
    spot = SpotChecks(ATTENTION, 1.0, 2.0, (1e-4, 2e-5))
    fn = ATTENTION.ops[op].baseline
    for seed in range(8):
        args, lens = _call(op, seed)
        spot.after(op, spot.before(op, args, lens), fn(*args))
    honest = spot.results()[op]
    assert (honest["spot_checked"], honest["spot_failed"], honest["spot_first"]) == (8, 0, ""), honest
    assert 0.0 < honest["spot_worst"] <= 1.0, honest
    for seed in range(8, 12):
        args, lens = _call(op, seed)
        pending = spot.before(op, args, lens)
        out = fn(*args)
        rows = pending.rows if op == "decode" else pending.rows[random.Random(seed).randrange(len(pending.rows))]
        out[rows] += 0.01                   # decode: the drawn sequence; prefill: one of the drawn rows
        spot.after(op, pending, out)
    failed = spot.results()[op]
    assert (failed["spot_checked"], failed["spot_failed"]) == (12, 4) and failed["spot_first"], failed


def test_a_spot_check_reads_the_inputs_as_they_were_before_the_call():
    """A kernel that writes the sequence's keys after answering cannot make the reference agree with it."""
    spot = SpotChecks(ATTENTION, 1.0, 2.0, (1e-4, 2e-5))
    args, lens = _call("decode", 3)
    pending = spot.before("decode", args, lens)
    out = ATTENTION.ops["decode"].baseline(*args)
    args[1].fill_(0.0)                                                   # the cache, changed after the call
    spot.after("decode", pending, out)
    assert spot.results()["decode"]["spot_failed"] == 0


def test_prefill_checks_reach_every_row_of_a_sequence_over_their_draws_and_always_its_last():
    spot = SpotChecks(ATTENTION, 1.0, 2.0, (1e-4, 2e-5))
    q, k, v = torch.randn(105, 4, 16), torch.randn(105, 2, 16), torch.randn(105, 2, 16)
    args = (q, k, v, torch.tensor([0, 3, 103, 105], dtype=torch.int32), 100, 0.25)
    seen = set()
    for _ in range(300):
        rows = spot.before("prefill", args, [3, 100, 2]).rows.tolist()     # the check draws one of the three
        if len(rows) > 3:
            assert len(rows) == 17 and rows[-1] == 102 and all(3 <= r <= 102 for r in rows), rows
            seen.update(rows)
    assert seen == set(range(3, 103))


def test_the_checks_kept_are_bounded_and_sampled_from_the_whole_window():
    spot = SpotChecks(ATTENTION, 1.0, 2.0, (1e-4, 2e-5), keep=5)
    fn = ATTENTION.ops["decode"].baseline
    args, lens = _call("decode", 0)
    for call in range(60):
        pending = spot.before("decode", args, lens)
        pending.kept.what = str(call)
        spot.after("decode", pending, fn(*args))
    kept = [int(k.what) for k in spot.kept["decode"]]
    assert len(kept) == 5 and spot.made["decode"] == 60 and max(kept) >= 5, kept
    assert spot.results()["decode"]["spot_checked"] == 5


def _served_from_graphs(decode) -> tuple[dict, DecodeGraphs]:
    """The tiny preset serving 6 requests that arrive at once, its decode steps from (stand-in) CUDA graphs, every
    candidate call drawn for a check. `decode(graphs, *args)`: the candidate's decode, told the stand-in (whether it
    is capturing or replaying). After the one prefill step every step is decode-only, so every served decode call is
    a replay's."""
    cfg = config_with()
    parity = cfg.stages.parity
    spot = SpotChecks(ATTENTION, 1.0, parity.tolerance_factor, (parity.floors["float32"].max_abs, parity.floors["float32"].rel_l2))
    box = {}
    ops = AttentionOps(SimpleNamespace(decode=lambda *args: decode(box["graphs"], *args)), spot=spot)
    e = make_engine(cfg.served.presets["tiny"], cfg.targets.attention.cpu.block_size, torch.float32, CPU, ops,
                    init=cfg.served.random_init, top_k=cfg.served.logprobs)
    box["graphs"] = EagerGraphs(ops)
    e.graphs = DecodeGraphs(e, GraphPlan(True, tuple(cfg.served.cuda_graphs.batch_buckets), 1, 64), box["graphs"])
    warm_up(e)
    ops.audit_all = False                     # serving from here, as the server does after its warm-up
    vocab = cfg.served.presets["tiny"].vocab
    run_requests(e, [TraceRequest(i, 0.0, [(11 * i + 3 * j + 1) % vocab for j in range(6 + 5 * i)], 6 + i) for i in range(6)],
                 realtime=False)
    return spot.results()["decode"], e.graphs


def test_decode_calls_replayed_from_cuda_graphs_are_spot_checked_on_what_the_replay_wrote():
    """An honest decode passes every check of a replay; one that launches something else only under capture (what
    replays then run) is caught there, and the failure says so. Eager calls of the same kernel are right."""
    base = ATTENTION.ops["decode"].baseline
    honest, graphs = _served_from_graphs(lambda g, *args: base(*args))
    assert graphs.on and graphs.replays >= 8 and graphs.eager_decode_steps == 0, graphs.stats()
    layers = config_with().served.presets["tiny"].layers
    assert honest["spot_failed"] == 0 and honest["spot_checked"] == honest["spot_replayed"] == layers * graphs.replays, honest
    wrong, graphs = _served_from_graphs(lambda g, *args: base(*args) * (1.01 if g.inside else 1.0))
    assert wrong["spot_failed"] == wrong["spot_checked"] == wrong["spot_replayed"] == layers * graphs.replays, wrong
    assert ", replayed from the CUDA graph of batch " in wrong["spot_first"], wrong["spot_first"]


def test_a_decode_that_hands_every_captured_call_one_buffer_is_named_so_by_the_checks_of_its_replays():
    """Serving reads each layer's output before the next layer runs, so one buffer gives the right tokens; the checks
    read each layer's after the step and see the last layer's. The contract says the output is the caller's."""
    base, buffers = ATTENTION.ops["decode"].baseline, {}

    def decode(g, *args):
        out = base(*args)
        if not g.inside:
            return out
        mine = buffers.setdefault(tuple(out.shape), torch.empty_like(out))
        return mine.copy_(out)

    reused, graphs = _served_from_graphs(decode)
    assert reused["spot_failed"] > 0 and graphs.replays >= 8, reused
    assert "(its output lies in the allocation of another call's of the step)" in reused["spot_first"], reused["spot_first"]
