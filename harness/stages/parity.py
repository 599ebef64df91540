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
from harness.stages.common import EvalContext, Rejected, diff, draw, run_trial


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)) and torch.equal(a.isnan(), b.isnan())


def parity_stage(ctx: EvalContext) -> StageResult:
    p = ctx.cfg.stages.parity
    checks, worst = 0, 0.0
    dist_i = 0
    for op in ctx.ops:
        for case in ctx.cases(op):
            for _ in range(p.checks_per_shape if case.weight > 0 else 1):
                dist = p.distributions[dist_i % len(p.distributions)]
                dist_i += 1
                trial = draw(ctx, case, dist)
                outs, reply = run_trial(ctx, trial, repeat=p.repeat_calls)
                where = f"{case.label}, {dist} inputs"
                if reply.get("inputs_modified"):
                    raise Rejected(f"{where}: the candidate wrote to its inputs {reply['inputs_modified']}")
                d = diff(outs[0], trial.ref, atol=trial.tol.max_abs)
                if not trial.tol.admits(d):
                    raise Rejected(f"{where}, output shape {list(outs[0].shape)}: {d.describe()} "
                                   f"(tolerance: max abs {trial.tol.max_abs:.3g}, relative L2 {trial.tol.rel_l2:.3g})",
                                   max_abs=d.max_abs, rel_l2=d.rel_l2)
                for i, again in enumerate(outs[1:], start=2):
                    if not _bitwise_equal(outs[0], again):
                        dd = diff(again, outs[0], atol=0.0)
                        raise Rejected(f"{where}: call {i} on identical inputs disagrees with call 1 "
                                       f"({dd.describe()}): a race or a stale cache")
                worst = max(worst, d.max_abs / trial.tol.max_abs, d.rel_l2 / trial.tol.rel_l2)
                checks += 1
    return StageResult.passed("parity", f"{checks} checks on fresh inputs within tolerance",
                              checks=float(checks), worst_error_over_tolerance=worst)
