"""Stage 3, parity: the same function as the float64 reference, on what serving sends.

The plan, per op: every served shape (`checks_per_shape` times), every boundary shape and every served-limit
shape (once: batches of the served engine's max_running and one past it, prefill steps of max_prefill_tokens
and the longest served prompt). Every check draws fresh inputs from a secret seed and, from the same seed, its
sm_scale (a range around 1/sqrt(head_dim)) and what unused cache slots hold (NaN, zeros, stale values of other
sequences, finite randoms); distributions rotate per op from a secret start (normal, peaky queries, keys with
a large shared logit offset, the served model's own q, k, v); a served-shape check may be followed by its twin
(a band redrawn) or by the next layer of its step (every value redrawn, the index tensors handed as the call
before's objects). The ops' checks are interleaved in one worker, and every output is sent back again after
each of the next two checks: it must not have changed (decode and prefill returning views of one buffer are
each right alone and wrong together in a served step). The worker poisons the allocator before each call and
reports whether inputs changed; each call but a step's is repeated on identical inputs and must agree bit for bit. The
tolerance is the baseline's own error against float64 on the same inputs (the op's `calibration` where it
names a cheaper torch way that errs alike) times a factor, with a floor (config: stages.parity). Before the
first check (begun by the compile stage once the candidate is imported: `begin`), the candidate's kernels are
compiled for every shape class of the plan at once (`send_warm`; config warm_threads, warm_draws), while the
trusted side draws the first checks (within `_ahead_bytes`); the warm's library use is judged here, after
dispatch (`judge_warm`).
"""
from __future__ import annotations

import itertools
import random
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal, NamedTuple

import torch

from harness.records import StageResult
from harness.replies import Reply
from harness.stages.common import (EvalContext, Rejected, Trial, candidate_raised, collect_trial, diff,
                                   draw, draw_twin, no_library_compute, send_trial)
from harness.targets import Case
from harness.transport import DTYPE_NAMES

RECHECK_AFTER = 2          # every output is sent back after each of this many later checks
AHEAD_SHARE = 0.5          # of the evaluator's reserved GPU working memory: what checks drawn during the warm may hold
AHEAD_HOST_BYTES = 1 << 30  # the same bound where nothing is reserved (a CPU)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)) and torch.equal(a.isnan(), b.isnan())


def _where(trial) -> str:
    return f"{trial.case.label}, {trial.dist} inputs"


def _judge(trial, outs: list[torch.Tensor], reply: dict) -> float:
    """Raise Rejected if this trial's outputs fail; return its error as a fraction of the tolerance."""
    where = _where(trial)
    if reply.get("inputs_modified"):
        raise Rejected(f"{where}: the candidate wrote to its inputs {reply['inputs_modified']}")
    d = diff(outs[0], trial.ref, atol=trial.tol.max_abs)
    if not trial.tol.admits(d):
        raise Rejected(f"{where}, output shape {list(outs[0].shape)}: {d.describe()} "
                       f"(tolerance: max abs {trial.tol.max_abs:.3g}, relative L2 {trial.tol.rel_l2:.3g})",
                       max_abs=d.max_abs, rel_l2=d.rel_l2)
    for i, again in enumerate(outs[1:], start=2):
        if not _bitwise_equal(outs[0], again):
            raise Rejected(f"{where}: call {i} on identical inputs disagrees with call 1 "
                           f"({diff(again, outs[0], atol=0.0).describe()}): a race or a stale cache")
    return max(d.max_abs / trial.tol.max_abs, d.rel_l2 / trial.tol.rel_l2)


class Check(NamedTuple):
    """One check of the plan, by `kind`: "fresh", a case and its distribution with inputs drawn afresh; "twin", the
    check before it again with a part of its inputs redrawn (harness/stages/common.py `draw_twin`); "layer", the next
    layer of the check before it, called as a served step calls its layers (the same index tensors, no repeat of
    either call between them)."""
    case: Case
    dist: str
    kind: Literal["fresh", "twin", "layer"] = "fresh"

    @property
    def twin(self) -> bool:
        return self.kind == "twin"

    @property
    def layer(self) -> bool:
        return self.kind == "layer"


