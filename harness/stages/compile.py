"""Stage 1, compile: is this a candidate at all, and do its kernels build and launch?

Trusted side first (no candidate code runs): the source parses, names only the allowlisted surface
(harness/allowlist.py: the modules, names, builtins and attributes of config `stages.compile`), and
defines contract functions with the contract's argument names in order. Then a fresh sandboxed
worker imports it; when parity will run, parity is begun (harness/stages/parity.py `begin`: its kernels compiled
for every shape class parity checks, in parallel, while this side draws the first checks), and then each op is
called once on the smallest served shape, finding most of its kernels compiled; import and compiler errors
come back verbatim (trimmed) as feedback for the coder (a warm call that fails is left for a call to report).
"""
from __future__ import annotations

import ast
import time

from harness import allowlist
from harness.compiled import KEPT
from harness.records import StageResult
from harness.stages import parity
from harness.syntax import parse
from harness.stages.common import EvalContext, Rejected, candidate_raised, draw, run_trial


def static_check(ctx: EvalContext) -> list[str]:
    """Return the ops the source defines; raise Rejected for what can be refused without running it."""
    try:
        tree = parse(ctx.source)
    except SyntaxError as e:
        raise Rejected(f"syntax error at line {e.lineno}: {e.msg}\n    {(e.text or '').rstrip()}") from None
    try:
        allowlist.check(tree, allowlist.Rules.from_config(ctx.cfg.stages.compile))
    except allowlist.Refused as e:
        raise Rejected(f"{e} (a kernel file may name only the allowlisted surface: docs/EVALUATOR.md)",
                       failure="allowlist") from None
    defined = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    ops = []
    for name, op in ctx.target.ops.items():
        fn = defined.get(name)
        if fn is None:
            continue
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if params != list(op.arg_names) or fn.args.vararg or fn.args.kwonlyargs:
            raise Rejected(f"line {fn.lineno}: {name}({', '.join(params)}) must be {name}({', '.join(op.arg_names)})")
        ops.append(name)
    if not ops:
        raise Rejected(f"defines none of the contract's functions ({', '.join(ctx.target.ops)}) at module level")
    return ops


def compile_stage(ctx: EvalContext) -> StageResult:
    ctx.ops = static_check(ctx)
    ctx.worker = ctx.pool.spawn(ctx.source)
    carried = KEPT.given([ctx.source]) if ctx.cfg.worker.carry_bytes else []   # what its own earlier sandbox compiled
    ctx.send({"cmd": "load", "path": str(ctx.worker.workdir / "candidate.py"), "carried": carried,
              "carry_bytes": ctx.cfg.worker.carry_bytes, "gpu_memory_fraction": ctx.cfg.worker.gpu_memory_fraction},
             "importing the candidate")
    trials = [draw(ctx, ctx.target.compile_case(ctx.shapes, op), "normal") for op in ctx.ops]  # while it imports
    reply = ctx.collect("importing the candidate", "load")
    if not reply.ok:
        raise candidate_raised("import failed", reply)
    metrics = {"ops": float(len(ctx.ops)), "load_s": reply.wall_s, "carried_files": float(reply.carried)}
    if "parity" in ctx.to_run:
        # every shape class parity will check compiled at once before the first call here (parity.begin)
        t0 = time.monotonic()
        ctx.parity = parity.begin(ctx)
        metrics["parity_begun_s"] = time.monotonic() - t0
    for op, trial in zip(ctx.ops, trials):
        _, call = run_trial(ctx, trial)
        metrics[f"{op}_first_call_s"] = call.wall_s
    return StageResult.passed("compile", f"built and launched {', '.join(ctx.ops)}; sandbox: {ctx.worker.sandbox}",
                              **metrics)
