"""The report's figures, drawn with matplotlib from a run's records and returned as inline SVG text:
best-so-far over time, the rejection funnel by stage, time spent per stage, predicted against
observed speedup, cost over time, and a kernel's microbench speedup per served shape.

A figure whose data the ledger does not hold (nothing was timed, nothing was spent) is not drawn
empty: its `Plot` carries the sentence saying why instead. Figures are built on `Figure` objects,
never pyplot, so nothing global is touched. Not here: the page around them (report), which kernel is
best (state.best_kernel), any figure the records do not hold.
"""
from __future__ import annotations

import io
import textwrap
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime

import matplotlib
from matplotlib.figure import Figure

from agent.records import CandidateRecord, Exchange, Kernel, RunHeader
from agent.run.state import best_kernel

COLOR = {"accepted": "#116329", "passed": "#2da44e", "rejected": "#cf222e", "skipped": "#afb8c1",
         "unevaluated": "#d0d7de"}


@dataclass(frozen=True)
class Plot:
    svg: str = ""                   # the figure as an inline <svg> element
    absent: str = ""                # or why there is none


def _svg(fig: Figure) -> Plot:
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):      # text stays text: searchable and small
        fig.savefig(buf, format="svg", bbox_inches="tight",
                    metadata={"Format": None, "Type": None, "Creator": None, "Date": None})
    text = buf.getvalue()
    return Plot(svg=text[text.index("<svg"):])


def _figure(height: float = 3.2) -> tuple[Figure, object]:
    fig = Figure(figsize=(8.5, height))
    ax = fig.subplots()
    ax.grid(alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    return fig, ax


def minutes_done(header: RunHeader, r: CandidateRecord) -> float | None:
    """When a candidate's verdict was in, in minutes since the run started (None: no time recorded)."""
    try:
        t0, t = datetime.fromisoformat(header.started), datetime.fromisoformat(r.started)
    except ValueError:
        return None
    return ((t - t0).total_seconds() + r.seconds) / 60


def best_so_far(header: RunHeader, heads: dict[str, Kernel], history: list[CandidateRecord]) -> Plot:
    """Per op, the best speedup over torch as candidates came in, from the head the run started with."""
    fig, ax = _figure()
    drawn = False
    for n, (op, head) in enumerate(heads.items()):
        mine = sorted(((t, r) for r in history if r.op == op and (t := minutes_done(header, r)) is not None),
                      key=lambda tr: tr[0])
        xs, ys = [0.0], [head.speedup]
        for done, (t, _) in enumerate(mine, 1):
            xs.append(t)
            ys.append(best_kernel(op, head, [r for _, r in mine[:done]]).speedup)
        timed = [(t, r) for t, r in mine if r.speedup is not None]
        if all(y is None for y in ys) and not timed:
            continue
        drawn = True
        ax.step(xs, [float("nan") if y is None else y for y in ys], where="post", color=f"C{n}", lw=2,
                label=f"{op}: best so far")
        for outcome, marker in (("passed", "o"), ("accepted", "*"), ("rejected", "x")):
            pts = [(t, r.speedup) for t, r in timed if r.outcome == outcome]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, s=60 if marker == "*" else 30, color=COLOR[outcome], zorder=3,
                           label=f"{op} candidate {outcome}")
    if not drawn:
        return Plot(absent="No candidate and no head was timed, so there is no best speed to plot.")
    ax.axhline(1.0, color="#57606a", ls="--", lw=1, label="torch baseline")
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("served-mix speedup over torch (x)")
    ax.legend(fontsize=8, loc="best")
    return _svg(fig)


def funnel(history: list[CandidateRecord]) -> Plot:
    """How many candidates each step saw, passed, rejected or could not run: proposal, then each stage."""
    if not history:
        return Plot(absent="No candidates yet.")
    outcomes = Counter(r.outcome for r in history)
    rows: dict[str, Counter] = {"proposal": Counter(passed=sum(1 for r in history if r.rounds),
                                                    rejected=outcomes["malformed"] + outcomes["not-worth-coding"],
                                                    unevaluated=outcomes["unevaluated"])}
    for r in history:
        for s in r.verdict.stages if r.verdict else []:
            rows.setdefault(s.name, Counter())["rejected" if s.status == "failed" else s.status] += 1
    fig, ax = _figure(0.55 * len(rows) + 1.2)
    names = list(rows)[::-1]
    left = [0] * len(names)
    for kind, label in (("passed", "passed"), ("rejected", "rejected here"), ("skipped", "skipped (cannot run here)"),
                        ("unevaluated", "not evaluated (budget)")):
        counts = [rows[n][kind] for n in names]
        if any(counts):
            bars = ax.barh(names, counts, left=left, color=COLOR[kind], label=label)
            ax.bar_label(bars, labels=[str(c) if c else "" for c in counts], label_type="center", fontsize=8)
            left = [a + b for a, b in zip(left, counts)]
    ax.set_xlabel("candidates (proposal: malformed or not worth coding count as rejected)")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, frameon=False)
    return _svg(fig)


