"""The GPU lease: which of the slots sharing one GPU may run a stage on it now.

A reader-writer lease per GPU (`Lease`), held in the executor's own process (harness/executors.py), which
is trusted: the slot processes ask it over their pipe before each stage, and the candidates' sandboxed
workers have no handle to it. A timed stage (`TIMED_STAGES`: microbench, the replay) holds its GPU alone;
every other stage, and a slot's health check, holds it shared, so the compile, dispatch and parity of
several candidates overlap on one GPU while no timed stage runs there. Writer preference: once a slot
waits to hold the GPU alone, no new shared holder starts (a slot moving on to its next shared stage is a
new holder), so a timed stage waits only for the shared holders to finish the stage they are in; slots
waiting to hold it alone are served in the order they asked.
Deadlock-free by construction: a holder asks for its next stage only after letting go of the last
(`Holding.hold`), so nobody waits while holding, and a shared holder's stage waits for nothing here.
Not here: which stages are timed (harness/stages), what a slot does with its grant, killing a slot
that holds a lease too long (the executor; `Holding.release` is what it calls).
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

from harness.stages import TIMED_STAGES

Mode = Literal["shared", "alone"]


def mode_of(stage: str) -> Mode:
    """How a stage holds its GPU: alone for a timed stage, shared for any other."""
    return "alone" if stage in TIMED_STAGES else "shared"


@dataclass(frozen=True)
class LeaseState:
    """Who holds a lease and who waits for it, at one moment (for tests and diagnostics)."""
    alone: str | None
    shared: frozenset[str]
    waiting_alone: tuple[str, ...]          # in the order they will be served
    waiting_shared: frozenset[str]


class Lease:
    """One GPU's lease: any number of shared holders, or one holder alone."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._cond = threading.Condition()
        self._shared: set[str] = set()
        self._alone: str | None = None
        self._waiting: deque[str] = deque()       # holders waiting to hold it alone, first asked first
        self._queued: set[str] = set()            # holders waiting to share it
        self._closed = False

    def acquire(self, holder: str, mode: Mode) -> bool:
        """Wait until `holder` holds the lease in `mode`; False when the lease was closed meanwhile.
        A holder asks again only after releasing what it held (`Holding` does both)."""
        with self._cond:
            if holder in self._shared or self._alone == holder:
                raise RuntimeError(f"{holder} asked for the {self.key} lease while holding it")
            if mode == "shared":
                self._queued.add(holder)
                while not self._closed and (self._alone is not None or self._waiting):
                    self._cond.wait()
                self._queued.discard(holder)
                if self._closed:
                    return False
                self._shared.add(holder)
                return True
            self._waiting.append(holder)
            try:
                while not self._closed and (self._alone is not None or self._shared or self._waiting[0] != holder):
                    self._cond.wait()
            finally:
                self._waiting.remove(holder)
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
            self._cond.notify_all()

    def close(self) -> None:
        """Every waiter gives up (its acquire returns False); used when the executor closes."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def state(self) -> LeaseState:
        with self._cond:
            return LeaseState(self._alone, frozenset(self._shared), tuple(self._waiting), frozenset(self._queued))


class Holding:
    """One slot's hold on its GPU's lease: a stage at a time, each asked for after the last is let go."""

    def __init__(self, lease: Lease, holder: str) -> None:
        self.lease, self.holder = lease, holder
        self.mode: Mode | None = None

    def hold(self, mode: Mode) -> bool:
        """Let go of what this slot held, then wait to hold the lease in `mode`; False: the lease was closed."""
        self.release()
        if not self.lease.acquire(self.holder, mode):
            return False
        self.mode = mode
        return True

    def release(self) -> None:
        self.lease.release(self.holder)
        self.mode = None
