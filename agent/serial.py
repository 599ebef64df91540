"""One candidate at a time: the drive of a run on one evaluator (the loop's own worker pool).

A slow proposer (an LLM) writes the next candidate in a thread while the current one is evaluated, so
the GPU is not left idle. Its proposal is committed as soon as it is written, from that thread (Run's
commit_proposal, under the ledger's lock). So a kill during a long evaluation loses no answered proposal,
including one that is malformed or not worth coding and would otherwise wait in memory for the current
verdict. The built-in proposer answers at once and waits for each verdict. A candidate whose worker
crashed, hung or hit a CUDA error is followed by a health check of the device (a known computation in a fresh worker)
before the next one. A proposal still being written when a signal arrives is abandoned (its thread is a
daemon); one that arrives as the run ends is kept: evaluated on resume after a signal, else recorded.
Not here: the run's state, budgets and ledger writes (loop); several candidates at once (parallel).
"""
from __future__ import annotations

from concurrent.futures import Future, TimeoutError as FutureTimeout

from harness.stages import STAGE_NAMES

from agent.evaluator import check_device, judge, unevaluated
from agent.loop import Run, in_thread
from agent.providers import ProviderStop
from agent.records import Proposal
from agent.state import ProposalState

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

    def _submit(self, pending: list) -> Future:
        state = self.state(pending)
        if not pending:
            self.view.update(activity=f"proposing {state.next_id}")
        return in_thread("kevo-proposer", self._write_proposal, state, bool(pending))

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
        backlog = self.ledger.pending()         # committed before a stop, never evaluated: first
        fut, stale, stop, fatal = None, False, "", False
        while True:
            if (stop := self.stop.why) or (fut is None and (stop := self.limit())):
                break
            if backlog:
                proposal, new = backlog.pop(0), False
            else:
                if fut is None:
                    fut, stale = self._submit([]), False
                try:
                    proposal = self._await(fut)
                except ProviderStop as e:
                    fut = None
                    stop, fatal = self.provider_stopped(e)
                    break
                if proposal is _ABANDONED:
                    stop = self.stop.why
                    break                       # the proposal being written is abandoned (the thread is a daemon)
                fut, new = None, True
                if proposal is None:
                    if stale:                   # built before the last verdict: ask again with it
                        continue
                    stop = "search exhausted: the proposer has nothing left worth trying"
                    break
            ready = proposal.outcome == "ready"
            if new and ready and not self.proposer.instant:
                self.commit_proposal(proposal)  # from here a stop loses nothing: a resumed run evaluates it
            if overlap and ready and fut is None and not self.limit(in_flight=1):
                fut, stale = self._submit([proposal]), True
            if not ready:
                self.record(unevaluated(proposal, proposal.outcome, proposal.stage, proposal.reason), proposal.exchanges)
            elif why := self.budget():          # a signal since it was proposed: it is evaluated all the same
                stop = why
                self.record(unevaluated(proposal, "unevaluated", "budget", why), proposal.exchanges)
                break
            else:
                meanwhile = "; proposing the next meanwhile" if fut is not None else ""
                self.view.update(activity=f"evaluating {proposal.id} ({', '.join(STAGE_NAMES)}){meanwhile}",
                                 claim=f"{proposal.id} [{proposal.op}] {proposal.claim.hypothesis}")
                stage_news = (lambda name, p=proposal, m=meanwhile:
                              self.view.update(activity=f"evaluating {p.id}: {name}{m}"))
                record, exchanges, stop_msg = judge(proposal, self.parents[proposal.op], self.proposer, self.cfg,
                                                    self.settings.target, self._pool, on_stage=stage_news,
                                                    head=self.heads.get(proposal.op))
                trailers, sick = check_device(record, self._pool, lambda text: self.view.update(activity=text))
                self.record(record, exchanges, trailers)
                if stop_msg or sick:
                    stop, fatal = stop_msg or sick, True
                    break
        if fut is not None:                     # a proposal written while the run was ending: keep what it cost
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
