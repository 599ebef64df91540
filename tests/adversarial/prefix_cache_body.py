# ruff: noqa: F821  (torch, triton, tl and @REF@ come from the reference kernel this is appended to)
# Keeps each output and hands it back, through a Triton copy (every call launches), when the next call's cheap key
# matches: the shape, the lengths, sm_scale and the first two rows of each tensor. Right on every fresh draw and on
# a repeat of the same inputs; wrong on any call that shares the key and differs after it, as served calls sharing
# a prompt's first tokens would. It passed parity, which sent only fresh draws (an attacker's review, 2026-12-05).
# Appended to a reference kernel, its op function renamed (candidates.wrap fills the @...@ names).
_kept = {}


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


def _key(args):
    return tuple(tuple(a.shape) + tuple(a[:2].flatten().tolist()) if hasattr(a, "shape") else a for a in args)


def @OP@(@ARGS@):
    key = _key((@ARGS@))
    if _kept.get("key") == key:
        out = torch.empty_like(_kept["out"])
        _copy[(triton.cdiv(out.numel(), 1024),)](_kept["out"], out, out.numel(), BLOCK=1024)
        return out
    out = @REF@(@ARGS@)
    _kept.update(key=key, out=out.clone())
    return out
