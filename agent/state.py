"""What a proposer is shown: the run's evidence so far, as one value (a snapshot, safe to hand to the
proposing thread), and how the kernel each op builds on is chosen from it.

Not here: deciding what to try (offline, planner), or keeping it (ledger: everything in a snapshot
is also in the run's git history).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agent.records import CandidateRecord, Kernel, Profile, Proposal

CORRECTNESS_STAGES = ("compile", "dispatch", "parity")


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


def _as_kernel(r: CandidateRecord) -> Kernel:
    return Kernel(ref=r.id, op=r.op, path=f"candidates/{r.id}/candidate.py", source=r.source or "",
                  knobs=r.knobs, speedup=r.speedup, verdict=r.verdict)


def _fastest(head: Kernel, records) -> Kernel:
    best = head
    for r in records:
        if best.speedup is None or r.speedup > best.speedup:
            best = _as_kernel(r)
    return best


def search_parent(op: str, head: Kernel, history: list[CandidateRecord]) -> Kernel:
    """What the next candidate of `op` starts from: the fastest correct kernel timed so far (a candidate
    that microbench rejected as not beating torch still counts), else the head."""
    return _fastest(head, [r for r in history if r.op == op and r.speedup is not None and r.verdict is not None
                           and r.verdict.failed_stage not in CORRECTNESS_STAGES])


def best_kernel(op: str, head: Kernel, history: list[CandidateRecord]) -> Kernel:
    """The best so far: the fastest kernel of `op` that passed every stage that ran, else the head."""
    return _fastest(head, [r for r in history if r.op == op and r.outcome in ("passed", "accepted")
                           and r.speedup is not None])
