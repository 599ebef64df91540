"""The evaluator's side of one worker process: send it requests, read its replies with deadlines, stop it.

`WorkerHandle.request` sends one request and returns the worker's JSON reply, or raises `WorkerFailure`
when the worker timed out (its process group is killed), died (with how), or broke the protocol. Replies
are read with a size limit and at most `MAX_OUTPUT_FILES` sealed memory files each (harness/transport.py);
the worker's stdout and stderr are a memory file of which only the tail is read. The handle asks its pool
(harness/pool.py, which forks workers) to reap a stopped worker. Importing this module does not import
torch (harness/transport.py is imported where a worker is talked to).
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from harness.sandbox import redact

if TYPE_CHECKING:
    from harness.pool import Pool

MAX_OUTPUT_FILES = 4          # descriptors accepted with one reply
STOPPED_STATES = "tTZX"       # /proc's run states of a thread that runs nothing: stopped, or dead and not yet reaped


class WorkerFailure(Exception):
    """The worker did not answer properly; `kind` (a FailureKind, harness/records.py) is timeout, crashed or protocol."""

    def __init__(self, kind: Literal["timeout", "crashed", "protocol"], message: str) -> None:
        super().__init__(message)
        self.kind = kind


class WorkerHandle:
    def __init__(self, pool: "Pool", pid: int, sock: socket.socket, host_folder: Path, log: int) -> None:
        self.pool, self.pid, self.sock, self.host_folder, self.log = pool, pid, sock, host_folder, log
        self.workdir = host_folder          # as the worker sees it: its hello says (before any candidate code runs)
        self.alive = True
        self.sandbox = ""
        self.warmed = False                 # its warm-up answered (Pool.settle_spare, or when handed over)

    def log_tail(self) -> str:
        """The end of the worker's stdout and stderr, read from the memory file made for it."""
        if self.log < 0:
            return ""
        limit = self.pool.cfg.log_tail_chars
        try:
            size = os.fstat(self.log).st_size
            data = os.pread(self.log, 4 * limit, max(0, size - 4 * limit))
        except OSError:
            return ""
        return redact(data.decode(errors="replace")[-limit:].strip())

    def receive(self, timeout: float, doing: str) -> dict:
        from harness.transport import Arena, ProtocolError, recv_json
        self.sock.settimeout(max(0.01, timeout))
        try:
            reply, fds = recv_json(self.sock, self.pool.cfg.reply_limit_bytes, MAX_OUTPUT_FILES)
            reply["_arenas"] = [Arena(fd, self.pool.cfg.file_size_bytes) for fd in fds]
            return reply
        except (socket.timeout, TimeoutError):
            self.kill()
            raise WorkerFailure("timeout", f"no reply within {timeout:.0f} s while {doing}: killed") from None
        except (EOFError, ConnectionError):
            status = self.kill(first_wait=True)
            tail = self.log_tail()
            raise WorkerFailure("crashed", f"the worker died while {doing} ({status})"
                                + (f"; its last output:\n{tail}" if tail else "")) from None
        except ProtocolError as e:
            self.kill()
            raise WorkerFailure("protocol", f"malformed reply while {doing}: {e}") from None

    def send(self, msg: dict, doing: str) -> None:
        """Send a request without waiting; replies come back in order (see `collect`)."""
        if not self.alive:
            raise WorkerFailure("crashed", "the worker is no longer running")
        from harness.transport import send_pickle
        try:
            send_pickle(self.sock, msg)
        except OSError:
            status = self.kill(first_wait=True)
            raise WorkerFailure("crashed", f"the worker died before {doing} ({status})") from None

    def collect(self, timeout: float, doing: str) -> dict:
        """The reply to the oldest request not yet collected."""
        if timeout <= 0:
            self.kill()
            raise WorkerFailure("timeout", f"the stage's time ran out while {doing}")
        t0 = time.monotonic()
        reply = self.receive(timeout, doing)
        reply["_wall_s"] = time.monotonic() - t0
        if reply.get("fatal"):
            self.kill()
        return reply

    def replied(self) -> bool:
        """Whether `collect` would find something to read at once: a reply, or the connection's end (or the
        worker is stopped already). Nothing is read: what it is, `collect` says."""
        if not self.alive:
            return True
        return bool(select.select([self.sock], [], [], 0)[0])

    def request(self, msg: dict, timeout: float, doing: str) -> dict:
        self.send(msg, doing)
        return self.collect(timeout, doing)

    def hold_still(self, still: bool) -> None:
        """Stop (SIGSTOP) or continue the worker's process group: between its stages, while its slot waits
        for its GPU's lease, nothing of the candidate's runs (another slot may be timing on that GPU).
        GPU work it queued before it was stopped still runs: every call is synchronized before its reply,
        so only code that escaped the allowlist could have left any (docs/EVALUATOR.md)."""
        if self.alive:
            try:
                os.killpg(self.pid, signal.SIGSTOP if still else signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass

    def stopped(self) -> bool:
        """Whether every thread of every process in the worker's process group (the shim, the worker, any child the
        candidate started) is stopped now, read from the host's /proc: a stop signal is delivered asynchronously, so
        `hold_still` returns before it has taken hold. The sandbox refuses setsid and setpgid (harness/sandbox.py),
        so no process the candidate starts can leave the group."""
        states = group_thread_states(self.pid)
        return bool(states) and all(s in STOPPED_STATES for s in states)

    def held_still(self, wait_s: float) -> bool:
        """Stop the worker's process group (`hold_still`) and wait up to `wait_s` for every thread of it to be
        stopped; whether it was."""
        self.hold_still(True)
        end = time.monotonic() + wait_s
        while not self.stopped():
            if time.monotonic() > end:
                return False
            time.sleep(0.001)
        return True

    def kill(self, first_wait: bool = False) -> str:
        """Stop the worker's process group and say how it ended. `first_wait`: it is probably dying
        already (its connection closed); let the zygote collect its real exit status first."""
        if not self.alive:
            return "already stopped"
        self.alive = False
        if not first_wait:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.sock.close()
        return self.pool.reap(self.pid)

    def close(self) -> None:
        self.kill()
        if self.log >= 0:
            os.close(self.log)
            self.log = -1
        shutil.rmtree(self.host_folder, ignore_errors=True)   # rmtree does not follow links a candidate left


def group_thread_states(pgid: int) -> list[str]:
    """The run state (a letter of /proc's stat) of every thread of every process whose process group is `pgid`, read
    from the host's /proc; a process that ends while it is read is left out."""
    states = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2:].split()[2]) != pgid:
                continue
            for task in (entry / "task").iterdir():
                stat = (task / "stat").read_text()
                states.append(stat[stat.rindex(")") + 2])
        except (OSError, ValueError):
            continue
    return states
