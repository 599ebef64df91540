"""Stage 2, dispatch: is the candidate's own kernel what does the work and produces the output?

Three observations on fresh served inputs, each able to reject:
  audit    — the aten ops the candidate issues outside its kernels: none of the library-compute ops,
             and no more elements from compute ops than a small fraction of the op's multiply-adds
             (allocation, views, copies, gathers and selects are plumbing and free). The worker watches
             every call it makes for the candidate, not only this one, and every stage's calls are held to
             the same rule (`library_use` in harness/stages/common.py): a candidate that runs its kernel
             only while it is watched has no unwatched call to save the library for;
  ablation — the same call with every Triton launch skipped must NOT still give the right answer
             (if it does, the kernel is not what produces the output);
  profile  — on CUDA, the launched kernels by name: no library compute kernels, and the candidate's
             own Triton kernels hold most of the device time.
"""
from __future__ import annotations

from harness.records import StageResult
from harness.stages.common import EvalContext, Rejected, candidate_raised, diff, draw, library_use, run_trial


def _profile(ctx: EvalContext, op: str, trial, launched: set[str]) -> dict[str, float]:
    d = ctx.cfg.stages.dispatch
    reply = ctx.request({"cmd": "profile", "op": op, "inputs": trial.recipe(ctx)}, f"profiling {op}", "profile")
    if not reply.ok:
        raise candidate_raised(f"{op}: the candidate raised under the profiler", reply)
    library_use(ctx, f"{op} (dispatch, under the profiler)", reply, float("inf"), 1)
    kernels = reply.kernels
    total = sum(kernels.values()) or 1e-9
    library = {k: us for k, us in kernels.items() if any(p in k.lower() for p in d.library_kernel_patterns)
               and k not in launched}
    if library:
        names = ", ".join(f"{k} ({us / total:.0%})" for k, us in sorted(library.items(), key=lambda x: -x[1])[:4])
        raise Rejected(f"{op}: library kernels run on the device: {names}")
    own = sum(us for k, us in kernels.items() if k in launched)   # by exact name: a kernel named `void` or
    # `sm` would otherwise claim every library kernel whose name starts so ("void at::native::...", "sm90_...")
    if not own / total >= d.min_own_device_share:
        others = ", ".join(f"{k} ({us / total:.0%})" for k, us in sorted(kernels.items(), key=lambda x: -x[1])[:4])
        raise Rejected(f"{op}: the candidate's Triton kernels hold {own / total:.0%} of device time "
                       f"(at least {d.min_own_device_share:.0%} required); kernels: {others}")
    return {f"{op}_own_device_share": own / total}


def dispatch_stage(ctx: EvalContext) -> StageResult:
    metrics: dict[str, float] = {}
    plumbing = set(ctx.cfg.stages.dispatch.plumbing_ops)
    for op in ctx.ops:
        case = ctx.target.compile_case(ctx.shapes, op)
        audit = draw(ctx, case, "normal")
        _, reply = run_trial(ctx, audit, mode="audit")      # run_trial holds it to library_use
        launched = set(reply.launches)
        metrics[f"{op}_torch_compute_elements"] = float(sum(
            e for n, e in reply.op_elements.items() if n not in plumbing))

        ablated = draw(ctx, case, "normal")
        (out,), _ = run_trial(ctx, ablated, mode="ablate")
        if ablated.tol.admits(diff(out, ablated.ref)):
            raise Rejected(f"{op}: the output is still correct with every Triton launch skipped "
                           f"({', '.join(sorted(launched))}): the kernel is not what produces it")
        metrics[f"{op}_kernels"] = float(len(launched))
        if ctx.device.type == "cuda":
            metrics.update(_profile(ctx, op, audit, launched))
    return StageResult.passed("dispatch", "the candidate's own kernels do the work", **metrics)
