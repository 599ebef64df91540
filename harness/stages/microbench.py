"""Stage 4, microbench (CUDA only): is the candidate faster than the baseline, beyond noise, honestly?

First, on a GPU still shared with the other slots' untimed stages, this side draws every case's inputs and builds
the cuDNN anchor's plans while the worker pays the trusted code's first uses, compiles the candidate for the input
sets it will time and makes one untimed round of calls on them (harness/stages/microbench_prepare.py); then the
stage asks for the GPU alone (`begin_timing`: harness/stages PREPARED_STAGES) and times candidate and baseline
(twice: the noise band) interleaved, on rotated input sets (fresh payloads at lengths the same for every
candidate: `draw_sets`), with the L2 flushed, launch overhead hidden
behind a spin kernel, and CUDA events read both on the call's stream and after a full device synchronize. The time that
counts is device time on the stream. The evaluator then distrusts every number it was handed:
  - the reply fits its schema (harness/replies.py: finite times above zero, bounded) and holds exactly
    the implementations and repetitions asked for; every guard below is written `if not <what must
    hold>`, so a NaN that got this far would still reject;
  - the timed calls, and the calls made just before the CUDA-graph capture, were watched by the audit
    like any other (no library op);
  - every timed call is on a query of its own (harness/worker_timing.py `per_call_seed`), so none repeats the inputs
    of a call before it: an output kept for inputs seen before would time a lookup; the outputs of a rep drawn in
    secret are re-checked against float64, computed here for that rep's query (`draw_timed`);
  - device time after the synchronize far beyond the stream's (less the synchronize's own cost,
    measured on the baseline) means work escaped the timed stream;
  - a time under bytes/bandwidth or FLOPs/peak is a measurement exploit;
  - CUDA-graph bursts of back-to-back calls clocked by the evaluator's own clock (CLOCK_MONOTONIC_RAW,
    which adjtimex cannot slew), one of whose graph calls (drawn after the capture) must have written a
    right output, give a second figure: the candidate's events may not be far under it (a patched timer),
    it is no faster than physics either, and the candidate counts at the slower of the two speedups
    (`counted_ms`), so a smaller lie of the events gains nothing (harness/stages/clock_check.py);
  - the evaluator times the baseline in its own process on every input set, the worker stopped meanwhile
    (`_worker_held`): where the worker's figure for it is slower beyond a tolerance, the evaluator's counts
    (`trusted_baseline`), so slowing the baseline inside the worker gains a candidate nothing.
The library anchor (cuDNN SDPA on equal shapes: the figure kevo's speed is reported against first) is timed
here only, in this process, with the worker's protocol (`anchor.time_anchor`) and the worker stopped, never in it: it
decides no verdict, so no check would catch a candidate that slowed it there (its memory held so that each
library call allocates, say); its time is reused for a later candidate of the process only on the same work
(harness/stages/anchor.py).
The bar is the noise band (at least `min_margin`) over the torch baseline — or over the candidate's
parent, when the loop names the parent's served-mix speedup (`beat`): both are ratios to the same torch
baseline timed here, so a candidate reaches the costly replay only if it is faster than the best kernel
of its op so far. Passing is not acceptance: only the full scored replay accepts.
Each served case's figures are recorded as metrics under its shape (`figure_metric`: `<Case.key>.<figure>`,
`decode_b32_len1024-2048_hq32_hkv8_d128_bs16.candidate_ms`), and read back by `case_figures`, so a record
says which shape each figure is of whatever the shape list is when it is read. Records an older kevo wrote
keyed them by position (`decode0_candidate_ms`); `case_figures` reads those too, with no shape to name.
"""
from __future__ import annotations

import contextlib
import functools
import re
import statistics
import time
from collections import Counter

import torch

from harness.errors import HarnessError
from harness.records import StageResult
from harness.replies import Timed
from harness.stages import anchor
from harness.stages.clock_check import Disagreement, agreeing, burst_ms, check_clock, counted_ms
from harness.stages.common import EvalContext, Rejected, candidate_raised, diff, drop_outputs, library_use
from harness.stages.launched import launched_resources
from harness.stages.microbench_prepare import (IMPLS, case_draws, collect_prime, collect_warm, draw_sets, first_calls,
                                               send_prime, send_warm, time_request)
