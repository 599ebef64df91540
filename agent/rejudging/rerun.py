"""A past run again (`kevo-agent replay runs/<id>`): then against now, committed on a branch of its own.

Here: where the run ran and what harness settings changed since (read through its `Ledger`, pinned to the
tip: git objects, never its working tree) and re-running its decisions. Re-judging, the default (the run's
kernels judged by today's stages), is agent/rejudging/rejudge.py.
Decisions (`--llm recorded`): the real loop runs again into a scratch ledger beside the run
(runs/<id>-recorded-<UTC time>), its planner and coder answered from the recorded exchanges
(agent/llm/recorded.py) — or, for a run of the built-in proposer, that proposer again (it is deterministic).
The run's own `agent` and `providers` config is kept (ops, minimum ceiling, repair rounds, overlap,
prices), so what differs is today's harness, prompts and knowledge. Each candidate's claim (op, expected
speedup), outcome and stage are then against now; any difference fails the command (exit 1).
The comparison is committed on a branch of its own by agent/rejudging/report.py. Not here: judging
(harness), proposing (proposers, recorded), the loop (loop).
"""
from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml
from pydantic import ValidationError

from harness.config import Config
from harness.evaluate import resolve_device

from agent.run.environment import describe, where
from agent.ledger.repository import Ledger, LedgerError
from agent.run.loop import run, settings_from
from agent.roles.proposers import PROPOSERS
from agent.llm.recorded import Recording, recorded_proposer
from agent.records import CandidateRecord
from agent.rejudging.report import Decision, DecisionRow, Rejudging

_HARNESS_KEYS = ("device", "worker", "stages", "targets", "served")
_NO_BUDGET_MINUTES = 24 * 60.0      # a re-run ends at the run's number of candidates, not on a clock


class RejudgeError(Exception):
    """Re-judging (or re-running) a past run cannot go as asked; one line."""


# -- the run as committed (read through its Ledger, pinned to its tip) ------------------------------------

def ran_on(ran: Ledger) -> dict[str, str]:
    """Where the run ran (its first commit's environment.json): device, GPU, kevo commit."""
    return where(json.loads(ran.read("environment.json", ran.first)))


def config_changes(ran: Ledger, cfg: Config) -> list[str]:
    """Harness settings that differ between the run's config.yaml and today's."""
    then = _flat({k: v for k, v in (yaml.safe_load(ran.read("config.yaml", ran.first)) or {}).items()
                  if k in _HARNESS_KEYS})
    now = _flat({k: v for k, v in cfg.model_dump(mode="json").items() if k in _HARNESS_KEYS})
    return [f"{k}: {_short(then.get(k, '(absent)'))} then, {_short(now.get(k, '(absent)'))} now"
            for k in sorted(then.keys() | now.keys()) if then.get(k) != now.get(k)]


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(v: object, n: int = 100) -> str:
    text = json.dumps(v)
    return text if len(text) <= n else text[: n - 1] + "…"


def here(device: torch.device) -> dict[str, str]:
    return where(describe(device))


def stamp() -> tuple[str, str]:
    t = datetime.now(timezone.utc)
    return t.isoformat(timespec="seconds"), t.strftime("%Y%m%dT%H%M%SZ")     # the record's, a name's


# -- decisions --------------------------------------------------------------------------------------

def _decision(r: CandidateRecord) -> Decision:
    return Decision(op=r.op, expected_speedup=r.claim.expected_speedup if r.claim else None, outcome=r.outcome,
                    stage=r.stage, hypothesis=r.claim.hypothesis if r.claim else "")


