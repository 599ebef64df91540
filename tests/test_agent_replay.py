"""`kevo-agent replay`: a real past run (the loop against a fake OpenAI service on loopback) re-judged by
today's harness (re-judging), and its decisions re-run from the recorded exchanges with no key and no service.
Each comparison is committed on a replay/ branch of the run and leaves the run's branch and files alone; a
re-judging killed mid-way is continued with --resume, and one on two evaluation slots gives the rows of one."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from rich.console import Console

from conftest import ROOT, config_with
from fakes import scripts as S
from fakes.llm_server import FakeLLM
from test_agent_unattended import SMALL
from test_ledger import git

from agent.run.loop import run, settings_from
from agent.cli import main
from agent.rejudging.rerun import RejudgeError, rerun
from agent.rejudging.rejudge import rejudge
from agent.rejudging.progress import PREFIX, finish, newest, receipts_of
from agent.rejudging.report import VerdictRow, commit_rejudging
from agent.reading.view import RunView

PLANNER, CODER = "fake-planner", "fake-coder"
KEYS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")
UNCUT = [("head:decode", "passed", "parity", ("passed", "parity"), "same", ""),    # every kernel re-judged on a CPU,
         ("c001", "passed", "parity", ("passed", "parity"), "same", ""),           # in one pool, never interrupted:
         ("c002", "rejected", "parity", ("rejected", "parity"), "same", ""),       # the stages after parity need CUDA
         ("c003", "not-worth-coding", "ceiling", None, "not evaluated then", "")]


HERE = tempfile.mkdtemp(prefix="kevo-test-runs-")      # this machine's runs folder: its re-judgings' receipts


def small(**overrides):
    """The project's config on the loop tests' small CPU shapes: what each kernel's re-judging does is the same
    on any shapes, and the past run and every re-judging or re-run of it use the same ones. The receipts of the
    re-judgings' saves go to a runs folder of the tests' own (HERE), not the project's."""
    return config_with(**{**SMALL, "agent.runs_dir": HERE, **overrides})


def quiet() -> RunView:
    return RunView(console=Console(file=io.StringIO(), width=200))


def untouched(repo) -> tuple:
    """What re-judging (or re-running) must not change: the checked-out branch, its tip, what is staged, the files."""
    return (git(repo, "rev-parse", "--abbrev-ref", "HEAD"), git(repo, "rev-parse", "HEAD"),
            git(repo, "ls-files", "--stage"), git(repo, "status", "--porcelain", "--untracked-files=all"))


@pytest.fixture(scope="module")
def past(pool, tmp_path_factory):
    """A three-candidate run of the LLM loop: c001 fails to compile and is repaired (passed), c002 fails
    parity, c003 is not worth coding. The next claim is written while a candidate is evaluated."""
    coder_replies = [S.SYNTAX_ERROR, S.WRONG]           # c001's first file, then c002's

    def coder(body: dict) -> str:                       # a compile repair may interleave with c002's file
        asks = body["messages"][-1]["content"]
        return S.GOOD if "rejected at the compile stage" in asks else coder_replies.pop(0)

    scripts = {PLANNER: [S.claim(1.3), S.claim(1.2, stage="parity"), S.claim(1.001)], CODER: [coder] * 3}
    runs = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp, FakeLLM(scripts) as fake:
        mp.setenv("OPENAI_API_KEY", "sk-test-REPLAY-4242")
        cfg = small(**{
            "agent.runs_dir": str(runs), "agent.ops": ["decode"], "providers.openai.base_url": fake.openai_url,
            "providers.openai.planner_model": PLANNER, "providers.openai.coder_model": CODER,
            f"providers.prices.{PLANNER}": {"input": 2.0, "output": 8.0},
            f"providers.prices.{CODER}": {"input": 1.0, "output": 4.0}})
        result = run(cfg, settings_from(cfg, pool.device, provider="openai", max_candidates=3, run_id="past"),
                     quiet(), pool=pool)
    assert [(r.outcome, r.stage, len(r.rounds)) for r in result.history] == [
        ("passed", "parity", 2), ("rejected", "parity", 1), ("not-worth-coding", "ceiling", 0)]
    return result


