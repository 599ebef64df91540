"""The drive of a run: propose, judge and commit until the run must end, with as many candidates in
flight as its evaluator allows (agent/run/evaluators.py): one in the loop's own worker pool, one per slot
through an executor (one slot process per GPU here, or a Dask cluster; docs/CLUSTER.md). One candidate at a
time is this drive at capacity 1, not a drive of its own.

Proposals are asked for in id order, each in its own thread. A slow proposer (an LLM) has up to
`agent.proposals_in_flight` (null: 3 per slot) being written, or written and waiting for the evaluator,
so the device is not left idle while the next claims are written (`agent.overlap`); the built-in one, which
answers at once, one at a time and only for a free slot, so it has seen every verdict before it proposes.
The planner is told every candidate still in flight. An LLM's proposal is committed as soon as it is
written, before its verdict (a kill meanwhile loses no answered proposal), unless its verdict is committed
at once (malformed, not worth coding); the built-in proposer's never are (it paid nothing).
Candidates start in the ledger's order, up to the evaluator's `capacity` at once, each judged in a thread
of its own (its compile repairs too: they ask the LLM from that thread), and their verdicts are committed
through Run.record strictly in that order (`InOrder`): one that finished early waits for those before it,
so the ledger does not depend on which slot was faster. A candidate accepted against a head that one recorded
before it replaced meanwhile is judged again against the new head before its verdict is handed in (judge_one).
What the evaluator adds to a verdict's commit
(the device's health check after a lost worker, the slots that judged it) comes with it; a device that
failed its check, or a provider that stopped during a repair, ends the run (fatal). A job whose evaluator
was lost more often than `executor.requeue_limit` allows is recorded unevaluated at `evaluator`; an
evaluator that cannot go on at all (no slot left) ends the run, fatal.
Budgets and signals are Run's; `max_candidates` counts the proposals in flight. When the run must end,
the candidates being judged are finished and committed first, and the proposals being written are waited
for (what they cost is kept) — after a signal those not yet written are abandoned (their threads are
daemons). A proposal never started: after a signal (or an evaluator that cannot go on) it stays in the
ledger as a proposal, evaluated first when the run is resumed; after any other end it is recorded
unevaluated, with what it cost. On resume the proposals committed and never judged are judged first,
and ids paid for and never proposed are proposed again, under their own ids, before any new one.
Not here: budgets, heads, resume and every ledger write (agent/run/loop.py); where evaluations run
(agent/run/evaluators.py); what a round is and how records are made (agent/roles/evaluator.py).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from itertools import takewhile
from typing import TYPE_CHECKING

from harness.errors import HarnessError
from harness.executors import InOrder

from agent.ledger.repository import id_number
from agent.llm.providers import ProviderStop
from agent.records import CandidateRecord, Exchange, Kernel, Proposal
from agent.roles.evaluator import judge, judge_again, others_of, unevaluated
from agent.run.state import kernel_of, stale_acceptance

if TYPE_CHECKING:
    from agent.run.loop import Run


def drive(run: Run) -> tuple[str, bool]:
    """Propose and judge until the run must end: (why it ended, whether that is fatal)."""
    return _Drive(run)()


def in_thread(name: str, fn, *args, fut: Future | None = None) -> Future:
    """`fn(*args)` in a daemon thread, its outcome (or exception) into `fut` (a new one if none is given):
    a proposal still being written or a candidate still being judged never keeps a stopping run alive."""
    fut = fut if fut is not None else Future()

    def work() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:                  # handed to the waiting thread as it is
                fut.set_exception(e)
    threading.Thread(target=work, name=name, daemon=True).start()
    return fut


def unproposed(run: Run) -> list[str]:
    """Ids an earlier session paid LLM calls for and stopped before committing a proposal under, oldest first,
    but the last (Run's resume gives the next proposal that one): several were being written at once when it
    stopped. Each is proposed again under its own id, before any new one, the calls it paid for not bought
    again (the meter's prepaid exchanges), so ids stay contiguous."""
    if run.proposer.instant:
        return []
    return sorted((cid for cid, (_, proposal) in run.ledger.unjudged_exchanges().items()
                   if proposal is None and id_number(cid) <= run.last_id), key=id_number)


def next_id(after: str, in_flight: list[str], unproposed: list[str]) -> str:
    """The id of the next proposal asked for: the oldest unproposed one (taken from the list), else the one
    after `after` (Run.state's next id: past the ledger and the proposals it was told of) and every id in flight."""
    if unproposed:
        return unproposed.pop(0)
    n = max([id_number(after)] + [id_number(cid) + 1 for cid in in_flight])
    return f"c{n:03d}"


@dataclass
class Judged:
    record: CandidateRecord
    exchanges: list[Exchange]
    stop: str = ""                  # the run must stop: a provider stopped during a repair, or the device is unwell
    trailers: dict[str, str] = field(default_factory=dict)     # what the evaluator adds to the commit


class _Drive:
    """One drive's state, from its first proposal to what it leaves when the run ends (the module's docstring)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.overlap = run.cfg.agent.overlap and not run.proposer.instant
        self.unproposed = unproposed(run)
        self.order = InOrder()                          # every id asked for or pending, in the ledger's order
        self.futures: dict[str, Future] = {}            # id -> its Judged (None: no proposal came under it)
        self.held: dict[str, Proposal] = {}             # every proposal not yet recorded
        self.waiting: dict[str, Proposal] = {}          # ready, not started
        self.running: dict[str, Future] = {}            # being judged
        self.writing: OrderedDict[str, Future] = OrderedDict()     # id -> the proposal being written under it
        self.asked: dict[str, int] = {}                 # id -> candidates recorded when it was asked for
        self.hold = False                               # the proposer had nothing: ask again after the next verdict
        self.stop, self.fatal, self.broken = "", False, ""
        self.wake, self.lock = threading.Event(), threading.Lock()
        self.settled: set[str] = set()                  # ids recorded, or given up, in the ledger's order
        self.settled_cv = threading.Condition()
        self.stages: dict[str, str] = {}                # candidate id -> the stage it is at (the live view)
        self.proposing = ""

    def __call__(self) -> tuple[str, bool]:
        run = self.run
        if why := run.limit():                          # spent before this session: what is pending stays so
            return why, False
        for p in run.ledger.pending():                  # committed before a stop, never evaluated: first
            self.arrive(p, new=False)
        while True:
            self.wake.clear()
            # before the verdicts: a judge done by now is committed (and can stop the run) before another starts
            self.running = {c: f for c, f in self.running.items() if not f.done()}
            self.commit_verdicts()
            if not self.stop and (why := run.limit()):
                self.stop = why
            self.take_proposals()
            self.commit_verdicts()          # a proposal that is its own verdict (malformed, not worth coding):
                                            # committed before the next is asked for, which then knows it
            cap = run.evaluator.capacity if not self.stop and (self.waiting or not self.writing or self.overlap) else 0
            self.start(cap)
            self.ask(cap)
            if self.stop and not self.running and not self.writing:
                break
            self.wake.wait(0.2)
        self.proposing = ""
        self.leave()
        return self.stop, self.fatal

    def keeps(self) -> bool:
        """Whether what was never started stays in the ledger as a proposal (a signal, or an evaluator that
        cannot go on: a resumed run evaluates it), rather than being recorded unevaluated."""
        return bool(self.run.stop.why or self.broken)

    # -- proposals --------------------------------------------------------------------------------

    def reserve(self, cid: str) -> None:
        """Its place in the ledger's order, taken when it is asked for (or found pending)."""
        self.futures[cid] = Future()
        self.futures[cid].add_done_callback(lambda _: self.wake.set())
        self.order.track(cid, self.futures[cid])

    def ask(self, cap: int) -> None:
        """Ask for proposals: in flight (being written, or written and waiting for a slot) with overlap up to
        agent.in_flight, else one at a time and only for a free slot; within the budgets."""
        run = self.run
        most = run.cfg.agent.in_flight(cap) if self.overlap else 1
        while (not self.stop and not self.hold and len(self.writing) < most
               and (len(self.waiting) + len(self.writing) < most if self.overlap
                    else len(self.running) + len(self.waiting) < cap)
               and not run.limit(in_flight=len(self.held) + len(self.writing))):
            state = run.state(list(self.held.values()))
            state = replace(state, next_id=next_id(state.next_id, list(self.writing), self.unproposed))
            self.proposing = ", ".join([*self.writing, state.next_id])
            self.news(None)
            fut: Future = Future()
            fut.add_done_callback(lambda _: self.wake.set())
            self.writing[state.next_id] = in_thread("kevo-proposer", run.proposer.propose, state, fut=fut)
            self.asked[state.next_id] = len(run.history)
            self.reserve(state.next_id)

    def take_proposals(self) -> None:
        """The proposals written by now, in id order; after a signal, those still being written are abandoned."""
        run = self.run
        for cid, fut in [(c, f) for c, f in self.writing.items() if f.done()]:
            try:
                proposal = fut.result()
            except ProviderStop as e:
                proposal = None
                if not self.stop:
                    self.stop, self.fatal = run.provider_stopped(e)
            del self.writing[cid]
            if isinstance(proposal, Proposal):
                self.arrive(proposal, new=True)
                continue
            self.futures[cid].set_result(None)          # no proposal under this id: its place is given up
            if not self.stop:                           # the proposer has nothing left, as things stand
                if self.held or self.writing:
                    self.hold = True                    # ask again once the next verdict is in
                elif len(run.history) == self.asked[cid]:
                    self.stop = "search exhausted: the proposer has nothing left worth trying"
                else:
                    self.hold = False                   # verdicts came in since it was asked: ask again
        if self.writing and run.stop.why:
            for cid in self.writing:
                self.futures[cid].set_result(None)
            self.writing.clear()
        self.proposing = ", ".join(self.writing)

    def arrive(self, p: Proposal, new: bool) -> None:
        """A proposal written (`new`) or found pending in the ledger: committed, and judged or recorded."""
        run = self.run
        if p.id not in self.futures:
            self.reserve(p.id)
        if self.stop and run.proposer.instant and not p.exchanges:
            self.futures[p.id].set_result(None)         # written as the run ended, and it cost nothing
            return
        waits = next(iter(self.order.pending)) != p.id  # its verdict is committed after those before it
        self.held[p.id] = p
        if p.outcome != "ready":
            if new and waits and not run.proposer.instant:
                run.commit_proposal(p)                  # it waits in memory: committed, a kill does not lose it
            self.futures[p.id].set_result(Judged(unevaluated(p, p.outcome, p.stage, p.reason), p.exchanges))
        elif self.stop and not self.keeps():            # written while the run was ending: what it cost is kept
            self.futures[p.id].set_result(Judged(unevaluated(p, "unevaluated", "budget", f"the run ended: {self.stop}"),
                                                 p.exchanges))
        else:
            if new and not run.proposer.instant:
                run.commit_proposal(p)                  # from here a stop loses nothing: a resumed run evaluates it
            self.waiting[p.id] = p

    # -- judging ----------------------------------------------------------------------------------

    def start(self, cap: int) -> None:
        """Start judging, in the ledger's order, while the evaluator has room (Dask: at least one, to learn
        whether it has any); the next in that order still being written holds back those after it."""
        run = self.run
        while not self.stop and self.waiting and len(self.running) < max(cap, 1):
            cid = next((c for c, f in self.order.pending.items() if not f.done() and c not in self.running), None)
            p = self.waiting.pop(cid, None)
            if p is None:
                break
            self.news(p.id, "queued")
            run.view.update(claim=f"{p.id} [{p.op}] {p.claim.hypothesis}" if p.claim else "")
            bar = run.parents[p.op]                     # the kernel to beat; the one it was written from may be slower
            parent = kernel_of(p.parent, run.heads, run.history) or bar
            before = list(takewhile(lambda c: c != cid, self.order.pending))
            self.running[p.id] = in_thread(f"kevo-judge-{p.id}", self.judge_one, p, parent, bar, run.heads.get(p.op),
                                           before, fut=self.futures[p.id])

    def judge_one(self, p: Proposal, parent: Kernel, bar: Kernel, head: Kernel | None, before: list[str]) -> Judged:
        """One candidate, in its judge thread: its rounds on the evaluator against the op's head when it started,
        then what the evaluator adds. Accepted, it waits for the verdicts of the candidates `before` it to be
        recorded; if one of them became the head meanwhile, it is judged again against that one
        (state.stale_acceptance): no kernel becomes the head unmeasured against the kernel it replaces."""
        run, ev = self.run, self.run.evaluator
        others = others_of({op: k.source for op, k in run.heads.items()}, p.op)

        def evaluate_fn(job: str, src: str, beat: float, against: str | None):
            return ev.evaluate(job, src, beat, against, other_heads=others, on_stage=lambda name: self.news(p.id, name))
        try:
            record, exchanges, stop = judge(p, parent, run.proposer, run.cfg, run.settings.target, None, head=head,
                                            bar=bar, evaluate_fn=evaluate_fn)
            if record.outcome == "accepted" and not stop and (why := stale_acceptance(record,
                                                                                      self.head_after(p.op, before))):
                self.news(p.id, "judged again")
                record = judge_again(record, exchanges, p, parent, run.heads[p.op], run.parents[p.op], why, evaluate_fn)
            trailers, sick = ev.after(record, say=lambda text: run.view.update(activity=text))
        finally:
            self.news(p.id, "")
        return Judged(record, exchanges, stop or sick, trailers)

    def head_after(self, op: str, before: list[str]) -> Kernel | None:
        """The head of `op` once every id in `before` is recorded or given up (None if the evaluator broke first:
        the run is ending and they never will be)."""
        with self.settled_cv:
            self.settled_cv.wait_for(lambda: self.broken or self.settled.issuperset(before))
            return None if self.broken else self.run.heads.get(op)

    def commit_verdicts(self) -> None:
        """The verdicts in, strictly in the ledger's order."""
        while not self.broken and self.order.ready():
            cid = next(iter(self.order.pending))
            try:
                judged = self.order.next()
            except HarnessError as e:                   # the evaluator itself cannot go on (no slot left)
                with self.settled_cv:
                    self.broken, self.stop, self.fatal = cid, f"{e}; resume the run once the evaluator can run", True
                    self.settled_cv.notify_all()
                return
            if judged is not None:                      # None: asked for, and no proposal came
                del self.held[cid]
                no_head = self.run.record(judged.record, judged.exchanges, judged.trailers)
                self.hold = False
                if (judged.stop or no_head) and not self.fatal:
                    self.stop, self.fatal = judged.stop or no_head, True
            with self.settled_cv:                       # a judge waiting for it (judge_one) sees the head it left
                self.settled.add(cid)
                self.settled_cv.notify_all()

    def leave(self) -> None:
        """What is not recorded when the run ends, in order. Answered (a verdict, a malformed proposal): recorded,
        unless something before it stays unrecorded. Never started: kept as a proposal for a resumed run
        (`keeps`), or recorded unevaluated. An instant proposer's is dropped (nothing spent, nothing committed)."""
        run, keep, cut = self.run, self.keeps(), False
        for cid, p in sorted(self.held.items(), key=lambda item: id_number(item[0])):
            f = self.futures[cid]
            judged = f.result() if f.done() and not f.cancelled() and f.exception() is None else None
            if judged is not None and not cut and cid != self.broken:
                run.record(judged.record, judged.exchanges, judged.trailers)
            elif run.proposer.instant:
                continue
            elif keep:
                cut = True
                if p.outcome != "ready":                # ready ones were committed as proposals when they came
                    run.commit_proposal(p)
            else:
                run.record(unevaluated(p, "unevaluated", "budget", f"the run ended: {self.stop}"), p.exchanges)

    # -- the live view ----------------------------------------------------------------------------

    def news(self, cid: str | None, stage: str = "") -> None:
        """The live view's activity line: each candidate being judged and its stage, and those being written."""
        with self.lock:
            if cid is not None:
                self.stages[cid] = stage
            self.stages = {c: s for c, s in self.stages.items() if s}
            parts = [f"{c}: {s}" for c, s in sorted(self.stages.items())]
            text = ("evaluating " + ", ".join(parts) if parts else "") + (
                f"{'; ' if parts else ''}proposing {self.proposing}" if self.proposing else "")
        self.run.view.update(activity=text or "waiting")
