"""Runs with several candidates in flight (agent/run/drive.py, through an executor's slots) against a fake
OpenAI-compatible service: through a real Dask cluster of two worker processes on loopback, one of them
SIGKILLed mid-task, the ledger holds what a run in the loop's own pool (one at a time) holds, in the same order; through two local slots, a candidate whose
evaluator is lost for good is recorded as unevaluated, not dropped, and the candidates after it follow."""
from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

from rich.console import Console

import candidates as C
from conftest import RUNTIME_ONLY, config_with
from fakes import scripts as S
from fakes.llm_server import FakeLLM
from test_ledger import git
from test_agent_unattended import SMALL

from agent.run.loop import Run, run, settings_from
from agent.reading.view import RunView

PLANNER, CODER = "fake-planner", "fake-coder"
GOOD = C.with_knobs(C.REF_DECODE, BLOCK_N=32)
SLOW = GOOD + '\nimport time\ntime.sleep(2)\n'        # slow while its worker imports it: time to kill it there
BROKEN = GOOD.replace("def decode(", "def decode((", 1)  # does not compile; its repair is GOOD
# Timing, and what a parity check drew from its secret seed, differ between any two evaluations of one source;
# input tokens and cost follow the planner's prompt, which lists the candidates in flight (more of them here).
VARIES = {"seconds", "started", "input_tokens", "cost_usd"}
DRAWN = {"worst_error_over_tolerance"}


class Coder:
    """The coder model's replies, chosen by what is asked: the proposer thread asks for code while a judge
    thread asks for a compile repair, so one queue in arrival order would depend on thread timing."""

    def __init__(self, code: list[str]) -> None:
        self.code, self.lock = list(code), threading.Lock()

    def __call__(self, body: dict) -> str:
        if "def decode((" in body["messages"][-1]["content"]:
            return S.code(GOOD)
        with self.lock:
            return self.code.pop(0)


def scripted(codes: list[str], claims: list[str]) -> FakeLLM:
    coder = Coder([S.code(c) for c in codes])
    return FakeLLM({PLANNER: list(claims), CODER: [coder] * (len(codes) + 2)})


def llm_config(fake: FakeLLM, runs, **more):
    return config_with(**{
        "agent.runs_dir": str(runs), "agent.ops": ["decode"], "agent.compile_repair_rounds": 1, **SMALL,
        "stages.parity.twins": 1.0,                                         # a plan of a fixed length: records compare
        "providers.openai.base_url": fake.openai_url, "providers.openai.planner_model": PLANNER,
        "providers.openai.coder_model": CODER, "providers.retry.initial_s": 0.01, "providers.retry.max_s": 0.05,
        f"providers.prices.{PLANNER}": {"input": 2.0, "output": 8.0},
        f"providers.prices.{CODER}": {"input": 1.0, "output": 4.0}, **more})


def settings(cfg, run_id: str, n: int):
    return settings_from(cfg, "cpu", provider="openai", max_candidates=n, run_id=run_id)


def view() -> RunView:
    return RunView(console=Console(file=io.StringIO(), width=200))


def gist(verdict: dict) -> dict:
    stages = [{**s, "seconds": None, "metrics": {k: v for k, v in s["metrics"].items()
                                                 if not k.endswith("_s") and k not in DRAWN}}
              for s in verdict["stages"]]
    return {**verdict, "stages": stages}


def record(ledger, cid: str) -> dict:
    r = json.loads((ledger / "candidates" / cid / "record.json").read_text())
    return {**{k: v for k, v in r.items() if k not in VARIES},
            "rounds": [{**rnd, "verdict": gist(rnd["verdict"])} for rnd in r["rounds"]]}


def replies(ledger, cid: str) -> list[tuple[str, str]]:
    path = ledger / "candidates" / cid / "exchanges.jsonl"
    return [(e["purpose"], e["reply"]) for e in map(json.loads, path.read_text().splitlines())]


def commits(ledger, trailer: str) -> list[str]:
    out = git(ledger, "log", "--reverse", f"--format=%(trailers:key={trailer},valueonly)")
    return [line.strip() for line in out.splitlines() if line.strip()]


def kill_when_running(prun: Run, cid: str, killed: list[str]) -> None:
    """SIGKILL the Dask worker process evaluating `cid`, once its compile stage has begun there."""
    from harness.cluster import TOPIC
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        ex = prun.evaluator.executor
        at = [m["slot"] for _, m in ex.client.get_events(TOPIC) if m["id"] == cid] if ex is not None else []
        if at:
            os.kill(ex.client.run(os.getpid)[at[0]], signal.SIGKILL)
            killed.append(at[0])
            return
        time.sleep(0.05)


