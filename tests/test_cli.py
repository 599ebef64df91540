"""`kevo-agent evaluate FILE [FILE ...]`: one JSON object per file with --json, exit 0/1/2, one-line
errors naming the file, several files judged in order in one worker pool."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

import candidates as C
from agent.cli import COMMANDS, UsageError, _read_candidate, main
from agent.cli_parser import EXIT_CODES
from conftest import ROOT, config_with

NO_CACHE: list[str] = []        # --config: the project's config with the verdict cache off (the fixture below)


@pytest.fixture(scope="module", autouse=True)
def _judged_afresh(tmp_path_factory):
    """Each file is judged by the stages, never given a verdict an earlier run left in runs/.verdicts."""
    path = tmp_path_factory.mktemp("cli") / "config.yaml"
    path.write_text(yaml.safe_dump(config_with().model_dump(mode="json"), sort_keys=False))
    NO_CACHE[:] = ["--config", str(path)]


def kevo(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    config = [] if args[:1] == ("--config",) else NO_CACHE
    return subprocess.run([sys.executable, "-m", "agent.cli", *config, *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_json_output_is_exactly_one_object_with_the_documented_fields_and_exit_0(tmp_path):
    done = kevo("evaluate", "--json", "--until", "dispatch", str(ROOT / "knowledge/attention/decode_paged_splitkv.py"))
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)               # fails if anything else is on stdout
    assert set(verdict) == {"file", "ok", "accepted", "failed_stage", "reason", "stages"}
    assert verdict["file"].endswith("decode_paged_splitkv.py")
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


def test_several_files_are_judged_in_order_and_a_missing_one_or_a_folder_costs_only_its_own_line(tmp_path):
    """A folder and a missing file among candidates: each is one line on stderr naming it, the JSON
    stream keeps one object per file in the order given, and every other file is still judged."""
    bad = tmp_path / "bad.py"
    bad.write_text(C.DROPS_NEWEST_TOKEN)
    empty = tmp_path / "empty.py"
    empty.write_text("import torch\n")
    good = str(ROOT / "knowledge/attention/decode_paged_splitkv.py")
    missing, folder = str(tmp_path / "missing.py"), str(tmp_path)
    done = kevo("evaluate", "--json", "--until", "parity", good, missing, str(bad), folder, str(empty))
    assert done.returncode == 2, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [x["file"] for x in lines] == [good, missing, str(bad), folder, str(empty)]
    assert lines[0]["ok"] is True and [s["name"] for s in lines[0]["stages"]] == ["compile", "dispatch", "parity"]
    assert lines[2]["failed_stage"] == "parity" and "max abs error" in lines[2]["reason"]
    assert lines[4]["failed_stage"] == "compile"
    assert "no such file" in lines[1]["error"] and "is a folder" in lines[3]["error"]
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 2 and missing in errors[0] and "no such file" in errors[0]
    assert folder in errors[1] and "is a folder" in errors[1] and "Traceback" not in done.stderr


def test_several_files_without_json_print_a_block_each_and_exit_1_when_one_is_rejected(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n")
    good = str(ROOT / "knowledge/attention/decode_paged_splitkv.py")
    done = kevo("evaluate", "--until", "compile", str(bad), good)
    assert done.returncode == 1, done.stderr
    out = done.stdout                                   # a block each (a table may wrap a long name), in order
    assert out.count("┏") == 2 and out.index("rejected at compile") < out.index("passed every stage that ran")


def help_of(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*args, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_documents_the_exit_codes():
    done = kevo("evaluate", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "exit status: 0 every file passed every stage that ran" in text and "1 at least one was rejected" in text
    assert "2 a file could not be judged" in text


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_help_lists_its_exit_codes_and_takes_config(capsys, command):
    text = help_of(capsys, command)
    assert EXIT_CODES[command], command
    for code, why in EXIT_CODES[command].items():
        assert f"{code} {' '.join(why.split())}" in text, (command, code)
    assert "--config PATH config file" in text and "before or after the subcommand" in text


def test_evaluate_and_replay_help_list_the_targets_and_stages(capsys):
    from harness.stages import STAGE_NAMES
    from harness.targets import TARGETS
    evaluate = help_of(capsys, "evaluate")
    assert f"--target TARGET one of: {', '.join(TARGETS)}" in evaluate
    assert f"--until STAGE stop after this stage, one of: {', '.join(STAGE_NAMES)}" in evaluate
    assert f"one of: {', '.join(STAGE_NAMES)}" in help_of(capsys, "replay")


@pytest.mark.parametrize("where", ["before", "after"])
def test_config_is_taken_before_or_after_the_subcommand(capsys, tmp_path, where):
    bad = tmp_path / "typo.yaml"
    bad.write_text((ROOT / "config.yaml").read_text().replace("tolerance_factor:", "tolerence_factor:"))
    args = ["--config", str(bad), "ledger", "r1"] if where == "before" else ["ledger", "r1", "--config", str(bad)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{bad}: 2 errors: stages.parity.tolerence_factor: unknown key" in err and len(err.splitlines()) == 1


def test_a_candidate_path_that_cannot_be_read_says_why(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "dangling.py").symlink_to(tmp_path / "gone.py")
    os.mkfifo(tmp_path / "fifo.py")
    (tmp_path / "latin1.py").write_bytes(b"# caf\xe9\n")
    why = {"folder": "is a folder, not a candidate file", "missing.py": "no such file",
           "dangling.py": "a link to a missing file", "fifo.py": "not a regular file",
           "latin1.py": "cannot read (not UTF-8 text: invalid continuation byte at byte 5)"}
    for name, words in why.items():
        with pytest.raises(UsageError) as err:
            _read_candidate(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}: {words}"), (name, str(err.value))
