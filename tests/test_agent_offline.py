"""The built-in proposer chooses each next hypothesis from the ledger's evidence — from the best kernel,
away from rejected regions, predicting from what was measured — and runs the whole loop with the same
claims, stages and ledger as an LLM, resumable from the ledger alone."""
from __future__ import annotations

import io
import json
import re
import subprocess

import pytest
from rich.console import Console

from conftest import CPU_GATES, config_with
from test_agent_unattended import SHORT_REPLAY, SMALL
from harness.evaluate import evaluate
from harness.records import StageResult, Verdict

from agent.roles.evaluator import judge, judge_again
from agent.ledger.messages import readme
from agent.knowledge import KNOWLEDGE, load_catalog, read_knobs, with_knobs
from agent.ledger.repository import Ledger
from agent.run.loop import run, settings_from
from agent.roles.offline import OfflineProposer
from agent.rejudging.rejudge import _verdicts, kernels_of, served_as_then
from agent.records import CandidateRecord, Conclusion, Kernel, OpEvidence, Profile, Round
from harness.amdahl import ceiling
from agent.run.state import ProposalState, head_changes, kernel_of, search_parent, stale_acceptance
from agent.reading.view import RunView

CATALOG = load_catalog()
MARGIN = config_with().stages.microbench.min_margin
FILES = {"decode": "attention/decode_paged_splitkv.py", "prefill": "attention/prefill_causal_tiled.py"}
# each family's file by its knobs: a candidate of another family than its parent's starts from that file
BY_KNOBS = {frozenset(read_knobs((KNOWLEDGE / e.files[0]).read_text())): e.files[0] for e in CATALOG.entries if e.family}


def head(op: str, speedup: float | None = None) -> Kernel:
    source = (KNOWLEDGE / FILES[op]).read_text()
    return Kernel(ref=f"head:{op}", op=op, path=f"heads/{op}.py", source=source, knobs=read_knobs(source), speedup=speedup)


def verdict(stage: str | None, speedup: float | None = None, noise: float = 0.0) -> Verdict:
    stages = []
    for name in ("compile", "dispatch", "parity", "microbench"):
        metrics = {"speedup": speedup, "noise": noise} if name == "microbench" and speedup is not None else {}
        if name == stage:
            stages.append(StageResult.failed(name, f"{name} said no", **metrics))
            break
        stages.append(StageResult.passed(name, "ok", **metrics) if metrics or name != "microbench"
                      else StageResult.skipped(name, "skipped: needs CUDA"))
    return Verdict.of(stages)


def record(cid: str, parent: Kernel | CandidateRecord, op: str, change: dict, failed: str | None = None,
           speedup: float | None = None, noise: float = 0.0) -> CandidateRecord:
    v = verdict(failed, speedup, noise)
    local = speedup / parent.speedup if speedup and parent.speedup else None
    knobs = change if set(change) != set(parent.knobs) and frozenset(change) in BY_KNOBS else {**parent.knobs, **change}
    file = BY_KNOBS[frozenset(knobs)]
    return CandidateRecord(id=cid, op=op, parent=getattr(parent, "ref", None) or parent.id, proposer="offline",
                           outcome="rejected" if failed else "passed", stage=failed or "parity", reason=v.reason,
                           knobs=knobs, rounds=[Round(source=with_knobs((KNOWLEDGE / file).read_text(), knobs, cid), verdict=v)],
                           speedup=speedup, local_speedup=local,
                           conclusion=Conclusion(learned="-", kill_test_fired=None, predicted=None, observed=local))


def state(history=(), heads=None, shares=(0.35, 0.15), ops=("decode", "prefill"), pending=(), explore=False) -> ProposalState:
    heads = heads or {op: head(op) for op in ops}
    profile = Profile(source="stand-in", note="", device="cpu", arch="cpu",
                      ops={op: OpEvidence(share=f, lines=[f"{op} share f = {f}"]) for op, f in zip(("decode", "prefill"), shares)})
    history = list(history)
    return ProposalState(next_id=f"c{len(history) + 1:03d}", ops=list(ops), history=history, heads=heads,
                         parents={op: search_parent(op, heads[op], history, MARGIN) for op in ops}, profile=profile,
                         min_ceiling=1.005, pending=list(pending), explore=explore)


def proposer(ops=("decode", "prefill"), arch="cpu") -> OfflineProposer:
    return OfflineProposer(CATALOG, "attention", list(ops), arch)


def test_a_family_for_sm90_is_offered_on_sm90_first_by_its_prior_and_never_on_the_cpu():
    gluon = next(e for e in CATALOG.entries if e.id == "prefill-gluon-sm90")
    on_cpu = proposer(("prefill",), "cpu").propose(state(ops=("prefill",)))
    on_sm90 = proposer(("prefill",), "sm90").propose(state(ops=("prefill",)))
    assert on_cpu.claim.hypothesis.startswith("family prefill-causal-tiled -> prefill-causal-tma")
    assert on_sm90.claim.hypothesis.startswith("family prefill-causal-tiled -> prefill-gluon-sm90")
    assert on_sm90.source.splitlines()[1:] == (KNOWLEDGE / gluon.files[0]).read_text().splitlines()
    assert all(e.arch in ("cpu", "any") for fams in proposer(arch="cpu").families.values() for e, _ in fams)


