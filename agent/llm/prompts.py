"""Render a prompt file from prompts/ with named slots: the one place prompt text meets values.

A slot is written `{{name}}` in the file. `render` fails on a slot without a value and on a value for
a slot the file does not have (so a file and the code that fills it cannot drift apart silently).
No prompt text lives in Python. Not here: what goes into the slots (planner, coder).
"""
from __future__ import annotations

import re
from pathlib import Path

from harness.config import PROJECT_ROOT

PROMPTS = PROJECT_ROOT / "prompts"
_SLOT = re.compile(r"{{\s*(\w+)\s*}}")


class PromptError(Exception):
    """A prompt file that cannot be rendered as asked; one line naming the file and the slot."""


def slots(name: str, folder: Path = PROMPTS) -> set[str]:
    return set(_SLOT.findall(_read(name, folder)))


def _read(name: str, folder: Path) -> str:
    path = folder / f"{name}.md"
    try:
        return path.read_text()
    except FileNotFoundError:
        raise PromptError(f"{path}: no such prompt file") from None


def render(name: str, folder: Path = PROMPTS, **values: str) -> str:
    text = _read(name, folder)
    wanted = set(_SLOT.findall(text))
    missing = sorted(wanted - set(values))
    if missing:
        raise PromptError(f"prompts/{name}.md: slot {{{{{missing[0]}}}}} has no value")
    unused = sorted(set(values) - wanted)
    if unused:
        raise PromptError(f"prompts/{name}.md: a value was given for {{{{{unused[0]}}}}}, which the file does not have")
    return _SLOT.sub(lambda m: str(values[m.group(1)]), text)
