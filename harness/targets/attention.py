"""The `attention` target: paged decode and varlen causal prefill.

Everything about the target lives here: the contract text, float64 references, input generators
(four distributions, one of them the served model's own q, k, v; unused cache slots holding NaN, zeros,
other sequences' stale values or finite randoms; shuffled block tables; sm_scale drawn per check),
served, boundary and served-limit cases, and the cost model. Elsewhere: the torch baselines and cuDNN
anchors (attention_baselines.py), a check's drawn shape (attention_draws.py), twin checks (attention_twins.py),
how outputs are compared (harness/stages).
"""
from __future__ import annotations

import itertools
import math

import torch

from harness.served.graphs import width_bucket
from harness.targets.attention_baselines import (DECODE_BASELINES, decode_anchor, decode_anchor_inputs,  # noqa: F401
                                                 decode_clamped, decode_masked, decode_per_sequence, prefill_anchor,
                                                 prefill_anchor_inputs, prefill_baseline, prefill_calibration)
from harness.targets.attention_draws import pin, vary
from harness.targets.attention_twins import layer, twin, twinned
from harness.targets.base import UNFILLED, Case, Cost, Inputs, Op, Target

CONTRACT = """\
decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale) -> Tensor
    q            [batch, num_q_heads, head_dim]
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim]      (v_cache the same)
    block_table  int32 [batch, max_blocks_per_seq]
    seq_lens     int32 [batch], 1 <= seq_lens[b] <= max_blocks_per_seq * block_size
    Token t of sequence b is at k_cache[block_table[b, t // block_size], t % block_size];
    positions >= seq_lens[b] hold garbage (anything: NaN, zeros, other sequences' stale values).
    Query head h reads kv head h // (num_q_heads // num_kv_heads).
    returns      [batch, num_q_heads, head_dim] in q.dtype

prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale) -> Tensor
    q [total_tokens, num_q_heads, head_dim]; k, v [total_tokens, num_kv_heads, head_dim]
    cu_seqlens int32 [batch + 1]; causal attention within each sequence; same head mapping
    returns      [total_tokens, num_q_heads, head_dim] in q.dtype

Both: sm_scale is any positive float (scores are q.k * sm_scale). The returned tensor is the
caller's: no later call of either function may change it (the served engine holds the prefill
output while decode runs in the same step).
decode must be capturable in a CUDA graph: the served engine captures its decode steps once and
replays them, so its Python runs only at capture. No host sync (.item(), .tolist(), .cpu(), printing
a tensor, a tensor's value in an `if`); grid sizes and split counts from shapes only; no state
carried from one call to the next; allocate with torch (within a graph an allocation keeps its
address from one replay to the next). Served, decode sees its batch padded to a bucket (padded rows
have seq_len 1) and block_table padded to a power-of-two width; a kernel that cannot be captured
is served eagerly, and that is reported.
"""

# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