def test_first_claim_moves_to_the_measured_faster_family_then_the_step_with_the_highest_ceiling():
    prop = proposer()
    p = prop.propose(state())
    gqa = next(e for e in CATALOG.entries if e.id == "decode-paged-gqa")
    assert p.outcome == "ready" and p.op == "decode" and p.parent == "head:decode"
    assert p.claim.hypothesis.startswith("family decode-paged-splitkv -> decode-paged-gqa")   # a structural step
    assert p.claim.expected_speedup == pytest.approx(gqa.family.over_reference)   # its measured prior over the reference
    assert p.knobs == read_knobs((KNOWLEDGE / gqa.files[0]).read_text())
    assert p.source.splitlines()[1:] == (KNOWLEDGE / gqa.files[0]).read_text().splitlines()
    assert f"{gqa.family.over_reference:.2f}x over the reference kernel" in p.claim.evidence[-1]

    moved = record(p.id, head("decode"), "decode", p.knobs)              # passed, not timed (a CPU run)
    lean = prop.propose(state([moved]))                                  # the op's other family, its prior next
    assert lean.parent == "head:decode" and lean.claim.hypothesis.startswith("family decode-paged-splitkv -> decode-paged-lean")
    lean_moved = record(lean.id, head("decode"), "decode", lean.knobs)
    q = prop.propose(state([moved, lean_moved]))
    assert q.parent == "head:prefill" and q.claim.hypothesis.startswith("family prefill-causal-tiled -> prefill-causal-tma")
    r = prop.propose(state([moved, lean_moved, record(q.id, head("prefill"), "prefill", q.knobs)]))
    assert r.claim.hypothesis.startswith("SPLITS_PER_SM_TARGET 2 -> 4")       # the catalog's largest knob prior
    assert r.claim.ceiling == pytest.approx(ceiling(0.35, 1.06))
    assert all(any(ch.isdigit() for ch in line) for line in r.claim.evidence)
    changed = [(a, b) for a, b in zip(head("decode").source.splitlines(), r.source.splitlines()[1:]) if a != b]
    assert changed == [("SPLITS_PER_SM_TARGET = 2  # aim for this many stage-1 programs per SM",
                        "SPLITS_PER_SM_TARGET = 4  # aim for this many stage-1 programs per SM")]


def test_it_steps_from_the_fastest_correct_kernel_and_expects_the_same_step_to_pay_again():
    heads = {"decode": head("decode", speedup=1.2)}
    c001 = record("c001", heads["decode"], "decode", {"SPLITS_PER_SM_TARGET": 4}, failed="microbench", speedup=1.5)
    p = proposer(["decode"]).propose(state([c001], heads, ops=["decode"]))
    assert p.parent == "c001" and p.knobs["SPLITS_PER_SM_TARGET"] == 8
    assert p.claim.expected_speedup == pytest.approx(1.25)
    assert "measured 1.250x in c001" in p.claim.evidence[-1]


def test_after_an_accepted_candidate_replaces_the_reference_head_its_step_still_counts_and_the_reference_is_not_proposed_again():
    ref = head("decode", speedup=10.0)
    c001 = record("c001", ref, "decode", {"SPLITS_PER_SM_TARGET": 4}, speedup=12.5)
    accepted = Kernel(ref="c001", op="decode", path="candidates/c001/candidate.py", source=c001.source,
                      knobs=c001.knobs, speedup=12.5)
    prop = proposer(["decode"])
    first = prop.propose(state([c001], {"decode": accepted}, ops=["decode"]))
    assert first.knobs == {**c001.knobs, "SPLITS_PER_SM_TARGET": 8}             # the step that paid, again
    assert first.claim.expected_speedup == pytest.approx(1.25) and "measured 1.250x in c001" in first.claim.evidence[-1]
    history = [c001]
    while (p := prop.propose(state(history, {"decode": accepted}, ops=["decode"]))) is not None:
        assert p.knobs != ref.knobs, p.claim.hypothesis                        # measured already, as the first head
        history.append(record(p.id, accepted, "decode", {**p.knobs}, failed="microbench", speedup=12.0))
        assert len(history) < 40
    assert len(history) > 10


def test_a_step_that_measured_slower_makes_the_opposite_step_the_next_hypothesis():
    heads = {"decode": head("decode", speedup=1.2)}
    c001 = record("c001", heads["decode"], "decode", {"SPLITS_PER_SM_TARGET": 4}, failed="microbench", speedup=0.96)
    p = proposer(["decode"]).propose(state([c001], heads, ops=["decode"]))
    assert p.parent == "head:decode" and p.knobs["SPLITS_PER_SM_TARGET"] == 1
    assert p.claim.expected_speedup == pytest.approx(1.25) and "assuming the effect is symmetric" in p.claim.evidence[-1]


def test_it_moves_away_from_a_rejected_region_and_ends_when_nothing_is_left():
    history = [record("c001", head("decode"), "decode", {"BLOCK_N": 32}, failed="parity")]
    prop = proposer(["decode"])
    while (p := prop.propose(state(history, ops=["decode"]))) is not None:
        assert p.knobs["BLOCK_N"] not in (16, 32), p.claim.hypothesis       # 32 failed: 16 lies beyond it
        history.append(record(p.id, head("decode"), "decode", p.knobs))
        assert len(history) < 40
    tried = [r.knobs for r in history[1:]]
    assert len(tried) == len({tuple(sorted(k.items())) for k in tried}) >= 10   # no repeats; every step, then jumps


