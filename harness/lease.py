"""The GPU lease: which of the slots sharing one GPU may run a stage on it now.

A reader-writer lease per GPU (`Lease`), held in the executor's own process (harness/local_executor.py), which
is trusted: the slot processes ask it over their pipe before each stage, and the candidates' sandboxed
workers have no handle to it. A timed stage (`TIMED_STAGES`: microbench, the replay) holds its GPU alone
(microbench from where its timing begins: its untimed first part, `preparing("microbench")`, is shared);
every other stage, and a slot's health check, holds it shared, so the compile, dispatch and parity of
several candidates overlap on one GPU while no timed stage runs there. Writer preference: once a slot
waits to hold the GPU alone, no new shared holder starts (a slot moving on to its next shared stage is a
new holder), so a timed stage waits only for the shared holders to finish the stage they are in; slots
waiting to hold it alone are served in the order they asked.
The replay (`WHOLE_GPU_STAGES`) holds its GPU `whole`: alone, and with no other slot of the GPU in a job
(`begin_job` .. `end_job`), because its three servers need most of the GPU's memory, which another slot's
candidate worker and working reserve would hold between two of its stages. Once a whole holder is first in
line, the GPU drains: a slot in a job that asks for its next stage is told to park (`Parked`: the executor
has it close its candidate's worker, hand its memory back and re-queue the job, which starts again after),
and no slot begins a job until the whole holder lets go. A slot out of a job holds no working memory on a
shared GPU (harness/slot.py), so an idle one is no obstacle; a health check is no job, and waits.
Deadlock-free by construction: a holder asks for its next stage only after letting go of the last
(`Holding.hold`), so nobody waits while holding, a shared holder's stage waits for nothing here, and a slot
in a job that would wait while the GPU drains is parked instead.
Not here: which stages are timed (harness/stages), what a slot does with its grant or a park, killing a slot
that holds a lease too long (the executor; `Holding.release` is what it calls).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

from harness.stages import TIMED_STAGES, WHOLE_GPU_STAGES

Mode = Literal["shared", "alone", "whole"]


def mode_of(stage: str) -> Mode:
    """How a stage holds its GPU: whole for the replay, alone for any other timed stage, shared for the rest."""
    return "whole" if stage in WHOLE_GPU_STAGES else "alone" if stage in TIMED_STAGES else "shared"


class Parked(Exception):
    """A slot in a job asked for a stage while its GPU drains for another slot's whole hold: it must end the
    job (its candidate's worker closed, its working memory handed back) and begin it again later."""


@dataclass(frozen=True)
class LeaseState:
    """Who holds a lease and who waits for it, at one moment (for tests and diagnostics)."""
    alone: str | None
    shared: frozenset[str]
    waiting_alone: tuple[str, ...]          # in the order they will be served (whole holders among them)
    waiting_shared: frozenset[str]
    jobs: frozenset[str] = frozenset()      # slots in a job (`begin_job` .. `end_job`)
    draining: str | None = None             # the whole holder the GPU drains for, or holds whole


class Lease:
    """One GPU's lease: any number of shared holders, or one holder alone (or whole)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._cond = threading.Condition()
        self._shared: set[str] = set()
        self._alone: str | None = None
        self._waiting: deque[str] = deque()       # holders waiting to hold it alone or whole, first asked first
        self._queued: set[str] = set()            # holders waiting to share it
        self._jobs: set[str] = set()              # holders in a job
        self._draining: str | None = None         # the whole holder first in line, or holding it
        self._closed = False

    def _park(self, holder: str) -> bool:
        """True when `holder` must park: it is in a job and the GPU drains for another's whole hold."""
        return self._draining not in (None, holder) and holder in self._jobs

    def begin_job(self, holder: str) -> bool:
        """`holder` begins a job, once no other holder's whole hold drains or holds the GPU; False when the
        lease was closed meanwhile."""
        with self._cond:
            while not self._closed and self._draining not in (None, holder):
                self._cond.wait()
            if self._closed:
                return False
            self._jobs.add(holder)
            return True

    def end_job(self, holder: str) -> None:
        """`holder`'s job ended (a verdict, a park, a lost slot): a drain waits for it no longer."""
        with self._cond:
            self._jobs.discard(holder)
            self._cond.notify_all()

    def acquire(self, holder: str, mode: Mode) -> bool:
        """Wait until `holder` holds the lease in `mode`; False when the lease was closed meanwhile; `Parked`
        when `holder` is in a job and the GPU drains meanwhile for another's whole hold. A holder asks again
        only after releasing what it held (`Holding` does both)."""
        with self._cond:
            if holder in self._shared or self._alone == holder:
                raise RuntimeError(f"{holder} asked for the {self.key} lease while holding it")
            if mode == "shared":
                self._queued.add(holder)
                try:
                    while not self._closed and (self._alone is not None or self._waiting):
                        if self._park(holder):
                            raise Parked(holder)
                        self._cond.wait()
                finally:
                    self._queued.discard(holder)
                if self._closed:
                    return False
                self._shared.add(holder)
                return True
            self._waiting.append(holder)
            try:
                while not self._closed:
                    if self._park(holder):
                        raise Parked(holder)
                    if mode == "whole" and self._waiting[0] == holder and self._draining is None:
                        self._draining = holder           # first in line: the GPU drains for it from now
                        self._cond.notify_all()           # slots in a job waiting here are parked
                    if (self._alone is None and not self._shared and self._waiting[0] == holder
                            and (mode != "whole" or not self._jobs - {holder})):
                        break
                    self._cond.wait()
            finally:
                self._waiting.remove(holder)
                if self._closed and self._draining == holder:
                    self._draining = None
                self._cond.notify_all()
            if self._closed:
                return False
            self._alone = holder
            return True

    def release(self, holder: str) -> None:
        """Let go of whatever `holder` holds (nothing: nothing happens)."""
        with self._cond:
            self._shared.discard(holder)
            if self._alone == holder:
                self._alone = None
            if self._draining == holder:
                self._draining = None
            self._cond.notify_all()

    def close(self) -> None:
        """Every waiter gives up (its acquire returns False); used when the executor closes."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def state(self) -> LeaseState:
        with self._cond:
            return LeaseState(self._alone, frozenset(self._shared), tuple(self._waiting), frozenset(self._queued),
                              frozenset(self._jobs), self._draining)


class Holding:
    """One slot's hold on its GPU's lease: a stage at a time, each asked for after the last is let go; and
    whether the slot is in a job."""

    def __init__(self, lease: Lease, holder: str) -> None:
        self.lease, self.holder = lease, holder
        self.mode: Mode | None = None

    def hold(self, mode: Mode) -> bool:
        """Let go of what this slot held, then wait to hold the lease in `mode`; False: the lease was closed;
        `Parked`: the slot is in a job and must end it (the GPU drains for another slot's whole hold)."""
        self.release()
        if not self.lease.acquire(self.holder, mode):
            return False
        self.mode = mode
        return True

    def begin_job(self) -> bool:
        return self.lease.begin_job(self.holder)

    def end_job(self) -> None:
        self.release()
        self.lease.end_job(self.holder)

    def release(self) -> None:
        self.lease.release(self.holder)
        self.mode = None
