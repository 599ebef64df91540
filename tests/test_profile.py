"""The served profile: its buckets add up to the measured step time, the ceilings are Amdahl's, it says
plainly when the target is not where the time goes, and the shapes it records feed the config's
shape groups. On the CPU it must call its figures CPU time, never GPU figures."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import CUDA, ROOT, config_with
from harness.errors import HarnessError
from harness.evaluate import device_shapes
from harness.amdahl import ceiling
from harness.profile import BUCKETS, attribute_graphs, profile_served, summarize
from harness.served.shapes import ShapesError, apply_recorded, load_recorded_shapes
from harness.targets.attention import served_cases

CFG = config_with()


@pytest.fixture(scope="module")
def report():
    return profile_served(CFG, "attention", device=torch.device("cpu"))


def test_profile_attributes_the_step_time_to_the_models_parts_counting_none_twice(report):
    """An op inside another is counted once (its own time): what the parts take never exceeds the steps'
    measured time, and idle, the rest, is never negative."""
    buckets = report["buckets"]
    assert set(buckets) == set(BUCKETS)
    attributed = sum(b["ms"] for k, b in buckets.items() if k != "idle")
    assert 0 < attributed <= report["step_ms_total"] and buckets["idle"]["ms"] >= 0
    assert buckets["attention_decode"]["ms"] > 0 and buckets["attention_prefill"]["ms"] > 0 and buckets["gemm"]["ms"] > 0
    assert report["steps_profiled"] > 0 and report["step_ms_mean"] > 0


def test_each_share_is_its_time_over_the_step_time_and_unattributed_time_is_reported_apart():
    us = dict.fromkeys(BUCKETS, 0.0) | {"gemm": 500.0, "attention_decode": 200.0, "other": 100.0, "idle": 200.0,
                                        "unattributed": 50.0}
    s = summarize(us, 1000.0, 4, "attention", "cuda")
    assert {k: b["share"] for k, b in s["buckets"].items() if b["share"]} == {
        "gemm": 0.5, "attention_decode": 0.2, "other": 0.1, "idle": 0.2}
    assert s["buckets"]["gemm"]["ms"] == 0.5 and s["step_ms_total"] == 1.0 and s["step_ms_mean"] == 0.25
    assert s["unattributed_share"] == 0.05 and "unattributed" not in s["buckets"]
    assert s["target_share"] == 0.2 and s["op_shares"] == {"decode": 0.2, "prefill": 0.0}


@pytest.mark.skipif(CUDA, reason="checks the CPU-only labelling")
def test_cpu_profile_is_labelled_cpu_time_not_gpu_figures(report):
    assert report["device"] == "cpu" and "CPU time" in report["clock"] and "not GPU figures" in report["clock"]


def test_ceilings_are_amdahls_for_the_target_share(report):
    f = report["target_share"]
    assert math.isclose(f, report["op_shares"]["decode"] + report["op_shares"]["prefill"])
    for s in ("1.25", "1.5", "2.0", "4.0", "inf"):
        assert math.isclose(report["ceilings"][s], 1 / (1 - f + (0 if s == "inf" else f / float(s))))
    values = list(report["ceilings"].values())
    assert values == sorted(values) and values[0] >= 1.0
    assert ceiling(0.5, 2) == pytest.approx(4 / 3) and ceiling(0.25, math.inf) == pytest.approx(4 / 3)


def test_profile_says_plainly_when_the_target_is_not_where_the_time_goes():
    us = dict.fromkeys(BUCKETS, 0.0) | {"gemm": 600.0, "attention_decode": 100.0, "idle": 300.0}
    elsewhere = summarize(us, 1000.0, 10, "attention", "cuda")
    assert elsewhere["verdict"].startswith("attention is not where the time goes: 10% of the served step, while GEMM takes 60%")
    assert "at most 1.11x faster" in elsewhere["verdict"] and elsewhere["clock"] == "device time of CUDA kernels"
    split = {"attention_decode": 300.0, "attention_prefill": 250.0, "gemm": 350.0, "idle": 100.0}
    here = summarize(dict.fromkeys(BUCKETS, 0.0) | split, 1000.0, 10, "attention", "cuda")
    assert here["verdict"].startswith("attention is where the time goes: 55% of the served step")   # both ops together


def test_graph_replay_kernels_are_shared_out_by_name_as_their_eager_kernels_were():
    buckets = dict.fromkeys(BUCKETS, 0.0) | {"graph": 100.0 + 40.0 + 10.0}
    buckets |= {"norm": 30.0, "rope": 10.0, "attention_decode": 20.0}          # the eager steps' own time
    buckets |= {"unattributed": 8.0 + 5.0, "other": 8.0 + 5.0}                  # launches not traced: other
    names = {"elementwise_mul": {"norm": 30.0, "rope": 10.0, "graph": 100.0, "unattributed": 8.0},   # 3:1 where traced
             "_decode_split_kernel": {"attention_decode": 20.0},              # eager only: nothing to share
             "nvjet_tst_64x8_64x16": {"graph": 40.0},                          # a GEMM met only inside graphs
             "mystery_kernel": {"graph": 10.0, "unattributed": 5.0}}           # known nowhere
    before = sum(buckets.values()) - buckets["unattributed"]
    how = attribute_graphs(buckets, names)
    assert buckets["norm"] == 30.0 + 81.0 and buckets["rope"] == 10.0 + 27.0 and buckets["attention_decode"] == 20.0
    assert buckets["gemm"] == 40.0 and buckets["graph"] == 0.0
    assert buckets["unattributed"] == 15.0 and buckets["other"] == 15.0                # counted as other, kept apart too
    assert math.isclose(sum(v for k, v in buckets.items() if k != "unattributed"), before)   # nothing lost or counted twice
    assert how == {"kernel name (graph replay)": 100.0, "gemm by name (graph replay)": 40.0,
                   "unattributed (graph replay)": 10.0, "kernel name (launch not traced)": 8.0}


def test_recorded_shapes_become_the_config_shape_groups_parity_and_microbench_use(report, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(report))
    recorded = load_recorded_shapes(path)
    assert recorded["decode"] and recorded["prefill"]
    assert math.isclose(sum(g.weight for g in recorded["decode"]), 1.0, rel_tol=1e-3)
    section = apply_recorded(CFG.targets.attention.cpu, path)
    cases = [c for c in served_cases(section) if c.op == "decode"]
    assert [(c.params["batch"], c.params["length_range"]) for c in cases] == [(g.batch, g.lengths) for g in recorded["decode"]]
    calls = sum(r["calls"] for r in report["served_shapes"]["decode"])
    assert calls > 0 and all(0 < r["call_share"] <= 1 for r in report["served_shapes"]["decode"])
    (tmp_path / "bad.json").write_text('{"served_shapes": {"decode": [{"batch": 0, "lengths": [1, 2], "weight": 1}]}}')
    with pytest.raises(ShapesError, match="served_shapes.decode: malformed group"):
        load_recorded_shapes(tmp_path / "bad.json")


def test_served_cases_are_drawn_at_the_heads_of_the_model_the_scenario_serves(tmp_path):
    cuda = torch.device("cuda")            # only its type is read: no GPU needed
    placeholders = served_cases(device_shapes(CFG, "attention", cuda))
    preset = CFG.served.presets[CFG.served.cuda.preset]
    assert CFG.targets.attention.cuda.heads[0] != (preset.q_heads, preset.kv_heads)      # the config lists 8B's first
    assert {(c.params["q_heads"], c.params["kv_heads"]) for c in placeholders} == {(preset.q_heads, preset.kv_heads)}
    h200 = "docs/data/profile-h200-qwen3-0.6b-long-60s.json"
    recorded = served_cases(device_shapes(config_with(**{"served.recorded_shapes": h200}), "attention", cuda))
    assert {(c.params["q_heads"], c.params["kv_heads"]) for c in recorded} == {(16, 8)}
    other = json.loads((ROOT / h200).read_text()) | {"heads": [64, 8]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ShapesError, match=r"recorded with heads \[64, 8\], which the target's heads"):
        apply_recorded(CFG.targets.attention.cuda, tmp_path / "other.json")
    (tmp_path / "8b.json").write_text(json.dumps(other | {"heads": [32, 8]}))      # the target's, not the served model's
    with pytest.raises(HarnessError, match=r"recorded with heads \[32, 8\], while the served model has \[16, 8\]"):
        device_shapes(config_with(**{"served.recorded_shapes": str(tmp_path / "8b.json")}), "attention", cuda)


def kevo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_profile_command_prints_the_breakdown_and_writes_json_for_the_planner(tmp_path):
    done = kevo("profile", "--target", "attention", "--json", str(tmp_path / "p.json"))
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "p.json").read_text())
    assert {"buckets", "target_share", "op_shares", "ceilings", "verdict", "served_shapes", "clock"} <= set(data)
    assert "attention share f =" in done.stdout and "end-to-end ceiling 1/(1-f+f/s)" in done.stdout
    assert data["verdict"] in done.stdout


@pytest.mark.parametrize("args, words", [
    (("profile", "--target", "rmsnorm"), "no served profile for target 'rmsnorm'"),
    (("profile", "--window", "-1"), "--window must be positive"),
], ids=["unknown-target", "bad-window"])
def test_profile_command_errors_are_one_line_and_exit_2(args, words):
    done = kevo(*args)
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert words in done.stderr


def test_a_recorded_profile_gives_the_planner_measured_shares_instead_of_assumptions(report, tmp_path):
    from agent.run.profile import run_profile
    from harness.errors import HarnessError
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(report))
    cfg = config_with(**{"served.recorded_shapes": str(path)})
    profile = run_profile(cfg, "attention", torch.device("cpu"), "cpu", heads={})
    assert profile.source == "served" and path.name in profile.note
    for op in cfg.agent.ops:
        assert profile.ops[op].share == pytest.approx(max(report["op_shares"][op], 1e-6))
        assert "MEASURED" in profile.ops[op].lines[0]
        recorded = {(r["batch"], tuple(r["lengths"])) for r in report["served_shapes"][op]}
        assert any(f"batch {b}, lengths {lo}..{hi}" in " ".join(profile.ops[op].lines) for b, (lo, hi) in recorded)
    assert run_profile(config_with(), "attention", torch.device("cpu"), "cpu", heads={}).source == "stand-in"
    path.write_text(json.dumps({"served_shapes": report["served_shapes"]}))     # shapes, but no measured shares
    with pytest.raises(HarnessError, match="not a kevo profile"):
        run_profile(cfg, "attention", torch.device("cpu"), "cpu", heads={})


def test_the_shares_of_the_current_heads_follow_their_measured_speedups_over_the_torch_baseline():
    from agent.run.profile import head_shares
    from agent.records import Kernel

    def k(op, s):
        return Kernel(ref=f"c-{op}", op=op, path="-", source="", speedup=s)
    base = {"decode": 0.35, "prefill": 0.15}
    assert head_shares(base, {}) == pytest.approx(base)                       # nothing timed: the base shares
    got = head_shares(base, {"decode": k("decode", 1.4), "prefill": k("prefill", None)})
    step = 0.5 + 0.35 / 1.4 + 0.15                                            # the rest, decode 1.4x faster, prefill as it was
    assert got == pytest.approx({"decode": 0.35 / 1.4 / step, "prefill": 0.15 / step})
    assert got["decode"] < base["decode"] and got["prefill"] > base["prefill"]   # the bottleneck moves
