"""How a re-judging (or a re-run of decisions) is written down: its records (then/now rows), the README
table, the terminal table, and the commit on a branch of its own (`replay/<UTC time>-<device>`) in the run.

The commit is built from git objects with an in-memory index, on top of the run's tip: the run's branch,
its .git/index and its working tree are left exactly as they were.
Not here: making the comparison (rejudge, rerun).
"""
from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import Field

from agent.ledger.messages import fit_subject
from agent.ledger.repository import Ledger
from agent.llm.recorded import Divergence
from agent.records import Record
from agent.text import shown


class Side(Record):
    """One verdict, then or now: where the kernel stopped and what it measured."""
    outcome: str
    stage: str
    speedup: float | None = None
    reason: str = ""


class VerdictRow(Record):
    ref: str                        # head:<op> or a candidate id
    op: str
    then: Side
    now: Side | None = None         # None: never evaluated then (malformed, not worth coding, out of budget)
    change: Literal["same", "regressed", "now passes", "changed", "not evaluated then"]
    note: str = ""


class Decision(Record):
    """What the loop decided for one candidate: its claim, and what became of it."""
    op: str
    expected_speedup: float | None
    outcome: str
    stage: str
    hypothesis: str = ""


class DecisionRow(Record):
    id: str
    then: Decision | None
    now: Decision | None
    differs: list[str]              # the fields that differ; empty: the decision was reproduced
    note: str = ""


class Rejudging(Record):
    """A whole re-judging or re-run, as committed (replay/replay.json) and printed with --json."""
    run: str
    kind: Literal["verdicts", "decisions"]
    at: str                                             # UTC
    then: dict[str, str]                                # device, gpu, kevo_commit of the run
    now: dict[str, str]                                 # the same, here and today
    until: str | None = None
    config_changes: list[str] = Field(default_factory=list)   # harness settings: the run's -> today's
    rows: list[VerdictRow] = Field(default_factory=list)
    decisions: list[DecisionRow] = Field(default_factory=list)
    proposer: str = ""                                  # decisions: what answered
    scratch: str = ""                                   # decisions: the scratch ledger
    stopped: dict[str, str] = Field(default_factory=dict)   # decisions: why the run ended, then and now
    divergences: list[Divergence] = Field(default_factory=list)
    unasked: list[str] = Field(default_factory=list)
    branch: str = ""

    @property
    def what(self) -> str:
        """Its name in prose: re-judging the run's kernels, or re-running its decisions."""
        return "re-judging" if self.kind == "verdicts" else "re-run of decisions"

    @property
    def failures(self) -> list[str]:
        """What fails the command: regressions, or decisions that differ."""
        return ([r.ref for r in self.rows if r.change == "regressed"]
                + [d.id for d in self.decisions if d.differs])


def _side_text(s: Side | None) -> str:
    if s is None:
        return "-"
    return f"{s.outcome} at {s.stage}" + (f", {s.speedup:.3f}x" if s.speedup is not None else "")


def _decision_text(d: Decision | None) -> str:
    if d is None:
        return "-"
    s = "n/a" if d.expected_speedup is None else f"{d.expected_speedup:.3f}"
    return f"[{d.op}] s {s}: {d.outcome} at {d.stage}"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(r: Rejudging) -> str:
    lines = [f"# {r.what.capitalize()} of {r.run}, {r.at}", "",
             f"Then: {r.then['device']} ({r.then['gpu']}), kevo {r.then['kevo_commit']}.",
             f"Now: {r.now['device']} ({r.now['gpu']}), kevo {r.now['kevo_commit']}."]
    if r.until:
        lines.append(f"Both verdicts cut after the {r.until} stage.")
    lines += ["", "Harness settings changed since the run:", *([f"- {c}" for c in r.config_changes] or ["- none"]), ""]
    if r.kind == "verdicts":
        lines += ["| kernel | op | then | now | change | note |", "|---|---|---|---|---|---|"]
        lines += [f"| {x.ref} | {x.op} | {_cell(_side_text(x.then))} | {_cell(_side_text(x.now))} | "
                  f"{'**' + x.change + '**' if x.change not in ('same', 'not evaluated then') else x.change} | "
                  f"{_cell(x.note)} |" for x in r.rows]
    else:
        lines += [f"Proposer: {r.proposer}. Scratch ledger: {r.scratch}.",
                  f"Stopped then: {r.stopped.get('then') or 'unknown'}; now: {r.stopped.get('now')}.", "",
                  "| candidate | then | now | differs | note |", "|---|---|---|---|---|"]
        lines += [f"| {d.id} | {_cell(_decision_text(d.then))} | {_cell(_decision_text(d.now))} | "
                  f"{'**' + ', '.join(d.differs) + '**' if d.differs else 'same'} | {_cell(d.note)} |"
                  for d in r.decisions]
        lines += ["", "Prompts that differ from the recorded ones (the recorded reply was given):",
                  *([f"- {d.candidate} {d.role} ({d.purpose}): {d.what}" for d in r.divergences] or ["- none"]),
                  "", "Recorded exchanges never asked for:", *([f"- {u}" for u in r.unasked] or ["- none"])]
    lines += ["", f"Result: {verdict_line(r)}", ""]
    return "\n".join(lines)


