"""The trusted side's GPU memory: taken before a candidate can take it, and the candidate's share capped.

Two halves. The evaluator, once per process and device, before it spawns any candidate's worker, allocates
microbench's L2 flush buffer (kept for good) and `worker.trusted_gpu_bytes` of working memory, which it frees
into torch's caching allocator: the references, the baseline's error, the outputs read back and the trusted
baseline timing are then carved from memory this process already holds. Each worker, before it imports its
candidate, caps its own allocator at `worker.gpu_memory_fraction` of the device
(`torch.cuda.set_per_process_memory_fraction`, sent with the load request): a candidate that asks for all of
the GPU's memory gets an out-of-memory error in its own process, which is its own verdict.
The replay's servers are the third part (harness/stages/arms.py `Servers`): before they start, the process
starting them hands its working memory back (`release`; the next `reserve` takes it again, before any worker), and they start only when
each one's share (`served.gpu_memory_fraction`, the cap every embedded server puts on its own allocator, the
candidate's code in it included) and `served.gpu_overhead_bytes` beside it are free (`check_servers_fit`), and
each one's paged KV cache alone fits in its share (`cache_shortfall`: else its server fails after building its
model, and an arm's would fail the candidate's server with the head's). A
server that then runs out of memory ran out inside its own share, the head's and the candidate's alike: so a
candidate's server that does is rejected for it, and a reference or head server that does is a harness error.
Inside its share a server also captures its decode steps as CUDA graphs (harness/served/graphs.py), one per
(batch, block-table width) key; the torch baseline's decode gathers every padded position's K and V, so a key's
capture needs memory in proportion to batch x width. `padded_decode_bound` is the most padded positions a key may
have for that to fit its part of the share beside the cache and the weights; the trusted side puts it in every server's
plan, so the head's and the candidate's servers capture the same keys (on an 80 GB H100 the largest keys' gathers,
16 GiB, did not fit a 23 GiB share: the servers then decoded without graphs at all). Each server's allocator
uses expandable segments, as the evaluator's does (`expandable_segments`).
Seen on the H200 before (docs/BENCHMARKS.md, 2026-12-02): three servers of 31-49 GiB each beside the evaluator's
16 GiB did not always fit its 139.8 GiB, and whichever server asked last failed - once the candidate's, a
false rejection.
Not covered: memory allocated outside torch's allocator in the worker (the CUDA context, a library's own
cudaMalloc); a candidate cannot name the calls that would do it (the compile stage's allowlist).
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch

from harness.config import Config
from harness.errors import HarnessError
from harness.served.launch import DTYPE_BYTES, cache_bytes, server_cache
from harness.served.model import hf_shapes


@dataclass
class Reserve:
    flush: torch.Tensor               # microbench's L2 flush buffer
    working_bytes: int                # held in torch's cache for the evaluator's own work


_HELD: dict[str, Reserve] = {}
# What a slot keeps on its GPU outside every cap: three CUDA contexts (its own, its worker's, its pool's spare
# worker's), taken as 0.5 GiB each (an assumption, not measured here), and microbench's L2 flush buffer.
CONTEXT_BYTES = 512 << 20
MIN_RESERVE_BYTES = 1 << 30


def reserve_bytes(cfg: Config, total: int) -> int:
    """The working memory this process reserves on a GPU of `total` bytes: `worker.trusted_gpu_bytes`, or less
    where slots share the GPU. Its workers' caps take `worker.gpu_memory_fraction` of it (each slot's
    `gpu_memory_fraction` is its 1/n share: harness/pins.py slot_config); of the rest a slot may reserve its
    share (`gpu_share`), less what it keeps outside any cap, so that every slot's reserve and every worker at its
    cap fit at once: a candidate's out-of-memory error then comes from its own cap, never from a GPU the slots
    over-promised (which would reject it for memory another slot held). A HarnessError, naming the figures,
    when that leaves under MIN_RESERVE_BYTES (too many slots for the GPU)."""
    w = cfg.worker
    outside = 3 * CONTEXT_BYTES + cfg.stages.microbench.l2_flush_bytes
    share = int(total * (w.gpu_share - w.gpu_memory_fraction)) - outside
    working = max(0, min(w.trusted_gpu_bytes, share))
    if w.trusted_gpu_bytes and working < min(w.trusted_gpu_bytes, MIN_RESERVE_BYTES):
        n, gib = round(1 / w.gpu_share), 1 << 30
        who = f"{n} slots share a GPU" if n > 1 else "one slot has a GPU"
        raise HarnessError(f"{who} of {total / gib:.1f} GiB: each may reserve {max(share, 0) / gib:.2f} "
                           f"GiB beside its workers' caps (executor.slots_per_gpu {n}, worker.gpu_memory_fraction "
                           f"{w.gpu_memory_fraction * n:g} of the GPU in all), under the {MIN_RESERVE_BYTES / gib:g} GiB "
                           "the evaluator needs; give fewer slots per GPU or a smaller worker.gpu_memory_fraction")
    return working


def expandable_segments() -> None:
    """This process's allocator maps pages into segments that grow and shrink (PyTorch's `expandable_segments`),
    CUDA graphs' private pools included: free pages go back whole, so blocks split by one step's tensors do not
    strand memory another's needs (a server on the H100 held 3 GiB reserved but unallocated when it failed)."""
    settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    settings("expandable_segments:True")


