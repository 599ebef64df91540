"""Stage 2, dispatch: is the candidate's own kernel what does the work and produces the output?

Three observations on fresh served inputs, each able to reject:
  audit    — the aten ops the candidate issues outside its kernels: none of the library-compute ops,
             and no more elements from compute ops than a small fraction of the op's multiply-adds
             (allocation, views, copies, gathers and selects are plumbing and free);
  ablation — the same call with every Triton launch skipped must NOT still give the right answer
             (if it does, the kernel is not what produces the output);
  profile  — on CUDA, the launched kernels by name: no library compute kernels, and the candidate's
             own Triton kernels hold most of the device time.
"""
from __future__ import annotations

from harness.records import StageResult
from harness.stages.common import EvalContext, Rejected, candidate_raised, diff, draw, run_trial

# Ops that allocate, reshape, move or select memory without doing arithmetic on it.
PLUMBING = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "fill", "fill_", "zero_", "arange",
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "as_strided",
    "slice", "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach", "lift_fresh",
    "copy_", "_to_copy", "clone", "contiguous", "cat", "stack", "index", "index_select", "gather", "masked_fill",
    "where", "view_as_real", "view_as_complex", "_local_scalar_dense", "resolve_conj", "resolve_neg", "flatten",
    "unflatten", "repeat_interleave", "repeat", "_reshape_alias", "set_", "record_stream", "lift_fresh_copy",
}


def _audit(ctx: EvalContext, op: str, reply: dict, madds: float) -> dict[str, float]:
    d = ctx.cfg.stages.dispatch
    elements, calls = reply.get("op_elements", {}), reply.get("op_calls", {})
    forbidden = sorted(n for n in calls if n in set(d.forbidden_ops))
    if forbidden:
        listed = ", ".join(f"aten::{n} x{calls[n]}" for n in forbidden)
        raise Rejected(f"{op}: library compute instead of the candidate's kernel: {listed}")
    compute = {n: e for n, e in elements.items() if n not in PLUMBING}
    work = float(sum(compute.values()))
    if work > d.aux_work_fraction * madds:
        top = ", ".join(f"aten::{n} ({e:.0f} elements)" for n, e in sorted(compute.items(), key=lambda x: -x[1])[:5])
        raise Rejected(f"{op}: torch ops outside the kernel produce {work:.0f} elements, more than "
                       f"{d.aux_work_fraction:.0%} of the op's {madds:.0f} multiply-adds: {top}")
    return {f"{op}_torch_compute_elements": work}


def _profile(ctx: EvalContext, op: str, trial, launched: set[str]) -> dict[str, float]:
    d = ctx.cfg.stages.dispatch
    reply = ctx.request({"cmd": "profile", "op": op, "inputs": trial.recipe(ctx)}, f"profiling {op}")
    if not reply.get("ok"):
        raise candidate_raised(f"{op}: the candidate raised under the profiler", reply)
    kernels: dict[str, float] = reply.get("kernels", {})
    total = sum(kernels.values()) or 1e-9
    library = {k: us for k, us in kernels.items() if any(p in k.lower() for p in d.library_kernel_patterns)
               and not any(k.startswith(n) for n in launched)}
    if library:
        names = ", ".join(f"{k} ({us / total:.0%})" for k, us in sorted(library.items(), key=lambda x: -x[1])[:4])
        raise Rejected(f"{op}: library kernels run on the device: {names}")
    own = sum(us for k, us in kernels.items() if any(k.startswith(n) for n in launched))
    if own / total < d.min_own_device_share:
        others = ", ".join(f"{k} ({us / total:.0%})" for k, us in sorted(kernels.items(), key=lambda x: -x[1])[:4])
        raise Rejected(f"{op}: the candidate's Triton kernels hold {own / total:.0%} of device time "
                       f"(at least {d.min_own_device_share:.0%} required); kernels: {others}")
    return {f"{op}_own_device_share": own / total}


def dispatch_stage(ctx: EvalContext) -> StageResult:
    metrics: dict[str, float] = {}
    for op in ctx.ops:
        case = ctx.target.compile_case(ctx.shapes, op)
        audit = draw(ctx, case, "normal")
        _, reply = run_trial(ctx, audit, mode="audit")
        launched = set(reply.get("launches", {}))
        if not launched:
            raise Rejected(f"{op}: no Triton kernel was launched for a call on fresh inputs: the output is "
                           "computed elsewhere or returned from a cache")
        metrics.update(_audit(ctx, op, reply, ctx.target.ops[op].cost(audit.inputs).madds))

        ablated = draw(ctx, case, "normal")
        (out,), _ = run_trial(ctx, ablated, mode="ablate")
        if ablated.tol.admits(diff(out, ablated.ref)):
            raise Rejected(f"{op}: the output is still correct with every Triton launch skipped "
                           f"({', '.join(sorted(launched))}): the kernel is not what produces it")
        metrics[f"{op}_kernels"] = float(len(launched))
        if ctx.device.type == "cuda":
            metrics.update(_profile(ctx, op, audit, launched))
    return StageResult.passed("dispatch", "the candidate's own kernels do the work", **metrics)
