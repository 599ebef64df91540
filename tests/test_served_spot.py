"""The served process's spot checks (harness/served/spot.py): a secret share of a candidate's served calls, one
sequence each, held to parity's tolerance against the float64 reference, judged by the replay."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import candidates as C
from conftest import config_with
from harness.served.spot import SpotChecks
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
    layers share: parity never sends that, and those rows reach no logit."""
    assert evaluate_source(UNSEEN_ROWS, until="parity").ok
    unchecked = run_gates(config_with(**{"served.spot_share": 0.0}), "cpu", UNSEEN_ROWS)
    assert unchecked.gate.passed and unchecked.metrics["served_prefill_spot_checked"] == 0, unchecked.reason
    with pytest.raises(Rejected) as e:
        run_gates(config_with(**{"served.spot_share": 1.0}), "cpu", UNSEEN_ROWS)
    words = str(e.value)
    assert words.startswith("prefill in the candidate's served process: ") and "float64 reference" in words, words
    assert "(the last among them): max abs error" in words, words


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
