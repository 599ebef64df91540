"""What a run left alone overnight needs: a ledger that a kill between writing and committing leaves
recoverable to its last commit, candidate ids never reused, budgets that are the run's totals over its
sessions and a stop line naming the one reached, a hanging and two crashing candidates mid-run that
each get a verdict and a device health check while the run goes on, and a provider outage the run waits
out. (Killing real `kevo-agent run` processes at random points: tests/test_agent_killed.py.)"""
from __future__ import annotations

import io
import json
import subprocess

import pytest
from rich.console import Console

import candidates as C
from conftest import RUNTIME_ONLY, config_with
from fakes import scripts as S
from fakes.flaky import FlakyLLM, down_for
from fakes.llm_server import FakeLLM
from test_ledger import candidate, commit, git, new_ledger

from agent.ledger.repository import Ledger, LedgerError
from agent.run.loop import run, settings_from
from agent.records import CandidateRecord, Proposal
from agent.run.session import LOCK_NAME
from agent.reading.view import RunView

PLANNER, CODER = "fake-planner", "fake-coder"
KEY = "sk-test-unattended-0001"
# Small served shapes and small served limits: the interpreter's parity checks take about a second per candidate.
# The tiny preset's limits (max_running 16, max_prefill_tokens 512, a 4096-token cache) make parity's served-limit
# cases (a 512-token prefill, decode batches of 16 and 17 over a 1024-block pool) most of a candidate's parity on
# the interpreter; these limits still hold every request of the tiny trace (6 requests of 22 tokens at most).
SMALL = {"targets.attention.cpu.heads": [[4, 2]],
         "targets.attention.cpu.decode": [{"batch": 2, "lengths": [3, 12], "weight": 1.0}],
         "targets.attention.cpu.prefill": [{"batch": 1, "lengths": [3, 12], "weight": 1.0}],
         "stages.parity.distributions": ["normal"], "stages.parity.checks_per_shape": 1,
         "served.presets.tiny.max_running": 4, "served.presets.tiny.max_prefill_tokens": 32,
         "served.presets.tiny.kv_cache_tokens": 256}
# A short CPU replay, for tests about what a replay serves beside a kernel, not how much: the tiny trace's first
# second (3 of its 6 requests), each output cut to 3 tokens.
SHORT_REPLAY = {"served.cpu.window_s": 1.0, "served.cpu.max_output": 3}

HANGS = C.wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    while True:                         # a kernel that never returns
        pass
""")
SEGFAULTS = C.wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    import ctypes
    ctypes.string_at(0)                 # reads address 0: SIGSEGV
    return q
""")
ABORTS = C.wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    import os
    os.abort()
""")
CUDA_ERROR = C.wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):   # what torch raises after an illegal address
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
""")


def go(cfg, pool, **settings):
    view = RunView(console=Console(file=io.StringIO(), width=200))
    return run(cfg, settings_from(cfg, pool.device, **settings), view, pool=pool)


def llm_config(fake: FakeLLM, runs, **more):
    return config_with(**{
        "agent.runs_dir": str(runs), "agent.ops": ["decode"], "providers.retry.initial_s": 0.01,
        "providers.retry.max_s": 0.02, "providers.openai.base_url": fake.openai_url,
        "providers.openai.planner_model": PLANNER, "providers.openai.coder_model": CODER,
        f"providers.prices.{PLANNER}": {"input": 2.0, "output": 8.0},
        f"providers.prices.{CODER}": {"input": 1.0, "output": 4.0}, **SMALL, **more})


# -- the ledger -------------------------------------------------------------------------------------

def verdict_record(cid: str) -> CandidateRecord:
    return candidate(cid, "passed", "microbench", 1.0)


def test_a_ledger_killed_between_writing_and_committing_is_restored_to_its_last_commit(tmp_path):
    ledger = new_ledger(tmp_path / "r")
    commit(ledger, verdict_record("c001"))
    root, tip = ledger.root, git(ledger.root, "rev-parse", "HEAD")
    # What SIGKILL can leave: files written for the next commit, half a summary, git's own lock files.
    (root / "candidates/c002").mkdir()
    (root / "candidates/c002/record.json").write_text('{"id": "c0')
    (root / "summary.json").write_text('{"candid')
    for lock in (".git/index.lock", ".git/HEAD.lock", ".git/logs/HEAD.lock", ".git/refs/heads/x.lock"):
        (root / lock).parent.mkdir(parents=True, exist_ok=True)
        (root / lock).write_text("")
    (root / ".git/objects/objk3v0").write_bytes(b"half an object")
    (root / LOCK_NAME).write_text("{}")

    Ledger(root).history()                               # reading changes nothing
    assert (root / ".git/index.lock").exists() and (root / "candidates/c002/record.json").exists()

    discarded = Ledger(root).recover()
    assert sorted(discarded) == ["candidates/c002/record.json", "summary.json"]
    assert git(root, "status", "--porcelain") == "" and git(root, "rev-parse", "HEAD") == tip
    assert not list((root / ".git").rglob("*.lock")) and not (root / ".git/objects/objk3v0").exists()
    assert (root / LOCK_NAME).exists()                   # the run lock's file is not the ledger's to remove
    assert json.loads((root / "summary.json").read_text()) == {"candidates": 1}
    commit(ledger, verdict_record("c002"))               # and it commits again
    assert subprocess.run(["git", "fsck", "--strict"], cwd=root, capture_output=True).returncode == 0
    assert [r.id for r in Ledger(root).history()] == ["c001", "c002"]


