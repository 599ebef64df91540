"""Replaying a past run (`kevo-agent replay runs/<id>`): then against now, committed on a branch of its own.

Verdicts (the default): the heads the run started from and every candidate's committed source (its last
round, the one its verdict is for) go through today's stages on this machine with today's config. Each
row is then against now: outcome, stage, speedup (microbench's bar is the one it had then: its
parent's speedup). A change is flagged; a *regression* — a kernel that
passed (or was accepted) then and is rejected now — fails the command (exit 1). A kernel that only loses
a stage this machine cannot run (microbench or replay without CUDA) is flagged as changed, not regressed.
`--until STAGE` cuts both verdicts after that stage; `--only` picks candidates (or `head:<op>`).
Decisions (`--llm recorded`): the real loop runs again into a scratch ledger beside the run
(runs/<id>-recorded-<UTC time>), its planner and coder answered from the recorded exchanges
(agent/recorded.py) — or, for a run of the built-in proposer, that proposer again (it is deterministic).
The run's own `agent` and `providers` config is kept (ops, minimum ceiling, repair rounds, overlap,
prices), so what differs is today's harness, prompts and knowledge. Each candidate's claim (op, expected
speedup), outcome and stage are then against now; any difference fails the command (exit 1).
The run is read as committed, never from its working tree; the comparison is committed on a branch of its
own by agent/replay_report.py. Not here: judging (harness), proposing (proposers, recorded), the loop (loop).
"""
from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import git
import torch
import yaml
from pydantic import ValidationError

from harness.config import Config
from harness.evaluate import evaluate, open_pool, resolve_device
from harness.records import Verdict

from agent.conclusion import outcome_of, speedup_of
from agent.environment import describe
from agent.loop import run, settings_from
from agent.proposers import PROPOSERS
from agent.recorded import Recording, recorded_proposer
from agent.records import CandidateRecord, Exchange, Kernel, RunHeader
from agent.replay_report import Decision, DecisionRow, Replay, Side, VerdictRow

_OK = ("passed", "accepted")
_HARNESS_KEYS = ("device", "worker", "stages", "targets", "served")
_NO_BUDGET_MINUTES = 24 * 60.0      # a replay ends at the run's number of candidates, not on a clock


class ReplayError(Exception):
    """The replay cannot run as asked; one line."""


# -- the run as committed ---------------------------------------------------------------------------