def plan_checks(ctx: EvalContext) -> list[Check]:
    """Each op's checks with its distributions rotated from a secret start, the ops interleaved; a served-shape
    check is followed by its twin with the odds `twins` (config), drawn in secret: which calls are twins, and so
    which calls a cache keyed on part of the inputs must not answer, is known only here; else, with the odds
    `layers`, by the next layer of its step (at once: a twin between them would be a call no served step makes)."""
    p, coin = ctx.cfg.stages.parity, secrets.SystemRandom()
    per_op = []
    for op in ctx.ops:
        cases = [c for c in ctx.cases(op, limits=True) for _ in range(p.checks_per_shape if c.weight > 0 else 1)]
        start = secrets.randbelow(len(p.distributions))
        per_op.append([Check(c, p.distributions[(start + j) % len(p.distributions)]) for j, c in enumerate(cases)])
    plan = [check for round_ in itertools.zip_longest(*per_op) for check in round_ if check is not None]
    with_twins = []
    for check in plan:
        with_twins.append(check)
        if ctx.target.twin is not None and check.case.weight > 0 and coin.random() < p.twins:
            with_twins.append(check._replace(kind="twin"))
        elif ctx.target.layer is not None and check.case.weight > 0 and coin.random() < p.layers:
            with_twins.append(check._replace(kind="layer"))
    return with_twins


def _ahead_bytes(ctx: EvalContext) -> int:
    """How much memory the checks drawn while the worker compiles may hold at once: each waits, inputs and
    float64 reference, until its turn and its judgment. On CUDA, AHEAD_SHARE of the evaluator's reserved working
    memory (worker.trusted_gpu_bytes, harness/gpu_memory.py): the rest stays for what each check takes while
    it runs (the float64 reference's intermediates, a GiB or two at the served limits; the outputs read back).
    The last check drawn may pass the bound by its own size (1.3 GiB at most, a served-limit decode); once the
    checks run, a check drawn ahead is let go of as in the loop (after its last recheck), so what they hold only
    shrinks. The served plan holds up to about 11 GiB in all, so the default 16 GiB reserve lets most of it be
    drawn during the warm; the checks past the bound are drawn in the loop as before, one ahead. A CPU
    reserves nothing: AHEAD_HOST_BYTES of host memory (its plan holds a few MiB)."""
    if ctx.device.type == "cuda":
        return int(AHEAD_SHARE * ctx.reserved.working_bytes) if ctx.reserved is not None else 0
    return AHEAD_HOST_BYTES


def _draw_ahead(checks: int, drawn: Callable[[int], Trial], budget: int, replied: Callable[[], bool]) -> deque[Trial]:
    """The first checks, drawn (`drawn(i)`: check i of the plan) while the worker compiles: each is kept here
    until its turn (the worker sees nothing of a check before it is sent). Drawn until all `checks` are, the
    ones drawn hold `budget` bytes or more, or, past the first (needed at once either way), the warm's reply
    waits to be read (`replied`): from then on running the checks is what overlaps the draws."""
    ahead: deque[Trial] = deque()
    held = 0
    while len(ahead) < checks and held < budget and not (ahead and replied()):
        ahead.append(drawn(len(ahead)))
        held += ahead[-1].nbytes()
    return ahead


@dataclass
class Warming:
    """A warm request sent and not yet collected."""
    classes: int
    calls: int
    t0: float


def send_warm(ctx: EvalContext, plan: list[Check]) -> Warming | None:
    """Ask the worker to compile the candidate's kernels for each shape class of the plan at once, before the
    first check (config stages.parity.warm_threads, per device; 0: skipped, None returned): `warm_draws` calls per
    class, each on fresh lengths (so that more of the class's specializations are met), with nothing launched,
    the compiles `threads` at a time (harness/worker.py `warm`). Triton compiles per
    specialization and a fresh worker has an empty cache, so otherwise each class compiles in turn inside its
    first check. Sent without waiting: the trusted side draws the first checks while the worker compiles
    (`begin`); `collect_warm` reads the reply."""
    threads = getattr(ctx.cfg.stages.parity.warm_threads, ctx.device.type)
    if not threads:
        return None
    classes, calls = warm_calls(ctx, plan)
    t0 = time.monotonic()
    ctx.send({"cmd": "warm", "calls": calls, "threads": threads}, "compiling the shape classes")
    return Warming(classes, len(calls), t0)