def test_a_candidate_id_is_committed_once_and_a_proposal_waits_for_its_verdict(tmp_path):
    ledger = new_ledger(tmp_path / "r")
    for cid in ("c999", "c1000"):
        commit(ledger, verdict_record(cid))
    assert [r.id for r in ledger.history()] == ["c999", "c1000"]         # by number, not as text
    with pytest.raises(LedgerError, match="c999 already has a verdict"):
        commit(ledger, verdict_record("c999"))
    proposal = Proposal(id="c1001", op="decode", parent="head:decode", proposer="openai:m/m", outcome="ready",
                        source="# c1001\n")
    ledger.commit_proposal(proposal, {"candidates": 2})
    assert ledger.pending() == [proposal] and ledger.last_id() == 1001
    with pytest.raises(LedgerError, match="c1001 is already in the ledger"):
        ledger.commit_proposal(proposal, {"candidates": 2})
    commit(ledger, verdict_record("c1001"))
    assert ledger.pending() == []
    assert git(ledger.root, "log", "--format=%(trailers:key=Candidate,valueonly,separator=)").split() == \
        ["c1001", "c1000", "c999"]


def test_a_run_stopped_before_its_first_commit_starts_again_from_scratch(pool, tmp_path):
    cfg = config_with(**{"agent.runs_dir": str(tmp_path), "agent.ops": ["decode"], **SMALL})
    root = tmp_path / "u"                            # killed inside its first commit: files written, none committed
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "run.json").write_text('{"id": "u", "targ')
    (root / "heads").mkdir()
    (root / "heads/decode.py").write_text("# half a head\n")
    (root / LOCK_NAME).write_text("")
    result = go(cfg, pool, run_id="u", max_device_minutes=1e-5)      # stops once the heads are evaluated
    assert result.stop.startswith("device-time budget") and result.history == []
    assert git(root, "log", "--format=%s").splitlines()[-1] == "start u: heads evaluated, baseline profile recorded"
    assert (root / "heads/decode.py").read_text() == result.heads["decode"].source != "# half a head\n"
    assert git(root, "status", "--porcelain") == ""


# -- budgets ----------------------------------------------------------------------------------------

def test_budgets_are_totals_over_sessions_and_the_stop_line_names_the_one_reached(pool, tmp_path):
    cfg = config_with(**{"agent.runs_dir": str(tmp_path), "agent.ops": ["decode"], **SMALL})
    first = go(cfg, pool, run_id="b", max_candidates=2)
    assert first.stop == "2 candidates reached" and len(first.history) == 2

    again = go(cfg, pool, resume=str(first.ledger))      # its own settings: 2 candidates in all
    assert again.stop == "2 candidates reached" and len(again.history) == 2
    device = go(cfg, pool, resume="b", max_candidates=9, max_device_minutes=0.001)
    assert device.stop.startswith("device-time budget of 0.001 min spent (") and len(device.history) == 2
    timed = go(cfg, pool, resume="b", budget_minutes=1e-4, max_device_minutes=60)
    assert timed.stop == "time budget of 0.0001 min spent (all sessions)" and len(timed.history) == 2
    settings = json.loads((first.ledger / "settings.json").read_text())      # in force for the next resume
    assert (settings["max_candidates"], settings["max_device_minutes"], settings["budget_minutes"]) == (9, 60, 1e-4)
    sessions = [json.loads(git(first.ledger, "show", f"{c}:summary.json")) for c in
                git(first.ledger, "log", "--reverse", "--format=%h", "--grep=^end b").split()]
    assert [s["stopped"].split(" (")[0] for s in sessions] == ["2 candidates reached", "2 candidates reached",
                                                               "device-time budget of 0.001 min spent",
                                                               "time budget of 0.0001 min spent"]
    elapsed = [s["elapsed_s"] for s in sessions]
    assert elapsed == sorted(elapsed) and sessions[-1]["device_s"] == sessions[0]["device_s"] > 0


