"""How the attention target's cases are drawn, apart from their payloads: the shape one parity check varies from its
secret seed (`vary`), and the lengths microbench holds the same for every candidate (`pin`)."""
from __future__ import annotations

import math
import random
from dataclasses import replace

from harness.served.limits import served_limits
from harness.targets.base import Case


def _batch_drawn(case: Case, batch: int) -> Case:
    """A served shape at another batch, its lengths scaled to the shape's own tokens (no more memory held)."""
    (lo, hi), budget = case.params["length_range"], case.params["batch"] * case.params["length_range"][1]
    lo = max(1, min(lo, budget // batch))
    lengths = (lo, max(lo, min(hi, budget // batch)))
    return replace(case, params={**case.params, "batch": batch, "length_range": lengths, "max_total": budget})


def vary(case: Case, dist: str, rng: random.Random, ctx) -> Case:
    """One check's draws from its secret seed (config: stages.parity): a served shape's batch (a share of checks);
    sm_scale, 1/sqrt(head_dim) times a factor drawn log-uniformly (one check in four exactly 1/sqrt(head_dim)); for
    decode, what unused cache slots hold and the cache's layout; for the served distribution, which layer of the
    served model's captured q, k, v. Each is named in the case's label, so feedback says what was drawn."""
    p, limits = ctx.cfg.stages.parity, served_limits(ctx.cfg, ctx.device.type)
    drawn = case.weight > 0 and "length_range" in case.params and rng.random() < p.batch_drawn  # serving sends them all
    case = _batch_drawn(case, rng.randint(1, limits.max_running + 1)) if drawn else case
    D = case.params["head_dim"]
    lo, hi = p.sm_scale
    factor = 1.0 if rng.random() < 0.25 else math.exp(rng.uniform(math.log(lo), math.log(hi)))
    params = {**case.params, "sm_scale": factor / math.sqrt(D)}
    notes = [f"batch {params['batch']} drawn"] if drawn else []
    notes.append(f"sm_scale {params['sm_scale']:.4g} ({factor:.6g}/sqrt({D}))")     # six figures: 1.0016 is not 1
    if case.op == "decode":
        params["unused"] = rng.choice(p.unused_slots)
        notes.append(f"unused slots hold {params['unused']}")
        if rng.random() < p.served_layout:
            params["pool"] = limits.kv_cache_tokens // case.params["block_size"]
            params["layer"] = rng.randrange(2)
            notes.append(f"the cache as served: a {params['pool']}-block pool, layer {params['layer']}'s view")
    if dist == "served":
        from harness.served.capture import served_qkv       # builds the served model: only when drawn
        layers = served_qkv(ctx.cfg, ctx.device, ctx.dtype)
        layer = rng.randrange(len(layers))
        params["served_qkv"] = layers[layer]
        notes.append(f"layer {layer} of the served model")
    return replace(case, label=f"{case.label}; {', '.join(notes)}", params=params)


def pin(case: Case, rng: random.Random) -> Case:
    """`case` with its lengths drawn from a seed of its own, taken from `rng` (Target.pin): every input set made from
    the result has those lengths, whatever its own seed, which still draws the queries, keys, values and block table.
    Fixed lengths are left as they are."""
    if "lengths" in case.params:
        return case
    return replace(case, params={**case.params, "lengths_seed": rng.getrandbits(62)})
