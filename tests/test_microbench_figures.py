"""Microbench's per-case figures are recorded under the case's shape (`Case.key`, `figure_metric`) and read back
by shape (`case_figures`), so a shape list changed since a kernel was timed cannot relabel its figures; a record an
older kevo keyed by position still reads, and the planner's evidence says those figures are kept by place."""
from __future__ import annotations

import pytest
import torch
import yaml

from conftest import config_with
from harness.config import DEFAULT_CONFIG, ConfigError, load_config
from harness.errors import HarnessError
from harness.evaluate import device_shapes
from harness.records import StageResult, Verdict
from harness.stages.common import EvalContext
from harness.replies import KernelUse
from harness.stages.launched import programs_per_sm
from harness.stages.microbench import case_figures, figure_metric, timing_plan
from harness.targets import TARGETS, Case

from agent.reading.figures import microbench_cases, speed
from agent.records import Kernel
from agent.run.profile import kernel_figures

CFG = config_with()
CPU = torch.device("cpu")


def served_now(op: str = "decode") -> list[Case]:
    return [c for c in TARGETS["attention"].served_cases(device_shapes(CFG, "attention", CPU)) if c.op == op]


def decode_case(batch: int, lo: int, hi: int, weight: float) -> Case:
    """A served decode case at the CPU config's heads, of a shape the config may no longer serve."""
    like = served_now()[0]
    return Case("decode", f"decode served: batch {batch}, lengths {lo}..{hi}, heads 4/2",
                {**like.params, "batch": batch, "length_range": (lo, hi)}, weight=weight)


def row(cand_ms: float, weight: float) -> dict[str, float]:
    return {"candidate_ms": cand_ms, "baseline_ms": 2 * cand_ms, "weight": weight, "candidate_rate": 1.0 / cand_ms,
            "baseline_rate": 0.5 / cand_ms}


def head_timed_on(cases: list[tuple[Case, float]], keyed: bool = True, told_apart: int | None = None) -> Kernel:
    """A decode head whose microbench timed `cases` (each with its candidate time), keyed by shape as microbench
    writes them, or (`keyed` False) by position, as an older kevo wrote them; the case at `told_apart` reported
    as microbench words a case whose clock and events disagree."""
    metrics = {}
    for i, (case, ms) in enumerate(cases):
        metrics.update({(figure_metric(case, k) if keyed else f"decode{i}_{k}"): v for k, v in row(ms, case.weight).items()})
    reason = "served mix 2.00x (bar 1.03x); " + "; ".join(
        f"{c.label}: 2.00x" + (" by the clock, 2.10x by the events" if i == told_apart else "") + f" ({ms:.4f} vs {2 * ms:.4f} ms)"
        for i, (c, ms) in enumerate(cases))
    bench = StageResult.passed("microbench", reason, speedup=2.0, bar=1.03, **metrics)
    verdict = Verdict.of([StageResult.passed(n, "ok") for n in ("compile", "dispatch", "parity")] + [bench])
    return Kernel(ref="head:decode", op="decode", path="heads/decode.py", source="# head\n", speedup=2.0, verdict=verdict)


def test_a_case_s_key_names_its_shape_and_nothing_else():
    case = served_now()[0]
    assert case.key == "decode_b3_len5-24_hq4_hkv2_d16_bs4"
    assert Case("decode", "another label", case.params, weight=0.01).key == case.key
    assert decode_case(4, 5, 24, 0.7).key != case.key and "." not in case.key


def test_figures_timed_on_a_shape_list_since_changed_keep_their_own_shapes_and_the_gone_one_says_so():
    now = served_now()                                       # batch 3 then batch 2, in the CPU config
    gone = decode_case(9, 1, 9, 0.5)
    head = head_timed_on([(now[1], 0.004), (gone, 0.008)])  # timed when the list was batch 2, batch 9
    lines = kernel_figures(head, CFG, "attention", CPU)
    first = next(line for line in lines if now[1].label in line)
    assert "4.0 us" in first and f"weight {now[1].weight:.2f}" in first and "not a served shape" not in first
    assert next(line for line in lines if gone.label in line).count("(not a served shape of the config now)") == 1
    assert not any(now[0].label in line for line in lines)   # today's first shape was never timed: no figures for it
    assert [k for k, _ in case_figures(head.verdict.stages[-1].metrics, "decode")] == [now[1].key, gone.key]