def verdict_line(r: Rejudging) -> str:
    fails = ", ".join(r.failures)
    if r.kind == "verdicts":
        counts = {c: sum(x.change == c for x in r.rows) for c in ("same", "changed", "now passes", "regressed")}
        line = (f"{sum(counts.values())} kernels re-judged: {counts['same']} same, {counts['changed']} changed, "
                f"{counts['now passes']} now pass, {counts['regressed']} no longer pass")
        skipped = len(r.rows) - sum(counts.values())
        line += f" ({skipped} not evaluated then)" if skipped else ""
        return line + (f": {fails}" if fails else "")
    return (f"{len(r.decisions)} decisions: {len(r.decisions) - len(r.failures)} reproduced, {len(r.failures)} differ"
            + (f": {fails}" if fails else ""))


def print_rejudging(r: Rejudging, console) -> None:
    """The comparison as a table, changes in colour, and where it was committed."""
    from rich.table import Table
    t = Table(title=shown(f"{r.what} of {r.run}: then on {r.then.get('device')}, now on {r.now.get('device')}"))
    if r.kind == "verdicts":
        for col in ("kernel", "then", "now", "change", "note"):
            t.add_column(col, overflow="fold")
        for x in r.rows:
            style = {"regressed": "red", "changed": "yellow", "now passes": "cyan"}.get(x.change, "")
            t.add_row(shown(x.ref), shown(_side_text(x.then)), shown(_side_text(x.now)),
                      f"[{style}]{shown(x.change)}[/]" if style else shown(x.change), shown(x.note))
    else:
        for col in ("candidate", "then", "now", "differs", "note"):
            t.add_column(col, overflow="fold")
        for d in r.decisions:
            t.add_row(shown(d.id), shown(_decision_text(d.then)), shown(_decision_text(d.now)),
                      f"[red]{shown(', '.join(d.differs))}[/]" if d.differs else "same", shown(d.note))
    console.print(t)
    lines = [f"harness setting changed: {c}" for c in r.config_changes]
    if r.kind == "decisions":
        lines += [f"proposer: {r.proposer}", f"stopped then: {r.stopped.get('then')}; now: {r.stopped.get('now')}",
                  f"scratch ledger: {r.scratch}"]
        lines += [f"prompt differs, recorded reply given: {d.candidate} {d.role} ({d.purpose}): {d.what}"
                  for d in r.divergences] + [f"never asked: {u}" for u in r.unasked]
    lines += [f"result: {verdict_line(r)}", f"committed on branch {r.branch or '(not committed)'}"]
    for line in lines:
        console.print(shown(line), soft_wrap=True)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def commit_rejudging(root: Path, r: Rejudging) -> Rejudging:
    """Commit the comparison on a branch of its own on top of the run's tip; the run's branch, index and
    working tree are left as they are (Ledger.commit_beside: built from objects, with an index of its own)."""
    ledger = Ledger(root)
    repo = ledger.repo
    device = r.now["device"] if r.now["device"] != "cuda" else _slug(r.now["gpu"])
    name = f"replay/{datetime.fromisoformat(r.at).strftime('%Y%m%dT%H%M%SZ')}-{device}"
    name += "-llm-recorded" if r.kind == "decisions" else ""
    existing = {h.name for h in repo.heads}
    unique, n = name, 1
    while unique in existing:
        n += 1
        unique = f"{name}-{n}"
    r = r.model_copy(update={"branch": unique})
    subject = fit_subject(f"{r.what} of {r.run} on {device}: {verdict_line(r)}")   # the whole line is in the body
    trailers = {"Replay": r.kind, "Run": r.run, "Device": device, "Failures": len(r.failures),
                "Kevo-Commit": r.now["kevo_commit"]}
    commit = ledger.commit_beside({"replay/replay.json": r.model_dump_json(indent=1), "replay/README.md": markdown(r)},
                                  subject, markdown(r), trailers)
    repo.create_head(unique, commit)
    return r

