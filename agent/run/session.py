"""What lets a run be left alone: one process per run folder (a lock), and signals that stop it between
commits rather than in the middle of one.

The lock is `fcntl.flock` on `<run>/.kevo.lock` (excluded from the ledger's git): the kernel releases it
when the holder exits however it exits, SIGKILL and reboots included, so a lock is never stale: the file a
killed run leaves is taken over by the next. A run that ends in order removes it (still holding it; a
process that opened the removed file meanwhile sees it is no longer the one there and locks the new one).
The file says who holds it (pid, host, since when, the command), for the one-line refusal a second run gets.
On NFS, flock is emulated with byte-range locks; two hosts sharing a run folder are not supported.

Signals: the first SIGINT or SIGTERM only sets `why`; the loop sees it between steps, finishes the
candidate being evaluated, commits it and stops with the end commit. A second one raises KeyboardInterrupt
at once — unless a commit is being written, then right after it — so the ledger is never left mid-commit by
kevo itself (a SIGKILL can; the ledger's `recover` repairs that on the next open). A signal to kevo's whole
process group (Ctrl-C in a terminal, `timeout`, a service manager) is the same signal: the git children
the orderly stop reads the ledger through run in sessions of their own (agent/ledger/store.py:open_repo).
Not here: what is committed (ledger), when the loop looks (loop).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import sys
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from agent.ledger import LedgerError

LOCK_NAME = ".kevo.lock"


class RunBusy(Exception):
    """The run folder is held by another process; the message (one line) names it."""


def _busy(root: Path, path: Path) -> "RunBusy":
    return RunBusy(f"{root} is in use by {_holder(path)}; one run per folder — wait for it to end or stop it "
                   "(SIGTERM stops it after its current candidate)")


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process (it has not said who yet)"
    return (f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('since', '?')} "
            f"({info.get('command', '?')})")


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


class RunLock:
    """An exclusive hold on one run folder for the life of this object's `with` block (or process)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> "RunLock":
        self.root.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:          # a link left in a folder from elsewhere: truncated and written below
                if e.errno != errno.ELOOP:
                    raise
                raise LedgerError(f"{self.path} is a symbolic link: kevo writes nothing through one") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise _busy(self.root, self.path) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)                # its holder removed it as this opened it: the lock is the file there now
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["kevo-agent", *sys.argv[1:]])[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """The file removed while still held, then the lock dropped: whoever opened the old file meanwhile
        finds it is no longer the one there and takes the new one (acquire)."""
        if self.fd is not None:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_free(root: Path) -> None:
    """RunBusy now if another process holds `root` (a cheap early refusal; the run takes the lock itself)."""
    path = root / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:                   # no run holds it, or one has just ended
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(root, path) from None
    finally:
        os.close(fd)


class Interrupts:
    """SIGINT / SIGTERM while a run is in this block: the first asks it to stop, a second stops it now.
    Handlers are installed only in the main thread (elsewhere signals cannot be caught) and restored after."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.why = ""               # "interrupted (SIGTERM)" once a first signal came
        self.signum = 0
        self._writing = 0
        self._deferred = False
        self._before: dict[int, object] = {}

    def __enter__(self) -> "Interrupts":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._before[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._before.items():
            signal.signal(s, handler)
        self._before = {}

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.why:
            self.why, self.signum = f"interrupted ({name})", signum
            os.write(2, f"\nkevo: {name}: stopping after the current candidate is committed; "
                        f"send it again to stop at once\n".encode())
            return
        if self._writing:
            self._deferred = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def writing(self):
        """A ledger commit: a second signal waits for it to be written."""
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
            if self._deferred and not self._writing:
                self._deferred = False
                raise KeyboardInterrupt
