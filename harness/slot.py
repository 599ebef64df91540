"""One evaluation slot: the staged evaluator pinned to one GPU (or a share of the CPU cores), one job
at a time, with its own worker pool and a health check of its device.

Every stage of a job runs in its slot, the microbench and the full scored replay included, and a
slot runs one job at a time. Several slots may share a GPU (executor.slots_per_gpu): a slot process
started by harness/local_executor.py asks its executor before each stage and waits for the grant of that
GPU's lease (harness/lease.py), so nothing else of kevo's runs on a GPU while a microbench times on it
or a replay serves from it (docs/EVALUATOR.md). Pinning is by environment and affinity,
set before the slot touches CUDA, so the worker pool's zygote, its workers and the replay's servers
inherit it. The health check (`device_health`, the one every caller uses: slots, `kevo-agent evaluate`
and a run in the loop's own pool) is a known sum computed on the device in the caller's process (in a
thread: on a GPU it starts the caller's CUDA context) while a tiny Triton kernel with a known answer runs
in a fresh sandboxed worker (`Pool.check_health`); both must come out right, and a device that fails
either is checked once more after executor.health_retry_s (a fault may be passing).
A slot of a GPU that other slots share (`Pin.shared`) hands its working memory back after every job, and a
slot told to park (another slot's replay needs the GPU whole: harness/lease.py) ends its job at once, its
candidate's worker closed and its memory handed back, and says so; the executor runs the job again later.
A slot records what its start-ups took (its pool's, its health checks': `Done.startup`, Span records).
A job is judged through the verdict cache (harness/verdicts.py): a verdict reached before for the
same inputs comes back marked `cached_from`, with no stage run.
Used by harness/local_executor.py (a slot process per GPU there) and harness/cluster.py (a slot per Dask
worker process). `Job` and `Done` are pure data: they cross a pipe or a network as JSON.
Not here: which slot runs which job, re-queueing, ordering (the executors).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict

from harness.config import Config
from harness.errors import HarnessError
from harness.evaluate import resolve_device
from harness.gpu_memory import release
from harness.lease import Parked
from harness.pool import Pool
from harness.records import Span, Verdict
from harness.verdicts import evaluate_cached

_KNOWN = 4096
_KNOWN_SUM = float(_KNOWN * (_KNOWN - 1))          # 2 * (0 + 1 + ... + 4095): exact in float32


class Job(BaseModel):
    """One evaluation: a candidate's source, to be judged by the stages up to `until` (None: all)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str                   # unique per evaluation: the candidate's id, or its repair round's (c007.r1)
    source: str
    until: str | None = None
    beat: float = 1.0         # the speedup over the torch baseline microbench must beat (the parent's)
    head: str | None = None   # the current head of the candidate's op, which the replay judges it against (None: torch)
    other_heads: dict[str, str] = {}   # per other op, its current head, served in both of the replay's arms
    fresh: bool = False       # judged by the stages whatever the verdict cache holds (re-judging a run asks that)


class Done(BaseModel):
    """A job's verdict and where and when it was reached (diagnostics; not part of any ledger)."""
    model_config = ConfigDict(extra="forbid")
    id: str
    verdict: Verdict
    slot: str                 # gpu1, cpu0, or a Dask worker's address
    started: float            # wall clock (time.time) in the slot
    ended: float
    spans: list[Span] = []    # each stage run, as the slot ran it, from its lease's grant (none for a cached verdict)
    # What the slot spent on start-ups since its last job, before this one: its pool's start (`pool`: waiting for
    # its zygote), each health check (`health`), the verdict cache's look-up and the stages' set-up (`prepare`),
    # and their parts beside them (`zygote.*`, `worker.*`, `health.*`); a worker forked within a stage is not here.
    startup: list[Span] = []


