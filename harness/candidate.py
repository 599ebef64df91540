"""Loading a candidate's kernel file: the module, the target's ops it defines, and what is wrong with them.

The one loader of candidate code, used where candidate code runs: the evaluator's sandboxed worker
(harness/worker.py) and the sandboxed served process (harness/served/ops.py). It imports the file as
the module `candidate` and checks each op the file defines against the target's contract: its
parameters must be the contract's, by name and order. Not covered: judging what the ops compute (the
stages do), or keeping the file's import from doing harm (the sandbox and the allowlist do).
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from harness.targets import Target


@dataclass(frozen=True)
class Loaded:
    module: ModuleType
    ops: tuple[str, ...]        # the target's ops the file defines
    error: str                  # "" when every defined op has the contract's signature and there is one at least


def load_candidate(path: Path | str, target: Target, name: str = "candidate") -> Loaded:
    """`name`: the module's name (a served process that also loads the other ops' heads gives each its own)."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    ops, problems = [], []
    for name, op in target.ops.items():
        fn = getattr(module, name, None)
        if fn is None:
            continue
        params = list(inspect.signature(fn).parameters)
        if params != list(op.arg_names):
            problems.append(f"{name}({', '.join(params)}) must be {name}({', '.join(op.arg_names)})")
        ops.append(name)
    error = "; ".join(problems) or ("" if ops else "defines none of: " + ", ".join(target.ops))
    return Loaded(module, tuple(ops), error)
