"""Where evaluations run: the `Executor` protocol, the local executor (a slot process per GPU on this
machine), `InOrder` (verdicts back in submission order, each id once), and `open_executor`.

An executor takes `Job`s (pure data: an id, a source, the last stage to run) and answers each with a
future `Done` (harness/slot.py). `LocalExecutor` starts one slot process per GPU (pinned with
CUDA_VISIBLE_DEVICES) or, on a CPU, `executor.cpu_slots` processes; each slot runs on its own share
of the cores; a slot thread here feeds its process one job at a time, so no two jobs ever share a GPU. A
slot that fails its health check, at start or after a job whose worker crashed, hung or hit a CUDA error, is taken out
and the rest go on; with none left, submitting is an error. A slot process that dies mid-job is
restarted and re-checked, and its job re-queued (first in line), at most `executor.requeue_limit`
times. The Dask executor is harness/cluster.py.
Not here: choosing candidates, repairing them, recording them (agent/).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Protocol

import torch

from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.evaluate import resolve_device
from harness.slot import Done, Job, Pin, needs_check

OnStage = Callable[[str], None]


class EvaluationLost(HarnessError):
    """A job whose evaluator was lost more often than executor.requeue_limit allows."""


class Executor(Protocol):
    def submit(self, job: Job, on_stage: OnStage | None = None) -> Future:
        """A future Done. Submitting an id already submitted returns that id's future, and a second
        answer for an id is dropped (`settle`): one verdict per id. `on_stage(name)` is called from
        another thread as each stage starts."""

    @property
    def capacity(self) -> int:
        """Jobs that can run at once now (healthy slots); keep about this many in flight."""

    def close(self) -> None: ...


def core_locality(cpu: int) -> tuple[int, int]:
    """(NUMA node, first core of its last-level cache group) from sysfs; (0, 0) where the host says nothing."""
    sysfs = Path("/sys/devices/system/cpu") / f"cpu{cpu}"
    node = next((int(p.name[4:]) for p in sysfs.glob("node[0-9]*")), 0)
    group = 0
    for idx in sorted(sysfs.glob("cache/index[0-9]*")):
        try:
            if (idx / "level").read_text().strip() == "3":
                group = int((idx / "shared_cpu_list").read_text().strip().replace("-", ",").split(",")[0])
        except (OSError, ValueError):
            pass
    return node, group


def core_shares(n: int, layout: str = "blocks") -> list[tuple[int, ...]]:
    """This process's CPU cores dealt out to n slots (`deal_cores`)."""
    return deal_cores(sorted(os.sched_getaffinity(0)), n, layout)