def test_a_record_keyed_by_position_by_an_older_kevo_still_reads_and_says_its_figures_are_kept_by_place():
    now = served_now()
    head = head_timed_on([(now[1], 0.004), (now[0], 0.008)], keyed=False)     # by place, in another order than now
    bench = head.verdict.stages[-1]
    cases = microbench_cases(bench.metrics, bench.reason, "decode")
    assert [(c["key"], c["label"], c["candidate_ms"]) for c in cases] == [(None, now[1].label, 0.004),
                                                                          (None, now[0].label, 0.008)]
    assert speed(head.verdict, "decode").timed
    lines = [line for line in kernel_figures(head, CFG, "attention", CPU) if " on decode served" in line]
    assert len(lines) == 2 and all("an older kevo's record, its figures kept by place" in line for line in lines)
    assert now[1].label in lines[0] and "4.0 us" in lines[0]


def test_a_shape_whose_clock_and_events_disagree_keeps_its_label_and_the_shapes_after_it_theirs():
    now = served_now()
    other = decode_case(9, 1, 9, 0.5)
    head = head_timed_on([(now[0], 0.004), (now[1], 0.006), (other, 0.008)], told_apart=1)
    assert "by the clock, 2.10x by the events" in head.verdict.stages[-1].reason
    assert [label for label, _, _ in speed(head.verdict, "decode").shapes] == [now[0].label, now[1].label, other.label]


def test_a_served_shape_given_twice_is_refused_before_anything_is_timed(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    group = {"batch": 2, "lengths": [3, 12], "weight": 0.5}
    raw["targets"]["attention"]["cpu"]["decode"] = [group, group]
    (tmp_path / "twice.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"targets\.attention\.cpu: decode: the shape batch 2, lengths \[3, 12\] is given twice") as err:
        load_config(tmp_path / "twice.yaml")
    assert "\n" not in str(err.value)
    # past the config (shapes that reach microbench another way, built here without validation), microbench refuses them too
    att = CFG.targets.attention
    twice = att.cpu.model_copy(update={"decode": [att.cpu.decode[0], att.cpu.decode[0]]})
    cfg = CFG.model_copy(update={"targets": CFG.targets.model_copy(update={"attention": att.model_copy(update={"cpu": twice})})})
    shapes = device_shapes(cfg, "attention", CPU)
    ctx = EvalContext(cfg=cfg, target=TARGETS["attention"], shapes=shapes, device=CPU, dtype=torch.float32,
                      pool=None, source="", ops=["decode"])
    with pytest.raises(HarnessError, match="give one shape twice: decode_b"):
        timing_plan(ctx)
    assert len(timing_plan(EvalContext(cfg=CFG, target=TARGETS["attention"], shapes=device_shapes(CFG, "attention", CPU),
                                       device=CPU, dtype=torch.float32, pool=None, source="", ops=["decode"]))) == 2


@pytest.mark.parametrize("registers, shared_kb, warps, fit", [
    (185, 38, 4, 2),      # the lean decode kernel at batch 64 before its register cap: 395.5 us at 64 x 4k (H200)
    (168, 38, 4, 3),      # capped for 3 a SM: 277.9 us
    (128, 38, 4, 4),
    (96, 38, 4, 5),       # the GQA family: five by registers, five by shared memory
    (96, 120, 4, 1),      # shared memory binds
    (16, 0, 32, 2),       # threads bind: 1024 a program (registers would allow 4)
])
def test_programs_per_sm_are_bounded_by_registers_shared_memory_and_threads(registers, shared_kb, warps, fit):
    k = KernelUse(name="_k", registers=registers, spills=0, shared_bytes=shared_kb * 1024, warps=warps)
    assert programs_per_sm(k) == fit


def test_the_planner_sees_how_many_programs_of_a_timed_kernel_fit_per_sm():
    case = served_now()[0]
    head = head_timed_on([(case, 0.004)])
    bench = head.verdict.stages[-1]
    bench.metrics.update({figure_metric(case, "kernel_registers"): 185.0, figure_metric(case, "kernel_spills"): 0.0,
                          figure_metric(case, "kernel_programs_per_sm"): 2.0})
    line = next(line for line in kernel_figures(head, CFG, "attention", CPU) if case.label in line)
    assert "up to 185 registers a thread, 0 spilled words, 2 programs per SM" in line, line
