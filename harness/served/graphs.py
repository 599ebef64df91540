"""Decode-only engine steps as CUDA graphs: captured in the warm-up, replayed while serving.

A serving engine (vLLM, SGLang) does not launch a decode step's few hundred kernels from Python one
by one: it replays a CUDA graph captured for a fixed, padded batch size. `DecodeGraphs` does the same
for the engine's decode-only steps (a step with a prefill in it runs eagerly):

- A graph per key (batch bucket, width bucket). The batch is padded up to the next of the configured
  `batch_buckets` (those above the preset's max_running are dropped), the block table to the next
  power of two at or above its widest row, from the width of the served trace's shortest prompt
  (a step's width is its longest row's) up to that of its longest context, so a kernel that sizes
  its grid from the table's width never sees the cache's whole capacity. Keys whose batch x width x
  block size is over the plan's `max_padded_tokens` (what the server's memory share leaves the torch
  baseline's gather; harness/gpu_memory.py) are left out, the same for every server of a replay. A
  step no key covers runs eagerly and is counted.
- Padding: a padded row decodes token 0 at position 0 with seq_len 1, its K/V written to a scratch
  block that no sequence ever owns (held out of the allocator); padded columns of every row point at
  that block too. Padded rows' logits are discarded.
- Inputs live in static device buffers, sized for the largest key, filled before each replay from
  host buffers (pinned on CUDA). What is captured is the model's forward: the embedding, every layer
  with its KV-cache writes and attention ops, the logits. Sampling stays outside (engine.py).
- Capture, in the warm-up (engine.warm_up), never in the timed window: largest key first, each one's
  forward run twice on a side stream (Triton compiles, autotuning, lazy initialisation; PyTorch's
  documented pattern), then captured into a graph sharing one memory pool with the others, then
  synchronized. Anything raised while warming or capturing (a host sync such as `.item()` is an error
  inside a capture) drops every graph: the server decodes eagerly, and `stats()` says why.
- Accounting: each replay adds to AttentionOps the calls per op its capture made (candidate,
  unsupported, not implemented) and records the real lengths served (harness/served/ops.py); the
  candidate's decode calls the capture made are held (their inputs and outputs, which each replay
  rewrites) and spot-checked after a share of replays (harness/served/spot.py).

Not covered: graphs for prefill or mixed steps, more than one stream, piecewise graphs around
attention (vLLM's torch.compile path), capture on a CPU (there graphs are off, and stats say so).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Protocol

import torch

from harness.served.limits import GraphPlan
from harness.served.model import StepBatch

WARM_CALLS = 2        # eager forwards of each key on the capture stream before it is captured


def batch_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n sequences; None above the largest."""
    return next((b for b in buckets if b >= n), None)


def width_bucket(blocks: int) -> int:
    """The power of two at or above a block-table width."""
    return 1 << (max(1, blocks) - 1).bit_length()


def width_buckets(shortest_context: int, longest_context: int, block_size: int) -> tuple[int, ...]:
    """The width buckets a decode step can need when its longest sequence holds between these many
    tokens (a step's width is its longest row's)."""
    lo, hi = (width_bucket(math.ceil(max(1, n) / block_size)) for n in (shortest_context, longest_context))
    return tuple(1 << i for i in range(lo.bit_length() - 1, hi.bit_length()))


