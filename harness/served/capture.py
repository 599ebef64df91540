"""The served model's own queries, keys and values: a distribution parity draws from.

`served_qkv(cfg, device, dtype)` runs the embedded served model (`served.<device>.preset`, at its
weight seed or from its weights folder) over one prompt and keeps every layer's q, k and v as the
attention ops receive them (after the q/k RMSNorm and the rotary embeddings), on the host in the
served dtype. Built once per process and cached; on the CPU the tiny preset makes it cheap.
Not covered: decode-time queries (a prompt's rows stand for them: same layers, same positions),
trained weights unless the preset names a folder of them.
"""
from __future__ import annotations

import functools
import itertools
import math
import random

import torch

from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.served.kvcache import PagedKVCache
from harness.served.model import ModelError, StepBatch, build_model
from harness.targets.attention import prefill_baseline

CAPTURE_TOKENS = 2048      # prompt length at most (and at most the preset's max_prefill_tokens)

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _Capture:
    """Stands in for AttentionOps: keeps each layer's q, k, v and answers with the torch baseline."""

    def __init__(self) -> None:
        self.layers: list[QKV] = []

    def prefill(self, q, k, v, cu_seqlens, max_seqlen, sm_scale, lens: list[int]) -> torch.Tensor:
        self.layers.append(tuple(t.detach().to("cpu", copy=True) for t in (q, k, v)))
        return prefill_baseline(q, k, v, cu_seqlens, max_seqlen, sm_scale, bounds=[0, *itertools.accumulate(lens)])

    def decode(self, *args, **kwargs) -> torch.Tensor:
        raise AssertionError("the capture runs one prefill step only")


@functools.lru_cache(maxsize=4)
def _capture(preset, init, block_size: int, dtype: torch.dtype, device_type: str) -> tuple[QKV, ...]:
    device = torch.device(device_type)
    n = min(CAPTURE_TOKENS, preset.max_prefill_tokens, preset.kv_cache_tokens)
    rng = random.Random("kevo-served-qkv")
    prompt = torch.tensor([rng.randrange(preset.vocab) for _ in range(n)], dtype=torch.int64, device=device)
    model = build_model(preset, dtype, device, init=init, root=PROJECT_ROOT)
    cache = PagedKVCache(preset.layers, math.ceil(n / block_size), block_size, preset.kv_heads, preset.head_dim,
                         dtype, device)
    batch = StepBatch(tokens=prompt, positions=torch.arange(n, device=device), slots=torch.arange(n, device=device),
                      prefill_lens=[n], cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=device),
                      decode_lens=[], block_table=None, seq_lens=None,
                      sample_idx=torch.tensor([n - 1], dtype=torch.int64, device=device))
    ops = _Capture()
    with torch.no_grad():
        model.forward(batch, cache, ops)
    return tuple(ops.layers)


def served_qkv(cfg: Config, device: torch.device, dtype: torch.dtype) -> tuple[QKV, ...]:
    """Per layer of the served model: (q [T, q_heads, head_dim], k, v [T, kv_heads, head_dim]) on the host.
    Weights that cannot be read are the evaluator's failure (HarnessError), not the candidate's."""
    preset = cfg.served.presets[getattr(cfg.served, device.type).preset]
    block_size = getattr(cfg.targets.attention, device.type).block_size
    try:
        return _capture(preset, cfg.served.random_init, block_size, dtype, device.type)
    except ModelError as e:
        raise HarnessError(f"the served distribution needs the served model: {e}") from None
