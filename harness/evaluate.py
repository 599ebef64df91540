"""The evaluator's driver: run the stages in order on one candidate and stop at the first rejection.

`evaluate` never raises for a bad candidate (a crash, a hang, a wrong answer are failing stage
results); it raises HarnessError only when the evaluator itself cannot run. Every reason is
redacted of the evaluator's secrets before it leaves.
"""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.gpu_memory import reserve
from harness.lease import Parked
from harness.pool import Pool
from harness.worker_handle import WorkerFailure
from harness.records import StageResult, Verdict
from harness.sandbox import redact
from harness.stages import PREPARED_STAGES, STAGE_NAMES, STAGES, TIMED_STAGES, preparing
from harness.stages.carry import PARKED_PACK_TIMEOUT_S, keep_worker
from harness.stages.common import EvalContext, Rejected
from harness.targets import TARGETS, configured
from harness.transport import DTYPES

if TYPE_CHECKING:
    from harness.slot import Done

_TICKS = os.sysconf("SC_CLK_TCK")                  # /proc/PID/stat's unit of CPU time


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise HarnessError("config device is cuda but no CUDA GPU is visible")
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def device_shapes(cfg: Config, target: str, device: torch.device):
    """The target's shapes for this device: the config's placeholders, or the shapes a profile of
    the served scenario recorded (`served.recorded_shapes`), relative paths from the project root;
    either way drawn at the heads of the model the served scenario runs on this device."""
    from harness.served.shapes import ShapesError, apply_recorded, served_heads_first
    section = getattr(getattr(cfg.targets, target), device.type)
    served = None
    if target == "attention":
        preset = cfg.served.presets[getattr(cfg.served, device.type).preset]
        served = (preset.q_heads, preset.kv_heads)
        section = served_heads_first(section, served)
    path = cfg.served.recorded_shapes
    try:
        return apply_recorded(section, None if path is None else PROJECT_ROOT / path, served)
    except ShapesError as e:
        raise HarnessError(str(e)) from None


def open_pool(cfg: Config, target: str, device: torch.device | None = None) -> Pool:
    device = device or resolve_device(cfg)
    return Pool(cfg.worker, device.type, target).start()


def sched_s() -> dict[int, tuple[float, float]]:
    """For this process and every process below it (the worker pool, the candidate's worker, a replay's
    servers), by pid: (seconds on a core, seconds ready to run but waiting for one), each summed over the
    process's threads (Linux schedstat; {} where it cannot be read). The first also holds the CPU time of
    children it has waited for (/proc/PID/stat: a compiler's ptxas, say). Read from the host's /proc, so a
    worker in its own PID namespace is found by its host pid. A stage's growth of them (`cpu_s`,
    `cpu_wait_s`: thread-seconds, which can exceed the stage's wall time) is the CPU it used and what it
    lost to CPU contention, less what processes that ended during the stage had had; a child reaped
    during the stage adds all its CPU, some of which it may have used before. Diagnostics only:
    tests/bench/gpu_scaling.py reads them."""
    out: dict[int, tuple[float, float]] = {}
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:                                         # ended meanwhile, or no /proc here
            continue
        fields = stat[stat.rindex(")") + 2:].split()            # after the command name, which may hold spaces
        ran, waited = (int(fields[13]) + int(fields[14])) / _TICKS, 0.0    # cutime, cstime: reaped children
        for task in tasks:
            try:
                on_cpu, delay = (task / "schedstat").read_text().split()[:2]
                ran, waited = ran + int(on_cpu) / 1e9, waited + int(delay) / 1e9
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):                       # a thread that ended meanwhile
                pass
        out[pid] = (ran, waited)
    return out


def evaluate_each(sources: list[str], target: str, cfg: Config, until: str | None = None,
                  pool: Pool | None = None, head: str | None = None,
                  on_stage: Callable[[int, str], None] | None = None,
                  other_heads: dict[str, str] | None = None) -> Iterator["Done | str"]:
    """Judge candidates in order in one worker pool, as a run's evaluation slot does (harness/slot.py):
    the slot's health check first; after a candidate whose worker crashed, hung or hit a CUDA error, the
    check again before the next one. The first check's known kernel runs beside the first candidate's compile
    stage: no later stage starts, and no verdict is stored or given, before it has passed; if it fails, that
    candidate's work is dropped, the device is checked once more after executor.health_retry_s (as
    `device_health` does), and the candidate judged afresh if it passes. Yields a Done per source (its verdict,
    its stages' spans and the start-ups before it), or, once the slot has failed its check (it judges nothing
    more, as a run takes it out), the one-line reason for each source left. `pool`: one launched early for the
    slot (used if its device is right); `head`: the kernel every source is judged against in the replay (None:
    torch's baseline); `other_heads`: per op, the kernel both of the replay's arms serve where a source does not
    define that op (none: torch's baseline); `on_stage(i, name)`: told as source i's stage `name` starts (a progress line)."""
    from harness.slot import Job, Slot, Unchecked, needs_check        # the slot imports this module
    slot = Slot(cfg, target, name=resolve_device(cfg).type, pool=pool)
    checking, why = slot.check_begin(), ""
    if isinstance(checking.begun, str):             # it could not begin (no pool): nothing runs beside it
        why, checking = slot.check_end(checking), None

    def settled() -> None:
        nonlocal checking, why
        if checking is not None:
            why, checking = slot.check_end(checking, retry=False), None
        if why:
            raise Unchecked(why)

    try:
        for i, source in enumerate(sources):
            if checking is None and why:
                yield f"not judged: {why}"
                continue
            job = Job(id=f"file{i + 1}", source=source, until=until, head=head, other_heads=other_heads or {})
            told = None if on_stage is None else functools.partial(on_stage, i)
            try:
                done = slot.run(job, on_stage=told, settled=settled if checking is not None else None)
            except Unchecked:                       # judged beside a failing check: dropped, the device checked again
                time.sleep(cfg.executor.health_retry_s)
                if why := slot.check(retry=False):
                    yield f"not judged: {why}"
                    continue
                done = slot.run(job, on_stage=told)
            yield done
            if needs_check(done.verdict):
                why = slot.check()
    finally:
        if checking is not None:
            slot.check_end(checking, retry=False)
        slot.close()


