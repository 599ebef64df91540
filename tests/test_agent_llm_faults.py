"""The loop against a service that misbehaves, through the real SDKs on loopback: a proxy's HTML page and
invalid JSON mid-run cost a retry and are accounted for in the summary and the end commit; a hung call
does not hold the run past its time budget; an answered claim is committed at once, so a fatal coder
failure loses nothing and the resumed run does not buy it again; a repair after a reply cut at the
output-token limit says it was cut; a call whose worst case passes the cost limit is not made; a service
never reached ends the run with one line naming it (exit 2 from the command line, within a minute);
and a signal to the whole process group, as Ctrl-C or `timeout` sends it, stops the run in order."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from conftest import ROOT, config_with
from fakes import scripts as S
from fakes.llm_server import FakeLLM, Step
from test_agent_unattended import CODER, PLANNER, SMALL, go, llm_config

KEY = "sk-test-llm-faults-0001"


def git(root, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def exchanges(root, cid: str) -> list[dict]:
    return [json.loads(line) for line in (root / f"candidates/{cid}/exchanges.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One runs folder for the module's runs in this process (each its own run id), its verdict cache on and
    empty at first: the head is judged once, not once a run; what these tests prove is the providers'
    faults, the same whether a verdict came from the stages or from the cache."""
    return tmp_path_factory.mktemp("runs")


