"""Where evaluations run: the `Executor` protocol, `InOrder` (verdicts back in submission order, each id once),
`settle`, and `open_executor`, which starts the executor config.executor.kind names.

An executor takes `Job`s (pure data: an id, a source, the last stage to run) and answers each with a
future `Done` (harness/slot.py). The local executor (slot processes on this machine's GPUs, sharing each
GPU's lease) is harness/local_executor.py; the Dask executor is harness/cluster.py.
Not here: choosing candidates, repairing them, recording them (agent/).
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError
from typing import Callable, Protocol

from harness.config import Config
from harness.errors import HarnessError
from harness.slot import Done, Job

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


def _local(cfg: Config, target: str) -> Executor:
    from harness.local_executor import LocalExecutor  # it imports this module (the protocol, settle)
    return LocalExecutor(cfg, target)


def _dask(cfg: Config, target: str) -> Executor:
    from harness.cluster import DaskExecutor          # imports distributed, the optional `cluster` extra
    return DaskExecutor(cfg, target)


EXECUTORS: dict[str, Callable[[Config, str], Executor]] = {"local": _local, "dask": _dask}


def open_executor(cfg: Config, target: str) -> Executor:
    """The executor config.executor.kind names, started: its slots checked, ready for jobs."""
    return EXECUTORS[cfg.executor.kind](cfg, target)
