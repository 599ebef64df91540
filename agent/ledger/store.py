"""A run's git repository as kevo opens it (`init_repo`, `open_repo`: every reader and writer of a ledger), so that
a kill at any moment leaves it whole: objects are written by this process to temporary files renamed into
place (gitdb's loose store), refs by git through its lock files, and every git child runs in a session of its
own, with Ctrl-C and SIGTERM held, so a signal to kevo's process group stops kevo in order without killing the
readers it stops through.

Not here: what is committed and how it is read back (agent/ledger/repository.py), recovery after a kill
(`Ledger.recover`), the words of a commit (agent/ledger/messages.py).
"""
from __future__ import annotations

from pathlib import Path

import git
from gitdb.base import IStream
from gitdb.db.loose import LooseObjectDB

from harness.detach import group_signals_held


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
        with group_signals_held():
            return super().execute(command, *args, **kwargs)


class _Repo(git.Repo):
    GitCommandWrapperType = _GitOfItsOwn


def open_repo(root: Path) -> git.Repo:
    """A run's repository, opened for reading and writing by kevo (every writer opens it here)."""
    return _Repo(root, odbt=_ObjectsWrittenHere)


def init_repo(root: Path) -> git.Repo:
    """A new, empty run repository at `root`, its `git init` run as every other git child here."""
    return _Repo.init(root, odbt=_ObjectsWrittenHere)