def faulty(fake: FakeLLM, runs, **more):
    return llm_config(fake, runs, **{"executor.verdict_cache": True, **more})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pages_and_invalid_json_mid_run_cost_a_retry_and_the_summary_accounts_for_them(pool, runs, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeLLM({PLANNER: [Step.odd("html"), S.claim(1.3)], CODER: [Step.odd("bad-json"), S.GOOD]}) as fake:
        result = go(faulty(fake, runs), pool, provider="openai", run_id="pages", max_candidates=1)
    assert not result.fatal and [r.outcome for r in result.history] == ["passed"]
    claim, code = exchanges(result.ledger, "c001")
    assert claim["attempts"] == code["attempts"] == 2
    assert "text/html" in claim["faults"][0] and "invalid JSON" in code["faults"][0]
    fared = json.loads((result.ledger / "summary.json").read_text())["providers"]["openai"]
    assert (fared["calls"], fared["answered"], fared["faults"]["malformed"]) == (4, 2, 2)
    line = "openai: 4 calls, 2 answered, 2 failed (2 malformed), 0 cut by the run's stop; 0 outage(s), 0 s down"
    assert result.providers == [line] and f"- {line}" in (result.ledger / "summary.md").read_text()
    assert git(result.ledger, "log", "-1", "--format=%(trailers:key=Providers,valueonly)").strip() == line


def test_a_hung_call_does_not_hold_the_run_past_its_time_budget(pool, runs, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeLLM({PLANNER: [Step.odd("hang", 300)] + [S.claim(1.3)] * 3, CODER: [S.GOOD] * 3}) as fake:
        cfg = faulty(fake, runs, **{"providers.idle_timeout_s": 120})
        result = go(cfg, pool, provider="openai", run_id="hung", budget_minutes=0.2)
        asked = len(fake.seen)
    summary = json.loads((result.ledger / "summary.json").read_text())
    assert not result.fatal and result.stop == "time budget of 0.2 min spent"
    assert summary["elapsed_s"] < 0.2 * 60 + 3, summary["elapsed_s"]        # not the hang's 300 s
    assert asked == 1 and summary["providers"]["openai"]["cut"] == 1        # nothing bought after the budget


def test_an_answered_claim_outlives_a_fatal_coder_failure_and_is_not_bought_again(pool, runs, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeLLM({PLANNER: [S.claim(1.3)], CODER: [Step.error(401, "key revoked")]}) as fake:
        first = go(faulty(fake, runs), pool, provider="openai", run_id="paid", max_candidates=1)
    assert first.fatal and first.history == []
    assert [e["purpose"] for e in exchanges(first.ledger, "c001")] == ["claim"]           # committed, not lost
    assert "paid c001 planner claim" in git(first.ledger, "log", "--format=%s")
    spent = json.loads((first.ledger / "summary.json").read_text())["cost_usd"]
    assert spent == exchanges(first.ledger, "c001")[0]["cost_usd"] > 0

    cut = "Here is the file.\n```python\ndef decode(q, k_cache,"
    with FakeLLM({PLANNER: [], CODER: [Step.cut(cut), S.GOOD]}) as fake:      # no planner reply to give
        again = go(faulty(fake, runs), pool, provider="openai", run_id="paid", max_candidates=1)
        asked = [s.model for s in fake.seen]
        repair = fake.seen[-1].body["messages"][-1]["content"]
    assert not again.fatal and [(r.id, r.outcome) for r in again.history] == [("c001", "passed")]
    assert asked == [CODER, CODER]                                  # the claim was not bought again
    done = exchanges(again.ledger, "c001")
    assert [e["purpose"] for e in done] == ["claim", "code", "code-format-repair"]
    assert done[0]["note"].endswith("paid for in an earlier session: not asked again")
    assert "the reply was cut at the output-token limit" in done[1]["note"] and done[1]["finish"] == "length"
    assert repair.startswith("Your reply was cut at the output-token limit (16000 tokens) before it ended.")
    summary = json.loads((again.ledger / "summary.json").read_text())
    assert summary["cost_usd"] == again.history[0].cost_usd == round(sum(e["cost_usd"] for e in done), 6)
    assert "paid for before, not bought again: c001 (planner claim)" in git(again.ledger, "log", "--format=%B",
                                                                            "--grep=^resume")


def test_a_call_whose_worst_case_passes_the_cost_limit_ends_the_run_before_it_is_made(pool, runs, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeLLM({PLANNER: [S.claim(1.3)], CODER: [S.GOOD]}) as fake:
        result = go(faulty(fake, runs), pool, provider="openai", run_id="cost", max_cost_usd=0.01)
        assert fake.seen == []
    assert not result.fatal and result.cost_usd == 0
    assert re.fullmatch(r"cost limit of \$0.01 reached: the next call \(fake-planner\) could cost up to \$0\.1\d+, "
                        r"\$0\.0100 is left", result.stop), result.stop


def test_a_service_never_reached_ends_the_run_with_one_line_naming_it(pool, runs, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    url = f"http://127.0.0.1:{closed_port()}/v1"
    cfg = config_with(**{"agent.runs_dir": str(runs), "executor.verdict_cache": True, "agent.ops": ["decode"],
                         "providers.openai.base_url": url, "providers.retry.initial_s": 0.2,
                         "providers.outage.unreached_s": 2.0, **SMALL})
    t0 = time.monotonic()
    result = go(cfg, pool, provider="openai", run_id="nowhere")
    assert result.fatal and time.monotonic() - t0 < 30 and "\n" not in result.stop
    assert result.stop.startswith(f"openai: {url} never answered since the run started (")
    assert result.providers[0].startswith("openai: ") and " 0 answered, " in result.providers[0]
    assert git(result.ledger, "log", "-1", "--format=%(trailers:key=Fatal,valueonly)").strip() == "true"


def test_the_command_exits_2_within_a_minute_when_the_service_was_never_reached(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    cfg = config_with(**{"agent.runs_dir": str(tmp_path / "runs"), "providers.openai.base_url": url,
                         "providers.outage.unreached_s": 1.0})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "agent.cli", "--config", str(tmp_path / "config.yaml"), "run",
                           "--provider", "openai", "--run-id", "x"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OPENAI_API_KEY": KEY}, timeout=120)
    assert done.returncode == 2 and time.monotonic() - t0 < 60
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "Traceback" not in done.stderr
    assert f"openai: {url} never answered since the run started" in done.stderr


def _run_then_signal_the_group(tmp_path, signum: int) -> tuple[subprocess.CompletedProcess, str, str]:
    cfg = config_with(**{"agent.runs_dir": str(tmp_path / "runs"), "agent.ops": ["decode"], **SMALL})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    root = tmp_path / "runs" / "g"
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "--config", str(tmp_path / "config.yaml"), "run",
                                 "--run-id", "g"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)         # its own process group, as a terminal's job
    t0 = time.monotonic()
    while not subprocess.run(["git", "log", "--format=%s"], cwd=root if root.exists() else tmp_path,
                             capture_output=True, text=True).stdout:   # the start committed: the loop is running
        assert proc.poll() is None and time.monotonic() - t0 < 180, (tmp_path / "err").read_text()[-2000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signum)                 # kevo, its worker pool and its git children, as Ctrl-C does
    proc.wait(timeout=120)
    return proc, git(root, "log", "-1", "--format=%s").strip(), (tmp_path / "err").read_text()


def test_ctrl_c_to_the_process_group_stops_the_run_in_order(tmp_path):
    proc, last, err = _run_then_signal_the_group(tmp_path, signal.SIGINT)
    assert "Traceback" not in err and proc.returncode == 130, err[-3000:]
    assert last == "end g: interrupted (SIGINT)"


def test_sigterm_to_the_process_group_stops_the_run_in_order(tmp_path):
    proc, last, err = _run_then_signal_the_group(tmp_path, signal.SIGTERM)
    assert "Traceback" not in err and proc.returncode == 143, err[-3000:]
    assert last == "end g: interrupted (SIGTERM)"
