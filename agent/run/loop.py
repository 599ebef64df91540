"""The agent loop behind `kevo-agent run`: propose, evaluate, conclude, commit — until a budget ends.

Order of a run: resolve the proposer (an LLM key missing is an error before anything starts), take the
run folder's lock, open the evaluator, evaluate the heads (the reference kernels), build the baseline
profile, make the ledger's first commit; then the drive (agent/run/drive.py: as many candidates in flight
as the evaluator allows, agent/run/evaluators.py) and the end commit. Here is the run's state and budgets,
starting and resuming, and every ledger write. After an accepted kernel the head of its op moves and the
profile is rebuilt, in the candidate's own commit. Proposals are committed once each, paid exchanges from
any thread, under the ledger's lock. The run ends at the first budget reached (wall time,
candidates, cost, device time: totals over all its sessions), when the proposer has nothing left, on
SIGINT/SIGTERM (after the current candidate's commit), or when a provider fails in a way retrying and
waiting cannot fix (`fatal`). Resuming a run first evaluates the proposals it had committed but not
judged. Everything a run learns is committed before the next step.
Not here: what to propose (proposers), how to judge (harness), when a candidate is proposed, judged and
committed (drive), where it is evaluated (evaluators), what its end says (ending), how to show it
(view), the settings (settings).
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import yaml

from harness.config import Config
from harness.evaluate import resolve_device
from harness.targets import TARGETS

from agent.run.drive import drive
from agent.run.ending import RunResult, end_text, funnel, heads_found_wrong, not_run, untimed_note
from agent.run.environment import describe, where
from agent.run.evaluators import evaluator_for
from agent.roles.evaluator import device_seconds, evaluate_head, head_source, now, others_of
from agent.reading.figures import speed
from agent.reading.pace import pace, pace_words
from agent.knowledge import gpu_arch, load_catalog
from agent.ledger.messages import fit_subject
from agent.ledger.repository import Ledger, exchange_text, id_number
from agent.ledger.store import discard_unstarted, folder_state
from agent.run.profile import baseline_replay_note, run_profile
from agent.roles.proposers import PROPOSERS
from agent.llm.providers import Halted, Meter
from agent.records import CandidateRecord, Exchange, Kernel, Proposal, RunHeader
from agent.run.session import Interrupts, RunBusy, RunLock
from agent.run.settings import RunError, RunSettings, runs_dir, settings_from  # noqa: F401  (re-exported)
from agent.run.state import ProposalState, best_kernel, search_parent, standing_head, wrong_later

class Run:
    """One run, from its lock to its end commit. `slots`: evaluate through an executor's slots (True) or the
    loop's own pool (False); None: as the config asks (agent/run/evaluators.py:in_parallel)."""

    def __init__(self, cfg: Config, settings: RunSettings, view, slots: bool | None = None) -> None:
        self.cfg, self.settings, self.view = cfg, settings, view
        self.t0 = time.monotonic()
        self.device = resolve_device(cfg)
        self.evaluator = evaluator_for(cfg, settings.target, self.device, lambda text: view.update(activity=text), slots)
        self.arch = gpu_arch(self.device)
        if settings.target not in TARGETS:
            raise RunError(f"unknown target {settings.target!r}; known: {', '.join(TARGETS)}")
        # the heads: the reference kernels unless agent.heads names another family (a CatalogError if unknown)
        self.catalog = load_catalog().heads_first(settings.target, cfg.agent.heads, self.arch)
        unknown = [op for op in cfg.agent.ops if op not in TARGETS[settings.target].ops]
        if unknown:
            raise RunError(f"agent.ops: {unknown[0]!r} is not an op of {settings.target} "
                           f"({', '.join(TARGETS[settings.target].ops)})")
        if settings.provider != "offline":
            for model in {settings.planner_model, settings.coder_model} - set(cfg.providers.prices):
                raise RunError(f"providers.prices has no entry for model {model!r}; add one (0 for a local server)")
            if cfg.providers.fallback == settings.provider:
                raise RunError(f"providers.fallback is {settings.provider}, the provider in use; name the other one or null")
        self.stop = Interrupts()
        self.meter = Meter(cfg.providers)
        self.meter.halt, self.meter.limit_usd, self.meter.on_paid = self.halted, settings.max_cost_usd, self.commit_paid
        self.meter.notice = getattr(view, "status", lambda text: view.update(activity=text) if text else None)
        self._paid: dict[str, list[Exchange]] = {}  # candidate id -> its exchanges committed so far
        self.proposer = PROPOSERS[settings.provider](cfg, settings.target, self.device, self.arch, self.catalog, self.meter,
                                                     settings.planner_model, settings.coder_model)
        self.root = Path(settings.root) if settings.root else runs_dir(cfg) / settings.run_id
        if folder_state(self.root) == "foreign":
            raise RunError(f"{self.root} exists and is not a kevo run; give another --run-id")
        self.history: list[CandidateRecord] = []
        self.elapsed_before, self.last_id, self.head_device_s = 0.0, 0, 0.0
        self.start_heads: dict[str, Kernel] = {}    # the heads the run began from, as judged then (its pace)
        self._ledger_lock = threading.Lock()        # commits come from this thread, paid ones from any
        self._kept: set[str] = set()                # proposals committed (once each)

    # -- limits -----------------------------------------------------------------------------------

    def elapsed(self) -> float:
        """Wall seconds of this run: earlier sessions (to their last commit) and this one."""
        return self.elapsed_before + time.monotonic() - self.t0

    def device_s(self) -> float:
        return self.head_device_s + device_seconds({}, self.history)

    def out_of_time(self) -> str:
        if self.elapsed() >= self.settings.budget_minutes * 60:
            return f"time budget of {self.settings.budget_minutes:g} min spent" + (" (all sessions)" if self.elapsed_before else "")
        return ""

    def halted(self) -> str:
        """Why a wait (for a proposal, for a provider) must end now: a signal, or the time budget."""
        return self.stop.why or self.out_of_time()

    def provider_stopped(self, e: Exception) -> tuple[str, bool]:
        """(why, fatal) when a provider gave up: a call refused or cut short by a signal, the time budget or
        the cost limit is an ordinary end; otherwise the provider's own failure, which is fatal."""
        if self.halted():
            return self.halted(), False
        return (e.why, False) if isinstance(e, Halted) else (str(e), True)

    def limit(self, in_flight: int = 0) -> str:
        """Why the run must end now: a signal, or the first budget reached."""
        return self.stop.why or self.budget(in_flight)

    def budget(self, in_flight: int = 0) -> str:
        s = self.settings
        if why := self.out_of_time():
            return why
        if s.max_candidates is not None and len(self.history) + in_flight >= s.max_candidates:
            return f"{s.max_candidates} candidates reached"
        if self.meter.cost_usd >= s.max_cost_usd > 0 or (s.max_cost_usd == 0 and self.meter.cost_usd > 0):
            return f"cost limit of ${s.max_cost_usd:g} reached (${self.meter.cost_usd:.4f} spent)"
        if s.max_device_minutes is not None and self.device_s() >= s.max_device_minutes * 60:
            return (f"device-time budget of {s.max_device_minutes:g} min spent "
                    f"({self.device_s() / 60:.2f} min in the evaluator's stages)")
        return ""

    def state(self, pending: list) -> ProposalState:
        n = max([self.last_id] + [id_number(p.id) for p in pending]) + 1      # never an id already in the ledger
        return ProposalState(next_id=f"c{n:03d}", ops=list(self.cfg.agent.ops),
                             history=list(self.history), heads=dict(self.heads), parents=dict(self.parents),
                             profile=self.profile, min_ceiling=self.cfg.agent.min_ceiling, pending=list(pending),
                             explore=self.cfg.agent.explore)

    def summary(self, stop: str = "") -> dict:
        best = {op: best_kernel(op, self.heads[op], self.history) for op in self.heads}
        return {"run": self.settings.run_id, "candidates": len(self.history), "funnel": funnel(self.history),
                "cost_usd": round(self.meter.cost_usd, 6), "input_tokens": self.meter.input_tokens,
                "output_tokens": self.meter.output_tokens, "elapsed_s": round(self.elapsed(), 1),
                "device_s": round(self.device_s(), 1),
                "providers": {name: f.record() for name, f in sorted(self.meter.fared.items())},
                "heads": {op: k.ref for op, k in self.heads.items()},
                "best": {op: {"ref": k.ref, **speed(k.verdict, op).record(), "speedup": k.speedup, "path": self._path(k)}
                         for op, k in best.items()},
                "untimed": untimed_note(self.heads, self.history),
                "heads_found_wrong": heads_found_wrong(self.history),
                "pace": pace(self.start_heads, self.history, self.elapsed()).record(),
                "stopped": stop}

    def _path(self, k: Kernel) -> str:
        return str(self.root / (f"best/{k.op}.py" if not k.ref.startswith("head:") else f"heads/{k.op}.py"))

    # -- the run ----------------------------------------------------------------------------------

    def _settings_json(self) -> str:
        return self.settings.model_dump_json(indent=1, exclude={"root"})

    def start(self) -> None:
        state = folder_state(self.root)
        if state == "started":
            self._resume()
        else:
            if state == "unstarted":             # stopped before its first commit: nothing to keep
                discard_unstarted(self.root)
            self.heads = {}
            for op in self.cfg.agent.ops:
                self.view.update(activity=f"evaluating the {op} head (reference kernel)")
                self.heads[op] = self.head(op)
            self.head_device_s = device_seconds(self.heads, [])
            self.start_heads = dict(self.heads)
            self.profile = run_profile(self.cfg, self.settings.target, self.device, self.arch, self.heads)
            s = self.settings
            header = RunHeader(id=s.run_id, target=s.target, provider=s.provider,
                               planner_model=s.planner_model if s.provider != "offline" else "",
                               coder_model=s.coder_model if s.provider != "offline" else "", device=self.device.type,
                               arch=self.arch, ops=list(self.cfg.agent.ops), budget_minutes=s.budget_minutes,
                               max_candidates=s.max_candidates, max_cost_usd=s.max_cost_usd, started=now(),
                               kevo_commit=describe(self.device)["kevo_commit"])
            with self.stop.writing():
                self.ledger = Ledger.create(self.root, header, yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False),
                                            describe(self.device), self.profile, baseline_replay_note(), self.heads,
                                            self.summary(), self._settings_json())
        self.parents = {op: search_parent(op, self.heads[op], self.history, self.cfg.stages.microbench.min_margin)
                        for op in self.heads}
        self.view.update(ledger=str(self.root), funnel=funnel(self.history))

    def head(self, op: str) -> Kernel:
        """One head's kernel and verdict, from the run's evaluator; its replay serves the other ops' first heads
        in both arms (the step the run starts from)."""
        def at(stage: str) -> None:
            self.view.update(activity=f"evaluating the {op} head (reference kernel): {stage}")
        first = {o: head_source(self.catalog, self.settings.target, o) for o in self.cfg.agent.ops}
        return evaluate_head(op, self.cfg, self.settings.target, None, self.catalog,
                             evaluate_fn=lambda job, src, beat, head: self.evaluator.evaluate(
                                 job, src, beat, head, on_stage=at, other_heads=others_of(first, op)))

    def _resume(self) -> None:
        self.ledger = Ledger(self.root)
        discarded = self.ledger.recover()            # we hold the lock: a killed session's leftovers go
        header = self.ledger.header()
        if (header.target, header.ops) != (self.settings.target, self.cfg.agent.ops):
            raise RunError(f"{self.root} is a run of {header.target} ({', '.join(header.ops)}); "
                           "resume it with the same target and agent.ops")
        environment = describe(self.device)
        then, here = where(json.loads(self.ledger.read("environment.json", self.ledger.first))), where(environment)
        if (then["device"], then["gpu"]) != (here["device"], here["gpu"]):     # its heads and bars are that GPU's
            raise RunError(f"{self.root} ran on {then['device']} ({then['gpu']}), this machine is {here['device']} "
                           f"({here['gpu']}): its heads' verdicts and the bars its search moves by were measured "
                           f"there; re-judge it here (`kevo-agent replay {self.root}`) or begin a new run")
        self.heads, self.history, self.profile = self.ledger.heads(), self.ledger.history(), self.ledger.profile()
        self.start_heads = self.ledger.heads(at_start=True)
        done = self.ledger.summary()
        self.meter.cost_usd = done.get("cost_usd", 0.0)
        self.meter.input_tokens, self.meter.output_tokens = done.get("input_tokens", 0), done.get("output_tokens", 0)
        self.meter.restore(done.get("providers", {}))
        self.elapsed_before = float(done.get("elapsed_s", 0.0))
        self.last_id = self.ledger.last_id()
        prepaid = self._prepaid()
        self.head_device_s = (max(0.0, done["device_s"] - device_seconds({}, self.history)) if "device_s" in done
                              else device_seconds(self.heads, []))
        self.ledger.retag({op: best_kernel(op, self.heads[op], self.history).ref for op in self.heads},
                          {op: k.ref for op, k in self.heads.items()})
        s, pending = self.settings, self.ledger.pending()
        body = [f"proposer {s.provider}" + (f" (the run began with {header.provider})" if s.provider != header.provider else "")
                + f"; budgets, all sessions together: {s.budget_minutes:g} min, "
                f"{s.max_candidates or 'no limit on'} candidates, ${s.max_cost_usd:g}, "
                f"{f'{s.max_device_minutes:g} min' if s.max_device_minutes else 'no limit on'} device time; "
                f"{self.elapsed_before / 60:.1f} min spent before",
                f"discarded, written but never committed by the session before: {', '.join(discarded)}" if discarded else "",
                f"proposed but not yet evaluated, evaluated first: {', '.join(p.id for p in pending)}" if pending else "",
                f"paid for before, not bought again: {prepaid}" if prepaid else ""]
        with self.stop.writing():
            self.ledger.commit(f"resume {s.run_id}", body,
                               {"environment.json": json.dumps(environment, indent=1),
                                "settings.json": self._settings_json(), "summary.json": json.dumps(self.summary(), indent=1)},
                               {"Run": s.run_id})

    def _prepaid(self) -> str:
        """On resume: the exchanges committed for candidates with no verdict yet, handed to the meter so the
        calls they answered are not made again. A candidate whose proposal was never committed is proposed
        again under its own id (by an LLM proposer; the built-in one pays nothing and takes a new id)."""
        said = []
        for cid, (exchanges, proposal) in sorted(self.ledger.unjudged_exchanges().items()):
            self._paid[cid] = list(exchanges)
            more = exchanges[len(proposal.exchanges):] if proposal is not None else exchanges
            if more:
                self.meter.prepaid[cid] = list(more)
                said.append(f"{cid} ({', '.join(f'{e.role} {e.purpose}' for e in more)})")
            if proposal is None and not self.proposer.instant and id_number(cid) == self.last_id:
                self.last_id -= 1                   # the candidate being proposed: proposed again, same id
        return "; ".join(said)

    def commit_paid(self, cid: str, exchange: Exchange) -> None:
        """A paid exchange, committed as soon as it is answered (from any thread): a fatal failure or a kill
        before the candidate's own commit does not lose it, and a resumed run does not buy it again."""
        if not cid:
            return
        in_main = threading.current_thread() is threading.main_thread()
        with self._ledger_lock:
            paid = self._paid.setdefault(cid, [])
            paid.append(exchange)
            with self.stop.writing() if in_main else nullcontext():
                self.ledger.commit(fit_subject(f"paid {cid} {exchange.role} {exchange.purpose}: ${exchange.cost_usd:.6f}, "
                                               f"{exchange.provider} {exchange.model}"),
                                   [f"{exchange.attempts} call(s), {exchange.seconds:.1f} s" +
                                    (f"; {exchange.note}" if exchange.note else "")],
                                   {f"candidates/{cid}/exchanges.jsonl": exchange_text(paid),
                                    "summary.json": json.dumps(self.summary(), indent=1)},
                                   {"Paid": cid, "Cost": f"{exchange.cost_usd:.6f}"})

    def record(self, record: CandidateRecord, exchanges: list[Exchange], trailers: dict | None = None) -> str:
        """Commit a verdict; the head moves to an accepted candidate, or back to the head before it when the
        replay found the head wrong (state.standing_head). Returns why the run must stop (every head of the op
        found wrong), else empty."""
        op = record.op
        self.history.append(record)
        self.last_id = max(self.last_id, id_number(record.id))
        known = op in self.heads
        standing = standing_head(op, self.start_heads[op], self.history) if known else None
        first = self.start_heads[op].ref if known else ""
        stop = (f"no {op} head is left that no replay found wrong: {first}, the run's first, was found wrong where "
                f"served, in {wrong_later(self.history)[first]}'s replay" if known and standing is None else "")
        new_best = known and best_kernel(op, standing or self.heads[op], self.history).ref == record.id
        files, trailers = {}, {**({"Vs-cuDNN": speed(record.verdict, op).trailer()} if record.verdict else {}),
                               **(trailers or {})}
        if standing is not None and standing.ref != self.heads[op].ref:    # the bottleneck moves: a new profile
            back = f"{self.heads[op].ref} was found wrong in {record.id}'s replay; {standing.ref}"
            became = f"{record.id} became" if standing.ref == record.id else f"{back} is again"
            self.heads[op] = standing
            self.profile = run_profile(self.cfg, self.settings.target, self.device, self.arch, self.heads,
                                       why=f"rebuilt after {became} the {op} head: f derived again from its "
                                           f"microbench {standing.speedup:.3f}x over torch" if standing.speedup else
                                           f"rebuilt after {became} the {op} head")
            files = {f"heads/{op}.json": self.heads[op].model_dump_json(indent=1, exclude={"source"}),
                     "profile.json": self.profile.model_dump_json(indent=1)}
            trailers["Head"] = f"{op}={standing.ref}"
        with self._ledger_lock, self.stop.writing():
            self._paid.pop(record.id, None)         # its exchanges are in its own commit from here
            self.ledger.commit_candidate(record, exchanges,
                                         self.summary(), new_best, files, trailers)
        if known:
            self.parents[op] = search_parent(op, self.heads[op], self.history, self.cfg.stages.microbench.min_margin)
        self.view.record(record, self.summary())
        return stop

    def commit_proposal(self, proposal: Proposal) -> None:
        """Commit a proposal before its evaluation, once (from the drive's thread, guarded against signals)."""
        with self._ledger_lock:
            if proposal.id in self._kept:
                return
            with self.stop.writing():
                self.ledger.commit_proposal(proposal, self.summary())
            self._kept.add(proposal.id)
            self.last_id = max(self.last_id, id_number(proposal.id))

    def finish(self, stop: str, fatal: bool) -> RunResult:
        self.view.update(activity=f"ended: {stop}", claim="")
        notes = [f"{name}: {why}" for name, why in not_run(self.heads, self.history).items()]
        summary = self.summary(stop)
        pending = [p.id for p in self.ledger.pending()]
        fared = [f.line(name) for name, f in sorted(self.meter.fared.items())]
        text = end_text(self.settings.run_id, stop, summary, pending, fared, notes)
        with self._ledger_lock, self.stop.writing():     # a proposer thread may still be committing
            self.ledger.commit(fit_subject(f"end {self.settings.run_id}: {stop}"), [text],
                               {"summary.json": json.dumps(summary, indent=1), "summary.md": text},
                               {"Run": self.settings.run_id, "Candidates": len(self.history),
                                "Cost": f"{self.meter.cost_usd:.6f}", "Fatal": str(fatal).lower(),
                                **({"Providers": "; ".join(fared)} if fared else {})})
        best = {op: best_kernel(op, self.heads[op], self.history) for op in self.heads}
        return RunResult(self.root, stop, fatal, self.history, self.heads, best, self.meter.cost_usd,
                         funnel(self.history), notes, self.stop.signum, fared, summary["untimed"],
                         pace_words(summary["pace"]))

    def __call__(self, pool=None) -> RunResult:
        try:
            lock = RunLock(self.root).acquire()
        except RunBusy as e:
            raise RunError(str(e)) from None
        try:
            with self.stop:
                self.evaluator.open(pool)
                try:
                    self.start()
                    stop, fatal = drive(self)
                    return self.finish(stop, fatal)
                finally:
                    self.evaluator.close()      # the run's own pool or slots; a pool handed in stays open
        finally:
            lock.release()


def run(cfg: Config, settings: RunSettings, view, pool=None) -> RunResult:
    """A run, evaluated in `pool` where one is given and the config asks for no executor (in_parallel)."""
    return Run(cfg, settings, view)(pool)
