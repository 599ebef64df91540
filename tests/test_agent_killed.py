"""`kevo-agent run` as a process, stopped the ways an unattended run gets stopped: SIGKILL at a random
moment of its start; SIGTERM, which finishes the candidate being evaluated, commits it and ends the run
(exit 143) — while that run is alive, a second run on the same folder is refused with one line naming
it; SIGKILL at random moments (seeded) while it proposes, evaluates and commits; each time resumed, then
the run finished. The ledger reads as if nothing had happened: git fsck clean after every kill, the
working tree the last commit, candidate ids contiguous, each committed with a verdict once, every
committed proposal evaluated, summary.json agreeing with the candidates. The LLM is a fake service on
loopback that always answers. Each process pays for torch and the worker pool (~8 s here), hence few kills."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import yaml

from conftest import ROOT, config_with
from fakes import scripts as S
from fakes.llm_server import FakeLLM
from test_agent_unattended import SMALL

from agent.run.session import LOCK_NAME

SEED = 20261130
KILLS = 1                               # while working, after an early one (many more, cheaper: test_ledger_killed.py)
N = 5                                   # candidates in all
PLANNER, CODER = "fake-planner", "fake-coder"
KEY = "sk-test-killed-0001"


def git(root, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=check)


def head_sha(root) -> str:
    if not (root / ".git").exists():
        return ""
    return git(root, "rev-parse", "--verify", "-q", "HEAD", check=False).stdout.strip()


def head_subject(root) -> str:
    if not (root / ".git").exists():
        return ""
    return git(root, "log", "-1", "--format=%s", check=False).stdout.strip()


def trailer(root, key: str) -> list[str]:
    out = git(root, "log", f"--format=%(trailers:key={key},valueonly,separator=%x2C)").stdout
    return [v for line in out.splitlines() for v in line.split(",") if v.strip()]


def holder(root) -> int | None:
    """The pid the run folder's lock file names (it may be stale: the lock itself is a flock)."""
    try:
        return json.loads((root / LOCK_NAME).read_text() or "{}").get("pid")
    except (OSError, ValueError):
        return None


def committed_problems(root) -> list[str]:
    """What is wrong with the ledger's committed state (the working tree may hold a killed commit's files)."""
    if not (root / ".git").exists() or git(root, "rev-parse", "--verify", "-q", "HEAD", check=False).returncode:
        return []                                         # stopped before its first commit: nothing to check
    problems = []
    fsck = git(root, "fsck", "--strict", "--no-dangling", check=False)
    if fsck.returncode or "error" in fsck.stderr:
        problems.append(f"git fsck: {fsck.stderr.strip()}")
    ids = trailer(root, "Candidate")
    problems += [f"{cid} committed with a verdict {n} times" for cid, n in Counter(ids).items() if n > 1]
    files = set(git(root, "ls-tree", "-r", "--name-only", "HEAD").stdout.split())
    rounds = dict(line.split() for line in git(root, "log", "--format=%(trailers:key=Candidate,key=Rounds,valueonly,"
                                                            "separator=%x20)").stdout.splitlines() if line.strip())
    for cid in ids:
        for name in ("record.json", "candidate.py") if rounds[cid] != "0" else ("record.json",):
            if f"candidates/{cid}/{name}" not in files:
                problems.append(f"{cid}: no {name} committed")
    return problems


def kevo(*args: str, env: dict, log) -> subprocess.Popen:
    """`kevo-agent` in the background, its output to files (a pipe nobody reads could block it)."""
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=err, text=True, start_new_session=True)
    proc.log = log
    return proc


