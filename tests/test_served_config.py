"""The served scenario's config sections (`served`, `stages.replay`) are checked at load: each mistake is
one line naming the key, and a preset must fit the attention target it is served through."""
from __future__ import annotations

import re

import pytest

from conftest import ROOT, config_with
from harness.config import ConfigError, load_config
from harness.gpu_memory import (DECODE_INDEX_BYTES, GRAPH_HEADROOM_BYTES, GRAPH_POOL_SHARE, cache_shortfall, padded_decode_bound,
                                server_graph_bound, servers_shortfall)
from harness.served.graphs import width_buckets
from harness.served.limits import served_limits
from harness.served.kvcache import PagedKVCache
from harness.served.launch import cache_bytes, embedded_spec, server_cache


def edited(tmp_path, old: str, new: str):
    text = (ROOT / "config.yaml").read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "config.yaml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize("old, new, words", [
    ("cpu: {preset: tiny,", "cpu: {preset: tinyy,", "served: cpu.preset 'tinyy' is not one of the presets"),
    ("tiny: {layers: 2, hidden: 64, q_heads: 4, kv_heads: 2,", "tiny: {layers: 2, hidden: 64, q_heads: 4, kv_heads: 4,",
     "served.cpu.preset 'tiny' has heads [4, 4] and head_dim 16; targets.attention.cpu has heads [[4, 2], [4, 1]]"),
    ("tiny: {layers: 2, hidden: 64, q_heads: 4, kv_heads: 2, head_dim: 16,", "tiny: {layers: 2, hidden: 64, q_heads: 4, kv_heads: 3, head_dim: 16,",
     "q_heads 4 must be a multiple of kv_heads 3"),
    ("  drain_timeout_s: 300", "  drain_timout_s: 300", "served.drain_timout_s: unknown key (did you mean drain_timeout_s?)"),
    ("    min_margin: 0.01 ", "    min_margin: -1 ", "stages.replay.min_margin: Input should be greater than or equal to 0"),
    ("    segments: 8\n", "    segments: 1\n", "stages.replay.segments: Input should be greater than or equal to 2"),
    ("  external: null", "  external: {command: [x], model: m, start_timeout_s: 5, env_passthrough: [HF_TOKEN]}",
     "HF_TOKEN looks like a secret"),
    ("batch_buckets: [1, 2, 4, 8, 16, 32, 64, 128]}", "batch_buckets: [1, 4, 2]}",
     "served.cuda_graphs.batch_buckets: must be positive and strictly increasing, got [1, 4, 2]"),
    ("batch_buckets: [1, 2, 4, 8, 16, 32, 64, 128]}", "batch_buckets: [0, 2]}",
     "served.cuda_graphs.batch_buckets: must be positive and strictly increasing, got [0, 2]"),
    ("cuda_graphs: {enabled: true,", "cuda_graphs: {enabled: true, buckets: [1],", "served.cuda_graphs.buckets: unknown key"),
    ("  gpu_memory_fraction: 0.29\n", "  gpu_memory_fraction: 0.4\n",
     "served: gpu_memory_fraction 0.4 x 3 (the replay's servers) is over the GPU: at most 0.333"),
], ids=["unknown-preset", "heads-not-served", "heads-do-not-divide", "typo", "negative-margin", "one-segment", "secret-to-external",
        "graph-buckets-unordered", "graph-bucket-zero", "graph-unknown-key", "server-shares-over-the-gpu"])
def test_a_served_config_mistake_is_one_line_naming_the_key(tmp_path, old, new, words):
    with pytest.raises(ConfigError) as err:
        load_config(edited(tmp_path, old, new))
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_replays_servers_start_only_when_each_ones_share_and_overhead_are_free():
    gib = 1 << 30
    assert servers_shortfall(free=130 * gib, total=140 * gib, servers=3, fraction=0.3, overhead=gib) == ""
    why = servers_shortfall(free=110 * gib, total=140 * gib, servers=3, fraction=0.3, overhead=gib)
    assert why.startswith("the replay's 3 servers need 129.0 GiB of GPU memory") and "110.0 GiB is free" in why, why
    exactly = 3 * (35 * gib + gib)          # a quarter of 140 GiB each, and 1 GiB beside it
    assert servers_shortfall(free=exactly, total=140 * gib, servers=3, fraction=0.25, overhead=gib) == ""
    assert servers_shortfall(free=exactly - 1, total=140 * gib, servers=3, fraction=0.25, overhead=gib)