def deal_cores(cores: list[int], n: int, layout: str, locality: Callable[[int], tuple] = core_locality) -> list[tuple[int, ...]]:
    """The cores dealt out to n slots (one core each where there are fewer cores than slots). blocks:
    contiguous runs of the cores ordered by `locality` (NUMA node and last-level cache), so that a slot
    shares as little cache with another as the host allows; interleaved: every n-th core to each; none:
    every slot gets every core."""
    if layout == "none":
        return [tuple(cores)] * n
    if n > len(cores):
        return [(cores[i % len(cores)],) for i in range(n)]
    if layout == "interleaved":
        return [tuple(cores[i::n]) for i in range(n)]
    ordered = sorted(cores, key=lambda c: (*locality(c), c))
    cuts = [len(cores) * i // n for i in range(n + 1)]
    return [tuple(sorted(ordered[a:b])) for a, b in zip(cuts, cuts[1:])]


def local_pins(cfg: Config) -> list[Pin]:
    """One pin per GPU (executor.gpus: indices among the GPUs this process sees), or cpu_slots pins.
    Either way each slot gets its own share of this process's CPU cores: an evaluation is mostly host
    work, and on the 2-GPU H200 host a job took about 10% longer with a second slot free to use every
    core (docs/BENCHMARKS.md, 2026-11-30 fourth session)."""
    ex = cfg.executor
    if resolve_device(cfg).type == "cuda":
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [v.strip() for v in seen.split(",")] if seen else [str(i) for i in range(torch.cuda.device_count())]
        indices = list(range(len(names)) if ex.gpus == "auto" else ex.gpus)
        # an index past the GPUs seen fails the slot's health check honestly; past a CUDA_VISIBLE_DEVICES
        # list it must not become a physical index (another slot's GPU, maybe): "-1" makes none visible
        missing = "-1" if seen else None
        return [Pin(name=f"gpu{i}", device="cuda", visible=names[i] if i < len(names) else (missing or str(i)), cpus=cpus)
                for i, cpus in zip(indices, core_shares(len(indices), ex.slot_cores))]
    return [Pin(name=f"cpu{i}", device="cpu", cpus=s) for i, s in enumerate(core_shares(ex.cpu_slots, ex.slot_cores))]


@dataclass
class _Entry:
    job: Job
    future: Future
    on_stage: OnStage | None
    lost: int = 0


class LocalExecutor:
    def __init__(self, cfg: Config, target: str, pins: list[Pin] | None = None) -> None:
        self.cfg, self.target = cfg, target
        self.pins = local_pins(cfg) if pins is None else pins
        if len({p.name for p in self.pins}) != len(self.pins):
            raise HarnessError("two evaluation slots share a name: " + ", ".join(p.name for p in self.pins))
        self.removed: dict[str, str] = {}          # slot name -> why it was taken out
        self.requeued: dict[str, int] = {}         # job id -> times its slot was lost under it
        self._live: set[str] = set()
        self._busy: dict[str, str] = {}
        self._scratch: dict[str, str] = {}          # slot name -> its pool's folder (removed if the slot is killed)
        self._queue: deque[_Entry] = deque()
        self._futures: dict[str, Future] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._cond = threading.Condition()
        self._closed = False
        started = [threading.Event() for _ in self.pins]
        self._threads = [threading.Thread(target=self._serve, args=(pin, ev), name=f"kevo-slot-{pin.name}", daemon=True)
                         for pin, ev in zip(self.pins, started)]
        for t in self._threads:
            t.start()
        for ev in started:
            ev.wait()
        if not self._live:
            self.close()
            raise HarnessError("no evaluation slot passed its health check: " + "; ".join(self.removed.values()))

    @property
    def capacity(self) -> int:
        with self._cond:
            return len(self._live)

    def running(self) -> dict[str, str]:
        """Slot name -> the id of the job it is evaluating now."""
        with self._cond:
            return dict(self._busy)

    def pid(self, slot: str) -> int | None:
        """The process id of a slot's process (for diagnostics and tests)."""
        proc = self._procs.get(slot)
        return proc.pid if proc is not None else None

    def submit(self, job: Job, on_stage: OnStage | None = None) -> Future:
        with self._cond:
            if job.id in self._futures:
                return self._futures[job.id]
            if self._closed:
                raise HarnessError("the executor is closed")
            if len(self.removed) == len(self.pins):
                raise HarnessError("every evaluation slot was taken out: " + "; ".join(self.removed.values()))
            fut: Future = Future()
            self._futures[job.id] = fut
            self._queue.append(_Entry(job, fut, on_stage))
            self._cond.notify()
        return fut

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for entry in self._queue:
                entry.future.cancel()
            self._queue.clear()
            self._cond.notify_all()
        for proc in list(self._procs.values()):
            proc.terminate()                       # SIGTERM: the slot closes its pool and exits
        for t in self._threads:
            t.join(timeout=30)

    def __enter__(self) -> "LocalExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- a slot thread: one per pin, feeding its slot process one job at a time ----------------------

    def _start(self, pin: Pin) -> tuple[subprocess.Popen, Connection]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = subprocess.Popen([sys.executable, "-m", "harness.slot", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL)
        theirs.close()
        self._procs[pin.name] = proc
        conn = Connection(ours.detach())
        conn.send((self.cfg.model_dump_json(), self.target, pin.model_dump_json()))
        return proc, conn

    def _take(self, slot: str) -> _Entry | None:
        with self._cond:
            self._busy.pop(slot, None)
            while not self._closed:
                while self._queue:
                    entry = self._queue.popleft()
                    if not entry.future.cancelled():
                        self._busy[slot] = entry.job.id
                        return entry
                self._cond.wait()
            return None

    def _serve(self, pin: Pin, started: threading.Event) -> None:
        proc = conn = None
        try:
            while True:
                if proc is None:
                    proc, conn = self._start(pin)
                    why = self._health(conn, pin)
                    if why:
                        return self._take_out(pin, why)
                    with self._cond:
                        self._live.add(pin.name)
                    started.set()
                entry = self._take(pin.name)
                if entry is None:
                    return
                try:
                    outcome = self._run(conn, entry)
                except Exception as e:              # a bug here must leave no future pending: not this job's,
                    why = f"{pin.name}: the slot thread failed: {type(e).__name__}: {e}"     # nor the queue's
                    settle(entry.future, error=EvaluationLost(f"{entry.job.id}: {why}"))
                    return self._take_out(pin, why)
                if outcome == "lost":
                    conn.close()
                    proc.wait()
                    if self._closed:                # killed by close(): no new slot process, no requeue
                        entry.future.cancel()
                        return
                    with self._cond:
                        self._live.discard(pin.name)
                        self._busy.pop(pin.name, None)
                    self._requeue(entry, f"the {pin.name} slot process {_how(proc.returncode)}")
                    scratch = self._scratch.pop(pin.name, "")
                    if scratch:                     # the killed process could not remove its pool's folder
                        shutil.rmtree(scratch, ignore_errors=True)
                    proc = None
                elif outcome == "check":
                    conn.send(("check",))
                    why = self._health(conn, pin)
                    if why:
                        return self._take_out(pin, why)
        finally:
            started.set()
            if conn is not None:
                conn.close()
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _health(self, conn, pin: Pin) -> str:
        try:
            _, why, self._scratch[pin.name] = conn.recv()
        except (EOFError, OSError):
            return f"{pin.name}: the slot process died during its health check"
        return why

    def _run(self, conn, entry: _Entry) -> str:
        """'done', 'check' (done, but the slot must be checked first) or 'lost'."""
        try:
            conn.send(("job", entry.job.model_dump_json()))
        except OSError:
            return "lost"
        callback_error: Exception | None = None
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                return "lost"
            if kind == "stage":
                if entry.on_stage is not None and callback_error is None:
                    try:
                        entry.on_stage(payload)
                    except Exception as e:          # the caller's callback: its error is the job's
                        callback_error = e
                continue
            if kind == "error":
                settle(entry.future, error=HarnessError(payload))
                return "done"
            try:
                done = Done.model_validate_json(payload)
            except ValueError as e:                 # pydantic's ValidationError: settled, never left pending
                settle(entry.future, error=EvaluationLost(f"{entry.job.id}: the slot's answer does not validate: "
                                                          + " ".join(str(e).split())[:500]))
                return "check"
            settle(entry.future, done, callback_error)
            return "check" if needs_check(done.verdict) else "done"

    def _requeue(self, entry: _Entry, why: str) -> None:
        with self._cond:
            entry.lost += 1
            self.requeued[entry.job.id] = entry.lost
            if self._closed:
                entry.future.cancel()
            elif entry.lost > self.cfg.executor.requeue_limit:
                settle(entry.future, error=EvaluationLost(
                    f"{entry.job.id}: its evaluator was lost {entry.lost} times (executor.requeue_limit "
                    f"{self.cfg.executor.requeue_limit}); last: {why}"))
            else:
                self._queue.appendleft(entry)
                self._cond.notify()

    def _take_out(self, pin: Pin, why: str) -> None:
        with self._cond:
            self._live.discard(pin.name)
            self._busy.pop(pin.name, None)
            self.removed[pin.name] = why
            if len(self.removed) == len(self.pins):
                for entry in self._queue:
                    settle(entry.future, error=HarnessError("every evaluation slot was taken out: "
                                                             + "; ".join(self.removed.values())))
                self._queue.clear()


def settle(fut: Future, result: Done | None = None, error: BaseException | None = None) -> bool:
    """Give a future its outcome once; a future already settled (cancelled, or answered before)
    keeps its first outcome and this one is dropped. Futures stay pending while their job runs, so
    a re-queued job's future is simply answered later."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        return True
    except InvalidStateError:
        return False


def _how(code: int | None) -> str:
    if code is None:
        return "did not exit"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class InOrder:
    """Results in flight, handed back in the order they were added (the ledger's order), each id
    once: adding an id again, in flight or already handed back, is ignored. Holds an executor's
    jobs (`submit`) or any future under an id (`track`: e.g. a thread judging a candidate through
    several repair rounds)."""

    def __init__(self, executor: Executor | None = None) -> None:
        self.executor = executor
        self.pending: OrderedDict[str, Future] = OrderedDict()
        self.delivered: set[str] = set()

    def submit(self, job: Job, on_stage: OnStage | None = None) -> bool:
        """False when the id is already in flight or delivered (nothing is submitted)."""
        if job.id in self.pending or job.id in self.delivered:
            return False
        return self.track(job.id, self.executor.submit(job, on_stage))

    def track(self, key: str, future: Future) -> bool:
        if key in self.pending or key in self.delivered:
            return False
        self.pending[key] = future
        return True

    def __len__(self) -> int:
        return len(self.pending)

    def ready(self) -> bool:
        """Whether the oldest in flight has its result (next() will not wait)."""
        return bool(self.pending) and next(iter(self.pending.values())).done()

    def next(self, timeout: float | None = None):
        """The oldest one's result (a Done for a job), waiting for it; its error (EvaluationLost,
        HarnessError) is raised here, and it counts as delivered either way."""
        key, fut = next(iter(self.pending.items()))
        try:
            return fut.result(timeout)
        finally:
            if fut.done():
                del self.pending[key]
                self.delivered.add(key)


def _dask(cfg: Config, target: str) -> Executor:
    from harness.cluster import DaskExecutor          # imports distributed, the optional `cluster` extra
    return DaskExecutor(cfg, target)


EXECUTORS: dict[str, Callable[[Config, str], Executor]] = {"local": LocalExecutor, "dask": _dask}


def open_executor(cfg: Config, target: str) -> Executor:
    """The executor config.executor.kind names, started: its slots checked, ready for jobs."""
    return EXECUTORS[cfg.executor.kind](cfg, target)
