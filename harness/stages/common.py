"""What every stage shares: the evaluation context, sending a case to the worker, comparing outputs.

All of it runs in the trusted evaluator: inputs are drawn here from secret seeds, references and
baseline errors are computed here, and the worker's outputs are read back and judged here. Every
reply is validated against its request's schema before it is read (`EvalContext.collect`), and every
call the worker makes for the candidate, in any stage, is held to `library_use`.
"""
from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from harness.compare import Diff, Tolerance, diff  # noqa: F401  (the stages' names for them)
from harness.config import Config
from harness import replies
from harness.gpu_memory import Reserve
from harness.records import FailureKind
from harness.pool import Pool
from harness.worker_handle import WorkerFailure, WorkerHandle
from harness.replies import MalformedReply, Reply
from harness.targets import Case, Inputs, Op, Target
from harness.targets.base import redrawn
from harness.transport import DTYPE_NAMES, ProtocolError, read_arena

if TYPE_CHECKING:
    from harness.stages.parity import Start


class Rejected(Exception):
    """A stage's verdict on the candidate, raised from deep inside a check; carries metrics, and the failure
    kind where a reader needs more than the reason's words (harness/records.py FailureKind)."""

    def __init__(self, reason: str, failure: FailureKind | None = None, **metrics: float) -> None:
        super().__init__(reason)
        self.failure, self.metrics = failure, metrics


@dataclass
class EvalContext:
    cfg: Config
    target: Target
    shapes: Any                      # the target's config section for this device
    device: torch.device             # where the trusted side computes references (and the worker runs)
    dtype: torch.dtype
    pool: Pool
    source: str
    ops: list[str] = field(default_factory=list)
    worker: WorkerHandle | None = None
    deadline: float = 0.0
    stage: str = ""
    worker_s: float = 0.0            # this stage's time spent waiting on the worker (the rest is ours)
    beat: float = 1.0                # the served-mix speedup over torch to beat: the candidate's parent's
    head: str | None = None          # the source of the current head of its op (the replay's other arm); None: torch's
    other_heads: dict[str, str] = field(default_factory=dict)   # the other ops' heads, served in both arms of the replay
    reserved: Reserve | None = None  # the evaluator's own GPU memory, taken before any worker (CUDA)
    to_run: frozenset[str] = frozenset()   # the stages this evaluation runs if none rejects (up to its `until`)
    parity: "Start | None" = None    # parity begun early by the compile stage (harness/stages/parity.py `begin`)
    # A prepared stage (harness/stages PREPARED_STAGES) calls this where its timing begins: the slot asks for its
    # GPU alone there (evaluate.py); it returns the seconds it waited for the grant, which are not the stage's
    begin_timing: Callable[[], float] = lambda: 0.0

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def request(self, msg: dict, doing: str, kind: str) -> Reply:
        self.send(msg, doing)
        return self.collect(doing, kind)

    def send(self, msg: dict, doing: str) -> None:
        assert self.worker is not None
        self.worker.send(msg, doing)

    def replied(self) -> bool:
        """Whether the reply to the oldest request sent can be collected without waiting (worker_handle.py `replied`)."""
        assert self.worker is not None
        return self.worker.replied()

    def collect(self, doing: str, kind: str) -> Reply:
        """The reply to the oldest request sent, validated against the schema of a `kind` request
        (harness/replies.py). One that does not fit is a rejection naming the stage and the field, and its
        worker is stopped: nothing it says afterwards is read."""
        assert self.worker is not None
        t0 = time.monotonic()
        try:
            raw = self.worker.collect(self.remaining(), doing)
        finally:
            self.worker_s += time.monotonic() - t0
        try:
            return replies.parse(kind, raw, wall_s=raw.pop("_wall_s", 0.0), arenas=raw.pop("_arenas", []))
        except MalformedReply as e:
            self.worker.kill()
            raise Rejected(f"{self.stage}: malformed reply while {doing}: {e}", "protocol") from None

    def cases(self, op: str, served: bool = True, boundary: bool = True, limits: bool = False) -> list[Case]:
        """The op's served shapes, boundary shapes and (with `limits`) the served engine's largest calls."""
        out = self.target.served_cases(self.shapes) if served else []
        out += self.target.boundary_cases(self.shapes) if boundary else []
        if limits and self.target.limit_cases is not None:
            from harness.served.limits import served_limits
            out += self.target.limit_cases(self.shapes, served_limits(self.cfg, self.device.type))
        return [c for c in out if c.op == op]


def tolerance(ctx: EvalContext, baseline_diff: Diff) -> Tolerance:
    p = ctx.cfg.stages.parity
    floor = p.floors[DTYPE_NAMES[ctx.dtype]]
    return Tolerance.beside(baseline_diff, p.tolerance_factor, floor.max_abs, floor.rel_l2)


