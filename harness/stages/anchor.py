"""Microbench's library anchor: cuDNN SDPA timed on the same work as the candidate, in the evaluator's process,
the figure kevo's speed is reported against first (docs/EVALUATOR.md). It decides no verdict.

A time is reused only for the same work: an anchor call's time depends on its inputs' shapes, not their values, so
a case whose input sets have the shapes of an earlier draw's (microbench pins each set's lengths: every served case,
every candidate) is timed once a process, and a draw of other shapes on its own sets. Until 2026-12-07 a case's rate
carried over to later draws of other lengths: at prefill batch 4 x 512..2048 one family's candidates then read
1.06-1.48x cuDNN in one run (s59, docs/BENCHMARKS.md), the spread of the lengths, not of the kernels.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

Inputs = dict[str, Any]
TIMES: dict[tuple, float] = {}      # the anchor's ms per call, by what it depends on (`work`), for this process


def workload(prepared: Inputs) -> tuple:
    """What an anchor call's time depends on: its tensors' shapes and dtypes (in lists too) and its integer and
    boolean arguments, by name; never a value of a tensor or a float (sm_scale)."""
    def of(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return tuple(x.shape), str(x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(of(y) for y in x)
        return x if isinstance(x, (int, bool)) else None
    return tuple(sorted((name, of(x)) for name, x in prepared.items()))


def work(key: tuple, prepare: Sequence[Callable[[], Inputs]]) -> tuple:
    """The cache key of one case's input sets: `key` (device, dtype, shape class, protocol), then each set's
    workload, its anchor inputs made and dropped one set at a time."""
    return key, tuple(workload(p()) for p in prepare)


def time_anchor(done: tuple, prepare: Sequence[Callable[[], Inputs]], time_one: Callable[[Inputs], float],
                times: dict[tuple, float] = TIMES) -> dict[str, float] | None:
    """The anchor's ms per call on a case's input sets, whose `work` is `done` (`prepare[i]()` makes set i's anchor
    inputs; `time_one` times calls on them): the time kept in `times` for the same work, or the median of the sets'
    times, then kept. Its figures (`anchor_ms`, `anchor_reused`, and `anchor_s` where it was timed), or None where
    the library has no kernel for these shapes or no memory for their inputs."""
    if done in times:
        return {"anchor_ms": times[done], "anchor_reused": 1.0}
    t0 = time.perf_counter()
    try:
        ms = statistics.median(time_one(p()) for p in prepare)
    except RuntimeError:
        return None
    times[done] = ms
    return {"anchor_ms": ms, "anchor_reused": 0.0, "anchor_s": time.perf_counter() - t0}
