"""What a person reads in the terminal: a verdict as a table (rich)."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.records import Verdict

_STYLE = {"passed": "green", "failed": "red", "skipped": "yellow"}


def print_verdict(verdict: Verdict, label: str, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"{label}: {'ok' if verdict.ok else 'REJECTED'}", show_lines=True)
    for col in ("stage", "status", "seconds", "reason"):
        table.add_column(col, overflow="fold")
    for s in verdict.stages:
        table.add_row(s.name, f"[{_STYLE[s.status]}]{s.status}[/]", f"{s.seconds:.2f}", escape(s.reason))
    console.print(table)
    console.print(escape(verdict.reason))
