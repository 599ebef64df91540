"""Confine a candidate's worker process with Linux Landlock (unprivileged; works as root too).

Covered: the worker may create and write files only in its own work folder, under /dev (the GPU's
device files) and under /proc/self (the CUDA driver fails to initialise without it); it may not open TCP connections or listen (ABI >= 4); it may not signal, ptrace or read
the environment of processes outside its sandbox, the evaluator included (ABI >= 6 for signals;
ptrace scoping holds from ABI 1). Reads are not restricted: the candidate has no secrets to find,
because its environment is built from an allowlist (see `clean_env`).
Not covered: CPU/memory limits, and grandchildren that call setsid() escape the process-group kill.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import struct

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446   # the same numbers on x86_64 and aarch64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_PDEATHSIG = 1

# LANDLOCK_ACCESS_FS_* rights that create, change or remove files. Reads and execution stay allowed.
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in range(6, 13))                  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


class SandboxError(Exception):
    pass


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is unavailable."""
    try:
        r = _libc().syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(0, r)


def confine(writable: list[str]) -> int:
    """Restrict this process (and its future children) for good. Returns the ABI used."""
    abi = landlock_abi()
    if abi < 1:
        raise SandboxError("Landlock is not available in this kernel")
    libc = _libc()
    fs = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    if abi >= 2:
        fs |= _REFER
    if abi >= 3:
        fs |= _TRUNCATE
    net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = libc.syscall(_SYS_CREATE, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if fd < 0:
        raise SandboxError(f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}")
    try:
        for path in writable:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", fs, pfd), 12)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                                ctypes.c_uint32(0)) != 0:
                    raise SandboxError(f"landlock_add_rule({path}) failed: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(pfd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SandboxError("prctl(NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise SandboxError(f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    return abi


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), so a killed
    evaluator never leaves a zygote, worker or server holding GPU memory (seen on the H200: two
    orphaned servers held 123 GB). Call first thing in every process kevo starts or forks; the
    parent must be a thread that lives as long as the child should."""
    parent = os.getppid()
    if _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise SandboxError("prctl(PDEATHSIG) failed")
    if os.getppid() != parent:                       # the parent died before the prctl took effect
        os._exit(1)


def clean_env(passthrough: list[str], extra: dict[str, str]) -> dict[str, str]:
    """An environment built from an allowlist: nothing secret-looking ever passes."""
    env = {k: os.environ[k] for k in passthrough if k in os.environ and not SECRET_NAME.search(k)}
    env.update(extra)
    return env


def redact(text: str) -> str:
    """Blank out the values of this process's secret-looking environment variables."""
    for name, value in os.environ.items():
        if len(value) >= 6 and SECRET_NAME.search(name) and value in text:
            text = text.replace(value, f"[{name} redacted]")
    return text
