"""The evaluator role: the staged evaluator (harness) on a proposal, with bounded compile-repair rounds,
and the CandidateRecord that results — outcome, speedups, conclusion, cost.

The stages run in cost order and the full scored replay, where it exists, only after microbench
passed (the harness's driver stops at the first rejection). A candidate the compile stage rejects
goes back to its proposer with the stage's verbatim feedback, at most agent.compile_repair_rounds
times; every round is kept (a repair the run stopped waiting for ends the rounds, not the run). A candidate
accepted against a head that was replaced while it was judged is judged once more against the new one
(`judge_again`; the drive decides when, agent/run/drive.py). Also
evaluates the heads (the reference kernels) a run starts from (through the verdict cache, as every
candidate: harness/verdicts.py), checks the device after a candidate's
worker crashed, hung or hit a CUDA error, and adds up the stage time (the device-time budget).
Not here: choosing what to evaluate (proposers) or recording it (ledger).
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

from harness.config import Config
from harness.errors import HarnessError
from harness.executors import EvaluationLost
from harness.pool import Pool
from harness.slot import device_health
from harness.verdicts import evaluate_cached

from agent.roles.conclusion import conclude, outcome_of, served_over_torch, speedup_of
from agent.knowledge import Catalog, KNOWLEDGE, read_knobs
from agent.llm.providers import ProviderDown, ProviderStop
from agent.records import CandidateRecord, Exchange, Kernel, Proposal, Round
from agent.run.state import found_wrong


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def head_source(catalog: Catalog, target: str, op: str) -> str:
    """The source of the first head of `op`: the file of its head family (config agent.heads, else the reference)."""
    entry, _ = catalog.family(target, op)
    return (KNOWLEDGE / entry.files[0]).read_text()


def others_of(heads: dict[str, str], op: str) -> dict[str, str]:
    """The heads of every op but `op` (op -> source): what both of the replay's arms serve beside a kernel of `op`."""
    return {o: source for o, source in heads.items() if o != op and source}


def evaluate_head(op: str, cfg: Config, target: str, pool: Pool, catalog: Catalog, evaluate_fn=None,
                  other_heads: dict[str, str] | None = None) -> Kernel:
    """`other_heads`: the other ops' heads, served in both arms of its replay (an `evaluate_fn` closes over
    them itself)."""
    entry, _ = catalog.family(target, op)
    source = head_source(catalog, target, op)
    verdict = (evaluate_fn(f"head-{op}", source, 1.0, None) if evaluate_fn
               else evaluate_cached(source, target, cfg, pool, job=f"head-{op}", other_heads=other_heads))
    if found_wrong(verdict):
        raise HarnessError(f"the {op} head (knowledge/{entry.files[0]}) fails its own evaluation: {verdict.reason}")
    return Kernel(ref=f"head:{op}", op=op, path=f"heads/{op}.py", source=source, knobs=read_knobs(source),
                  speedup=speedup_of(verdict), verdict=verdict, served_over_torch=served_over_torch(verdict))


def unevaluated(proposal: Proposal, outcome: str, stage: str, reason: str) -> CandidateRecord:
    """A proposal that never reached the evaluator: malformed, not worth coding, or out of budget."""
    return _record(proposal, outcome, stage, reason, [], proposal.exchanges, None, 0.0, now())


def judge(proposal: Proposal, parent: Kernel, proposer, cfg: Config, target: str,
          pool: Pool, on_stage=None, evaluate_fn=None, head: Kernel | None = None,
          other_heads: dict[str, str] | None = None, bar: Kernel | None = None) -> tuple[CandidateRecord, list[Exchange], str]:
    """The record of an evaluated proposal, every exchange behind it (repairs included), and a
    non-empty message if a provider stopped the run during a repair. `parent`: the kernel it was written from
    (its local speedup is over this one). `bar`: the kernel whose speedup microbench must beat, the op's search
    parent (default: `parent`; they differ when the built-in proposer explores from a slower kernel). `head`: the
    current head of its op, which the replay serves beside it (a reference head is itself judged against torch).
    `other_heads`: the other ops' current heads, which both arms serve (`others_of`; an `evaluate_fn` closes over
    them itself)."""
    started, t0 = now(), time.monotonic()
    rounds, exchanges, source, stop = [], list(proposal.exchanges), proposal.source, ""
    bar = bar if bar is not None else parent
    beat = bar.speedup if bar is not None and bar.speedup else 1.0     # only faster than it is replayed
    against = head.source if head is not None and head.source else None
    evaluate_fn = evaluate_fn or (lambda job, src, bar, hd: evaluate_cached(src, target, cfg, pool, job=job, on_stage=on_stage,
                                                                            beat=bar, head=hd, other_heads=other_heads))
    for round_no in range(cfg.agent.compile_repair_rounds + 1):
        try:
            verdict = evaluate_fn(proposal.id if round_no == 0 else f"{proposal.id}.r{round_no}", source, beat, against)
        except EvaluationLost as e:     # its evaluator died more often than executor.requeue_limit allows
            if not rounds:
                return unevaluated(proposal, "unevaluated", "evaluator", str(e)), exchanges, ""
            break                       # a repair's: the rounds judged stand
        rounds.append(Round(source=source, verdict=verdict, against=head.ref if against else ""))
        if verdict.failed_stage != "compile" or round_no == cfg.agent.compile_repair_rounds:
            break
        try:
            fixed, more = proposer.repair(proposal, source, verdict.stages[-1].reason, round_no + 1)
        except ProviderDown:            # the run is stopping (a signal, the time budget): this round stands
            break
        except ProviderStop as e:
            stop = str(e)
            break
        exchanges += more
        if fixed is None:
            break
        source = fixed
    outcome, stage = outcome_of(rounds[-1].verdict)
    record = _record(proposal, outcome, stage, rounds[-1].verdict.reason, rounds, exchanges, parent,
                     time.monotonic() - t0, started, head)
    return record, exchanges, stop