def test_rejudging_reproduces_every_verdict_and_commits_on_its_own_branch(past, pool):
    root = past.ledger
    before = untouched(root)
    replay = rejudge(root, small(), pool)

    rows = {r.ref: r for r in replay.rows}
    assert list(rows) == ["head:decode", "c001", "c002", "c003"]
    for r in past.history:
        row = rows[r.id]
        assert (row.then.outcome, row.then.stage) == (r.outcome, r.stage)
        if r.rounds:
            assert (row.now.outcome, row.now.stage) == (r.outcome, r.stage) and row.change == "same"
        else:
            assert row.now is None and row.change == "not evaluated then"
    assert rows["head:decode"].change == "same" and rows["head:decode"].now.outcome == "passed"
    assert replay.failures == [] and replay.config_changes == []
    assert judged(replay.rows) == UNCUT                 # what a re-judging killed mid-way must end as (below)

    receipts = receipts_of(small())
    assert newest(root, receipts).state.at == replay.at and len(newest(root, receipts).state.rows) == 3   # saved as it went
    done = commit_rejudging(root, replay)
    finish(root, done, receipts)
    assert git(root, "for-each-ref", PREFIX) == ""                                  # committed: the saved rows go
    assert untouched(root) == before
    assert done.branch.startswith("replay/") and done.branch.endswith("-cpu")
    assert git(root, "branch", "--list", "replay/*").split() == [done.branch]
    assert git(root, "rev-parse", f"{done.branch}~1") == before[1]                # on top of the run's tip
    committed = json.loads(git(root, "show", f"{done.branch}:replay/replay.json"))
    assert [(r["ref"], r["change"]) for r in committed["rows"]] == [(r.ref, r.change) for r in replay.rows]
    readme = git(root, "show", f"{done.branch}:replay/README.md")
    assert "| c002 | decode | rejected at parity | rejected at parity | same |" in readme

    only = rejudge(root, small(), pool, only=["c002"], until="compile")
    assert [(r.ref, r.then.outcome, r.then.stage, r.now.outcome, r.now.stage) for r in only.rows] == [
        ("c002", "passed", "compile", "passed", "compile")]            # both verdicts cut after compile
    with pytest.raises(RejudgeError, match="'c009' is not a kernel of past"):
        rejudge(root, small(), pool, only=["c009"])


def test_a_stricter_harness_is_flagged_and_fails_the_command(past, tmp_path, capsys):
    root = past.ledger
    before = untouched(root)
    allowed = {m: names for m, names in small().stages.compile.allowed_names.items() if m != "math"}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(small(**{"stages.compile.allowed_names": allowed}).model_dump(mode="json")))
    code = main(["--config", str(cfg), "replay", str(root), "--json"])     # in this process: no interpreter to start
    done = capsys.readouterr()
    assert code == 1, done.err
    replay = json.loads(done.out)
    changes = {r["ref"]: (r["change"], r["now"] and r["now"]["stage"]) for r in replay["rows"]}
    assert changes == {"head:decode": ("regressed", "compile"), "c001": ("regressed", "compile"),
                       "c002": ("changed", "compile"), "c003": ("not evaluated then", None)}
    assert any(c.startswith("stages.compile.allowed_names") for c in replay["config_changes"])
    assert "re-judging c002 (3/4)" in done.err
    assert untouched(root) == before
    assert replay["branch"] in git(root, "branch", "--list", "replay/*").split()


