"""The whole loop against fake OpenAI- and Anthropic-compatible services on loopback: the real SDKs
speak real HTTP to them, scripted with good claims, code that does not compile, malformed replies,
429s, 500s and 529s. The run keeps going, the ledger records every outcome, and no key reaches it."""
from __future__ import annotations

import io
import json
import subprocess

import pytest
from rich.console import Console

from fakes import scripts as S
from conftest import config_with
from test_agent_unattended import SMALL
from fakes.llm_server import FakeLLM, Step

from agent.run.loop import run, settings_from
from agent.reading.view import RunView

PLANNER, CODER = "fake-planner-2026-11-30-with-a-dated-name-as-long-as-a-vendors", "fake-coder"   # long: subjects must still fit
KEY = "sk-test-SECRET-4242"


def llm_config(fake: FakeLLM, runs, provider: str, **more):
    url = fake.openai_url if provider == "openai" else fake.anthropic_url
    return config_with(**{
        "agent.runs_dir": str(runs), "agent.ops": ["decode"], "providers.retry.initial_s": 0.01,
        "providers.retry.max_s": 0.05, f"providers.{provider}.base_url": url,
        f"providers.{provider}.planner_model": PLANNER, f"providers.{provider}.coder_model": CODER,
        f"providers.prices.{PLANNER}": {"input": 2.0, "output": 8.0},
        f"providers.prices.{CODER}": {"input": 1.0, "output": 4.0}, **SMALL, **more})


def go(cfg, pool, provider: str, run_id: str, max_candidates: int):
    view = RunView(console=Console(file=io.StringIO(), width=200))
    return run(cfg, settings_from(cfg, pool.device, provider=provider, max_candidates=max_candidates, run_id=run_id),
               view, pool=pool)


def git(ledger, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=ledger, capture_output=True, text=True, check=True).stdout


def gist(subject: str) -> str:
    """A ledger subject without its free text: `propose c001 [decode]`, `c001: passed at parity`, `paid c001 ...`."""
    if subject.startswith(("propose ", "paid ", "start ", "end ", "resume ")):
        return subject.split(":")[0]
    return f"{subject.split()[0]}: {subject.rsplit(': ', 1)[1]}"


