"""The served scenario's config sections (`served`, `stages.replay`) are checked at load: each mistake is
one line naming the key, and a preset must fit the attention target it is served through."""
from __future__ import annotations

import pytest

from conftest import ROOT
from harness.config import ConfigError, load_config
from harness.gpu_memory import servers_shortfall


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
