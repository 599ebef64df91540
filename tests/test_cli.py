"""`kevo-agent evaluate FILE [FILE ...]`: one JSON object per file with --json, exit 0/1/2, one-line
errors naming the file, several files judged in order in one worker pool.

Each `evaluate` process costs an interpreter, torch and a worker pool: one run of several files (the
`several` fixture) and one without --json (`tables`) are read by several tests each."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest
import yaml

import candidates as C
from agent.cli import COMMANDS, main
from agent.cli_evaluate import read_candidate
from agent.cli_parser import UsageError
from agent.cli_parser import EXIT_CODES
from conftest import CPU_GATES, ROOT, config_with
from harness.stages import STAGE_NAMES
from test_agent_unattended import SHORT_REPLAY, SMALL

NO_CACHE: list[str] = []        # --config: the project's config with the verdict cache off (the fixture below)
GOOD = str(ROOT / "knowledge/attention/decode_paged_splitkv.py")
FIELDS = {"file", "ok", "accepted", "failed_stage", "reason", "stages", "spans", "wall_s"}


@pytest.fixture(scope="module", autouse=True)
def _judged_afresh(tmp_path_factory):
    """Each file is judged by the stages, never given a verdict an earlier run left in runs/.verdicts; on
    the loop tests' small CPU shapes (what the command prints does not depend on them)."""
    path = tmp_path_factory.mktemp("cli") / "config.yaml"
    path.write_text(yaml.safe_dump(config_with(**SMALL).model_dump(mode="json"), sort_keys=False))
    NO_CACHE[:] = ["--config", str(path)]