@dataclass
class Trial:
    """One case drawn fresh: inputs, the float64 reference, the tolerance the baseline earns here."""
    case: Case
    dist: str
    seed: int
    inputs: Inputs
    ref: torch.Tensor
    tol: Tolerance
    # Microbench's timed sets (`draw_timed`): every timed call's `Op.per_call` argument is redrawn, the checked call's
    # (rep `check_rep`) from `per_call_seed`; `ref` and `tol` are for that draw, not for `inputs`' own.
    per_call_seed: int | None = None
    check_rep: int = 0

    def nbytes(self) -> int:
        """The memory this trial holds while it waits to be judged: its inputs (the whole of what each is a view of)
        and its reference."""
        return sum(t.untyped_storage().nbytes() for t in [*self.inputs.values(), self.ref] if isinstance(t, torch.Tensor))

    def recipe(self, ctx: EvalContext) -> dict:
        """What the worker needs to rebuild these exact inputs on its device (nothing else)."""
        return {"case": self.case, "dist": self.dist, "seed": self.seed, "dtype": DTYPE_NAMES[ctx.dtype],
                **({} if self.per_call_seed is None else {"per_call_seed": self.per_call_seed})}


def draw(ctx: EvalContext, case: Case, dist: str, vary: bool = False) -> Trial:
    """Fresh inputs from a new secret seed. The seed is sent with the request that uses it, so the
    candidate learns each one only with inputs it is handed anyway, and never the next one; the
    worker rebuilds the inputs from it instead of receiving gigabytes, and any divergence (a
    tampered generator) can only make the candidate's output disagree with this reference. With
    `vary` (parity), the target draws the rest of the check from the same seed (sm_scale, what
    unused cache slots hold, ...) into the case the worker is sent."""
    seed = secrets.randbits(62)
    if vary and ctx.target.vary is not None:
        case = ctx.target.vary(case, dist, random.Random(seed), ctx)
    return _trial(ctx, case, dist, seed)


def draw_timed(ctx: EvalContext, case: Case, check_rep: int) -> Trial:
    """An input set for microbench: fresh inputs from a new secret seed, as `draw`, and (for an op with a per-call
    argument, `Op.per_call`: attention's query) a second secret seed for that argument in the timed call whose output
    is checked (rep `check_rep`, drawn in secret per case): the reference and the tolerance are for the inputs with
    it (harness/targets/base.py `redrawn`). Every other timed call gets one of its own (harness/worker_timing.py),
    so none of them repeats the inputs of one before it."""
    fresh = ctx.target.ops[case.op].per_call is not None
    return _trial(ctx, case, "normal", secrets.randbits(62), per_call_seed=secrets.randbits(62) if fresh else None,
                  check_rep=check_rep)


def draw_twin(ctx: EvalContext, earlier: Trial, layer: bool = False) -> Trial:
    """`earlier`'s check again with one part of its inputs redrawn from a new secret seed (the target's `twin`
    picks the part from that seed and names it in the label): an output kept from the earlier call and handed
    back on a key the part does not enter is wrong there. With `layer`, the next layer of `earlier`'s step (the
    target's `layer`): every payload redrawn, the lengths and host facts the same."""
    seed, how = secrets.randbits(62), ctx.target.layer if layer else ctx.target.twin
    return _trial(ctx, how(earlier.case, earlier.seed, earlier.inputs, random.Random(seed)), earlier.dist, seed)


def _trial(ctx: EvalContext, case: Case, dist: str, seed: int, per_call_seed: int | None = None,
           check_rep: int = 0) -> Trial:
    op = ctx.target.ops[case.op]
    inputs = op.make_inputs(case, dist, seed, ctx.device, ctx.dtype)
    checked = inputs if per_call_seed is None else {**inputs, op.per_call: redrawn(inputs[op.per_call], per_call_seed)}
    ref = op.reference(**checked)
    return Trial(case, dist, seed, inputs, ref, tolerance(ctx, diff(op.calibrate(checked), ref)), per_call_seed, check_rep)


def candidate_raised(what: str, reply: Reply) -> Rejected:
    """The candidate's exception, from the worker's reply, as a rejection; a CUDA error is marked
    (failure `cuda_error`), so that the device is checked before the next candidate gets it."""
    return Rejected(f"{what}:\n{reply.get('error', '')}", "cuda_error" if reply.get("cuda_error") else None)


def library_use(ctx: EvalContext, where: str, reply: Reply, madds: float, calls: int) -> float:
    """Judge the aten ops the worker saw the candidate issue (inside its Triton launches too) on `calls` calls
    (every call it makes for the candidate is watched, in every stage: a candidate cannot save its library
    calls for when no check is looking) by `dispatch_rules`. Returns the elements torch compute ops touched."""
    return dispatch_rules(ctx.cfg.stages.dispatch, where, reply.get("op_calls") or {}, reply.get("op_elements") or {},
                          madds * calls)


def no_library_compute(ctx: EvalContext, where: str, reply: Reply) -> None:
    """Rejected if the worker saw the candidate issue any library compute op (dispatch.forbidden_ops)."""
    dispatch_rules(ctx.cfg.stages.dispatch, where, reply.get("op_calls") or {}, {}, float("inf"))


