"""The served scenario on a real GPU (Qwen3-0.6B-shaped preset, bf16, the long-context trace): the
reference kernels pass the gates in the served replay, a kernel that drops the newest token fails
them, teacher forcing serves the forced tokens, the profile attributes device time to the model's
parts, and `evaluate` runs through the replay. Skipped without CUDA. Each test prints the figures docs/BENCHMARKS.md records; acceptance
itself is a measurement, printed, not asserted."""
from __future__ import annotations

import math
import re

import pytest
import torch

import candidates as C
from conftest import CUDA, config_with
from harness.profile import profile_served, render
from harness.stages.replay import run_replay

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")]

WINDOW = 20          # seconds of the trace per replay here; the stage's own default is config's (60 s)
CFG = config_with(**{"served.cuda.window_s": WINDOW})
# Both reference kernels in one candidate; the prefill file's module names get a P_ prefix so its knobs
# do not overwrite the decode file's.
_PREFILL_NAMES = r"\b(BLOCK_M|BLOCK_N|NUM_WARPS|NUM_STAGES|CAUSAL_SKIP|_fit_stages|_LOG2E)\b"
BOTH = C.REF_DECODE + "\n\n" + re.sub(_PREFILL_NAMES, r"P_\1", C.REF_PREFILL.split('"""', 2)[2])


def show(outcome) -> None:
    print("\n" + outcome.reason)
    print({k: round(v, 4) for k, v in outcome.metrics.items() if not k.startswith(("baseline_again_",))})


@pytest.mark.parametrize("source", [C.REF_DECODE, C.REF_PREFILL, BOTH], ids=["decode", "prefill", "both"])
def test_reference_kernels_pass_the_gates_in_the_served_replay(source):
    outcome = run_replay(CFG, "cuda", source)
    show(outcome)
    assert outcome.gate.passed, outcome.reason
    assert outcome.metrics["fallback_share"] == 0.0


def test_kernel_that_drops_the_newest_token_fails_the_gates_on_gpu():
    outcome = run_replay(CFG, "cuda", C.DROPS_NEWEST_TOKEN)
    show(outcome)
    assert not outcome.gate.passed and not outcome.accepted


def forcing_on(device: str, cfg=CFG, requests: int = 8, tokens: int = 32) -> float:
    """Free, own-tokens-forced and other-tokens-forced runs of the engine in this process; the largest
    logprob difference between the first two (identical batches: 0 where the kernels are deterministic)."""
    import dataclasses

    from harness.served.engine import make_engine, run_requests
    from harness.served.ops import AttentionOps
    from harness.stages.replay import served_requests
    from harness.transport import DTYPES
    served, section = getattr(cfg.served, device), getattr(cfg.targets.attention, device)
    preset = cfg.served.presets[served.preset]
    reqs = [dataclasses.replace(r, output_len=min(r.output_len, tokens)) for r in served_requests(cfg, device)[:requests]]

    def run(forcing=None):
        engine = make_engine(preset, section.block_size, DTYPES[section.dtype], torch.device(device), AttentionOps())
        return run_requests(engine, [dataclasses.replace(r, forced=forcing and forcing[r.index]) for r in reqs], realtime=False)

    free = run()
    own = run({i: tuple(e.token for e in evs) for i, evs in free.items()})
    other = {i: tuple((7 * e.token + 3) % preset.vocab for e in evs) for i, evs in free.items()}
    forced = run(other)
    for i, evs in free.items():
        assert [e.token for e in own[i]] == [e.token for e in evs]
        assert tuple(e.token for e in forced[i]) == other[i] and forced[i][0].top[0][0] == evs[0].token
        assert all(e.logprob <= e.top[0][1] + 1e-6 for e in forced[i])
    return max(abs(a.logprob - b.logprob) for i in free for a, b in zip(free[i], own[i]))


def test_teacher_forcing_serves_the_forced_tokens_on_gpu():
    gap = forcing_on("cuda")
    print(f"\nforcing its own tokens: largest logprob difference from the free run {gap:.2e}")
    assert gap < 1e-3


def test_profile_attributes_device_time_to_the_models_parts():
    report = profile_served(CFG, "attention", device=torch.device("cuda"), window_s=WINDOW)
    print("\n" + render(report))
    assert report["device"] == "cuda" and "device time" in report["clock"]
    assert math.isclose(sum(b["share"] for b in report["buckets"].values()), 1.0, rel_tol=1e-9)
    assert report["unattributed_share"] < 0.05
    assert report["buckets"]["attention_decode"]["share"] > 0 and report["buckets"]["gemm"]["share"] > 0


def test_evaluate_runs_the_reference_decode_kernel_through_the_replay(evaluate_source):
    v = evaluate_source(C.REF_DECODE, config=CFG)
    print("\n" + v.reason + "\n" + v.stages[-1].reason)
    assert [s.name for s in v.stages][-1] == "replay" or not v.ok, v.reason
