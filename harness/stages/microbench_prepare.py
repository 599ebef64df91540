"""Microbench's untimed first part (harness/stages/microbench.py), run while the GPU is still shared with the other
slots' untimed stages (harness/stages PREPARED_STAGES): the worker pays the trusted code's first uses (`send_prime`,
while the stage draws every case's inputs), compiles the candidate for the very input sets it will time
(`send_warm`), and makes one untimed round of calls on them (`first_calls`), so that the part of the stage that
holds the GPU alone spends its time timing. Nothing here is timed, and nothing here decides a figure; the calls
are watched and judged like every call. Also the worker's `time` request (`time_request`), which both parts send.
"""
from __future__ import annotations

import random
import secrets
import time

from harness.stages.common import EvalContext, candidate_raised, draw_timed, library_use, no_library_compute
from harness.targets import Case
from harness.transport import DTYPE_NAMES


IMPLS = ["candidate", "baseline", "baseline"]       # timed interleaved; the baseline twice: the noise band


def send_prime(ctx: EvalContext, plan: list[tuple[str, Case]]) -> None:
    """Ask the worker to pay the trusted code's first uses in its process (harness/worker_timing.py `prime`: the
    baseline's kernels, the spin kernel, events) on each timed op's small compile
    case, a public seed's inputs no check uses; sent without waiting, so it runs while this side draws the timed
    inputs, and before any timing: the first case timed no longer pays them inside its `time` request."""
    m = ctx.cfg.stages.microbench
    calls = [{"case": ctx.target.compile_case(ctx.shapes, op), "dist": "normal", "seed": 0, "dtype": DTYPE_NAMES[ctx.dtype],
              "baseline": ctx.target.ops[op].baseline_name} for op in dict.fromkeys(op for op, _ in plan)]
    ctx.send({"cmd": "prime", "calls": calls, "flush_bytes": m.l2_flush_bytes}, "priming the timing")


def collect_prime(ctx: EvalContext) -> dict[str, float]:
    """The prime's reply (its own seconds, and how long this side waited for it after its draws)."""
    t0 = time.monotonic()
    reply = ctx.collect("priming the timing", "prime")
    if not reply.ok:
        raise candidate_raised("the worker failed while priming the timing (before any candidate call)", reply)
    return {"prime_s": reply.seconds.get("prime_s", 0.0), "prime_wait_s": time.monotonic() - t0,
            "prime_failed": float(reply.failed)}


def send_warm(ctx: EvalContext, drawn: list[list]) -> float | None:
    """Ask the worker to compile the candidate's kernels for the very input sets it will be timed on (harness/worker.py
    `warm`: nothing launched, `stages.parity.warm_threads` compiles at once), in the shared part, after the prime.
    Parity's warm met other lengths: a kernel that specializes on an integer argument, or picks constexprs from
    lengths, may meet a new variant here, and would compile it in its first timed case with the GPU held alone
    (H200, eighteenth session: 0.37 s of compiles here in one of two cold evaluates of the reference decode). Many
    at once here; `first_calls` would find them one at a time. The time it was sent; None where warms are off."""
    threads = getattr(ctx.cfg.stages.parity.warm_threads, ctx.device.type)
    if not threads:
        return None
    calls = [t.recipe(ctx) for trials in drawn for t in trials]
    ctx.send({"cmd": "warm", "calls": calls, "threads": threads}, "compiling for the timed inputs")
    return time.monotonic()


def collect_warm(ctx: EvalContext, sent: float | None) -> dict[str, float]:
    """The warm's reply, its calls held to `no_library_compute` like every call (their outputs are dropped), and
    its figures."""
    if sent is None:
        return {}
    reply = ctx.collect("compiling for the timed inputs", "warm")
    if not reply.ok:
        raise candidate_raised("microbench: compiling for the timed inputs", reply)
    no_library_compute(ctx, "microbench (compiling for the timed inputs)", reply)
    return {"timed_warm_s": time.monotonic() - sent, "worker_timed_warm_compiles_s": reply.seconds.get("compiles_s", 0.0),
            "worker_timed_warm_compiles": float(reply.compiles)}


