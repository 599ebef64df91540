"""The warm worker factory: a process that has imported torch and triton once and forks workers.

Started by the evaluator with an environment built from an allowlist (no keys), it never touches
the GPU itself, so each forked worker creates its own CUDA context and shares no state with the
candidates before it. A worker is made in three steps: fork a shim (own session, so a timeout can
kill its process group); the shim enters new mount and PID namespaces and forks the worker, which
is PID 1 there (when it dies the kernel kills everything the candidate started), mounts a /proc
that shows only its sandbox, confines itself with Landlock, and serves requests; the shim mirrors
the worker's exit so the zygote can report it. Control messages are JSON over a SOCK_SEQPACKET pair.

Usage (by harness/pool.py only): python -m harness.zygote CONTROL_FD DEVICE
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

_NEWNS, _NEWPID, _NEWUSER = 0x00020000, 0x20000000, 0x10000000
_MS_REC, _MS_PRIVATE, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 16384, 1 << 18, 2, 4, 8


def _isolate_namespaces() -> None:
    """In the shim: new mount and PID namespaces (and a user namespace when not root)."""
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
    """In the worker (PID 1 of its namespace): a /proc that lists only the sandbox's processes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), f"make / private: {os.strerror(ctypes.get_errno())}")
    if libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount /proc: {os.strerror(ctypes.get_errno())}")


def _exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _worker_main(sock: socket.socket, cmd: dict) -> None:
    """Runs in the sandboxed worker; never returns."""
    from harness import sandbox, worker
    from harness.transport import send_json
    workdir = Path(cmd["workdir"])
    notes, code = [], 0
    try:
        try:
            _private_proc()
            notes.append("private PID namespace and /proc")
        except OSError as e:
            if cmd["sandbox"] == "required":
                raise
            notes.append(f"no private /proc ({e})")
        for sub in ("tmp", "triton", "cache"):
            (workdir / sub).mkdir(exist_ok=True)
        os.environ.update(HOME=str(workdir), TMPDIR=str(workdir / "tmp"), TRITON_CACHE_DIR=str(workdir / "triton"),
                          XDG_CACHE_HOME=str(workdir / "cache"))
        import tempfile
        tempfile.tempdir = str(workdir / "tmp")     # the zygote may have cached its own before the fork
        os.chdir(workdir)
        try:
            abi = sandbox.confine([str(workdir), "/dev", "/proc/self"])   # CUDA writes under /proc/self
            notes.append(f"Landlock ABI {abi}")
        except sandbox.SandboxError as e:
            if cmd["sandbox"] == "required":
                raise
            notes.append(f"no Landlock ({e})")
        send_json(sock, {"ok": True, "sandbox": "; ".join(notes), "pid": os.getpid()})
        worker.serve(sock, workdir, cmd["target"], cmd["device"], cmd["log_limit"])
    except BaseException as e:                                             # noqa: BLE001 - reported, then exit
        try:
            send_json(sock, {"ok": False, "error": f"sandbox: {type(e).__name__}: {e}"})
        except OSError:
            pass
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_worker(ctl: socket.socket, cmd: dict, fd: int) -> int:
    pid = os.fork()
    if pid:
        os.close(fd)
        return pid
    # shim
    try:
        from harness.sandbox import die_with_parent
        die_with_parent()
        ctl.close()
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(Path(cmd["workdir"]) / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sock = socket.socket(fileno=fd)
        try:
            _isolate_namespaces()
        except OSError as e:
            if cmd["sandbox"] == "required":
                from harness.transport import send_json
                send_json(sock, {"ok": False, "error": f"sandbox: cannot create namespaces ({e}); "
                                                       "set worker.sandbox: best_effort to run without"})
                os._exit(3)
        child = os.fork()
        if child == 0:
            die_with_parent()
            _worker_main(sock, cmd)
        sock.close()
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        _exit_like(status)
    finally:
        os._exit(4)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({signal.Signals(sig).name})"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def _reap(pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return "already gone"
        if done:
            return _describe(status)
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            return "did not exit after closing its connection; killed"
        time.sleep(0.01)


def main() -> None:
    from harness.sandbox import die_with_parent
    die_with_parent()
    ctl = socket.socket(fileno=int(sys.argv[1]))
    device = sys.argv[2]
    import torch  # noqa: F401  - the reason this process exists: import once, fork many
    import triton  # noqa: F401
    import triton.language  # noqa: F401
    from harness import worker
    worker.preload()
    info = {"ready": True, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0], "device": device}
    ctl.send(json.dumps(info).encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 1)
        except OSError:
            return
        if not data:
            return
        cmd = json.loads(data)
        if cmd["cmd"] == "fork":
            reply = {"pid": _fork_worker(ctl, cmd, fds[0])}
        elif cmd["cmd"] == "reap":
            reply = {"status": _reap(int(cmd["pid"]), float(cmd.get("timeout", 2.0)))}
        else:
            reply = {"error": f"unknown command {cmd['cmd']!r}"}
        ctl.send(json.dumps(reply).encode())


if __name__ == "__main__":
    main()
