"""The run ledger is a git repository whose log reads as the run's history: a first commit with what
the run started from, one commit per candidate with a short `<candidate> <op> <change>: <verdict> at <stage>`
subject, the conclusion in the body and machine-readable trailers, the best kernel tagged, secrets never written, and everything
readable back."""
from __future__ import annotations

import json
import subprocess

import pytest

from harness.records import StageResult, Verdict

from agent.ledger.messages import SUBJECT_CHARS
from agent.ledger.repository import Ledger, LedgerError
from agent.reading.report import write as write_report
from agent.records import (CandidateRecord, Claim, Conclusion, Exchange, Kernel, KillTest, Message, OpEvidence,
                           Profile, Proposal, Round, RunHeader)

SECRET = "sk-ledger-test-77aa99"


def git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def new_ledger(root) -> Ledger:
    header = RunHeader(id="r1", target="attention", provider="offline", device="cuda", arch="sm90", ops=["decode"],
                       budget_minutes=20, max_candidates=None, max_cost_usd=0, started="2026-11-30T00:00:00+00:00",
                       kevo_commit="abc")
    profile = Profile(source="stand-in", note="stand-in profile", device="cuda", arch="sm90",
                      ops={"decode": OpEvidence(share=0.35, lines=["decode f = 0.35"])})
    head = Kernel(ref="head:decode", op="decode", path="heads/decode.py", source="def decode(): pass\n", speedup=1.2,
                  verdict=Verdict.of([StageResult.passed("microbench", "ok", speedup=1.2)]))
    return Ledger.create(root, header, "agent: {}\n", {"gpu": "NVIDIA H200"}, profile, {"status": "not run", "note": "none"},
                         {"decode": head}, {"candidates": 0})


def candidate(cid: str, outcome: str, stage: str, speedup: float | None, reason: str = "ok") -> CandidateRecord:
    claim = Claim(op="decode", hypothesis="wider KV tiles put more bytes in flight", evidence=["3.1 TB/s of 4.19"],
                  expected_speedup=1.1, risks=["spills"], kill_test=KillTest(stage="microbench", observation="no gain"),
                  op_share=0.35, share_source="stand-in")
    stages = [StageResult.passed("parity", "ok")]
    stages.append(StageResult.failed(stage, reason) if outcome == "rejected"
                  else StageResult.passed("microbench", "ok", speedup=speedup or 1.0))
    conclusion = Conclusion(learned=f"learned from {cid}", kill_test_fired=None, predicted=1.1, observed=None)
    return CandidateRecord(id=cid, op="decode", parent="head:decode", proposer="openai:m/m", outcome=outcome, stage=stage,
                           reason=reason, claim=claim, rounds=[Round(source=f"# {cid}\n", verdict=Verdict.of(stages))],
                           speedup=speedup, conclusion=conclusion, cost_usd=0.0123)


def commit(ledger: Ledger, r: CandidateRecord, new_best: bool = False, exchanges=()) -> str:
    return ledger.commit_candidate(r, list(exchanges), {"candidates": 1}, new_best)


