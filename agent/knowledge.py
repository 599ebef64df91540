"""The knowledge catalog (knowledge/catalog.yaml): which notes and kernels apply to an op on a GPU.

Entries are indexed by target, op (or `any`), architecture (`sm90`, `cpu`, or `any`) and tags; each
names its files under knowledge/. A kernel entry may carry a parametric `family` (knob name -> the
values worth trying, why, the prior expected speedup of one step, the risk, the stage that kills it):
the built-in proposer searches those, and moves between the families of one op. `family` is an op's
head family (the first in the catalog: the reference kernel, unless `heads_first` put the one config
names, agent.heads, before it). `select` gives a role only the entries for its target's ops and the GPU
in use. Not here: what to do with them (planner, coder, offline).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from harness.config import PROJECT_ROOT
from harness.syntax import parse

from agent.records import Knob

KNOWLEDGE = PROJECT_ROOT / "knowledge"
CATALOG = KNOWLEDGE / "catalog.yaml"


class CatalogError(Exception):
    """The catalog cannot be used; one line naming the entry."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Step(Strict):
    up: float = Field(gt=0)         # prior local speedup of a step to the next value in the list
    down: float = Field(gt=0)       # ... and to the previous one


class KnobSpec(Strict):
    values: list[Knob] = Field(min_length=2)
    why: str
    expect: Step
    risk: str
    kill: Literal["compile", "dispatch", "parity", "microbench", "replay"]


class Family(Strict):
    knobs: dict[str, KnobSpec]
    # prior local speedup of this family's kernel over the op's reference kernel (the first family of the
    # op), as measured (catalog comment says where); 1 for the reference itself
    over_reference: float = Field(default=1.0, gt=0)


class Entry(Strict):
    id: str
    target: str
    op: str                         # an op of the target, or "any"
    arch: str                       # sm90, cpu, ... or "any"
    tags: list[str]
    files: list[str] = Field(min_length=1)
    summary: str
    sources: list[str] = Field(default_factory=list)
    family: Family | None = None

    @model_validator(mode="after")
    def _family_is_a_kernel(self) -> "Entry":
        if self.family and "kernel" not in self.tags:
            raise ValueError("only a kernel entry (tag 'kernel') may carry a family")
        return self

    def text(self) -> str:
        return "\n\n".join((KNOWLEDGE / f).read_text() for f in self.files)


class Catalog(Strict):
    entries: list[Entry]

    def select(self, target: str, ops: list[str], arch: str) -> list[Entry]:
        return [e for e in self.entries if e.target in (target, "any") and e.op in (*ops, "any")
                and e.arch in (arch, "any")]

    def families(self, target: str, op: str, arch: str | None = None) -> list[tuple[Entry, Family]]:
        """Every kernel family of `op`, the head family first; given `arch`, only those that run on it (an sm90
        family's kernel needs that GPU)."""
        return [(e, e.family) for e in self.entries if e.target == target and e.op == op and e.family
                and (arch is None or e.arch in (arch, "any"))]

    def family(self, target: str, op: str) -> tuple[Entry, Family]:
        """The head family of `op`: the kernel a run starts from."""
        found = self.families(target, op)
        if not found:
            raise CatalogError(f"{CATALOG}: no kernel family for {target}.{op}")
        return found[0]

    def heads_first(self, target: str, heads: dict[str, str], arch: str) -> "Catalog":
        """This catalog with the family named for each op in `heads` (config agent.heads: op -> entry id)
        moved before the op's other families, so that it is the head; one line naming the op when it is not
        a kernel family of that op, or when its kernel does not run on `arch` (this device)."""
        for op, eid in heads.items():
            found = {e.id: e for e, _ in self.families(target, op)}
            if eid not in found:
                raise CatalogError(f"agent.heads.{op}: {eid!r} is not a kernel family of {target}.{op} in "
                                   f"knowledge/catalog.yaml (known: {', '.join(found) or 'none'})")
            if found[eid].arch not in (arch, "any"):
                raise CatalogError(f"agent.heads.{op}: {eid} runs on {found[eid].arch} only, not on this device "
                                   f"({arch})")
        chosen = [e for e in self.entries if e.target == target and heads.get(e.op) == e.id]
        return Catalog(entries=chosen + [e for e in self.entries if e not in chosen])


