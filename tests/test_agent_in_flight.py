"""Enough proposals in flight (agent.proposals_in_flight): with a slow LLM, a run has that many proposals
being written at once, never more, asked for and recorded in id order — in the loop's own pool and through an
executor's slot (agent/run/evaluators.py), one drive (agent/run/drive.py). Both runs take their head's verdict
from the verdict cache."""
from __future__ import annotations

import io
import threading

import pytest
from rich.console import Console

from candidates import REF_DECODE
from conftest import config_with
from fakes import scripts as S
from fakes.llm_server import FakeLLM, Step

from agent.run.loop import Run, settings_from
from agent.reading.view import RunView
from harness.verdicts import evaluate_cached

PLANNER, CODER = "fake-planner", "fake-coder"
IN_FLIGHT, CANDIDATES = 3, 6
# Refused by the compile stage before any worker runs it: each candidate costs the evaluator next to nothing.
CHEAP = S.code("import torch\n\n\ndef decode(q):\n    return q\n")


class SlowModel:
    """The LLM service's side of writing proposals: a proposal is being written from its planner call to the
    end of its coder call. The first IN_FLIGHT planner calls answer only once IN_FLIGHT proposals are being
    written together (a barrier that breaks, failing the test, if the run never has that many at once); the
    rest answer after a short real sleep."""

    def __init__(self) -> None:
        self.lock, self.calls, self.writing, self.most = threading.Lock(), 0, 0, 0
        self.together = threading.Barrier(IN_FLIGHT, timeout=30)

    def plan(self, body: dict) -> str:
        with self.lock:
            self.calls += 1
            first = self.calls <= IN_FLIGHT
            self.writing += 1
            self.most = max(self.most, self.writing)
        if first:
            self.together.wait()
        else:
            threading.Event().wait(0.2)
        return S.claim(1.3)

    def code(self, body: dict) -> str:
        with self.lock:
            self.writing -= 1
        return CHEAP


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pool):
    """A runs folder whose verdict cache holds the decode head's verdict: both runs start from it."""
    runs = tmp_path_factory.mktemp("runs")
    cfg = config_with(**BASE, **{"agent.runs_dir": str(runs)})
    evaluate_cached(REF_DECODE, "attention", cfg, pool, job="head-decode")
    return runs


BASE = {"agent.ops": ["decode"], "agent.compile_repair_rounds": 0, "agent.proposals_in_flight": IN_FLIGHT,
        "stages.parity.checks_per_shape": 1, "executor.verdict_cache": True, "executor.cpu_slots": 1}


def llm_config(fake: FakeLLM, runs):
    return config_with(**BASE, **{
            "agent.runs_dir": str(runs), "providers.openai.base_url": fake.openai_url, "providers.openai.planner_model": PLANNER,
            "providers.openai.coder_model": CODER, "providers.retry.initial_s": 0.01, "providers.retry.max_s": 0.05,
            f"providers.prices.{PLANNER}": {"input": 2.0, "output": 8.0},
            f"providers.prices.{CODER}": {"input": 1.0, "output": 4.0}})


def go(cfg, pool, run_id: str, n: int, slots: bool = False):
    settings = settings_from(cfg, pool.device, provider="openai", max_candidates=n, run_id=run_id)
    return Run(cfg, settings, RunView(console=Console(file=io.StringIO(), width=200)), slots=slots)(pool)


@pytest.mark.parametrize("slots", [False, True], ids=["pool", "slots"])
def test_a_slow_llm_has_the_configured_number_of_proposals_in_flight_and_never_more(pool, runs, monkeypatch, slots):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-in-flight")
    model = SlowModel()
    with FakeLLM({PLANNER: [model.plan] * CANDIDATES, CODER: [model.code] * CANDIDATES}) as fake:
        result = go(llm_config(fake, runs), pool, f"in-flight-{'slots' if slots else 'pool'}", CANDIDATES, slots)
    assert result.heads["decode"].verdict.cached_from.job == "head-decode"     # the run's head: from the cache
    assert not model.together.broken, "the run never had IN_FLIGHT proposals being written at once"
    assert model.most == IN_FLIGHT and model.calls == CANDIDATES
    assert not result.fatal and result.stop == f"{CANDIDATES} candidates reached"
    assert [(r.id, r.outcome, r.stage) for r in result.history] == [
        (f"c{i:03d}", "rejected", "compile") for i in range(1, CANDIDATES + 1)]


def test_proposals_paid_for_and_cut_short_together_are_proposed_again_under_their_ids(pool, runs, monkeypatch):
    """A run stopped with several proposals being written (here: the coder's key revoked under all three) has
    paid for their claims; resumed, it proposes each again under its own id, buying no claim twice."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-in-flight")
    claims = [S.claim(1.3)] * IN_FLIGHT
    with FakeLLM({PLANNER: list(claims), CODER: [Step.error(401, "key revoked")] * IN_FLIGHT}) as fake:
        first = go(llm_config(fake, runs), pool, "cut-short", IN_FLIGHT)
    assert first.fatal and first.history == []
    with FakeLLM({PLANNER: [], CODER: [CHEAP] * IN_FLIGHT}) as fake:        # no claim left to sell
        again = go(llm_config(fake, runs), pool, "cut-short", IN_FLIGHT)
        asked = [s.model for s in fake.seen]
    assert asked == [CODER] * IN_FLIGHT
    assert not again.fatal and [r.id for r in again.history] == [f"c{i:03d}" for i in range(1, IN_FLIGHT + 1)]
