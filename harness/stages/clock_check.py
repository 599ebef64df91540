"""Microbench's second figure (harness/stages/microbench.py): the candidate's and the baseline's time per call by
the evaluator's own clock, over short rounds of CUDA-graph bursts replayed in the worker, each round after a
rest (so that no burst starts at the GPU's power cap); one call of the candidate's graph in one round, both
drawn after the capture, checked (a graph recording less work than its calls would be clocked fast);
the check that the worker's events are not far under that clock; and the figure that counts, the slower of
the two speedups (`counted_ms`); and `Disagreement`, the rejection of a case whose measurements disagree, which
microbench measures again before it names a kernel by it (`agreeing`). Not here: the events' timing
(harness/worker_timing.py) or the verdict.
"""
from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from harness.stages.common import EvalContext, Rejected, Trial, candidate_raised, diff, drop_outputs, library_use
from harness.transport import ProtocolError, read_arena

T = TypeVar("T")


class Disagreement(Rejected):
    """Two of the evaluator's measurements of one served case disagree beyond their bound: the worker's events
    against the evaluator's clock (`check_clock`), or a burst of 2n calls no longer than one of n (`burst_ms`). An
    honest kernel's case can meet one once, so microbench times such a case again (`agreeing`); a lie that made it
    disagree makes every try disagree. (The worker's baseline against the evaluator's own timing of it is no
    disagreement: the evaluator's figure counts, harness/stages/microbench.py `trusted_baseline`.)"""


def agreeing(measure: Callable[[], T], tries: int) -> tuple[T, list[str]]:
    """`measure()`'s result from the first of up to `tries` calls that met no Disagreement, and the disagreements
    met before it (their reasons, in order). The last try's Disagreement is raised, carrying `timing_tries`.
    Any other rejection is raised at once: only a disagreement between two clocks is measured again."""
    met: list[str] = []
    while True:
        try:
            return measure(), met
        except Disagreement as e:
            met.append(str(e))
            if len(met) >= tries:
                again = f" (measured {tries} times, each disagreed)" if tries > 1 else ""
                raise Disagreement(f"{e}{again}", e.failure, **{**e.metrics, "timing_tries": float(tries)}) from None


def _clock() -> float:
    """The evaluator's own clock, in seconds: CLOCK_MONOTONIC_RAW, which no adjtimex (tick or frequency)
    slews, unlike perf_counter's CLOCK_MONOTONIC; the candidate's process cannot reach it either."""
    return time.clock_gettime(time.CLOCK_MONOTONIC_RAW)