def dispatch_rules(d, where: str, op_calls: dict, op_elements: dict, madds: float) -> float:
    """The rule every watched call of a candidate is held to, in the worker's stages and in its served process
    (the replay): Rejected for any library compute op (`d.forbidden_ops`, config stages.dispatch), and for torch
    compute beyond `d.aux_work_fraction` of the calls' `madds` multiply-adds (`d.plumbing_ops` are free). Returns
    the elements torch compute ops touched (each op's output, or its largest argument where larger: harness/probes.py)."""
    forbidden = sorted(n for n in op_calls if n in set(d.forbidden_ops))
    if forbidden:
        listed = ", ".join(f"aten::{n} x{op_calls[n]}" for n in forbidden)
        raise Rejected(f"{where}: library compute instead of the candidate's kernel: {listed}", "library_ops")
    plumbing = set(d.plumbing_ops)          # config: ops that move or select memory, no arithmetic
    compute = {n: e for n, e in op_elements.items() if n not in plumbing}
    work = float(sum(compute.values()))
    if not work <= d.aux_work_fraction * madds:
        top = ", ".join(f"aten::{n} ({e:.0f} elements)" for n, e in sorted(compute.items(), key=lambda x: -x[1])[:5])
        raise Rejected(f"{where}: torch ops outside the kernel touch {work:.0f} elements, more than "
                       f"{d.aux_work_fraction:.0%} of the op's {madds:.0f} multiply-adds: {top}")
    return work


def no_launch(where: str) -> Rejected:
    return Rejected(f"{where}: no Triton kernel was launched for a call on fresh inputs: the output is "
                    "computed elsewhere or returned from a cache")


def send_trial(ctx: EvalContext, trial: Trial, mode: str = "run", repeat: int = 1, keep: int | None = None,
               recheck: list[int] = (), drop: list[int] = (), step: bool = False) -> None:
    """Hand a trial to the worker without waiting: the next trial can be drawn meanwhile. The worker
    holds the first output as returned under `keep`, sends back those held under `recheck` as they are
    after this trial's calls (`kept<key>`), and lets go of those under `drop`. With `step` (the next layer of the
    previous call's step) it hands the call the previous call's objects for the op's `step_shared` arguments."""
    op: Op = ctx.target.ops[trial.case.op]
    ctx.send({"cmd": "call", "op": op.name, "inputs": trial.recipe(ctx), "mode": mode, "repeat": repeat,
              "out_shape": list(op.output_shape(trial.inputs)), "recheck": list(recheck), "drop": list(drop),
              **({} if keep is None else {"keep": keep}), **({"step": True} if step else {})}, f"running {trial.case.label}")


def collect_trial(ctx: EvalContext, trial: Trial, repeat: int = 1,
                  also: dict[str, tuple[int, ...]] | None = None) -> tuple[list[torch.Tensor], Reply]:
    """The worker's outputs for a trial sent earlier, as read and checked here, and its validated reply;
    the outputs named in `also` (name -> shape: earlier outputs sent back for a recheck) follow in order.
    Every call is held to `library_use` (no library compute, torch compute within its share, a Triton launch
    per call), whichever stage made it."""
    shape = ctx.target.ops[trial.case.op].output_shape(trial.inputs)
    reply = ctx.collect(f"running {trial.case.label}", "call")
    if not reply.ok:
        raise candidate_raised(f"{trial.case.label}: the candidate raised", reply)
    op = ctx.target.ops[trial.case.op]
    library_use(ctx, f"{trial.case.op} ({ctx.stage}, {trial.case.label})", reply, op.cost(trial.inputs).madds, repeat)
    if reply.unlaunched or sum(reply.launches.values()) < repeat:     # each call: a repeat answered from a cache too
        raise no_launch(f"{trial.case.op} ({ctx.stage}, {trial.case.label})")
    expect = {f"out{i}": (shape, ctx.dtype) for i in range(repeat)}
    expect.update({name: (tuple(s), ctx.dtype) for name, s in (also or {}).items()})
    try:
        outs = read_arena([e.model_dump() for e in reply.outputs], ctx.device, reply.arenas, expect=expect)
    except (ProtocolError, OSError, RuntimeError, ValueError) as e:
        raise Rejected(f"{trial.case.label}: wrong output: {type(e).__name__}: {e}", "protocol") from None
    if set(outs) != set(expect):
        raise Rejected(f"{trial.case.label}: the worker returned {sorted(outs)}, expected {sorted(expect)}")
    drop_outputs(ctx, reply)
    return [outs[f"out{i}"] for i in range(repeat)] + [outs[name] for name in also or {}], reply


def run_trial(ctx: EvalContext, trial: Trial, mode: str = "run", repeat: int = 1) -> tuple[list[torch.Tensor], Reply]:
    send_trial(ctx, trial, mode, repeat)
    return collect_trial(ctx, trial, repeat)


def drop_outputs(ctx: EvalContext, reply: Reply) -> None:
    """Let go of the reply's output memory (the worker's sealed memory files, mapped here)."""
    reply.release()


__all__ = ["EvalContext", "Rejected", "Diff", "dispatch_rules", "library_use", "no_library_compute", "no_launch", "Tolerance", "Trial", "diff", "draw", "draw_timed", "draw_twin", "run_trial", "send_trial", "collect_trial",
           "tolerance", "WorkerFailure"]
