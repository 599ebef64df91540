"""A run's git repository as kevo opens it (`init_repo`, `open_repo`: every reader and writer of a ledger), so that
a kill at any moment leaves it whole: objects are written by this process to temporary files renamed into
place (gitdb's loose store), refs by git through its lock files, and every git child runs in a session of its
own, with Ctrl-C and SIGTERM held, so a signal to kevo's process group stops kevo in order without killing the
readers it stops through.

A ledger may come from elsewhere (a run copied in to resume or re-judge it), and its .git is then someone else's:
its hooks and its config can name commands git (and gitpython's commit) would run as the user, with the user's
keys in the environment. So every git child here runs with hooks and fsmonitor switched off on its command line
and no secret-looking variable in its environment (`_GitOfItsOwn`), commits skip hooks (repository.py), and a
repository is opened only if its .git is a folder of its own, naming no other folder as its common directory, whose
config sets nothing but what `git init` and `git clone` write (`open_repo`); the files kevo writes into the run
folder go through no symbolic link (`write_inside`). What a run folder found on disk is (`folder_state`: new, a
started ledger, a run stopped before its first commit, or someone else's) is read here too.

Not here: what is committed and how it is read back (agent/ledger/repository.py), recovery after a kill
(`Ledger.recover`), the words of a commit (agent/ledger/messages.py).
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path, PurePosixPath
from typing import Literal

import git
from gitdb.base import IStream
from gitdb.db.loose import LooseObjectDB

from agent.ledger import LedgerError
from agent.run.session import LOCK_NAME
from harness.detach import group_signals_held
from harness.sandbox import SECRET_NAME

# git's own command-line settings, over anything a repository's config says: no hook, no fsmonitor command
NO_COMMANDS = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")
# What `git init` and `git clone` write into .git/config; a key outside these is someone else's (a command to run)
OWN_CONFIG = re.compile(r"core\.(repositoryformatversion|filemode|bare|logallrefupdates|ignorecase|precomposeunicode|"
                        r"symlinks)|remote\.[^.]+\.(url|fetch)|branch\.[^.]+\.(remote|merge)")
# What a first commit writes: a folder holding only these (and no commit) is a run stopped before it.
FIRST_FILES = {"run.json", "config.yaml", "environment.json", "profile.json", "replay.json", "summary.json",
               "settings.json", "README.md", "heads", ".git"}


class _ObjectsWrittenHere(git.GitCmdObjectDB):
    """Objects read through git, as gitpython does by default, but written by this process: gitdb's loose
    store writes each to a temp file and renames it into place. gitpython's own store pipes every object
    into a `git hash-object -w --stdin --literally` child; a run SIGKILLed mid-pipe leaves that child to
    write what it had read so far, an empty or truncated object that `git fsck` reports as bogus."""

    def store(self, istream: IStream) -> IStream:
        return LooseObjectDB.store(self, istream)


class _GitOfItsOwn(git.Git):
    """Every git child (gitpython's long-lived `git cat-file --batch` readers included) in a session of its
    own: a signal to kevo's whole process group — Ctrl-C in a terminal, `timeout`, a service manager —
    reaches kevo, which stops in order, and not the processes its orderly stop reads the ledger through
    (killed, they left a BrokenPipeError traceback and no end commit). Each starts with SIGINT and SIGTERM
    held (harness/detach.py says why) and keeps them so."""

    def execute(self, command, *args, **kwargs):
        kwargs.setdefault("start_new_session", True)
        if isinstance(command, (list, tuple)) and command and command[0] == self.GIT_PYTHON_GIT_EXECUTABLE:
            command = [command[0], *NO_COMMANDS, *command[1:]]
        kwargs["env"] = {**(kwargs.get("env") or {}), **{k: "" for k in os.environ if SECRET_NAME.search(k)}}
        with group_signals_held():
            return super().execute(command, *args, **kwargs)


class _Repo(git.Repo):
    GitCommandWrapperType = _GitOfItsOwn


def open_repo(root: Path) -> git.Repo:
    """A run's repository, opened for reading and writing by kevo (every writer opens it here); LedgerError for a
    .git that is a link or a file (pointing at another repository), that names another folder as its common
    directory (`commondir`: git would read that folder's config), or whose config sets a key of someone else's."""
    dot = root / ".git"
    if dot.is_symlink() or (dot.exists() and not dot.is_dir()):
        raise LedgerError(f"{dot} is not a folder of its own (a link, or a file naming another repository): not a "
                           "kevo ledger")
    common = dot / "commondir"
    if common.exists() or common.is_symlink():
        raise LedgerError(f"{common} hands git another folder's config, objects and refs (commands git would run): not "
                           "a kevo ledger")
    config = dot / "config"
    if config.is_symlink():
        raise LedgerError(f"{config} is a symbolic link: not a kevo ledger")
    if config.is_file():
        keys = _GitOfItsOwn().config("--file", str(config), "--list", "--name-only").split()
        foreign = sorted(k for k in keys if not OWN_CONFIG.fullmatch(k))
        if foreign:
            raise LedgerError(f"{config} sets {', '.join(foreign[:3])}, which kevo never writes (a ledger from "
                               f"elsewhere may name commands git would run): `git config --unset` it to use this run")
    return _Repo(root, odbt=_ObjectsWrittenHere)


def folder_state(root: Path) -> Literal["new", "started", "unstarted", "foreign"]:
    """new: nothing there yet; started: a kevo ledger with its first commit; unstarted: a kevo run stopped
    before its first commit (safe to start again); foreign: anything else."""
    if root.exists() and not root.is_dir():
        return "foreign"
    entries = {p.name for p in root.iterdir()} - {LOCK_NAME} if root.is_dir() else set()
    if not entries:
        return "new"
    if ".git" not in entries:
        return "foreign"
    try:
        repo = open_repo(root)
        if repo.head.is_valid():
            repo.head.commit.tree / "run.json"
            return "started"
    except (git.exc.InvalidGitRepositoryError, KeyError, ValueError):
        return "foreign"
    return "unstarted" if entries <= FIRST_FILES else "foreign"


def discard_unstarted(root: Path) -> None:
    """Clear a run stopped before its first commit (folder_state 'unstarted'), keeping the lock file."""
    for p in root.iterdir():
        if p.name != LOCK_NAME:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def write_inside(root: Path, rel: str, data: bytes) -> None:
    """Write `data` to root/rel, making its folders, through no symbolic link (LedgerError) and never outside root."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise LedgerError(f"{root}: {rel!r} is not a path inside the run folder")
    folder = root
    for part in parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            raise LedgerError(f"{folder} is a symbolic link: kevo writes nothing through one (a ledger from elsewhere?)")
        folder.mkdir(exist_ok=True)
    try:
        fd = os.open(folder / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise LedgerError(f"{folder / parts[-1]} is a symbolic link: kevo writes nothing through one (a ledger from "
                           "elsewhere?)") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def init_repo(root: Path) -> git.Repo:
    """A new, empty run repository at `root`, its `git init` run as every other git child here."""
    return _Repo.init(root, odbt=_ObjectsWrittenHere)
