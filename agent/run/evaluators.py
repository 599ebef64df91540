"""Where a run's candidates and heads are evaluated: the loop's own worker pool, one evaluation at a time
(`PoolEvaluator`), or an executor's slots, one evaluation per slot at once (`SlotsEvaluator`: one slot
process per GPU here, or a Dask cluster; harness/executors.py). `in_parallel` says which a config asks for.

Both answer the drive (agent/run/drive.py) alike: how many evaluations may run at once (`capacity`), one
round's verdict (`evaluate`, called from a judge thread), and what a judged candidate's commit adds
(`after`). The pool checks its device after a candidate whose worker crashed, hung or hit a CUDA error
(harness/slot.py:device_health, the one health check, its retry included: agent/roles/evaluator.py's
check_device) before the next candidate gets it, and a device that failed twice stops the run; the
executor checks its own slots (a slot that fails is taken out), so its commit names the slots that judged
the candidate and any taken out since the last commit that named one.
Not here: which candidate is evaluated when, or committed (the drive); the stages (harness).
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol

from harness.config import Config
from harness.evaluate import open_pool
from harness.executors import Executor, open_executor
from harness.pins import local_pins
from harness.pool import Pool
from harness.records import Verdict
from harness.slot import Done, Job
from harness.verdicts import evaluate_cached

from agent.records import CandidateRecord
from agent.roles.evaluator import check_device

Say = Callable[[str], None]


def in_parallel(cfg: Config) -> bool:
    """Whether a run evaluates through an executor: a Dask cluster, or more than one slot on this machine."""
    return cfg.executor.kind == "dask" or len(local_pins(cfg)) > 1


class Evaluator(Protocol):
    @property
    def capacity(self) -> int:
        """Evaluations that can run at once now."""

    def open(self, pool: Pool | None) -> None:
        """Ready to evaluate, inside the run's lock (`pool`: one handed to the run, used where it fits)."""

    def evaluate(self, job: str, source: str, beat: float = 1.0, head: str | None = None,
                 on_stage: Say | None = None, other_heads: dict[str, str] | None = None) -> Verdict:
        """One round's verdict (job: c007, c007.r1, head-decode), waiting for it; `other_heads`: the other ops'
        heads, which both arms of its replay serve."""

    def after(self, record: CandidateRecord, say: Say) -> tuple[dict[str, str], str]:
        """What a judged candidate's commit adds (trailers), and why the run must stop (empty: it goes on)."""

    def close(self) -> None: ...


class PoolEvaluator:
    """The loop's own worker pool: one evaluation at a time, in this process (the module's docstring)."""

    capacity = 1

    def __init__(self, cfg: Config, target: str, device, say: Say) -> None:
        self.cfg, self.target, self.device, self.say = cfg, target, device, say
        self.pool: Pool | None = None
        self._own = False

    def open(self, pool: Pool | None) -> None:
        if pool is None:
            self.say("starting the worker pool")
            pool, self._own = open_pool(self.cfg, self.target, self.device), True
        self.pool = pool

    def evaluate(self, job: str, source: str, beat: float = 1.0, head: str | None = None,
                 on_stage: Say | None = None, other_heads: dict[str, str] | None = None) -> Verdict:
        return evaluate_cached(source, self.target, self.cfg, self.pool, job=job, on_stage=on_stage, beat=beat, head=head,
                               other_heads=other_heads)

    def after(self, record: CandidateRecord, say: Say) -> tuple[dict[str, str], str]:
        return check_device(record, self.pool, self.cfg.executor.health_retry_s, say)

    def close(self) -> None:
        if self._own and self.pool is not None:
            self.pool.close()


class SlotsEvaluator:
    """An executor's slots, several evaluations at once (the module's docstring). The executor is opened on
    first use, inside the run's lock; a pool handed to the run is not used."""

    def __init__(self, cfg: Config, target: str, say: Say) -> None:
        self.cfg, self.target, self.say = cfg, target, say
        self.executor: Executor | None = None
        self.evaluations: list[Done] = []           # every job's Done as it came back (diagnostics, trailers)
        self._lock = threading.Lock()
        self._reported: set[str] = set()            # slots taken out that a commit has already named

    def slots(self) -> Executor:
        if self.executor is None:
            self.say(f"starting the evaluation slots ({self.cfg.executor.kind} executor)")
            self.executor = open_executor(self.cfg, self.target)
        return self.executor

    @property
    def capacity(self) -> int:
        return self.slots().capacity                # Dask: asks the scheduler

    def open(self, pool: Pool | None) -> None:
        """Nothing yet: the slots start when the first evaluation (a head's, maybe) needs them."""

    def evaluate(self, job: str, source: str, beat: float = 1.0, head: str | None = None,
                 on_stage: Say | None = None, other_heads: dict[str, str] | None = None) -> Verdict:
        done = self.slots().submit(Job(id=job, source=source, beat=beat, head=head, other_heads=other_heads or {}),
                                   on_stage=on_stage).result()
        with self._lock:
            self.evaluations.append(done)
        return done.verdict

    def after(self, record: CandidateRecord, say: Say) -> tuple[dict[str, str], str]:
        with self._lock:
            slots = [d.slot for d in self.evaluations if d.id.split(".")[0] == record.id]
            out = {"Evaluated-On": ", ".join(slots)} if slots else {}
            new = {slot: why for slot, why in dict(getattr(self.executor, "removed", {})).items()
                   if slot not in self._reported}
            if new:
                out["Slots-Out"] = "; ".join(" ".join(why.split())[:200] for why in new.values())
                self._reported |= set(new)
        return out, ""

    def close(self) -> None:
        """The executor's slots, closed inside the run's lock (its GPUs are free before another run can start)."""
        if self.executor is not None:
            self.executor.close()


def evaluator_for(cfg: Config, target: str, device, say: Say, slots: bool | None = None) -> Evaluator:
    """The evaluator a run uses: an executor's slots where `slots` (None: where the config asks, `in_parallel`),
    else the loop's own pool."""
    if slots if slots is not None else in_parallel(cfg):
        return SlotsEvaluator(cfg, target, say)
    return PoolEvaluator(cfg, target, device, say)
