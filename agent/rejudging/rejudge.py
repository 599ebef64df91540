"""Re-judging a past run (`kevo-agent replay runs/<id>`, the default): its kernels judged by today's harness.

The heads the run started from and every candidate's committed source (its last round, the one its
verdict is for) go through today's stages on this machine with today's config. Each row is then against
now: outcome, stage, speedup (microbench's bar is the one it had then: its parent's speedup). A change is
flagged; a *regression* — a kernel that passed (or was accepted) then and is rejected now — fails the
command (exit 1). A kernel that only loses a stage this machine cannot run (microbench or replay without
CUDA) is flagged as changed, not regressed. `--until STAGE` cuts both verdicts after that stage; `--only`
picks candidates (or `head:<op>`). Each row is saved as its kernel finishes (agent/rejudging/progress.py), so
a killed re-judging is continued with `--resume`; with more than one evaluation slot (config executor) the
kernels are judged at once, one per slot. Not here: reading the run (agent/ledger/repository.py's `Ledger`, pinned),
committing the comparison (agent/rejudging/report.py), judging (harness).
"""
from __future__ import annotations

from concurrent.futures import as_completed
from contextlib import closing, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from harness.config import Config
from harness.errors import HarnessError
from harness.evaluate import evaluate, open_pool, resolve_device
from harness.executors import open_executor
from harness.records import Verdict
from harness.slot import Job
from harness.stages import STAGE_NAMES

from agent.roles.conclusion import outcome_of, speedup_of
from agent.roles.evaluator import others_of
from agent.run.evaluators import in_parallel
from agent.run.state import wrong_later
from agent.records import CandidateRecord
from agent.ledger.repository import Ledger
from agent.rejudging.rerun import RejudgeError, config_changes, here, ran_on, stamp
from agent.rejudging.progress import Saved, Unfinished, newest, receipts_of, resumed
from agent.rejudging.report import Rejudging, Side, VerdictRow

_OK = ("passed", "accepted")


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
    """One kernel to re-judge: a head or a candidate, with its verdict then (None: never evaluated then), and
    what its replay serves beside it, as the run did: the head of its op it is judged against (None: torch's,
    a head's own) and the other ops' heads (`served_as_then`)."""
    ref: str
    op: str
    source: str
    then: Verdict | None
    record: CandidateRecord | None = None
    head: str | None = None
    other_heads: dict[str, str] = field(default_factory=dict)


def kernels_of(ran: Ledger) -> list[_Kernel]:
    """The run's heads at its start, then its candidates in order, each with what its replay served then."""
    started, history = ran.heads(at_start=True), ran.history()
    served = served_as_then({op: k.source for op, k in started.items()}, history)
    kernels = [_Kernel(k.ref, k.op, k.source, k.verdict, None, *served[k.ref]) for k in started.values()]
    return kernels + [_Kernel(r.id, r.op, r.source, r.verdict, r, *served[r.id]) for r in history]


def served_as_then(heads: dict[str, str], history: list[CandidateRecord]) -> dict[str, tuple[str | None, dict[str, str]]]:
    """Per kernel ref, the head its replay was judged against and the other ops' heads served beside it, in the
    run's order: the heads it started from (`heads`, op -> source) judged against torch, beside each other; each
    candidate against its op's head at the time, the other ops' beside it; an accepted candidate its op's head
    from then on, until a later replay finds it wrong and the head before it is again (agent/run/drive.py serves
    a candidate so; state.standing_head)."""
    out: dict[str, tuple[str | None, dict[str, str]]] = {f"head:{op}": (None, others_of(heads, op)) for op in heads}
    current, chains, wrong = dict(heads), {op: [(f"head:{op}", source)] for op, source in heads.items()}, {}
    for r in history:
        out[r.id] = (current.get(r.op), others_of(current, r.op))
        if r.outcome == "accepted" and r.source:
            chains.setdefault(r.op, []).append((r.id, r.source))
        wrong |= wrong_later([r])                   # what the run knew once r was recorded
        standing = next((source for ref, source in reversed(chains.get(r.op, [])) if ref not in wrong), None)
        if standing is not None:
            current[r.op] = standing
    return out


