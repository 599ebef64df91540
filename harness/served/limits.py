"""The largest calls the served engine can make to the attention ops, read from the served config.

One source of truth, nothing copied: the preset's `max_running` (sequences batched together),
`max_prefill_tokens` (prompt tokens admitted per step; a longer prompt runs alone) and
`kv_cache_tokens` (what the paged cache holds at once), and the served trace's longest prompt and
longest context (prompt plus output). Parity draws its served-limit cases from these
(harness/targets/attention.py: `limit_cases`); the block-table widths the CUDA graphs capture
(`plan_for`, harness/served/graphs.py) run from the shortest prompt's to the longest context's.
Not covered: an external server's own limits (`served.external`): the preset's stand for them.
"""
from __future__ import annotations

from dataclasses import dataclass

from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.served.traces import TraceError, load_trace


@dataclass(frozen=True)
class ServedLimits:
    max_running: int
    max_prefill_tokens: int
    kv_cache_tokens: int
    longest_prompt: int
    longest_context: int
    shortest_prompt: int
    graph_batches: tuple[int, ...] = ()      # the batch buckets a decode step is padded to under CUDA graphs


def served_limits(cfg: Config, device_type: str) -> ServedLimits:
    served = getattr(cfg.served, device_type)
    preset = cfg.served.presets[served.preset]
    path = PROJECT_ROOT / served.trace
    try:
        lines = load_trace(path)
    except TraceError as e:
        raise HarnessError(str(e)) from None
    return ServedLimits(max_running=preset.max_running, max_prefill_tokens=preset.max_prefill_tokens,
                        kv_cache_tokens=preset.kv_cache_tokens,
                        longest_prompt=max(line.length for line in lines),
                        longest_context=min(preset.kv_cache_tokens, max(line.length + line.output_len for line in lines)),
                        shortest_prompt=min(line.length for line in lines),
                        graph_batches=tuple(b for b in cfg.served.cuda_graphs.batch_buckets if b <= preset.max_running))


@dataclass(frozen=True)
class GraphPlan:
    """What the served engine captures as CUDA graphs: `served.cuda_graphs`, and the contexts (tokens)
    a decode step's longest sequence can have serving the trace: from its shortest prompt plus one
    token to its longest context. The block-table widths captured cover that range. `max_padded_tokens`
    bounds a key's batch x width x block size, what the torch baseline's decode gathers (0: no bound); the
    trusted side sets it from the server's memory share (harness/gpu_memory.py `padded_decode_bound`)."""
    enabled: bool
    batch_buckets: tuple[int, ...]
    shortest_context: int
    longest_context: int
    max_padded_tokens: int = 0


def plan_for(cfg: Config, device_type: str, max_padded_tokens: int = 0) -> GraphPlan:
    g = cfg.served.cuda_graphs
    lim = served_limits(cfg, device_type)
    return GraphPlan(g.enabled, tuple(g.batch_buckets), lim.shortest_prompt + 1, lim.longest_context, max_padded_tokens)
