"""The registry of targets: name -> Target. A new target is a module beside attention.py and a line here."""
from harness.targets.attention import TARGET as ATTENTION
from harness.targets.base import Case, Cost, Inputs, Op, Target

TARGETS: dict[str, Target] = {ATTENTION.name: ATTENTION}

__all__ = ["TARGETS", "Case", "Cost", "Inputs", "Op", "Target"]
