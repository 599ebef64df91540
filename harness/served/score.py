"""Judging replays: latency summaries, the paired speed comparison of two arms, and the correctness gates.

`summarize` gives p50/p90/p99 of TTFT and TPOT (milliseconds) and throughput of one replay.

`paired` compares two arms served the same requests in alternating segments (harness/stages/replay.py):
each request scores the geometric mean of its TTFT ratio and its TPOT ratio (head over candidate: above 1,
the candidate was faster; TTFT's alone for a request of one token) - the ratio of the two arms' headroom
against any common SLO bars, so no bar has to be chosen. A segment's figure is the mean log ratio of its
requests (the requests of a segment share their batches, so they are not independent; segments are
nearly so, each starting from an idle server). Over the segments: the mean, its standard error and the
one-sided lower bound at `false_accept` (Student's t with segments - 1 degrees of freedom). The band is
the stage's own noise estimate, measured on every replay.

`compare_forced` is the correctness gate, on every generated token: the arm and the reference were fed
one continuation (teacher forcing, `kevo_forced`: the reference's own greedy tokens, or the head's that
the reference scored), so at each position both saw the same context. The arm's logprob of each token
must be finite and within `max_abs` of the reference's, the mean of those differences within `mean_abs`,
and where the arm's own top choice differs from the reference's (its top one there) the reference's lead
over its runner-up must have been a near-tie (within `near_tie_margin`).
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


def _ratio(head, cand) -> float | None:
    """log(head / candidate) of one request's latencies: TTFT and TPOT in equal parts."""
    if not (head.token_times and cand.token_times):
        return None
    r = math.log(max(head.ttft, 1e-9) / max(cand.ttft, 1e-9))
    if head.tpot is not None and cand.tpot is not None:
        r = 0.5 * (r + math.log(max(head.tpot, 1e-9) / max(cand.tpot, 1e-9)))
    return r


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p in (0.5, 1)), by bisection on its CDF: Simpson's rule on the density."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, n: int = 2000) -> float:
        h = x / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Paired:
    gain: float                 # the candidate's served speed over the head's, minus 1 (geometric, all segments)
    lower: float                # the one-sided lower bound of the gain at the false-accept rate
    band: float                 # the half-width of that bound on the log scale: the stage's noise estimate
    segments: list[float]       # each segment's mean log ratio (positive: the candidate faster)
    requests: int

    @property
    def detail(self) -> str:
        return (f"{self.gain:+.1%} over the head (one-sided lower bound {self.lower:+.1%}, noise band "
                f"+-{self.band:.1%}, {len(self.segments)} segments, {self.requests} requests)")


def paired(head: list[ReplayRun], cand: list[ReplayRun], false_accept: float) -> Paired:
    """`head[j]` and `cand[j]`: the two arms' replays of segment j (the same requests)."""
    segs, n = [], 0
    for h, c in zip(head, cand):
        others = {x.index: x for x in c.completions}
        rs = [r for x in h.completions if x.index in others and (r := _ratio(x, others[x.index])) is not None]
        if rs:
            segs.append(sum(rs) / len(rs))
            n += len(rs)
    if not segs:
        return Paired(float("nan"), float("nan"), float("nan"), [], 0)
    mean = sum(segs) / len(segs)
    if len(segs) < 2:
        return Paired(math.expm1(mean), float("nan"), float("inf"), segs, n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in segs) / (len(segs) - 1))
    band = t_quantile(1 - false_accept, len(segs) - 1) * sd / math.sqrt(len(segs))
    return Paired(math.expm1(mean), math.expm1(mean - band), band, segs, n)


@dataclass(frozen=True)
class Gate:
    passed: bool
    compared: int              # tokens whose logprobs were compared
    generated: int             # tokens the reference generated
    flips: int                 # positions where the arm's own choice differed from the reference's (near-ties)
    max_abs: float             # the largest |logprob difference| (inf: a non-finite logprob)
    mean_abs: float
    p99_abs: float             # the 99th percentile of them
    flip_lead: float           # the largest reference lead at which the arm's own choice differed (0: none)
    detail: str                # the first failure, in words; or a one-line summary when passed

    @property
    def coverage(self) -> float:
        return self.compared / self.generated if self.generated else 0.0


def _lead(top: list[tuple[str, float]]) -> float:
    return top[0][1] - top[1][1] if len(top) >= 2 else math.inf