def test_rerunning_on_the_recorded_llm_reproduces_the_decisions_with_no_key_and_no_service(past, pool, monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    root = past.ledger
    before = untouched(root)
    replay = rerun(root, small(), quiet(), pool=pool)

    assert [(d.id, d.differs) for d in replay.decisions] == [("c001", []), ("c002", []), ("c003", [])]
    for d, r in zip(replay.decisions, past.history, strict=True):
        assert (d.now.op, d.now.expected_speedup, d.now.outcome, d.now.stage) == (
            r.op, r.claim.expected_speedup, r.outcome, r.stage)
    assert replay.failures == [] and replay.unasked == []
    assert replay.divergences == []                 # today's prompts are the recorded ones, byte for byte
    assert replay.stopped == {"then": "3 candidates reached", "now": "3 candidates reached"}
    scratch = replay.scratch
    assert scratch != str(root) and os.path.isdir(scratch)
    assert json.loads(git(scratch, "show", "HEAD:run.json"))["provider"] == "recorded"     # a ledger of its own
    assert json.loads(git(scratch, "show", "HEAD:candidates/c002/record.json"))["outcome"] == "rejected"

    done = commit_rejudging(root, replay)
    assert untouched(root) == before
    assert done.branch.endswith("-cpu-llm-recorded")
    committed = json.loads(git(root, "show", f"{done.branch}:replay/replay.json"))
    assert committed["kind"] == "decisions" and [d["differs"] for d in committed["decisions"]] == [[], [], []]


def tamper(root, cid: str, old: str, new: str) -> None:
    """Rewrite the planner's first recorded reply for `cid`, and commit it (a re-run reads commits)."""
    path = root / "candidates" / cid / "exchanges.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    assert (first["role"], first["purpose"]) == ("planner", "claim") and old in first["reply"]
    first["reply"] = first["reply"].replace(old, new)
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    git(root, "commit", "-qam", f"someone rewrote {cid}'s claim")


def test_a_tampered_reply_is_reported_as_a_diverging_decision(past, pool, tmp_path, monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    root = tmp_path / "tampered"
    shutil.copytree(past.ledger, root)
    tamper(root, "c001", '"expected_speedup": 1.3', '"expected_speedup": 1.001')    # now not worth coding
    tamper(root, "c003", '"expected_speedup": 1.001', '"expected_speedup": 1.3')    # now worth coding: no code recorded

    replay = rerun(root, small(), quiet(), pool=pool)
    differs = {d.id: d.differs for d in replay.decisions}
    assert differs == {"c001": ["expected_speedup", "outcome", "stage"], "c002": [], "c003": ["not made now"]}
    assert replay.failures == ["c001", "c003"]
    c001 = replay.decisions[0]
    assert (c001.then.outcome, c001.now.outcome, c001.now.stage) == ("passed", "not-worth-coding", "ceiling")
    assert replay.unasked == ["c001: 2 recorded coder exchange(s) never asked for (code, compile-repair)"]
    assert any(d.candidate == "c002" and d.role == "planner" for d in replay.divergences)   # its history changed
    assert replay.stopped["now"] == ("recorded: nothing matches: c003 asked the coder for reply 1; "
                                     "the run recorded 0 coder exchange(s) for c003")


def test_a_run_of_the_built_in_proposer_is_run_again_and_compared_the_same_way(pool, tmp_path):
    """The verdict cache on, in this test's own runs folder: the run again takes the head's and c001's verdicts
    from it (the decisions are what this compares; a re-run's verdicts by the stages are the tests' above)."""
    cached = {"executor.verdict_cache": True}
    cfg = small(**{"agent.runs_dir": str(tmp_path), "agent.ops": ["decode"], **cached})
    past = run(cfg, settings_from(cfg, pool.device, max_candidates=1, run_id="offline"), quiet(), pool=pool)
    assert len(past.history) == 1
    replay = rerun(past.ledger, small(**cached), quiet(), pool=pool)            # runs_dir: the run's folder
    assert replay.proposer.startswith("the built-in proposer, run again")
    assert [(d.id, d.differs) for d in replay.decisions] == [(r.id, []) for r in past.history]
    assert [(d.now.hypothesis, d.now.expected_speedup) for d in replay.decisions] == [
        (r.claim.hypothesis, r.claim.expected_speedup) for r in past.history]
    assert replay.failures == [] and replay.divergences == [] and replay.unasked == []


def fresh_copy(past, folder):
    """The run in another folder, without the unfinished re-judgings other tests left in it."""
    root = folder / "run"
    shutil.copytree(past.ledger, root)
    for ref in git(root, "for-each-ref", "--format=%(refname)", PREFIX).split():
        git(root, "update-ref", "-d", ref)
    return root


def judged(rows) -> list[tuple]:
    return [(r.ref, r.then.outcome, r.then.stage, r.now and (r.now.outcome, r.now.stage), r.change, r.note) for r in rows]


def test_a_rejudging_killed_mid_way_resumes_with_only_the_rest_and_ends_as_an_uninterrupted_one(
        past, tmp_path, capsys):
    root = fresh_copy(past, tmp_path)
    before, branches = untouched(root), git(root, "branch", "--list", "replay/*").split()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(small().model_dump(mode="json")))
    cli = ["--config", str(cfg), "replay", str(root)]
    two = ("c001", "c002")                                      # the head's re-judging is the first test's

    killed = subprocess.Popen([sys.executable, "-m", "agent.cli", *cli, "--until", "parity", "--only", ",".join(two)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while (saved := newest(root, receipts_of(small()))) is None or not saved.state.rows:                 # the first kernel saved: kill it
        assert killed.poll() is None and time.monotonic() < deadline, killed.stderr.read().decode()
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    killed.stderr.close()
    kept = [r.ref for r in newest(root, receipts_of(small())).state.rows]
    assert killed.returncode == -9 and kept and len(kept) < len(two)               # killed mid-way, for real
    assert git(root, "branch", "--list", "replay/*").split() == branches and untouched(root) == before

    assert main([*cli, "--resume", "--until", "compile"]) == 2
    assert "--until compile: the unfinished re-judging of" in capsys.readouterr().err     # its flags are the saved ones
    assert main([*cli, "--resume", "--llm", "recorded"]) == 2
    assert "are for re-judging" in capsys.readouterr().err

    code = main([*cli, "--resume", "--json"])                   # in this process: its own pool, as the command's
    done = capsys.readouterr()
    assert code == 0, done.err
    assert f"kernel(s) reused from it: {', '.join(kept)}" in done.err
    assert [line.split()[1] for line in done.err.splitlines() if line.startswith("re-judging ")] == [
        r for r in two if r not in kept]                                            # only the rest evaluated
    resumed = json.loads(done.out)
    assert resumed["until"] == "parity" and resumed["kind"] == "verdicts"
    assert judged(VerdictRow.model_validate(r) for r in resumed["rows"]) == UNCUT[1:3]     # the saved --only too
    assert git(root, "branch", "--list", "replay/*").split() == sorted([*branches, resumed["branch"]])
    assert git(root, "rev-parse", f"{resumed['branch']}~1") == before[1]           # the same kind of commit
    assert git(root, "for-each-ref", PREFIX) == "" and untouched(root) == before
    assert main([*cli, "--resume"]) == 2
    assert "no unfinished re-judging to resume" in capsys.readouterr().err       # committed: nothing left


def test_an_unfinished_rejudging_that_came_with_a_copied_ledger_is_resumed_only_on_the_machine_that_saved_it(
        past, pool, tmp_path, capsys):
    """Its ref names this machine and its harness, as a planted one could: what it lacks elsewhere is this machine's
    receipt of the save."""
    root = fresh_copy(past, tmp_path)
    rejudge(root, small(), pool, only=["c002"], until="compile")                    # saved, never committed
    shipped = tmp_path / "shipped"
    shutil.copytree(root, shipped)
    for name, runs in (("here.yaml", HERE), ("elsewhere.yaml", str(tmp_path / "elsewhere"))):
        (tmp_path / name).write_text(yaml.safe_dump(small(**{"agent.runs_dir": runs}).model_dump(mode="json")))
    assert main(["--config", str(tmp_path / "elsewhere.yaml"), "replay", str(shipped), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "was not saved on this machine (it came with the ledger)" in err and "refs/kevo/replay-unfinished/" in err
    assert main(["--config", str(tmp_path / "here.yaml"), "replay", str(shipped), "--resume", "--json"]) == 0
    assert "1 kernel(s) reused from it: c002" in capsys.readouterr().err          # the same save, its receipt here


def test_a_rejudging_on_two_cpu_slots_gives_the_rows_of_one_in_the_runs_order_and_judges_afresh_each_time(past, tmp_path):
    """Judged afresh: whether a run's verdicts reproduce is the question, and on slots each job went through the verdict
    cache, so on the machine and harness that judged it a kernel was given its old verdict back (an attacker's review,
    2026-12-07). With the cache on, the stages run again (and say so) the second time."""
    root = fresh_copy(past, tmp_path)
    lines = []
    cfg = small(**{"executor.cpu_slots": 2, "executor.verdict_cache": True, "agent.runs_dir": str(tmp_path / "runs")})
    two = rejudge(root, cfg, only=["c001", "c002", "c003"],
                          until="parity", progress=lines.append)        # c002 fails parity sooner than c001 passes it
    assert judged(two.rows) == UNCUT[1:]
    assert sorted(lines) == ["re-judging c001 (1/3)", "re-judging c002 (2/3)"]
    assert sorted(r.ref for r in newest(root, receipts_of(cfg)).state.rows) == ["c001", "c002"]      # each saved as it came
    assert list((tmp_path / "runs" / ".verdicts").glob("*.json"))                  # the cache holds their verdicts
    lines.clear()
    rejudge(root, cfg, only=["c002"], until="parity", progress=lines.append)
    assert [line for line in lines if line.startswith("re-judging ")] == ["re-judging c002 (1/1)"]
