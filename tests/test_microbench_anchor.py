"""Microbench's cuDNN anchor is timed on the candidate's own work: a time is reused for a later draw only where the
anchor's inputs have the same shapes (harness/stages/anchor.py). The attention target's own anchor inputs are made
here on the CPU; the timer is a stand-in that counts its calls (on the CPU nothing of cuDNN runs)."""
from __future__ import annotations

import functools

import torch

from harness.stages import anchor
from harness.targets.attention_baselines import decode_anchor_inputs, prefill_anchor_inputs

KEY = ("a device", "torch.bfloat16", "prefill_b4_len512-2048", 30, 2, 1 << 28, 2_000_000)


def prefill_inputs(lengths: list[int], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, 8, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "cu_seqlens": cu, "max_seqlen": max(lengths), "sm_scale": 0.1 * seed + 0.3}


def decode_inputs(lengths: list[int], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(len(lengths), 4, 8, generator=gen), "k_cache": torch.randn(6, 16, 2, 8, generator=gen),
            "seq_lens": torch.tensor(lengths, dtype=torch.int32), "sm_scale": 0.25}


def sets(make, *inputs) -> list:
    return [functools.partial(make, x) for x in inputs]


class Timer:
    """Times a set as 1 ms per its first tensor's elements, and counts its calls."""
    def __init__(self, fail: bool = False):
        self.calls, self.fail = 0, fail

    def __call__(self, prepared: dict) -> float:
        self.calls += 1
        if self.fail:
            raise RuntimeError("no cuDNN kernel for these shapes")
        first = next(iter(prepared.values()))
        first = first[0][0] if isinstance(first, list) else first
        return float(first.numel())


def test_the_anchors_workload_is_its_inputs_shapes_and_never_their_values():
    same = [anchor.workload(prefill_anchor_inputs(prefill_inputs([32, 64, 16, 48], seed))) for seed in (1, 2)]
    assert same[0] == same[1]                              # other values and sm_scale: the same work
    assert anchor.workload(prefill_anchor_inputs(prefill_inputs([48, 64, 16, 32], 1))) != same[0]   # other order
    assert anchor.workload(prefill_anchor_inputs(prefill_inputs([32, 64, 16, 40], 1))) != same[0]   # one length
    dec = [anchor.workload(decode_anchor_inputs(decode_inputs(lengths, 3))) for lengths in ([20, 40], [30, 30], [20, 42])]
    assert dec[0] == dec[1] != dec[2]                      # the decode anchor reads the mean length's contiguous K/V


def timed(key: tuple, case: list, timer: Timer, times: dict) -> dict | None:
    """What microbench does: the case's work found once (`_build_anchors`), then the anchor timed or reused."""
    return anchor.time_anchor(anchor.work(key, case), case, timer, times)


def test_an_anchor_time_is_reused_only_for_a_draw_of_the_same_shapes():
    times, timer = {}, Timer()
    first = timed(KEY, sets(prefill_anchor_inputs, prefill_inputs([32, 64], 1), prefill_inputs([16, 16], 2)), timer, times)
    assert timer.calls == 2 and first["anchor_reused"] == 0.0 and first["anchor_s"] >= 0
    assert first["anchor_ms"] == (32 * 4 * 8 + 16 * 4 * 8) / 2          # the median of the two sets' times
    again = timed(KEY, sets(prefill_anchor_inputs, prefill_inputs([32, 64], 7), prefill_inputs([16, 16], 8)), timer, times)
    assert timer.calls == 2 and again == {"anchor_ms": first["anchor_ms"], "anchor_reused": 1.0}
    other = timed(KEY, sets(prefill_anchor_inputs, prefill_inputs([48, 64], 7), prefill_inputs([16, 16], 8)), timer, times)
    assert timer.calls == 4 and other["anchor_reused"] == 0.0 and other["anchor_ms"] == (48 * 4 * 8 + 16 * 4 * 8) / 2
    elsewhere = timed(("another device", *KEY[1:]),
                      sets(prefill_anchor_inputs, prefill_inputs([32, 64], 1), prefill_inputs([16, 16], 2)), timer, times)
    assert timer.calls == 6 and elsewhere["anchor_reused"] == 0.0


def test_an_anchor_the_library_cannot_run_has_no_figure_and_is_not_kept():
    times = {}
    case = sets(prefill_anchor_inputs, prefill_inputs([32, 64], 1))
    assert timed(KEY, case, Timer(fail=True), times) is None and times == {}
    timer = Timer()
    assert timed(KEY, case, timer, times)["anchor_reused"] == 0.0 and timer.calls == 1