def judge_again(record: CandidateRecord, exchanges: list[Exchange], proposal: Proposal, parent: Kernel, head: Kernel,
                bar: Kernel, why: str, evaluate_fn) -> CandidateRecord:
    """`record`, accepted against a head that has since been replaced (`why`: state.stale_acceptance), judged once
    more, its accepted source unchanged, against the op's head now (`head`, which its replay serves beside it)
    and the search parent now (`bar`, which microbench must beat). The new round's verdict is the record's; the
    first stays in its rounds. `exchanges`: every exchange behind `record` (its cost). `evaluate_fn(job, source,
    beat, head_source)`, as for `judge`."""
    t0 = time.monotonic()
    beat = bar.speedup if bar.speedup else 1.0
    try:
        verdict = evaluate_fn(f"{proposal.id}.again", record.source, beat, head.source)
    except EvaluationLost as e:     # the first verdict no longer holds and no second one came: not judged
        return _record(proposal, "unevaluated", "evaluator", f"{why}; judging it again was lost: {e}", record.rounds,
                       exchanges, parent, record.seconds + time.monotonic() - t0, record.started, head)
    rounds = [*record.rounds, Round(source=record.source, verdict=verdict, against=head.ref, again=why)]
    outcome, stage = outcome_of(verdict)
    return _record(proposal, outcome, stage, verdict.reason, rounds, exchanges, parent,
                   record.seconds + time.monotonic() - t0, record.started, head)


def device_seconds(heads: dict[str, Kernel], history: list[CandidateRecord]) -> float:
    """The evaluator's stage time: the reference heads' and every evaluated round's (none for a verdict
    given from the verdict cache: its stages ran in an earlier evaluation)."""
    verdicts = [k.verdict for k in heads.values() if k.ref.startswith("head:") and k.verdict]
    verdicts += [rnd.verdict for r in history for rnd in r.rounds]
    return sum(s.seconds for v in verdicts if v.cached_from is None for s in v.stages)


def check_device(record: CandidateRecord, pool: Pool, retry_s: float, say=lambda text: None) -> tuple[dict[str, str], str]:
    """After a candidate whose worker crashed, hung or hit a CUDA error: a known computation in a fresh
    worker, before the next candidate gets the device. The trailer to commit, and a message if the device failed twice (the run
    must stop: its verdicts would mean nothing)."""
    died = next((s for rnd in record.rounds for s in rnd.verdict.stages if s.worker_lost), None)
    if died is None:
        return {}, ""
    how = died.worker_lost
    say(f"checking the {pool.device} after {record.id}'s worker {how} at {died.name}")
    why = device_health(pool.device, pool, retry_s)      # the slots' check (harness/slot.py), its retry included
    if not why:
        return {"Health": f"passed after the worker {how} at {died.name}"}, ""
    line = " ".join(why.split())
    return ({"Health": f"failed after the worker {how} at {died.name}: {line[:200]}"},
            f"the {pool.device} failed its health check after {record.id}'s worker {how}: {line[:300]}; "
            "resume the run once the device is healthy")


def _record(proposal: Proposal, outcome: str, stage: str, reason: str, rounds: list[Round],
            exchanges: list[Exchange], parent: Kernel | None, seconds: float, started: str,
            head: Kernel | None = None) -> CandidateRecord:
    speedup = speedup_of(rounds[-1].verdict) if rounds else None
    local = speedup / parent.speedup if speedup and parent is not None and parent.speedup else None
    conclusion = conclude(proposal.claim, outcome, stage, reason, rounds, proposal.parent, local, head)
    return CandidateRecord(
        id=proposal.id, op=proposal.op, parent=proposal.parent, proposer=proposal.proposer, outcome=outcome,
        stage=stage, reason=reason, claim=proposal.claim, knobs=proposal.knobs, rounds=rounds, speedup=speedup,
        local_speedup=local, conclusion=conclusion, cost_usd=round(sum(e.cost_usd for e in exchanges), 6),
        input_tokens=sum(e.input_tokens for e in exchanges), output_tokens=sum(e.output_tokens for e in exchanges),
        seconds=round(seconds, 3), started=started)