def rejudge(root: Path, cfg: Config, pool=None, only: list[str] | None = None, until: str | None = None,
            progress: Callable[[str], None] | None = None, resume: bool = False) -> Rejudging:
    """Today's stages on the run's heads and committed candidates. Each kernel's row is saved as it finishes
    (agent/rejudging/progress.py); `resume` continues the run's newest unfinished re-judging, its --until and --only
    the saved ones, and evaluates only the kernels it had not finished. With no pool given and more than one
    evaluation slot (config executor), the kernels are judged at once, one per slot (`_verdicts`); otherwise
    one at a time in the pool (opened if none is given). The rows are in the run's order either way.
    The caller commits the result (report.commit_rejudging), then drops the saved state (progress.finish)."""
    say = progress or (lambda _: None)
    ran = Ledger(root, pinned=True)
    h = ran.header()
    receipts = receipts_of(cfg)
    saved = newest(root, receipts)
    if resume and saved is None:
        raise RejudgeError(f"{root}: no unfinished re-judging to resume")
    if saved is not None and not resume:
        say(f"note: the unfinished re-judging of {saved.state.at} ({len(saved.state.rows)} kernel(s) done) is left as it "
            "is; --resume continues it")
    if pool is not None:
        device = torch.device("cuda" if pool.device == "cuda" else "cpu")
    else:
        device = resolve_device(cfg)
    now, changes = here(device), config_changes(ran, cfg)
    if resume:
        until, only = resumed(saved, ran.tip.hexsha, now, changes, until, only)
    kernels = kernels_of(ran)
    if only:
        known = [k.ref for k in kernels]
        unknown = [x for x in only if x not in known]
        if unknown:
            raise RejudgeError(f"--only: {unknown[0]!r} is not a kernel of {h.id} (known: {', '.join(known)})")
        kernels = [k for k in kernels if k.ref in only]
    if resume:
        rows = saved.done()
        say(f"resuming the re-judging of {saved.state.at}: {len(rows)} kernel(s) reused from it"
            + (f": {', '.join(rows)}" if rows else ""))
    else:
        saved = Saved.start(root, Unfinished(run=h.id, tip=ran.tip.hexsha, at=stamp()[0], until=until, only=only,
                                             now=now, config_changes=changes), receipts)
        rows = {}
    for k in kernels:
        if k.then is None:
            r = k.record
            rows[k.ref] = VerdictRow(ref=k.ref, op=k.op, then=Side(outcome=r.outcome, stage=r.stage, reason=r.reason),
                                     change="not evaluated then")
    todo = [k for k in kernels if k.ref not in rows]
    number = {k.ref: i for i, k in enumerate(kernels, 1)}

    def tell(k: _Kernel) -> None:
        say(f"re-judging {k.ref} ({number[k.ref]}/{len(kernels)})")
    try:
        with closing(_verdicts(todo, h.target, cfg, pool, until, tell)) as verdicts:
            for k, verdict in verdicts:
                then, now_side = _side(k.then, until), _side(verdict, None)
                rows[k.ref] = VerdictRow(ref=k.ref, op=k.op, then=then, now=now_side, change=_change(then, now_side),
                                         note=_skipped_here(k.then, verdict))
                saved.save(rows[k.ref])
    except HarnessError as e:
        kept = f"; the {len(saved.state.rows)} kernel(s) finished are saved, --resume continues" if saved.sha else ""
        raise RejudgeError(f"{e}".splitlines()[0] + kept) from None
    return Rejudging(run=h.id, kind="verdicts", at=saved.state.at, then=ran_on(ran), now=now, until=until,
                     config_changes=changes, rows=[rows[k.ref] for k in kernels])


def _verdicts(todo: list[_Kernel], target: str, cfg: Config, pool, until: str | None,
              tell: Callable[[_Kernel], None]) -> Iterator[tuple[_Kernel, Verdict]]:
    """Each kernel's verdict as it is reached, each against its own microbench bar (`_beat`). With no pool and
    more than one slot (agent/run/evaluators.py:in_parallel), every kernel is a job on the executor, which runs one job
    per slot at a time, each slot on a GPU of its own (or a share of the cores): a kernel's replay stage never
    shares a GPU with another's microbench, judged afresh (`Job.fresh`: whether a verdict reproduces is the question,
    so the verdict cache is not read). Otherwise one at a time, in the order given, in the pool."""
    if not todo:
        return
    if pool is None and in_parallel(cfg):
        ex = open_executor(cfg, target)

        def started(k: _Kernel) -> Callable[[str], None]:          # told from a slot's thread as each stage starts
            return lambda stage: tell(k) if stage == STAGE_NAMES[0] else None
        try:
            jobs = {ex.submit(Job(id=k.ref, source=k.source, until=until, beat=_beat(k.then), head=k.head,
                                  other_heads=k.other_heads, fresh=True), on_stage=started(k)): k
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
            yield k, evaluate(k.source, target, cfg, workers, until=until, beat=_beat(k.then), head=k.head,
                              other_heads=k.other_heads)
