"""The ledger under SIGKILL, many times: a process committing candidates through the real Ledger is
killed at seeded random moments (while it starts, writes files, adds to git's index, writes objects,
moves the branch, tags), then reopened the way a resumed run reopens it (`recover`) and writing goes
on. After every kill the repository is sound (`git fsck`), the working tree is the last commit, the
candidates read back are exactly the committed ones, numbered without gaps or repeats, each whole
(record, source, README), and every commit the writer saw return is there. The cheap complement of
tests/test_agent_killed.py, which kills whole `kevo-agent run` processes a few times."""
from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from agent.ledger.repository import Ledger
from agent.ledger.store import folder_state

TESTS = Path(__file__).resolve().parent
TRIALS = 16
SEED = 20261130

WRITER = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
from test_ledger import candidate, commit, new_ledger
from agent.ledger.repository import Ledger
from agent.ledger.store import discard_unstarted, folder_state
root = Path(sys.argv[1])
state = folder_state(root)                     # what a resumed run does with the folder it finds
assert state != "foreign", state
if state == "started":
    ledger = Ledger(root)
    ledger.recover()
    n = len(ledger.history())
else:
    if state == "unstarted":
        discard_unstarted(root)
    ledger, n = new_ledger(root), 0
while True:
    n += 1
    cid = f"c{{n:03d}}"
    commit(ledger, candidate(cid, "rejected" if n % 3 else "passed", "parity" if n % 3 else "microbench", 1.1),
           new_best=n % 3 == 0)
    print(cid, flush=True)
"""


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def test_a_ledger_killed_at_random_moments_reopens_sound_with_every_acknowledged_commit(tmp_path):
    root = tmp_path / "r1"
    rng = random.Random(SEED)
    acknowledged: set[str] = set()
    discarded = 0                                     # kills that left files written but not committed
    for trial in range(TRIALS):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, text=True)
        # the kill's moment counted from the writer's own progress, so a loaded machine moves it no earlier: after
        # 0-3 commits it saw return, then up to 0.3 s into what follows (a commit takes tens of ms; with none
        # waited for, the kill lands in the writer's start-up or its first commit)
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(x.strip()) for x in proc.stdout if x.strip()], daemon=True)
        reader.start()
        for _ in range(rng.randrange(4)):
            try:
                acknowledged.add(lines.get(timeout=60))
            except queue.Empty:
                proc.kill()
                raise AssertionError(f"trial {trial}: the writer committed nothing in 60 s") from None
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.wait()
        reader.join()
        while not lines.empty():
            acknowledged.add(lines.get())
        state = folder_state(root) if root.exists() else "new"
        assert state != "foreign", trial
        if state != "started":
            continue                                  # killed before the first commit: a run starts such a folder again
        ledger = Ledger(root)
        discarded += bool(ledger.recover())
        fsck = git(root, "fsck", "--strict", "--no-dangling")
        assert fsck.returncode == 0, (trial, fsck.stdout, fsck.stderr)
        assert git(root, "status", "--porcelain", "--untracked-files=all").stdout.strip() == "", trial
        ids = [r.id for r in ledger.history()]
        assert ids == [f"c{i:03d}" for i in range(1, len(ids) + 1)], (trial, ids)
        assert acknowledged <= set(ids), (trial, sorted(acknowledged - set(ids)))
        trailers = git(root, "log", "--reverse", "--format=%(trailers:key=Candidate,valueonly)").stdout.split()
        assert trailers == ids, (trial, trailers, ids)
        for cid in ids:
            for name in ("record.json", "candidate.py", "README.md"):
                assert (root / "candidates" / cid / name).is_file(), (trial, cid, name)
    ledger = Ledger(root)
    print(f"{TRIALS} kills, {len(ledger.history())} candidates committed, {discarded} kills mid-write")
    assert len(ledger.history()) >= 10 and acknowledged, "too few commits happened between the kills to prove anything"
    assert discarded > 0, "no kill landed between writing and committing: the recovery was never exercised"


WRITES_THREE = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
from test_ledger import candidate, commit, new_ledger
ledger = new_ledger(Path(sys.argv[1]))
for n in (1, 2, 3):
    commit(ledger, candidate(f"c{{n:03d}}", "rejected", "parity", None), new_best=False)
ledger.commit_beside({{"replay/replay.json": "{{}}"}}, "replay", "")
"""


def _writes_three_through_a_logging_git(tmp_path, echo: str) -> list[str]:
    """WRITES_THREE run with a `git` first on PATH that appends `echo` (shell words, the command's own arguments
    after the `-c` settings every ledger git child starts with) to a log, then runs the real git with them all;
    the log's lines, one per git child the ledger's writes started."""
    bin_dir, log = tmp_path / "bin", tmp_path / "git.log"
    bin_dir.mkdir()
    real = subprocess.run(["sh", "-c", "command -v git"], capture_output=True, text=True, check=True).stdout.strip()
    (bin_dir / "git").write_text(f'#!/bin/sh\nlog() {{\n  while [ "$1" = "-c" ]; do shift 2; done\n  echo {echo} >> {log}\n}}\n'
                                 f'log "$@"\nexec {real} "$@"\n')
    (bin_dir / "git").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run([sys.executable, "-c", WRITES_THREE, str(tmp_path / "r1")], env=env, check=True, timeout=120)
    return log.read_text().splitlines()


def test_objects_are_written_by_kevo_itself_so_no_git_child_is_left_writing_half_an_object(tmp_path):
    """What the random kills above once caught (CI, 2026-11-30): gitpython's default store pipes each object
    into a `git hash-object --stdin` child, and a kill mid-pipe left that child to write an empty commit.
    A `git` on PATH that logs its arguments shows which git commands a ledger's writes run."""
    ran = _writes_three_through_a_logging_git(tmp_path, '"$@"')
    assert any(line.startswith("tag") for line in ran), ran          # the logging git is the one gitpython ran
    assert [line for line in ran if line.startswith(("hash-object", "mktree", "commit-tree"))] == []
    assert git(tmp_path / "r1", "fsck", "--strict", "--no-dangling").returncode == 0


def test_every_git_child_leaves_kevos_group_holding_ctrl_c_and_sigterm(tmp_path):
    """A signal to kevo's process group (Ctrl-C, `timeout`) must never reach a git child: CI (2026-12-04) saw
    `git tag` die of SIGINT in the moment after Python's spawn unblocks signals and before the child's setsid.
    A `git` on PATH records the signals each child runs with held and the session it runs in."""
    ran = _writes_three_through_a_logging_git(
        tmp_path, '"$(grep SigBlk /proc/$$/status | cut -f2) $(cut -d" " -f6 /proc/$$/stat) $1"')
    children = [line.split() for line in ran]
    children = [c for c in children if c[2] != "version"]      # gitpython's own, as `import git` runs
    assert {"init", "tag", "cat-file"} <= {command for _, _, command in children}, children
    held = {signal.SIGINT, signal.SIGTERM}
    for mask, session, command in children:
        assert {s for s in held if int(mask, 16) >> (s - 1) & 1} == held, (command, mask)
        assert int(session) != os.getsid(0), command