# -- faults mid-run ---------------------------------------------------------------------------------

def test_a_hanging_two_crashing_and_a_cuda_error_candidate_get_verdicts_the_device_is_checked_and_the_run_goes_on(
        pool, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    scripts = {PLANNER: [S.claim(1.3)] * 5, CODER: [S.code(HANGS), S.code(SEGFAULTS), S.code(ABORTS), S.code(CUDA_ERROR),
                                                  S.GOOD]}
    with FakeLLM(scripts) as fake:
        cfg = llm_config(fake, tmp_path, **RUNTIME_ONLY, **{"stages.compile.timeout_s": 3, "stages.dispatch.timeout_s": 3,
                                            "agent.compile_repair_rounds": 0})
        result = go(cfg, pool, provider="openai", run_id="faults", max_candidates=5)
    assert not result.fatal and result.stop == "5 candidates reached"
    hang, segv, abort, cuda, good = result.history
    assert hang.outcome == "rejected" and "no reply within" in hang.reason and "killed" in hang.reason
    assert hang.verdict.stages[-1].failure == "timeout"
    assert segv.outcome == "rejected" and "the worker died" in segv.reason and "SIGSEGV" in segv.reason
    assert abort.outcome == "rejected" and "the worker died" in abort.reason
    assert cuda.outcome == "rejected" and "the candidate raised" in cuda.reason and "illegal memory access" in cuda.reason
    assert good.outcome == "passed"
    health = dict(line.split("\t") for line in git(
        result.ledger, "log", "--format=%(trailers:key=Candidate,valueonly,separator=)\t"
                              "%(trailers:key=Health,valueonly,separator=)").splitlines() if line.strip())
    assert health == {"c001": f"passed after the worker hung at {hang.stage}",
                      "c002": f"passed after the worker crashed at {segv.stage}",
                      "c003": f"passed after the worker crashed at {abort.stage}",
                      "c004": f"passed after the worker hit a CUDA error at {cuda.stage}", "c005": ""}


class UnwellDevice:
    """The run's worker pool on a device gone bad after a crash (a fault outside kevo): every health check
    of it fails; everything else is the pool's own."""

    def __init__(self, pool) -> None:
        self._pool = pool

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def check_health(self) -> str:
        return "a known kernel came out wrong"


def test_a_device_failing_its_health_check_twice_ends_the_run_before_another_candidate_is_evaluated(
        pool, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    scripts = {PLANNER: [S.claim(1.3)] * 2, CODER: [S.code(SEGFAULTS), S.GOOD]}
    with FakeLLM(scripts) as fake:           # c002 is asked for as c001 starts: written while c001 is judged
        cfg = llm_config(fake, tmp_path, **RUNTIME_ONLY, **{"agent.compile_repair_rounds": 0,
                                                            "agent.proposals_in_flight": 1, "executor.health_retry_s": 0})
        result = go(cfg, UnwellDevice(pool), provider="openai", run_id="unwell", max_candidates=2)
    segv, good = result.history
    assert result.fatal and result.stop.startswith(f"the {pool.device} failed its health check after c001's worker "
                                                   "crashed: a known kernel came out wrong")
    assert (segv.id, segv.outcome, good.id, good.outcome) == ("c001", "rejected", "c002", "unevaluated")
    assert not good.rounds and good.reason.startswith(f"the run ended: the {pool.device} failed its health check")
    health = git(result.ledger, "log", "--format=%(trailers:key=Health,valueonly,separator=)", "--grep=^c001 ")
    assert health.strip() == f"failed after the worker crashed at {segv.stage}: a known kernel came out wrong"


def test_a_run_waits_out_a_provider_outage_longer_than_its_retries_and_goes_on(pool, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FlakyLLM({PLANNER: [S.claim(1.3)], CODER: [S.GOOD]}, down=down_for(1.5)) as fake:
        cfg = llm_config(fake, tmp_path, **{"providers.retry.attempts": 2, "providers.outage.wait_s": 0.05,
                                            "providers.outage.max_wait_s": 0.2, "providers.outage.give_up_s": 60})
        result = go(cfg, pool, provider="openai", run_id="outage", max_candidates=1)
        calls = len(fake.seen)
    assert not result.fatal and result.stop == "1 candidates reached"
    assert [r.outcome for r in result.history] == ["passed"]
    claim = json.loads((result.ledger / "candidates/c001/exchanges.jsonl").read_text().splitlines()[0])
    assert claim["note"].startswith("openai down for ") and claim["attempts"] == calls - 1 > 4