def wait_for(condition, proc: subprocess.Popen, limit: float = 120.0) -> None:
    t0 = time.monotonic()
    while not condition():
        assert proc.poll() is None, f"kevo ended early ({proc.returncode}): {open(f'{proc.log}.err').read()[-2000:]}"
        assert time.monotonic() - t0 < limit, "kevo made no progress"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("killed")
    root = tmp / "runs" / "k"
    rng = random.Random(SEED)
    seen: dict = {"after_kill": []}
    with FakeLLM({PLANNER: [S.claim(1.3)] * 100, CODER: [S.GOOD] * 100}) as fake:
        cfg = config_with(**{
            "agent.runs_dir": str(tmp / "runs"), "agent.ops": ["decode"], "agent.provider": "openai",
            "agent.max_candidates": N, "agent.budget_minutes.cpu": 30, "providers.openai.base_url": fake.openai_url,
            "providers.openai.planner_model": PLANNER, "providers.openai.coder_model": CODER,
            f"providers.prices.{PLANNER}": {"input": 2.0, "output": 8.0},
            f"providers.prices.{CODER}": {"input": 1.0, "output": 4.0}, **SMALL})
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        env = {**os.environ, "OPENAI_API_KEY": KEY}
        run = ("--config", str(config), "run", "--run-id", "k")

        # SIGKILL while it starts: imports, the worker pool, the heads.
        proc = kevo(*run, env=env, log=tmp / "early")
        seen["early"] = rng.uniform(1.5, 6.0)
        try:
            proc.wait(timeout=seen["early"])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        seen["after_kill"].append((seen["early"], head_subject(root), committed_problems(root), proc.returncode))

        # SIGTERM while a proposal is being evaluated; before that, a second run on the folder is refused.
        before = head_sha(root)             # an earlier session may have ended on a "propose" commit of its own
        proc = kevo(*run, env=env, log=tmp / "term")
        wait_for(lambda: holder(root) == proc.pid, proc)
        second = subprocess.run([sys.executable, "-m", "agent.cli", "--config", str(config), "run", "--resume", str(root)],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        seen["second"], seen["holder"] = second, proc.pid
        wait_for(lambda: head_sha(root) != before and head_subject(root).startswith("propose "), proc)
        # With overlap the next proposal is committed while the current one is judged: the candidate in
        # evaluation is the earliest proposed one without a verdict, not the newest proposal.
        proposed = [line.split()[1] for line in reversed(git(root, "log", "--format=%s").stdout.splitlines())
                    if line.startswith("propose ")]
        seen["evaluating"] = next(c for c in proposed if c not in trailer(root, "Candidate"))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        seen["term"] = (proc.returncode, (tmp / "term.err").read_text(), head_subject(root), trailer(root, "Candidate"))

        # SIGKILL at random moments once it works: proposing, evaluating, committing.
        for i in range(KILLS):
            before = head_sha(root)
            proc = kevo(*run, env=env, log=tmp / f"kill{i}")
            wait_for(lambda: head_sha(root) != before, proc)               # its resume commit
            delay = rng.uniform(0.0, 3.5)
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            seen["after_kill"].append((round(delay, 2), head_subject(root), committed_problems(root), proc.returncode))

        final = subprocess.run([sys.executable, "-m", "agent.cli", *run], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=300)
        seen["final"] = final
    seen["root"] = root
    return seen


def test_sigterm_finishes_the_candidate_being_evaluated_commits_it_and_stops(chain):
    rc, err, last, verdicts = chain["term"]
    assert rc == 128 + signal.SIGTERM
    assert last == "end k: interrupted (SIGTERM)"
    assert chain["evaluating"] in verdicts                # the candidate in evaluation got its verdict first
    assert err.strip().splitlines()[-1] == f"kevo-agent: run interrupted (SIGTERM); resume: kevo-agent run --resume {chain['root']}"


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(chain):
    second = chain["second"]
    assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1
    assert re.search(rf"is in use by pid {chain['holder']} on {re.escape(os.uname().nodename)} since \S+ "
                     r"\(kevo-agent --config \S+ run --run-id k\)", second.stderr), second.stderr


def test_killed_at_random_moments_and_resumed_the_ledger_reads_as_if_never_killed(chain):
    for delay, last, problems, returncode in chain["after_kill"]:
        assert returncode == -signal.SIGKILL, (delay, last, returncode)     # the kill landed on a running run
        assert problems == [], (delay, last)             # the committed state is whole after every SIGKILL
    final, root = chain["final"], chain["root"]
    assert final.returncode == 0, final.stderr
    assert f"run ended: {N} candidates reached" in " ".join(final.stdout.split())
    assert committed_problems(root) == []
    assert git(root, "status", "--porcelain").stdout == ""
    ids = trailer(root, "Candidate")
    assert sorted(ids) == [f"c{i:03d}" for i in range(1, N + 1)]          # contiguous, each evaluated once
    assert set(trailer(root, "Proposal")) <= set(ids)                     # no committed proposal lost
    summary = json.loads((root / "summary.json").read_text())
    records = [json.loads((root / f"candidates/{c}/record.json").read_text()) for c in ids]
    assert summary["candidates"] == N == sum(summary["funnel"].values())
    assert summary["funnel"]["passed"] == sum(r["outcome"] == "passed" for r in records) == N
    assert summary["cost_usd"] >= sum(r["cost_usd"] for r in records) - 1e-6 > 0
    assert f"Stopped: {N} candidates reached" in (root / "summary.md").read_text()
