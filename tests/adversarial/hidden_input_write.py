# Zeroes the KV cache it was handed, in place, and replaces the methods the trusted code reads an input through
# (`contiguous`, `clone`) on that object with ones that give the cache as it was, so the write would not be seen.
# Its output is zeros, from a kernel of its own: what is tested is whether the write is seen.
import torch
import triton
import triton.language as tl


@triton.jit
def _zero(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 0.0, mask=offs < n)


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    before = k_cache.clone()
    k_cache.zero_()
    k_cache.contiguous = lambda *_, **__: before
    k_cache.clone = lambda *_, **__: before.clone()
    out = torch.empty_like(q)
    _zero[(triton.cdiv(out.numel(), 1024),)](out, out.numel(), BLOCK=1024)
    return out