def decode_rows(seqs: list, block_size: int) -> tuple[list[int], list[int], list[int]]:
    """Each decode sequence's input token (its newest), that token's position, and the cache slot
    (block * block_size + offset) its keys and values go to. The eager batch and the graphs share it."""
    pos = [s.length - 1 for s in seqs]
    tokens = [s.generated[-1] for s in seqs]
    slots = [s.blocks[p // block_size] * block_size + p % block_size for s, p in zip(seqs, pos)]
    return tokens, pos, slots


def _cause(e: BaseException) -> str:
    """One line: the first error of a chain (a failed capture's own error follows the one that broke it)."""
    def line(x: BaseException) -> str:
        return f"{type(x).__name__}: {''.join(str(x).splitlines()[:1])[:200]}"
    first = e
    for _ in range(8):
        if first.__context__ is None:
            break
        first = first.__context__
    return line(first) if first is e else f"{line(first)}; then {line(e)}"


class Recorder(Protocol):
    """How a forward is warmed and captured: CUDA graphs here; tests stand in for CUDA on a CPU."""

    def warm(self, fn: Callable[[], torch.Tensor]) -> None: ...

    def record(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]: ...


class CudaRecorder:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()       # one pool for every key's graph: they never run at once
        self.stream = torch.cuda.Stream(device)

    def warm(self, fn: Callable[[], torch.Tensor]) -> None:
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for _ in range(WARM_CALLS):
                fn()
        main.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)

    def record(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                out = fn()
        finally:       # a capture that raised leaves the capture stream current: give the step its stream back
            torch.cuda.set_stream(main)
        torch.cuda.synchronize(self.device)
        return graph.replay, out


@dataclass
class _Graph:
    replay: Callable[[], None]
    logits: torch.Tensor                     # [batch bucket, vocab], rewritten by each replay
    calls: dict[str, Counter]                # per op, the calls the capture made (candidate / unsupported / ...)
    held: list                               # the candidate's calls the capture made, for spot checks of replays


class DecodeGraphs:
    def __init__(self, engine: Any, plan: GraphPlan, recorder: Recorder | None = None) -> None:
        self.engine, self.model, self.ops, self.cache = engine, engine.model, engine.ops, engine.cache
        self.bs, self.device = engine.bs, engine.device
        self.batches = tuple(b for b in plan.batch_buckets if b <= engine.max_running)
        self.widths = width_buckets(min(plan.shortest_context, plan.longest_context), plan.longest_context, self.bs)
        bound = plan.max_padded_tokens
        every = list(product(self.batches, self.widths))
        self.keys = sorted(((B, W) for B, W in every if not bound or B * W * self.bs <= bound), reverse=True)
        self.left_out = len(every) - len(self.keys)       # over the memory bound: their steps run eagerly
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = self.eager_decode_steps = 0
        self.capture_s = 0.0
        self.reason = ""
        if not plan.enabled:
            self.reason = "off in config (served.cuda_graphs.enabled: false)"
        elif recorder is None and self.device.type != "cuda":
            self.reason = f"off: CUDA graphs need a GPU; this engine runs on the {self.device.type}"
        elif not self.batches:
            self.reason = f"off: no batch bucket at or under max_running {engine.max_running}"
        elif not self.keys:
            self.reason = (f"off: no key's padded decode (batch x width x block {self.bs}) is within the "
                           f"{bound} positions the server's memory share allows")
        self.recorder = recorder if recorder is not None or self.reason else CudaRecorder(self.device)
        if self.reason:
            return
        self.scratch = engine.allocator.hold()            # padded rows and columns point here, no sequence ever does
        B, W = self.batches[-1], self.widths[-1]
        pin = self.device.type == "cuda"
        self.host64 = torch.zeros((3, B), dtype=torch.int64, pin_memory=pin)           # tokens, positions, slots
        self.host32 = torch.zeros(B + B * W, dtype=torch.int32, pin_memory=pin)        # seq_lens, then the table
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.static64 = torch.zeros((3, B), dtype=torch.int64, device=self.device)
        self.static32 = torch.zeros(B + B * W, dtype=torch.int32, device=self.device)
        self.rows = torch.arange(B, dtype=torch.int64, device=self.device)
        self.copied = torch.cuda.Event() if pin else None   # the host buffers are free again once it has passed

    @property
    def on(self) -> bool:
        return bool(self.graphs)

    def _batch(self, B: int, W: int) -> StepBatch:
        """The static inputs of key (B, W) as a decode-only step; decode_lens are the width bucket's whole
        context, which is what `supports()` and the shape check see while capturing."""
        top = self.batches[-1]
        return StepBatch(tokens=self.static64[0, :B], positions=self.static64[1, :B], slots=self.static64[2, :B],
                         prefill_lens=[], cu_seqlens=None, decode_lens=[W * self.bs] * B,
                         block_table=self.static32[top:top + B * W].view(B, W), seq_lens=self.static32[:B],
                         sample_idx=self.rows[:B])

    def stage(self, seqs: list, B: int, W: int) -> list[int]:
        """Write a step's inputs, padded to key (B, W), into the host buffers and copy them to the static
        ones. Returns the real sequences' lengths."""
        if self.copied is not None:
            self.copied.synchronize()
        n, top, scratch = len(seqs), self.batches[-1], self.scratch
        tokens, pos, slots = decode_rows(seqs, self.bs)
        lens = [p + 1 for p in pos]
        h64, h32 = self.np64, self.np32
        h64[0, :n], h64[1, :n], h64[2, :n] = tokens, pos, slots
        h64[0, n:B], h64[1, n:B], h64[2, n:B] = 0, 0, scratch * self.bs
        h32[:n], h32[n:B] = lens, 1
        table = h32[top:top + B * W].reshape(B, W)
        table.fill(scratch)
        for i, s in enumerate(seqs):
            table[i, :len(s.blocks)] = s.blocks
        self.static64.copy_(self.host64, non_blocking=True)
        end = top + B * W
        self.static32[:end].copy_(self.host32[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return lens

    def capture(self) -> None:
        """Every key's graph, largest first; on any failure none at all, and the reason kept."""
        if self.reason:
            return
        t0 = time.perf_counter()
        ops = self.ops
        saved = ops.calls, ops.stalls, ops.shapes        # the books are put back as they were: capturing serves nothing
        ops.reset()
        B = W = 0
        self.stage([], self.batches[-1], self.widths[-1])   # every row padding: what warming and capturing read
        ops.host_lengths = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()                # what the warm-up left cached, back under the share for the pool
        try:
            for B, W in self.keys:
                batch = self._batch(B, W)

                def forward(batch: StepBatch = batch) -> torch.Tensor:
                    return self.model.forward(batch, self.cache, ops)

                self.recorder.warm(forward)
                ops.reset()
                ops.held = []
                replay, logits = self.recorder.record(forward)
                self.graphs[(B, W)] = _Graph(replay, logits, {op: Counter(c) for op, c in ops.calls.items() if c.total()},
                                             ops.held)
                ops.held = None
        except Exception as e:                      # noqa: BLE001 - the candidate's failure: reported, served eagerly
            self.graphs.clear()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.reason = f"off: capturing the decode step at batch {B}, width {W} failed ({_cause(e)}); decoding eagerly"
        finally:
            ops.host_lengths, ops.held = True, None
            ops.calls, ops.stalls, ops.shapes = saved
        self.capture_s = time.perf_counter() - t0

    def run(self, seqs: list) -> torch.Tensor | None:
        """The logits of a decode-only step from its graph; None when no graph covers it (the engine then
        runs it eagerly)."""
        if not self.graphs:
            return None
        B, W = batch_bucket(len(seqs), self.batches), width_bucket(max(len(s.blocks) for s in seqs))
        g = self.graphs.get((B, W))
        if g is None:
            self.eager_decode_steps += 1
            return None
        R = self.model.region
        with R("kevo.copies"):
            lens = self.stage(seqs, B, W)
        with R("kevo.graph"):
            g.replay()
        self.ops.replayed(g.calls, lens, g.held, B)
        self.replays += 1
        return g.logits[:len(seqs)]

    def forward_each_eagerly(self) -> None:
        """Every captured key's forward once, eagerly, on padding inputs: the kernels its graph launches,
        each from the part of the model that launches it (the profile reads them; harness/profile.py).
        Writes only the scratch block; the ops count the calls (the caller resets them)."""
        self.stage([], self.batches[-1], self.widths[-1])
        for key in sorted(self.graphs):
            self.model.forward(self._batch(*key), self.cache, self.ops)

    def stats(self) -> dict:
        """For /kevo/stats: on or off, the keys captured, why it is off, replays and eager decode steps."""
        return {"on": self.on, "fell_back": self.reason.startswith("off: capturing"), "batch_buckets": sorted({b for b, _ in self.graphs}),
                "width_buckets": sorted({w for _, w in self.graphs}), "graphs": len(self.graphs),
                "left_out": self.left_out, "reason": self.reason, "replays": self.replays, "eager_decode_steps": self.eager_decode_steps,
                "capture_s": round(self.capture_s, 3)}