def warm_calls(ctx: EvalContext, plan: list[Check]) -> tuple[int, list[dict]]:
    """The warm's recipes: each shape class of the plan `warm_draws` times, each from a fresh seed; and how many
    classes."""
    classes = list({(check.case.op, check.case.label): check.case for check in plan}.values())
    calls = []
    for case in classes:
        for _ in range(max(1, getattr(ctx.cfg.stages.parity.warm_draws, ctx.device.type))):   # fresh lengths each
            seed = secrets.randbits(62)
            drawn = ctx.target.vary(case, "normal", random.Random(seed), ctx) if ctx.target.vary is not None else case
            calls.append({"case": drawn, "dist": "normal", "seed": seed, "dtype": DTYPE_NAMES[ctx.dtype]})
    return len(classes), calls


def collect_warm(ctx: EvalContext, sent: Warming) -> tuple[Reply, dict[str, float]]:
    """The warm's reply (a candidate that raised fatally there is rejected at once), and the stage's metrics of
    it (warm_s: from the request to its reply collected, the checks drawn meanwhile included). Its library use is
    judged by `judge_warm`, in the parity stage, after dispatch has judged the candidate's calls its own way."""
    reply = ctx.collect("compiling the shape classes", "warm")
    if not reply.ok:
        raise candidate_raised("compiling the shape classes", reply)
    return reply, {"warm_s": round(time.monotonic() - sent.t0, 3), "warm_classes": float(sent.classes),
                   "warm_calls": float(sent.calls), "warm_failed": float(reply.failed),
                   "worker_warm_inputs_s": reply.seconds.get("inputs_s", 0.0),
                   "worker_warm_calls_s": reply.seconds.get("calls_s", 0.0),
                   "worker_warm_compiles_s": reply.seconds.get("compiles_s", 0.0)}


def judge_warm(ctx: EvalContext, start: "Start") -> None:
    """The warm's calls are held to `no_library_compute` like every call; their outputs are dropped, so their
    torch work is not weighed against the op's (`library_use`)."""
    if start.warm_reply is not None:
        no_library_compute(ctx, f"parity (compiling the {int(start.warmed['warm_classes'])} shape classes)",
                           start.warm_reply)


@dataclass
class Start:
    """Parity begun (`begin`): its plan, the warm's reply and metrics, the first checks drawn while the worker
    compiled, what the draws took so far. The compile stage begins it once the candidate is imported, so that the
    first call it makes finds its kernels compiled, in parallel, with every class parity will check."""
    plan: list[Check]
    ahead: deque
    drawing: dict[str, float]
    warm_reply: Reply | None = None
    warmed: dict[str, float] = field(default_factory=dict)
    last: Trial | None = None              # the check drawn last (a twin's or a layer's check)


def _drawn(ctx: EvalContext, start: Start, i: int) -> Trial:
    """Check i of the plan, drawn (checks are drawn in order: a twin's check is the one drawn last)."""
    t0 = time.monotonic()
    check = start.plan[i]
    trial = draw_twin(ctx, start.last, layer=check.layer) if check.kind != "fresh" else \
        draw(ctx, check.case, check.dist, vary=True)
    start.drawing["draw_s"] += time.monotonic() - t0
    start.last = trial
    return trial


