"""Prompts are files with named slots, rendered by one strict function: a slot without a value, or a
value for a slot the file lacks, is an error naming both; no slot survives rendering."""
from __future__ import annotations

import re

import pytest

from agent.llm.prompts import PROMPTS, PromptError, render, slots


def test_a_missing_slot_is_an_error_naming_the_file_and_the_slot():
    values = {name: "x" for name in slots("coder_compile_repair")}
    del values["feedback"]
    with pytest.raises(PromptError, match=r"^prompts/coder_compile_repair\.md: slot \{\{feedback\}\} has no value$"):
        render("coder_compile_repair", **values)


def test_a_value_for_a_slot_the_file_does_not_have_is_an_error():
    with pytest.raises(PromptError, match=r"\{\{temperature\}\}, which the file does not have"):
        render("planner_repair", notice="", error="x", temperature="0.7")


def test_a_missing_prompt_file_is_an_error():
    with pytest.raises(PromptError, match="no such prompt file"):
        render("no_such_prompt")


def test_rendering_fills_every_slot_once_and_leaves_the_values_alone(tmp_path):
    (tmp_path / "t.md").write_text("a {{one}} b {{ two }} c {{one}}\n")
    assert render("t", folder=tmp_path, one="{{two}}", two="2") == "a {{two}} b 2 c {{two}}\n"


def test_every_prompt_file_in_prompts_is_listed_in_its_readme_with_its_slots():
    readme = (PROMPTS / "README.md").read_text()
    for path in sorted(PROMPTS.glob("*.md")):
        if path.name == "README.md":
            continue
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{path.name}`")), None)
        assert row is not None, path.name
        listed = set(re.split(r",\s*", row.split("|")[3].strip()))
        assert listed == slots(path.stem), path.name


# -- what the planner's and coder's requests carry ------------------------------------------------------

def _head(op: str, anchor_rate: float | None):
    """A head whose microbench timed one served shape, with the cuDNN anchor when `anchor_rate` is given."""
    import torch

    from conftest import config_with
    from harness.evaluate import device_shapes
    from harness.records import StageResult, Verdict
    from harness.stages.microbench import figure_metric
    from harness.targets import TARGETS

    from agent.records import Kernel
    case = next(c for c in TARGETS["attention"].served_cases(device_shapes(config_with(), "attention", torch.device("cpu")))
                if c.op == op)
    label = case.label
    row = {"candidate_ms": 0.05, "baseline_ms": 0.06, "weight": 1.0, "candidate_rate": 2.89, "baseline_rate": 2.41}
    if anchor_rate is not None:
        row.update(anchor_ms=0.05 * 2.89 / anchor_rate, anchor_rate=anchor_rate)
    bench = StageResult.passed("microbench", f"served mix 1.20x (bar 1.03x); {label}: 1.20x (0.05 vs 0.06 ms)",
                               speedup=1.2, bar=1.03, **{figure_metric(case, k): v for k, v in row.items()})
    v = Verdict.of([StageResult.passed(n, "ok") for n in ("compile", "dispatch", "parity")] + [bench])
    return Kernel(ref=f"head:{op}", op=op, path=f"heads/{op}.py", source=f"# the {op} head\n", speedup=1.2, verdict=v), label


def _roles(arch: str = "sm90"):
    import torch

    from conftest import config_with

    from agent.roles.coder import Coder
    from agent.knowledge import load_catalog
    from agent.roles.planner import Planner
    cfg, catalog = config_with(), load_catalog()
    return (Planner(None, None, "m", cfg, "attention", torch.device("cpu"), catalog, arch),
            Coder(None, None, "m", cfg, "attention", torch.device("cpu"), catalog, arch), catalog)


def test_planner_and_coder_prompts_carry_the_sm90_notes_the_families_with_their_knobs_and_the_cudnn_anchors():
    from agent.reading.figures import anchors_text
    from agent.knowledge import KNOWLEDGE, read_knobs
    from agent.records import Claim, KillTest, OpEvidence, Profile
    from agent.run.state import ProposalState
    planner, coder, catalog = _roles("sm90")
    decode, label = _head("decode", anchor_rate=4.05)
    prefill, _ = _head("prefill", anchor_rate=None)
    heads = {"decode": decode, "prefill": prefill}
    profile = Profile(source="stand-in", note="n", device="cpu", arch="sm90",
                      ops={op: OpEvidence(share=0.3, lines=["f = 0.3"]) for op in heads})
    state = ProposalState(next_id="c001", ops=["decode", "prefill"], history=[], heads=heads, parents=heads,
                          profile=profile, min_ceiling=1.005)
    claim = Claim(op="decode", hypothesis="pack the GQA group into one tile", evidence=["f = 0.3"], expected_speedup=1.1,
                  risks=["spills"], kill_test=KillTest(stage="microbench", observation="no gain"), op_share=0.3,
                  share_source="stand-in")
    prompts = {"planner": planner._prompt(state),
               "coder": coder.prompt(claim, decode, anchors_text(heads, "attention", ["decode"]))}
    for role, text in prompts.items():
        for note in ("arch/sm90.md", "attention/decode.md"):                 # the notes, as the files hold them
            body = (KNOWLEDGE / note).read_text()
            assert all(line in text for line in body.splitlines() if line.strip()), (role, note)
        for entry, family in catalog.families("attention", "decode"):        # every family, every knob
            defaults = read_knobs((KNOWLEDGE / entry.files[0]).read_text())
            assert entry.files[0] in text and entry.summary in text, (role, entry.id)
            for name, spec in family.knobs.items():
                assert f"{name} = {defaults[name]!r}, worth trying {spec.values}" in text, (role, name)
                assert spec.why[:100] in text, (role, name)
        assert f"{label} (weight 1.00): cuDNN 4.05 TB/s, head:decode 2.89 TB/s = {2.89 / 4.05:.3f}x cuDNN" in text, role
    assert "prefill: no cuDNN anchor timed" not in prompts["planner"]       # prefill was timed, its anchor was not
    assert "no cuDNN anchor timed; head:prefill 2.89 TFLOP/s" in prompts["planner"]
    assert "### hopper-sm90 " in prompts["planner"] and "### hopper-sm90 " not in _roles("cpu")[0]._prompt(state)       # a GPU's notes only on that GPU


def test_a_note_longer_than_the_bound_reaches_a_prompt_cut_saying_where_the_rest_is():
    from agent.knowledge import KNOWLEDGE, NOTE_CHARS, Catalog, Entry, prompt_text
    long = "attention/decode_paged_gqa.py"
    assert len((KNOWLEDGE / long).read_text()) > NOTE_CHARS
    cat = Catalog(entries=[Entry(id="long", target="attention", op="decode", arch="any", tags=["notes"], files=[long],
                                 summary="a long note")])
    text = prompt_text(cat, "attention", ["decode"], "sm90")
    assert text.endswith(f"(cut at {NOTE_CHARS} characters; the rest is in knowledge/{long})")
    assert len(text) < NOTE_CHARS + 200