def evaluate(source: str, target: str, cfg: Config, pool: Pool, until: str | None = None,
             on_stage: Callable[[str], None] | None = None, beat: float = 1.0, head: str | None = None,
             other_heads: dict[str, str] | None = None) -> Verdict:
    """Run the stages in order; `on_stage(name)` is told as each one starts (a live view). `beat` is the
    served-mix speedup over the torch baseline that microbench must beat beyond noise (a candidate's
    parent's, so only kernels faster than the best so far reach the replay); under 1, the baseline's. `head` is
    the source of the current head of the candidate's op: the replay serves it beside the candidate and
    accepts only a candidate faster than it (None: the torch baseline is the head). `other_heads`: per op the candidate
    is not about, its current head, which both of the replay's arms serve (the step the run would ship)."""
    if target not in TARGETS:
        raise HarnessError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    if until is not None and until not in STAGE_NAMES:
        raise HarnessError(f"unknown stage {until!r}; stages: {', '.join(STAGE_NAMES)}")
    device = torch.device("cuda" if pool.device == "cuda" else "cpu")
    shapes = device_shapes(cfg, target, device)
    ctx = EvalContext(cfg=cfg, target=configured(target, cfg), shapes=shapes, device=device,
                      dtype=DTYPES[shapes.dtype], pool=pool, source=source, beat=max(1.0, beat), head=head, other_heads=dict(other_heads or {}),
                      to_run=frozenset(STAGE_NAMES[:STAGE_NAMES.index(until) + 1] if until else STAGE_NAMES))
    results: list[StageResult] = []
    try:
        def ask(name: str) -> float:
            """Tell `on_stage` that `name` begins, and wait for it to return (a slot's GPU lease is granted there:
            harness/lease.py); the seconds waited."""
            t0 = time.monotonic()
            if on_stage is not None:
                if ctx.worker is not None:          # nothing of the candidate's runs while its slot waits
                    ctx.worker.hold_still(True)
                on_stage(name)
                if ctx.worker is not None:
                    ctx.worker.hold_still(False)
            return time.monotonic() - t0

        for name, stage in STAGES:
            ctx.stage, ctx.worker_s = name, 0.0
            prepared = name in PREPARED_STAGES and name in ctx.to_run and device.type == "cuda"   # a CPU skips it
            waited = [ask(preparing(name) if prepared else name)]    # a prepared stage asks for its timing later
            ctx.reserved = ctx.reserved or reserve(cfg, device)    # first taken within a stage, before any worker
            ctx.deadline = time.monotonic() + getattr(cfg.stages, name).timeout_s
            before = sched_s()
            t0 = time.monotonic()
            alone_since = [t0] if name in TIMED_STAGES and not prepared and device.type == "cuda" else []

            def begin_timing(name: str = name) -> float:
                waited.append(ask(name))
                alone_since.append(time.monotonic())
                ctx.deadline += waited[-1]          # the stage's timeout counts its own work, not the queue
                return waited[-1]
            ctx.begin_timing = begin_timing if prepared else (lambda: 0.0)
            try:
                result = stage(ctx)
            except Rejected as e:
                result = StageResult.failed(name, str(e), e.failure, **e.metrics)
            except WorkerFailure as e:
                result = StageResult.failed(name, str(e), e.kind)
            pool.settle_spare()                     # the spare's warm-up ends within this stage (and its time)
            ended = time.monotonic()
            result.seconds = round(ended - t0 - sum(waited[1:]), 3)    # not the waits for its grants
            if result.status != "skipped":          # where the slot's time went (agent/reading/pace.py)
                result.metrics["lease_wait_s"] = round(sum(waited), 3)
                if alone_since:
                    result.metrics["alone_s"] = round(ended - alone_since[0], 3)
            if ctx.worker_s:
                result.metrics["worker_s"] = round(ctx.worker_s, 3)
            if result.status != "skipped" and (now := sched_s()):
                for i, key in enumerate(("cpu_s", "cpu_wait_s")):
                    result.metrics[key] = round(max(0.0, sum(v[i] - before.get(pid, (0.0, 0.0))[i] for pid, v in now.items())), 3)
            result.reason = redact(result.reason)
            results.append(result)
            if result.status == "failed" or name == until:
                break
    except Parked:                      # the job runs again once a replay lets go: what its worker compiled so far
        if ctx.worker is not None:      # is kept for that run, if it comes to this process (harness/compiled.py)
            ctx.worker.hold_still(False)
            keep_worker(cfg, ctx.worker, source, PARKED_PACK_TIMEOUT_S)
        raise
    finally:
        if ctx.worker is not None:
            ctx.worker.close()
    return Verdict.of(results)
