"""Putting a process that will run candidate code into kevo's sandbox.

Two steps, used by the evaluator's workers (harness/zygote.py) and by the served-model server
(harness/served/server.py): `isolate_namespaces` in an outer process, which then forks the process
that is PID 1 of the new PID namespace and `mirror_child`s it; inside, `settle_inside` mounts a /proc
that lists only the sandbox, moves HOME/TMPDIR/caches into the process's own folder, and applies
Landlock (harness/sandbox.py). What each step could not do is returned as notes, or raised when the
sandbox is required.
"""
from __future__ import annotations

import ctypes
import os
import signal
import tempfile
from pathlib import Path
from typing import NoReturn

from harness import sandbox

_NEWNS, _NEWPID, _NEWUSER = 0x00020000, 0x20000000, 0x10000000
_MS_REC, _MS_PRIVATE, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 16384, 1 << 18, 2, 4, 8


def isolate_namespaces() -> None:
    """New mount and PID namespaces (and a user namespace when not root); the next fork is PID 1."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    flags = _NEWNS | _NEWPID | (_NEWUSER if uid != 0 else 0)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), f"unshare: {os.strerror(ctypes.get_errno())}")
    if uid != 0:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _private_proc() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), f"make / private: {os.strerror(ctypes.get_errno())}")
    if libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount /proc: {os.strerror(ctypes.get_errno())}")


def exit_like(status: int) -> NoReturn:
    """End this process the way a child with wait status `status` ended (same code or signal)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def mirror_child(child: int) -> NoReturn:
    """Wait for `child` and exit as it did, so whoever waits for this process learns how it ended."""
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    exit_like(status)


def settle_inside(workdir: Path, required: bool) -> list[str]:
    """In the process that will run candidate code (PID 1 of its namespace when namespaces exist)."""
    notes: list[str] = []
    try:
        _private_proc()
        notes.append("private PID namespace and /proc")
    except OSError as e:
        if required:
            raise
        notes.append(f"no private /proc ({e})")
    for sub in ("tmp", "triton", "cache"):
        (workdir / sub).mkdir(exist_ok=True)
    os.environ.update(HOME=str(workdir), TMPDIR=str(workdir / "tmp"), TRITON_CACHE_DIR=str(workdir / "triton"),
                      XDG_CACHE_HOME=str(workdir / "cache"))
    tempfile.tempdir = str(workdir / "tmp")          # a parent may have cached its own before the fork
    os.chdir(workdir)
    try:
        # /dev for the GPU's device files; /proc/self because the CUDA driver fails without it (H200).
        notes.append(f"Landlock ABI {sandbox.confine([str(workdir), '/dev', '/proc/self'])}")
    except sandbox.SandboxError as e:
        if required:
            raise
        notes.append(f"no Landlock ({e})")
    return notes
