"""The local executor: slot processes on this machine's GPUs (or shares of its CPU cores), each fed one job
at a time by a thread here, the slots of one GPU sharing its lease.

`LocalExecutor` starts `executor.slots_per_gpu` slot processes per GPU (pinned with CUDA_VISIBLE_DEVICES) or, on
a CPU, `executor.cpu_slots` processes; each slot runs on its own share of the cores; a slot thread here feeds its
process one job at a time. The slots of one GPU share its lease (harness/lease.py), held here: a slot's process
asks for it before each stage and its thread grants it, alone for a timed stage, shared for any other and for a
health check, so no two timed stages and no timed stage and anything else of kevo's ever share a GPU; the replay
holds it whole, and a slot of its GPU in a job meanwhile is parked: it ends the job (its candidate's worker
closed, its memory handed back) and the job is re-queued first in line, not counted as lost (`parked`). A slot
silent for longer than its stage can take while it holds a lease is killed (`silence_limit_s`), which releases
it. A slot that fails its health check, at start or after a job whose worker crashed, hung or hit a CUDA error,
is taken out and the rest go on; with none left, submitting is an error. A slot process that dies mid-job is
restarted and re-checked, and its job re-queued (first in line), at most `executor.requeue_limit` times.
Not here: the Executor protocol, ordering results, choosing an executor (harness/executors.py); the Dask
executor (harness/cluster.py); choosing candidates, repairing them, recording them (agent/).
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

from harness.config import PROJECT_ROOT, Config
from harness.detach import spawn_detached
from harness.errors import HarnessError
from harness.executors import EvaluationLost, OnStage, settle
from harness.lease import Holding, Lease, Parked, mode_of
from harness.stages import stage_of
from harness.pins import local_pins, slot_config
from harness.slot import Done, Job, Pin, needs_check


@dataclass
class _Entry:
    job: Job
    future: Future
    on_stage: OnStage | None
    lost: int = 0


class LocalExecutor:
    def __init__(self, cfg: Config, target: str, pins: list[Pin] | None = None, slack_s: float | None = None) -> None:
        self.cfg, self.target, self.slack_s = cfg, target, slack_s     # slack_s: `silence_limit_s`'s
        self.pins = local_pins(cfg) if pins is None else pins
        if len({p.name for p in self.pins}) != len(self.pins):
            raise HarnessError("two evaluation slots share a name: " + ", ".join(p.name for p in self.pins))
        self.removed: dict[str, str] = {}          # slot name -> why it was taken out
        self.requeued: dict[str, int] = {}         # job id -> times its slot was lost under it
        self.parked: dict[str, int] = {}           # job id -> times it was parked for a replay on its GPU
        self._live: set[str] = set()
        self._busy: dict[str, str] = {}
        self._scratch: dict[str, str] = {}          # slot name -> its pool's folder (removed if the slot is killed)
        self._queue: deque[_Entry] = deque()
        self._futures: dict[str, Future] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.leases = {p.lease or p.name: Lease(p.lease or p.name) for p in self.pins}   # GPU -> its lease
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
        for lease in self.leases.values():
            lease.close()
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
        # a session of its own: a signal to the run's process group (a service manager, `timeout`, `kill -- -PGID`)
        # reaches the run, which finishes the jobs in flight, and not the slots judging them; `close` and the
        # slot's death signal (harness/sandbox.py die_with_parent) are what end a slot
        proc = spawn_detached([sys.executable, "-m", "harness.slot", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                              cwd=PROJECT_ROOT, stdin=subprocess.DEVNULL)
        theirs.close()
        self._procs[pin.name] = proc
        conn = Connection(ours.detach())
        conn.send((slot_config(self.cfg, pin, self.pins).model_dump_json(), self.target, pin.model_dump_json()))
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
        holding = Holding(self.leases[pin.lease or pin.name], pin.name)
        try:
            while True:
                if proc is None:
                    if not holding.hold("shared"):  # the check computes on the GPU: never during a timed stage
                        return
                    proc, conn = self._start(pin)
                    why = self._health(conn, pin, proc)
                    holding.release()
                    if why:
                        return self._take_out(pin, why)
                    with self._cond:
                        self._live.add(pin.name)
                    started.set()
                entry = self._take(pin.name)
                if entry is None:
                    return
                try:
                    outcome = self._run(conn, entry, holding, proc)
                except Exception as e:              # a bug here must leave no future pending: not this job's,
                    why = f"{pin.name}: the slot thread failed: {type(e).__name__}: {e}"     # nor the queue's
                    settle(entry.future, error=EvaluationLost(f"{entry.job.id}: {why}"))
                    return self._take_out(pin, why)
                if outcome == "parked":
                    self._unpark(entry)
                elif outcome in ("lost", "hung"):
                    conn.close()
                    proc.wait()
                    if self._closed:                # killed by close(): no new slot process, no requeue
                        entry.future.cancel()
                        return
                    with self._cond:
                        self._live.discard(pin.name)
                        self._busy.pop(pin.name, None)
                    self._requeue(entry, f"the {pin.name} slot process " + (_how(proc.returncode) if outcome == "lost" else
                                  "held its GPU's lease silent for longer than its stage may take, and was killed"))
                    scratch = self._scratch.pop(pin.name, "")
                    if scratch:                     # the killed process could not remove its pool's folder
                        shutil.rmtree(scratch, ignore_errors=True)
                    proc = None
                elif outcome == "check":
                    if not holding.hold("shared"):
                        return
                    conn.send(("check",))
                    why = self._health(conn, pin, proc)
                    holding.release()
                    if why:
                        return self._take_out(pin, why)
        finally:
            holding.release()                       # a slot thread that ends holds nothing
            started.set()
            if conn is not None:
                conn.close()
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def _health(self, conn, pin: Pin, proc: subprocess.Popen) -> str:
        try:
            if not conn.poll(silence_limit_s(self.cfg, None, self.slack_s)):
                proc.kill()
                return f"{pin.name}: the slot process hung in its health check (killed)"
            _, why, self._scratch[pin.name] = conn.recv()
        except (EOFError, OSError):
            return f"{pin.name}: the slot process died during its health check"
        return why

    def _run(self, conn, entry: _Entry, holding: Holding, proc: subprocess.Popen) -> str:
        """'done', 'check' (done, but the slot must be checked first), 'parked' (to run again), 'lost' or 'hung'
        (killed). The job begins once no replay drains or holds its GPU; each stage the slot asks for starts once
        its GPU's lease is held here as the stage needs; released, and the job ended, at the end."""
        if not holding.begin_job():
            return "lost"                           # the executor is closing
        try:
            conn.send(("job", entry.job.model_dump_json()))
        except OSError:
            holding.end_job()
            return "lost"
        try:
            return self._answer(conn, entry, holding, proc)
        finally:
            holding.end_job()

    def _answer(self, conn, entry: _Entry, holding: Holding, proc: subprocess.Popen) -> str:
        callback_error: Exception | None = None
        stage = None
        while True:
            try:
                if stage is not None and not conn.poll(silence_limit_s(self.cfg, stage, self.slack_s)):
                    proc.kill()
                    return "hung"
                kind, payload = conn.recv()
            except (EOFError, OSError):
                return "lost"
            if kind == "stage":
                try:
                    if not holding.hold(mode_of(payload)):
                        return "lost"               # the executor is closing
                except Parked:
                    return self._park(conn, entry, proc, payload)
                stage = payload
                try:
                    conn.send(("go", payload))
                except OSError:
                    return "lost"
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

    def _park(self, conn, entry: _Entry, proc: subprocess.Popen, stage: str) -> str:
        """Tell the slot, waiting for its `stage`, to end its job and give its GPU memory back; 'parked' once
        it says it did, else as `_answer` would say of a slot that fails to."""
        try:
            conn.send(("park", stage))
            if not conn.poll(silence_limit_s(self.cfg, None, self.slack_s)):
                proc.kill()
                return "hung"
            kind, payload = conn.recv()
        except (EOFError, OSError):
            return "lost"
        if (kind, payload) != ("parked", entry.job.id):
            settle(entry.future, error=EvaluationLost(f"{entry.job.id}: the slot answered {str((kind, payload))[:100]} "
                                                      "when told to park"))
            return "check"
        return "parked"

    def _unpark(self, entry: _Entry) -> None:
        """A parked job, first in line again; a park is no loss (requeue_limit does not count it)."""
        with self._cond:
            self.parked[entry.job.id] = self.parked.get(entry.job.id, 0) + 1
            if self._closed:
                entry.future.cancel()
            else:
                self._queue.appendleft(entry)
                self._cond.notify()

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



def silence_limit_s(cfg: Config, stage: str | None, slack_s: float | None = None) -> float:
    """How long a slot may stay silent while it holds its GPU's lease before it is taken for hung: the
    stage's timeout (for a health check: its pool's start, a fresh worker and the retry) and `slack_s` more for
    the trusted side's work past the deadline (None: as much again, at least a minute)."""
    limit = 3 * cfg.worker.start_timeout_s + cfg.executor.health_retry_s if stage is None else getattr(cfg.stages, stage_of(stage)).timeout_s
    return limit + (max(60.0, limit) if slack_s is None else slack_s)


def _how(code: int | None) -> str:
    if code is None:
        return "did not exit"
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
