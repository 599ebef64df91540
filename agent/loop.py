"""The agent loop behind `kevo-agent run`: propose, evaluate, conclude, commit — until a budget ends.

Order of a run: resolve the proposer (an LLM key missing is an error before anything starts), open the
worker pool, evaluate the heads (the reference kernels), build the baseline profile (a stand-in until
issue 3's profiler exists), make the ledger's first commit; then one candidate at a time. A slow
proposer (an LLM) writes the next candidate in a thread while the current one is evaluated, so the
GPU is not left idle; the built-in proposer answers at once and waits for each verdict. After an
accepted kernel the head of its op moves and the profile is rebuilt. The run ends at the time budget,
the candidate or cost limit, when the proposer has nothing left, or when a provider fails in a way
retrying cannot fix (`fatal`). Everything a run learns is committed before the next step.
Not here: what to propose (proposers), how to judge (harness), how to show it (view).
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import yaml

from harness.config import PROJECT_ROOT, Config
from harness.evaluate import open_pool, resolve_device
from harness.stages import STAGE_NAMES
from harness.targets import TARGETS

from agent.conclusion import subject
from agent.environment import describe
from agent.evaluator import evaluate_head, judge, now, unevaluated
from agent.knowledge import gpu_arch, load_catalog
from agent.ledger import Ledger
from agent.profile import baseline_replay_note, standin_profile
from agent.proposers import PROPOSERS
from agent.providers import Meter, ProviderStop
from agent.records import CandidateRecord, Exchange, Kernel, Record, RunHeader
from agent.state import ProposalState, best_kernel, search_parent

FUNNEL = ("malformed", "not-worth-coding", *STAGE_NAMES, "passed", "accepted", "unevaluated")


class RunError(Exception):
    """The run cannot start as asked; one line."""


class RunSettings(Record):
    target: str
    provider: str
    planner_model: str
    coder_model: str
    budget_minutes: float
    max_candidates: int | None
    max_cost_usd: float
    run_id: str


def settings_from(cfg: Config, device_type: str, target: str = "attention", provider: str | None = None,
                  model: str | None = None, budget_minutes: float | None = None, max_candidates: int | None = None,
                  max_cost_usd: float | None = None, run_id: str | None = None) -> RunSettings:
    provider = provider or cfg.agent.provider
    pcfg = getattr(cfg.providers, provider, None)
    return RunSettings(
        target=target, provider=provider,
        planner_model=model or (pcfg.planner_model if pcfg else ""), coder_model=model or (pcfg.coder_model if pcfg else ""),
        budget_minutes=budget_minutes or getattr(cfg.agent.budget_minutes, device_type),
        max_candidates=max_candidates or cfg.agent.max_candidates,
        max_cost_usd=cfg.agent.max_cost_usd if max_cost_usd is None else max_cost_usd,
        run_id=run_id or datetime.now().strftime("%Y%m%d-%H%M%S-") + provider)


@dataclass
class RunResult:
    ledger: Path
    stop: str
    fatal: bool
    history: list[CandidateRecord]
    heads: dict[str, Kernel]
    best: dict[str, Kernel]
    cost_usd: float
    funnel: dict[str, int]
    not_run: list[str] = field(default_factory=list)


def funnel(history: list[CandidateRecord]) -> dict[str, int]:
    counts = dict.fromkeys(FUNNEL, 0)
    for r in history:
        key = r.stage if r.outcome == "rejected" else r.outcome
        counts[key] = counts.get(key, 0) + 1
    return counts


def not_run(heads: dict[str, Kernel], history: list[CandidateRecord]) -> list[str]:
    """The stages that could not run here, and why (from the verdicts themselves)."""
    seen: dict[str, str] = {}
    for v in [k.verdict for k in heads.values()] + [r.verdict for r in history]:
        for s in v.stages if v else []:
            if s.status == "skipped":
                seen.setdefault(s.name, " ".join(s.reason.split()))
    notes = [f"{name}: {why}" for name, why in seen.items()]
    replay = baseline_replay_note()
    if replay["status"] == "not run":
        notes.append(f"replay: {replay['note']}")
    return notes


class Run:
    def __init__(self, cfg: Config, settings: RunSettings, view) -> None:
        self.cfg, self.settings, self.view = cfg, settings, view
        self.t0 = time.monotonic()
        self.device = resolve_device(cfg)
        self.arch = gpu_arch(self.device)
        self.catalog = load_catalog()
        if settings.target not in TARGETS:
            raise RunError(f"unknown target {settings.target!r}; known: {', '.join(TARGETS)}")
        unknown = [op for op in cfg.agent.ops if op not in TARGETS[settings.target].ops]
        if unknown:
            raise RunError(f"agent.ops: {unknown[0]!r} is not an op of {settings.target} "
                           f"({', '.join(TARGETS[settings.target].ops)})")
        if settings.provider != "offline":
            for model in {settings.planner_model, settings.coder_model} - set(cfg.providers.prices):
                raise RunError(f"providers.prices has no entry for model {model!r}; add one (0 for a local server)")
        self.meter = Meter(cfg.providers)
        self.proposer = PROPOSERS[settings.provider](cfg, settings.target, self.device, self.arch, self.catalog, self.meter,
                                                     settings.planner_model, settings.coder_model)
        runs = Path(cfg.agent.runs_dir)
        self.root = (runs if runs.is_absolute() else PROJECT_ROOT / runs) / settings.run_id
        if self.root.exists() and any(self.root.iterdir()) and not (self.root / "run.json").exists():
            raise RunError(f"{self.root} exists and is not a kevo run; give another --run-id")
        self.history: list[CandidateRecord] = []

    # -- limits -----------------------------------------------------------------------------------

    def limit(self, in_flight: int = 0) -> str:
        s = self.settings
        if time.monotonic() - self.t0 >= s.budget_minutes * 60:
            return f"time budget of {s.budget_minutes:g} min spent"
        if s.max_candidates is not None and len(self.history) + in_flight >= s.max_candidates:
            return f"{s.max_candidates} candidates reached"
        if self.meter.cost_usd >= s.max_cost_usd > 0 or (s.max_cost_usd == 0 and self.meter.cost_usd > 0):
            return f"cost limit of ${s.max_cost_usd:g} reached (${self.meter.cost_usd:.4f} spent)"
        return ""

    def state(self, pending: list) -> ProposalState:
        return ProposalState(next_id=f"c{len(self.history) + len(pending) + 1:03d}", ops=list(self.cfg.agent.ops),
                             history=list(self.history), heads=dict(self.heads), parents=dict(self.parents),
                             profile=self.profile, min_ceiling=self.cfg.agent.min_ceiling, pending=list(pending))

    def summary(self, stop: str = "") -> dict:
        best = {op: best_kernel(op, self.heads[op], self.history) for op in self.heads}
        return {"run": self.settings.run_id, "candidates": len(self.history), "funnel": funnel(self.history),
                "cost_usd": round(self.meter.cost_usd, 6), "input_tokens": self.meter.input_tokens,
                "output_tokens": self.meter.output_tokens, "elapsed_s": round(time.monotonic() - self.t0, 1),
                "heads": {op: k.ref for op, k in self.heads.items()},
                "best": {op: {"ref": k.ref, "speedup": k.speedup, "path": self._path(k)} for op, k in best.items()},
                "stopped": stop}

    def _path(self, k: Kernel) -> str:
        return str(self.root / (f"best/{k.op}.py" if not k.ref.startswith("head:") else f"heads/{k.op}.py"))

    # -- the run ----------------------------------------------------------------------------------

    def start(self, pool) -> None:
        if (self.root / "run.json").exists():
            self.ledger = Ledger(self.root)
            header = self.ledger.header()
            if (header.target, header.provider, header.ops) != (self.settings.target, self.settings.provider, self.cfg.agent.ops):
                raise RunError(f"{self.root} is a run of {header.target} ({', '.join(header.ops)}) with {header.provider}; "
                               "resume it with the same target, ops and provider")
            self.heads, self.history, self.profile = self.ledger.heads(), self.ledger.history(), self.ledger.profile()
            done = self.ledger.summary()
            self.meter.cost_usd = done.get("cost_usd", 0.0)
            self.meter.input_tokens, self.meter.output_tokens = done.get("input_tokens", 0), done.get("output_tokens", 0)
            self.ledger.commit(f"resume {self.settings.run_id}", [f"budget {self.settings.budget_minutes:g} min"],
                               {"environment.json": json.dumps(describe(self.device), indent=1)}, {"Run": self.settings.run_id})
        else:
            self.heads = {}
            for op in self.cfg.agent.ops:
                self.view.update(activity=f"evaluating the {op} head (reference kernel)")
                self.heads[op] = evaluate_head(op, self.cfg, self.settings.target, pool, self.catalog)
            self.profile = standin_profile(self.cfg, self.settings.target, self.device, self.arch, self.heads)
            s = self.settings
            header = RunHeader(id=s.run_id, target=s.target, provider=s.provider,
                               planner_model=s.planner_model if s.provider != "offline" else "",
                               coder_model=s.coder_model if s.provider != "offline" else "", device=self.device.type,
                               arch=self.arch, ops=list(self.cfg.agent.ops), budget_minutes=s.budget_minutes,
                               max_candidates=s.max_candidates, max_cost_usd=s.max_cost_usd, started=now(),
                               kevo_commit=describe(self.device)["kevo_commit"])
            self.ledger = Ledger.create(self.root, header, yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False),
                                        describe(self.device), self.profile, baseline_replay_note(), self.heads,
                                        self.summary())
        self.parents = {op: search_parent(op, self.heads[op], self.history) for op in self.heads}
        self.view.update(ledger=str(self.root), funnel=funnel(self.history))

    def record(self, record: CandidateRecord, exchanges: list[Exchange]) -> None:
        op = record.op
        self.history.append(record)
        known = op in self.heads
        new_best = known and best_kernel(op, self.heads[op], self.history).ref == record.id
        self.ledger.commit_candidate(record, exchanges, subject(record.outcome, record.id, record.stage, record.conclusion),
                                     self.summary(), new_best)
        if known and record.outcome == "accepted":      # the bottleneck moves: a new head, a new profile
            self.heads[op] = Kernel(ref=record.id, op=op, path=f"candidates/{record.id}/candidate.py",
                                    source=record.source or "", knobs=record.knobs, speedup=record.speedup,
                                    verdict=record.verdict)
            self.profile = standin_profile(self.cfg, self.settings.target, self.device, self.arch, self.heads,
                                           why=f"rebuilt after {record.id} became the {op} head")
            self.ledger.commit(f"head {op} <- {record.id}: profile rebuilt", [self.profile.note],
                               {f"heads/{op}.json": self.heads[op].model_dump_json(indent=1, exclude={"source"}),
                                "profile.json": self.profile.model_dump_json(indent=1)}, {"Head": f"{op}={record.id}"})
        if known:
            self.parents[op] = search_parent(op, self.heads[op], self.history)
        self.view.record(record, self.summary())

    def drive(self) -> tuple[str, bool]:
        overlap = self.cfg.agent.overlap and not self.proposer.instant
        stop, fatal = self.limit(), False
        with ThreadPoolExecutor(1, thread_name_prefix="kevo-proposer") as ex:
            def submit(pending: list):
                state = self.state(pending)
                if not pending:
                    self.view.update(activity=f"proposing {state.next_id}")
                return ex.submit(self.proposer.propose, state), bool(pending)
            fut, stale = submit([]) if not stop else (None, False)
            while fut is not None:
                try:
                    proposal = fut.result()
                except ProviderStop as e:
                    return str(e), True
                fut = None
                if proposal is None:
                    if stale:               # built before the last verdict: ask again with it
                        fut, stale = submit([])
                        continue
                    stop = "search exhausted: the proposer has nothing left worth trying"
                    break
                ready = proposal.outcome == "ready"
                if overlap and ready and not self.limit(in_flight=1):
                    fut, stale = submit([proposal])
                if not ready:
                    self.record(unevaluated(proposal, proposal.outcome, proposal.stage, proposal.reason), proposal.exchanges)
                elif why := self.limit():
                    self.record(unevaluated(proposal, "unevaluated", "budget", why), proposal.exchanges)
                else:
                    meanwhile = f"; proposing c{len(self.history) + 2:03d} meanwhile" if fut is not None else ""
                    self.view.update(activity=f"evaluating {proposal.id} ({', '.join(STAGE_NAMES)}){meanwhile}",
                                     claim=f"{proposal.id} [{proposal.op}] {proposal.claim.hypothesis}")
                    stage_news = (lambda name, p=proposal, m=meanwhile:
                                  self.view.update(activity=f"evaluating {p.id}: {name}{m}"))
                    record, exchanges, stop_msg = judge(proposal, self.parents[proposal.op], self.proposer, self.cfg,
                                                        self.settings.target, self._pool, on_stage=stage_news)
                    self.record(record, exchanges)
                    if stop_msg:
                        stop, fatal = stop_msg, True
                        break
                if fut is None:
                    stop = self.limit()
                    if stop:
                        break
                    fut, stale = submit([])
            if fut is not None:             # a proposal written while the run was ending: keep what it cost
                try:
                    late = fut.result()
                except ProviderStop:
                    late = None
                if late is not None and late.exchanges:
                    self.record(unevaluated(late, "unevaluated", "budget", f"the run ended: {stop}"), late.exchanges)
        return stop, fatal

    def finish(self, stop: str, fatal: bool) -> RunResult:
        self.view.update(activity=f"ended: {stop}", claim="")
        notes = not_run(self.heads, self.history)
        summary = self.summary(stop)
        text = "\n".join([f"# {self.settings.run_id}: ended", "", f"Stopped: {stop}", "",
                          "Stages not run here:", *([f"- {n}" for n in notes] or ["- none"]), ""])
        self.ledger.commit(f"end {self.settings.run_id}: {stop}"[:150], [text],
                           {"summary.json": json.dumps(summary, indent=1), "summary.md": text},
                           {"Run": self.settings.run_id, "Candidates": len(self.history),
                            "Cost": f"{self.meter.cost_usd:.6f}", "Fatal": str(fatal).lower()})
        best = {op: best_kernel(op, self.heads[op], self.history) for op in self.heads}
        return RunResult(self.root, stop, fatal, self.history, self.heads, best, self.meter.cost_usd,
                         funnel(self.history), notes)

    def __call__(self, pool=None) -> RunResult:
        own = pool is None
        self.view.update(activity="starting the worker pool")
        self._pool = pool or open_pool(self.cfg, self.settings.target, self.device)
        try:
            self.start(self._pool)
            stop, fatal = self.drive()
            return self.finish(stop, fatal)
        finally:
            if own:
                self._pool.close()


def run(cfg: Config, settings: RunSettings, view, pool=None) -> RunResult:
    return Run(cfg, settings, view)(pool)
