"""The ledger as rows: one per candidate — claim, stage reached, verdict, predicted against observed
speedup, the served mix against cuDNN (first) and against torch, conclusion, cost — read from a run's committed files, and shown as a terminal table (rich,
like agent/reading/view.py) or as JSON.

Also finds a run's ledger from what a person types: a path, or a bare run id under the configured
runs folder. Piped, the table keeps its full width. Not here: the HTML report (report), writing the ledger (ledger), judging (conclusion).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from rich import box
from rich.console import Console
from rich.table import Table

from agent.ledger.repository import Ledger, LedgerError
from agent.reading.figures import speed
from agent.records import CandidateRecord, RunHeader
from agent.text import shown

_STYLE = {"accepted": "bold green", "passed": "green", "rejected": "red", "not-worth-coding": "yellow",
          "malformed": "magenta", "unevaluated": "dim"}


class Row(BaseModel):
    """One candidate as a person compares them: what it claimed, how far it got, what it measured."""
    model_config = ConfigDict(extra="forbid")
    id: str
    op: str
    parent: str
    proposer: str
    claim: str                      # the hypothesis, or why there is none (malformed)
    stage: str                      # where it stopped: the failed stage, the last stage passed, or planner/coder/...
    verdict: str                    # the outcome: accepted, passed, rejected, not-worth-coding, malformed, unevaluated
    predicted: float | None         # the claim's expected local speedup s over its parent
    observed: float | None          # measured local speedup over the parent, when both were timed
    vs_cudnn: float | None          # served-mix speed against cuDNN SDPA on equal shapes (microbench), when timed
    speedup: float | None           # served-mix speedup over the torch baseline (microbench), when timed
    kill_test_fired: bool | None
    conclusion: str
    rounds: int
    cost_usd: float
    seconds: float
    started: str


def row(r: CandidateRecord) -> Row:
    return Row(id=r.id, op=r.op, parent=r.parent, proposer=r.proposer,
               claim=r.claim.hypothesis if r.claim else f"(no claim) {r.reason}".strip(), stage=r.stage,
               verdict=r.outcome, predicted=r.claim.expected_speedup if r.claim else None, observed=r.local_speedup,
               vs_cudnn=speed(r.verdict, r.op).mix_vs_cudnn if r.verdict else None, speedup=r.speedup, kill_test_fired=r.conclusion.kill_test_fired, conclusion=r.conclusion.learned,
               rounds=len(r.rounds), cost_usd=r.cost_usd, seconds=r.seconds, started=r.started)


def rows(ledger: Ledger) -> list[Row]:
    return [row(r) for r in ledger.history()]


def find_run(given: str, runs_dir: Path) -> Ledger:
    """The ledger at `given` (a path), else at runs_dir/given (a bare run id); LedgerError, one line, if neither."""
    path = next((p for p in (Path(given), runs_dir / given) if p.is_dir()), None)
    if path is None:
        raise LedgerError(f"no run ledger at {given} (nor under {runs_dir})")
    ledger = Ledger(path)
    ledger.header()                             # not a kevo run: LedgerError now
    return ledger


def x(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


class _Console(Console):
    """rich's console, but a reader gone away (`| head`) is BrokenPipeError, for the command line to end
    quietly with its own exit status (rich's own answer is exit 1)."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def _table(header: RunHeader, items: list[Row]) -> list:
    t = Table(title=shown(f"run {header.id}: {header.target} ({', '.join(header.ops)}), {header.provider} on "
                           f"{header.device} ({header.arch}); {len(items)} candidates"),
              box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, padding=(0, 1))
    for col in ("id", "stage", "verdict", "pred s", "obs s", "cuDNN", "torch", "cost"):
        t.add_column(col, no_wrap=True, justify="left" if col in ("id", "stage", "verdict") else "right")
    t.add_column("claim / conclusion", overflow="fold", min_width=20)
    for r in items:
        t.add_row(f"{shown(r.id)}\n[dim]{shown(r.op)}[/]", shown(r.stage),
                  f"[{_STYLE.get(r.verdict, '')}]{shown(r.verdict)}[/]", x(r.predicted), x(r.observed), x(r.vs_cudnn),
                  x(r.speedup), f"${r.cost_usd:.4f}",
                  f"{shown(r.claim)}\n[dim]» {shown(r.conclusion)}[/]", end_section=True)
    if not items:
        return [t, "no candidates yet"]
    if all(r.speedup is None for r in items):
        return [t, shown(f"no candidate was timed on {header.device}: 'obs s', 'cuDNN' and 'torch' stay empty")]
    return [t]


def print_rows(header: RunHeader, items: list[Row], console: Console | None = None) -> None:
    """The rows as a table on `console`, else on stdout: on a terminal as wide as it is; piped or redirected
    (`| less -S`, `> rows.txt`) as wide as the rows need, where rich would cut every line to 80 columns,
    and without the padding that fills each line to the table's width; COLUMNS, when set, decides."""
    parts = _table(header, items)
    if console is not None or sys.stdout.isatty() or os.environ.get("COLUMNS"):
        console = console or _Console()
        for part in parts:
            console.print(part, soft_wrap=isinstance(part, str))
        return
    wide = Console(width=100_000, color_system=None)
    with wide.capture() as captured:
        for part in parts:
            wide.print(part, soft_wrap=isinstance(part, str))
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
