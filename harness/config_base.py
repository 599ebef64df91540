"""What every config section model is built on: the `Strict` base (unknown keys are errors, values frozen),
`ConfigError`, and the one line a validation failure is reported in (`message`).

Holds no section of config.yaml: the sections a verdict depends on are in harness/config.py, those that
drive a run (the agent, its providers, the executor) in harness/config_run.py.
"""
from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(Exception):
    """A config file that cannot be used; the message is one line naming the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def message(err: ValidationError, source: str) -> str:
    """Every error, each naming its key, on one line; unknown keys (typos) first, each with the likeliest
    missing key beside it as a guess."""
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    parts = []
    for e in errors:
        loc = tuple(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            siblings = [str(m["loc"][-1]) for m in errors if m["type"] == "missing" and m["loc"][:-1] == e["loc"][:-1]]
            close = difflib.get_close_matches(loc[-1], siblings, n=1) if loc else []
            msg = "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
        elif e["type"] == "missing":
            msg = "missing key"
        parts.append(f"{'.'.join(loc) or '(top level)'}: {msg}")
    count = f"{len(parts)} errors: " if len(parts) > 1 else ""
    return f"{source}: {count}" + "; ".join(" ".join(p.split()) for p in parts)