class Pin(BaseModel):
    """Where a slot runs: one GPU (CUDA_VISIBLE_DEVICES), or a set of CPU cores (affinity)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    device: Literal["cuda", "cpu"]
    visible: str | None = None        # the CUDA_VISIBLE_DEVICES value (an index or a GPU UUID)
    cpus: tuple[int, ...] = ()        # empty: leave the affinity as it is
    lease: str = ""                   # the key of the GPU lease the slot shares with the others on its GPU ("": its own)
    shared: bool = False              # other slots share its GPU: it holds no working memory between jobs


def _known_sum(device: torch.device | str) -> str:
    try:
        x = torch.arange(_KNOWN, dtype=torch.float32, device=device)
        got = float((x * 2).sum().item())
        return "" if got == _KNOWN_SUM else f"a known sum on {torch.device(device).type} came out {got}, not {_KNOWN_SUM}"
    except (OSError, RuntimeError, HarnessError) as e:
        return f"{type(e).__name__}: {e}"


@dataclass
class Checking:
    """A health check under way (`begin_health`): the known sum's thread here, the known kernel's worker there."""
    beside: threading.Thread
    here: list
    finish: Callable[[], str]          # waits for the known kernel's answer: "" or why not
    spans: list[Span]
    begun: float                       # when the known kernel was asked for (monotonic)


def begin_health(device: torch.device | str, pool: Pool | Callable[[], Pool], spans: list[Span],
                 overlap: bool = False) -> Checking:
    """Start the health check: the known sum here, in a thread (on a GPU it starts this process's CUDA context), and
    the known kernel in a fresh worker; `pool` may be a function that gives it, called meanwhile (a slot's zygote
    may still be starting). `overlap`: the known kernel is only sent here (`Pool.begin_health`) and its answer read
    by `end_health`, so that the caller works meanwhile; else `end_health` runs it whole (`Pool.check_health`).
    An error starting the pool is raised, as the pool raises it."""
    here: list[str | BaseException] = []
    t0 = time.monotonic()

    def known_sum() -> None:
        try:
            here.append(_known_sum(device))
        except BaseException as e:                 # a harness bug: raised here, in the caller's thread
            here.append(e)
        spans.append(Span(name="health.here", start=t0, end=time.monotonic()))

    beside = threading.Thread(target=known_sum, name="kevo-known-sum", daemon=True)
    beside.start()
    try:
        if callable(pool):
            t1 = time.monotonic()
            pool = pool()
            spans.append(Span(name="pool", start=t1, end=time.monotonic()))
    except BaseException:
        beside.join()
        raise
    t1, started = time.monotonic(), pool

    def guarded(run: Callable[[], str]) -> str:
        try:
            return run()
        except (OSError, RuntimeError, HarnessError) as e:
            return f"{type(e).__name__}: {e}"

    if overlap:
        try:
            check = started.begin_health()
        except (OSError, RuntimeError, HarnessError) as e:
            why = f"{type(e).__name__}: {e}"
            return Checking(beside, here, lambda: why, spans, t1)
        return Checking(beside, here, lambda: guarded(lambda: started.end_health(check)), spans, t1)
    return Checking(beside, here, lambda: guarded(started.check_health), spans, t1)


def end_health(checking: Checking) -> str:
    """The outcome of a health check begun: '' when both parts came out right, else why not (the sum's failure first)."""
    try:
        why = checking.finish()
        checking.spans.append(Span(name="health.worker", start=checking.begun, end=time.monotonic()))
    finally:
        checking.beside.join()
    if isinstance(checking.here[0], BaseException):
        raise checking.here[0]
    return checking.here[0] or why


def _health_once(device: torch.device | str, pool: Pool | Callable[[], Pool], spans: list[Span]) -> str:
    """The known sum here while the known kernel runs in a fresh worker, waited for (`begin_health`, `end_health`)."""
    return end_health(begin_health(device, pool, spans))


def device_health(device: torch.device | str, pool: Pool | Callable[[], Pool], retry_s: float,
                  sleep: Callable[[float], None] = time.sleep, spans: list[Span] | None = None,
                  begun: Checking | None = None) -> str:
    """'' when the device computes a known sum here and a known kernel in a fresh worker of `pool` (or of the
    pool that `pool()` gives); else one line saying why not. A device that fails is checked once more after
    `retry_s` seconds. Appends to `spans` what each part took (`pool`, `health.here`, `health.worker`). `begun`:
    the first attempt, begun earlier (`begin_health`), whose answer is read here; its spans are its own."""
    spans = ([] if begun is None else begun.spans) if spans is None else spans
    why = end_health(begun) if begun is not None else _health_once(device, pool, spans)
    if why:
        sleep(retry_s)
        why = _health_once(device, pool, spans)
    return " ".join(why.split())


@dataclass
class SlotCheck:
    """A slot's health check begun (`Slot.check_begin`): under way, or (a string) why it could not begin."""
    begun: Checking | str
    spans: list[Span]
    overlap: bool


class Unchecked(Exception):
    """The health check run beside a job failed: the job gets no verdict (`Slot.run`'s `settled`)."""


def needs_check(verdict: Verdict) -> bool:
    """A worker that crashed, hung or hit a CUDA error may have left the device unwell: check it before the next job."""
    return any(s.worker_lost for s in verdict.stages)


class Slot:
    def __init__(self, cfg: Config, target: str, pin: Pin | None = None, name: str = "", pool: Pool | None = None) -> None:
        """`pool`: one launched already for this slot (`kevo-agent evaluate` starts its zygote before it imports
        torch); used when it is for the device the slot resolves, else closed and another started."""
        self.cfg, self.target, self.pin = cfg, target, pin
        self.name = pin.name if pin else name
        self.pool: Pool | None = pool
        self._pinned = pin is None
        self.startup: list[Span] = []         # since the last job: the next Done's `startup`

    def _apply_pin(self) -> None:
        if self._pinned:
            return
        if self.pin.device == "cuda":
            os.environ["CUDA_VISIBLE_DEVICES"] = self.pin.visible or ""
        if self.pin.cpus:
            try:
                os.sched_setaffinity(0, self.pin.cpus)
            except OSError as e:
                raise OSError(f"cannot pin to CPU cores {list(self.pin.cpus)}: {e.strerror}") from None
            torch.set_num_threads(len(self.pin.cpus))
        self._pinned = True

    def device(self) -> torch.device:
        if self.pin is None:
            return resolve_device(self.cfg)
        if self.pin.device == "cuda" and not torch.cuda.is_available():
            raise HarnessError(f"no CUDA device visible with CUDA_VISIBLE_DEVICES={self.pin.visible}")
        return torch.device(self.pin.device)

    def _pool(self) -> Pool:
        device = self.device().type
        if (self.pool is not None and self.pool.device == device and self.pool.proc is not None
                and self.pool.proc.poll() is None):
            return self.pool.ready()
        if self.pool is not None:                  # its zygote died, or was launched for another device: start another
            self.pool.close()
        self.pool = None
        self.pool = Pool(self.cfg.worker, device, self.target).start()
        return self.pool

    def check(self, retry: bool = True) -> str:
        """'' when the slot can evaluate; otherwise one line saying why not (without `retry`, from one attempt)."""
        return self.check_end(self.check_begin(overlap=False), retry)

    def check_begin(self, overlap: bool = True) -> "SlotCheck":
        """Begin `check`; with `overlap`, return once the known kernel is sent (`begin_health`), so a job can start
        beside it; `check_end` gives its outcome, and no verdict of that job may be given before it (`Slot.run`'s
        `settled`). Its step on the command's path (`health`) ends here; the rest of it runs beside."""
        t0, spans = time.monotonic(), []
        try:
            self._apply_pin()
            begun: Checking | str = begin_health(self.device(), self._pool, spans, overlap)
        except (OSError, RuntimeError, HarnessError) as e:
            begun = f"{type(e).__name__}: {e}"
        pool = [s for s in spans if s.name == "pool"][:1]      # the health check is what follows the pool's start
        self.startup += pool + [Span(name="health", start=pool[0].end if pool else t0, end=time.monotonic())]
        return SlotCheck(begun=begun, spans=spans, overlap=overlap)

    def check_end(self, check: "SlotCheck", retry: bool = True) -> str:
        """'' when the check begun passed (with `retry`, a failure is checked once more after
        executor.health_retry_s); else why not."""
        why = check.begun if isinstance(check.begun, str) else ""
        if not why:
            try:
                why = (device_health(self.device(), self._pool, self.cfg.executor.health_retry_s, begun=check.begun)
                       if retry else " ".join(end_health(check.begun).split()))
            except (OSError, RuntimeError, HarnessError) as e:
                why = f"{type(e).__name__}: {e}"
        if not check.overlap:
            self.startup[-1] = self.startup[-1].model_copy(update={"end": time.monotonic()})   # the whole check on the path
        self.startup += [s for s in check.spans if s.name != "pool"] + (self.pool.take_spans() if self.pool is not None else [])
        return f"{self.name}: " + " ".join(why.split())[:500] if why else ""

    def identity(self) -> str:
        """The device this slot runs on, the same string for every slot that shares it."""
        self._apply_pin()
        host = socket.gethostname()
        if self.device().type == "cuda":
            return f"{host}/{torch.cuda.get_device_properties(0).uuid}"
        return f"{host}/cpu{sorted(os.sched_getaffinity(0))}"

    def run(self, job: Job, on_stage: Callable[[str], None] | None = None,
            settled: Callable[[], None] | None = None) -> Done:
        """Judge a job; `on_stage(name)` is called before each stage starts, and the stage waits for it
        to return (a slot process asks for its GPU's lease there). `settled()` (a health check run beside the
        job: it raises `Unchecked` if the check failed) is called before every stage after the first and before a
        verdict is stored or returned, within the spans; what a check begun beside it recorded is this job's."""
        started, spans, t0 = time.time(), [], time.monotonic()
        startup, self.startup = self.startup, []
        pool = self._pool()
        startup += pool.take_spans()               # a pool started afresh here, say

        def stage(name: str) -> None:
            if spans:
                spans[-1] = spans[-1].model_copy(update={"end": time.monotonic()})
            else:                                  # the verdict cache's look-up, the shapes, the context
                startup.append(Span(name="prepare", start=t0, end=time.monotonic()))
            if on_stage is not None:
                on_stage(name)
            now = time.monotonic()
            spans.append(Span(name=name, start=now, end=now))
            if settled is not None and len(spans) > 1:       # the first stage may run beside the check, no other
                settled()

        verdict = evaluate_cached(job.source, self.target, self.cfg, pool, job=job.id,
                                  where=f"{socket.gethostname()}/{self.name}", until=job.until, on_stage=stage,
                                  beat=job.beat, head=job.head, other_heads=job.other_heads, settled=settled,
                                  fresh=job.fresh)
        if spans:
            spans[-1] = spans[-1].model_copy(update={"end": time.monotonic()})
        else:                                      # the verdict cache answered
            startup.append(Span(name="cache", start=t0, end=time.monotonic()))
        pool.take_spans()                          # workers forked within the stages: their time is the stages'
        startup, self.startup = startup + self.startup, []     # a check that ended within the job: its parts
        return Done(id=job.id, verdict=verdict, slot=self.name, started=started, ended=time.time(), spans=spans,
                    startup=startup)

    def give_back(self) -> None:
        """Hand this process's working GPU memory back to the device (the flush buffer and the CUDA context
        stay); the next job's first stage takes it again (harness/gpu_memory.py; nothing to do on a CPU)."""
        release(self.device())

    def scratch(self) -> str:
        """The pool's scratch folder, for whoever must clean up after this process is killed."""
        return str(self.pool.root) if self.pool is not None else ""

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def serve(fd: int) -> None:
    """A slot process (`python -m harness.slot FD`, started by harness/local_executor.py). The first message
    on FD is (config JSON, target, pin JSON); then it answers ("check",) and ("job", JSON) until FD
    closes. Before each stage of a job it sends ("stage", name) and waits for ("go", name): the grant of
    its GPU's lease, held by the executor; or ("park", name): it ends the job there (`Parked`: the candidate's
    worker closed on the way out of `evaluate`), hands its memory back and answers ("parked", job id).
    SIGTERM ends it with its pool closed; SIGINT is left to the process that started it."""
    from harness.detach import release_group_signals
    from harness.sandbox import die_with_parent
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    release_group_signals()
    conn = Connection(fd)
    cfg_json, target, pin_json = conn.recv()
    slot = Slot(Config.model_validate_json(cfg_json), target, Pin.model_validate_json(pin_json))
    try:
        conn.send(("health", slot.check(), slot.scratch()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "check":
                conn.send(("health", slot.check(), slot.scratch()))
                continue
            job = Job.model_validate_json(msg[1])

            def granted(name: str) -> None:
                conn.send(("stage", name))
                if (reply := conn.recv()) == ("park", name):
                    raise Parked(name)
                if reply != ("go", name):
                    raise HarnessError(f"the executor answered {str(reply)[:100]} to a request for the {name} stage")

            try:
                reply = ("done", slot.run(job, on_stage=granted).model_dump_json())
            except Parked:
                reply = ("parked", job.id)
            except HarnessError as e:
                reply = ("error", str(e))
            if slot.pin.shared or reply[0] == "parked":     # before the executor counts this slot's memory free
                slot.give_back()
            conn.send(reply)
    finally:
        slot.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
