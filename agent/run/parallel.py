"""Several candidates in flight at once: the run's drive when evaluations go through an executor
(harness/executors.py: one slot process per GPU here, or a Dask cluster; docs/CLUSTER.md).

Proposals are asked for in id order, each in its own thread: a slow proposer (an LLM) has up to
`agent.proposals_in_flight` (null: 3 per slot) being written or written and waiting for a slot, the
built-in one a single one at a time, so its ids and order are what a serial run's would be; the
planner is told every candidate still in flight. Each ready proposal is
judged in its own thread, every round of it a job on the executor (c007, then c007.r1 for its first
compile repair), so the loop's process evaluates no candidate (nor the heads, where Run.start asks
`head()`); compile repairs ask the LLM from that thread, on this machine. Up to `executor.capacity`
candidates are judged at once, and the next proposals are written meanwhile (`agent.overlap`).
Verdicts are committed through Run.record strictly in candidate-id order (`InOrder`): one that
finished early waits for those before it, so the ledger's order does not depend on which slot was
faster. A job whose evaluator was lost more often than `executor.requeue_limit` allows
(`EvaluationLost`) is recorded as unevaluated at `evaluator`, with the reason.
Budgets, signals and resume are Run's. `max_candidates` counts proposals in flight; when the run must
end, the candidates being judged are finished and committed first. A proposal never started is treated
as the serial loop treats the one it was writing: after a signal (or an evaluator that cannot go on)
it stays in the ledger as a proposal, evaluated first when the run is resumed; after any other end it
is recorded unevaluated, with what it cost.
Not here: running jobs, re-queueing, slot health (the executors); what a round is and how records are
made (agent/roles/evaluator.py); the budgets themselves, heads, resume (agent/run/loop.py).
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from harness.config import Config
from harness.errors import HarnessError
from harness.executors import Executor, InOrder, local_pins, open_executor
from harness.records import Verdict
from harness.slot import Done, Job

from agent.roles.evaluator import evaluate_head, judge, unevaluated
from agent.ledger.repository import id_number
from agent.run.loop import Run, in_thread
from agent.run.serial import next_id, unproposed
from agent.llm.providers import ProviderStop
from agent.records import CandidateRecord, Exchange, Kernel, Proposal


def in_parallel(cfg: Config) -> bool:
    """Whether a run evaluates through an executor: a Dask cluster, or more than one slot on this machine."""
    return cfg.executor.kind == "dask" or len(local_pins(cfg)) > 1


# -----------------------------------------------------------------------------------------------------

@dataclass
class _Judged:
    record: CandidateRecord
    exchanges: list[Exchange]
    stop: str = ""                  # a provider stopped the run during a compile repair
    slots: list[str] = field(default_factory=list)


class ParallelRun(Run):
    """A run whose candidates are judged through an executor, several at once (the module's docstring)."""

    def __init__(self, cfg: Config, settings, view) -> None:
        super().__init__(cfg, settings, view)
        self.executor: Executor | None = None       # opened on first use, inside the run's lock
        self.evaluations: list[Done] = []           # every job's Done as it came back (diagnostics, trailers)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stages: dict[str, str] = {}           # candidate id -> the stage it is at (the live view)
        self._proposing = ""
        self._reported: set[str] = set()            # slots taken out that a commit has already named

    def slots(self) -> Executor:
        if self.executor is None:
            self.view.update(activity=f"starting the evaluation slots ({self.cfg.executor.kind} executor)")
            self.executor = open_executor(self.cfg, self.settings.target)
        return self.executor

    def evaluate(self, job: str, source: str, beat: float = 1.0, head: str | None = None) -> Verdict:
        """One job on the executor, waiting for its verdict (in a judge thread, or for a head)."""
        cid = job.split(".")[0]
        done = self.slots().submit(Job(id=job, source=source, beat=beat, head=head), on_stage=lambda name: self._news(cid, name)).result()
        with self._lock:
            self.evaluations.append(done)
        return done.verdict

    def head(self, op: str, pool) -> Kernel:
        """The head of `op`, evaluated on the executor (the hook Run.start calls, where it has one)."""
        try:
            return evaluate_head(op, self.cfg, self.settings.target, None, self.catalog, evaluate_fn=self.evaluate)
        finally:
            self._news(f"head-{op}", "")

    # -- the live view ------------------------------------------------------------------------------

    def _news(self, cid: str | None, stage: str = "") -> None:
        with self._lock:
            if cid is not None:
                self._stages[cid] = stage
            self._stages = {c: s for c, s in self._stages.items() if s}
            parts = [f"{c}: {s}" for c, s in sorted(self._stages.items())]
            text = ("evaluating " + ", ".join(parts) if parts else "") + (
                f"{'; ' if parts else ''}proposing {self._proposing}" if self._proposing else "")
        self.view.update(activity=text or "waiting")

    # -- the drive ----------------------------------------------------------------------------------

    def _judge(self, proposal: Proposal, parent: Kernel) -> _Judged:
        try:
            record, exchanges, stop = judge(proposal, parent, self.proposer, self.cfg, self.settings.target, None,
                                           evaluate_fn=self.evaluate, head=self.heads.get(proposal.op))
        finally:
            self._news(proposal.id, "")
        with self._lock:
            slots = [d.slot for d in self.evaluations if d.id.split(".")[0] == proposal.id]
        return _Judged(record, exchanges, stop, slots)

    def _trailers(self, judged: _Judged) -> dict[str, str]:
        out = {"Evaluated-On": ", ".join(judged.slots)} if judged.slots else {}
        removed = dict(getattr(self.executor, "removed", {}))
        new = {slot: why for slot, why in removed.items() if slot not in self._reported}
        if new:
            out["Slots-Out"] = "; ".join(" ".join(why.split())[:200] for why in new.values())
            self._reported |= set(new)
        return out

    def _propose(self, held: dict[str, Proposal], writing: dict[str, Future]) -> tuple[str, Future]:
        """Ask for the next proposal in a thread; its id follows every id held and being written."""
        state = self.state(list(held.values()))
        state = replace(state, next_id=next_id(state.next_id, list(writing), self._unproposed))
        self._proposing = ", ".join([*writing, state.next_id])
        self._news(None)
        fut: Future = Future()
        fut.add_done_callback(lambda _: self._wake.set())
        return state.next_id, in_thread("kevo-proposer", self.proposer.propose, state, fut=fut)

    def drive(self) -> tuple[str, bool]:
        if why := self.limit():                     # spent before this session: what is pending stays so
            return why, False
        ex = self.slots()
        overlap = self.cfg.agent.overlap and not self.proposer.instant
        self._unproposed = unproposed(self)
        order, held, futures = InOrder(), OrderedDict(), {}    # every proposal not yet recorded; order: in id order
        waiting: deque[Proposal] = deque()                      # ready, not started
        running: dict[str, Future] = {}
        writing: OrderedDict[str, Future] = OrderedDict()       # id -> the proposal being written under it
        asked: dict[str, int] = {}                              # id -> candidates recorded when it was asked for
        hold, stop, fatal, broken = False, "", False, ""

        def reserve(cid: str) -> None:               # its place in the ledger's order, taken when it is asked for
            futures[cid] = Future()
            futures[cid].add_done_callback(lambda _: self._wake.set())
            order.track(cid, futures[cid])

        def arrive(p: Proposal, new: bool) -> None:
            if p.id not in futures:
                reserve(p.id)
            if stop and self.proposer.instant and not p.exchanges:
                futures[p.id].set_result(None)       # written as the run ended, and it cost nothing
                return
            waits = next(iter(order.pending)) != p.id    # its verdict is committed after those before it
            held[p.id] = p
            if p.outcome != "ready":
                if new and waits and not self.proposer.instant:
                    self.commit_proposal(p)          # it waits in memory: committed, a kill does not lose it
                futures[p.id].set_result(_Judged(unevaluated(p, p.outcome, p.stage, p.reason), p.exchanges))
            elif stop:                               # written while the run was ending: what it cost is kept
                futures[p.id].set_result(_Judged(unevaluated(p, "unevaluated", "budget", f"the run ended: {stop}"),
                                                 p.exchanges))
            else:
                if new and not self.proposer.instant:
                    self.commit_proposal(p)          # from here a stop loses nothing: a resumed run evaluates it
                waiting.append(p)

        for p in self.ledger.pending():              # committed before a stop, never evaluated: first
            arrive(p, new=False)
        while True:
            self._wake.clear()
            while not broken and order.ready():      # verdicts, strictly in candidate order
                cid = next(iter(order.pending))
                try:
                    judged = order.next()
                except HarnessError as e:            # the evaluator itself cannot go on (no slot left)
                    broken, stop, fatal = cid, f"{e}; resume the run once the evaluator can run", True
                    break
                if judged is None:                   # asked for, and no proposal came
                    continue
                del held[cid]
                self.record(judged.record, judged.exchanges, self._trailers(judged))
                hold = False
                if judged.stop and not fatal:
                    stop, fatal = judged.stop, True
            running = {c: f for c, f in running.items() if not f.done()}
            if not stop and (why := self.limit()):
                stop = why
            if writing and self.stop.why:            # a signal: the proposals being written are abandoned
                for cid in writing:
                    futures[cid].set_result(None)
                writing.clear()
            for cid, fut in [(c, f) for c, f in writing.items() if f.done()]:     # in id order
                try:
                    proposal = fut.result()
                except ProviderStop as e:
                    proposal = None
                    if not stop:
                        stop, fatal = self.provider_stopped(e)
                del writing[cid]
                if isinstance(proposal, Proposal):
                    arrive(proposal, new=True)
                    continue
                futures[cid].set_result(None)        # no proposal under this id: its place is given up
                if not stop:                         # the proposer has nothing left, as things stand
                    if held or writing:
                        hold = True                  # ask again once the next verdict is in
                    elif len(self.history) == asked[cid]:
                        stop = "search exhausted: the proposer has nothing left worth trying"
                    else:
                        hold = False                 # verdicts came in since it was asked: ask again
            self._proposing = ", ".join(writing)
            cap = ex.capacity if not stop and (waiting or not writing or overlap) else 0     # Dask: asks the scheduler
            while not stop and waiting and len(running) < max(cap, 1):
                p = waiting.popleft()
                self._news(p.id, "queued")
                self.view.update(claim=f"{p.id} [{p.op}] {p.claim.hypothesis}" if p.claim else "")
                running[p.id] = in_thread(f"kevo-judge-{p.id}", self._judge, p, self.parents[p.op], fut=futures[p.id])
            # in flight: being written, or written and waiting for a slot; with overlap up to agent.in_flight,
            # else one at a time, and only for a free slot
            most = self.cfg.agent.in_flight(cap) if overlap else 1
            while (not stop and not hold and len(writing) < most
                   and (len(waiting) + len(writing) < most if overlap else len(running) + len(waiting) < cap)
                   and not self.limit(in_flight=len(held) + len(writing))):
                cid, fut = self._propose(held, writing)
                writing[cid], asked[cid] = fut, len(self.history)
                reserve(cid)
            if stop and not running and not writing:
                break
            self._wake.wait(0.2)
        self._proposing = ""
        self._leave(held, futures, stop, keep=bool(self.stop.why or broken), broken=broken)
        return stop, fatal

    def _leave(self, held: dict[str, Proposal], futures: dict[str, Future], stop: str, keep: bool,
               broken: str) -> None:
        """What is not recorded when the run ends, in order. Answered (a verdict, a malformed proposal): recorded,
        unless something before it stays unrecorded. Never started: `keep` (a signal, or an evaluator that cannot
        go on) leaves it in the ledger as a proposal for a resumed run; otherwise it is recorded unevaluated.
        An instant proposer's is dropped (nothing spent, nothing committed)."""
        cut = False
        for cid, p in sorted(held.items(), key=lambda item: id_number(item[0])):
            f = futures[cid]
            judged = f.result() if f.done() and not f.cancelled() and f.exception() is None else None
            if judged is not None and not cut and cid != broken:
                self.record(judged.record, judged.exchanges, self._trailers(judged))
            elif self.proposer.instant:
                continue
            elif keep:
                cut = True
                if p.outcome != "ready":             # ready ones were committed as proposals when they came
                    self.commit_proposal(p)
            else:
                self.record(unevaluated(p, "unevaluated", "budget", f"the run ended: {stop}"), p.exchanges)

    def open_evaluator(self):
        """No pool of the loop's own: heads and candidates are evaluated in the executor's slots (opened
        lazily by `slots()`, inside the run's lock); Run.start is handed None for a pool."""
        return None

    def close_evaluator(self) -> None:
        """The executor's slots, closed inside the run's lock (its GPUs are free before another run can start)."""
        if self.executor is not None:
            self.executor.close()