def test_a_step_whose_ceiling_is_under_the_minimum_is_recorded_once_then_the_search_has_converged():
    p = proposer(["decode"]).propose(state(shares=(0.01, 0.01), ops=["decode"]))
    assert p.outcome == "not-worth-coding" and p.stage == "ceiling" and p.source is None
    assert p.claim.ceiling < 1.005 and "under the minimum 1.005" in p.reason
    said = CandidateRecord(id=p.id, op="decode", parent=p.parent, proposer="offline", outcome=p.outcome, stage=p.stage,
                           reason=p.reason, claim=p.claim, knobs=p.knobs,
                           conclusion=Conclusion(learned=p.reason, kill_test_fired=None, predicted=None, observed=None))
    assert proposer(["decode"]).propose(state([said], shares=(0.01, 0.01), ops=["decode"])) is None


def test_no_step_is_written_off_as_not_worth_coding_while_a_verdict_that_could_change_it_is_on_its_way():
    in_flight = proposer(["decode"]).propose(state(ops=["decode"]))
    assert in_flight.outcome == "ready"
    assert proposer(["decode"]).propose(state(shares=(0.01, 0.01), ops=["decode"], pending=[in_flight])) is None
    p = proposer(["decode"]).propose(state(shares=(0.01, 0.01), ops=["decode"]))   # nothing on its way: said once
    assert p.outcome == "not-worth-coding"


def test_an_in_flight_proposal_is_not_proposed_again():
    first = proposer(["decode"]).propose(state(ops=["decode"]))
    second = proposer(["decode"]).propose(state(ops=["decode"], pending=[first]))
    assert second.knobs != first.knobs


def test_once_no_step_is_worth_coding_it_explores_every_untried_step_best_predicted_first_then_stops():
    """Shares so small that no step reaches the minimum ceiling: without exploring the first proposal is written
    off; exploring, every step is measured, one knob first (best predicted first), then jumps, then two knobs at
    once, none twice, the ops in turn, until none is left."""
    assert proposer(["decode"]).propose(state(shares=(0.01, 0.01), ops=["decode"])).outcome == "not-worth-coding"
    prop, history, sizes = proposer(), [], []
    while (p := prop.propose(state(history, shares=(0.01, 0.01), explore=True))) is not None:
        assert p.outcome == "ready" and p.claim.ceiling < 1.005 and p.source is not None
        assert ", exploring)" in p.claim.hypothesis and any("exploring (agent.explore)" in line for line in p.claim.evidence)
        ref = head(p.op).knobs
        knobs_moved = sum(p.knobs[k] != ref[k] for k in ref) if set(p.knobs) == set(ref) else 0   # 0: another family
        sizes.append((p.op, knobs_moved, p.claim.expected_speedup))
        history.append(record(p.id, head(p.op), p.op, p.knobs))
        assert len(history) < 400
    keys = [(r.op, tuple(sorted(r.knobs.items()))) for r in history]
    assert len(keys) == len(set(keys)) > 100                                   # nothing twice; far past the 12 of old
    ops = [op for op, _, _ in sizes]
    assert ops[:6] == ["decode", "prefill"] * 3                                # the ops in turn
    decode = [(n, s) for op, n, s in sizes if op == "decode" and n]           # knob moves of the reference family
    moved = [n for n, _ in decode]
    assert moved == sorted(moved) and moved[0] == 1 and moved[-1] == 2         # one knob (steps, jumps), then two
    firsts = [s for n, s in decode[:8]]
    assert firsts == sorted(firsts, reverse=True)                               # best predicted first


def test_exploring_it_searches_from_a_kernel_that_was_faster_inside_the_bar_and_the_bar_stays_the_search_parent():
    """The H200 run h200-b: the GQA family measured 1.027x over the reference head, inside the 3% bar, so the
    head stayed the search parent and the next steps moved the slower family's knobs. Exploring, the GQA
    kernel's own steps are measured, and each must still beat the head beyond noise."""
    heads = {"decode": head("decode", speedup=4.10)}
    prop = proposer(["decode"])
    first = prop.propose(state([], heads, ops=["decode"]))
    near = record(first.id, heads["decode"], "decode", first.knobs, failed="microbench", speedup=4.21)
    assert search_parent("decode", heads["decode"], [near], MARGIN).ref == "head:decode"
    tiny = dict(shares=(0.01, 0.01), ops=["decode"])
    assert prop.propose(state([near], heads, **tiny)).outcome == "not-worth-coding"   # not exploring: written off
    history = [near]
    while (p := prop.propose(st := state(history, heads, explore=True, **tiny))).parent == "head:decode":
        assert p.claim.expected_speedup > 4.21 / 4.10                         # predicted faster than near's steps
        history.append(record(p.id, heads["decode"], "decode", p.knobs, failed="microbench", speedup=3.9))
        assert len(history) < 13                                             # the head's 11 steps predicted over 1.027x
    assert p.outcome == "ready" and p.parent == near.id and set(p.knobs) == set(near.knobs)
    assert "it must still beat head:decode beyond noise" in p.claim.evidence[-2]
    bars = []

    def evaluate_fn(job: str, source: str, beat: float, head: str | None = None) -> Verdict:
        bars.append(beat)
        return verdict("microbench", 4.30)
    parent = kernel_of(p.parent, heads, st.history)
    rec, _, _ = judge(p, parent, prop, config_with(), "attention", None, evaluate_fn=evaluate_fn, bar=st.parents["decode"])
    assert bars == [4.10] and rec.parent == near.id and rec.local_speedup == pytest.approx(4.30 / 4.21)