def first_calls(ctx: EvalContext, plan: list[tuple[str, Case]], drawn: list[list]) -> dict[str, float]:
    """One untimed round of candidate and baseline on every input set to be timed, in the shared part: a `time`
    request with one warmup round and no reps. Whatever a first call pays (the inputs' buffers and the
    allocator's segments, a kernel's first launch at a size, a library's plan for a new shape, an autotuner's
    choice) is paid here, not in the timed request's warmup with the GPU held alone (H200: that warmup took about
    1 s on one case of most candidates, none of it Triton compiles: run h200-two, eighteenth session's cold
    evaluate). The calls are watched and judged like every call; their outputs are not returned."""
    t0, worker_s, compiles = time.monotonic(), 0.0, 0
    for (_, case), trials in zip(plan, drawn):
        ctx.send(time_request(ctx, case, trials, warmup=1, reps=0), f"first calls of {case.label}")
    for op, case in plan:
        reply = ctx.collect(f"first calls of {case.label}", "time")
        if not reply.ok:
            raise candidate_raised(f"{case.label}: the candidate raised in its first calls on the timed inputs", reply)
        library_use(ctx, f"{op} (microbench, first calls of {case.label})", reply, float("inf"), 1)
        worker_s += sum(reply.seconds.values())
        compiles += reply.compiles
    return {"first_calls_s": time.monotonic() - t0, "worker_first_calls_s": worker_s,
            "worker_first_calls_compiles": float(compiles)}


def time_request(ctx: EvalContext, case, trials: list, warmup: int, reps: int) -> dict:
    """The worker's `time` request for one served case (harness/worker_timing.py `timed`)."""
    m = ctx.cfg.stages.microbench
    return {"cmd": "time", "op": case.op, "impls": IMPLS, "sets": [t.recipe(ctx) for t in trials],
            "warmup": warmup, "reps": reps, "flush_bytes": m.l2_flush_bytes, "cover_cycles": m.cover_cycles,
            "baseline": ctx.target.ops[case.op].baseline_name,
            # whose outputs come back to be checked: drawn with the sets, learnt only with the request, so a kernel
            # that is right on some calls only (counted per buffer) cannot know which of its reps is looked at
            "check_rep": trials[0].check_rep if trials else 0,
            # every other call's query is drawn from this request's own secret (harness/worker_timing.py)
            "per_call_nonce": secrets.randbits(48)}


def draw_sets(ctx: EvalContext, case) -> list:
    """The case's input sets, and (drawn in secret, one for the case) the rep whose outputs are checked: each set's
    reference is for the query that rep is timed on (`draw_timed`). Set i has the same lengths for every candidate
    (the target's `pin`, from `lengths_seed`, the case's shape and i), its payload a fresh secret draw: a candidate's
    speedup and its parent's, the bar, are of the same work."""
    m = ctx.cfg.stages.microbench
    check_rep = secrets.randbelow(m.reps) if m.reps else 0
    pin = ctx.target.pin or (lambda c, _: c)
    return [draw_timed(ctx, pin(case, random.Random(f"{m.lengths_seed}:{case.key}:{i}")), check_rep)
            for i in range(m.input_sets)]


def case_draws(ctx: EvalContext, case, first: list):
    """The input sets of each try at timing `case`: `first`, then sets drawn afresh for every try after it (the same
    lengths, new payloads, a new checked rep and query, and their references). A try's checked query comes back to the
    candidate in the clock's burst, and a candidate can make any try disagree: timing the same sets again would tell
    it which rep is checked (an attacker's review, 2026-12-07)."""
    yield first
    del first
    while True:
        yield draw_sets(ctx, case)
