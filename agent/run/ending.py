"""What a run's end says: `RunResult` (what `run()` hands back), the funnel of its outcomes, the stages that
could not run here and what a pass means on a machine that timed nothing, the heads a later replay found
wrong, and the end commit's summary.md. Pure functions of the heads, the history and the run's summary.
Not here: the summary's figures themselves (Run.summary), the end commit (Run.finish), showing the
result to a person (agent/reading/view.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from harness.stages import STAGE_NAMES

from agent.reading.figures import nothing_timed, speed_words, untimed_pass, untimed_words
from agent.reading.pace import pace_words
from agent.records import CandidateRecord, Kernel
from agent.run.state import wrong_later

FUNNEL = ("malformed", "not-worth-coding", *STAGE_NAMES, "passed", "accepted", "unevaluated")


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
    signal: int = 0                 # the signal that stopped the run, if one did
    providers: list[str] = field(default_factory=list)      # how each LLM provider fared, a line each
    untimed: str = ""               # on a machine that timed nothing: what its passes mean (figures.untimed_words)
    pace: str = ""                  # how fast it judged, and where the evaluator's time went (pace.pace_words)


def funnel(history: list[CandidateRecord]) -> dict[str, int]:
    counts = dict.fromkeys(FUNNEL, 0)
    for r in history:
        key = r.stage if r.outcome == "rejected" else r.outcome
        counts[key] = counts.get(key, 0) + 1
    return counts


def untimed_note(heads: dict[str, Kernel], history: list[CandidateRecord]) -> str:
    """On a machine that timed nothing, what the passes mean (figures.untimed_words); empty otherwise."""
    if not nothing_timed([k.verdict for k in heads.values()] + [r.verdict for r in history]):
        return ""
    return untimed_words(sum(r.outcome == "passed" and untimed_pass(r.verdict) for r in history))


def not_run(heads: dict[str, Kernel], history: list[CandidateRecord]) -> dict[str, str]:
    """The stages that could not run here, each with why, as the verdicts themselves give it (the end
    commit and the report both read this)."""
    seen: dict[str, str] = {}
    for v in [k.verdict for k in heads.values()] + [r.verdict for r in history]:
        for s in v.stages if v else []:
            if s.status == "skipped":
                seen.setdefault(s.name, " ".join(s.reason.split()))
    return seen


def heads_found_wrong(history: list[CandidateRecord]) -> list[str]:
    """Each head a later replay found wrong where it was served (state.wrong_later), a line each: the head, its
    op, the candidate whose replay found it. The run no longer builds on it (state.standing_head)."""
    ops = {r.id: r.op for r in history}
    return [f"{ref}, the {ops[cid]} head, failed its own spot checks in {cid}'s replay (that verdict's reason says "
            f"how): neither the head nor built on from then" for ref, cid in wrong_later(history).items()]


def end_text(run_id: str, stop: str, summary: dict, pending: list[str], fared: list[str], notes: list[str]) -> str:
    """The end commit's message and summary.md: why it stopped, the best per op, the run's pace, any head a later
    replay found wrong, what is left to evaluate, how the LLM providers fared, the stages not run here."""
    best = [f"- {op}: {b['ref']}, {speed_words(b)}" for op, b in summary["best"].items()]
    return "\n".join([f"# {run_id}: ended", "", f"Stopped: {stop}", "",
                      "Best per op (served mix, kevo over the cuDNN anchor first, over torch second):", *best, "",
                      f"Pace: {pace_words(summary['pace'])}", "",
                      *([summary["untimed"], ""] if summary["untimed"] else []),
                      *(["Heads found wrong where served (each gave its place back to the head before it):",
                         *[f"- {line}" for line in summary.get("heads_found_wrong", [])], ""]
                        if summary.get("heads_found_wrong") else []),
                      *([f"Proposed, not yet evaluated (a resumed run evaluates them first): {', '.join(pending)}", ""]
                        if pending else []),
                      *(["LLM providers (all sessions):", *[f"- {line}" for line in fared], ""] if fared else []),
                      "Stages not run here:", *([f"- {n}" for n in notes] or ["- none"]), ""])
