# ruff: noqa: F821  (torch, triton, tl and _ref_decode come from the reference decode this is appended to)
# Runs its Triton kernel while a dispatch check is watching and torch SDPA otherwise (issue 15, "Dispatch").
# Appended to the reference decode (renamed _ref_decode) by candidates.wrap_decode.
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode


@triton.jit
def _mark(flag_ptr):
    tl.store(flag_ptr, 1)


def _watched(device) -> bool:
    if _get_current_dispatch_mode() is not None:                  # the aten audit (a TorchDispatchMode)
        return True
    if torch.autograd.profiler._is_profiler_enabled:              # the profiler
        return True
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    _mark[(1,)](flag)
    return int(flag.item()) == 0                                  # the ablation: launches are skipped


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if _watched(q.device):
        return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    B, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    L = block_table.shape[1] * bs
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]
    k = k_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    v = v_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    return F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), attn_mask=valid[:, None, None],
                                          scale=sm_scale, enable_gqa=True)[:, :, 0]
