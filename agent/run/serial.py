"""One candidate at a time: the drive of a run on one evaluator (the loop's own worker pool).

A slow proposer (an LLM) writes the next candidates in threads while the current one is evaluated, so
the GPU is not left idle: up to `agent.proposals_in_flight` (null: 3) proposals being written or written
and waiting, each in its own thread, asked for in id order and judged in that order. Each proposal is
committed as soon as it is written, from its thread (Run's commit_proposal, under the ledger's lock). So a kill during a long evaluation loses no answered proposal,
including one that is malformed or not worth coding and would otherwise wait in memory for the current
verdict. The built-in proposer answers at once and waits for each verdict. A candidate whose worker
crashed, hung or hit a CUDA error is followed by a health check of the device (a known computation in a fresh worker)
before the next one. A proposal still being written when a signal arrives is abandoned (its thread is a
daemon); one written by the time the run ends is kept: evaluated on resume after a signal, else recorded.
Not here: the run's state, budgets and ledger writes (loop); several candidates at once (parallel).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import replace

from harness.stages import STAGE_NAMES

from agent.roles.evaluator import check_device, judge, unevaluated
from agent.ledger.repository import id_number
from agent.run.loop import Run, in_thread
from agent.llm.providers import ProviderStop
from agent.records import Proposal
from agent.run.state import ProposalState

_ABANDONED = object()           # what waiting for a proposal gives when the run must stop first


class SerialRun(Run):
    """A run that judges one candidate at a time in its own pool (the module's docstring)."""

    def _write_proposal(self, state: ProposalState, overlapped: bool):
        """The proposer's thread: write the next proposal and commit it at once if it is to be evaluated,
        or if it will wait in memory for the current candidate's verdict (written meanwhile)."""
        proposal = self.proposer.propose(state)
        if isinstance(proposal, Proposal) and not self.proposer.instant and not self.stop.why \
                and (proposal.outcome == "ready" or overlapped):
            self.commit_proposal(proposal, from_proposer=True)
        return proposal

    def _submit(self, pending: list, writing: list[tuple[Future, bool, str]]) -> tuple[Future, bool, str]:
        """Ask for the next proposal in a thread: (its future, whether it was asked while others were in flight
        or being judged, its id: `next_id`)."""
        state = self.state(pending)
        state = replace(state, next_id=next_id(state.next_id, [cid for _, _, cid in writing], self._unproposed))
        if not pending and not writing:
            self.view.update(activity=f"proposing {state.next_id}")
        overlapped = bool(pending or writing)
        return in_thread("kevo-proposer", self._write_proposal, state, overlapped), overlapped, state.next_id

    def _fill(self, writing: deque, most: int, judging: Proposal | None = None) -> None:
        """Ask for proposals until `most` are in flight (being written, or written and not yet taken), within
        the run's budgets (max_candidates counts those in flight and the one being judged). The planner is
        told of the one being judged and those written."""
        while len(writing) < most and not self.limit(in_flight=len(writing) + (judging is not None)):
            writing.append(self._submit(([judging] if judging else []) + _written(writing), list(writing)))

    def _await(self, fut: Future):
        """The proposal once written, or _ABANDONED as soon as a signal says the run must stop. (A budget
        that ends meanwhile does not abandon it: what it cost is recorded; a wait for a provider ends then.)"""
        while True:
            try:
                return fut.result(timeout=0.2)
            except FutureTimeout:
                if self.stop.why:
                    return _ABANDONED

    def drive(self) -> tuple[str, bool]:
        overlap = self.cfg.agent.overlap and not self.proposer.instant
        most = self.cfg.agent.in_flight(1) if overlap else 1
        self._unproposed = unproposed(self)
        backlog = self.ledger.pending()         # committed before a stop, never evaluated: first
        writing: deque[tuple[Future, bool, str]] = deque()     # in id order: (future, stale, id)
        stop, fatal = "", False
        while True:
            if (stop := self.stop.why) or (not writing and (stop := self.limit())):
                break
            if backlog:
                proposal, new = backlog.pop(0), False
            else:
                if not writing:                 # none in flight: a slow proposer writes `most` at once
                    self._fill(writing, most)
                    if not writing:             # a budget ran out just now: said at the top
                        continue
                fut, stale, _ = writing.popleft()
                try:
                    proposal = self._await(fut)
                except ProviderStop as e:
                    stop, fatal = self.provider_stopped(e)
                    break
                if proposal is _ABANDONED:
                    stop = self.stop.why
                    break                       # the proposals being written are abandoned (the threads are daemons)
                new = True
                if proposal is None:
                    if stale or writing:        # built before the last verdict, or others are coming: go on with them
                        continue
                    stop = "search exhausted: the proposer has nothing left worth trying"
                    break
            ready = proposal.outcome == "ready"
            if new and ready and not self.proposer.instant:
                self.commit_proposal(proposal)  # from here a stop loses nothing: a resumed run evaluates it
            if overlap and ready:
                self._fill(writing, most, judging=proposal)
            if not ready:
                self.record(unevaluated(proposal, proposal.outcome, proposal.stage, proposal.reason), proposal.exchanges)
            elif why := self.budget():          # a signal since it was proposed: it is evaluated all the same
                stop = why
                self.record(unevaluated(proposal, "unevaluated", "budget", why), proposal.exchanges)
                break
            else:
                meanwhile = (f"; proposing {len(writing)} meanwhile" if len(writing) > 1
                             else "; proposing the next meanwhile" if writing else "")
                self.view.update(activity=f"evaluating {proposal.id} ({', '.join(STAGE_NAMES)}){meanwhile}",
                                 claim=f"{proposal.id} [{proposal.op}] {proposal.claim.hypothesis}")
                stage_news = (lambda name, p=proposal, m=meanwhile:
                              self.view.update(activity=f"evaluating {p.id}: {name}{m}"))
                record, exchanges, stop_msg = judge(proposal, self.parents[proposal.op], self.proposer, self.cfg,
                                                    self.settings.target, self._pool, on_stage=stage_news,
                                                    head=self.heads.get(proposal.op))
                trailers, sick = check_device(record, self._pool, self.cfg.executor.health_retry_s, lambda text: self.view.update(activity=text))
                self.record(record, exchanges, trailers)
                if stop_msg or sick:
                    stop, fatal = stop_msg or sick, True
                    break
        for fut, _, _ in writing:               # proposals written while the run was ending: keep what they cost
            if self.stop.why and not fut.done():
                continue                        # a signal: one still being written is abandoned
            try:
                late = self._await(fut)
            except ProviderStop:
                late = None
            if isinstance(late, Proposal) and late.exchanges:
                if late.outcome != "ready":     # malformed or not worth coding: that is its verdict
                    self.record(unevaluated(late, late.outcome, late.stage, late.reason), late.exchanges)
                elif self.stop.why:
                    self.commit_proposal(late)  # stopped by a signal: evaluated when the run is resumed
                else:
                    self.record(unevaluated(late, "unevaluated", "budget", f"the run ended: {stop}"), late.exchanges)
        return stop, fatal


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


def _written(writing) -> list[Proposal]:
    """The proposals among those in flight that are written already (the planner is told of them)."""
    out = []
    for fut, _, _ in writing:
        if fut.done() and not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), Proposal):
            out.append(fut.result())
    return out
