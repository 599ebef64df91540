"""The conclusion role: after the verdict, what was learned — in a sentence or two the next planner
reads — whether the kill test fired, predicted against observed speedup, and, where the full replay
scored it, the served gain against the ceiling the profile gave for microbench's speedup, and where the
candidate stands against torch in serving (`served_over_torch`: chained through its head's own replay).

Written by code from the record, never by a model: a conclusion is a reading of the evidence, and the
same evidence must always read the same way. Not here: the verdict itself (harness).
"""
from __future__ import annotations

import math

from harness.amdahl import ceiling
from harness.records import StageResult, Verdict

from agent.records import Claim, Conclusion, Kernel, Outcome, Round

_SPEED_STAGES = ("microbench", "replay")


def outcome_of(verdict: Verdict) -> tuple[Outcome, str]:
    """(outcome, stage): the failed stage, or the last stage that ran and passed."""
    if verdict.failed_stage:
        return "rejected", verdict.failed_stage
    ran = [s.name for s in verdict.stages if s.status == "passed"]
    return ("accepted" if verdict.accepted else "passed"), (ran[-1] if ran else "none")


def speedup_of(verdict: Verdict | None) -> float | None:
    """The served-mix speedup over the torch baseline, if microbench measured one."""
    for s in verdict.stages if verdict else []:
        if s.name == "microbench" and "speedup" in s.metrics:
            return s.metrics["speedup"]
    return None


def _kill_fired(claim: Claim, verdict: Verdict, observed: float | None) -> bool | None:
    stage = next((s for s in verdict.stages if s.name == claim.kill_test.stage), None)
    if stage is None or stage.status == "skipped":
        return None                                     # its stage was not reached, or cannot run here
    if stage.status == "failed":
        return True
    if claim.kill_test.stage in _SPEED_STAGES:
        return None if observed is None else observed <= 1.0
    return False


def _replay(verdict: Verdict | None) -> StageResult | None:
    """The replay stage of a verdict, when it measured a paired gain with its gates passed."""
    return next((s for s in verdict.stages if s.name == "replay" and "gain" in s.metrics
                 and s.metrics.get("gate_passed") == 1.0 and math.isfinite(s.metrics["gain"])), None) if verdict else None


def served_over_torch(verdict: Verdict | None, head: Kernel | None = None) -> float | None:
    """The served step's gain over torch's for the kernel of `verdict`: measured, when its replay's head was
    torch; else its gain over `head` (the head it was served beside) chained with that head's own figure,
    (1 + g)(1 + g_head) - 1: two replays apart, on different draws, not side by side. None when either is unknown."""
    replay = _replay(verdict)
    if replay is None:
        return None
    gain = replay.metrics["gain"]
    if replay.metrics.get("head_is_torch"):
        return gain
    if head is None or head.served_over_torch is None:
        return None
    return (1 + gain) * (1 + head.served_over_torch) - 1


def _served(claim: Claim | None, verdict: Verdict, head: Kernel | None) -> str:
    """The replay's paired gain over the head it was served beside (torch's when it had none), set against
    Amdahl's ceiling for microbench's speedup on the claim's op share: how much of the local gain reached
    the served step; and, against a head, the standing against torch chained through the head's own replay."""
    replay = next((s for s in verdict.stages if s.name == "replay" and "gain" in s.metrics), None)
    if replay is None:
        return ""
    m = replay.metrics
    over = "torch" if m.get("head_is_torch") else "its head"
    text = (f"; served over {over}: {m['gain']:+.1%} (lower bound {m.get('gain_lower', float('nan')):+.1%}), "
            f"p90 TPOT {m.get('tpot_p90_speedup', float('nan')):.2f}x")
    local = speedup_of(verdict)
    if claim is not None and local:
        text += f" against a ceiling of {ceiling(claim.op_share, local):.2f}x for {local:.2f}x on f {claim.op_share:.2f}"
    chained = None if m.get("head_is_torch") else served_over_torch(verdict, head)
    if chained is not None:
        text += (f"; over torch {chained:+.1%} (chained: {head.ref} served {head.served_over_torch:+.1%} against "
                 "torch in its own replay)")
    return text


def _first(text: str, n: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= n else line[: n - 1] + "…"


def _why(reason: str) -> str:
    """The gist of a skip reason: 'skipped: needs CUDA; this machine ...' -> 'needs CUDA'."""
    return _first(reason.removeprefix("skipped:").strip().split(";")[0].split(". ")[0], 60)


def conclude(claim: Claim | None, outcome: str, stage: str, reason: str, rounds: list[Round],
             parent_ref: str, observed: float | None, head: Kernel | None = None) -> Conclusion:
    """`head`: the head the replay served beside the candidate (its standing against torch is chained through it)."""
    predicted = claim.expected_speedup if claim else None
    if not rounds:
        return Conclusion(learned=_first(reason, 240), kill_test_fired=None, predicted=predicted, observed=None)
    verdict = rounds[-1].verdict
    repairs = sum(1 for rnd in rounds[1:] if not rnd.again)
    repaired = f" after {repairs} compile repair round(s)" if repairs else ""
    if outcome == "rejected":
        failed = next(s for s in verdict.stages if s.name == verdict.failed_stage)
        learned = _first(failed.reason) + repaired
    else:
        learned = f"correct on every served and boundary shape{repaired}"
    if observed is not None:
        learned += f"; measured {observed:.3f}x over {parent_ref}" + (f" (predicted {predicted:.3f}x)" if predicted else "")
    elif outcome != "rejected":
        skipped = [f"{s.name} skipped: {_why(s.reason)}" for s in verdict.stages if s.status == "skipped"]
        learned += "; speed not measured here" + (f" ({', '.join(skipped)})" if skipped else "")
    learned += _served(claim, verdict, head)
    if rounds[-1].again:
        learned += f"; judged again, its first verdict (accepted) against a replaced head: {rounds[-1].again}"
    fired = _kill_fired(claim, verdict, observed) if claim else None
    if fired is not None:
        learned += f"; kill test ({claim.kill_test.stage}) {'fired' if fired else 'did not fire'}"
    return Conclusion(learned=learned, kill_test_fired=fired, predicted=predicted, observed=observed)

