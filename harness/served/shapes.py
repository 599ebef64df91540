"""The attention shapes a served workload really calls, with their frequencies.

`ShapeRecorder` counts every prefill and decode call the engine makes, bucketed by batch size and
longest sequence (powers of two), and summarises them as the config's shape groups
(`{batch, lengths: [lo, hi], weight}`), weighted by the work each group does (keys read for decode,
causal query-key pairs for prefill). The profile writes the summary into its JSON;
`load_recorded_shapes` reads it back and `apply_recorded` puts it in place of a target section's
placeholder shapes. Not covered: choosing which recorded shapes parity and microbench should use
(they take the heaviest groups, up to `top` per op).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError


def _bucket(n: int) -> int:
    return max(1, n - 1).bit_length()


class ShapeRecorder:
    def __init__(self) -> None:
        # (op, batch bucket, length bucket) -> [calls, batch total, shortest, longest, work]
        self.groups: dict[tuple[str, int, int], list[float]] = {}

    def record(self, op: str, lens: list[int], calls: int = 1) -> None:
        """`calls` calls on these lengths (a CUDA graph replay stands for all its layers' calls at once)."""
        hi, lo = max(lens), min(lens)
        work = sum(lens) if op == "decode" else sum(n * (n + 1) / 2 for n in lens)
        g = self.groups.setdefault((op, _bucket(len(lens)), _bucket(hi)), [0, 0, lo, hi, 0.0])
        g[0] += calls
        g[1] += calls * len(lens)
        g[2], g[3] = min(g[2], lo), max(g[3], hi)
        g[4] += calls * work

    def summary(self, top: int = 4) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for op in ("decode", "prefill"):
            rows = [g for key, g in self.groups.items() if key[0] == op]
            calls = sum(g[0] for g in rows)
            rows = sorted(rows, key=lambda g: -g[4])[:top]
            work = sum(g[4] for g in rows) or 1.0
            out[op] = [{"batch": max(1, round(g[1] / g[0])), "lengths": [int(g[2]), int(g[3])],
                        "weight": round(g[4] / work, 4), "calls": int(g[0]), "call_share": round(g[0] / calls, 4)}
                       for g in rows]
        return out


class ShapesError(Exception):
    """A recorded-shapes file that cannot be used; one line."""


def load_recorded_shapes(path: Path | str) -> dict[str, list]:
    """The `served_shapes` of a profile JSON as config shape groups, per op; and under "heads" the
    [query heads, kv heads] the profile served, where it says."""
    from harness.config import ShapeGroup
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShapesError(f"{path}: no such recorded-shapes file (write one with kevo-agent profile --json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ShapesError(f"{path}: cannot read recorded shapes ({e})") from None
    shapes = data.get("served_shapes") if isinstance(data, dict) else None
    if not isinstance(shapes, dict):
        raise ShapesError(f"{path}: no served_shapes object")
    out = {}
    for op in ("decode", "prefill"):
        rows = shapes.get(op) or []
        try:
            out[op] = [ShapeGroup(batch=r["batch"], lengths=tuple(r["lengths"]), weight=max(r["weight"], 1e-6))
                       for r in rows]
        except (KeyError, TypeError, ValidationError) as e:
            raise ShapesError(f"{path}: served_shapes.{op}: malformed group ({str(e).splitlines()[0]})") from None
    heads = data.get("heads")
    if isinstance(heads, list) and len(heads) == 2 and all(isinstance(h, int) for h in heads):
        out["heads"] = (heads[0], heads[1])
    return out


def served_heads_first(section: Any, heads: tuple[int, int] | list[int]) -> Any:
    """The section with the served model's [query heads, kv heads] first in `heads`: the served cases
    are drawn at the first pair, the boundary cases at every pair."""
    pair = tuple(heads)
    return section.model_copy(update={"heads": [pair] + [tuple(h) for h in section.heads if tuple(h) != pair]})


def apply_recorded(section: Any, path: Path | str | None, served: tuple[int, int] | None = None) -> Any:
    """A target's device section with its served shapes replaced by the recorded ones (ops that
    recorded none keep the config's), and the heads the profile served first. `served`: the heads of
    the model the served scenario runs, which a recorded profile's heads must be."""
    if path is None:
        return section
    recorded = load_recorded_shapes(path)
    heads = recorded.pop("heads", None)
    if heads is not None:
        if served is not None and heads != tuple(served):
            raise ShapesError(f"{path}: recorded with heads {list(heads)}, while the served model has "
                              f"{list(served)} (a profile of another model?)")
        if heads not in [tuple(h) for h in section.heads]:
            raise ShapesError(f"{path}: recorded with heads {list(heads)}, which the target's heads "
                              f"{[list(h) for h in section.heads]} do not include (a profile of another model?)")
        section = served_heads_first(section, heads)
    return section.model_copy(update={op: groups for op, groups in recorded.items() if groups})