def test_judge_sets_the_microbench_bar_at_the_fastest_parents_speedup_or_1_when_the_parent_was_never_timed(pool):
    heads = {"decode": head("decode", speedup=2.5)}
    c001 = record("c001", heads["decode"], "decode", {"SPLITS_PER_SM_TARGET": 4}, failed="microbench", speedup=2.7)
    st = state([c001], heads, ops=["decode"])
    p = proposer(["decode"]).propose(st)
    cfg, bars = config_with(**SMALL), []

    def evaluate_fn(job: str, source: str, beat: float, head: str | None = None) -> Verdict:      # the real evaluator; the bar noted
        bars.append((job, beat))
        return evaluate(source, "attention", cfg, pool, until="parity", beat=beat)
    rec, _, stop = judge(p, st.parents["decode"], proposer(["decode"]), cfg, "attention", None, evaluate_fn=evaluate_fn)
    assert p.parent == "c001" and bars == [(p.id, 2.7)] and not stop         # the fastest so far, not the head
    assert rec.outcome == "passed" and rec.stage == "parity"
    untimed = proposer(["decode"]).propose(state(ops=["decode"]))              # a parent never timed (a CPU run)
    judge(untimed, head("decode"), proposer(["decode"]), cfg, "attention", None, evaluate_fn=evaluate_fn)
    assert bars[-1] == (untimed.id, 1.0)


def test_a_candidate_rejected_below_its_parents_speedup_is_recorded_against_that_parent():
    """The evaluator's verdict here stands in for a GPU's microbench: faster than the baseline (2.6x) but not
    than its parent (2.7x). The record keeps where it stopped and its speedup over that parent, and the next
    claim still starts from the parent. (That microbench itself rejects such a kernel, and the replay never
    sees it, is tests/test_stages.py's, on a GPU.)"""
    heads = {"decode": head("decode", speedup=2.5)}
    c001 = record("c001", heads["decode"], "decode", {"SPLITS_PER_SM_TARGET": 4}, failed="microbench", speedup=2.7)
    st = state([c001], heads, ops=["decode"])
    p = proposer(["decode"]).propose(st)
    rec, _, stop = judge(p, st.parents["decode"], proposer(["decode"]), config_with(), "attention", None,
                         evaluate_fn=lambda job, source, beat, head=None: verdict("microbench", 2.6))
    assert not stop and (rec.outcome, rec.stage, rec.parent) == ("rejected", "microbench", "c001")
    assert rec.speedup == 2.6 and rec.local_speedup == pytest.approx(2.6 / 2.7)
    assert search_parent("decode", heads["decode"], [c001, rec], config_with().stages.microbench.min_margin).ref == "c001"