def exchanges(ledger, cid: str) -> list[dict]:
    path = ledger / "candidates" / cid / "exchanges.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_openai_run_survives_every_scripted_failure_and_records_each_outcome(pool, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    scripts = {
        PLANNER: [S.PROSE, '{"op": "decode"}',                 # c001: no claim, then an invalid one
                  Step.error(429), S.claim(1.3),               # c002: rate limited, then good
                  Step.error(500), S.claim(1.001, ceiling=9.9),   # c003: a server error, then a claim not worth coding
                  S.claim(1.2),                                # c004
                  S.claim(1.2, stage="parity")],               # c005
        CODER: [S.SYNTAX_ERROR, S.GOOD,                        # c002: does not compile, repaired
                S.PROSE, "```python\nx = 1\n```",              # c004: no code, twice
                S.WRONG],                                      # c005: compiles, wrong answer
    }
    with FakeLLM(scripts) as fake:
        cfg = llm_config(fake, tmp_path, "openai", **{"agent.overlap": False})
        result = go(cfg, pool, "openai", "llm", 5)
        assert fake.left(PLANNER) == fake.left(CODER) == 0
        sent_keys = {s.headers.get("authorization") for s in fake.seen}
    assert sent_keys == {f"Bearer {KEY}"}                       # the key went to the service, in its header

    assert not result.fatal and result.stop == "5 candidates reached"
    outcomes = [(r.id, r.outcome, r.stage) for r in result.history]
    assert outcomes == [("c001", "malformed", "planner"), ("c002", "passed", "parity"),
                        ("c003", "not-worth-coding", "ceiling"), ("c004", "malformed", "coder"),
                        ("c005", "rejected", "parity")]
    c002, c003, c005 = result.history[1], result.history[2], result.history[4]
    assert len(c002.rounds) == 2 and c002.rounds[0].verdict.failed_stage == "compile"
    f = cfg.agent.standin_op_share["decode"]      # no head timed on a CPU: the stand-in's share as it is
    assert c003.claim.ceiling == pytest.approx(1 / (1 - f + f / 1.001))   # by code, not the model's 9.9
    assert c005.conclusion.kill_test_fired is True

    ledger = result.ledger
    subjects = git(ledger, "log", "--reverse", "--format=%s").splitlines()
    assert subjects[0].startswith("start llm:") and subjects[-1] == "end llm: 5 candidates reached"
    proposed = [s.split(":")[0] for s in subjects if s.startswith("propose ")]   # committed before their verdicts
    assert proposed == ["propose c002 [decode]", "propose c005 [decode]"]
    verdicts = [s for s in subjects[1:-1] if not s.startswith(("propose ", "paid "))]
    assert [gist(s) for s in verdicts] == [f"{c}: {o} at {st}" for c, o, st in outcomes]
    assert all(len(s) <= 72 for s in subjects), max(subjects, key=len)     # every subject: paid and end too
    trailers = git(ledger, "log", "-1", "--format=%(trailers:key=Verdict,key=Rounds,key=Cost,valueonly)",
                   "--grep=^c002 .*: passed at parity$")
    assert trailers.split() == ["passed", "2", f"{c002.cost_usd:.6f}"]
    paid = [s.split(":")[0] for s in subjects if s.startswith("paid ")]      # each exchange committed as answered
    assert paid[:4] == ["paid c001 planner claim", "paid c001 planner claim-repair", "paid c002 planner claim",
                        "paid c002 coder code"] and len(paid) == 11

    assert [e["purpose"] for e in exchanges(ledger, "c001")] == ["claim", "claim-repair"]
    assert [(e["purpose"], e["attempts"]) for e in exchanges(ledger, "c002")] == [("claim", 2), ("code", 1), ("compile-repair", 1)]
    assert "ceiling=9.9" in exchanges(ledger, "c003")[0]["note"]
    assert [e["purpose"] for e in exchanges(ledger, "c004")] == ["claim", "code", "code-format-repair"]
    code = next(e for e in exchanges(ledger, "c002") if e["purpose"] == "code")["messages"][0]["content"]
    assert "decode: no cuDNN anchor timed (needs CUDA" in code            # the coder is told the anchors (none on a CPU)
    assert (ledger / "candidates/c002/round0.py").read_text().count("def decode((") == 1
    assert json.loads((ledger / "summary.json").read_text())["cost_usd"] == pytest.approx(result.cost_usd)
    assert result.cost_usd == pytest.approx(sum(r.cost_usd for r in result.history)) and result.cost_usd > 0

    everything = git(ledger, "log", "-p", "--all") + "".join(
        p.read_text() for p in ledger.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert KEY not in everything


def test_anthropic_run_retries_overload_then_stops_on_an_auth_error_with_one_line(pool, tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    scripts = {PLANNER: [Step.error(529), S.claim(1.3), Step.error(401, "invalid x-api-key")], CODER: [S.GOOD]}
    with FakeLLM(scripts) as fake:
        cfg = llm_config(fake, tmp_path, "anthropic")
        result = go(cfg, pool, "anthropic", "claude", 10)
        assert sum(s.api == "anthropic" for s in fake.seen) == 4
    assert result.fatal and "\n" not in result.stop
    assert result.stop.startswith("anthropic: authentication failed (401 invalid x-api-key)")
    assert [(r.id, r.outcome) for r in result.history] == [("c001", "passed")]
    assert git(result.ledger, "log", "-1", "--format=%(trailers:key=Fatal,valueonly)").strip() == "true"


def test_next_claim_is_written_and_committed_while_the_current_candidate_is_evaluated(pool, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeLLM({PLANNER: [S.claim(1.3), S.claim(1.2)], CODER: [S.GOOD, S.GOOD]}) as fake:
        cfg = llm_config(fake, tmp_path, "openai")
        result = go(cfg, pool, "openai", "overlap", 2)
        second = [s.body for s in fake.seen if s.model == PLANNER][1]["messages"][-1]["content"]
    in_flight = second.split("## In flight")[1].split("##")[0]
    assert "c001 [decode]" in in_flight                         # proposed before c001's verdict was in
    assert [r.outcome for r in result.history] == ["passed", "passed"]
    subjects = [gist(line) for line in git(result.ledger, "log", "--reverse", "--format=%s").splitlines()
                if not line.startswith("paid ")]
    # committed as soon as it was written, not after c001's verdict: a kill meanwhile would not lose it
    assert subjects[1:5] == ["propose c001 [decode]", "propose c002 [decode]", "c001: passed at parity",
                             "c002: passed at parity"], subjects
