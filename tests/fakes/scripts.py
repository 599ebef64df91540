"""Scripted LLM replies for the fake services: good claims, code that compiles or does not, malformed
replies. Plain data built from the project's reference kernels (tests/candidates.py)."""
from __future__ import annotations

import json

import candidates as C


def claim(s: float = 1.3, stage: str = "microbench", **extra) -> str:
    body = {"op": "decode",
            "hypothesis": "Halve BLOCK_N to 32 so the short served contexts waste fewer masked lanes per tile",
            "evidence": ["decode holds f = 0.35 of the served step (stand-in)",
                         "served lengths 5..24 tokens are shorter than BLOCK_N = 64"],
            "expected_speedup": s, "risks": ["more loop iterations on long contexts"],
            "kill_test": {"stage": stage, "observation": "no gain beyond the noise bar"}, **extra}
    return "Here is my claim.\n```json\n" + json.dumps(body, indent=1) + "\n```\n"


def code(source: str) -> str:
    return f"Here is the file.\n```python\n{source}```\n"


GOOD = code(C.with_knobs(C.REF_DECODE, BLOCK_N=32))
WRONG = code(C.DROPS_NEWEST_TOKEN)                       # compiles, fails parity
SYNTAX_ERROR = code(C.REF_DECODE.replace("def decode(", "def decode((", 1))
PROSE = "I would make the tiles smaller, since the contexts are short."