def load_catalog(path: Path = CATALOG) -> Catalog:
    try:
        cat = Catalog.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError) as e:
        raise CatalogError(f"{path}: cannot read ({e})".splitlines()[0]) from None
    except ValidationError as e:
        err = e.errors()[0]
        raise CatalogError(f"{path}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
    for entry in cat.entries:
        for f in entry.files:
            if not (path.parent / f).is_file():
                raise CatalogError(f"{path}: entry {entry.id} names {f}, which does not exist")
        if entry.family:
            defaults = read_knobs((path.parent / entry.files[0]).read_text())
            for name, spec in entry.family.knobs.items():
                if defaults.get(name) not in spec.values:
                    raise CatalogError(f"{path}: entry {entry.id}: knob {name} = {defaults.get(name)!r} in "
                                       f"{entry.files[0]} is not among its values {spec.values}")
    return cat


NOTE_CHARS = 6000        # a note longer than this reaches a prompt cut, saying where the rest is
WHY_CHARS = 240          # each knob's reason, as a prompt shows it


def prompt_text(catalog: Catalog, target: str, ops: list[str], arch: str) -> str:
    """The knowledge a planner or coder prompt carries for `ops` on `arch`: each note (the op notes, the
    GPU's, the method), and each kernel family with its file, summary and knobs (values, default, why).
    Bounded: a note is cut at NOTE_CHARS and a knob's reason at WHY_CHARS, each saying so."""
    parts = []
    for e in catalog.select(target, ops, arch):
        if e.family is None:
            text = e.text()
            if len(text) > NOTE_CHARS:
                text = text[:NOTE_CHARS] + f"\n... (cut at {NOTE_CHARS} characters; the rest is in knowledge/{e.files[0]})"
            parts.append(f"### {e.id} (knowledge/{', knowledge/'.join(e.files)})\n{text}")
            continue
        if "kernel" not in e.tags:
            continue
        defaults = read_knobs((KNOWLEDGE / e.files[0]).read_text())
        knobs = [f"  - {name} = {defaults.get(name)!r}, worth trying {spec.values}: "
                 + (spec.why if len(spec.why) <= WHY_CHARS else spec.why[:WHY_CHARS - 1] + "…")
                 for name, spec in e.family.knobs.items()]
        prior = ("the reference kernel" if e.family.over_reference == 1.0 else
                 f"measured {e.family.over_reference:.2f}x the reference kernel's rate (geomean, H200)")
        parts.append(f"### kernel family {e.id} ({e.op}; knowledge/{e.files[0]}, runnable; {prior})\n{e.summary}\n"
                     f"knobs (module constants):\n" + "\n".join(knobs))
    for e in catalog.select(target, ops, arch):
        if "kernel" in e.tags and e.family is None:
            parts.append(f"- runnable example: knowledge/{e.files[0]} ({e.op}): {e.summary}")
    return "\n\n".join(parts)


def gpu_arch(device: torch.device) -> str:
    """sm90 on an H100/H200; cpu on the CPU (where the catalog's GPU notes do not apply)."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


_KNOB_LINE = r"^({name}) = ([^#\n]*?)(\s*#.*)?$"


def read_knobs(source: str) -> dict[str, Knob]:
    """Module-level `NAME = literal` lines in upper case: a kernel family's settings."""
    knobs = {}
    for node in parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper() and not name.startswith("_"):
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(value, (bool, int, float)):
                    knobs[name] = value
    return knobs


def with_knobs(source: str, knobs: dict[str, Knob], header: str) -> str:
    """The source with each knob's line rewritten (its comment kept), under a one-line header comment."""
    for name, value in knobs.items():
        pattern = re.compile(_KNOB_LINE.format(name=re.escape(name)), re.MULTILINE)
        source, n = pattern.subn(lambda m: f"{m.group(1)} = {value!r}{m.group(3) or ''}", source, count=1)
        if n != 1:
            raise CatalogError(f"no line `{name} = ...` to rewrite")
    return f"# {header}\n{source}"
