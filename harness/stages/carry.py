"""The replay's side of compiling once (harness/compiled.py): what the candidate's worker compiled, kept before the
replay closes it (or before another slot's replay parks its job: harness/evaluate.py); and each head the replay
serves, compiled once in a worker of its own, so that every later server running that head (either arm of every
later replay in this slot) finds its kernels compiled. Nothing here is judged: a worker that fails, hangs or answers
out of form only carries nothing. Not here: handing the kept blobs to servers (harness/stages/arms.py `Servers`).
"""
from __future__ import annotations

import dataclasses
import logging
import time

from harness import replies
from harness.compiled import KEPT
from harness.config import Config
from harness.stages import parity
from harness.stages.common import EvalContext, Rejected
from harness.worker_handle import WorkerFailure, WorkerHandle

log = logging.getLogger(__name__)
PACK_TIMEOUT_S = 60.0
# A parked job's worker packs while a replay waits for the GPU to drain: it may hold that wait this long at most.
PARKED_PACK_TIMEOUT_S = 10.0


def keep_worker(cfg: Config, worker: WorkerHandle, source: str, timeout_s: float = PACK_TIMEOUT_S) -> int:
    """Keep what a worker running `source` alone compiled, for the next sandbox running it: the bytes kept."""
    if not cfg.worker.carry_bytes or not worker.alive:
        return 0
    try:
        raw = worker.request({"cmd": "pack", "limit": cfg.worker.carry_bytes}, timeout_s, "packing its compiled kernels")
        raw.pop("_wall_s", None)
        reply = replies.parse("pack", raw, arenas=raw.pop("_arenas", []))
    except (WorkerFailure, replies.MalformedReply):
        return 0
    blob = reply.arenas[0].blob if isinstance(reply, replies.Packed) and len(reply.arenas) == 1 else None
    if blob is None or blob.numel() != reply["bytes"] or reply["bytes"] > cfg.worker.carry_bytes:
        return 0
    KEPT.keep_from([source], bytes(blob.numpy()))
    reply.release()
    return reply["bytes"]


def compile_alone(ctx: EvalContext, ops: list[str], source: str) -> float:
    """`source`, a head the replay serves, compiled in a fresh worker of its own for parity's shape classes of `ops`
    (parity's warm: nothing launched, `warm_threads` compiles at once), then kept under `source` alone; skipped when
    something is kept under it already (its own earlier worker's, as a candidate, or this). The seconds it took (0:
    skipped). Run once the candidate's worker is closed, before the servers start."""
    threads = getattr(ctx.cfg.stages.parity.warm_threads, ctx.device.type)
    if not ctx.cfg.worker.carry_bytes or ctx.cfg.served.external or not threads or KEPT.given([source]):
        return 0.0
    t0 = time.monotonic()
    worker = ctx.pool.spawn(source)
    head = dataclasses.replace(ctx, source=source, ops=list(ops), worker=worker, parity=None)
    try:
        loaded = head.request({"cmd": "load", "path": str(worker.workdir / "candidate.py"), "carried": [],
                               "carry_bytes": ctx.cfg.worker.carry_bytes,
                               "gpu_memory_fraction": ctx.cfg.worker.gpu_memory_fraction}, "importing a head", "load")
        head.ops = [op for op in ops if op in loaded.ops]
        if loaded.ok and head.ops and (warming := parity.send_warm(head, parity.plan_checks(head))) is not None:
            parity.collect_warm(head, warming)
            keep_worker(ctx.cfg, worker, source)
    except (Rejected, WorkerFailure) as e:
        log.info("replay: a head (%s) was not compiled alone (%s); its servers compile it", ", ".join(ops), str(e)[:200])
    finally:
        worker.close()
    return time.monotonic() - t0


def compile_heads(ctx: EvalContext) -> float:
    """Every head the replay serves compiled alone (`compile_alone`): the heads of the ops the candidate does not
    define, which both arms serve, and the head it is judged against, for the ops it defines. So the head's arm is
    handed at least the kind of kernels the candidate's is (parity's shape classes, the candidate's from its own
    worker), and the carry cannot spare the candidate's server a compile in the timed window that the head's must
    still pay; the head's server also gets its own from earlier replays, so any tilt is the head's way. Seconds."""
    spent = sum(compile_alone(ctx, [op], source) for op, source in ctx.other_heads.items())
    return spent + (compile_alone(ctx, ctx.ops, ctx.head) if ctx.head is not None else 0.0)