def test_git_log_reads_as_the_history_with_trailers_and_the_best_tagged(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    first = git(ledger.root, "rev-parse", "HEAD").strip()
    assert git(ledger.root, "rev-parse", "best-decode^{commit}").strip() == first       # the head, until beaten
    commit(ledger, candidate("c001", "rejected", "parity", None, "max abs error 0.37"))
    best = commit(ledger, candidate("c002", "passed", "microbench", 1.5), new_best=True)
    commit(ledger, candidate("c003", "passed", "microbench", 1.3))
    assert git(ledger.root, "log", "--format=%s").splitlines() == [
        "c003 decode wider KV tiles put more bytes in flig…: passed at microbench",
        "c002 decode wider KV tiles put more bytes in flig…: passed at microbench",
        "c001 decode wider KV tiles put more bytes in flight: rejected at parity",
        "start r1: heads evaluated, baseline profile recorded"]
    assert "conclusion: learned from c002" in git(ledger.root, "log", "-1", "--format=%b", best)
    fields = git(ledger.root, "log", "-1", "--format=%(trailers:only,unfold)", best)
    assert dict(line.split(": ", 1) for line in fields.strip().splitlines()) == {
        "Candidate": "c002", "Parent": "head:decode", "Op": "decode", "Stage": "microbench", "Verdict": "passed",
        "Speedup": "1.5000", "Local-Speedup": "n/a", "Predicted": "1.1000", "Ceiling": "1.0329", "Rounds": "1",
        "Cost": "0.012300"}
    assert git(ledger.root, "rev-parse", "best-decode^{commit}").strip() == best
    assert (ledger.root / "best/decode.py").read_text() == "# c002\n"
    shown = git(ledger.root, "show", "--stat", "--format=", "HEAD~2")
    assert "candidates/c001/record.json" in shown and "candidates/c001/candidate.py" in shown


def test_each_subject_leads_with_the_change_fits_72_columns_and_the_conclusion_is_in_the_body(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    offline = candidate("c007", "rejected", "parity", None)
    offline.claim = offline.claim.model_copy(update={
        "hypothesis": "BLOCK_N 64 -> 128 in the decode kernel (from c003): more bytes in flight per program"})
    offline.conclusion = offline.conclusion.model_copy(update={"learned": "parity: max abs error 0.37 at [0, 3] " * 8})
    malformed = candidate("c008", "rejected", "parity", None).model_copy(update={
        "claim": None, "rounds": [], "outcome": "malformed", "stage": "planner"})
    wordy = candidate("c1000", "passed", "microbench", 1.2).model_copy(update={"op": "prefill"})
    wordy.claim = wordy.claim.model_copy(update={
        "op": "prefill", "hypothesis": "Use a persistent-kernel schedule over KV blocks so that each program streams "
                                       "several tiles back to back without relaunching, which hides latency"})
    for r in (offline, malformed, wordy):
        commit(ledger, r)
    proposal = Proposal(id="c1001", op="decode", parent="head:decode", proposer="openai:m/m", outcome="ready",
                        claim=wordy.claim.model_copy(update={"op": "decode"}), source="# c1001\n")
    ledger.commit_proposal(proposal, {"candidates": 3})
    subjects = git(ledger.root, "log", "--format=%s").splitlines()[:4]
    assert subjects[3] == "c007 decode BLOCK_N 64 -> 128: rejected at parity"
    assert subjects[2] == "c008 decode (no claim): malformed at planner"
    assert subjects[1].startswith("c1000 prefill Use a persistent-kernel schedule") and \
        subjects[1].endswith("…: passed at microbench")
    assert subjects[0].startswith("propose c1001 [decode]: Use a persistent-kernel") and subjects[0].endswith("…")
    assert max(len(s) for s in subjects) == SUBJECT_CHARS
    body = git(ledger.root, "log", "-1", "--format=%b", "HEAD~3")
    assert f"conclusion: {offline.conclusion.learned}" in body and offline.claim.hypothesis in body


def test_what_was_committed_reads_back_exactly(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    records = [candidate("c001", "rejected", "parity", None), candidate("c002", "passed", "microbench", 1.5)]
    for r in records:
        commit(ledger, r)
    again = Ledger(ledger.root)
    assert again.history() == records
    assert again.heads()["decode"].source == "def decode(): pass\n" and again.header().id == "r1"
    assert again.profile().ops["decode"].share == 0.35


def test_a_reply_holding_unicode_line_separators_reads_back_whole_in_the_history_and_the_report(tmp_path):
    """U+2028, U+2029 and U+0085 are written raw inside a JSON string; a reader splitting with `str.splitlines` cut the
    record there: the ledger's exchanges, the resume's unjudged ones and the report were then unreadable (an attacker's
    review, 2026-12-07: a model's reply, or compile-error text sent back to it, puts them there)."""
    ledger = new_ledger(tmp_path / "r1")
    ex = Exchange(role="coder", purpose="code", provider="openai", model="m", system="s",
                  messages=[Message(role="user", content="a\u2029b")], reply="line\u2028separator\x85next")
    commit(ledger, candidate("c001", "rejected", "compile", None), exchanges=[ex])
    assert Ledger(ledger.root).exchanges() == {"c001": [ex]}
    assert "kevo run r1" in write_report(Ledger(ledger.root), tmp_path / "report.html").read_text()   # it reads them


def test_secret_values_never_reach_a_file_or_a_commit_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KEVO_TEST_API_KEY", SECRET)
    ledger = new_ledger(tmp_path / "r1")
    leaky = candidate("c001", "rejected", "compile", None, f"import failed: token {SECRET} in the traceback")
    ex = Exchange(role="coder", purpose="code", provider="openai", model="m", system="s",
                  messages=[Message(role="user", content=f"my key is {SECRET}")], reply="ok")
    commit(ledger, leaky, exchanges=[ex])
    everything = git(ledger.root, "log", "-p", "--all") + "".join(
        p.read_text() for p in ledger.root.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert SECRET not in everything and "[KEVO_TEST_API_KEY redacted]" in everything


def test_an_existing_folder_is_never_overwritten(tmp_path):
    new_ledger(tmp_path / "r1")
    with pytest.raises(LedgerError, match="already exists; give another --run-id"):
        new_ledger(tmp_path / "r1")
    (tmp_path / "plain").mkdir()
    with pytest.raises(LedgerError, match="is not a run ledger"):
        Ledger(tmp_path / "plain")


def test_the_first_commit_holds_config_environment_profile_replay_and_heads(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    files = set(git(ledger.root, "show", "--name-only", "--format=", "HEAD").split())
    assert files == {"run.json", "config.yaml", "environment.json", "profile.json", "replay.json", "summary.json",
                     "README.md", "heads/decode.py", "heads/decode.json"}
    assert json.loads((ledger.root / "environment.json").read_text()) == {"gpu": "NVIDIA H200"}


def test_a_pinned_ledger_reads_the_tip_it_was_opened_at_whatever_is_committed_after(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    first = candidate("c001", "rejected", "parity", None)
    commit(ledger, first)
    pinned = Ledger(ledger.root, pinned=True)
    commit(ledger, candidate("c002", "passed", "microbench", 1.5), new_best=True)
    assert pinned.history() == [first] and pinned.committed("candidates/c002/record.json") is None
    assert [r.id for r in Ledger(ledger.root).history()] == ["c001", "c002"]
    assert list(pinned.heads(at_start=True)) == ["decode"] and pinned.first.hexsha == git(
        ledger.root, "rev-list", "--max-parents=0", "HEAD").strip()


def test_a_commit_beside_the_run_moves_no_ref_touches_no_file_and_is_redacted(tmp_path, monkeypatch):
    monkeypatch.setenv("KEVO_TEST_API_KEY", SECRET)
    ledger = new_ledger(tmp_path / "r1")
    commit(ledger, candidate("c001", "rejected", "parity", None))
    refs, tip = git(ledger.root, "show-ref"), ledger.tip.hexsha
    side = ledger.commit_beside({"replay/note.md": f"token {SECRET}\n"}, "a note beside the run", f"body {SECRET}",
                                {"Replay": "verdicts"})
    assert git(ledger.root, "show-ref") == refs and git(ledger.root, "status", "--porcelain") == ""
    assert side.parents[0].hexsha == tip and not (ledger.root / "replay").exists()
    shown = git(ledger.root, "show", side.hexsha)
    assert SECRET not in shown and "[KEVO_TEST_API_KEY redacted]" in shown and "Replay: verdicts" in shown
    assert (side.tree / "candidates/c001/record.json").data_stream.read() == (ledger.tip.tree / "candidates/c001/record.json").data_stream.read()
