"""The clock check's own rules (harness/stages/clock_check.py): a disagreement between two clocks is measured
again before a kernel is named by it, and only that; the graph call whose output is checked is drawn, round and
call, and read as its burst returns. What it measures on a GPU is in tests/test_gpu.py."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from conftest import config_with
from harness.stages import clock_check as cc
from harness.stages import microbench as mb
from harness.stages.common import Rejected
from harness.targets import configured

RATIO = config_with().stages.microbench.clock_check_ratio


def test_the_checks_between_two_clocks_reject_as_a_disagreement_the_others_do_not():
    with pytest.raises(cc.Disagreement):
        cc.check_clock("c", 0.1086, 0.1557, RATIO)      # events far under the clock (figures of run h200-r23's c022)
    with pytest.raises(Rejected) as err:
        mb.check_floor("c", 0.001, 0.01, "events")
    assert not isinstance(err.value, cc.Disagreement)


def test_the_baseline_counts_at_the_lower_of_the_workers_and_the_evaluators_own_timing():
    assert mb.trusted_baseline("c", 0.4741, 0.2197) == 0.2197     # run s62's c005 at batch 4: no rejection
    assert mb.trusted_baseline("c", 0.2600, 0.2109) == 0.2109     # 23% slower in the worker: what an input the candidate
    assert mb.trusted_baseline("c", 0.2200, 0.2109) == 0.2109     # widened in place gives it; any slower gains nothing
    assert mb.trusted_baseline("c", 0.1000, 0.2109) == 0.1000     # faster: it can only lower the speedup


def test_the_workers_baseline_is_held_to_the_evaluators_on_every_input_set_so_slowing_the_second_alone_gains_nothing():
    # a timing reply's event times, rep by rep and set by set (two sets): the second set's baseline slowed 2x
    streamed = {"baseline:1": [0.20, 0.44, 0.21, 0.46, 0.20, 0.45], "baseline:2": [0.21, 0.45, 0.20, 0.44, 0.21, 0.46]}
    there = mb.worker_baselines(streamed, 2)
    assert there == [pytest.approx(0.205), pytest.approx(0.45)]
    assert mb.counted_baselines("c", there, [0.207, 0.225]) == [there[0], 0.225]


class _Tries:
    """A measurement that disagrees on its first `disagree` calls, then returns the number of its call."""

    def __init__(self, disagree: int, then: Exception | None = None) -> None:
        self.calls, self.disagree, self.then = 0, disagree, then

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.disagree:
            raise cc.Disagreement(f"try {self.calls}: the clocks disagree", candidate_ms=0.1)
        if self.then is not None:
            raise self.then
        return self.calls


def test_a_disagreement_is_measured_again_and_the_first_try_that_agrees_counts():
    measure = _Tries(disagree=2)
    got, met = cc.agreeing(measure, 3)
    assert (got, measure.calls) == (3, 3)
    assert met == ["try 1: the clocks disagree", "try 2: the clocks disagree"]
    assert cc.agreeing(_Tries(disagree=0), 3) == (1, [])


def test_clocks_that_disagree_on_every_try_reject_saying_how_often_they_were_measured():
    measure = _Tries(disagree=10)
    with pytest.raises(cc.Disagreement, match=r"try 3: the clocks disagree \(measured 3 times, each disagreed\)") as err:
        cc.agreeing(measure, 3)
    assert measure.calls == 3
    assert err.value.metrics == {"candidate_ms": 0.1, "timing_tries": 3.0}
    with pytest.raises(cc.Disagreement, match=r"^try 1: the clocks disagree$"):
        cc.agreeing(_Tries(disagree=10), 1)


def test_any_other_rejection_is_not_measured_again():
    measure = _Tries(disagree=1, then=Rejected("a timed call wrote a wrong output"))
    with pytest.raises(Rejected, match="wrong output") as err:
        cc.agreeing(measure, 3)
    assert measure.calls == 2 and not isinstance(err.value, cc.Disagreement)


def test_the_clock_check_draws_the_round_whose_graph_call_it_checks_and_checks_it_there():
    """Which round's longer burst has one of its graph calls checked is drawn per clock check, and the output is
    read as that burst returns: a graph that does its work only in the last round is no longer clocked fast."""
    cfg = config_with(**{"stages.microbench.clock_check_rest_s": 0, "targets.attention.decode_baseline": "masked"})
    rounds = cfg.stages.microbench.clock_check_rounds

    class Unreadable:
        def model_dump(self):
            raise ValueError("the fake worker's output cannot be read")

    def request(msg, what, kind):
        sent.append(msg)
        longer = kind == "burst" and len(sent) % 2 == 1      # after the prepare, each round's n calls then 2n
        time.sleep(msg["n"] * 2e-3 if longer else 0)      # so 2n is longer than n even on a loaded machine
        return SimpleNamespace(ok=True, graph=True, error="", get=lambda key, default=None: default,
                               outputs=[Unreadable()], arenas=[], release=lambda: None)

    ctx = SimpleNamespace(cfg=cfg, target=configured("attention", cfg), request=request, device=torch.device("cpu"),
                          dtype=torch.float32)
    trial = SimpleNamespace(inputs={"q": torch.zeros(1, 1, 1)}, ref=torch.zeros(1), tol=None)
    checked = set()
    for _ in range(30):
        sent = []
        with pytest.raises(Rejected, match="the output of the candidate's clock check"):
            cc.burst_ms(ctx, "decode", "candidate", per_call_ms=1.0, check=trial)
        prepare, *bursts = sent
        assert "check" in bursts[-1] and all("check" not in b for b in bursts[:-1])
        assert len(bursts) % 2 == 0 and bursts[-1]["n"] == 2 * bursts[-2]["n"]      # a round's longer burst
        checked.add(len(bursts) // 2 - 1)
    assert checked <= set(range(rounds)) and len(checked) > 1, checked
