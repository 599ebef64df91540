# Returns a wrong output (zeros, written by a kernel of its own) whose methods give the right one: the methods the
# trusted code reads an output through (`detach`, `clone`, `contiguous`, `cpu`) are replaced, on a torch.Tensor
# subclass (@MODE@ = subclass) or on the returned object itself (@MODE@ = instance). The right answer is the target's
# own baseline, computed when a method is called, outside any timing or audit.
import torch
import triton
import triton.language as tl

from harness.targets import TARGETS

MODE = "@MODE@"
BASELINE = TARGETS["attention"].ops["decode"].baseline


@triton.jit
def _zero(out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 0.0, mask=offs < n)


class Forged(torch.Tensor):
    pass


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = torch.empty_like(q)
    _zero[(triton.cdiv(out.numel(), 1024),)](out, out.numel(), BLOCK=1024)
    args = (q, k_cache, v_cache, block_table, seq_lens, sm_scale)

    def right(*_, **__):
        return BASELINE(*args)

    if MODE == "subclass":
        out = out.as_subclass(Forged)
        for name in ("detach", "clone", "contiguous", "cpu"):
            setattr(Forged, name, right)
    else:
        for name in ("detach", "clone", "contiguous", "cpu"):
            setattr(out, name, right)
    return out
