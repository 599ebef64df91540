"""`kevo-agent evaluate`: exactly one JSON object with --json, exit 0/1/2, one-line errors."""
from __future__ import annotations

import json
import subprocess
import sys

import candidates as C
from conftest import ROOT


def kevo(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_json_output_is_exactly_one_object_with_the_documented_fields_and_exit_0(tmp_path):
    done = kevo("evaluate", "--json", "--until", "dispatch", str(ROOT / "knowledge/attention/decode_paged_splitkv.py"))
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)               # fails if anything else is on stdout
    assert set(verdict) == {"ok", "accepted", "failed_stage", "reason", "stages"}
    assert verdict["ok"] is True and verdict["accepted"] is False and verdict["failed_stage"] is None
    for stage in verdict["stages"]:
        assert set(stage) == {"name", "status", "reason", "seconds", "metrics"}
        assert all(isinstance(v, float) for v in stage["metrics"].values())


def test_rejected_candidate_exits_1_and_names_the_stage(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(C.DROPS_NEWEST_TOKEN)
    done = kevo("evaluate", "--json", str(bad))
    assert done.returncode == 1
    assert json.loads(done.stdout)["failed_stage"] == "parity"


def test_readable_table_without_json(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n")
    done = kevo("evaluate", str(bad))
    assert done.returncode == 1
    assert "compile" in done.stdout and "failed" in done.stdout and "REJECTED" in done.stdout


def test_command_errors_are_one_line_and_exit_2(tmp_path):
    ok = str(ROOT / "knowledge/attention/decode_paged_splitkv.py")
    bad_config = tmp_path / "config.yaml"
    bad_config.write_text((ROOT / "config.yaml").read_text().replace("tolerance_factor:", "tolerence_factor:"))
    cases = {
        ("evaluate", str(tmp_path / "missing.py")): "no such file",
        ("evaluate", "--target", "rmsnorm", ok): "unknown target 'rmsnorm'",
        ("evaluate", "--until", "benchmark", ok): "unknown stage 'benchmark'",
        ("--config", str(bad_config), "evaluate", ok): "stages.parity.tolerence_factor: unknown key (did you mean tolerance_factor?)",
    }
    for args, words in cases.items():
        done = kevo(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert words in done.stderr and "Traceback" not in done.stderr
