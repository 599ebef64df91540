"""Parity draws what serving sends: sm_scale, batches and lengths to the served engine's limits, what
unused cache slots hold, the served model's own q, k, v, and both ops interleaved in one worker.
Each adversarial fixture in tests/adversarial/ passed the old parity and is rejected at parity now,
for the reason its file names (CPU: Triton's interpreter, float32; on CUDA the same files run at the
served sizes, their thresholds there being the old parity's CUDA maxima)."""
from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import CUDA, config_with
from harness.evaluate import device_shapes
from harness.served.capture import served_qkv
from harness.served.limits import served_limits
from harness.stages.parity import plan_checks
from harness.targets import TARGETS

ADVERSARIAL = Path(__file__).resolve().parent / "adversarial"
ATTENTION = TARGETS["attention"]
CPU = torch.device("cpu")


def _ctx(cfg, ops=("decode", "prefill")):
    """What the draws read of an evaluation's context: no worker needed."""
    from harness.stages.common import EvalContext
    return EvalContext(cfg=cfg, target=ATTENTION, shapes=device_shapes(cfg, "attention", CPU), device=CPU,
                       dtype=torch.float32, pool=None, source="", ops=list(ops))


def _limit_case(cfg, op, words):
    return next(c for c in _ctx(cfg).cases(op, served=False, boundary=False, limits=True) if words in c.label)


def test_served_limit_cases_come_from_the_served_preset_and_trace(cfg):
    lim = served_limits(cfg, "cpu")
    preset = cfg.served.presets[cfg.served.cpu.preset]
    assert (lim.max_running, lim.max_prefill_tokens, lim.kv_cache_tokens) == \
        (preset.max_running, preset.max_prefill_tokens, preset.kv_cache_tokens)
    def batches(config):
        cases = _ctx(config).cases("decode", served=False, boundary=False, limits=True)
        return (sorted(c.params["batch"] for c in cases if "served limits" in c.label),
                [(c.params["batch"], c.params["graph_batch"]) for c in cases if "graph" in c.label])
    assert batches(cfg) == ([preset.max_running, preset.max_running + 1], [(3, 4)])    # the smallest padded: 3 -> 4
    smaller = config_with(**{"served.presets.tiny.max_running": 5, "served.presets.tiny.max_prefill_tokens": 40})
    assert batches(smaller) == ([5, 6], [(3, 4)])
    step = _limit_case(smaller, "prefill", "tokens (max_prefill_tokens)")
    lengths = ATTENTION.ops["prefill"].make_inputs(step, "normal", 7, CPU, torch.float32)["cu_seqlens"].diff().tolist()
    assert sum(lengths) == 40 and len(lengths) == 6 and min(lengths) >= 1


def test_on_cuda_the_limits_are_the_served_models_past_every_old_parity_maximum(cfg):
    """Read from the config alone (no GPU needed): qwen3-0.6b's limits and the long-context trace,
    beyond the old parity's largest batch (64) and longest prefill (8192)."""
    shapes = device_shapes(cfg, "attention", torch.device("cuda"))
    cases = ATTENTION.limit_cases(shapes, served_limits(cfg, "cuda"))
    limits = [c for c in cases if "served limits" in c.label]
    assert sorted(c.params["batch"] for c in limits if c.op == "decode") == [128, 129]
    assert [c.params["lengths"] for c in cases if "one prompt" in c.label] == [[16384]]
    assert all(c.params["length_range"] == (1, 17056) for c in limits if c.op == "decode")
    graph = next(c for c in cases if "graph" in c.label)     # a table 2048 wide, its longest row 1025 pages
    assert (graph.params["batch"], graph.params["graph_batch"], graph.params["length_range"]) == (3, 4, (1, 16385))


def test_decode_at_the_limits_reaches_the_longest_served_context_within_the_cache(cfg):
    lim = served_limits(cfg, "cpu")
    case = _limit_case(cfg, "decode", "max_running + 1")
    for seed in range(5):
        lens = ATTENTION.ops["decode"].make_inputs(case, "normal", seed, CPU, torch.float32)["seq_lens"].tolist()
        assert len(lens) == lim.max_running + 1 and max(lens) == lim.longest_context and sum(lens) <= lim.kv_cache_tokens