def begin(ctx: EvalContext) -> Start:
    """The plan drawn, the warm sent (`send_warm`), the first checks drawn while the worker compiles
    (`_draw_ahead`) and the warm's reply collected. What the worker is sent, and when, is as without the
    overlap: the warm, its reply collected, then (in the parity stage) the checks one at a time."""
    start = Start(plan_checks(ctx), deque(), {"draw_s": 0.0, "draw_during_warm_s": 0.0, "drawn_during_warm": 0.0})
    if (warming := send_warm(ctx, start.plan)) is not None:
        start.ahead = _draw_ahead(len(start.plan), lambda i: _drawn(ctx, start, i), _ahead_bytes(ctx), ctx.replied)
        start.drawing.update(draw_during_warm_s=start.drawing["draw_s"], drawn_during_warm=float(len(start.ahead)))
        start.warm_reply, start.warmed = collect_warm(ctx, warming)
    return start


def parity_stage(ctx: EvalContext) -> StageResult:
    p = ctx.cfg.stages.parity
    start, ctx.parity = ctx.parity or begin(ctx), None      # begun by the compile stage, or here
    judge_warm(ctx, start)
    plan, ahead, drawing, warmed = start.plan, start.ahead, start.drawing, start.warmed
    worst, pending, spent = 0.0, None, {"worker_inputs_s": 0.0, "worker_first_calls_s": 0.0, "worker_repeats_s": 0.0}
    firsts: dict[int, tuple] = {}            # check index -> (trial, its first output as read then)

    def settle(i: int, trial, rechecks: list[int], repeat: int) -> float:
        also = {f"kept{j}": tuple(firsts[j][1].shape) for j in rechecks}
        outs, reply = collect_trial(ctx, trial, repeat, also=also)
        took = reply.get("seconds")           # the worker's own account: the evaluator's cost figures only
        if isinstance(took, dict) and all(isinstance(v, (int, float)) for v in took.values()):
            spent["worker_inputs_s"] += took.get("inputs_s", 0.0)
            spent["worker_first_calls_s"] += took.get("call0_s", 0.0)
            spent["worker_repeats_s"] += sum(v for k, v in took.items() if k.startswith("call") and k != "call0_s")
        for j, now in zip(rechecks, outs[repeat:]):
            earlier, first = firsts[j]
            if not _bitwise_equal(first, now):
                between = "; then ".join(_where(t) for t in [firsts[k][0] for k in range(j + 1, i) if k in firsts] + [trial])
                raise Rejected(f"{_where(earlier)}: its output changed after it was returned, when later checks ran "
                               f"({between}): {diff(now, first, atol=0.0).describe()}. The returned tensor must be "
                               f"the caller's: no later call may write to it (does it share memory with another "
                               f"call's output?)")
        error = _judge(trial, outs[:repeat], reply)
        firsts[i] = (trial, outs[0])
        firsts.pop(i - RECHECK_AFTER - 1, None)
        return error

    for i in range(len(plan)):
        trial = ahead.popleft() if ahead else _drawn(ctx, start, i)   # drawn during the warm, or while the worker runs the last
        if pending is not None:
            worst = max(worst, settle(*pending))
        rechecks = [j for j in range(max(0, i - RECHECK_AFTER), i)]
        # a step's layers are called one after the other, as served: no repeat between them (a repeat's query equal
        # to the call before's would tell parity from a served step)
        step = plan[i].layer or (i + 1 < len(plan) and plan[i + 1].layer)
        repeat = 1 if step else p.repeat_calls
        send_trial(ctx, trial, repeat=repeat, keep=i, recheck=rechecks,
                   drop=[i - RECHECK_AFTER] if i >= RECHECK_AFTER else [], step=plan[i].layer)
        pending = (i, trial, rechecks, repeat)
    if pending is not None:
        worst = max(worst, settle(*pending))
    twins, layers = sum(check.twin for check in plan), sum(check.layer for check in plan)
    return StageResult.passed("parity", f"{len(plan)} checks on fresh inputs within tolerance ({twins} of them an "
                                        f"earlier check's inputs with a part redrawn, {layers} a step's next layer), "
                                        f"interleaved over {', '.join(ctx.ops)}, earlier outputs unchanged by later calls",
                              checks=float(len(plan)), twins=float(twins), layers=float(layers),
                              worst_error_over_tolerance=worst, **spent, **warmed,
                              **{k: round(v, 3) for k, v in drawing.items()})