def kevo(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    config = [] if args[:1] == ("--config",) else NO_CACHE
    return subprocess.run([sys.executable, "-m", "agent.cli", *config, *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.fixture(scope="module")
def several(tmp_path_factory) -> tuple[list[str], subprocess.CompletedProcess]:
    """`evaluate --json --until parity` of a good kernel, a missing file, a kernel that fails parity, a
    folder and a file that fails compile, in that order: the files given, and the finished process."""
    folder = tmp_path_factory.mktemp("several")
    (folder / "bad.py").write_text(C.DROPS_NEWEST_TOKEN)
    (folder / "empty.py").write_text("import torch\n")
    files = [GOOD, str(folder / "missing.py"), str(folder / "bad.py"), str(folder), str(folder / "empty.py")]
    return files, kevo("evaluate", "--json", "--until", "parity", *files)


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> subprocess.CompletedProcess:
    """`evaluate --progress --until compile` without --json of a file that fails compile, then a good kernel."""
    bad = tmp_path_factory.mktemp("tables") / "bad.py"
    bad.write_text("import torch\n")
    return kevo("evaluate", "--progress", "--until", "compile", str(bad), GOOD)


def test_json_output_is_one_object_per_file_with_the_documented_fields(several):
    files, done = several
    lines = [json.loads(line) for line in done.stdout.splitlines()]      # fails if anything else is on stdout
    assert len(lines) == len(files), done.stdout
    for verdict in (lines[0], lines[2], lines[4]):
        assert set(verdict) == FIELDS
        for stage in verdict["stages"]:
            assert set(stage) == {"name", "status", "reason", "seconds", "metrics"}
            assert all(isinstance(v, float) for v in stage["metrics"].values())
    assert lines[0]["ok"] is True and lines[0]["accepted"] is False and lines[0]["failed_stage"] is None
    assert set(lines[1]) == set(lines[3]) == {"file", "error"}


def test_each_verdict_says_where_the_wall_time_went_since_the_process_started(several, tables):
    """The first file's spans run from the interpreter's start through the start-ups to its last stage, one
    step after another within the wall time, with the zygote's, the workers' and the health check's parts
    beside them; a later file's, only its own (after the first's, on the same clock); and the table says it too."""
    first, later = json.loads(several[1].stdout.splitlines()[0]), json.loads(several[1].stdout.splitlines()[2])
    steps = [s for s in first["spans"] if "." not in s["name"]]
    assert [s["name"] for s in steps] == ["python", "imports", "config", "launch", "torch", "read", "pool", "health",
                                          "prepare", "compile", "dispatch", "parity"]
    assert steps[0]["start"] == 0.0 and all(s["start"] <= s["end"] for s in first["spans"])
    assert all(a["end"] <= b["start"] for a, b in zip(steps, steps[1:])), steps           # one after another
    assert steps[-1]["end"] <= first["wall_s"] and sum(s["end"] - s["start"] for s in steps) <= first["wall_s"]
    ran = {s["name"]: s for s in steps}
    for stage in first["stages"]:                   # each stage's own seconds lie within its span (ms rounding)
        assert ran[stage["name"]]["end"] - ran[stage["name"]]["start"] >= stage["seconds"] - 0.002, (stage, ran)
    beside = {s["name"] for s in first["spans"]} - set(ran)
    assert {"zygote.python", "zygote.imports", "zygote.preload", "health.here", "health.worker", "worker.start",
            "worker.warmup"} <= beside
    assert [s["name"] for s in later["spans"]] == ["prepare", "compile", "dispatch", "parity"]
    assert later["spans"][0]["start"] >= steps[-1]["end"] and later["wall_s"] >= later["spans"][-1]["end"]
    assert "time: " in tables.stdout and " since the process started: python " in tables.stdout


def test_a_file_that_passes_every_stage_that_ran_exits_0_with_exactly_one_object(capfd):
    assert main([*NO_CACHE, "evaluate", "--json", "--until", "dispatch", GOOD]) == 0
    out = capfd.readouterr().out                    # the worker pool's output too: its processes share the fd
    verdict = json.loads(out)                       # fails if anything else is on stdout
    assert verdict["file"] == GOOD and verdict["ok"] is True and verdict["failed_stage"] is None
    assert [s["name"] for s in verdict["stages"]] == ["compile", "dispatch"]


def test_other_heads_given_are_served_beside_a_file_in_its_replay_and_named_in_the_json(tmp_path, capfd):
    """A prefill file judged with the decode head beside it: on a CPU the replay's gates serve it, and the
    served process's own accounting says every decode call was that head's (a short replay: SHORT_REPLAY)."""
    config = tmp_path / "gates.yaml"
    config.write_text(yaml.safe_dump(config_with(**SMALL, **SHORT_REPLAY, **CPU_GATES).model_dump(mode="json"),
                                     sort_keys=False))
    prefill = str(ROOT / "knowledge/attention/prefill_causal_tiled.py")
    assert main(["--config", str(config), "evaluate", "--json", "--other-head", f"decode={GOOD}", prefill]) == 0
    verdict = json.loads(capfd.readouterr().out)
    assert verdict["other_heads"] == {"decode": GOOD} and verdict["stages"][-1]["name"] == "replay"
    assert re.search(r"decode not implemented \((\d+) of \1 calls ran its head beside the candidate",
                     verdict["stages"][-1]["reason"]), verdict["stages"][-1]["reason"]


def test_rejected_candidate_exits_1_and_names_the_stage(several, tables):
    assert tables.returncode == 1, tables.stderr
    assert json.loads(several[1].stdout.splitlines()[2])["failed_stage"] == "parity"


def test_readable_table_without_json(tables):
    assert "compile" in tables.stdout and "failed" in tables.stdout and "REJECTED" in tables.stdout


def test_command_errors_are_one_line_and_exit_2(tmp_path, capfd):
    bad_config = tmp_path / "config.yaml"
    bad_config.write_text((ROOT / "config.yaml").read_text().replace("tolerance_factor:", "tolerence_factor:"))
    cases = {
        ("evaluate", str(tmp_path / "missing.py")): "no such file",
        ("evaluate", "--target", "rmsnorm", GOOD): "unknown target 'rmsnorm'",
        ("evaluate", "--until", "benchmark", GOOD): "unknown stage 'benchmark'",
        ("evaluate", "--head", str(tmp_path / "best.py"), GOOD): f"--head {tmp_path / 'best.py'}: no such file",
        ("evaluate", "--other-head", str(tmp_path / "d.py"), GOOD): "give OP=FILE",
        ("evaluate", "--other-head", f"decode={tmp_path / 'd.py'}", GOOD): f"--other-head decode={tmp_path / 'd.py'}: no such file",
        ("evaluate", "--other-head", f"rmsnorm={GOOD}", GOOD): "attention has no op 'rmsnorm'; its ops: decode, prefill",
        ("evaluate", "--other-head", f"decode={GOOD}", "--other-head", f"decode={GOOD}", GOOD): "decode is given twice",
        ("--config", str(bad_config), "evaluate", GOOD): "stages.parity.tolerence_factor: unknown key (did you mean tolerance_factor?)",
    }
    for args, words in cases.items():              # in this process: none of them opens a worker pool
        config = [] if args[0] == "--config" else NO_CACHE
        assert main([*config, *args]) == 2, args
        out, err = capfd.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert words in err and "Traceback" not in err
    done = kevo("evaluate", "--until", "benchmark", GOOD)             # and as a process, torch imported
    assert done.returncode == 2 and done.stdout == "" and done.stderr.strip().splitlines() == [
        f"kevo-agent: unknown stage 'benchmark'; stages: {', '.join(STAGE_NAMES)}"], done.stderr


def test_several_files_are_judged_in_order_and_a_missing_one_or_a_folder_costs_only_its_own_line(several):
    """A folder and a missing file among candidates: each is one line on stderr naming it, the JSON
    stream keeps one object per file in the order given, and every other file is still judged."""
    (good, missing, bad, folder, empty), done = several
    assert done.returncode == 2, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [x["file"] for x in lines] == [good, missing, bad, folder, empty]
    assert lines[0]["ok"] is True and [s["name"] for s in lines[0]["stages"]] == ["compile", "dispatch", "parity"]
    assert lines[2]["failed_stage"] == "parity" and "max abs error" in lines[2]["reason"]
    assert lines[4]["failed_stage"] == "compile"
    assert "no such file" in lines[1]["error"] and "is a folder" in lines[3]["error"]
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 2 and missing in errors[0] and "no such file" in errors[0]
    assert folder in errors[1] and "is a folder" in errors[1] and "Traceback" not in done.stderr


def test_several_files_without_json_print_a_block_each_and_exit_1_when_one_is_rejected(tables):
    assert tables.returncode == 1, tables.stderr
    out = tables.stdout                                 # a block each (a table may wrap a long name), in order
    assert out.count("┏") == 2 and out.index("rejected at compile") < out.index("passed every stage that ran")


def test_progress_names_each_files_stage_on_stderr_as_it_starts(tables):
    lines = [line for line in tables.stderr.splitlines() if line.startswith("kevo-agent: ")]
    stages = [line.split(" s: ", 1)[1] for line in lines]
    bad = stages[0].split(": ")[0]
    assert bad.endswith("bad.py") and stages == [f"{bad}: compile", f"{GOOD}: compile"], tables.stderr
    seconds = [float(line.split(": ")[1].removesuffix(" s")) for line in lines]
    assert 0 < seconds[0] <= seconds[1], lines


def help_of(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*args, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_documents_the_exit_codes(capsys):
    text = help_of(capsys, "evaluate")
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
            read_candidate(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}: {words}"), (name, str(err.value))