def test_a_decode_step_padded_as_a_cuda_graph_replays_it_has_padding_rows_and_columns_on_a_block_no_sequence_owns(cfg):
    """harness/served/graphs.py pads a decode step's batch to a bucket with rows of length 1 and its table to a power of
    two wide, every padded entry on one scratch block; parity's graph-padded check sends the same."""
    case = _limit_case(cfg, "decode", "as a CUDA graph replays it")
    real, padded = case.params["batch"], case.params["graph_batch"]
    assert padded in served_limits(cfg, "cpu").graph_batches and real < padded
    for seed in range(4):
        x = ATTENTION.ops["decode"].make_inputs(case, "normal", seed, CPU, torch.float32)
        table, lens, bs = x["block_table"], x["seq_lens"].tolist(), x["k_cache"].shape[1]
        pages = [-(-n // bs) for n in lens[:real]]
        width = table.shape[1]
        assert len(lens) == padded and lens[real:] == [1] * (padded - real)
        assert width & (width - 1) == 0 and max(pages) < width and max(pages) > width // 2
        scratch = int(table[real, 0])
        owned = {int(table[b, i]) for b, n in enumerate(pages) for i in range(n)}
        assert scratch not in owned and (table[real:] == scratch).all() and (table[:, max(pages):] == scratch).all()
        ref = ATTENTION.ops["decode"].reference(*[x[n] for n in ATTENTION.ops["decode"].arg_names])
        assert torch.isfinite(ref).all()         # position 0 of the scratch block holds a key; the rest is unused


def test_a_decode_wrong_only_where_its_table_is_wider_than_its_longest_row_is_rejected_on_the_graph_padded_check(
        evaluate_source):
    """Every other check's block table is exactly as wide as its longest row needs; a CUDA graph's is a power of two
    wide, past it. A decode that takes another path there (here: reads it on the host and reads the wrong kv heads)
    passed the old parity."""
    source = (ADVERSARIAL / "big_batch_path.py").read_text()
    flawed = "    big = B > (64 if q.device.type == \"cuda\" else 8)"
    assert flawed in source
    wide = "    big = block_table.shape[1] > -(-int(seq_lens.max()) // k_cache.shape[1])"
    v = evaluate_source(source.replace(flawed, wide), until="parity")
    assert v.failed_stage == "parity", v.reason
    assert "as a CUDA graph replays it" in v.stages[-1].reason, v.stages[-1].reason


def test_each_check_draws_sm_scale_and_what_unused_slots_hold_from_its_seed(cfg):
    ctx = _ctx(cfg)
    case = ctx.cases("decode", boundary=False)[0]
    served_scale = 1 / math.sqrt(case.params["head_dim"])
    scales, fills = [], set()
    for seed in range(60):
        varied = ATTENTION.vary(case, "normal", random.Random(seed), ctx)
        x = ATTENTION.ops["decode"].make_inputs(varied, "normal", seed, CPU, torch.float32)
        scales.append(x["sm_scale"])
        fills.add(varied.params["unused"])
        assert varied.params["unused"] in varied.label and "sm_scale" in varied.label
        bs = x["k_cache"].shape[1]
        tables, lens = x["block_table"], x["seq_lens"].tolist()
        used = torch.zeros(x["k_cache"].shape[:2], dtype=torch.bool)
        for b, n in enumerate(lens):
            for t in range(n):
                used[tables[b, t // bs], t % bs] = True
        k, garbage = x["k_cache"], x["k_cache"][~used]
        if varied.params["unused"] == "nan":
            assert garbage.isnan().all()
        elif varied.params["unused"] == "zeros":
            assert (garbage == 0).all()
        elif varied.params["unused"] == "stale":           # copies of slots some sequence holds
            held = k[used].reshape(-1, k.shape[-1])
            assert all((held == row).all(1).any() for row in garbage.reshape(-1, k.shape[-1]))
        else:
            assert torch.isfinite(garbage).all() and (garbage != 0).any()
    assert fills == set(cfg.stages.parity.unused_slots)
    lo, hi = cfg.stages.parity.sm_scale
    assert min(scales) < 0.8 * served_scale and max(scales) > 1.25 * served_scale
    assert all(lo * served_scale * 0.999 <= s <= hi * served_scale * 1.001 for s in scales)
    assert 0 < sum(s == served_scale for s in scales) < len(scales) / 2     # the served value, now and then


def test_a_checks_label_names_the_served_sm_scale_only_where_it_drew_exactly_that(cfg):
    """A drawn factor of 1.0016 is not the served scale: its label must not read "1/sqrt(D)" (feedback and parity's
    reasons would then say a kernel failed where the served scale was used). Over 3,000 draws some factors fall
    within rounding of 1."""
    ctx = _ctx(cfg)
    case = ctx.cases("decode", boundary=False)[0]
    served = 1 / math.sqrt(case.params["head_dim"])
    near = 0
    for seed in range(3000):
        varied = ATTENTION.vary(case, "normal", random.Random(seed), ctx)
        exact = varied.params["sm_scale"] == served
        near += not exact and abs(varied.params["sm_scale"] / served - 1) < 0.005
        assert ("(1/sqrt(" in varied.label) == exact, varied.label
    assert near > 0


def test_the_served_distribution_is_the_served_models_own_queries_keys_and_values(cfg):
    ctx = _ctx(cfg)
    layers = served_qkv(cfg, CPU, torch.float32)
    assert len(layers) == cfg.served.presets["tiny"].layers
    case = next(c for c in ctx.cases("prefill", served=False) if "mixed lengths" in c.label and "4/2" in c.label)
    varied = ATTENTION.vary(case, "served", random.Random(3), ctx)
    x = ATTENTION.ops["prefill"].make_inputs(varied, "served", 3, CPU, torch.float32)
    layer = int(varied.label.split("layer ")[1].split()[0])
    q_bank, k_bank, _ = layers[layer]
    assert all((q_bank == row).all(-1).all(-1).any() for row in x["q"])         # every query a captured one
    assert all((k_bank == row).all(-1).all(-1).any() for row in x["k"])
    assert not torch.equal(q_bank, layers[1 - layer][0])                        # layers differ


def test_a_checks_tolerance_is_set_by_its_ops_calibration_where_it_names_one_and_by_the_baseline_elsewhere(cfg):
    """Prefill's tolerance comes from its calibration (the baseline without cuDNN's per-length plans, on a GPU),
    decode names none (its baseline's error sets it): a calibration that errs by 0.25 everywhere sets a prefill
    check's max-abs tolerance at tolerance_factor x 0.25, and the timed baseline stays the baseline."""
    from dataclasses import replace

    from harness.stages.common import draw
    prefill = ATTENTION.ops["prefill"]
    assert ATTENTION.ops["decode"].calibration is None and prefill.calibration is not None
    off = replace(prefill, calibration=lambda **x: prefill.baseline(**x) + 0.25)
    ctx = _ctx(cfg)
    ctx.target = replace(ATTENTION, ops={**ATTENTION.ops, "prefill": off})
    case = next(c for c in ctx.cases("prefill") if c.weight > 0)
    p = cfg.stages.parity
    assert draw(ctx, case, "normal").tol.max_abs == pytest.approx(p.tolerance_factor * 0.25, rel=1e-3)
    honest = draw(_ctx(cfg), case, "normal").tol.max_abs
    assert honest < p.tolerance_factor * 0.01 and off.baseline is prefill.baseline


def test_parity_interleaves_the_ops_and_rotates_every_distribution_through_each(cfg):
    plan = plan_checks(_ctx(config_with(**{"stages.parity.twins": 0.0, "stages.parity.layers": 0.0})))   # tests/test_parity_twins.py
    ops = [check.case.op for check in plan]
    assert ops[:6] == ["decode", "prefill"] * 3
    for op in ("decode", "prefill"):
        assert {check.dist for check in plan if check.case.op == op} == set(cfg.stages.parity.distributions)


@pytest.mark.parametrize("fixture, words, never", [
    ("ignores_sm_scale.py", "sm_scale", "(1/sqrt("),
    ("big_batch_path.py", ("decode at the served limits: batch", "drawn"), None),     # a drawn batch may come first
    ("masks_unused_by_nan.py", "unused slots hold", "unused slots hold nan"),
    ("right_only_to_old_longest_prefill.py", "prefill at the served limits", None),
    ("shared_output_buffer.py", "its output changed after it was returned", None),
], ids=lambda v: v.removesuffix(".py") if isinstance(v, str) and v.endswith(".py") else "")
def test_adversarial_fixture_is_rejected_at_parity_for_its_flaw(evaluate_source, fixture, words, never):
    v = evaluate_source((ADVERSARIAL / fixture).read_text(), until="parity")
    assert v.failed_stage == "parity", v.reason
    reason = v.stages[-1].reason
    assert any(w in reason for w in ((words,) if isinstance(words, str) else words)), reason
    assert never is None or never not in reason.split(", output shape")[0], reason


def test_the_same_two_ops_with_outputs_of_their_own_pass_interleaved(evaluate_source):
    source = (ADVERSARIAL / "shared_output_buffer.py").read_text()
    fixed = source.replace("    out = _output(q)\n", "    out = torch.empty_like(q)\n")
    assert fixed.count("torch.empty_like(q)") == 2
    v = evaluate_source(fixed, until="parity")
    assert v.ok, v.reason
    parity = v.stages[-1]
    assert "interleaved over decode, prefill" in parity.reason


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA): the fixtures' thresholds there are the old CUDA maxima")
@pytest.mark.parametrize("fixture, words", [
    ("big_batch_path.py", ("batch 128 (max_running)", " drawn,")),     # a served check's drawn batch may come first
    ("right_only_to_old_longest_prefill.py", ("one prompt of 16384 tokens",)),
], ids=["big-batch-path", "old-longest-prefill"])
def test_on_cuda_the_served_limits_reject_what_only_the_old_cuda_maxima_let_through(evaluate_source, fixture, words):
    v = evaluate_source((ADVERSARIAL / fixture).read_text(), until="parity")
    assert v.failed_stage == "parity", v.reason
    assert any(w in v.stages[-1].reason for w in words), v.stages[-1].reason


def test_one_op_reusing_its_own_output_buffer_is_rejected_too(evaluate_source):
    """The rule is the contract's: the returned tensor is the caller's. A decode that hands back the
    same buffer call after call is caught when the next checks write over it."""
    source = (ADVERSARIAL / "shared_output_buffer.py").read_text()
    decode_only = source[:source.index("\ndef prefill(")] + "\n"
    v = evaluate_source(decode_only, until="parity")
    assert v.failed_stage == "parity", v.reason
    assert "its output changed after it was returned" in v.stages[-1].reason
