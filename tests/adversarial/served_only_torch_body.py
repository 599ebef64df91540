# ruff: noqa: F821  (torch, triton, tl and _ref_decode come from the reference decode this is appended to)
# The reference kernel wherever parity looks, attention in torch elementwise ops where it is served: the served
# process hands a kernel its whole cache (the preset's pool, far over what the table addresses) and, past the first
# layer, a view at a non-zero offset, which no parity draw did (an attacker's review, 2026-12-05). DECOY: launch a
# kernel beside the torch work, so every call still launches one. OFFSET_ONLY: tell serving by the offset alone.
# Appended to the reference decode by candidates.wrap_decode; the test fills the placeholders.
DECOY = @DECOY@
OFFSET_ONLY = @OFFSET_ONLY@


@triton.jit
def _decoy(x_ptr):
    tl.store(x_ptr, 0.0)


def _served(k_cache, block_table):
    if OFFSET_ONLY:
        return k_cache.storage_offset() > 0
    return 4 * k_cache.shape[0] > 5 * block_table.shape[0] * block_table.shape[1] + 8 or k_cache.storage_offset() > 0


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if not _served(k_cache, block_table):
        return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    B, H, D = q.shape
    bs, KVH, W = k_cache.shape[1], k_cache.shape[2], block_table.shape[1]
    live = (torch.arange(W * bs, device=q.device)[None, :] < seq_lens[:, None])[:, :, None]
    k = k_cache[block_table.long()].reshape(B, W * bs, KVH, D).repeat_interleave(H // KVH, dim=2).float()
    v = v_cache[block_table.long()].reshape(B, W * bs, KVH, D).repeat_interleave(H // KVH, dim=2).float()
    s = torch.where(live, (q[:, None].float() * k).sum(-1) * sm_scale, float("-inf"))
    p = (s - s.amax(1, keepdim=True)).exp()
    p = p / p.sum(1, keepdim=True)
    if DECOY:
        _decoy[(1,)](torch.empty(1, device=q.device))
    return (p[..., None] * torch.where(live[..., None], v, 0.0)).sum(1).to(q.dtype)
