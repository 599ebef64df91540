# ruff: noqa: F821  (torch, triton and tl come from the reference decode this is appended to)
# Torch does the attention inside the grid callable of a decoy launch: Triton calls a callable grid from within
# its own launch, where the audit once counted no elements (it took everything inside a launch for Triton's
# plumbing); ablation skips the launch, grid and all, so the ablated output is left unwritten, as a real
# kernel's would be. Appended to the reference decode (renamed _ref_decode) by candidates.wrap_decode.


@triton.jit
def _decoy(x_ptr):
    tl.store(x_ptr, 0.0)


def _attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, out):
    B, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    L = block_table.shape[1] * bs
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]
    k = k_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    v = v_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    k = k.repeat_interleave(H // KVH, dim=2).float()
    v = v.repeat_interleave(H // KVH, dim=2).float()
    s = (q.float()[:, None] * k).sum(-1) * sm_scale
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    p = (s - s.amax(1, keepdim=True)).exp()
    p = p / p.sum(1, keepdim=True)
    out.copy_((p[..., None] * v).sum(1))


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = torch.empty_like(q)

    def grid(meta):
        _attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, out)
        return (1,)
    _decoy[grid](torch.empty(1, device=q.device))
    return out
