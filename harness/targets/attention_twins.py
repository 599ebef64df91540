"""Twin checks for the attention target: an earlier parity check's inputs again, one part of them redrawn.

An output kept from an earlier call and handed back when a cheap key matches (the shape, the lengths, sm_scale,
a few rows of q) is right on every check whose inputs are all fresh, so fresh draws alone never see it. A twin
is the check before it sent again with the same lengths, block table, sm_scale and unused slots, and one band
of one sequence redrawn from the twin's own secret seed: decode, its query (every head) or a band of its keys
and values; prefill, a band of its rows (q, k and v; one token or many). A key that skips that band returns the
earlier output, which is wrong there by the band's whole share of the attention.

A step's next layer (`layer`) is made the same way with every sequence's queries, keys and values redrawn: the
lengths, block table, sm_scale and unused slots as the check before it (a served step's layers share them, and the
worker hands the call the same index tensors as the call before, harness/worker.py), a decode cache as the other
layer's view of its two-layer buffer where the check had one.

The part is chosen by `twin` (trusted side, from the twin's seed) and named in the case's params and label;
`twinned` wraps an op's `make_inputs`, so the trusted side and the worker rebuild the same inputs from the
recipe: the earlier check's inputs from its seed, a fresh draw at the same lengths from the twin's seed, and
the band copied from the second into the first. The fresh draw keeps the check's distribution (the served
model's rows included) and leaves out the served layout (only its values are read).
"""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable

import torch

from harness.targets.base import UNFILLED, Case, Inputs

MakeInputs = Callable[[Case, str, int, torch.device, torch.dtype], Inputs]
TRIES = 8           # fresh draws of a twin's band, until one differs from the earlier check's


def _lengths(op: str, inputs: Inputs) -> list[int]:
    if op == "decode":
        return [int(n) for n in inputs["seq_lens"].tolist()]
    cu = inputs["cu_seqlens"].tolist()
    return [e - s for s, e in zip(cu[:-1], cu[1:])]


def twin(case: Case, seed: int, inputs: Inputs, rng: random.Random) -> Case:
    """The check drawn from `seed` as `case` (its inputs `inputs`) again, with one band of one sequence redrawn:
    which, from `rng` (the twin's seed)."""
    lengths = _lengths(case.op, inputs)
    b = rng.randrange(len(lengths))
    n = lengths[b]
    start = rng.randrange(n)
    if case.op == "prefill":        # one token's rows, or a band of them
        part, end = "rows", start + 1 if rng.random() < 0.25 else rng.randint(start + 1, n)
    elif rng.random() < 0.25:       # the query: a useful cache keys on it (it is new at every step), so seldom
        part, start, end = "query", 0, n
    else:                           # a band of its keys and values, wide enough to move the output past bf16's error
        part, end = "keys and values", rng.randint(start + 1, n)
    what = f"sequence {b}'s query" if part == "query" else f"sequence {b}'s {part} {start}..{end - 1} of {n}"
    spec = {"of": seed, "lengths": lengths, "seq": b, "part": part, "start": start, "end": end}
    return replace(case, label=f"{case.label}; the check before it again with {what} redrawn",
                   params={**case.params, "twin": spec})


def layer(case: Case, seed: int, inputs: Inputs, rng: random.Random) -> Case:
    """The check drawn from `seed` as `case` (its inputs `inputs`) as the next layer of its step: every query, key
    and value redrawn from the layer's own seed, the rest the same. `rng` is unused: nothing of it is a choice."""
    spec = {"of": seed, "lengths": _lengths(case.op, inputs), "part": "layer"}
    params = {**case.params, "twin": spec}
    view = ""
    if "layer" in params:
        params["layer"] = 1 - params["layer"]
        view = f"layer {params['layer']}'s view of the cache, "
    return replace(case, label=f"{case.label}; then the next layer of its step ({view}the same index tensors, every "
                               f"query, key and value redrawn)", params=params)


def _slots(table: torch.Tensor, b: int, start: int, end: int, block: int) -> torch.Tensor:
    """The flat cache slots (block * block_size + offset) of sequence b's tokens start..end-1."""
    t = torch.arange(start, end, device=table.device)
    return table[b].long()[t // block] * block + t % block


def _cached(x: Inputs, slots: torch.Tensor) -> list[tuple[torch.Tensor, object]]:
    """The keys and values at these flat cache slots."""
    return [(x[name].view(-1, *x[name].shape[2:]), slots) for name in ("k_cache", "v_cache")]


def _band(x: Inputs, spec: dict) -> list[tuple[torch.Tensor, object]]:
    """Where the twin's band lies in inputs `x`: (a view of a tensor, the index of the band in it) per tensor."""
    decode, block = "k_cache" in x, x["k_cache"].shape[1] if "k_cache" in x else 0
    if spec["part"] == "layer" and decode:              # every query, and every sequence's keys and values
        return [(x["q"], slice(None))] + _cached(x, torch.cat([_slots(x["block_table"], b, 0, n, block)
                                                               for b, n in enumerate(spec["lengths"])]))
    if spec["part"] == "layer":
        return [(x[name], slice(None)) for name in ("q", "k", "v")]
    b, s, e = spec["seq"], spec["start"], spec["end"]
    if spec["part"] == "query":
        return [(x["q"], b)]
    if spec["part"] == "keys and values":
        return _cached(x, _slots(x["block_table"], b, s, e, block))
    first = int(x["cu_seqlens"][b])
    return [(x[name], slice(first + s, first + e)) for name in ("q", "k", "v")]


def twinned(make: MakeInputs) -> MakeInputs:
    """`make` that builds a twin's inputs (a case whose params hold `twin`) as the module docstring says. A fresh
    draw whose band equals the earlier one (the served distribution reads windows of a few hundred captured
    rows, so a window can start where the earlier one did) is drawn again from the next seed, up to TRIES."""
    def make_inputs(case: Case, dist: str, seed: int, device: torch.device, dtype: torch.dtype) -> Inputs:
        spec = case.params.get("twin")
        if spec is None:
            return make(case, dist, seed, device, dtype)
        base = {k: v for k, v in case.params.items() if k != "twin"}
        x = make(replace(case, params=base), dist, spec["of"], device, dtype)
        if dist == UNFILLED:
            return x
        at = {k: v for k, v in base.items() if k not in ("pool", "layer")} | {"lengths": spec["lengths"]}
        into = _band(x, spec)
        for tries in range(TRIES):
            src = _band(make(replace(case, params=at), dist, seed + tries, device, dtype), spec)
            if not all(torch.equal(a[i], f[j]) for (a, i), (f, j) in zip(into, src)):
                break
        for (a, i), (f, j) in zip(into, src):
            a[i] = f[j]
        return x
    return make_inputs
