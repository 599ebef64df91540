"""The evaluator's side of the worker processes: start the zygote, make workers (talking with one is
harness/worker_handle.py: `WorkerHandle`, `WorkerFailure`).

`Pool` owns the zygote (harness/zygote.py) and a private scratch folder, and hands out fresh workers. Nothing here
opens a path a candidate could have made: the candidate's source goes to the worker in a message
(it writes the file in its own folder, which only it can see); outputs come back as sealed memory
files passed with the reply; the worker's stdout and stderr go to a memory file made here, of
which only the tail is read. `Pool.check_health` runs a known computation in a fresh worker
(after a crash or a hang, before the next candidate), warmed up without the profiler (it runs no candidate),
while the spare for the next candidate is forked and warms up beside it.
Importing this module does not import torch (harness/transport.py, which does, is imported where a worker
is talked to), so `kevo-agent evaluate` can `launch` the zygote before it imports torch itself, and the two
imports run at once. The pool keeps the start-up spans it sees (`spans`: the zygote's, each worker's sandbox
and warm-up, as they reported them) for its slot's breakdown (harness/slot.py `Span`).
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.config import PROJECT_ROOT, WorkerConfig
from harness.detach import spawn_detached
from harness.errors import HarnessError
from harness.isolation import sandbox_spec
from harness.records import Span
from harness.sandbox import clean_env
from harness.worker_handle import WorkerFailure, WorkerHandle

# A tiny Triton kernel and a sum whose result is exact in float32 (3 * 1023 * 1024 / 2), run at import.
_HEALTH = """import torch
import triton
import triton.language as tl


@triton.jit
def _triple(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, 3.0 * tl.load(x_ptr + offs, mask=mask), mask=mask)


x = torch.arange(1024, dtype=torch.float32, device=DEVICE)
out = torch.empty_like(x)
_triple[(4,)](x, out, 1024, BLOCK=256)
got = float(out.sum())
if got != 1571328.0:
    raise RuntimeError("health check: 3 * sum(0..1023) came out %r, not 1571328" % got)