def _lengths(case: Case, gen: torch.Generator) -> list[int]:
    """Fixed lengths; or `total` tokens split at random into `batch` sequences (a full prefill step); or `batch`
    lengths drawn from `length_range`, one of them its top when `longest`, the rest scaled down to fit `max_total`
    (what the KV cache holds at once). Drawn from `gen`, or from `lengths_seed` where the case has one."""
    p = case.params
    if "lengths" in p:
        return list(p["lengths"])
    if "lengths_seed" in p:             # pinned (attention_draws.pin): the same lengths whatever the set's own seed
        gen = torch.Generator().manual_seed(p["lengths_seed"])
    if "total" in p:
        cuts = sorted((torch.randperm(p["total"] - 1, generator=gen)[: p["batch"] - 1] + 1).tolist())
        return [b - a for a, b in zip([0, *cuts], [*cuts, p["total"]])]
    lo, hi = p["length_range"]
    n = torch.randint(lo, hi + 1, (p["batch"],), generator=gen).tolist()
    top = int(torch.randint(0, len(n), (1,), generator=gen)) if p.get("longest") else None
    if top is not None:
        n[top] = hi
    room = p.get("max_total", math.inf) - (hi if top is not None else 0)
    rest = sum(x for i, x in enumerate(n) if i != top)
    if rest > room:
        n = [x if i == top else max(lo, x * int(room) // rest) for i, x in enumerate(n)]
    return n


def _gens(seed: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """A CPU generator for lengths and indices, one on the device for the bulk values."""
    return torch.Generator().manual_seed(seed), torch.Generator(device=device).manual_seed(seed ^ 0x5EED)


def _draw(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device)


def _qkv(dist: str, q_shape, kv_shape, head_dim: int, gen: torch.Generator, dtype: torch.dtype):
    if dist == UNFILLED:          # nothing drawn (`gen` is the device's): the CPU generator's draws are unchanged
        return tuple(torch.empty(s, dtype=dtype, device=gen.device) for s in (q_shape, kv_shape, kv_shape))
    q, k, v = _draw(q_shape, gen), _draw(kv_shape, gen), _draw(kv_shape, gen)
    if dist == "peaky":          # large-magnitude queries: a softmax dominated by a few keys
        q = q * 8.0
    elif dist == "shifted_keys":  # a large logit offset shared by all keys: needs max subtraction
        sign = torch.randint(0, 2, (head_dim,), generator=gen, device=gen.device).float() * 2 - 1
        k = k + 30.0 * sign
    elif dist not in ("normal", "served"):   # served: i.i.d. here, the sequences' own rows written over it
        raise ValueError(f"unknown input distribution {dist!r}")
    return q, k, v


def _served_rows(case: Case, lengths: list[int], gen: torch.Generator, device: torch.device, newest_q: bool = False):
    """The served model's q, k, v (one layer, in `served_qkv`) for every token of every sequence (q:
    only each sequence's newest token with `newest_q`): each sequence reads a window of consecutive
    captured positions from a random start (wrapping), so keys keep their positions relative to the
    queries (rotary embeddings). Heads map onto the captured ones group by group (kv head j -> captured
    kv head j mod theirs, its query heads onto that group's)."""
    p = case.params
    qb, kb, vb = (t.to(device, torch.float32) for t in p["served_qkv"])
    T, Hc, KVHc = qb.shape[0], qb.shape[1], kb.shape[1]
    H, KVH = p["q_heads"], p["kv_heads"]
    kv_map = torch.arange(KVH) % KVHc
    q_map = kv_map.repeat_interleave(H // KVH) * (Hc // KVHc) + torch.arange(H) % (H // KVH) % (Hc // KVHc)
    starts = torch.randint(0, T, (len(lengths),), generator=gen).tolist()
    rows = torch.cat([(s + torch.arange(n)) % T for s, n in zip(starts, lengths)]).to(device)
    q_rows = rows[torch.tensor(list(itertools.accumulate(lengths)), device=device) - 1] if newest_q else rows
    return qb[q_rows][:, q_map.to(device)], kb[rows][:, kv_map.to(device)], vb[rows][:, kv_map.to(device)]


def _sm_scale(case: Case) -> float:
    return case.params.get("sm_scale", 1.0 / math.sqrt(case.params["head_dim"]))


def _fill_unused(k: torch.Tensor, v: torch.Tensor, garbage: torch.Tensor, how: str, gen: torch.Generator) -> None:
    """What unused slots hold: NaN; zeros (a fresh served cache); other sequences' stale keys and values; or randoms."""
    if how == "nan":
        k[garbage], v[garbage] = float("nan"), float("nan")
    elif how == "zeros":
        k[garbage], v[garbage] = 0.0, 0.0
    elif how == "stale":
        used = (~garbage).flatten().nonzero()[:, 0]
        slots = garbage.flatten().nonzero()[:, 0]
        pick = used[torch.randint(0, used.numel(), (slots.numel(),), generator=gen).to(used.device)]
        flat_k, flat_v = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
        flat_k[slots], flat_v[slots] = flat_k[pick], flat_v[pick]
    elif how != "random":
        raise ValueError(f"unknown unused-slot fill {how!r}")


def _as_served(cache: torch.Tensor, layer: int, copy: bool = True) -> torch.Tensor:
    """`cache` as served: layer `layer`'s view of a two-layer buffer (the other layer whatever the allocator left).
    Without `copy` (unfilled inputs: nothing in `cache` is anyone's) the view is left as allocated."""
    both = cache.new_empty((2, *cache.shape))
    if copy:
        both[layer] = cache
    return both[layer]


def decode_inputs(case: Case, dist: str, seed: int, device: torch.device, dtype: torch.dtype) -> Inputs:
    p = case.params
    gen, dev_gen = _gens(seed, device)
    lengths, bs, H, KVH, D = _lengths(case, gen), p["block_size"], p["q_heads"], p["kv_heads"], p["head_dim"]
    real = len(lengths)
    lengths += [1] * max(0, p.get("graph_batch", 0) - real)   # padding rows, as a CUDA graph replays the step
    blocks_per_seq = [math.ceil(n / bs) for n in lengths[:real]] + [0] * (len(lengths) - real)
    max_blocks = max(blocks_per_seq)
    used = sum(blocks_per_seq)
    pool = max(used + max(2, used // 4), p.get("pool", 0))   # spare blocks nobody owns: garbage
    q, k, v = _qkv(dist, (len(lengths), H, D), (pool, bs, KVH, D), D, dev_gen, dtype)
    perm = torch.randperm(pool, generator=gen)          # shuffled, non-contiguous ownership
    table = torch.randint(0, pool, (len(lengths), max_blocks), generator=gen, dtype=torch.int32)
    starts = [0] + list(itertools.accumulate(blocks_per_seq))
    for b, nb in enumerate(blocks_per_seq):             # entries past nb stay garbage (in range)
        table[b, :nb] = perm[starts[b]:starts[b + 1]].to(torch.int32)
    if "graph_batch" in p:      # harness/served/graphs.py: padded rows and the columns past a power-of-two width
        scratch = perm[used].to(torch.int32)            # read a scratch block no sequence owns, position 0 written
        table[real:] = scratch
        table = torch.cat([table, scratch.expand(len(lengths), width_bucket(max_blocks) - max_blocks)], dim=1)
    if dist == "served":                                # token t of sequence b where the table puts it
        q, ks, vs = _served_rows(case, lengths, gen, device, newest_q=True)   # the newest position queries
        held = sum(lengths[:real]) + (len(lengths) > real)     # the padding rows' one slot, written once
        slot = torch.cat([table[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                          for b, n in enumerate(lengths[:real + 1])]).to(device)
        k.view(-1, KVH, D)[slot], v.view(-1, KVH, D)[slot] = ks[:held], vs[:held]
    if dist != UNFILLED:
        fill = torch.cat([(torch.tensor(n) - torch.arange(nb) * bs).clamp(max=bs)
                          for n, nb in zip(lengths, blocks_per_seq)])   # tokens held by each owned block
        valid = torch.zeros(pool, bs, dtype=torch.bool)
        valid[perm[:used]] = torch.arange(bs)[None, :] < fill[:, None]
        valid[perm[used], 0] |= len(lengths) > real
        _fill_unused(k, v, ~valid.to(device), p.get("unused", "nan"), gen)
    k, v = (_as_served(c.to(device, dtype), p.get("layer"), copy=dist != UNFILLED) if "pool" in p else c.to(device, dtype)
            for c in (k, v))
    return {
        "q": q.to(device, dtype), "k_cache": k, "v_cache": v, "block_table": table.to(device), "seq_lens": torch.tensor(lengths, dtype=torch.int32, device=device),
        "sm_scale": _sm_scale(case),
    }


def prefill_inputs(case: Case, dist: str, seed: int, device: torch.device, dtype: torch.dtype) -> Inputs:
    p = case.params
    gen, dev_gen = _gens(seed, device)
    lengths, H, KVH, D = _lengths(case, gen), p["q_heads"], p["kv_heads"], p["head_dim"]
    total = sum(lengths)
    q, k, v = _qkv(dist, (total, H, D), (total, KVH, D), D, dev_gen, dtype)
    if dist == "served":
        q, k, v = _served_rows(case, lengths, gen, device)
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    return {"q": q.to(device, dtype), "k": k.to(device, dtype), "v": v.to(device, dtype),
            "cu_seqlens": cu.to(device), "max_seqlen": max(lengths), "sm_scale": _sm_scale(case)}


# ---------------------------------------------------------------------------------------------
# float64 references (trusted; computed chunk by chunk so long sequences fit in memory)
# ---------------------------------------------------------------------------------------------

def _attend64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool) -> torch.Tensor:
    """q [M, H, D], k/v [N, KVH, D] -> [M, H, D] float64; causal aligns the last query with the last key."""
    M, H, D = q.shape
    N, KVH, _ = k.shape
    k = k.double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)   # [H, N, D]
    v = v.double().repeat_interleave(H // KVH, dim=1).transpose(0, 1)
    out = torch.empty(M, H, D, dtype=torch.float64, device=q.device)
    chunk = max(1, (1 << 25) // max(1, H * N))
    for s in range(0, M, chunk):
        qc = q[s:s + chunk].double().transpose(0, 1)                    # [H, m, D]
        scores = qc @ k.transpose(1, 2) * sm_scale                      # [H, m, N]
        if causal:
            rows = torch.arange(s, s + qc.shape[1], device=q.device)[:, None] + (N - M)
            scores = scores.masked_fill(torch.arange(N, device=q.device)[None, :] > rows, float("-inf"))
        out[s:s + chunk] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def decode_reference(q, k_cache, v_cache, block_table, seq_lens, sm_scale) -> torch.Tensor:
    """float64, a chunk of sequences at a time: gather each sequence's blocks, mask past its length."""
    B, H, D = q.shape
    bs, KVH = k_cache.shape[1], k_cache.shape[2]
    L = block_table.shape[1] * bs
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    pos = torch.arange(L, device=q.device)
    step = max(1, (1 << 26) // (L * KVH * D))
    for s in range(0, B, step):
        table = block_table[s:s + step].long()
        n = table.shape[0]
        valid = pos[None, :] < seq_lens[s:s + step, None]                              # [n, L]
        k = k_cache[table].reshape(n, L, KVH, D).double()
        v = v_cache[table].reshape(n, L, KVH, D).double().masked_fill(~valid[:, :, None, None], 0)
        qg = q[s:s + step].double().reshape(n, KVH, H // KVH, D)
        scores = torch.einsum("nkgd,nlkd->nkgl", qg, k) * sm_scale
        p = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
        out[s:s + step] = torch.einsum("nkgl,nlkd->nkgd", p, v).reshape(n, H, D)
    return out


def prefill_reference(q, k, v, cu_seqlens, max_seqlen, sm_scale) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    cu = cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        out[s:e] = _attend64(q[s:e], k[s:e], v[s:e], sm_scale, causal=True)
    return out


# ---------------------------------------------------------------------------------------------
# cost model
# ---------------------------------------------------------------------------------------------

def decode_cost(x: Inputs) -> Cost:
    q, kc = x["q"], x["k_cache"]
    B, H, D = q.shape
    tokens = float(x["seq_lens"].sum())
    esz = q.element_size()
    kv_bytes = 2 * tokens * kc.shape[2] * D * esz
    madds = tokens * H * D * 2
    return Cost(bytes=kv_bytes + 2 * q.numel() * esz + x["block_table"].numel() * 4, flops=2 * madds, madds=madds)


def prefill_cost(x: Inputs) -> Cost:
    q, k = x["q"], x["k"]
    _, H, D = q.shape
    cu = x["cu_seqlens"].tolist()
    pairs = sum((e - s) * (e - s + 1) / 2 for s, e in zip(cu[:-1], cu[1:]))   # causal (query, key) pairs
    madds = 2 * pairs * H * D
    esz = q.element_size()
    return Cost(bytes=(2 * q.numel() + 2 * k.numel()) * esz, flops=2 * madds, madds=madds)


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------

def _params(shapes, heads, **extra) -> dict:
    q_heads, kv_heads = heads
    return {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": shapes.head_dim,
            "block_size": shapes.block_size, **extra}


def served_cases(shapes) -> list[Case]:
    heads = tuple(shapes.heads[0])
    cases = []
    for op in ("decode", "prefill"):
        groups = getattr(shapes, op)
        total = sum(g.weight for g in groups)
        for g in groups:
            lo, hi = g.lengths
            label = f"{op} served: batch {g.batch}, lengths {lo}..{hi}, heads {heads[0]}/{heads[1]}"
            cases.append(Case(op, label, _params(shapes, heads, batch=g.batch, length_range=(lo, hi),
                                                 size=g.batch * hi * heads[0]), weight=g.weight / total))
    return cases


def boundary_cases(shapes) -> list[Case]:
    bs = shapes.block_size
    cases = []
    for op in ("decode", "prefill"):
        longest = max(g.lengths[1] for g in getattr(shapes, op))
        if op == "decode":      # either side of a cache block, and the longest served context
            mixed = sorted({n for n in (1, bs - 1, bs, bs + 1, longest) if 1 <= n <= longest})
        else:                   # either side of the usual tile sizes, up to what the shapes reach
            tiles = (1, 15, 16, 17, 63, 64, 65, 127, 128, 129)
            mixed = sorted({n for n in tiles if n <= max(longest, 65)})
        for heads in shapes.heads:
            h = f"heads {heads[0]}/{heads[1]}"
            for what, lengths in (("mixed lengths", mixed), ("length 1", [1]), ("the maximum", [longest])):
                cases.append(Case(op, f"{op} boundary: {what} {lengths}, {h}",
                                  _params(shapes, tuple(heads), lengths=lengths,
                                          size=len(lengths) * max(lengths) * heads[0])))
    return cases


def _graph_padded(shapes, heads, limits) -> list[Case]:
    """A decode step as a CUDA graph replays it (harness/served/graphs.py): one sequence past a batch bucket, padded to
    the next with rows of length 1 on a scratch block, the table a power of two wide with its longest row one block
    past half of it, every padded column on the scratch block: the smallest such step (the batch is not what it
    checks: the max_running cases are the large batches), within the max_running + 1 case's gather (batch x width);
    none where no bucket is padded to."""
    bs = shapes.block_size
    ctx_blocks = math.ceil(limits.longest_context / bs)
    width = width_bucket(ctx_blocks)
    longest = min(limits.longest_context, (width // 2) * bs + 1) if width > 1 else limits.longest_context
    fits = [(lo, hi) for lo, hi in zip(limits.graph_batches, limits.graph_batches[1:])
            if hi > lo + 1 and hi * width <= (limits.max_running + 1) * ctx_blocks]
    if not fits:
        return []
    lo, hi = fits[0]
    return [Case("decode", f"decode as a CUDA graph replays it: {lo + 1} sequences padded to {hi}, contexts up to "
                           f"{longest}, the block table {width} wide, heads {heads[0]}/{heads[1]}",
                 _params(shapes, heads, batch=lo + 1, length_range=(1, longest), longest=True, graph_batch=hi,
                         max_total=max(limits.kv_cache_tokens, longest + lo + 1), size=hi * width * bs * heads[0]))]


def limit_cases(shapes, limits) -> list[Case]:
    """At the served engine's limits (harness/served/limits.py), at the served heads: decode batches of
    max_running and one past it, contexts up to the longest served one (one sequence at it), as many
    tokens in all as the KV cache holds; a decode step padded as a CUDA graph replays it (`_graph_padded`);
    a prefill step of max_prefill_tokens split over one past max_running prompts; and one prompt as long as
    the longer of max_prefill_tokens and the longest served prompt (a longer prompt runs alone)."""
    heads = tuple(shapes.heads[0])
    h = f"heads {heads[0]}/{heads[1]}"
    ctx, cap = limits.longest_context, limits.kv_cache_tokens
    cases = []
    for batch, why in ((limits.max_running, "max_running"), (limits.max_running + 1, "max_running + 1")):
        cases.append(Case("decode", f"decode at the served limits: batch {batch} ({why}), contexts up to {ctx}, {h}",
                          _params(shapes, heads, batch=batch, length_range=(1, ctx), longest=True,
                                  max_total=max(cap, ctx + batch), size=batch * ctx * heads[0])))
    cases += _graph_padded(shapes, heads, limits)
    tokens = limits.max_prefill_tokens
    batch = min(limits.max_running + 1, tokens)
    cases.append(Case("prefill", f"prefill at the served limits: {tokens} tokens (max_prefill_tokens) in {batch} "
                                 f"prompts (max_running + 1), {h}",
                      _params(shapes, heads, batch=batch, total=tokens, size=tokens * heads[0])))
    longest = max(tokens, limits.longest_prompt)
    cases.append(Case("prefill", f"prefill at the served limits: one prompt of {longest} tokens (max_prefill_tokens "
                                 f"{tokens}, longest served prompt {limits.longest_prompt}), {h}",
                      _params(shapes, heads, lengths=[longest], size=longest * heads[0])))
    return cases


DECODE = Op("decode", ("q", "k_cache", "v_cache", "block_table", "seq_lens", "sm_scale"),
            make_inputs=twinned(decode_inputs), reference=decode_reference, baseline=decode_clamped, baselines=DECODE_BASELINES,
            baseline_host=lambda x: {"lengths": x["seq_lens"].tolist()}, step_shared=("block_table", "seq_lens"),
            cost=decode_cost, output_shape=lambda x: tuple(x["q"].shape), per_call="q",
            anchor=decode_anchor, anchor_inputs=decode_anchor_inputs, anchor_name="cuDNN SDPA, contiguous KV of the mean length", unit="TB/s")
PREFILL = Op("prefill", ("q", "k", "v", "cu_seqlens", "max_seqlen", "sm_scale"),
             make_inputs=twinned(prefill_inputs), reference=prefill_reference, baseline=prefill_baseline,
             calibration=prefill_calibration,
             baseline_host=lambda x: {"bounds": x["cu_seqlens"].tolist()}, step_shared=("cu_seqlens",),
             cost=prefill_cost, output_shape=lambda x: tuple(x["q"].shape), per_call="q",
             anchor=prefill_anchor, anchor_inputs=prefill_anchor_inputs, anchor_name="cuDNN SDPA, one causal call per sequence", unit="TFLOP/s")

# `baseline=decode_clamped` serves where no config is applied (unit tests, benches); the harness runs the way
# config.yaml's targets.attention.decode_baseline names (harness.targets.configured), by default the same.
decode_baseline = DECODE.baseline

TARGET = Target(
    name="attention",
    ops={"decode": DECODE, "prefill": PREFILL},
    served_cases=served_cases,
    boundary_cases=boundary_cases,
    contract=CONTRACT,
    limit_cases=limit_cases,
    vary=vary,
    pin=pin,
    twin=twin,
    layer=layer,
)
