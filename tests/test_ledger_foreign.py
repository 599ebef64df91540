"""A ledger from elsewhere (a run copied in to resume, re-judge or report on) is someone else's folder: kevo runs
none of the commands its .git could name (hooks, a config's fsmonitor), hands git no secret, writes nothing through
a symbolic link left in it, and reads no candidate id that is a path. Each attack below was found by an attacker's
review (2026-12-05) and worked before."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from agent.ledger.repository import Ledger, LedgerError
from agent.ledger.store import open_repo
from agent.reading.report import write as write_report
from agent.run.session import LOCK_NAME, RunLock
from test_ledger import candidate, commit, git, new_ledger


def _plant_hooks(root, marker) -> None:
    for name in ("pre-commit", "commit-msg", "post-commit", "reference-transaction", "post-checkout"):
        hook = root / ".git" / "hooks" / name
        hook.write_text(f"#!/bin/sh\necho {name} >> {marker}\n")
        hook.chmod(hook.stat().st_mode | stat.S_IXUSR)


def test_hooks_left_in_a_ledger_run_for_none_of_kevos_commits_tags_or_resets(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    marker = tmp_path / "hooks-ran"
    _plant_hooks(ledger.root, marker)
    again = Ledger(ledger.root)
    commit(again, candidate("c001", "passed", "microbench", 1.5), new_best=True)      # a commit and a tag
    again.recover()
    assert not marker.exists(), marker.read_text()
    git(ledger.root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--allow-empty", "-q", "-m", "git runs them")
    assert "pre-commit" in marker.read_text()


def test_a_ledger_whose_git_config_names_a_command_is_refused_before_git_runs_it(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    marker = tmp_path / "fsmonitor-ran"
    git(ledger.root, "config", "core.fsmonitor", f"touch {marker}; false")
    with pytest.raises(LedgerError, match=r"config sets core\.fsmonitor, which kevo never writes"):
        Ledger(ledger.root)
    assert not marker.exists()


def test_a_ledger_whose_git_names_another_folders_config_as_its_own_is_refused_before_git_runs_its_filter(tmp_path):
    """.git/commondir makes git read the config (and objects, refs) of the folder it names: a clean .git/config
    beside it hid a filter command that `git status` and `git reset --hard` in recover() ran (attacker's review,
    2026-12-07)."""
    ledger = new_ledger(tmp_path / "r1")
    marker = tmp_path / "filter-ran"
    shutil.copytree(ledger.root / ".git", ledger.root / "common")
    with open(ledger.root / "common" / "config", "a") as f:
        f.write(f'[filter "x"]\n\tclean = touch {marker}; cat\n\tsmudge = touch {marker}; cat\n')
    (ledger.root / ".git" / "commondir").write_text("../common\n")
    (ledger.root / ".gitattributes").write_text("* filter=x\n")
    with pytest.raises(LedgerError, match="commondir hands git another folder's config"):
        Ledger(ledger.root).recover()
    assert not marker.exists()


@pytest.mark.parametrize("text, said", [
    ("[1, 2]", "not a JSON object naming its kernel's path"),
    ("{not json", "not a JSON object naming its kernel's path"),
    ('{"path": "heads/decode.py", "ref": "head:decode", "op": "decode", "speedup": "fast"}', "speedup"),
    ('{"path": "heads/decode.py", "ref": "head:decode", "op": "decode", "source": "evil"}', None),
], ids=["a-list", "not-json", "a-word-for-a-figure", "its-own-source"])
def test_a_head_record_from_elsewhere_reads_as_a_one_line_error_or_with_the_source_committed_beside_it(tmp_path, text,
                                                                                                      said):
    """heads/<op>.json is read back on resume, report and replay: malformed, it raised a bare KeyError or TypeError (a
    traceback); a `source` of its own raised TypeError (an attacker's review, 2026-12-07)."""
    ledger = new_ledger(tmp_path / "r1")
    (ledger.root / "heads" / "decode.json").write_text(text)
    git(ledger.root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "someone else's head record")
    if said is None:
        assert Ledger(ledger.root).heads()["decode"].source == "def decode(): pass\n"
    else:
        with pytest.raises(LedgerError, match=r"heads/decode\.json cannot be read by this kevo \(.*" + said):
            Ledger(ledger.root).heads()


def test_a_ledger_cloned_with_git_clone_still_opens(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    subprocess.run(["git", "clone", "-q", str(ledger.root), str(tmp_path / "copy")], check=True)
    assert Ledger(tmp_path / "copy").header().id == "r1"


def test_a_git_child_of_the_ledger_sees_no_secret_from_kevos_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KEVO_TEST_API_KEY", "sk-never-to-git-1234")
    repo = open_repo(new_ledger(tmp_path / "r1").root)
    seen = repo.git.execute([repo.git.GIT_PYTHON_GIT_EXECUTABLE, "-c", "alias.env=!env", "env"])
    assert "KEVO_TEST_API_KEY=" in seen and "sk-never-to-git-1234" not in seen


@pytest.mark.parametrize("planted", ["summary.json", "report.html", "candidates", LOCK_NAME])
def test_kevo_writes_nothing_through_a_symbolic_link_left_in_the_run_folder(tmp_path, planted):
    ledger = new_ledger(tmp_path / "r1")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine\n")
    target = victim if planted == "candidates" else victim / "notes.txt"
    if (ledger.root / planted).is_file():
        (ledger.root / planted).unlink()
    os.symlink(target, ledger.root / planted)
    with pytest.raises(LedgerError, match="is a symbolic link: kevo writes nothing through one"):
        if planted == "report.html":
            write_report(Ledger(ledger.root))
        elif planted == LOCK_NAME:
            RunLock(ledger.root).acquire()
        else:
            commit(Ledger(ledger.root), candidate("c001", "passed", "microbench", 1.5))
    assert sorted(p.name for p in victim.iterdir()) == ["notes.txt"] and (victim / "notes.txt").read_text() == "mine\n"


@pytest.mark.parametrize("said", ["../../../victim/trav", "c004"], ids=["a-path", "another-folders-id"])
def test_a_pending_proposal_is_read_only_if_its_id_names_its_own_folder(tmp_path, said):
    ledger = new_ledger(tmp_path / "r1")
    text = ('{"id": "%s", "op": "decode", "parent": "head:decode", "proposer": "openai:m/m", "outcome": "ready", '
            '"source": "# attacker-chosen\\n"}' % said)
    ledger.commit("propose c003", [], {"candidates/c003/proposal.json": text}, {"Proposal": "c003"})
    with pytest.raises(LedgerError, match="candidates/c003/proposal.json"):
        ledger.pending()
    assert not (tmp_path / "victim").exists()
