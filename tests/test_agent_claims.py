"""A claim's ceiling 1/(1-f+f/s) is computed by code from the profile's f and the planner's s, never
taken from the model; a reply without a valid claim says why, so the repair round can tell the model."""
from __future__ import annotations

import pytest

from fakes import scripts as S
from agent.roles.planner import parse_claim
from agent.roles.conclusion import conclude, served_over_torch
from agent.records import Claim, Kernel, KillTest, OpEvidence, Profile, Round
from harness.amdahl import ceiling
from harness.records import StageResult, Verdict
from agent.run.state import ProposalState


def state(share: float = 0.35) -> ProposalState:
    profile = Profile(source="stand-in", note="", device="cpu", arch="cpu",
                      ops={"decode": OpEvidence(share=share, lines=[]), "prefill": OpEvidence(share=0.15, lines=[])})
    return ProposalState(next_id="c001", ops=["decode", "prefill"], history=[], heads={}, parents={}, profile=profile,
                         min_ceiling=1.005)


@pytest.mark.parametrize("f, s, expected", [(0.5, 2.0, 4 / 3), (1.0, 3.0, 3.0), (0.04, 3.0, 1 / (0.96 + 0.04 / 3))])
def test_ceiling_is_amdahls_law(f, s, expected):
    assert ceiling(f, s) == pytest.approx(expected)


def test_the_ceiling_and_share_a_model_sends_are_ignored_and_the_exchange_says_so():
    claim, error, note = parse_claim(S.claim(1.5, ceiling=9.9, op_share=0.99), state(0.35), "stand-in")
    assert error == "" and claim.op_share == 0.35
    assert claim.ceiling == pytest.approx(1 / (0.65 + 0.35 / 1.5))
    assert "ceiling=9.9" in note and "op_share=0.99" in note


def test_a_stored_claim_reads_back_with_the_same_computed_ceiling():
    claim, _, _ = parse_claim(S.claim(1.25), state(), "stand-in")
    again = Claim.model_validate_json(claim.model_dump_json())
    assert again == claim and again.ceiling == claim.ceiling


@pytest.mark.parametrize("reply, words", [
    (S.PROSE, "no JSON object could be read"),
    ('```json\n["decode"]\n```', "the JSON is not an object"),
    (S.claim(1.2).replace("0.35", "a third").replace("5..24", "short").replace("= 64", "large"),
     "evidence must quote numbers"),
    (S.claim(1.2, stage="benchmark"), "kill_test.stage must be one of compile, dispatch, parity"),
    (S.claim(1.2).replace('"decode"', '"rmsnorm"', 1), "op must be one of decode, prefill"),
    (S.claim(1.2, speed="fast"), "speed: Extra inputs are not permitted"),
    (S.claim(-1.0), "expected_speedup: Input should be greater than 0"),
])
def test_a_reply_without_a_valid_claim_says_why(reply, words):
    claim, error, _ = parse_claim(reply, state(), "stand-in")
    assert claim is None and words in error


def test_a_replayed_candidates_conclusion_sets_its_served_gain_against_the_profiles_ceiling():
    stages = [StageResult.passed("parity", "ok"), StageResult.passed("microbench", "ok", speedup=4.0),
              StageResult(name="replay", status="failed", reason="not better beyond noise",
                          metrics={"gain": 0.04, "gain_lower": -0.01, "tpot_p90_speedup": 1.17, "head_is_torch": 0.0})]
    c = Claim(op="decode", hypothesis="split-K over the paged cache", evidence=["decode f = 0.43"], expected_speedup=1.5,
              risks=["a wrong merge"], kill_test=KillTest(stage="microbench", observation="no gain"), op_share=0.43,
              share_source="profile")
    verdict = Verdict.of(stages)
    learned = conclude(c, "rejected", "replay", verdict.reason, [Round(source="", verdict=verdict)], "head:decode",
                       1.2).learned
    amdahl = 1 / (1 - 0.43 + 0.43 / 4.0)
    assert (f"served over its head: +4.0% (lower bound -1.0%), p90 TPOT 1.17x against a ceiling of {amdahl:.2f}x for "
            "4.00x on f 0.43") in learned
    no_replay = [Round(source="", verdict=Verdict.of(stages[:2]))]
    assert "served over" not in conclude(c, "passed", "microbench", "", no_replay, "head:decode", 1.2).learned


def _replayed(gain: float, head_is_torch: bool, gate_passed: bool = True) -> Verdict:
    return Verdict.of([StageResult.passed("microbench", "ok", speedup=1.44),
                       StageResult(name="replay", status="passed" if gain > 0.01 else "failed", reason="replayed",
                                   metrics={"gain": gain, "gain_lower": gain - 0.013, "tpot_p90_speedup": 0.99,
                                            "head_is_torch": float(head_is_torch), "gate_passed": float(gate_passed)})])


def test_a_candidate_judged_against_its_head_is_placed_against_torch_through_the_heads_own_replay_and_said_so():
    # the H200 run h200-b (2026-12-03): the tiled prefill head served -3.0% against torch in its own replay; the
    # TMA family +2.9% against that head; so about -0.2% against torch, chained through two replays
    head = Kernel(ref="head:prefill", op="prefill", path="heads/prefill.py", source="",
                  served_over_torch=served_over_torch(_replayed(-0.030, head_is_torch=True)))
    assert head.served_over_torch == pytest.approx(-0.030)
    verdict = _replayed(0.029, head_is_torch=False)
    chained = served_over_torch(verdict, head)
    assert chained == pytest.approx(1.029 * 0.970 - 1)
    learned = conclude(None, "accepted", "replay", verdict.reason, [Round(source="", verdict=verdict)], "head:prefill",
                       1.39, head).learned
    assert ("served over its head: +2.9% (lower bound +1.6%)" in learned
            and "over torch -0.2% (chained: head:prefill served -3.0% against torch in its own replay)" in learned)
    # no figure where one is unknown: a head never replayed against torch, gates that failed, no replay at all
    unknown = Kernel(ref="head:prefill", op="prefill", path="heads/prefill.py", source="")
    assert served_over_torch(verdict, unknown) is None and served_over_torch(verdict) is None
    assert "over torch" not in conclude(None, "accepted", "replay", "", [Round(source="", verdict=verdict)],
                                        "head:prefill", 1.39, unknown).learned
    assert served_over_torch(_replayed(-0.030, True, gate_passed=False)) is None
    assert served_over_torch(Verdict.of([StageResult.passed("microbench", "ok", speedup=1.44)])) is None