def stage_time(header: RunHeader, history: list[CandidateRecord], exchanges: list[Exchange]) -> Plot:
    """Wall seconds per stage over every round of every candidate, and the LLM calls that proposed them."""
    seconds: dict[str, float] = defaultdict(float)
    runs: Counter = Counter()
    for r in history:
        for rnd in r.rounds:
            for s in rnd.verdict.stages:
                if s.status != "skipped":
                    seconds[s.name] += s.seconds
                    runs[s.name] += 1
    llm = [x for x in exchanges if x.seconds > 0]
    if llm:
        seconds["proposer (LLM calls)"], runs["proposer (LLM calls)"] = sum(x.seconds for x in llm), len(llm)
    if not any(seconds.values()):
        return Plot(absent="No candidate has reached the evaluator, and no LLM call was timed.")
    fig, ax = _figure(0.5 * len(seconds) + 1.2)
    names = list(seconds)[::-1]
    bars = ax.barh(names, [seconds[n] for n in names], color="#0969da")
    ax.bar_label(bars, labels=[f"{seconds[n]:.1f} s over {runs[n]}" for n in names], padding=3, fontsize=8)
    where = header.device + (f" ({header.arch})" if header.arch != header.device else "")
    ax.set_xlabel(f"wall seconds on {where}, every candidate and repair round")
    ax.margins(x=0.25)
    return _svg(fig)


def predicted_observed(history: list[CandidateRecord]) -> Plot:
    """The claim's local speedup s against the one measured over the parent, one point per timed candidate."""
    pts = [r for r in history if r.claim and r.local_speedup is not None]
    if not pts:
        return Plot(absent="No candidate was timed against a timed parent, so no observed speedup exists to set "
                           "against the predicted one.")
    fig, ax = _figure(4.2)
    for outcome in dict.fromkeys(r.outcome for r in pts):
        mine = [r for r in pts if r.outcome == outcome]
        ax.scatter([r.claim.expected_speedup for r in mine], [r.local_speedup for r in mine], color=COLOR[outcome],
                   label=outcome, zorder=3)
    for r in pts:
        ax.annotate(r.id, (r.claim.expected_speedup, r.local_speedup), fontsize=7, xytext=(4, 3), textcoords="offset points")
    lo = min(min(r.claim.expected_speedup, r.local_speedup) for r in pts) * 0.97
    hi = max(max(r.claim.expected_speedup, r.local_speedup) for r in pts) * 1.03
    ax.plot([lo, hi], [lo, hi], color="#57606a", ls="--", lw=1, label="observed = predicted")
    ax.axhline(1.0, color="#cf222e", lw=0.8, alpha=0.6, label="no gain over the parent")
    ax.set_xlabel("predicted local speedup s (the claim)")
    ax.set_ylabel("observed local speedup over the parent")
    ax.legend(fontsize=8, loc="best")
    return _svg(fig)


def cost(header: RunHeader, history: list[CandidateRecord]) -> Plot:
    """Cumulative LLM cost as candidates came in; the limit is drawn only where it does not flatten the curve."""
    total = sum(r.cost_usd for r in history)
    if total == 0:
        return Plot(absent=f"Nothing was spent: {len(history)} candidates, $0 (proposer {header.provider}"
                           f"{', which calls no model' if header.provider == 'offline' else ''}).")
    fig, ax = _figure()
    xs, ys = [0.0], [0.0]
    for t, c in sorted((t, r.cost_usd) for r in history if (t := minutes_done(header, r)) is not None):
        xs.append(t)
        ys.append(ys[-1] + c)
    ax.step(xs, ys, where="post", color="#8250df", lw=2)
    ax.scatter(xs[1:], ys[1:], color="#8250df", s=12)
    limit = header.max_cost_usd
    ax.set_title(f"\\${total:.4f} spent" + (f" of the \\${limit:g} limit" if limit > 0 else ", no limit"), fontsize=9)
    if limit > 0 and total >= limit / 2:
        ax.axhline(limit, color="#cf222e", ls="--", lw=1, label=f"limit \\${limit:g}")
        ax.legend(fontsize=8)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel("cumulative LLM cost (USD)")
    return _svg(fig)


def shapes(cases: list[dict]) -> Plot:
    """A kernel's speedup per served shape over the torch baseline and, where timed, the cuDNN anchor."""
    fig, ax = _figure(0.7 * len(cases) + 1.0)
    names = [textwrap.fill(c["label"], 30) for c in cases][::-1]
    h, ys = 0.38, range(len(cases))
    ax.barh([y + h / 2 for y in ys], [c["baseline_ms"] / c["candidate_ms"] for c in cases][::-1], height=h,
            color="#2da44e", label="over the torch baseline")
    if all("anchor_ms" in c for c in cases):
        ax.barh([y - h / 2 for y in ys], [c["anchor_ms"] / c["candidate_ms"] for c in cases][::-1], height=h,
                color="#0969da", label="over the cuDNN anchor")
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.set_ylim(-0.6, len(cases) - 0.4)
    ax.axvline(1.0, color="#57606a", ls="--", lw=1)
    ax.set_xlabel("the kernel's speedup (x; above 1 it is faster)")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    return _svg(fig)
