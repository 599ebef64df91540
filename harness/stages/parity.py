"""Stage 3, parity: the same function as the float64 reference, on every served and boundary shape.

Every check draws fresh inputs from a secret seed; distributions rotate across checks (normal,
peaky queries, keys with a large shared logit offset); unused cache slots hold NaN; the worker
poisons the allocator before each call and reports whether inputs changed. Each call is repeated on
identical inputs and must agree bit for bit. The tolerance is the baseline's own error against
float64 on the same inputs times a factor, with a floor (config: stages.parity).
"""
from __future__ import annotations

import torch

from harness.records import StageResult
from harness.stages.common import EvalContext, Rejected, collect_trial, diff, draw, send_trial


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)) and torch.equal(a.isnan(), b.isnan())


def _judge(trial, outs: list[torch.Tensor], reply: dict) -> float:
    """Raise Rejected if this trial's outputs fail; return its error as a fraction of the tolerance."""
    where = f"{trial.case.label}, {trial.dist} inputs"
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


def parity_stage(ctx: EvalContext) -> StageResult:
    p = ctx.cfg.stages.parity
    plan = [case for op in ctx.ops for case in ctx.cases(op)
            for _ in range(p.checks_per_shape if case.weight > 0 else 1)]
    worst, pending, spent = 0.0, None, {"worker_inputs_s": 0.0, "worker_first_calls_s": 0.0, "worker_repeats_s": 0.0}

    def settle(trial) -> float:
        outs, reply = collect_trial(ctx, trial, p.repeat_calls)
        took = reply.get("seconds")           # the worker's own account: the evaluator's cost figures only
        if isinstance(took, dict) and all(isinstance(v, (int, float)) for v in took.values()):
            spent["worker_inputs_s"] += took.get("inputs_s", 0.0)
            spent["worker_first_calls_s"] += took.get("call0_s", 0.0)
            spent["worker_repeats_s"] += sum(v for k, v in took.items() if k.startswith("call") and k != "call0_s")
        return _judge(trial, outs, reply)

    for i, case in enumerate(plan):
        trial = draw(ctx, case, p.distributions[i % len(p.distributions)])   # while the worker runs the last
        if pending is not None:
            worst = max(worst, settle(pending))
        send_trial(ctx, trial, repeat=p.repeat_calls)
        pending = trial
    if pending is not None:
        worst = max(worst, settle(pending))
    return StageResult.passed("parity", f"{len(plan)} checks on fresh inputs within tolerance",
                              checks=float(len(plan)), worst_error_over_tolerance=worst, **spent)