@pytest.mark.parametrize("free_gib", [73.5, 70.0, 40.25])
def test_a_replay_that_does_not_fit_names_the_largest_share_that_would(free_gib):
    """Four slots on an 80 GB H100 left 73.5 GiB free for three servers needing 74.9 (2026-12-05): the refusal says
    how far to lower served.gpu_memory_fraction, to two decimals, and that share fits where one 0.01 larger does not."""
    gib, total = 1 << 30, int(79.2 * (1 << 30))
    free = int(free_gib * gib)
    why = servers_shortfall(free=free, total=total, servers=3, fraction=0.29, overhead=2 * gib)
    fits = float(re.search(r"lower served.gpu_memory_fraction to (\d\.\d\d) or run fewer executor.slots_per_gpu$", why)[1])
    assert servers_shortfall(free=free, total=total, servers=3, fraction=fits, overhead=2 * gib) == ""
    assert servers_shortfall(free=free, total=total, servers=3, fraction=fits + 0.01, overhead=2 * gib)
    assert "\n" not in why


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "arm"])
def test_a_servers_cache_bytes_are_what_its_paged_cache_allocates(tmp_path, reference):
    """The replay refuses before any server starts a cache over its server's share, so the bytes it counts must be
    the bytes the server allocates: the tiny preset's cache built as its server builds it from its spec."""
    import torch
    cfg = config_with(**{"stages.replay.reference_kv_cache_tokens": 1000})     # not a whole number of blocks
    spec = embedded_spec(cfg, "cpu", None, tmp_path, reference=reference)
    p, block = spec["preset"], spec["block_size"]
    cache = PagedKVCache(p["layers"], max(1, p["kv_cache_tokens"] // block), block, p["kv_heads"], p["head_dim"],
                         getattr(torch, spec["dtype"]), torch.device("cpu"))
    assert cache.k.nbytes + cache.v.nbytes == cache_bytes(cfg, "cpu", reference)
    assert server_cache(cfg, "cpu", reference)[1] == spec["dtype"]


def test_a_cache_over_its_servers_share_is_refused_before_any_server_starts_naming_its_key():
    """On an 80 GB H100 (79.18 GiB) the 0.6B preset's float32 reference with 131,072 tokens ran out of its 0.29
    share after its model was built (2026-12-05); 65,536 tokens served there. The arms' bf16 cache fits."""
    total = int(79.18 * (1 << 30))
    old = config_with(**{"stages.replay.reference_kv_cache_tokens": 131072})
    why = cache_shortfall("reference", "stages.replay.reference_kv_cache_tokens", cache_bytes(old, "cuda", True), total,
                          old.served.gpu_memory_fraction)
    assert why == ("the replay's reference server: its KV cache (stages.replay.reference_kv_cache_tokens) takes 28.0 GiB, "
                   "more than its share of the GPU, served.gpu_memory_fraction 0.29 of 79.2 GiB (23.0 GiB): lower the "
                   "one or raise the other"), why
    cfg = config_with()
    for reference in (True, False):
        key = server_cache(cfg, "cuda", reference)[0]
        assert cache_shortfall("x", key, cache_bytes(cfg, "cuda", reference), total, cfg.served.gpu_memory_fraction) == ""


def test_on_an_80_gb_gpu_the_graph_plan_leaves_out_the_keys_whose_baseline_gather_cannot_fit_the_share():
    """2026-12-05, H100: capturing the decode step at batch 128, width 2048 asked the torch baseline for 8 GiB more
    than the 23 GiB share held, so the server decoded without graphs at all. The bound leaves such keys out, the
    same for every arm, and the pool its part of the share; on the H200 it leaves out the largest key alone."""
    cfg = config_with()
    lim = served_limits(cfg, "cuda")
    p, block = cfg.served.presets[cfg.served.cuda.preset], cfg.targets.attention.cuda.block_size
    keys = [(B, W) for B in cfg.served.cuda_graphs.batch_buckets if B <= p.max_running
            for W in width_buckets(lim.shortest_prompt + 1, lim.longest_context, block)]
    share, gather = int(0.29 * 79.18 * (1 << 30)), 2 * p.kv_heads * p.head_dim * 2 + DECODE_INDEX_BYTES
    h100 = server_graph_bound(cfg, "cuda", False, total=int(79.18 * (1 << 30)))
    kept = [(B, W) for B, W in keys if B * W * block <= h100]
    assert (128, 2048) in keys and (128, 2048) not in kept and (16, 2048) in kept and (128, 256) in kept
    weights = 596_049_920 * 2        # Qwen3-0.6B's tensors in bf16 (0.44B beside the 151,936 x 1,024 tied embedding)
    pool = max(B * W for B, W in kept) * block * gather
    left = share - cache_bytes(cfg, "cuda", False) - weights - GRAPH_HEADROOM_BYTES
    assert pool <= left * GRAPH_POOL_SHARE and pool > left * GRAPH_POOL_SHARE / 2      # the next key up would not fit
    h200 = server_graph_bound(cfg, "cuda", False, total=int(139.8 * (1 << 30)))
    assert [key for key in keys if key[0] * key[1] * block > h200] == [(128, 2048)]      # on the H200 the largest only
    reference = server_graph_bound(cfg, "cuda", True, total=int(79.18 * (1 << 30)))
    assert 0 < reference < h100                    # float32: twice the bytes a position, a larger cache share
    cache, kv = 3 << 30, 4096                      # the share holds the cache, the weights, the headroom and 1000 gathers
    total = cache + weights + GRAPH_HEADROOM_BYTES + int(1000 * (kv + DECODE_INDEX_BYTES) / GRAPH_POOL_SHARE)
    assert padded_decode_bound(total, 1.0, cache, weights, kv) == 1000
    assert padded_decode_bound(total - 1, 1.0, cache, weights, kv) == 999
    assert padded_decode_bound(total, 0.5, cache, weights, kv) == 0
