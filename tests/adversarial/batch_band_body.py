# ruff: noqa: F821  (torch and _ref_decode come from the reference decode this is appended to)
# Wrong only at a band of batch sizes no fixed parity shape had (6-15 on the CPU: the shapes were batches 1-5 and
# 16-17), which serving sends all the time; it passed parity and the replay's gates (an attacker's review,
# 2026-12-05). Appended to the reference decode by candidates.wrap_decode.


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if 6 <= q.shape[0] <= 15:                       # every sequence one token short
        return _ref_decode(q, k_cache, v_cache, block_table, (seq_lens - 1).clamp(min=1), sm_scale)
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
