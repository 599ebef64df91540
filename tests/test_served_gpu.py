"""The served scenario on a real GPU (Qwen3-0.6B-shaped preset, bf16, the long-context trace): the
reference kernels pass the gates in the served replay, a kernel that drops the newest token fails
them, the profile attributes device time to the model's parts, and `evaluate` runs through the
replay. Skipped without CUDA. Each test prints the figures docs/BENCHMARKS.md records; acceptance
itself is a measurement, printed, not asserted."""
from __future__ import annotations

import math
import re

import pytest
import torch

import candidates as C
from conftest import CUDA, config_with
from harness.profile import profile_served, render
from harness.stages import STAGE_NAMES
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


def test_profile_attributes_device_time_to_the_models_parts():
    report = profile_served(CFG, "attention", device=torch.device("cuda"), window_s=WINDOW)
    print("\n" + render(report))
    assert report["device"] == "cuda" and "device time" in report["clock"]
    assert math.isclose(sum(b["share"] for b in report["buckets"].values()), 1.0, rel_tol=1e-9)
    assert report["unattributed_share"] < 0.05
    assert report["buckets"]["attention_decode"]["share"] > 0 and report["buckets"]["gemm"]["share"] > 0


def test_evaluate_runs_the_reference_decode_kernel_through_the_replay(evaluate_source):
    """The reference kernel passes the four cheap stages (microbench: about 4x the served baseline) and is
    served through the whole replay, its gates passed and every decode call its own; whether the replay then
    accepts it is a measurement over a 20 s window, printed, not asserted."""
    v = evaluate_source(C.REF_DECODE, config=CFG)
    print("\n" + v.reason + "\n" + v.stages[-1].reason)
    assert [s.name for s in v.stages] == list(STAGE_NAMES), v.reason
    assert [s.status for s in v.stages[:-1]] == ["passed"] * (len(STAGE_NAMES) - 1), v.reason
    replay = v.stages[-1]
    assert replay.status in ("passed", "failed") and replay.metrics.get("gate_passed") == 1.0, replay.reason
    assert replay.metrics["fallback_share"] == 0.0 and replay.metrics["gate_tokens_compared"] > 0