from harness.targets import Case
from harness.transport import ProtocolError, read_arena
from harness.worker_handle import STOPPED_STATES, group_thread_states

HOLD_WAIT_S = 2.0     # how long a stopped worker may take to be seen stopped (`_worker_held`)


def figure_metric(case: Case, figure: str) -> str:
    """The metric under which this stage records `figure` (candidate_ms, anchor_rate, ...) of `case`."""
    return f"{case.key}.{figure}"


def case_figures(metrics: dict[str, float], op: str) -> list[tuple[str | None, dict[str, float]]]:
    """Per case of `op` this stage timed, in the order it timed them: the case's key and its figures. From a
    record keyed by position (an older kevo's `<op><i>_<figure>`) the key is None: such figures name their
    shape only by their place in the case list of the run that wrote them."""
    keyed: dict[str, dict[str, float]] = {}
    for name, value in metrics.items():
        key, dot, figure = name.rpartition(".")
        if dot and key.startswith(op + "_"):
            keyed.setdefault(key, {})[figure] = value
    if keyed:
        return list(keyed.items())
    placed: dict[int, dict[str, float]] = {}
    for name, value in metrics.items():
        if m := re.fullmatch(rf"{re.escape(op)}(\d+)_(.+)", name):
            placed.setdefault(int(m[1]), {})[m[2]] = value
    return [(None, placed[i]) for i in sorted(placed)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _time_here(fn, reps: int, flush: torch.Tensor, cover_cycles: int) -> float:
    """The evaluator's own measurement of a trusted function, with the worker's protocol."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    times = []
    for i in range(reps + 3):
        flush.zero_()
        torch.cuda.synchronize()
        torch.cuda._sleep(cover_cycles)
        ev[0].record()
        fn()
        ev[1].record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(ev[0].elapsed_time(ev[1]))
    return _median(times)


def per_set_median(times: list[float], sets: int) -> float:
    """A timing reply's times of one implementation (rep by rep, each rep one call per input set) as one figure:
    the mean over the input sets of each set's median. Not the median of them all: each set draws its own
    lengths, and where the sets' work differs (batch 4 of 512..2048 causal tokens: up to 1.5x between two draws
    on the H200) that median falls in one set's times or the other's by chance, so that the baseline's two
    arms, timed alike, read up to 38% apart (run h200-r24) and that band raised the bar of every case."""
    return statistics.fmean(_median(times[s::sets]) for s in range(sets))


def timed_medians(reply: Timed, impls: list[str], calls: int, label: str, sets: int = 1) -> tuple[dict[str, float], dict[str, float]]:
    """Synced and streamed time per implementation key ("candidate:0", ...) of a validated `time` reply
    (`per_set_median` over its `sets` input sets), after checking it holds exactly the keys asked for with
    `calls` times each. The schema has already refused NaN, Inf, zero and negative times."""
    want = {f"{impl}:{i}" for i, impl in enumerate(impls)}
    for field in ("synced_ms", "streamed_ms"):
        got = getattr(reply, field)
        if not set(got) == want:
            raise Rejected(f"{label}: malformed reply while timing: field {field} has keys {sorted(got)}, "
                           f"expected {sorted(want)}", failure="protocol")
        short = [k for k, v in got.items() if len(v) != calls]
        if short:
            raise Rejected(f"{label}: malformed reply while timing: field {field}.{short[0]} holds "
                           f"{len(got[short[0]])} times, expected {calls}", failure="protocol")
    if set(reply.synced_ms) != set(reply.streamed_ms):
        raise Rejected(f"{label}: malformed reply while timing: synced_ms and streamed_ms name different "
                       "implementations", failure="protocol")
    return ({k: per_set_median(v, sets) for k, v in reply.synced_ms.items()},
            {k: per_set_median(v, sets) for k, v in reply.streamed_ms.items()})


def check_stream(label: str, cand: float, busy: float, ratio: float) -> None:
    """Work launched on a side stream: device busy after the synchronize far beyond the stream's time.
    Written so that a NaN anywhere rejects (every guard here is `if not <what must hold>`)."""
    if not cand >= ratio * busy:
        raise Rejected(f"{label}: {cand:.4f} ms of device time on the call's stream, but the device stays busy "
                       f"for {busy:.4f} ms: work escapes the timed stream")


def check_floor(label: str, cand: float, floor_ms: float, what: str) -> None:
    if not cand >= floor_ms:
        raise Rejected(f"{label}: {cand:.4f} ms by {what} is under the physical floor of {floor_ms:.4f} ms: "
                       "a measurement exploit")


def trusted_baseline(label: str, there: float, here: float) -> float:
    """The baseline's time on one input set that counts: the lower of the worker's (`there`) and the evaluator's own
    timing of it in this process (`here`). The worker's is a figure the candidate's process could reach: its calls
    share the candidate's input objects, which the candidate may change between them (a block table widened in place
    gives the baseline more work, its outputs still right), so a slower baseline there never raises its speedup; a
    faster one can only lower it. Counted rather than rejected where the two part widely: honest kernels' workers read
    the batch-4 prefill baseline at 2.0-2.2x the evaluator's (run s62, H100), a host launch slower than the spin
    cover being one way (docs/BENCHMARKS.md, sixty-third session). A NaN or a time not above zero rejects."""
    if not (there > 0 and here > 0):
        raise Rejected(f"{label}: the baseline's time is not a positive number: {there} ms in the worker, "
                       f"{here} ms in the evaluator's own process")
    return min(there, here)


def worker_baselines(streamed: dict[str, list[float]], sets: int) -> list[float]:
    """Per input set, the worker's baseline: both arms' event times of that set pooled (a timing reply's
    `streamed_ms`, rep by rep and set by set), their median."""
    return [_median(streamed["baseline:1"][s::sets] + streamed["baseline:2"][s::sets]) for s in range(sets)]


def counted_baselines(label: str, there: list[float], here: list[float]) -> list[float]:
    """Per input set, what counts of the worker's baseline `there` against the evaluator's own `here`."""
    return [trusted_baseline(label, a, b) for a, b in zip(there, here, strict=True)]


def _anchor_key(ctx: EvalContext, case) -> tuple:
    m = ctx.cfg.stages.microbench
    return (torch.cuda.get_device_name(ctx.device), str(ctx.dtype), case.key, m.reps, m.input_sets, m.l2_flush_bytes,
            m.cover_cycles)


def _bench_case(ctx: EvalContext, case, trials: list, flush: torch.Tensor,
                work: tuple | None) -> tuple[dict[str, float], list[str]]:
    """Time one served case, again (up to `disagreement_tries` in all, each try on sets of its own: `case_draws`)
    where two of its clocks disagree: its figures, with `timing_tries`, and the disagreements met before the try
    that counts."""
    draws = case_draws(ctx, case, trials)
    del trials
    row, met = agreeing(lambda: _time_case(ctx, case, next(draws), flush, work), ctx.cfg.stages.microbench.disagreement_tries)
    row["timing_tries"] = float(1 + len(met))
    return row, met


def _time_case(ctx: EvalContext, case, trials: list, flush: torch.Tensor, work: tuple | None) -> dict[str, float]:
    """One try at timing one served case; this side waits, computing nothing, while the worker times. Then the cuDNN
    anchor on the same sets, whose `work` (`_build_anchors`) may have been timed before (None: no anchor)."""
    m = ctx.cfg.stages.microbench
    spec = ctx.target.ops[case.op]
    ctx.send(time_request(ctx, case, trials, m.warmup_reps, m.reps), f"timing {case.label}")
    t_send = time.perf_counter()
    reply = ctx.collect(f"timing {case.label}", "time")
    timed_s = time.perf_counter() - t_send
    if not reply.ok:
        raise candidate_raised(f"{case.label}: the candidate raised while being timed", reply)
    library_use(ctx, f"{case.op} (microbench, timed calls of {case.label})", reply, float("inf"), 1)
    synced, stream = timed_medians(reply, IMPLS, m.reps * len(trials), case.label, len(trials))
    expect = {f"set{i}": (spec.output_shape(t.inputs), ctx.dtype) for i, t in enumerate(trials)}
    try:
        outs = read_arena([e.model_dump() for e in reply.outputs], ctx.device, reply.arenas, expect=expect)
    except (ProtocolError, OSError, RuntimeError, ValueError) as e:
        raise Rejected(f"{case.label}: outputs of the timed calls: {type(e).__name__}: {e}", failure="protocol") from None
    drop_outputs(ctx, reply)
    for i, t in enumerate(trials):
        d = diff(outs.get(f"set{i}", torch.full((1,), float("nan"))), t.ref)
        if f"set{i}" not in outs or not t.tol.admits(d):
            raise Rejected(f"{case.label}: the output of a timed call is wrong ({d.describe()})")

    events, b1, b2 = stream["candidate:0"], stream["baseline:1"], stream["baseline:2"]
    base = (b1 + b2) / 2
    noise = abs(b1 - b2) / min(b1, b2)

    sync_cost = _median([s - t for k in ("baseline:1", "baseline:2")
                         for s, t in zip(reply.synced_ms[k], reply.streamed_ms[k])])
    check_stream(case.label, events, synced["candidate:0"] - sync_cost, m.stream_escape_ratio)
    costs = [spec.cost(t.inputs) for t in trials]
    nbytes = statistics.mean(c.bytes for c in costs)
    flops = statistics.mean(c.flops for c in costs)
    floor_ms = 1e3 * max(nbytes / m.hbm_bytes_per_s, flops / m.peak_flops)
    floor_words = (f"{nbytes / 1e6:.1f} MB at {m.hbm_bytes_per_s / 1e12:.1f} TB/s, {flops / 1e9:.1f} GFLOP at "
                   f"{m.peak_flops / 1e12:.0f} TFLOP/s")
    check_floor(case.label, events, floor_ms, f"the worker's events ({floor_words})")

    # The clock's bursts replay the first input set alone, and the sets' work differs (each draws its own lengths:
    # at batch 4, 512..2048 tokens, one set's causal FLOPs can be 1.5x another's), so the clock is held to that
    # set's events and floor, never to the median over every set.
    k = len(trials)
    events0 = _median(reply.streamed_ms["candidate:0"][0::k])
    there = worker_baselines(reply.streamed_ms, k)
    base0 = there[0]
    floor0_ms = 1e3 * max(costs[0].bytes / m.hbm_bytes_per_s, costs[0].flops / m.peak_flops)
    t_burst = time.perf_counter()
    wall_c, _ = burst_ms(ctx, case.op, "candidate", events0, check=trials[0])
    wall_b, base_graph = burst_ms(ctx, case.op, "baseline", base0)   # the baseline may not be capturable
    # the clock's burst difference is noisier than events: the same slack as the clock check itself
    check_floor(case.label, wall_c, m.clock_check_ratio * floor0_ms, f"the evaluator's clock (its input set: "
                f"{costs[0].bytes / 1e6:.1f} MB, {costs[0].flops / 1e9:.1f} GFLOP; less {1 - m.clock_check_ratio:.0%} for its noise)")
    check_clock(case.label, events0, wall_c, m.clock_check_ratio, baseline_ms=base0, baseline_clock_ms=wall_b,
                baseline_clock_from_graph=float(base_graph))
    burst_s = time.perf_counter() - t_burst
    t_here = time.perf_counter()             # the baseline in this process, on each set (`trusted_baseline`), and the
    with _worker_held(ctx, case.label):      # anchor, the worker stopped meanwhile: nothing of the candidate's runs
        here = [_time_here(functools.partial(spec.prepared_baseline(t.inputs), **t.inputs),
                           max(5, m.trusted_baseline_reps // k), flush, m.cover_cycles) for t in trials]
        got = None if work is None else anchor.time_anchor(work, _anchor_sets(spec, trials), lambda prepared: _time_here(
            lambda: spec.anchor(**prepared), m.reps, flush, m.cover_cycles))
    counted = counted_baselines(case.label, there, here)
    slow_sets = sum(a > b * (1 + m.trusted_baseline_tolerance) for a, b in zip(there, here))     # said in the reason
    base = statistics.fmean(counted)
    cand = counted_ms(events, base, wall_c, wall_b)
    speedup, speedup_by_clock = base / cand, wall_b / wall_c

    rate = (lambda ms: nbytes / ms / 1e9) if spec.unit == "TB/s" else (lambda ms: flops / ms / 1e9)
    row = {"candidate_ms": cand, "baseline_ms": base, "noise": noise, "speedup": speedup,
           "candidate_events_ms": events, "speedup_by_events": base / events, "speedup_by_clock": speedup_by_clock, "candidate_clock_ms": wall_c, "baseline_clock_ms": wall_b,
           "candidate_clocked_set_events_ms": events0, "baseline_clocked_set_events_ms": base0,
           "baseline_in_evaluator_ms": statistics.fmean(here), "baseline_sets_counted_here": float(slow_sets),
           "baseline_worker_over_here": max(a / b for a, b in zip(there, here)), "baseline_clock_from_graph": float(base_graph), "candidate_synced_ms": synced["candidate:0"],
           "candidate_rate": rate(cand), "baseline_rate": rate(base), "weight": case.weight,
           "bytes": nbytes, "flops": flops,
           "timing_s": timed_s, "clock_check_s": burst_s, "trusted_baseline_s": time.perf_counter() - t_here,
           "worker_compiles": float(reply.compiles),
           **launched_resources(reply.kernels, ctx.device),
           **{f"worker_{k}": v for k, v in reply.seconds.items()}}
    if got is not None:                           # None: no anchor, or no library kernel for the shape (reports say so)
        row.update(got, anchor_rate=rate(got["anchor_ms"]))
    return row


@contextlib.contextmanager
def _worker_held(ctx: EvalContext, label: str):
    """Stop the candidate's worker (every thread of it, seen stopped within `HOLD_WAIT_S`) while this process times;
    continue it after. One not seen stopped is a Disagreement: the case is timed again (`agreeing`)."""
    if ctx.worker is None:
        yield
        return
    try:
        if not ctx.worker.held_still(HOLD_WAIT_S):
            left = Counter(s for s in group_thread_states(ctx.worker.pid) if s not in STOPPED_STATES)
            raise Disagreement(f"{label}: the worker was not stopped within {HOLD_WAIT_S:.0f} s for the evaluator's own "
                               "timing of the baseline and the anchor (threads of its group not stopped, by /proc "
                               f"state: {', '.join(f'{n} {s}' for s, n in sorted(left.items())) or 'none read'})")
        yield
    finally:
        ctx.worker.hold_still(False)


def _anchor_sets(spec, trials: list) -> list:
    """Each input set's anchor inputs, made when called (one set's held at a time)."""
    return [functools.partial(spec.anchor_inputs, t.inputs) for t in trials]


def _build_anchors(ctx: EvalContext, plan: list[tuple[str, Case]], drawn: list[list]) -> tuple[float, list]:
    """Each served case's anchor `work` (None: no anchor, or no memory for its inputs), and one untimed anchor call
    per case whose work has no time in this process, on its first input set: cuDNN's libraries, handle and each
    shape's plan, built here while the worker primes (nothing is timed meanwhile), so that `anchor.time_anchor`
    later times calls alone. Its seconds, and the works."""
    m, t0, works = ctx.cfg.stages.microbench, time.perf_counter(), []
    for (op, case), trials in zip(plan, drawn):
        spec, done = ctx.target.ops[op], None
        if m.anchor and spec.anchor is not None:
            try:
                done = anchor.work(_anchor_key(ctx, case), _anchor_sets(spec, trials))
                if done not in anchor.TIMES:
                    spec.anchor(**spec.anchor_inputs(trials[0].inputs))
            except RuntimeError:             # no kernel for these shapes: `anchor.time_anchor` meets it again
                pass
        works.append(done)
    torch.cuda.synchronize(ctx.device)
    return time.perf_counter() - t0, works


def timing_plan(ctx: EvalContext) -> list[tuple[str, Case]]:
    """The served cases to time, op by op; a shape given twice is a HarnessError (its figures would share a key)."""
    plan = [(op, case) for op in ctx.ops for case in ctx.cases(op, boundary=False)]
    keys = [case.key for _, case in plan]
    if twice := sorted({k for k in keys if keys.count(k) > 1}):
        raise HarnessError(f"the served shapes (targets.{ctx.target.name}.{ctx.device.type}, or served.recorded_shapes) "
                           f"give one shape twice: {', '.join(twice)}; give it once, its weights summed")
    return plan


def microbench_stage(ctx: EvalContext) -> StageResult:
    if ctx.device.type != "cuda":
        return StageResult.skipped("microbench", "skipped: needs CUDA; this machine has none, and no CPU "
                                                 "figure stands in for a GPU speedup")
    m = ctx.cfg.stages.microbench
    flush = ctx.reserved.flush if ctx.reserved is not None else torch.empty(max(1, m.l2_flush_bytes // 4), dtype=torch.int32, device=ctx.device)
    metrics: dict[str, float] = {}
    lines, num, den, worst_noise = [], 0.0, 0.0, 0.0
    plan = timing_plan(ctx)
    t0 = time.monotonic()
    send_prime(ctx, plan)
    drawn = [draw_sets(ctx, case) for _, case in plan]    # every reference before any timing: none during it
    metrics["draws_s"] = time.monotonic() - t0
    warming = send_warm(ctx, drawn)
    metrics["anchor_build_s"], works = _build_anchors(ctx, plan, drawn)
    metrics.update(**collect_prime(ctx), **collect_warm(ctx, warming))
    metrics.update(first_calls(ctx, plan, drawn))
    ctx.begin_timing()          # until here the GPU was shared (nothing timed); from here nothing else of kevo's runs on it
    for k, (op, case) in enumerate(plan):
        unit = ctx.target.ops[op].unit
        trials, drawn[k] = drawn[k], None           # a try after a disagreement draws its own: held once at a time
        row, met = _bench_case(ctx, case, trials, flush, works[k])
        del trials
        metrics.update({figure_metric(case, figure): v for figure, v in row.items()})
        num += case.weight * row["baseline_ms"]
        den += case.weight * row["candidate_ms"]
        worst_noise = max(worst_noise, row["noise"])
        anchor = f", cuDNN {row['anchor_rate']:.2f} {unit}" if "anchor_rate" in row else ""
        slower = (f" by the clock, {row['speedup_by_events']:.2f}x by the events"     # where the two tell apart
                  if row["candidate_ms"] > 1.005 * row["candidate_events_ms"] else "")
        again = f"; timed {len(met) + 1} times, the first {len(met)} disagreeing: {met[0]}" if met else ""
        if row["baseline_sets_counted_here"]:
            again += (f"; the worker's baseline read up to {row['baseline_worker_over_here']:.2f}x the evaluator's own "
                      f"timing of it, on {row['baseline_sets_counted_here']:.0f} of {m.input_sets} input sets: "
                      "counted at the evaluator's")
        lines.append(f"{case.label}: {row['speedup']:.2f}x{slower} ({row['candidate_ms']:.4f} vs {row['baseline_ms']:.4f} ms; "
                     f"{row['candidate_rate']:.2f} vs {row['baseline_rate']:.2f} {unit}{anchor}{again})")
    mix = num / den
    margin = 1 + max(worst_noise, m.min_margin)
    bar = ctx.beat * margin
    metrics.update(speedup=mix, noise=worst_noise, bar=bar, beat=ctx.beat)
    anchors = "; ".join(f"anchor for {op}: {ctx.target.ops[op].anchor_name}" for op in ctx.ops
                        if ctx.target.ops[op].anchor_name and m.anchor)
    parent = f", its parent's {ctx.beat:.2f}x x {margin:.2f}" if ctx.beat > 1 else ""
    summary = (f"served mix {mix:.2f}x (bar {bar:.2f}x{parent}); " + "; ".join(lines)
               + (f" ({anchors})" if anchors else ""))
    if not mix > bar:                                  # NaN never passes
        if ctx.beat > 1 and mix > margin:
            raise Rejected(f"faster than the baseline but not than its parent beyond noise: {summary}", **metrics)
        raise Rejected(f"not faster than the baseline beyond noise: {summary}", **metrics)
    return StageResult.passed("microbench", summary, **metrics)
