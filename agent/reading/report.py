"""`kevo-agent report`: one run's ledger as a self-contained HTML page — one file, nothing fetched
(the plots are inline SVG from agent/plots, the CSS is inline) — that a person reads after the run.

The page: the run's header and why it stopped; the stages that did not run on its machine and why;
five plots (best-so-far over time, the rejection funnel, time per stage with the run's pace under it,
predicted against observed speedup, cost over time), each replaced by a sentence saying why when the ledger holds nothing to
plot (a CPU run times nothing); per op the best kernel's source with its verdict and its microbench
figures per served shape, kevo over the cuDNN anchor first and over the torch baseline second; the
ledger's rows (agent/table) with each candidate's kevo/cuDNN. On a run that timed nothing, the page
says its passes are of the correctness stages only. Everything is read from the ledger's committed files. The page is a view: written
beside them, kept out of the ledger's git. Not here: the figures themselves (plots), the terminal
table (table), which kernel is best (state.best_kernel).
"""
from __future__ import annotations

import html
from pathlib import Path

from agent.reading import plots
from agent.reading.pace import pace, pace_words
from agent.reading.figures import NO_ANCHOR, microbench_cases, nothing_timed, speed, untimed_pass, untimed_words, vs_cudnn
from agent.ledger.repository import Ledger, exchange_lines
from agent.ledger.store import write_inside
from agent.records import CandidateRecord, Exchange, Kernel, RunHeader
from agent.run.ending import heads_found_wrong, not_run
from agent.run.state import best_kernel
from agent.reading.table import Row, row, x

e = html.escape
PLOTS = (("best-so-far", "Best so far over time"), ("funnel", "Rejection funnel by stage"),
         ("stage-time", "Time spent per stage"), ("predicted-observed", "Predicted against observed speedup"),
         ("cost", "Cost over time"))
CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#1f2328}
h1{font-size:1.6em;margin-bottom:.2em} h2{border-bottom:1px solid #d0d7de;padding-bottom:.2em;margin-top:1.8em}
.meta{color:#57606a} .notrun{background:#fff8c5;border:1px solid #d4a72c;padding:.6em 1em;border-radius:6px}
.absent{color:#57606a;font-style:italic;background:#f6f8fa;padding:.6em 1em;border-radius:6px}
svg{width:100%;height:auto;display:block}
table{border-collapse:collapse;font-size:13px;margin:.6em 0;width:100%}
th,td{border:1px solid #d0d7de;padding:3px 6px;text-align:left;vertical-align:top} th{background:#f6f8fa}
td.num{text-align:right;white-space:nowrap} tr.failed td,td.rejected{color:#cf222e} tr.skipped td{color:#8c959f}
td.passed,td.accepted{color:#116329;font-weight:600}
pre{background:#f6f8fa;padding:1em;overflow:auto;max-height:36em;font-size:12px;line-height:1.35;border-radius:6px}
.path{color:#57606a;font-family:monospace}
"""


def _plot(p: plots.Plot, context: str = "") -> str:
    return p.svg or f"<p class='absent'>{e(' '.join([p.absent, context]).strip())}</p>"


def _shapes_table(cases: list[dict]) -> str:
    anchor = all("anchor_ms" in c for c in cases)
    cols = ["shape", "weight", "kernel ms"] + (["cuDNN ms", "vs cuDNN"] if anchor else []) + ["torch ms", "vs torch"]
    body = "".join("<tr>" + "".join(f"<td>{v}</td>" for v in [
        e(c["label"]), f"{c.get('weight', float('nan')):.2f}", f"{c['candidate_ms']:.4f}",
        *([f"{c['anchor_ms']:.4f}", x(vs_cudnn([c]))] if anchor else []),
        f"{c['baseline_ms']:.4f}", x(c["baseline_ms"] / c["candidate_ms"])]) + "</tr>" for c in cases)
    none = "" if anchor else f"<p class='absent'>{NO_ANCHOR.capitalize()} for these shapes.</p>"
    return f"<table class='shapes'><tr>{''.join(f'<th>{c}</th>' for c in cols)}</tr>{body}</table>{none}"


def _best_section(ledger: Ledger, header: RunHeader, op: str, head: Kernel, history: list[CandidateRecord]) -> str:
    k = best_kernel(op, head, history)
    from_head = k.ref.startswith("head:")
    path = ledger.root / (f"heads/{op}.py" if from_head else f"best/{op}.py")
    source = k.source
    record = next((r for r in history if r.id == k.ref), None)
    said = ("the reference kernel: no candidate beat it" if from_head else
            "accepted by the full scored replay" if record and record.outcome == "accepted" else
            "passed the correctness stages; not timed, not accepted" if record and untimed_pass(record.verdict) else
            "passed every stage that ran") + f"; served mix {speed(k.verdict, op).words()}"
    out = [f"<section class='best' id='best-{e(op)}'><h3>{e(op)}: {e(k.ref)} ({e(said)})</h3>",
           f"<p class='path'>{e(str(path.relative_to(ledger.root)))} in the ledger</p>"]
    if k.verdict:
        out.append("<table><tr><th>stage</th><th>status</th><th>s</th><th>reason</th></tr>" + "".join(
            f"<tr class='{s.status}'><td>{e(s.name)}</td><td>{s.status}</td><td>{s.seconds:.2f}</td>"
            f"<td>{e(' '.join(s.reason.split())[:400])}</td></tr>" for s in k.verdict.stages) + "</table>")
    bench = next((s for s in (k.verdict.stages if k.verdict else []) if s.name == "microbench" and s.metrics), None)
    cases = microbench_cases(bench.metrics, bench.reason, op) if bench else []
    if cases:
        out += [f"<h4>Microbench, per served shape (served mix {e(speed(k.verdict, op).words())}; "
                f"torch noise bar {x(bench.metrics.get('bar'))})</h4>", _plot(plots.shapes(cases)), _shapes_table(cases)]
    else:
        skipped = not_run({op: k}, history).get("microbench")
        why = f"microbench did not run on this {header.device} machine ({skipped})" if skipped else "microbench recorded no figures"
        out.append(f"<p class='absent nospeed'>No speed figure exists for this kernel: {e(why)}.</p>")
    out.append(f"<details open><summary>source ({len(source.splitlines())} lines)</summary>"
               f"<pre><code>{e(source)}</code></pre></details></section>")
    return "\n".join(out)


def _rows_table(items: list[Row], history: list[CandidateRecord]) -> str:
    cols = ("id", "op", "claim", "stage", "verdict", "predicted", "observed", "vs cuDNN", "vs torch", "conclusion", "cost")
    lib = {r.id: speed(r.verdict, r.op) for r in history}
    body = "".join(
        f"<tr><td>{e(r.id)}</td><td>{e(r.op)}</td><td>{e(r.claim)}</td><td>{e(r.stage)}</td>"
        f"<td class='{e(r.verdict)}'>{e(r.verdict)}</td><td class='num'>{x(r.predicted)}</td>"
        f"<td class='num'>{x(r.observed)}</td><td class='num'>{x(lib[r.id].mix_vs_cudnn) if r.id in lib else '-'}</td>"
        f"<td class='num'>{x(r.speedup)}</td><td>{e(r.conclusion)}</td>"
        f"<td class='num'>${r.cost_usd:.4f}</td></tr>" for r in items)
    return f"<table class='rows'><tr>{''.join(f'<th>{c}</th>' for c in cols)}</tr>{body}</table>"


def _exchanges(ledger: Ledger, history: list[CandidateRecord]) -> list[Exchange]:
    out = []
    for r in history:
        text = ledger.committed(f"candidates/{r.id}/exchanges.jsonl") or ""
        out += exchange_lines(text)
    return out


def render(ledger: Ledger) -> str:
    header, summary, heads, history = ledger.header(), ledger.summary(), ledger.heads(), ledger.history()
    started = ledger.heads(at_start=True)
    skipped = not_run(started, history)
    untimed = all(r.speedup is None for r in history) and all(k.speedup is None for k in started.values())
    only_correct = nothing_timed([k.verdict for k in started.values()] + [r.verdict for r in history])
    passed = sum(r.outcome == "passed" and untimed_pass(r.verdict) for r in history)
    no_timing = (f"The microbench stage did not run on this {header.device} machine ({skipped['microbench']})."
                 if "microbench" in skipped else "")
    models = f", planner {header.planner_model}, coder {header.coder_model}" if header.planner_model else ""
    parts = [f"<h1>kevo run {e(header.id)}</h1>",
             f"<p class='meta'>target {e(header.target)} ({e(', '.join(header.ops))}); proposer {e(header.provider)}"
             f"{e(models)}; on {e(header.device)} ({e(header.arch)}); started {e(header.started)}; budget "
             f"{header.budget_minutes:g} min; kevo {e(header.kevo_commit[:12])}</p>",
             f"<p>{len(history)} candidates, ${sum(r.cost_usd for r in history):.4f} spent "
             f"({sum(r.input_tokens for r in history)} input, {sum(r.output_tokens for r in history)} output tokens). "
             f"Stopped: {e(summary.get('stopped') or 'not yet (running, or cut short)')}.</p>"]
    if skipped:
        parts.append("<div class='notrun' id='not-run'><b>Stages that did not run on this machine:</b><ul>"
                     + "".join(f"<li><b>{e(n)}</b>: {e(why)}</li>" for n, why in skipped.items()) + "</ul>"
                     + ("No speed figure exists for this run: nothing was timed, so no candidate could beat a head. "
                        if untimed else "")
                     + (f"<span id='untimed'>{e(untimed_words(passed))}.</span>" if only_correct else "") + "</div>")
    wrong_heads = heads_found_wrong(history)
    if wrong_heads:
        parts.append("<div class='notrun' id='heads-found-wrong'><b>Heads found wrong where served</b> (their own spot "
                     "checks, in a later replay; each gave its place back to the head before it):<ul>"
                     + "".join(f"<li>{e(line)}</li>" for line in wrong_heads) + "</ul></div>")
    figures = {"best-so-far": _plot(plots.best_so_far(header, started, history), no_timing),
               "funnel": _plot(plots.funnel(history)),
               "stage-time": _plot(plots.stage_time(header, history, _exchanges(ledger, history)))
               + f"<p id='pace'>Pace: {e(pace_words(pace(started, history, summary.get('elapsed_s', 0.0)).record()))}.</p>",
               "predicted-observed": _plot(plots.predicted_observed(history), no_timing),
               "cost": _plot(plots.cost(header, history))}
    parts += [f"<section class='plot' id='{pid}'><h2>{title}</h2>{figures[pid]}</section>" for pid, title in PLOTS]
    parts.append("<h2>Best kernel per op</h2>")
    parts += [_best_section(ledger, header, op, head, history) for op, head in heads.items()]
    parts += ["<h2>Every candidate</h2>", _rows_table([row(r) for r in history], history)]
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>kevo run {e(header.id)}</title>"
            f"<style>{CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write(ledger: Ledger, out: Path | None = None) -> Path:
    """Write the page (default: report.html in the ledger, listed in its .git/info/exclude: never committed)."""
    out = out or ledger.root / "report.html"
    text = render(ledger)
    if out.parent.resolve() == ledger.root.resolve():    # in the run folder: never through a link left there
        ledger.exclude(f"/{out.name}")
        write_inside(ledger.root, out.name, text.encode())
    else:
        out.write_text(text)
    return out
