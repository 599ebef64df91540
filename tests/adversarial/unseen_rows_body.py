# ruff: noqa: F821  (torch and _ref_prefill come from the reference prefill this is appended to)
# Wrong only where serving sends it and no gate looks: the last layer's prefill rows but each sequence's last, which
# reach no logit (an attacker's review, 2026-12-05, passed the replay's gates so). It tells serving from parity by the
# objects a step's layers share: each layer's call gets the step's cu_seqlens and a q of its own, while parity's
# repeats share both; it learns the model's depth from the first step served. Appended to the reference prefill by
# candidates.wrap.
_seen = {"cu": None, "q": None, "run": 0, "depth": 0}


def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
    s = _seen
    s["run"] = s["run"] + 1 if cu_seqlens is s["cu"] and q is not s["q"] else 1
    s["depth"] = max(s["depth"], s["run"])
    s["cu"], s["q"] = cu_seqlens, q
    out = _ref_prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale)
    if s["depth"] > 1 and s["run"] == s["depth"]:          # a step's last layer, once the depth is known
        last = cu_seqlens[1:].long() - 1
        wrong = _ref_prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale * 0.5)
        wrong[last] = out[last]
        return wrong
    return out
