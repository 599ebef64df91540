# ruff: noqa: F821  (torch and _ref_decode come from the reference decode this is appended to)
# Wrong (half the sm_scale) on every layer of a step but its first: told from parity by the objects a served step
# hands each of its layers (the same block_table and seq_lens, each layer's own query), which parity's calls never
# shared until its checks of a step's next layer (2026-12-05). Appended to the reference decode by candidates.wrap.
_last = {"table": None, "q": None}


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    later = block_table is _last["table"] and q is not _last["q"]
    _last["table"], _last["q"] = block_table, q
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale * (0.5 if later else 1.0))
