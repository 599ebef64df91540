"""How fast a run judged, and where its evaluator's time went: candidates an hour of the run, each stage's
share of the stages' time, the slots' waits for their GPU's lease, and the time a GPU was held alone (timing,
or a replay's servers).

Read from the verdicts alone (their stages' `seconds`, and the metrics harness/evaluate.py gives every stage
that ran: `lease_wait_s`, the wait for its grants; `alone_s`, on a GPU, its part that held the GPU alone), so the
end of a run, its summary.md and its report say the same, for any ledger; a verdict from the verdict cache ran
no stage and adds none. Why the GPU is held alone, and what that costs a run's rate: docs/EVALUATOR.md.
Not here: the lease itself (harness/lease.py), how a view lays the words out.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.records import Verdict
from harness.stages import STAGE_NAMES

from agent.records import CandidateRecord, Kernel


@dataclass(frozen=True)
class Pace:
    elapsed_s: float                   # the run's own time, all its sessions
    candidates: int                    # candidates evaluated (each with a verdict)
    from_cache: int                    # of them, those whose verdict came from the verdict cache
    stage_s: dict[str, float] = field(default_factory=dict)   # per stage, its seconds over the verdicts the stages reached
    lease_wait_s: float = 0.0          # the stages' waits for their GPU's lease
    alone_s: float = 0.0               # the stages' time holding a GPU alone (timing, replays)

    @property
    def per_hour(self) -> float | None:
        return self.candidates / (self.elapsed_s / 3600) if self.elapsed_s > 0 else None

    def record(self) -> dict:
        """For summary.json."""
        return {**asdict(self), "per_hour": None if self.per_hour is None else round(self.per_hour, 1)}


def pace(heads: dict[str, Kernel], history: list[CandidateRecord], elapsed_s: float) -> Pace:
    """The run's pace: its candidates over its time, and the stages of every verdict the stages reached (the
    heads' too: they are judged on the run's time)."""
    verdicts: list[Verdict] = [k.verdict for k in heads.values() if k.ref.startswith("head:") and k.verdict]
    verdicts += [rnd.verdict for r in history for rnd in r.rounds]
    stage_s: dict[str, float] = {}
    wait = alone = 0.0
    for s in (s for v in verdicts if v.cached_from is None for s in v.stages):
        stage_s[s.name] = stage_s.get(s.name, 0.0) + s.seconds
        wait += s.metrics.get("lease_wait_s", 0.0)
        alone += s.metrics.get("alone_s", 0.0)
    judged = [r for r in history if r.rounds]
    return Pace(elapsed_s=round(elapsed_s, 1), candidates=len(judged),
                from_cache=sum(r.rounds[-1].verdict.cached_from is not None for r in judged),
                stage_s={k: round(stage_s[k], 1) for k in STAGE_NAMES if k in stage_s},
                lease_wait_s=round(wait, 1), alone_s=round(alone, 1))


def pace_words(p: dict) -> str:
    """One line from a summary's `pace` (`Pace.record()`): '3 candidates in 0.8 min (222 an hour); the stages ran
    46.9 s: compile 2%, dispatch 1%, parity 30%, replay 67%' (a CPU run), and on a GPU '...; they waited W s more
    for their turn on the device (P% of their time); a GPU was held alone A s (Q% of the run's time)'. Over several
    GPUs the time held alone is their sum. A stage, or the waits, under 0.5% of the stages' time is left out."""
    cache = f"{p['from_cache']} from the verdict cache" if p["from_cache"] else ""
    if p["elapsed_s"] > 0:                   # a ledger an older kevo wrote may not say how long it ran
        line = f"{p['candidates']} candidates in {p['elapsed_s'] / 60:.1f} min ({p['per_hour']:.0f} an hour" \
               + (f"; {cache})" if cache else ")")
    else:
        line = f"{p['candidates']} candidates" + (f" ({cache})" if cache else "")
    total = sum(p["stage_s"].values())
    if total > 0:
        line += f"; the stages ran {total:.1f} s: " + ", ".join(
            f"{name} {s / total:.0%}" for name, s in p["stage_s"].items() if s / total >= 0.005)
        if (share := p["lease_wait_s"] / (total + p["lease_wait_s"])) >= 0.005:
            line += f"; they waited {p['lease_wait_s']:.1f} s more for their turn on the device ({share:.0%} of their time)"
    if p["alone_s"] > 0 and p["elapsed_s"] > 0:
        line += f"; a GPU was held alone {p['alone_s']:.1f} s ({p['alone_s'] / p['elapsed_s']:.0%} of the run's time)"
    return line