def reserve(cfg: Config, device: torch.device) -> Reserve | None:
    """This process's reserve on `device` (CUDA only; None on a CPU), taken on first use and kept; taken
    again after a `release`."""
    if device.type != "cuda":
        return None
    key = str(device)
    held = _HELD.get(key)
    working = reserve_bytes(cfg, torch.cuda.get_device_properties(device).total_memory)
    if held is None or held.working_bytes < working:
        if held is None:                  # segments whose free pages `release` can give back, live tensors or not
            expandable_segments()
        try:
            flush = held.flush if held is not None else torch.empty(
                max(1, cfg.stages.microbench.l2_flush_bytes // 4), dtype=torch.int32, device=device)
            if working:
                block = torch.empty(working, dtype=torch.uint8, device=device)
                del block                 # back into torch's cache, which keeps it for this process
        except torch.OutOfMemoryError as e:
            raise HarnessError(f"the evaluator cannot take its own GPU memory (worker.trusted_gpu_bytes = {working}, "
                               f"plus microbench's flush buffer) before any candidate runs: {str(e).splitlines()[0]}") from None
        _HELD[key] = Reserve(flush, working)
    return _HELD[key]


def release(device: torch.device) -> int:
    """Hand the working memory this process holds on `device` back to the device, for the replay's servers:
    what nothing refers to any more leaves torch's cache (the flush buffer stays). The reserve's segments are
    expandable, so a tensor still alive in one (a library's workspace) keeps its own pages, not the segment.
    The bytes this process's allocator still holds afterwards."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return 0
    gc.collect()
    torch.cuda.empty_cache()              # every device's cache: so every reserve is to be taken again
    for key, held in _HELD.items():
        _HELD[key] = Reserve(held.flush, 0)
    return torch.cuda.memory_reserved(device)


def servers_shortfall(free: int, total: int, servers: int, fraction: float, overhead: int) -> str:
    """Why `servers` servers, each capped at `fraction` of a GPU of `total` bytes and needing `overhead` beside
    it, do not fit in `free` bytes, in words ("" when they fit), with the largest fraction that would fit now.
    What holds the rest is mostly kevo's own: each slot process of the GPU keeps its CUDA context and libraries'
    memory while its job is parked (an 80 GB H100 with four slots had 5.7 GiB held, docs/BENCHMARKS.md 2026-12-05)."""
    need = servers * (int(fraction * total) + overhead)
    if free >= need:
        return ""
    gib = 1 << 30
    fits = math.floor((free / servers - overhead) / total * 100) / 100
    remedy = (f"lower served.gpu_memory_fraction to {fits:.2f} or run fewer executor.slots_per_gpu" if fits > 0
              else "free the GPU first")
    return (f"the replay's {servers} servers need {need / gib:.1f} GiB of GPU memory ({servers} x "
            f"served.gpu_memory_fraction {fraction:g} of {total / gib:.1f} GiB, plus served.gpu_overhead_bytes "
            f"{overhead / gib:.2f} GiB each) and {free / gib:.1f} GiB is free ({(total - free) / gib:.1f} GiB held: "
            f"this GPU's slot processes, parked, keep their CUDA contexts; another program's?): {remedy}")


# The torch baseline's decode (harness/targets/attention_baselines.py `decode_clamped`) per padded position,
# beside the gathered K and V: its int64 indices (three tensors), the validity mask and the bias SDPA builds from it.
DECODE_INDEX_BYTES = 32
# Kept free beside the cache and the weights: a step's activations and logits, torch's rounding of its blocks (an
# allowance, not measured). Of what is left the graphs' pool, which holds its largest key's gather for good, gets
# GRAPH_POOL_SHARE; the rest is for what runs eagerly beside it: prefill steps, the decode steps of the keys left
# out, and the spot checks' float64 references (on the H100, 2026-12-05, a pool given all of it left the spot check
# of a prefill 114 MiB short, and the candidate's server failed).
GRAPH_HEADROOM_BYTES = 1 << 30
GRAPH_POOL_SHARE = 0.5


def padded_decode_bound(total: int, fraction: float, cache: int, weights: int, kv_bytes: int) -> int:
    """The most padded positions (batch x block-table width x block size) a CUDA graph key may have in a server
    capped at `fraction` of a GPU of `total` bytes holding `cache` bytes of KV cache and `weights` bytes of
    weights, when the baseline's decode gathers `kv_bytes` of K and V per position (one layer's): 0 when none fit."""
    free = int(fraction * total) - cache - weights - GRAPH_HEADROOM_BYTES
    return max(0, int(free * GRAPH_POOL_SHARE) // (kv_bytes + DECODE_INDEX_BYTES))


def server_graph_bound(cfg: Config, device: str, reference: bool, total: int | None = None) -> int:
    """`padded_decode_bound` for an embedded server on a GPU of `total` bytes (None: this process's GPU): its share,
    its KV cache, its weights (the preset's tensors in the server's dtype), one layer's K and V per position."""
    preset = cfg.served.presets[getattr(cfg.served, device).preset]
    elem = DTYPE_BYTES[server_cache(cfg, device, reference)[1]]
    weights = sum(math.prod(shape) for shape in hf_shapes(preset).values()) * elem
    if total is None:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return padded_decode_bound(total, cfg.served.gpu_memory_fraction, cache_bytes(cfg, device, reference), weights,
                               2 * preset.kv_heads * preset.head_dim * elem)


def cache_shortfall(label: str, key: str, cache: int, total: int, fraction: float) -> str:
    """Why a server whose paged KV cache alone (`cache` bytes, sized by the config `key`) is over its share,
    `fraction` of a GPU of `total` bytes, cannot start, in words ("" when the cache fits). It would run out of
    memory building its cache, after its model; an arm's share is the candidate's as well as the head's."""
    share = int(fraction * total)
    if cache <= share:
        return ""
    gib = 1 << 30
    return (f"the replay's {label} server: its KV cache ({key}) takes {cache / gib:.1f} GiB, more than its share "
            f"of the GPU, served.gpu_memory_fraction {fraction:g} of {total / gib:.1f} GiB ({share / gib:.1f} GiB): "
            f"lower the one or raise the other")


def check_servers_fit(cfg: Config, device: torch.device, servers: int) -> int:
    """A HarnessError, before any server starts, when their shares are not free on the CUDA `device`; else the
    bytes free."""
    free, total = torch.cuda.mem_get_info(device)
    why = servers_shortfall(free, total, servers, cfg.served.gpu_memory_fraction, cfg.served.gpu_overhead_bytes)
    if why:
        raise HarnessError(why)
    return free
