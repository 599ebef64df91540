"""`kevo-agent run`: with the built-in proposer it runs the loop, writes the ledger and says plainly
which stages it could not run here; what stops it before or during a run is one line on stderr, exit 2."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import yaml

from conftest import ROOT, config_with
from fakes.llm_server import FakeLLM
from test_agent_unattended import SMALL

from agent.run.session import LOCK_NAME


def kevo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)


def config_file(tmp_path, **overrides) -> str:
    """The run's config, its candidates judged on the small parity plan (SMALL): these tests are about the command."""
    cfg = config_with(**{"agent.runs_dir": str(tmp_path / "runs"), "agent.ops": ["decode"], **SMALL, **overrides})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return str(path)


def test_offline_run_writes_a_ledger_and_says_which_stages_could_not_run(tmp_path):
    done = kevo("run", "--config", config_file(tmp_path), "--max-candidates", "2", "--run-id", "cli")
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    assert "c001 [decode] passed the correctness stages (compile, dispatch, parity); not timed" in out and "c002 [decode]" in out
    assert "run ended: 2 candidates reached" in out
    assert "passed the correctness stages only (nothing timed)" in out and "nothing was timed or accepted here" in out
    assert "not run here: microbench: skipped: needs CUDA" in out and "not run here: replay:" in out
    assert f"ledger: {tmp_path / 'runs' / 'cli'}" in out
    log = subprocess.run(["git", "log", "--format=%s"], cwd=tmp_path / "runs" / "cli", capture_output=True, text=True)
    subjects = log.stdout.splitlines()                            # end, two candidates, start
    assert len(subjects) == 4 and subjects[0].startswith("end cli:") and subjects[3].startswith("start cli:")
    for cid, line in zip(("c002", "c001"), subjects[1:3]):        # `c001 decode BLOCK_N 64 -> 128: passed at parity`
        assert re.fullmatch(rf"{cid} decode .+ -> .+: passed at parity", line) and len(line) <= 72, line
    assert not (tmp_path / "runs" / "cli" / LOCK_NAME).exists()  # a run that ended in order leaves no lock file


def test_run_errors_are_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    cfg = config_file(tmp_path)
    (tmp_path / "runs" / "taken").mkdir(parents=True)
    (tmp_path / "runs" / "taken" / "notes.txt").write_text("mine")
    cases = {
        ("run", "--provider", "mistral"): "unknown provider 'mistral'",
        ("run", "--provider", "openai"): "OPENAI_API_KEY is not set; providers.openai needs it",
        ("run", "--budget-minutes", "0"): "--budget-minutes must be positive",
        ("run", "--run-id", "../escape"): "--run-id '../escape': use letters, digits",
        ("run", "--run-id", "taken"): "exists and is not a kevo run; give another --run-id",
        ("run", "--provider", "openai", "--model", "gpt-unpriced"): "providers.prices has no entry for model 'gpt-unpriced'",
    }
    for args, words in cases.items():
        done = kevo("--config", cfg, *args, env=env if "gpt-unpriced" not in args else {**env, "OPENAI_API_KEY": "x"})
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
        assert words in done.stderr, (args, done.stderr)


def test_a_refused_key_is_said_in_one_line_before_anything_starts(tmp_path):
    """A wrong key is found by one call that costs no tokens, before torch loads and the heads are
    evaluated (minutes on a GPU): no run folder is made and nothing is asked of the planner. A key refused
    later in a run (revoked overnight) ends it with a commit: tests/test_agent_loop_llm.py."""
    with FakeLLM({"fake-planner": ["never asked"]}, keys={"sk-the-right-key"}) as fake:
        cfg = config_file(tmp_path, **{"providers.openai.base_url": fake.openai_url,
                                       "providers.openai.planner_model": "fake-planner",
                                       "providers.prices.fake-planner": {"input": 1.0, "output": 1.0}})
        done = kevo("--config", cfg, "run", "--provider", "openai", "--run-id", "auth",
                    env={**os.environ, "OPENAI_API_KEY": "sk-wrong-key-123456"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "kevo-agent: openai: authentication failed (401 fake: incorrect API key provided); check OPENAI_API_KEY"]
    assert not (tmp_path / "runs" / "auth").exists()
    assert len(fake.listed) == 1 and fake.seen == []
