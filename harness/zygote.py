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

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from harness.isolation import isolate_namespaces, mirror_child, settle_inside


def _worker_main(sock: socket.socket, cmd: dict) -> None:
    """Runs in the sandboxed worker; never returns."""
    from harness import worker
    from harness.transport import send_json
    workdir = Path(cmd["workdir"])
    code = 0
    try:
        notes = settle_inside(workdir, cmd["sandbox"] == "required")
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
            isolate_namespaces()
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
        mirror_child(child)
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
