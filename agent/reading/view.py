"""What a person reads in the terminal (rich): a verdict as a table; a run's live view and its summary.

Speeds read kevo over the cuDNN anchor first and over torch second (agent/reading/figures.py); on a machine that
timed nothing, a pass says it is a pass of the correctness stages and that nothing was timed or accepted."""
from __future__ import annotations

import re
import threading
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from harness.records import Verdict

from agent.reading.figures import outcome_words, speed, speed_words
from agent.text import shown

_STYLE = {"passed": "green", "failed": "red", "skipped": "yellow"}


def print_verdict(verdict: Verdict, label: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"{label}: {'ok' if verdict.ok else 'REJECTED'}", show_lines=True)
    for col in ("stage", "status", "seconds", "reason"):
        table.add_column(col, overflow="fold")
    for s in verdict.stages:
        table.add_row(s.name, f"[{_STYLE[s.status]}]{s.status}[/]", f"{s.seconds:.2f}", shown(s.reason))
    console.print(table)
    console.print(shown(verdict.reason))


class RunView:
    """The live view of a run: current claim, activity (the stage in progress), funnel, best, cost.
    On a terminal it redraws in place (rich Live); elsewhere (logs, CI) it prints one line per candidate."""

    def __init__(self, console: Console | None = None, budget_minutes: float = 0.0, provider: str = "") -> None:
        self.console = console or Console()
        self.live: Live | None = None
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.llm_key = ""
        self.fields = {"activity": "", "llm": "", "claim": "", "ledger": "", "funnel": {}, "best": {}, "cost_usd": 0.0,
                       "candidates": 0, "last": "", "untimed": ""}
        self.budget_minutes, self.provider = budget_minutes, provider
        self.since = self.t0

    def __enter__(self) -> "RunView":
        if self.console.is_terminal:
            self.live = Live(self, console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, **fields) -> None:
        with self.lock:
            changed = fields.get("activity", self.fields["activity"]) != self.fields["activity"]
            if changed:
                self.since = time.monotonic()
            self.fields.update(fields)
        if self.live is None and changed:
            self.console.print(shown(f"[{self.since - self.t0:6.1f} s] {fields['activity']}"), soft_wrap=True)
        if self.live is None and fields.get("claim"):
            self.console.print(shown(f"          claim {fields['claim']}"), soft_wrap=True)

    def status(self, text: str) -> None:
        """The live line of an LLM call in flight ("" when none): shown after the activity, redrawn with its
        counters on a terminal; elsewhere printed when it changes other than in its seconds."""
        key = re.sub(r"\d+ s\b", "# s", text)
        with self.lock:
            changed, self.llm_key = key != self.llm_key, key
            self.fields["llm"] = text
        if self.live is None and changed and text:
            self.console.print(shown(f"[{time.monotonic() - self.t0:6.1f} s]   {text}"), soft_wrap=True)

    def record(self, record, summary: dict) -> None:
        fast = speed(record.verdict, record.op)
        figures = f", {fast.words()}" + (f" ({fast.per_shape()})" if fast.per_shape() else "") if fast.timed else ""
        line = (f"{record.id} [{record.op}] {outcome_words(record.outcome, record.stage, record.verdict)}{figures}: "
                f"{record.conclusion.learned}")
        self.update(funnel=summary["funnel"], best=summary["best"], cost_usd=summary["cost_usd"],
                    candidates=summary["candidates"], last=line, claim="", untimed=summary.get("untimed", ""))
        if self.live is None:
            self.console.print(shown(line), soft_wrap=True)

    def __rich__(self) -> Table:
        with self.lock:
            f = dict(self.fields)
        elapsed = (time.monotonic() - self.t0) / 60
        t = Table(title=f"kevo run ({self.provider}): {elapsed:.1f} / {self.budget_minutes:g} min", show_header=False,
                  expand=True)
        t.add_column("what", style="bold", width=12)
        t.add_column("value", overflow="fold")
        t.add_row("now", shown(f"{f['activity']} ({time.monotonic() - self.since:.0f} s)"
                                + (f"; {f['llm']}" if f["llm"] else "")))
        t.add_row("claim", shown(f["claim"] or "-"))
        t.add_row("last", shown(f["last"] or "-"))
        t.add_row("funnel", "  ".join(f"{k} {v}" for k, v in f["funnel"].items() if v) or "-")
        if f["untimed"]:
            t.add_row("timed", shown(f["untimed"]))
        t.add_row("best", shown("  ".join(f"{op}: {b['ref']} {_best(b)}" for op, b in f["best"].items())) or "-")
        t.add_row("cost", f"${f['cost_usd']:.4f} over {f['candidates']} candidates")
        t.add_row("ledger", shown(f["ledger"]))
        return t


def _best(best: dict) -> str:
    """A best kernel's served-mix figures from summary.json (older summaries: only its speedup over torch)."""
    if "vs_cudnn" not in best:
        return "(no timing here)" if best.get("speedup") is None else f"{best['speedup']:.3f}x over torch"
    return speed_words(best)


def print_summary(result, console: Console | None = None) -> None:
    console = console or Console()
    console.print(shown(f"run ended: {result.stop}"), soft_wrap=True)
    t = Table(show_lines=False)
    for col in ("outcome", "candidates"):
        t.add_column(col)
    untimed = getattr(result, "untimed", "")
    for k, v in result.funnel.items():
        if v:
            label = k if k in ("accepted", "malformed", "not-worth-coding", "unevaluated") else f"rejected at {k}"
            if k == "passed":
                label = "passed the correctness stages only (nothing timed)" if untimed else "passed every stage that ran"
            t.add_row(label, str(v))
    console.print(t)
    if untimed:
        console.print(shown(untimed), soft_wrap=True)
    for op, k in result.best.items():
        where = f"{result.ledger}/best/{op}.py" if not k.ref.startswith("head:") else f"{result.ledger}/heads/{op}.py"
        verdict = ("no candidate beat it" if k.ref.startswith("head:") else "the fastest candidate that passed every stage that ran")
        console.print(shown(f"best {op}: {k.ref}, served mix {speed(k.verdict, op).words()} ({verdict}): {where}"),
                      soft_wrap=True)
    if getattr(result, "pace", ""):
        console.print(shown(f"pace: {result.pace}"), soft_wrap=True)
    console.print(shown(f"cost: ${result.cost_usd:.4f}; ledger: {result.ledger} (git log there reads as the run's history)"),
                  soft_wrap=True)
    for line in getattr(result, "providers", []):
        console.print(shown(f"provider {line}"), soft_wrap=True)
    for note in result.not_run:
        console.print(shown(f"not run here: {note}"), soft_wrap=True)