def test_offline_run_commits_each_candidate_and_resumes_from_its_ledger(pool, tmp_path):
    cfg = config_with(**SMALL, **{"agent.runs_dir": str(tmp_path), "agent.ops": ["decode"]})
    out = io.StringIO()

    def go(n: int):
        settings = settings_from(cfg, pool.device, max_candidates=n, run_id="offline")
        return run(cfg, settings, RunView(console=Console(file=out, width=200)), pool=pool)

    first = go(2)
    assert first.stop == "2 candidates reached" and not first.fatal
    assert [r.outcome for r in first.history] == ["passed", "passed"]
    assert Ledger(first.ledger).history() == first.history                   # nothing lives only in memory
    assert any("microbench: skipped: needs CUDA" in n for n in first.not_run)
    assert any(n.startswith("replay:") for n in first.not_run)

    again = go(3)                                                             # the same run id resumes it
    assert [r.id for r in again.history] == ["c001", "c002", "c003"]
    assert len({tuple(sorted(r.knobs.items())) for r in again.history}) == 3
    log = subprocess.run(["git", "log", "--reverse", "--format=%s"], cwd=again.ledger, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    gist = [f"{line.split()[0]}: {line.rsplit(': ', 1)[1]}" if line.startswith("c") else line.split(":")[0]
            for line in log]
    assert gist == ["start offline", "c001: passed at parity", "c002: passed at parity", "end offline",
                    "resume offline", "c003: passed at parity", "end offline"]
    for line, r in zip([line for line in log if line.startswith("c")], again.history):
        change = line.removeprefix(f"{r.id} decode ").rsplit(": ", 1)[0]   # what was tried: `<knob> <old> -> <new>`
        assert " -> " in change and r.claim.hypothesis.startswith(change.removesuffix("…")) and len(line) <= 72, line
    tags = subprocess.run(["git", "tag"], cwd=again.ledger, capture_output=True, text=True).stdout.split()
    assert tags == ["best-decode", "head-decode"]
    said = " ".join(out.getvalue().split())
    assert ("c001 [decode] passed the correctness stages (compile, dispatch, parity); not timed, not accepted "
            "(microbench, replay skipped)") in said
    summary = json.loads(Ledger(again.ledger).committed("summary.json"))
    assert summary["untimed"] == again.untimed and again.untimed.startswith("3 candidate(s) passed the correctness stages")
    assert "nothing was timed or accepted here" in Ledger(again.ledger).committed("summary.md")
    assert summary["best"]["decode"]["vs_cudnn"] is None and "no cuDNN anchor timed" in summary["best"]["decode"]["vs_cudnn_note"]
    ledger = Ledger(again.ledger)                 # the pace is of the whole run, both sessions, the heads' stages too
    ran = [s for v in [k.verdict for k in ledger.heads(at_start=True).values()] + [r.verdict for r in again.history]
           for s in v.stages]
    assert summary["pace"]["candidates"] == 3
    assert summary["pace"]["stage_s"]["parity"] == round(sum(s.seconds for s in ran if s.name == "parity"), 1)
    assert f"Pace: {again.pace}" in ledger.committed("summary.md") and again.pace.startswith("3 candidates in ")


def test_every_replay_of_a_run_serves_the_other_ops_heads_beside_the_kernel_it_judges(pool, tmp_path):
    """A decode kernel is served with the prefill head and a prefill kernel with the decode head (the step the
    run would ship), the heads' own replays too: on a CPU the replay's gates serve it, and its reason carries
    the server's own accounting of who served each op (a short replay: SHORT_REPLAY)."""
    cfg = config_with(**CPU_GATES, **SMALL, **SHORT_REPLAY,
                      **{"agent.runs_dir": str(tmp_path), "agent.ops": ["decode", "prefill"]})
    settings = settings_from(cfg, pool.device, max_candidates=1, run_id="beside")
    done = run(cfg, settings, RunView(console=Console(file=io.StringIO(), width=200)), pool=pool)
    assert not done.fatal, done.stop
    reasons = {op: done.heads[op].verdict.stages[-1].reason for op in ("decode", "prefill")}
    reasons["c001"] = done.history[0].rounds[-1].verdict.stages[-1].reason
    other = {"decode": "prefill", "prefill": "decode", "c001": "prefill" if done.history[0].op == "decode" else "decode"}
    for who, reason in reasons.items():
        assert re.search(rf"{other[who]} not implemented \((\d+) of \1 calls ran its head beside the candidate", reason), (who, reason)
    # and re-judged from the ledger alone, each kernel is served as the run served it
    kernels = {k.ref: k for k in kernels_of(Ledger(done.ledger))}
    first = {op: done.heads[op].source for op in ("decode", "prefill")}
    c001 = done.history[0]
    assert (kernels["head:decode"].head, kernels["head:decode"].other_heads) == (None, {"prefill": first["prefill"]})
    assert (kernels["c001"].head, kernels["c001"].other_heads) == (first[c001.op], {other["c001"]: first[other["c001"]]})
    (_, now), = _verdicts([kernels["c001"]], "attention", cfg, pool, None, lambda k: None)
    assert re.search(rf"{other['c001']} not implemented \((\d+) of \1 calls ran its head beside the candidate",
                     now.stages[-1].reason), now.stages[-1].reason


def test_a_rejudged_candidate_is_served_with_the_heads_of_its_time():
    d0, p0 = head("decode"), head("prefill")
    c001 = record("c001", d0, "decode", {"NUM_WARPS": 8}).model_copy(update={"outcome": "accepted"})
    c002, c003 = record("c002", p0, "prefill", {"NUM_WARPS": 8}), record("c003", d0, "decode", {"NUM_WARPS": 2})
    served = served_as_then({"decode": d0.source, "prefill": p0.source}, [c001, c002, c003])
    assert served["head:decode"] == (None, {"prefill": p0.source}) and served["head:prefill"] == (None, {"decode": d0.source})
    assert served["c001"] == (d0.source, {"prefill": p0.source})       # judged against the head it then replaced
    assert served["c002"] == (p0.source, {"decode": c001.source})       # served with the decode head it became
    assert served["c003"] == (c001.source, {"prefill": p0.source})
    # c004's replay found its head c001 wrong: from then on the decode head is the one c001 replaced
    v = verdict(None, speedup=1.1)
    found = Verdict.of([*v.stages, StageResult.failed("replay", "slower", head_spot_failed_ops=1.0)])
    c004 = record("c004", d0, "decode", {"NUM_WARPS": 4})
    c004 = c004.model_copy(update={"rounds": [c004.rounds[0].model_copy(update={"verdict": found, "against": "c001"})]})
    c005, c006 = record("c005", p0, "prefill", {"NUM_WARPS": 2}), record("c006", d0, "decode", {"NUM_STAGES": 3})
    served = served_as_then({"decode": d0.source, "prefill": p0.source}, [c001, c002, c003, c004, c005, c006])
    assert served["c004"] == (c001.source, {"prefill": p0.source})
    assert served["c005"] == (p0.source, {"decode": d0.source}) and served["c006"] == (d0.source, {"prefill": p0.source})


def test_the_search_parent_moves_only_on_a_gain_beyond_the_noise_band_microbench_measured():
    heads = {"decode": head("decode", speedup=1.20)}
    inside = record("c001", heads["decode"], "decode", {"BLOCK_N": 128}, failed="microbench", speedup=1.20 * 1.006)
    assert search_parent("decode", heads["decode"], [inside], MARGIN).ref == "head:decode"      # a 1.006x step: chance
    noisy = record("c002", heads["decode"], "decode", {"NUM_WARPS": 8}, failed="microbench", speedup=1.20 * 1.05, noise=0.08)
    assert search_parent("decode", heads["decode"], [inside, noisy], MARGIN).ref == "head:decode"  # 5% inside its 8% band
    beyond = record("c003", heads["decode"], "decode", {"NUM_STAGES": 3}, failed="microbench", speedup=1.20 * 1.05, noise=0.01)
    assert search_parent("decode", heads["decode"], [inside, noisy, beyond], MARGIN).ref == "c003"  # 5% beyond 1% and the margin
    then = record("c004", beyond, "decode", {"NUM_STAGES": 4}, failed="microbench", speedup=beyond.speedup * 1.02, noise=0.0)
    assert search_parent("decode", heads["decode"], [inside, noisy, beyond, then], MARGIN).ref == "c003"   # 2% under the margin
    p = proposer(["decode"]).propose(state([inside, noisy, beyond, then], heads, ops=["decode"]))
    assert p.parent == "c003"


def served(r: CandidateRecord, failure: str | None) -> CandidateRecord:
    """`r`, timed by microbench, then rejected by the replay: found wrong when served (`failure`), or not faster."""
    reason = ("prefill in the candidate's served process: 1 of the 38 served calls checked (a secret share) differ"
              if failure else "not faster than the head beyond noise")
    v = Verdict.of([*r.verdict.stages, StageResult.failed("replay", reason, failure)])
    return r.model_copy(update={"outcome": "rejected", "stage": "replay", "reason": v.reason,
                                "rounds": [Round(source=r.source, verdict=v)]})


def test_a_kernel_the_replay_found_wrong_when_served_is_never_built_on_however_fast_it_timed():
    """2026-12-06, H100: a prefill accepted by one run's replay (s50 c022) failed another's spot check, one served call
    of 38 checked wrong by up to 3.4. Microbench had timed it 1.7x over torch: its speedup is no evidence."""
    heads = {"decode": head("decode", speedup=1.2)}
    fast = record("c001", heads["decode"], "decode", {"SPLITS_PER_SM_TARGET": 4}, speedup=1.5)
    slow = served(fast, None)
    assert search_parent("decode", heads["decode"], [slow], MARGIN).ref == "c001"        # slow when served: still timed
    assert kernel_of("c001", heads, [slow]).speedup == 1.5
    for failure in ("wrong_output", "library_ops"):
        wrong = served(fast, failure)
        assert search_parent("decode", heads["decode"], [wrong], MARGIN).ref == "head:decode", failure
        assert kernel_of("c001", heads, [wrong]) is None, failure                # named as a parent: not built on
        history, prop = [wrong], proposer(["decode"])
        while (p := prop.propose(state(history, heads, ops=["decode"]))) is not None:
            assert p.parent == "head:decode", p.claim.hypothesis
            if set(p.knobs) == set(fast.knobs):                     # its family: 4 was wrong, so 8 lies beyond it
                assert p.knobs["SPLITS_PER_SM_TARGET"] not in (4, 8), p.claim.hypothesis
            history.append(record(p.id, heads["decode"], "decode", p.knobs))
            assert len(history) < 40
        assert sum(set(r.knobs) == set(fast.knobs) for r in history[1:]) >= 5        # its family was searched


def test_once_a_family_move_measured_faster_the_search_steps_that_familys_knobs():
    heads = {"decode": head("decode", speedup=1.0)}
    prop = proposer(["decode"])
    first = prop.propose(state([], heads, ops=["decode"]))
    moved = record(first.id, heads["decode"], "decode", first.knobs, failed="microbench", speedup=1.3)
    p = prop.propose(state([moved], heads, ops=["decode"]))
    gqa = next(e for e, _ in CATALOG.families("attention", "decode") if e.id == "decode-paged-gqa")
    assert p.parent == moved.id and set(p.knobs) == set(first.knobs)             # a kernel of the gqa family
    assert [k for k in p.knobs if p.knobs[k] != first.knobs[k]] == [p.claim.hypothesis.split()[0]]   # one knob moved
    assert p.claim.hypothesis.split()[0] in gqa.family.knobs and "SPLIT_POLICY" in gqa.family.knobs


def timed(speedup: float, anchor_ms: float, replay: bool = False) -> Verdict:
    """A GPU verdict as microbench writes it for one served decode shape (candidate, torch, cuDNN), and the
    full scored replay's figures when `replay`."""
    from harness.stages.microbench import figure_metric
    from harness.targets import Case
    base_ms = 0.060
    case = Case("decode", "decode served: batch 8, lengths 1..9", {"batch": 8, "length_range": (1, 9)}, weight=1.0)
    row = {"candidate_ms": base_ms / speedup, "baseline_ms": base_ms, "anchor_ms": anchor_ms, "weight": 1.0,
           "candidate_rate": 3.0 * speedup, "baseline_rate": 3.0, "anchor_rate": 3.0 * base_ms / anchor_ms}
    m = {figure_metric(case, k): v for k, v in row.items()} | {"speedup": speedup, "noise": 0.005, "bar": 1.03}
    stages = [StageResult.passed(n, "ok") for n in ("compile", "dispatch", "parity")]
    stages.append(StageResult.passed("microbench", f"served mix {speedup:.2f}x (bar 1.03x); {case.label}: "
                                                   f"{speedup:.2f}x (...)", **m))
    if replay:
        stages.append(StageResult.passed("replay", "accepted", accepted=1.0, tpot_p90_speedup=1.08, throughput_ratio=1.0))
    return Verdict.of(stages)


def test_a_candidate_accepted_against_a_head_replaced_while_it_was_judged_is_judged_again_against_the_new_one():
    """Two candidates of one op judged at once (two slots, as in the forty-ninth session's H100 run): the earlier
    one is accepted and becomes the head while the later one's replay still serves the old head beside it. The
    later acceptance is stale, and the candidate is judged once more against the new head and its bar. The
    evaluator's verdicts stand in for a GPU's: accepted over the old head, then rejected at microbench by the
    new head's bar; its first verdict stays in its rounds. (Waiting for the earlier verdict to be recorded
    before asking is the drive's, agent/run/drive.py, and needs a GPU to accept anything.)"""
    old = head("decode", speedup=1.0)
    new = Kernel(ref="c001", op="decode", path="candidates/c001/candidate.py", source="# c001\n", speedup=1.5)
    prop, calls = proposer(["decode"]), []

    def evaluate_fn(job: str, source: str, beat: float, against: str | None = None) -> Verdict:
        calls.append((job, beat, against))
        return timed(1.4, anchor_ms=0.050, replay=True) if len(calls) == 1 else verdict("microbench", 1.4)
    p = prop.propose(state([], {"decode": old}, ops=["decode"])).model_copy(update={"id": "c002"})
    first, exchanges, _ = judge(p, old, prop, config_with(), "attention", None, evaluate_fn=evaluate_fn, head=old)
    assert first.outcome == "accepted" and calls == [(p.id, 1.0, old.source)]
    assert first.rounds[0].against == "head:decode"
    passed = record("c003", old, "decode", p.knobs)
    assert stale_acceptance(first, old) == "" and stale_acceptance(passed, new) == ""
    why = stale_acceptance(first, new)
    assert why == "c001 became the decode head while it was judged against head:decode"
    again = judge_again(first, exchanges, p, old, new, new, why, evaluate_fn)
    assert calls[1] == (f"{p.id}.again", 1.5, "# c001\n")              # the new head served beside it, its bar
    assert (again.outcome, again.stage, again.speedup) == ("rejected", "microbench", 1.4)
    assert [(r.against, r.again) for r in again.rounds] == [("head:decode", ""), ("c001", why)]
    assert again.rounds[0].verdict == first.verdict
    assert "judged again" in again.conclusion.learned and "repair" not in again.conclusion.learned
    assert "## Verdict (round 1, against c001)" in readme(again) and f"Judged again: {why}." in readme(again)


def test_a_ledgers_head_changes_show_a_kernel_that_became_the_head_unmeasured_against_the_one_it_replaced():
    """head_changes reads, from the records alone, what each accepted candidate replaced and what its accepted
    round was judged against: the forty-ninth session's c006 (accepted against the reference after c005 had
    replaced it) shows as a mismatch; judged again against c005 it does not; a ledger whose rounds never named
    their head shows neither."""
    old = head("decode", speedup=1.0)

    def accepted(cid: str, *against: str) -> CandidateRecord:
        verdict = timed(1.4, anchor_ms=0.050, replay=True)
        rounds = [Round(source=f"# {cid}\n", verdict=verdict, against=a) for a in against]
        return record(cid, old, "decode", {"NUM_WARPS": 8}).model_copy(update={"outcome": "accepted", "rounds": rounds})
    rejected = record("c002", old, "decode", {"NUM_STAGES": 3}, failed="microbench", speedup=1.2)
    first = accepted("c001", "head:decode")
    assert head_changes({"decode": old}, [first, rejected, accepted("c003", "head:decode")]) == [
        ("c001", "head:decode", "head:decode"), ("c003", "c001", "head:decode")]
    again = accepted("c003", "head:decode", "c001")
    assert head_changes({"decode": old}, [first, again])[-1] == ("c003", "c001", "c001")
    assert head_changes({"decode": old}, [accepted("c001", "")]) == [("c001", "head:decode", "")]


def resumed_run(tmp_path, run_id: str, environment: dict | None = None):
    """A decode run's loop resumed from a ledger holding only its reference head, timed at 1.0x torch: it
    records verdicts given to it (the GPU's, standing in) with no evaluator. Begun on this CPU machine, unless
    `environment` says where."""
    from agent.records import RunHeader
    from agent.run.loop import Run
    cfg = config_with(**{"agent.runs_dir": str(tmp_path), "agent.ops": ["decode"]})
    ref = head("decode", speedup=1.0).model_copy(update={"verdict": timed(1.0, anchor_ms=0.050)})
    f = cfg.agent.standin_op_share["decode"]
    profile = Profile(source="stand-in", note="", device="cpu", arch="cpu", ops={"decode": OpEvidence(share=f, lines=["f"])})
    header = RunHeader(id=run_id, target="attention", provider="offline", device="cpu", arch="cpu", ops=["decode"],
                       budget_minutes=3, max_candidates=None, max_cost_usd=0, started="2026-12-01T10:00:00+00:00",
                       kevo_commit="0" * 12)
    Ledger.create(tmp_path / run_id, header, "agent: {}\n", environment or {"device": "cpu", "gpu": "none"}, profile,
                  {"note": "-"}, {"decode": ref}, {})
    loop = Run(cfg, settings_from(cfg, "cpu", run_id=run_id), RunView(console=Console(file=io.StringIO())))
    loop.start()
    return loop, ref, f


def test_a_run_begun_on_another_gpu_is_not_resumed_here_where_its_heads_and_bars_were_not_measured(tmp_path):
    """A ledger's heads' verdicts and the bars its search moves by are its GPU's (an attacker's review, 2026-12-07:
    a ledger copied in from another machine brought its accepted heads with it, unjudged here)."""
    from agent.run.loop import RunError
    with pytest.raises(RunError, match=r"ran on cuda \(NVIDIA H100 80GB HBM3\), this machine is cpu \(none\): its "
                                       r"heads' verdicts .*`kevo-agent replay "):
        resumed_run(tmp_path, "elsewhere", {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"})


def test_after_an_accepted_kernel_f_is_derived_again_from_its_speedup_and_the_next_claim_uses_it(tmp_path):
    loop, ref, f = resumed_run(tmp_path, "accepted")
    first = loop.proposer.propose(loop.state([]))
    assert first.claim.op_share == pytest.approx(f)   # a head at 1.0x torch: the base share stands
    accepted = record(first.id, ref, "decode", first.knobs).model_copy(update={
        "outcome": "accepted", "stage": "replay", "speedup": 1.4, "local_speedup": 1.4,
        "rounds": [Round(source=first.source, verdict=timed(1.4, anchor_ms=0.050, replay=True))]})
    loop.record(accepted, [])
    new_f = (f / 1.4) / (1 - f + f / 1.4)            # Amdahl: the op's time shrank 1.4x, the step with it
    committed = Profile.model_validate_json(Ledger(loop.root).committed("profile.json"))
    assert committed.ops["decode"].share == pytest.approx(new_f) and loop.profile.ops["decode"].share == pytest.approx(new_f)
    assert any("DERIVED" in line and "1.400x over torch" in line for line in committed.ops["decode"].lines)
    assert any("p90 TPOT 1.080x" in line for line in committed.ops["decode"].lines)     # the replay beside it, a check
    nxt = loop.proposer.propose(loop.state([]))
    assert nxt.parent == accepted.id and nxt.claim.op_share == pytest.approx(new_f)
    message = Ledger(loop.root).repo.head.commit.message
    assert f"Vs-cuDNN: {0.050 / (0.060 / 1.4):.4f}" in message                          # kevo/cuDNN, per candidate
    assert message.index("Vs-cuDNN:") < message.index("\nSpeedup:")                   # the library first, torch second
    best = json.loads(Ledger(loop.root).committed("summary.json"))["best"]["decode"]
    assert best["vs_cudnn"] == pytest.approx(0.050 / (0.060 / 1.4)) and best["vs_torch"] == pytest.approx(1.4)


def test_a_head_a_later_replay_found_wrong_gives_its_place_back_and_a_resumed_run_keeps_it_so(tmp_path):
    """2026-12-06, H100: s50's c022, the run's accepted prefill head, failed its own spot checks in a later replay.
    A head found wrong is the head no more: the one it replaced is again (heads/ in the finder's commit, a resumed
    run reads it), it is neither the best nor a parent, its step is not tried again; the reference found wrong
    too leaves no head, and the run must stop. The GPU's verdicts stand in."""
    from agent.run.loop import Run
    from agent.run.state import best_kernel

    def judged(cid: str, knobs: dict, speedup: float, against: str, head_wrong: bool, slower: bool) -> CandidateRecord:
        v = timed(speedup, anchor_ms=0.050, replay=True)
        metrics = {**v.stages[-1].metrics, "head_spot_failed_ops": 1.0 if head_wrong else 0.0}
        last = (StageResult.failed("replay", "slower than the head", **metrics) if slower else
                v.stages[-1].model_copy(update={"metrics": metrics}))
        r = record(cid, ref, "decode", knobs, speedup=speedup)
        rnd = r.rounds[0].model_copy(update={"verdict": Verdict.of([*v.stages[:-1], last]), "against": against})
        return r.model_copy(update={"outcome": "rejected" if slower else "accepted", "stage": "replay", "rounds": [rnd]})
    loop, ref, _ = resumed_run(tmp_path, "found")
    c001 = judged("c001", {"SPLITS_PER_SM_TARGET": 4}, 1.4, "head:decode", head_wrong=False, slower=False)
    assert loop.record(c001, []) == "" and loop.heads["decode"].ref == "c001"
    assert loop.proposer.propose(loop.state([])).parent == "c001"
    c002 = judged("c002", {"NUM_WARPS": 8}, 1.3, "c001", head_wrong=True, slower=True)
    assert loop.record(c002, []) == ""
    # c002, slower than c001 where served and faster than the reference, is the parent; c001 (1.4x) no longer is
    assert loop.heads["decode"].ref == "head:decode" and loop.parents["decode"].ref == "c002"
    assert best_kernel("decode", loop.heads["decode"], loop.history).ref == "head:decode"
    ledger = Ledger(loop.root)
    assert json.loads(ledger.committed("heads/decode.json"))["ref"] == "head:decode"
    assert "Head: decode=head:decode" in ledger.repo.head.commit.message
    assert "c001 was found wrong in c002's replay; head:decode is again the decode head" in ledger.committed("profile.json")
    assert json.loads(ledger.committed("summary.json"))["heads_found_wrong"] == [
        "c001, the decode head, failed its own spot checks in c002's replay (that verdict's reason says how): "
        "neither the head nor built on from then"]
    again = Run(loop.cfg, loop.settings, RunView(console=Console(file=io.StringIO())))
    again.start()                                     # resumed: the head it reads is the one given back
    assert again.heads["decode"].ref == "head:decode" and again.parents["decode"].ref == "c002"
    while len(again.history) < 40 and (p := again.proposer.propose(again.state([]))) is not None:
        assert p.parent != "c001", p.claim.hypothesis
        if set(p.knobs) == set(c001.knobs):                     # its family: 4 was wrong, so 8 lies beyond it
            assert p.knobs["SPLITS_PER_SM_TARGET"] not in (4, 8), p.claim.hypothesis
        again.history.append(record(p.id, ref, "decode", p.knobs, failed="microbench", speedup=0.9))
    assert sum(set(r.knobs) == set(c001.knobs) for r in again.history[2:]) >= 5        # its family was searched
    stop = again.record(judged("c099", {"NUM_WARPS": 2}, 1.2, "head:decode", head_wrong=True, slower=True), [])
    assert stop == ("no decode head is left that no replay found wrong: head:decode, the run's first, was found "
                    "wrong where served, in c099's replay"), stop
