"""Prompts are files with named slots, rendered by one strict function: a slot without a value, or a
value for a slot the file lacks, is an error naming both; no slot survives rendering."""
from __future__ import annotations

import re

import pytest

from agent.prompts import PROMPTS, PromptError, render, slots


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
