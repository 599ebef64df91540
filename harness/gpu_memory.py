"""The trusted side's GPU memory: taken before a candidate can take it, and the candidate's share capped.

Two halves. The evaluator, once per process and device, before it spawns any candidate's worker, allocates
microbench's L2 flush buffer (kept for good) and `worker.trusted_gpu_bytes` of working memory, which it frees
into torch's caching allocator: the references, the baseline's error, the outputs read back and the trusted
baseline timing are then carved from memory this process already holds. Each worker, before it imports its
candidate, caps its own allocator at `worker.gpu_memory_fraction` of the device
(`torch.cuda.set_per_process_memory_fraction`, sent with the load request): a candidate that asks for all of
the GPU's memory gets an out-of-memory error in its own process, which is its own verdict.
Not covered: memory allocated outside torch's allocator in the worker (the CUDA context, a library's own
cudaMalloc); a candidate cannot name the calls that would do it (the compile stage's allowlist).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.config import Config
from harness.errors import HarnessError


@dataclass
class Reserve:
    flush: torch.Tensor               # microbench's L2 flush buffer
    working_bytes: int                # held in torch's cache for the evaluator's own work


_HELD: dict[str, Reserve] = {}


def reserve(cfg: Config, device: torch.device) -> Reserve | None:
    """This process's reserve on `device` (CUDA only; None on a CPU), taken on first use and kept."""
    if device.type != "cuda":
        return None
    key = str(device)
    if key not in _HELD:
        working = cfg.worker.trusted_gpu_bytes
        try:
            flush = torch.empty(max(1, cfg.stages.microbench.l2_flush_bytes // 4), dtype=torch.int32, device=device)
            if working:
                block = torch.empty(working, dtype=torch.uint8, device=device)
                del block                 # back into torch's cache, which keeps it for this process
        except torch.OutOfMemoryError as e:
            raise HarnessError(f"the evaluator cannot take its own GPU memory (worker.trusted_gpu_bytes = {working}, "
                               f"plus microbench's flush buffer) before any candidate runs: {str(e).splitlines()[0]}") from None
        _HELD[key] = Reserve(flush, working)
    return _HELD[key]
