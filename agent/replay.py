"""Replaying a past run (`kevo-agent replay runs/<id>`): then against now, committed on a branch of its own.

Verdicts (the default): the heads the run started from and every candidate's committed source (its last
round, the one its verdict is for) go through today's stages on this machine with today's config. Each
row is then against now: outcome, stage, speedup (microbench's bar is the one it had then: its
parent's speedup). A change is flagged; a *regression* — a kernel that
passed (or was accepted) then and is rejected now — fails the command (exit 1). A kernel that only loses
a stage this machine cannot run (microbench or replay without CUDA) is flagged as changed, not regressed.
`--until STAGE` cuts both verdicts after that stage; `--only` picks candidates (or `head:<op>`). Each row is
saved as its kernel finishes (agent/replay_progress.py), so a killed replay is continued with `--resume`; with
more than one evaluation slot (config executor) the kernels are judged at once, one per slot.
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
from concurrent.futures import as_completed
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

import git
import torch
import yaml
from pydantic import ValidationError

from harness.config import Config
from harness.errors import HarnessError
from harness.evaluate import evaluate, open_pool, resolve_device
from harness.executors import open_executor
from harness.records import Verdict
from harness.slot import Job
from harness.stages import STAGE_NAMES

from agent.conclusion import outcome_of, speedup_of
from agent.environment import describe
from agent.loop import run, settings_from
from agent.parallel import in_parallel
from agent.proposers import PROPOSERS
from agent.recorded import Recording, recorded_proposer
from agent.records import CandidateRecord, Exchange, Kernel, RunHeader
from agent.replay_progress import Saved, Unfinished, newest, resumed
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


@dataclass(frozen=True)
class _Kernel:
    """One kernel to re-judge: a head or a candidate, with its verdict then (None: never evaluated then)."""
    ref: str
    op: str
    source: str
    then: Verdict | None
    record: CandidateRecord | None = None


def replay_verdicts(root: Path, cfg: Config, pool=None, only: list[str] | None = None, until: str | None = None,
                    progress: Callable[[str], None] | None = None, resume: bool = False) -> Replay:
    """Today's stages on the run's heads and committed candidates. Each kernel's row is saved as it finishes
    (agent/replay_progress.py); `resume` continues the run's newest unfinished replay, its --until and --only
    the saved ones, and evaluates only the kernels it had not finished. With no pool given and more than one
    evaluation slot (config executor), the kernels are judged at once, one per slot (`_verdicts`); otherwise
    one at a time in the pool (opened if none is given). The rows are in the run's order either way.
    The caller commits the result (replay_report.commit_replay), then drops the saved state (replay_progress.finish)."""
    say = progress or (lambda _: None)
    ran = Committed(root)
    h = ran.header
    saved = newest(root)
    if resume and saved is None:
        raise ReplayError(f"{root}: no unfinished verdict replay to resume")
    if saved is not None and not resume:
        say(f"note: the unfinished replay of {saved.state.at} ({len(saved.state.rows)} kernel(s) done) is left as it "
            "is; --resume continues it")
    if pool is not None:
        device = torch.device("cuda" if pool.device == "cuda" else "cpu")
    else:
        device = resolve_device(cfg)
    now, changes = _here(device), ran.config_changes(cfg)
    if resume:
        until, only = resumed(saved, ran.tip.hexsha, now, changes, until, only)
    kernels = [_Kernel(k.ref, k.op, k.source, k.verdict) for k in ran.heads()]
    kernels += [_Kernel(r.id, r.op, r.source, r.verdict, r) for r in ran.history()]
    if only:
        known = [k.ref for k in kernels]
        unknown = [x for x in only if x not in known]
        if unknown:
            raise ReplayError(f"--only: {unknown[0]!r} is not a kernel of {h.id} (known: {', '.join(known)})")
        kernels = [k for k in kernels if k.ref in only]
    if resume:
        rows = saved.done()
        say(f"resuming the replay of {saved.state.at}: {len(rows)} kernel(s) reused from it"
            + (f": {', '.join(rows)}" if rows else ""))
    else:
        saved = Saved.start(root, Unfinished(run=h.id, tip=ran.tip.hexsha, at=_stamp()[0], until=until, only=only,
                                             now=now, config_changes=changes))
        rows = {}
    for k in kernels:
        if k.then is None:
            r = k.record
            rows[k.ref] = VerdictRow(ref=k.ref, op=k.op, then=Side(outcome=r.outcome, stage=r.stage, reason=r.reason),
                                     change="not evaluated then")
    todo = [k for k in kernels if k.ref not in rows]
    number = {k.ref: i for i, k in enumerate(kernels, 1)}

    def tell(k: _Kernel) -> None:
        say(f"replaying {k.ref} ({number[k.ref]}/{len(kernels)})")
    try:
        with closing(_verdicts(todo, h.target, cfg, pool, until, tell)) as verdicts:
            for k, verdict in verdicts:
                then, now_side = _side(k.then, until), _side(verdict, None)
                rows[k.ref] = VerdictRow(ref=k.ref, op=k.op, then=then, now=now_side, change=_change(then, now_side),
                                         note=_skipped_here(k.then, verdict))
                saved.save(rows[k.ref])
    except HarnessError as e:
        kept = f"; the {len(saved.state.rows)} kernel(s) finished are saved, --resume continues" if saved.sha else ""
        raise ReplayError(f"{e}".splitlines()[0] + kept) from None
    return Replay(run=h.id, kind="verdicts", at=saved.state.at, then=ran.where(), now=now, until=until,
                  config_changes=changes, rows=[rows[k.ref] for k in kernels])


def _verdicts(todo: list[_Kernel], target: str, cfg: Config, pool, until: str | None,
              tell: Callable[[_Kernel], None]) -> Iterator[tuple[_Kernel, Verdict]]:
    """Each kernel's verdict as it is reached, each against its own microbench bar (`_beat`). With no pool and
    more than one slot (agent/parallel.in_parallel), every kernel is a job on the executor, which runs one job
    per slot at a time, each slot on a GPU of its own (or a share of the cores): a kernel's replay stage never
    shares a GPU with another's microbench. Otherwise one at a time, in the order given, in the pool."""
    if not todo:
        return
    if pool is None and in_parallel(cfg):
        ex = open_executor(cfg, target)

        def started(k: _Kernel) -> Callable[[str], None]:          # told from a slot's thread as each stage starts
            return lambda stage: tell(k) if stage == STAGE_NAMES[0] else None
        try:
            jobs = {ex.submit(Job(id=k.ref, source=k.source, until=until, beat=_beat(k.then)), on_stage=started(k)): k
                    for k in todo}
            failed: HarnessError | None = None
            for fut in as_completed(jobs):
                try:
                    done = fut.result()
                except HarnessError as e:           # lost too often, or no slot left: the others are still kept
                    failed = failed or e
                    continue
                yield jobs[fut], done.verdict
            if failed is not None:
                raise failed
        finally:
            ex.close()
        return
    with nullcontext(pool) if pool is not None else open_pool(cfg, target, resolve_device(cfg)) as workers:
        for k in todo:
            tell(k)
            yield k, evaluate(k.source, target, cfg, workers, until=until, beat=_beat(k.then))


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
