"""The warm worker factory: a process that has imported torch and triton once and forks workers.

Started by the evaluator with an environment built from an allowlist (no keys), it never touches
the GPU itself, so each forked worker creates its own CUDA context and shares no state with the
candidates before it. A worker is made in three steps: fork a shim (own session, so a timeout can
kill its process group; stdout and stderr on the log file the evaluator made and keeps); the shim
enters new namespaces and forks the worker, which is PID 1 there (when it dies the kernel kills
everything the candidate started), builds its own root and locks itself down
(harness/isolation.py), and serves requests; the shim mirrors the worker's exit so the zygote can
report it. Sandboxing in the forked process, not by exec'ing a sandbox tool, keeps the warm import
(docs/EVALUATOR.md says why). Control messages are JSON over a SOCK_SEQPACKET pair.

Its ready message says how long its own start took (`spans`: its imports, its preload, monotonic seconds).

Usage (by harness/pool.py only): python -m harness.zygote CONTROL_FD DEVICE
"""
from __future__ import annotations

import time

_STARTED = time.monotonic()          # the interpreter's start is behind this; its imports ahead

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

from harness.isolation import isolate_namespaces, mirror_child, settle_inside
from harness.sandbox import SandboxError


def _worker_main(sock: socket.socket, cmd: dict, namespaces: bool) -> None:
    """Runs in the sandboxed worker; never returns."""
    from harness import worker
    from harness.transport import send_json
    code = 0
    try:
        workdir, notes = settle_inside(cmd["spec"], namespaces)
        send_json(sock, {"ok": True, "sandbox": "; ".join(notes), "pid": os.getpid(), "workdir": str(workdir)})
        worker.serve(sock, workdir, cmd["target"], cmd["device"], cmd["log_limit"])
    except BaseException as e:                                             # noqa: BLE001 - reported, then exit
        try:
            send_json(sock, {"ok": False, "error": f"sandbox: {e}; set worker.sandbox: best_effort to run without"
                             if isinstance(e, SandboxError) else f"sandbox: {type(e).__name__}: {e}"})
        except OSError:
            pass
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _fork_worker(ctl: socket.socket, cmd: dict, fds: list[int]) -> int:
    """`fds`: the worker's end of its connection, and its log file."""
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    # shim
    try:
        from harness.sandbox import die_with_parent
        die_with_parent()
        ctl.close()
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd, log = fds
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sock = socket.socket(fileno=fd)
        namespaces = True
        try:
            isolate_namespaces()
        except OSError as e:
            if cmd["spec"]["required"]:
                from harness.transport import send_json
                send_json(sock, {"ok": False, "error": f"sandbox: cannot create namespaces ({e}); "
                                                       "set worker.sandbox: best_effort to run without"})
                os._exit(3)
            namespaces = False
            print(f"sandbox: no namespaces ({e})", flush=True)
        child = os.fork()
        if child == 0:
            die_with_parent()
            _worker_main(sock, cmd, namespaces)
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
    from harness.detach import release_group_signals
    from harness.sandbox import die_with_parent
    die_with_parent()
    release_group_signals()
    ctl = socket.socket(fileno=int(sys.argv[1]))
    device = sys.argv[2]
    import torch  # noqa: F401  - the reason this process exists: import once, fork many
    import triton  # noqa: F401
    import triton.language  # noqa: F401
    from harness import worker
    imported = time.monotonic()
    worker.preload()
    info = {"ready": True, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0], "device": device,
            "spans": {"imports": [_STARTED, imported], "preload": [imported, time.monotonic()]}}
    ctl.send(json.dumps(info).encode())
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(ctl, 1 << 16, 2)
        except OSError:
            return
        if not data:
            return
        cmd = json.loads(data)
        if cmd["cmd"] == "fork":
            reply = {"pid": _fork_worker(ctl, cmd, fds)}
        elif cmd["cmd"] == "reap":
            reply = {"status": _reap(int(cmd["pid"]), float(cmd.get("timeout", 2.0)))}
        else:
            reply = {"error": f"unknown command {cmd['cmd']!r}"}
        ctl.send(json.dumps(reply).encode())


if __name__ == "__main__":
    main()