def parting(ref: ReplayRun, margin: float) -> str:
    """Where a continuation the reference scored leaves the reference's own choice by more than `margin` (its
    lead over the continuation's token), in words; "" where it never does: then it is the reference's own greedy
    path up to near-ties, and may stand for it."""
    for r in ref.completions:
        for i, tok in enumerate(r.tokens):
            if i < len(r.top) and r.top[i] and r.top[i][0][0] != tok and r.top[i][0][1] - r.logprobs[i] > margin:
                return (f"request {r.index + 1}, token {i + 1}: {tok} where the reference would choose {r.top[i][0][0]} "
                        f"by a lead of {r.top[i][0][1] - r.logprobs[i]:.3g} (a near-tie is within {margin:.3g})")
    return ""


def compare_forced(ref: ReplayRun, other: ReplayRun, max_abs: float, mean_abs: float, margin: float) -> Gate:
    """`other` was fed `ref`'s tokens; compare every position (see the module's docstring)."""
    compared = generated = flips = 0
    total, worst, failure, diffs, flip_lead = 0.0, 0.0, "", [], 0.0
    others = {c.index: c for c in other.completions}
    for r in ref.completions:
        generated += len(r.tokens)
        o = others.get(r.index)
        if o is None:
            failure = failure or f"request {r.index + 1} is missing from the {other.label or 'other'} replay"
            continue
        if o.tokens != r.tokens:
            failure = failure or (f"request {r.index + 1}: the {other.label or 'other'} server did not return the forced "
                                  f"tokens (kevo_forced); it sent {len(o.tokens)} tokens")
            continue
        for i, tok in enumerate(r.tokens):
            d = abs(o.logprobs[i] - r.logprobs[i])
            if not math.isfinite(d):
                d = math.inf
            compared += 1
            diffs.append(d)
            total += d if math.isfinite(d) else 0.0
            worst = max(worst, d)
            if d > max_abs and not failure:
                failure = (f"request {r.index + 1}, token {i + 1}: logprob {o.logprobs[i]:.5f} where the reference has "
                           f"{r.logprobs[i]:.5f} (difference {d:.3g} > max_abs {max_abs:.3g})")
            choice = r.top[i][0][0] if i < len(r.top) and r.top[i] else tok      # the reference's own there
            own = o.top[i][0][0] if i < len(o.top) and o.top[i] else tok
            if own != choice:
                lead = _lead(r.top[i]) if i < len(r.top) else math.inf
                flip_lead = max(flip_lead, lead)
                if lead <= margin:
                    flips += 1
                elif not failure:
                    failure = (f"request {r.index + 1}, token {i + 1}: would choose {own} where the reference chose "
                               f"{choice}, whose lead over its runner-up was {lead:.3g} (a near-tie is within {margin:.3g})")
    mean = total / compared if compared else math.inf
    if not failure and mean > mean_abs:
        failure = (f"the mean logprob difference over {compared} tokens is {mean:.3g} > mean_abs {mean_abs:.3g} "
                   f"(the largest {worst:.3g})")
    if not failure and not compared:
        failure = "no token was compared"
    p99 = percentile(diffs, 99)
    if failure:
        return Gate(False, compared, generated, flips, worst, mean, p99, flip_lead, failure)
    return Gate(True, compared, generated, flips, worst, mean, p99, flip_lead,
                f"{compared} of {generated} tokens compared by teacher forcing (max logprob difference {worst:.3g} <= "
                f"{max_abs:.3g}, p99 {p99:.3g}, mean {mean:.3g} <= {mean_abs:.3g}); {flips} near-tie flips (margin {margin:.3g})")


def against_head(gate: Gate, head: Gate, factor: float, floor: float) -> Gate:
    """The candidate's gate, failed also when its mean difference from the reference is over `factor` x the
    head's on the same tokens (or `floor`, whichever is larger): a paired check, far finer than any fixed
    bound (both arms meet the same contexts). The fixed `mean_abs` still caps it: no head's error becomes
    the next one's allowance beyond that."""
    allowed = max(floor, factor * head.mean_abs)
    if not gate.passed or not head.compared or gate.mean_abs <= allowed:
        return gate
    return Gate(False, gate.compared, gate.generated, gate.flips, gate.max_abs, gate.mean_abs, gate.p99_abs, gate.flip_lead,
                f"the mean logprob difference from the reference over {gate.compared} tokens is {gate.mean_abs:.3g}, over "
                f"{factor:g} x the head's {head.mean_abs:.3g} on the same tokens (floor {floor:.3g})")
