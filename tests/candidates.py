"""Candidate sources for the evaluator's tests, built from the project's reference kernels.

Each adversarial candidate is the reference decode kernel (renamed `_ref_decode`) plus a `decode`
that misbehaves in one specific way. Some name what the compile stage's allowlist refuses (numpy,
ctypes, torch.nn.functional, the worker's timers) on purpose: with the project's config they are
refused before they run; evaluated with conftest.RUNTIME_ONLY, they prove the runtime checks behind
the allowlist hold without it.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

KNOWLEDGE = Path(__file__).resolve().parent.parent / "knowledge" / "attention"
REF_DECODE = (KNOWLEDGE / "decode_paged_splitkv.py").read_text()
REF_PREFILL = (KNOWLEDGE / "prefill_causal_tiled.py").read_text()
TMA_PREFILL = (KNOWLEDGE / "prefill_causal_tma.py").read_text()


def with_knobs(source: str, **knobs) -> str:
    lines = source.splitlines()
    for name, value in knobs.items():
        hits = [i for i, line in enumerate(lines) if line.startswith(f"{name} = ")]
        assert len(hits) == 1, name
        lines[hits[0]] = f"{name} = {value!r}"
    return "\n".join(lines) + "\n"


def wrap_decode(body: str) -> str:
    return wrap(REF_DECODE, "decode", body)


def wrap(reference: str, op: str, body: str) -> str:
    """`body` appended to a reference kernel whose op function is renamed `_ref_<op>` (in the body, `@OP@`, `@REF@` and
    `@ARGS@` stand for the op, that function and the contract's arguments)."""
    assert reference.count(f"\ndef {op}(") == 1
    args = reference.split(f"\ndef {op}(", 1)[1].split(")", 1)[0]
    return (reference.replace(f"\ndef {op}(", f"\ndef _ref_{op}(") + "\n\n"
            + textwrap.dedent(body).replace("@OP@", op).replace("@REF@", f"_ref_{op}").replace("@ARGS@", args))


# A correct kernel with a different blocking and summation order: 16-token tiles, no split-KV.
REBLOCKED = with_knobs(REF_DECODE, BLOCK_N=16, MAX_SPLITS=1, NUM_WARPS=2)

UNWRITTEN_OUTPUT = """
import torch, triton, triton.language as tl

@triton.jit
def _touch(x_ptr):
    pass

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = torch.empty_like(q)          # never written: whatever the allocator left there
    _touch[(1,)](out)
    return out
"""

SDPA_WRAPPER = wrap_decode("""
import torch.nn.functional as F

@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    B, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    L = block_table.shape[1] * bs
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]
    k = k_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    v = v_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    o = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=valid[:, None, None], scale=sm_scale, enable_gqa=True)
    out = torch.empty_like(q)
    _copy[(triton.cdiv(q.numel(), 256),)](o.contiguous(), out, q.numel(), BLOCK=256)
    return out
""")

TORCH_ELEMENTWISE = wrap_decode("""
@triton.jit
def _scale(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * 1.0, mask=offs < n)

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    B, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    L = block_table.shape[1] * bs
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]
    k = k_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    v = v_cache[block_table.long()].reshape(B, L, KVH, D).masked_fill(~valid[:, :, None, None], 0)
    k = k.repeat_interleave(H // KVH, dim=2)
    v = v.repeat_interleave(H // KVH, dim=2)
    s = (q[:, None] * k).sum(-1) * sm_scale                       # [B, L, H], no matmul
    s = s.masked_fill(~valid[:, :, None], float("-inf"))
    p = (s - s.amax(1, keepdim=True)).exp()
    p = p / p.sum(1, keepdim=True)
    o = (p[..., None] * v).sum(1)
    out = torch.empty_like(q)
    _scale[(triton.cdiv(q.numel(), 256),)](o.contiguous(), out, q.numel(), BLOCK=256)
    return out
""")

# The work happens in numpy, out of torch's sight; a decoy Triton kernel runs beside it.
DECOY_KERNEL = wrap_decode("""
import numpy as np

@triton.jit
def _decoy(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < n)

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    scratch = torch.empty(1024, device=q.device)
    _decoy[(4,)](scratch, 1024, BLOCK=256)
    qn, kc, vc = q.numpy(), k_cache.numpy(), v_cache.numpy()
    bt, sl = block_table.numpy(), seq_lens.numpy()
    B, H, D = qn.shape
    bs, KVH = kc.shape[1], kc.shape[2]
    out = np.empty_like(qn)
    for b in range(B):
        n = int(sl[b])
        blocks = bt[b, : (n + bs - 1) // bs]
        k = kc[blocks].reshape(-1, KVH, D)[:n]
        v = vc[blocks].reshape(-1, KVH, D)[:n]
        for h in range(H):
            s = k[:, h // (H // KVH)] @ qn[b, h] * sm_scale
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[:, h // (H // KVH)]
    return torch.from_numpy(out)
""")

POINTER_CACHE = wrap_decode("""
_cache = {}

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    key = (q.data_ptr(), tuple(q.shape))
    if key not in _cache:
        _cache[key] = _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    return _cache[key]
""")

DROPS_NEWEST_TOKEN = wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return _ref_decode(q, k_cache, v_cache, block_table, (seq_lens - 1).clamp(min=1), sm_scale)
""")

WRITES_INPUTS = wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    k_cache.view(-1)[:8].zero_()        # "harmless" tidying of a slot it thinks unused
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

NONDETERMINISTIC = wrap_decode("""
_calls = [0]

@triton.jit
def _nudge(x_ptr, n, delta, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x + delta, mask=offs < n)

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    _calls[0] += 1                        # every other call comes out a hair different
    _nudge[(triton.cdiv(out.numel(), 256),)](out, out.numel(), (_calls[0] % 2) * 1e-6, BLOCK=256)
    return out
""")

# Crashes and hangs only on a boundary shape (a length-1 sequence), so they pass compile and dispatch.
CRASH_ON_BOUNDARY = wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if int(seq_lens.min()) == 1:
        import ctypes
        ctypes.string_at(0)                    # segmentation fault
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

HANG_ON_BOUNDARY = wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    while int(seq_lens.min()) == 1:
        pass
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

# The same faults on the GPU itself, on the boundary shape only: a kernel that spins forever on a flag
# nobody sets (the worker blocks in CUDA until it is killed), and a store far outside any allocation
# (an illegal address: the CUDA context is lost). For runs with injected faults (tests/bench/h200_run.py).
GPU_HANG_ON_BOUNDARY = wrap_decode("""
@triton.jit
def _spin(flag_ptr):
    seen = tl.load(flag_ptr, volatile=True)
    while seen == 0:
        seen = tl.load(flag_ptr, volatile=True)

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if int(seq_lens.min()) == 1:
        _spin[(1,)](torch.zeros(1, dtype=torch.int32, device=q.device))
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

GPU_FAULT_ON_BOUNDARY = wrap_decode("""
@triton.jit
def _wild(x_ptr):
    tl.store(x_ptr + (1 << 40), 1.0)

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    if int(seq_lens.min()) == 1:
        _wild[(1,)](out)
    return out
""")

RAISES_AT_IMPORT = """
import torch
raise RuntimeError("deliberate: tile shape 48 is not a power of two")
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return q
"""

TRITON_COMPILE_ERROR = """
import torch, triton, triton.language as tl

@triton.jit
def _bad(x_ptr):
    tl.store(x_ptr, tl.no_such_builtin(1.0))

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = torch.empty_like(q)
    _bad[(1,)](out)
    return out
"""

WRONG_SHAPE = wrap_decode("""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)[:, :1]
""")

FORGES_REPLIES = """
import torch
import os as _os
for fd in range(3, 64):                   # scribble on every descriptor, the evaluator's socket included
    try:
        _os.write(fd, b"\\x00\\x00\\x00\\x04junk")
    except OSError:
        pass
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return q
"""

# --- CUDA-only cheats: each passes parity and must be caught by microbench --------------------

# Launches on a side stream and returns at once: the timed stream sees almost nothing.
SIDE_STREAM = wrap_decode("""
_side = []

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    if not _side:
        _side.append(torch.cuda.Stream())
    s = _side[0]
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

def flattering_timer(factor: float, decode_body: str) -> str:
    """A decode that patches the worker's event timer to scale its own two intervals per timed call by
    `factor` (nobody else's), then runs `decode_body` (which calls `_ref_decode`)."""
    return wrap_decode(f"""
_mine = [0]
_elapsed = torch.cuda.Event.elapsed_time

def _flattering(self, other):
    ms = _elapsed(self, other)
    if _mine[0] > 0:
        _mine[0] -= 1
        return ms * {factor}
    return ms

torch.cuda.Event.elapsed_time = _flattering

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
""" + textwrap.indent(textwrap.dedent(decode_body).strip("\n"), "    ") + "\n")


# Patches the worker's event timer to halve the candidate's own times (and nobody else's).
PATCHED_TIMER = flattering_timer(0.5, """
    _mine[0] = 2                           # the worker reads two intervals per timed call
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

# Lies to the events by a tenth (too little for the physical floor to see) and keeps the clock check from
# seeing it: while a CUDA graph is being captured it records the kernel on half of each context, so the
# bursts the evaluator clocks replay half the work, faster than the flattered events.
SKIPS_WORK_IN_GRAPHS = flattering_timer(0.9, """
    if torch.cuda.is_current_stream_capturing():
        return _ref_decode(q, k_cache, v_cache, block_table, (seq_lens + 1) // 2, sm_scale)
    _mine[0] = 2
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

# The reference decode plus a one-element kernel specialized on the KV cache's size, which every draw sets anew
# (its spare blocks follow the lengths drawn): a Triton kernel compiled for each new input, as a kernel that takes
# a constexpr from the lengths is. Correct and as fast as the reference.
SPECIALIZES_PER_DRAW = wrap_decode("""
@triton.jit
def _pool_mark(out_ptr, POOL: tl.constexpr):
    offs = tl.arange(0, 1)
    tl.store(out_ptr + offs, tl.load(out_ptr + offs))      # one element rewritten as it is

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    _pool_mark[(1,)](out, POOL=k_cache.shape[0])
    return out
""")

# Slows the baseline down inside the worker (it patches SDPA, which the baseline calls), so the
# candidate looks faster by comparison.
SLOWS_THE_BASELINE = wrap_decode("""
import time
import torch.nn.functional as F
_sdpa = F.scaled_dot_product_attention

def _slow(*args, **kwargs):
    out = _sdpa(*args, **kwargs)
    time.sleep(0.002)                      # the stream idles until the timer's closing event is queued
    return out

F.scaled_dot_product_attention = _slow

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

ILLEGAL_ADDRESS = """
import torch, triton, triton.language as tl

@triton.jit
def _wild(x_ptr):
    tl.store(x_ptr + (1 << 40), 1.0)

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = torch.empty_like(q)
    _wild[(1,)](out)
    return out
"""


def patched(source: str, old: str, new: str) -> str:
    assert source.count(old) == 1, old
    return source.replace(old, new)


_LOOP = "    for start_n in range(split_start, split_end, BLOCK_N):\n"


def recent_window(tokens: int) -> str:
    """The reference decode attending only to the last `tokens` tokens of each context."""
    return patched(REF_DECODE, _LOOP, f"    for start_n in range(tl.maximum(split_start, seq_len - {tokens}), split_end, BLOCK_N):\n")


# The reference decode leaving out every key whose weight is under 1e-3 of the running maximum's (so under
# 1e-3 of the softmax's total): small weights, but a long context has many.
DROPS_SMALL_WEIGHTS = patched(REF_DECODE, "        p = tl.exp2(qk - m_new[:, None])\n",
                              "        p = tl.exp2(qk - m_new[:, None])\n        p = tl.where(p < 1e-3, 0.0, p)\n")

# The reference decode with its accumulator rounded to bfloat16 after every tile, as a bf16 accumulator would be.
ACCUMULATES_IN_BF16 = patched(REF_DECODE, "        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)\n",
                              "        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)\n"
                              "        acc = acc.to(tl.bfloat16).to(tl.float32)\n")
