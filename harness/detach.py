"""Starting a process in a session of its own, so that a signal to kevo's process group (Ctrl-C in a terminal,
`timeout`, a service manager) reaches kevo, which stops in order, and never the processes it stops through.

`start_new_session` alone leaves a moment in which the signal can still land: Python's vfork child restores
default signal handling and unblocks signals before it calls setsid. CI (2026-12-04) saw `git tag` die of
SIGINT there, and a burst of group signals killed about one git child in 150. So the spawning thread holds
SIGINT and SIGTERM across the spawn (`group_signals_held`); the child inherits them held and has left the group
before it execs. git children keep them held: they end on end of input, SIGPIPE or SIGKILL. kevo's own Python
children let them go first thing (`release_group_signals`); a program not kevo's starts through this file as a
script, which lets them go and then execs it.

Run as a script: `python -I harness/detach.py PROGRAM ARGS...`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

GROUP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextmanager
def group_signals_held():
    """SIGINT and SIGTERM held in this thread for the block (kevo still gets them: through another thread at
    once, or when the block ends); a process spawned inside starts with them held."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def spawn_detached(argv: list[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen` in a session of its own, which no signal to kevo's group reaches. The child starts with
    SIGINT and SIGTERM held: a Python child of kevo's calls `release_group_signals` first; `foreign` wraps any
    other program so that it starts with them as usual."""
    with group_signals_held():
        return subprocess.Popen(argv, start_new_session=True, **kwargs)


def foreign(argv: list[str]) -> list[str]:
    """`argv` for a program not kevo's, started through this file so that it runs with SIGINT and SIGTERM free."""
    return [sys.executable, "-I", str(Path(__file__).resolve()), *argv]


def release_group_signals() -> None:
    """Let SIGINT and SIGTERM go in a process `spawn_detached` started. A pending SIGINT can only be the group's
    Ctrl-C that reached it before its setsid (in a session of its own nothing else sends it one): dropped. A
    pending SIGTERM is delivered, since it may be kevo's own stop."""
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)      # ignoring a signal drops it if pending
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    signal.signal(signal.SIGINT, handler)


if __name__ == "__main__":
    release_group_signals()
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    except OSError as e:
        sys.exit(f"kevo: cannot run {sys.argv[1]}: {e.strerror}")