def burst_ms(ctx: EvalContext, op: str, impl: str, per_call_ms: float, check: Trial | None = None) -> tuple[float, bool]:
    """Per-call time by the evaluator's clock, (wall of 2n calls - wall of n calls) / n, the median of
    `clock_check_rounds` short rounds each begun after the GPU rested, and whether the calls were replayed
    from a CUDA graph. The candidate must be capturable; the baseline may not be.
    With `check` (the trial of the burst's input set), the output of one of the graph's calls, drawn here
    after the capture, must be right after one of the rounds' longer bursts (drawn too): a graph that did less
    than the calls it recorded would be clocked as faster than the candidate is."""
    m = ctx.cfg.stages.microbench
    per_graph, baseline = m.calls_per_graph, ctx.target.ops[op].baseline_name
    prep = ctx.request({"cmd": "burst", "op": op, "impl": impl, "prepare": True, "per_graph": per_graph,
                        "baseline": baseline}, f"capturing the {impl}", "capture")
    if not prep.ok:
        raise Rejected(f"{op}: the {impl} raised while being captured:\n{prep.get('error', '')}")
    if impl == "candidate":
        library_use(ctx, f"{op} (microbench, captured for the clock check)", prep, float("inf"), 1)
        if not prep.graph:
            raise Rejected(f"{op}: the candidate cannot be captured in a CUDA graph ({prep.error}); "
                           "kevo clocks device time through graph replays, and serving engines replay decode the same way")
    n = per_graph * int(min(500, max(1, m.clock_check_ms / max(per_call_ms, 1e-3) / per_graph)))
    # the call whose output is checked: one of the graph's, in one of the rounds' longer bursts, both drawn here
    per_call, pick, checked_round = [], secrets.randbelow(per_graph), secrets.randbelow(m.clock_check_rounds)
    for r in range(m.clock_check_rounds):
        time.sleep(m.clock_check_rest_s)          # the GPU idles first: no burst starts at the power cap
        walls = []
        for k in (n, 2 * n):
            msg = {"cmd": "burst", "op": op, "impl": impl, "n": k, "baseline": baseline}
            checking = check is not None and k == 2 * n and r == checked_round
            if checking:
                msg["check"] = pick
            t0 = _clock()
            reply = ctx.request(msg, f"clock check of the {impl}", "burst")
            walls.append(_clock() - t0)
            if not reply.ok:
                raise candidate_raised(f"{op}: the {impl} raised during the clock check", reply)
            if checking:
                _check_burst_output(ctx, op, impl, reply, check)
        if not walls[1] > walls[0]:
            raise Disagreement(f"{op}: by the evaluator's clock {2 * n} calls of the {impl} took {walls[1] * 1e3:.3f} ms, "
                           f"no longer than {n} calls ({walls[0] * 1e3:.3f} ms): its time per call cannot be clocked")
        per_call.append((walls[1] - walls[0]) * 1e3 / n)
    return statistics.median(per_call), bool(prep.graph)


def _check_burst_output(ctx: EvalContext, op: str, impl: str, reply, trial: Trial) -> None:
    expect = {"burst": (ctx.target.ops[op].output_shape(trial.inputs), ctx.dtype)}
    try:
        outs = read_arena([e.model_dump() for e in reply.outputs], ctx.device, reply.arenas, expect=expect)
    except (ProtocolError, OSError, RuntimeError, ValueError) as e:
        raise Rejected(f"{op}: the output of the {impl}'s clock check: {type(e).__name__}: {e}", failure="protocol") from None
    drop_outputs(ctx, reply)
    d = diff(outs.get("burst", torch.full((1,), float("nan"))), trial.ref)
    if "burst" not in outs or not trial.tol.admits(d):
        raise Rejected(f"{op}: a call of the {impl}'s CUDA graph that the clock check timed wrote a wrong output "
                       f"({d.describe()}): the calls clocked are not the calls timed")


def counted_ms(cand: float, base: float, wall_c: float, wall_b: float) -> float:
    """The candidate's time per call that counts: its events' time, or slower where the evaluator's clock gives
    it a smaller speedup over the baseline (the baseline's events time over the clock's speedup). The two
    protocols differ in what they meet: the events time each call alone (L2 flushed, the GPU idle before it),
    a burst replays calls back to back (inputs warm in the L2, the GPU at its power cap: a power-hungry kernel
    is clocked down there, the H200's TMA prefill by up to 21%). A kernel must be faster in both; and the
    worker's events, which the candidate's process could reach, can only ever lower its figure."""
    by_clock = base * wall_c / wall_b
    return cand if by_clock <= cand else by_clock          # a NaN from the clock counts as NaN, never as fast


def check_clock(label: str, cand: float, wall_c: float, ratio: float, **metrics) -> None:
    """The worker's event time of the candidate against the evaluator's own clock (CUDA-graph bursts). A lie
    smaller than the bound gains nothing (`counted_ms`); this names the larger ones."""
    if not cand >= ratio * wall_c:
        raise Disagreement(f"{label}: the worker's events say {cand:.4f} ms per call, the evaluator's clock "
                       f"{wall_c:.4f} ms: the worker's timer is not to be believed", candidate_ms=cand,
                       candidate_clock_ms=wall_c, **metrics)