"""


def _reported_span(name: str, value: object) -> Span | None:
    """A [start, end] pair a worker or the zygote sent (before any candidate ran in it) as a Span; None if it is not one."""
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                           for x in value) and 0 <= value[0] <= value[1] < 1e12):
        return Span(name=name, start=float(value[0]), end=float(value[1]))
    return None


def likely_device(device: str) -> str:
    """The device config's `device` most likely resolves to, without importing torch: "cuda" where an NVIDIA
    device node is visible and CUDA_VISIBLE_DEVICES does not hide every GPU. Only a guess, for a pool launched
    early: harness/slot.py starts another when the device torch resolves differs."""
    if device != "auto":
        return device
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    return "cuda" if not hidden and any(Path("/dev").glob("nvidia[0-9]*")) else "cpu"


class Pool:
    def __init__(self, cfg: WorkerConfig, device: str, target: str) -> None:
        self.cfg, self.device, self.target = cfg, device, target
        self.root = Path(tempfile.mkdtemp(prefix="kevo-"))   # the zygote's log; workers' folders without namespaces
        self.proc: subprocess.Popen | None = None
        self.ctl: socket.socket | None = None
        self.info: dict = {}
        self._spare: WorkerHandle | None = None
        self.launched = 0.0                                # when the zygote was started (time.monotonic)
        self.spans: list[Span] = []                        # start-ups seen since the slot last took them (take_spans)

    def _note(self, span: Span) -> None:
        """Keep a start-up's span; the last 64 only, for a pool whose spans nobody takes (a run's own pool)."""
        self.spans = self.spans[-63:] + [span]

    def take_spans(self) -> list[Span]:
        spans, self.spans = self.spans, []
        return spans

    def start(self) -> "Pool":
        """Launch the zygote (unless `launch` did) and wait until it is ready to fork workers."""
        if self.proc is None:
            self.launch()
        return self.ready()

    def launch(self) -> "Pool":
        """Start the zygote without waiting for it (its imports take seconds); `ready` waits."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pythonpath = os.pathsep.join([str(PROJECT_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        extra = {"PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                 "HOME": str(self.root)}
        if self.device == "cpu":
            extra["TRITON_INTERPRET"] = "1"
        log = open(self.root / "zygote.log", "wb")
        try:
            self.proc = spawn_detached([sys.executable, "-m", "harness.zygote", str(theirs.fileno()), self.device],
                                       pass_fds=[theirs.fileno()], env=clean_env(self.cfg.env_passthrough, extra),
                                       cwd=self.root, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        except OSError as e:
            ours.close()
            self.close()
            raise HarnessError(f"cannot start the worker pool ({sys.executable}): {e}") from None
        finally:
            theirs.close()
            log.close()
        self.ctl, self.launched = ours, time.monotonic()
        return self

    def ready(self) -> "Pool":
        """Wait for the launched zygote's ready message (within worker.start_timeout_s of its launch)."""
        if self.info:
            return self
        wait = max(0.0, self.launched + self.cfg.start_timeout_s - time.monotonic())
        ready, _, _ = select.select([self.ctl], [], [], wait)
        data = self.ctl.recv(1 << 16) if ready else b""
        if not data:
            tail = (self.root / "zygote.log").read_text(errors="replace")[-2000:]
            self.close()
            raise HarnessError(f"the worker pool did not start within {self.cfg.start_timeout_s:.0f} s: {tail.strip()}")
        self.info = json.loads(data)
        for name, value in dict(self.info.pop("spans", {})).items():     # the zygote's own: its imports, its preload
            if (span := _reported_span(f"zygote.{name}", value)) is not None:
                if name == "imports":                                     # before them: the interpreter's start
                    self._note(Span(name="zygote.python", start=self.launched, end=max(self.launched, span.start)))
                self._note(span)
        return self

    def _control(self, cmd: dict, fds: list[int] = ()) -> dict:
        assert self.ctl is not None, "pool not started"
        socket.send_fds(self.ctl, [json.dumps(cmd).encode()], list(fds)) if fds else self.ctl.send(json.dumps(cmd).encode())
        data = self.ctl.recv(1 << 16)
        if not data:
            raise HarnessError("the worker pool exited; see " + str(self.root / "zygote.log"))
        return json.loads(data)

    def _fork(self, candidate: bool = True) -> "WorkerHandle":
        """A fresh worker, its warm-up asked for and answered later; one that will run no `candidate` (the health
        check's) is warmed up without the profiler (its CUPTI start), which only a candidate's dispatch stage uses."""
        workdir = Path(tempfile.mkdtemp(prefix="worker-", dir=self.root))   # used only without a mount namespace
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log = os.memfd_create("kevo-worker-log", os.MFD_CLOEXEC)
        spec = sandbox_spec(self.cfg, workdir, self.device, self.root)
        t0 = time.monotonic()
        try:
            reply = self._control({"cmd": "fork", "spec": spec, "target": self.target, "device": self.device,
                                   "log_limit": self.cfg.log_tail_chars}, [theirs.fileno(), log])
        except BaseException:
            os.close(log)
            raise
        finally:
            theirs.close()
        handle = WorkerHandle(self, reply["pid"], ours, workdir, log)
        hello = handle.receive(self.cfg.start_timeout_s, "starting")
        if not hello.get("ok"):
            handle.close()
            raise HarnessError(str(hello.get("error", "the worker did not start")))
        handle.sandbox = str(hello.get("sandbox", ""))
        handle.workdir = Path(str(hello.get("workdir", workdir)))
        self._note(Span(name="worker.start", start=t0, end=time.monotonic()))    # fork, namespaces, lock-down
        from harness.transport import send_pickle
        send_pickle(handle.sock, {"cmd": "warmup", "profiler": candidate})       # CUDA context, profiler, ...: answered later
        return handle

    def _warmed(self, handle: "WorkerHandle") -> None:
        """Wait for a worker's warm-up reply (no candidate has run in it yet) and keep the span it reports."""
        reply = handle.receive(self.cfg.start_timeout_s, "warming up")
        handle.warmed = True
        if (span := _reported_span("worker.warmup", reply.get("span"))) is not None:
            self._note(span)

    def spawn(self, source: str) -> "WorkerHandle":
        """A fresh sandboxed worker holding `source` as its candidate.py. Workers are used once; the
        next one is forked and warmed (CUDA context, profiler) while this one works, so a candidate
        never waits for that and never shares a process with another candidate. With no spare to take (the
        first worker, or a spare that died), the next is forked at once beside this one, so their warm-ups overlap."""
        handle, self._spare = self._spare, None
        if handle is not None:
            try:
                self._hand_over(handle, source)
            except WorkerFailure:
                handle.close()                            # a spare that died waiting: make a fresh one
                handle = None
        if handle is None:                                # no spare (the pool's first worker): both warm up at once
            handle = self._fork()
            try:
                self._spare = self._fork()
                self._hand_over(handle, source)
            except (WorkerFailure, HarnessError):
                handle.close()
                raise
        if self._spare is None:
            self._spare = self._fork()
        return handle

    def settle_spare(self) -> None:
        """Wait for the spare's warm-up (its CUDA context, a matmul under the profiler) to end, so that it
        runs within the stage that forked it and holds that stage's GPU lease, never during another slot's
        timed stage (harness/lease.py). A spare that fails meanwhile is dropped; the next spawn forks afresh."""
        if self._spare is not None and not self._spare.warmed:
            try:
                self._warmed(self._spare)
            except WorkerFailure:
                self._spare.close()
                self._spare = None

    def _hand_over(self, handle: "WorkerHandle", source: str) -> None:
        if not handle.warmed:
            self._warmed(handle)
        reply = handle.request({"cmd": "source", "text": source}, 30, "handing over the candidate's source")
        if not reply.get("ok"):
            handle.close()
            raise HarnessError(f"a fresh worker could not write the candidate's file: {reply.get('error', '')}"[:2000])

    def check_health(self) -> str:
        """A known computation in a fresh worker: "" when it comes out right, else what went wrong."""
        return self.end_health(self.begin_health())

    def begin_health(self) -> "HealthCheck":
        """Start `check_health` without waiting for its answer (`end_health` reads it): a fresh worker, warmed up
        without the profiler (it runs no candidate), is sent the known kernel, and the spare for the next
        candidate is forked meanwhile (if there is none)."""
        handle: WorkerHandle | None = None
        try:
            handle = self._fork(candidate=False)
            handle.send({"cmd": "source", "text": _HEALTH.replace("DEVICE", repr(self.device))}, "handing over the health check")
            handle.send({"cmd": "load", "path": str(handle.workdir / "candidate.py")}, "running the health check")
            if self._spare is None:
                self._spare = self._fork()
            return HealthCheck(handle)
        except WorkerFailure as e:
            why = str(e)
        except HarnessError as e:
            why = f"no fresh worker: {e}"
        if handle is not None:
            handle.close()
        return HealthCheck(None, why)

    def end_health(self, check: "HealthCheck") -> str:
        """The outcome of a health check begun: "" when the known kernel came out right, else what went wrong."""
        if check.handle is None:
            return check.why
        handle = check.handle
        try:
            self._warmed(handle)
            written = handle.collect(30, "handing over the health check")
            reply = handle.collect(self.cfg.start_timeout_s, "running the health check")
        except WorkerFailure as e:
            return str(e)
        finally:
            handle.close()
            self.settle_spare()
        if not written.get("ok"):
            return f"no fresh worker: it could not write the health check's file: {written.get('error', '')}"[:2000]
        # A module that imported cleanly is answered with the ops it defines (none here); one whose import
        # raised (a wrong sum, a device error), with the error instead.
        return "" if "ops" in reply else str(reply.get("error", reply))[-1000:]

    def reap(self, pid: int) -> str:
        try:
            return self._control({"cmd": "reap", "pid": pid, "timeout": 2.0})["status"]
        except (OSError, HarnessError) as e:
            return f"unknown ({e})"

    def close(self) -> None:
        if self._spare is not None and self.ctl is not None:
            self._spare.close()
        self._spare = None
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Pool":
        return self.start()                    # open_pool hands over a started pool: start and ready wait once

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class HealthCheck:
    """A health check under way (`Pool.begin_health`): the worker computing the known kernel, or (None) why none could."""
    handle: "WorkerHandle | None"
    why: str = ""
