"""What a proposer is shown: the run's evidence so far, as one value (a snapshot, safe to hand to the
proposing thread), and how the kernel each op builds on is chosen from it.

Not here: deciding what to try (offline, planner), or keeping it (ledger: everything in a snapshot
is also in the run's git history).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from harness.records import Verdict

from agent.records import CandidateRecord, Kernel, Profile, Proposal
from agent.roles.conclusion import served_over_torch

CORRECTNESS_STAGES = ("compile", "dispatch", "parity")
# How a replay fails when it finds the kernel wrong or not its own where served (harness/records.py FailureKind),
# rather than slow: its spot checks or token gates, or its served calls computing elsewhere.
WRONG_WHEN_SERVED = ("wrong_output", "library_ops")


def found_wrong(verdict: Verdict | None) -> bool:
    """Whether `verdict` found its kernel wrong: a correctness stage failed, or the replay (which runs after
    microbench has timed it) found it wrong when served. Such a kernel's speedup is no evidence to build on: it
    is never a search parent, a beam's kernel or a family's measurement, and its step is a rejected region."""
    if verdict is None or verdict.failed_stage is None:
        return False
    failed = next((s for s in verdict.stages if s.name == verdict.failed_stage), None)
    return verdict.failed_stage in CORRECTNESS_STAGES or (failed is not None and failed.failure in WRONG_WHEN_SERVED)


def wrong_later(history: list[CandidateRecord]) -> dict[str, str]:
    """Each head a later replay found wrong where it was served beside a candidate (the head's own spot checks,
    harness/served/accounting.py `spot_checks`): its ref -> the first candidate whose replay found it. Its own
    verdict passed, so `found_wrong` cannot see it; it is built on no more than a kernel `found_wrong` names."""
    out: dict[str, str] = {}
    for r in history:
        for rnd in r.rounds:
            replay = next((s for s in rnd.verdict.stages if s.name == "replay"), None)
            if replay is not None and replay.metrics.get("head_spot_failed_ops", 0) > 0 and rnd.against:
                out.setdefault(rnd.against, r.id)
    return out


def standing_head(op: str, start: Kernel, history: list[CandidateRecord]) -> Kernel | None:
    """The head of `op` now: of the run's first head and each candidate accepted since, the last that no later
    replay found wrong (`wrong_later`); None when every one of them was. A head found wrong gives its place
    back to the one it replaced, and the ledger's heads/ says so from that candidate's commit on."""
    wrong, chain = wrong_later(history), [start]
    for r in history:
        if r.op == op and r.outcome == "accepted":
            against = r.rounds[-1].against if r.rounds else ""
            then = next((k for k in reversed(chain) if k.ref == against), chain[-1])
            chain.append(_as_kernel(r).model_copy(update={"served_over_torch": served_over_torch(r.verdict, then)}))
    return next((k for k in reversed(chain) if k.ref not in wrong), None)


@dataclass(frozen=True)
class ProposalState:
    next_id: str
    ops: list[str]
    history: list[CandidateRecord]          # every candidate so far, in order, rejections included
    heads: dict[str, Kernel]                # per op: the reference kernel, or the last accepted one
    parents: dict[str, Kernel]              # per op: what the next candidate starts from
    profile: Profile
    min_ceiling: float
    pending: list[Proposal] = field(default_factory=list)   # proposed, not yet judged
    explore: bool = False                   # agent.explore: measure untried steps once none is worth coding


def _as_kernel(r: CandidateRecord) -> Kernel:
    return Kernel(ref=r.id, op=r.op, path=f"candidates/{r.id}/candidate.py", source=r.source or "",
                  knobs=r.knobs, speedup=r.speedup, verdict=r.verdict)


def kernel_of(ref: str, heads: dict[str, Kernel], history: list[CandidateRecord]) -> Kernel | None:
    """The kernel a proposal names as its parent: a head (the reference `head:<op>` or an accepted candidate),
    else a candidate of the run that was timed and not found wrong (`found_wrong`, `wrong_later`); None if the
    run has no such kernel (a proposal naming one it may not build on, as an LLM's may, is then judged from its
    op's bar)."""
    for k in heads.values():
        if k.ref == ref:
            return k
    wrong = wrong_later(history)
    return next((_as_kernel(r) for r in history if r.id == ref and r.speedup is not None
                 and not found_wrong(r.verdict) and r.id not in wrong), None)


def _fastest(head: Kernel, records) -> Kernel:
    best = head
    for r in records:
        if best.speedup is None or r.speedup > best.speedup:
            best = _as_kernel(r)
    return best


def noise_band(r: CandidateRecord) -> float:
    """The noise microbench measured while timing `r` (its worst case's two baselines apart), 0 if none."""
    bench = next((s for s in r.verdict.stages if s.name == "microbench"), None) if r.verdict else None
    noise = bench.metrics.get("noise", 0.0) if bench is not None else 0.0
    return noise if noise == noise else float("inf")           # a NaN band: nothing clears it


def search_parent(op: str, head: Kernel, history: list[CandidateRecord], min_margin: float) -> Kernel:
    """What the next candidate of `op` starts from. From the head, in the order they were judged, a correct
    timed kernel (a candidate that microbench rejected as not beating torch still counts; one the replay found
    wrong when served does not) replaces the parent only when its served-mix speedup over torch beats the
    parent's by more than the noise band microbench measured for it, and at least `min_margin`
    (stages.microbench.min_margin): a step inside the noise is chance, not a better kernel to build on."""
    parent, wrong = head, wrong_later(history)
    for r in history:
        if r.op != op or r.speedup is None or r.verdict is None or found_wrong(r.verdict) or r.id in wrong:
            continue
        if parent.speedup is None or r.speedup > parent.speedup * (1 + max(noise_band(r), min_margin)):
            parent = _as_kernel(r)
    return parent


def stale_acceptance(record: CandidateRecord, head: Kernel | None) -> str:
    """Why an accepted `record` must be judged again before it may become its op's head: the head its replay
    served beside it (its last round's `against`) was replaced by `head` while it was judged (two candidates of
    one op in flight, the earlier one accepted), so nothing has measured it against the kernel it would replace.
    Empty when it stands: not accepted, or the head did not move."""
    against = record.rounds[-1].against if record.rounds else ""
    if record.outcome != "accepted" or not against or head is None or head.ref == against:
        return ""
    return f"{head.ref} became the {record.op} head while it was judged against {against}"


def head_changes(heads: dict[str, Kernel], history: list[CandidateRecord]) -> list[tuple[str, str, str]]:
    """Each head change of a run, in order, from its first heads (`heads`) and its records: (the accepted
    candidate, the head it replaced, the head its accepted round was judged against; empty where a ledger
    from before rounds named it). Where the last two differ, a kernel became the head unmeasured against the
    one it replaced."""
    now, out = {op: k.ref for op, k in heads.items()}, []
    for r in history:
        if r.outcome == "accepted" and r.op in now:
            out.append((r.id, now[r.op], r.rounds[-1].against if r.rounds else ""))
            now[r.op] = r.id
    return out


def best_kernel(op: str, head: Kernel, history: list[CandidateRecord]) -> Kernel:
    """The best so far: the fastest kernel of `op` that passed every stage that ran and that no later replay
    found wrong, else the head."""
    wrong = wrong_later(history)
    return _fastest(head, [r for r in history if r.op == op and r.outcome in ("passed", "accepted")
                           and r.speedup is not None and r.id not in wrong])
