"""A run's git repository as kevo opens it (`init_repo`, `open_repo`; every reader and writer of a ledger opens it here), so
that a kill at any moment leaves it whole: objects are written by this process to temporary files renamed into
place (gitdb's loose store), refs by git through its lock files, and every git child runs in a session of its
own, with Ctrl-C and SIGTERM held, so a signal to kevo's process group stops kevo in order without killing the
readers it stops through.

Not here: what is committed and how it is read back (agent/ledger/repository.py), recovery after a kill
(`Ledger.recover`), the words of a commit (agent/ledger/messages.py).
"""
from __future__ import annotations

import signal
from pathlib import Path

import git
from gitdb.base import IStream
from gitdb.db.loose import LooseObjectDB


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
    (killed, they left a BrokenPipeError traceback and no end commit).

    The new session alone leaves a window: Python's vfork child restores default signal handling and unblocks
    signals before it calls setsid, so a group signal in between killed `git tag` with status -2 (seen once in
    CI). The spawning thread therefore holds SIGINT and SIGTERM while git starts; the child inherits them held,
    leaves the group still holding them, and runs git so (it ends on end of input, SIGPIPE or SIGKILL, never on
    these two). kevo itself still gets the signal: through another thread at once, or when the hold ends."""

    def execute(self, command, *args, **kwargs):
        kwargs.setdefault("start_new_session", True)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
        try:
            return super().execute(command, *args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


_GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class _Repo(git.Repo):
    GitCommandWrapperType = _GitOfItsOwn


def open_repo(root: Path) -> git.Repo:
    """A run's repository, opened for reading and writing by kevo (every writer opens it here)."""
    return _Repo(root, odbt=_ObjectsWrittenHere)


def init_repo(root: Path) -> git.Repo:
    """A new, empty run repository at `root`, its `git init` run as every other git child here."""
    return _Repo.init(root, odbt=_ObjectsWrittenHere)