def compare_decisions(then: list[CandidateRecord], now: list[CandidateRecord]) -> list[DecisionRow]:
    t, n = {r.id: _decision(r) for r in then}, {r.id: _decision(r) for r in now}
    rows = []
    for cid in sorted(t.keys() | n.keys(), key=lambda c: (len(c), c)):
        a, b = t.get(cid), n.get(cid)
        if a is None or b is None:
            rows.append(DecisionRow(id=cid, then=a, now=b, differs=["made now only" if a is None else "not made now"]))
            continue
        fields, note = ["op", "expected_speedup", "outcome", "stage"], ""
        if a.outcome == "unevaluated":
            fields, note = fields[:2], "unevaluated then (the run was ending): only its claim is compared"
        rows.append(DecisionRow(id=cid, then=a, now=b, differs=[f for f in fields if getattr(a, f) != getattr(b, f)],
                                note=note))
    return rows


def run_config(cfg: Config, ran: Ledger) -> Config:
    """Today's config with the run's own agent and providers settings (where today still has them)."""
    theirs = yaml.safe_load(ran.read("config.yaml", ran.first)) or {}
    raw = cfg.model_dump(mode="json")
    for section in ("agent", "providers"):
        raw[section].update({k: {**raw[section][k], **v} if isinstance(v, dict) and isinstance(raw[section][k], dict) else v
                             for k, v in (theirs.get(section) or {}).items() if k in raw[section]})   # keys added since: today's
    raw["providers"]["prices"] = {**cfg.model_dump(mode="json")["providers"]["prices"],
                                  **((theirs.get("providers") or {}).get("prices") or {})}
    raw["agent"].update(ops=list(ran.header().ops), runs_dir=str(ran.root.resolve().parent))
    raw["providers"]["fallback"] = None                 # only the recording answers: never a live provider
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise RejudgeError(f"{ran.root}/config.yaml: the run's agent and providers settings do not load today "
                          f"({'.'.join(map(str, err['loc']))}: {err['msg']})") from None


@contextmanager
def _registered(name: str, factory):
    """A proposer entry for the length of one re-run (the recorded LLM needs its recording)."""
    before = PROPOSERS.get(name)
    PROPOSERS[name] = factory
    try:
        yield
    finally:
        if before is None:
            PROPOSERS.pop(name, None)
        else:
            PROPOSERS[name] = before


def rerun(root: Path, cfg: Config, view, pool=None) -> Rejudging:
    """The run again with its recorded LLM (or its built-in proposer) and today's harness, then vs now."""
    ran = Ledger(root, pinned=True)
    h, then = ran.header(), ran.history()
    if not then:
        raise RejudgeError(f"{root}: the run has no candidates; there is no decision to re-run")
    merged = run_config(cfg, ran)
    device = resolve_device(merged)
    at, name = stamp()
    scratch_id = f"{root.name}-recorded-{name}"
    while (root.resolve().parent / scratch_id).exists():
        scratch_id += "x"
    if h.provider == "offline":
        recording, provider = None, "offline"
        what = "the built-in proposer, run again (deterministic; the run has no LLM exchanges)"
    else:
        recording, provider = Recording(ran.exchanges()), "recorded"
        what = f"the run's {recording.calls} recorded {h.provider} exchanges, answered in order per candidate and role"
    settings = settings_from(merged, device.type, target=h.target, provider=provider, budget_minutes=_NO_BUDGET_MINUTES,
                             max_candidates=len(then), max_cost_usd=h.max_cost_usd, run_id=scratch_id)
    settings = settings.model_copy(update={"planner_model": h.planner_model, "coder_model": h.coder_model})
    with _registered("recorded", recorded_proposer(recording)) if recording else nullcontext():
        result = run(merged, settings, view, pool=pool)
    try:
        stopped_then = ran.summary().get("stopped", "")
    except (LedgerError, json.JSONDecodeError):
        stopped_then = ""
    return Rejudging(run=h.id, kind="decisions", at=at, then=ran_on(ran), now=here(device),
                  config_changes=config_changes(ran, merged), decisions=compare_decisions(then, result.history),
                  proposer=what, scratch=str(result.ledger), stopped={"then": stopped_then, "now": result.stop},
                  divergences=recording.divergences if recording else [],
                  unasked=recording.unasked() if recording else [])