def test_a_dask_run_with_a_worker_killed_mid_task_commits_what_a_serial_run_commits(pool, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-parallel")
    claims = [S.claim(1.3), S.claim(1.2), S.claim(1.25), S.claim(1.2, stage="dispatch"), S.claim(1.001)]
    codes = [GOOD, BROKEN, SLOW, C.POINTER_CACHE]
    with scripted(codes, claims) as fake:
        cfg = llm_config(fake, tmp_path, **RUNTIME_ONLY)          # SLOW imports time
        serial = run(cfg, settings(cfg, "serial", 5), view(), pool=pool)
    with scripted(codes, claims) as fake:
        cfg = llm_config(fake, tmp_path, **RUNTIME_ONLY, **{"executor.kind": "dask", "executor.cpu_slots": 2})
        prun, killed = Run(cfg, settings(cfg, "dask", 5), view()), []
        killer = threading.Thread(target=kill_when_running, args=(prun, "c003", killed), daemon=True)
        killer.start()
        parallel = prun()
        killer.join(timeout=5)

    expected = [("c001", "passed", "parity"), ("c002", "passed", "parity"), ("c003", "passed", "parity"),
                ("c004", "rejected", "dispatch"), ("c005", "not-worth-coding", "ceiling")]
    for result in (serial, parallel):
        assert not result.fatal and result.stop == "5 candidates reached"
        assert [(r.id, r.outcome, r.stage) for r in result.history] == expected
    a, b = serial.ledger, parallel.ledger
    assert git(b, "ls-files") == git(a, "ls-files")
    for cid, *_ in expected:
        assert record(b, cid) == record(a, cid), cid
        assert replies(b, cid) == replies(a, cid), cid
    heads = [gist(json.loads((ledger / "heads/decode.json").read_text())["verdict"]) for ledger in (a, b)]
    assert heads[0] == heads[1]
    ids = [cid for cid, *_ in expected]
    assert commits(b, "Candidate") == commits(a, "Candidate") == ids        # one verdict each, in candidate order
    assert commits(b, "Proposal") == commits(a, "Proposal") == ids         # each committed before its verdict:
    subjects = git(b, "log", "--reverse", "--format=%s").splitlines()
    assert all(subjects.index(next(s for s in subjects if s.startswith(f"propose {c} ")))
               < subjects.index(next(s for s in subjects if s.startswith(f"{c} ")))
               for c in ids[:4])
    summaries = [json.loads((ledger / "summary.json").read_text()) for ledger in (a, b)]
    assert summaries[0]["funnel"] == summaries[1]["funnel"]

    done = {d.id: d for d in prun.evaluator.evaluations}
    assert [d.id for d in prun.evaluator.evaluations].count("c003") == 1
    assert {job for job in done if job.startswith("c")} == {"c001", "c002", "c002.r1", "c003", "c004"}
    assert killed and done["c003"].slot != killed[0]          # re-run elsewhere after its worker was killed
    assert f"Evaluated-On: {done['c003'].slot}" in git(b, "log", "-1", "--format=%B", "--grep=^c003 .*: passed at ")
    overlapping = [(x.id, y.id) for x in prun.evaluator.evaluations for y in prun.evaluator.evaluations
                   if x.slot != y.slot and x.started < y.ended and y.started < x.ended]
    assert overlapping, [(d.id, d.slot, d.started, d.ended) for d in prun.evaluator.evaluations]   # judged at the same time


def test_a_candidate_whose_evaluator_is_lost_for_good_is_recorded_unevaluated_and_the_run_goes_on(
        pool, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-parallel")
    with scripted([SLOW, GOOD], [S.claim(1.3), S.claim(1.2)]) as fake:
        cfg = llm_config(fake, tmp_path, **RUNTIME_ONLY, **{"executor.cpu_slots": 2, "executor.requeue_limit": 0})
        prun = Run(cfg, settings(cfg, "lost", 2), view())
        head = prun.head("decode")                     # the head through the executor, as Run.start can ask

        def kill() -> None:
            ex, deadline = prun.evaluator.executor, time.monotonic() + 240
            while time.monotonic() < deadline:
                at = [slot for slot, job in ex.running().items() if job == "c001"]
                if at:
                    return os.kill(ex.pid(at[0]), signal.SIGKILL)
                time.sleep(0.05)
        threading.Thread(target=kill, daemon=True).start()
        result = prun(pool)
    assert not result.fatal and [(r.id, r.outcome, r.stage) for r in result.history] == [
        ("c001", "unevaluated", "evaluator"), ("c002", "passed", "parity")]
    assert "c001: its evaluator was lost 1 times (executor.requeue_limit 0)" in result.history[0].reason
    assert commits(result.ledger, "Candidate") == ["c001", "c002"]
    assert head.verdict.ok and gist(head.verdict.model_dump()) == gist(result.heads["decode"].verdict.model_dump())
