"""A stand-in for CUDA graph capture on a CPU, where there are no graphs: `EagerGraphs` is the Recorder
harness/served/graphs.py takes. A "capture" runs the forward once and keeps every tensor its aten ops made; a
"replay" runs the forward again on the static buffers and copies what each op made into the tensor its
capture made, as a real replay rewrites the capture's memory; and it leaves the ops' books, audits and spot checks
alone, as a real replay runs no Python. `inside` is True while it captures or replays: a test's kernel can
behave as one that launches something else under capture (the kernels a capture records are what replays run).
On the GPU the real capture is tested in tests/test_served_gpu.py."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Made(TorchDispatchMode):
    """Every tensor the aten ops return, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


class EagerGraphs:
    def __init__(self, ops, fail_at: int | None = None) -> None:
        self.ops, self.fail_at, self.recorded, self.inside = ops, fail_at, 0, False

    def warm(self, fn) -> None:
        fn()

    def record(self, fn):
        if self.fail_at is not None and self.recorded == self.fail_at:     # as a capture broken by a host sync fails:
            try:                                                           # the sync's error, then the capture's end
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            finally:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.recorded += 1
        self.inside = True
        try:
            with _Made() as capture:
                out = fn()
        finally:
            self.inside = False
        kept = [t for t in capture.made if 0 not in t.stride()]      # an expanded view is written through its base

        def replay() -> None:
            ops = self.ops
            books = ops.calls, ops.stalls, ops.shapes, ops.spot
            ops.reset()
            ops.host_lengths, ops.spot, self.inside = False, None, True
            try:
                with _Made() as again:
                    fn()
            finally:
                ops.host_lengths, self.inside = True, False
                ops.calls, ops.stalls, ops.shapes, ops.spot = books
            made = [t for t in again.made if 0 not in t.stride()]
            assert [(t.shape, t.dtype) for t in made] == [(t.shape, t.dtype) for t in kept], "the forward changed"
            for k, t in zip(kept, made):
                if k.data_ptr() != t.data_ptr():
                    k.copy_(t)

        return replay, out