class Committed:
    """A run's files as committed at the tip of its checked-out branch."""

    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            self.repo = git.Repo(root)
            self.tip = self.repo.head.commit
        except (git.exc.InvalidGitRepositoryError, git.exc.NoSuchPathError):
            raise ReplayError(f"{root} is not a kevo run (no git repository)") from None
        except ValueError:
            raise ReplayError(f"{root}: the run has no commit yet") from None
        self.header = self._load(RunHeader, "run.json")
        self.first = next(self.repo.iter_commits(self.tip, max_parents=0))

    def text(self, rel: str, commit: git.Commit | None = None) -> str:
        try:
            return ((commit or self.tip).tree / rel).data_stream.read().decode()
        except KeyError:
            raise ReplayError(f"{self.root}: {rel} is not committed; not a kevo run ledger") from None

    def _load(self, model, rel: str, commit: git.Commit | None = None):
        try:
            return model.model_validate_json(self.text(rel, commit))
        except ValidationError as e:
            err = e.errors()[0]
            raise ReplayError(f"{self.root}/{rel} cannot be read by this kevo "
                              f"({'.'.join(map(str, err['loc']))}: {err['msg']})") from None

    def _candidates(self) -> list[str]:
        """Candidates with a verdict committed (a proposal still waiting for one is not history yet)."""
        try:
            folders = (self.tip.tree / "candidates").trees
        except KeyError:
            return []
        judged = [t.name for t in folders if any(b.name == "record.json" for b in t.blobs)]
        return sorted(judged, key=lambda n: (len(n), n))

    def history(self) -> list[CandidateRecord]:
        return [self._load(CandidateRecord, f"candidates/{cid}/record.json") for cid in self._candidates()]

    def heads(self) -> list[Kernel]:
        """The heads the run started from, with their verdicts then (its first commit)."""
        try:
            blobs = (self.first.tree / "heads").blobs
        except KeyError:
            raise ReplayError(f"{self.root}: the run's first commit holds no heads/; not a kevo run ledger") from None
        heads = []
        for blob in sorted(blobs, key=lambda b: b.name):
            if blob.name.endswith(".json"):
                data = json.loads(blob.data_stream.read())
                heads.append(Kernel(**data, source=self.text(data["path"], self.first)))
        return heads

    def exchanges(self) -> dict[str, list[Exchange]]:
        out = {}
        for cid in self._candidates():
            try:
                blob = self.tip.tree / f"candidates/{cid}/exchanges.jsonl"
            except KeyError:
                continue
            try:
                out[cid] = [Exchange.model_validate_json(line) for line in blob.data_stream.read().decode().splitlines()
                            if line.strip()]
            except ValidationError as e:
                raise ReplayError(f"{self.root}/candidates/{cid}/exchanges.jsonl cannot be read by this kevo "
                                  f"({e.errors()[0]['msg']})") from None
        return out

    def where(self) -> dict[str, str]:
        env = json.loads(self.text("environment.json", self.first))
        return {k: str(env.get(k, "unknown")) for k in ("device", "gpu", "kevo_commit")}

    def config_changes(self, cfg: Config) -> list[str]:
        """Harness settings that differ between the run's config.yaml and today's."""
        then = _flat({k: v for k, v in (yaml.safe_load(self.text("config.yaml", self.first)) or {}).items()
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


def _here(device: torch.device) -> dict[str, str]:
    env = describe(device)
    return {k: str(env.get(k, "unknown")) for k in ("device", "gpu", "kevo_commit")}


def _stamp() -> tuple[str, str]:
    t = datetime.now(timezone.utc)
    return t.isoformat(timespec="seconds"), t.strftime("%Y%m%dT%H%M%SZ")     # the record's, a name's


# -- verdicts ---------------------------------------------------------------------------------------

def _side(verdict: Verdict, until: str | None) -> Side:
    stages = verdict.stages
    if until is not None:
        cut = next((i for i, s in enumerate(stages) if s.name == until), len(stages) - 1)
        verdict = Verdict.of(stages[: cut + 1])
    outcome, stage = outcome_of(verdict)
    return Side(outcome=outcome, stage=stage, speedup=speedup_of(verdict), reason=verdict.reason)


def _change(then: Side, now: Side) -> str:
    if (then.outcome, then.stage) == (now.outcome, now.stage):
        return "same"
    if then.outcome in _OK and now.outcome == "rejected":
        return "regressed"
    if then.outcome == "rejected" and now.outcome in _OK:
        return "now passes"
    return "changed"


def _skipped_here(then: Verdict, now: Verdict) -> str:
    ran = {s.name for s in then.stages if s.status != "skipped"}
    skipped = [s for s in now.stages if s.status == "skipped" and s.name in ran]
    if not skipped:
        return ""
    why = " ".join(skipped[0].reason.removeprefix("skipped:").split())[:80]
    return f"{', '.join(s.name for s in skipped)} ran then, skipped here ({why})"


def _beat(verdict: Verdict) -> float:
    """The speedup microbench had to beat then (its parent's), so the bar is the same now."""
    bench = next((s for s in verdict.stages if s.name == "microbench"), None)
    return bench.metrics.get("beat", 1.0) if bench is not None else 1.0


def replay_verdicts(root: Path, cfg: Config, pool=None, only: list[str] | None = None, until: str | None = None,
                    progress: Callable[[str], None] | None = None) -> Replay:
    """Today's stages on the run's heads and committed candidates; a pool is opened if none is given."""
    ran = Committed(root)
    h = ran.header
    subjects = [(k.ref, k.op, k.source, k.verdict, None) for k in ran.heads()]
    subjects += [(r.id, r.op, r.source, r.verdict, r) for r in ran.history()]
    if only:
        known = [s[0] for s in subjects]
        unknown = [x for x in only if x not in known]
        if unknown:
            raise ReplayError(f"--only: {unknown[0]!r} is not a kernel of {h.id} (known: {', '.join(known)})")
        subjects = [s for s in subjects if s[0] in only]
    at, _ = _stamp()
    rows = []
    with nullcontext(pool) if pool is not None else open_pool(cfg, h.target, resolve_device(cfg)) as workers:
        device = torch.device("cuda" if workers.device == "cuda" else "cpu")
        for i, (ref, op, source, then_verdict, record) in enumerate(subjects, 1):
            if then_verdict is None:
                rows.append(VerdictRow(ref=ref, op=op, then=Side(outcome=record.outcome, stage=record.stage,
                                                                 reason=record.reason), change="not evaluated then"))
                continue
            if progress:
                progress(f"replaying {ref} ({i}/{len(subjects)})")
            verdict = evaluate(source, h.target, cfg, workers, until=until, beat=_beat(then_verdict))
            then, now = _side(then_verdict, until), _side(verdict, None)
            rows.append(VerdictRow(ref=ref, op=op, then=then, now=now, change=_change(then, now),
                                   note=_skipped_here(then_verdict, verdict)))
        return Replay(run=h.id, kind="verdicts", at=at, then=ran.where(), now=_here(device), until=until,
                      config_changes=ran.config_changes(cfg), rows=rows)


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


def run_config(cfg: Config, ran: Committed) -> Config:
    """Today's config with the run's own agent and providers settings (where today still has them)."""
    theirs = yaml.safe_load(ran.text("config.yaml", ran.first)) or {}
    raw = cfg.model_dump(mode="json")
    for section in ("agent", "providers"):
        raw[section].update({k: v for k, v in (theirs.get(section) or {}).items() if k in raw[section]})
    raw["providers"]["prices"] = {**cfg.model_dump(mode="json")["providers"]["prices"],
                                  **((theirs.get("providers") or {}).get("prices") or {})}
    raw["agent"].update(ops=list(ran.header.ops), runs_dir=str(ran.root.resolve().parent))
    raw["providers"]["fallback"] = None                 # only the recording answers: never a live provider
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise ReplayError(f"{ran.root}/config.yaml: the run's agent and providers settings do not load today "
                          f"({'.'.join(map(str, err['loc']))}: {err['msg']})") from None


@contextmanager
def _registered(name: str, factory):
    """A proposer entry for the length of one replay (the recorded LLM needs its recording)."""
    before = PROPOSERS.get(name)
    PROPOSERS[name] = factory
    try:
        yield
    finally:
        if before is None:
            PROPOSERS.pop(name, None)
        else:
            PROPOSERS[name] = before


def replay_decisions(root: Path, cfg: Config, view, pool=None) -> Replay:
    """The run again with its recorded LLM (or its built-in proposer) and today's harness, then vs now."""
    ran = Committed(root)
    h, then = ran.header, ran.history()
    if not then:
        raise ReplayError(f"{root}: the run has no candidates; there is no decision to replay")
    merged = run_config(cfg, ran)
    device = resolve_device(merged)
    at, stamp = _stamp()
    scratch_id = f"{root.name}-recorded-{stamp}"
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
        stopped_then = json.loads(ran.text("summary.json")).get("stopped", "")
    except (ReplayError, json.JSONDecodeError):
        stopped_then = ""
    return Replay(run=h.id, kind="decisions", at=at, then=ran.where(), now=_here(device),
                  config_changes=ran.config_changes(merged), decisions=compare_decisions(then, result.history),
                  proposer=what, scratch=str(result.ledger), stopped={"then": stopped_then, "now": result.stop},
                  divergences=recording.divergences if recording else [],
                  unasked=recording.unasked() if recording else [])
