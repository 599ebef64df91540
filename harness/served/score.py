"""Judging replays: latency summaries, each request scored against p90 bars, and the correctness gates.

`summarize` gives p50/p90/p99 of TTFT and TPOT (milliseconds) and throughput. `headroom` scores one
request against the bars: the geometric mean of TTFT bar / its TTFT and TPOT bar / its TPOT (above 1:
faster than the bars), so a TTFT far over its bar is not hidden by a fast decode, and neither
latency caps the credit the other earns (the tighter of the two would: with bars at a baseline's p90
both sit near 1, and a decode twice as fast would score as little as the TTFT allows). `slo_score`
is the geometric mean of that over a run's requests — a continuous score, so a server uniformly 2%
slower scores 2% lower. `attainment`, the share of requests inside both bars, is reported beside
it but decides nothing: in a batched engine the requests served together share their step times,
so their TPOTs bunch, and with bars at a baseline's own p90 a 2% drift carries most of them across
a bar (two replays of one baseline server on an H200 attained 0.727 and 0.136 at a 20 s window,
2026-11-30). `compare` is the correctness gate: token by token, the other run's greedy tokens must
equal the baseline's, with the chosen token's logprob within `tolerance`; where the tokens differ, that
is tolerated only if the baseline's top two logprobs were within `margin` of each other (a
near-tie), and the rest of that request is not compared (its contexts differ from there on).
Not covered: running the replays (harness/stages/replay.py) or timing tokens (client.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from harness.served.client import ReplayRun


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(run: ReplayRun) -> dict[str, float]:
    done = [c for c in run.completions if c.token_times]
    ttft = [c.ttft * 1e3 for c in done]
    tpot = [c.tpot * 1e3 for c in done if c.tpot is not None]
    out = {"requests": float(len(run.completions)), "tokens": float(sum(len(c.tokens) for c in run.completions))}
    for name, xs in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile(xs, q)
    out["throughput_tok_s"] = out["tokens"] / run.duration_s if run.duration_s > 0 else 0.0
    return out


def attainment(run: ReplayRun, ttft_bar_ms: float, tpot_bar_ms: float) -> float:
    ok = 0
    for c in run.completions:
        if c.token_times and c.ttft * 1e3 <= ttft_bar_ms and (c.tpot is None or c.tpot * 1e3 <= tpot_bar_ms):
            ok += 1
    return ok / len(run.completions) if run.completions else 0.0


def headroom(ttft_ms: float, tpot_ms: float | None, ttft_bar_ms: float, tpot_bar_ms: float) -> float:
    """How far inside its bars one request finished: the geometric mean of bar/observed for TTFT and
    TPOT (TTFT's alone for a request of one token, which has no TPOT)."""
    h = ttft_bar_ms / max(ttft_ms, 1e-6)
    return h if tpot_ms is None else math.sqrt(h * tpot_bar_ms / max(tpot_ms, 1e-6))


def slo_score(run: ReplayRun, ttft_bar_ms: float, tpot_bar_ms: float) -> float:
    """The geometric mean of the requests' headroom (requests that streamed no token are left out: a
    replay with any failed request never reaches scoring); NaN for none."""
    logs = [math.log(headroom(c.ttft * 1e3, None if c.tpot is None else c.tpot * 1e3, ttft_bar_ms, tpot_bar_ms))
            for c in run.completions if c.token_times]
    return math.exp(sum(logs) / len(logs)) if logs else float("nan")


@dataclass(frozen=True)
class Gate:
    passed: bool
    compared: int              # tokens whose logprobs were compared
    near_ties: int             # requests whose tokens parted at a near-tie
    max_logprob_diff: float
    detail: str                # the first failure, in words; or a one-line summary when passed


def _lead(top: list[tuple[str, float]]) -> float:
    return top[0][1] - top[1][1] if len(top) >= 2 else math.inf


def compare(base: ReplayRun, other: ReplayRun, tolerance: float, margin: float) -> Gate:
    compared, near_ties, worst, failure = 0, 0, 0.0, ""
    others = {c.index: c for c in other.completions}
    for b in base.completions:
        o = others.get(b.index)
        if o is None:
            failure = failure or f"request {b.index + 1} is missing from the {other.label or 'other'} replay"
            continue
        for i, (bt, ot) in enumerate(zip(b.tokens, o.tokens)):
            if bt == ot:
                d = abs(b.logprobs[i] - o.logprobs[i])
                compared += 1
                worst = max(worst, d)
                if d > tolerance and not failure:
                    failure = (f"request {b.index + 1}, token {i + 1}: logprob {o.logprobs[i]:.5f} where the baseline "
                               f"has {b.logprobs[i]:.5f} (difference {d:.3g} > tolerance {tolerance:.3g})")
                continue
            lead = _lead(b.top[i]) if i < len(b.top) else math.inf
            if lead <= margin:
                near_ties += 1
            elif not failure:
                failure = (f"request {b.index + 1}, token {i + 1}: chose {ot} where the baseline chose {bt}, whose "
                           f"lead over its runner-up was {lead:.3g} (a near-tie is within {margin:.3g})")
            break
    if failure:
        return Gate(False, compared, near_ties, worst, failure)
    return Gate(True, compared, near_ties, worst,
                f"{compared} tokens agree (max logprob difference {worst:.3g}, tolerance {tolerance:.3g}); "
                f"{near_ties} requests parted at a near-tie (margin {margin:.3g})")
