# Returns the same buffer from every call, written with a different value each time (a nondeterministic kernel):
# read only after all the calls of a repeat check, the outputs would be one memory, equal to itself.
import torch
import triton
import triton.language as tl

_BUF = {}


@triton.jit
def _fill(out_ptr, n, value, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, value, mask=offs < n)


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = _BUF.setdefault("out", torch.empty_like(q))
    _BUF["calls"] = _BUF.get("calls", 0) + 1
    _fill[(triton.cdiv(out.numel(), 1024),)](out, out.numel(), float(_BUF["calls"]), BLOCK=1024)
    return out
