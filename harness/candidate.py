"""Loading a candidate file: the one loader, for every process that runs candidate code (the sandboxed
worker, harness/worker.py; the served scenario's engine, harness/served/). It imports the file as module
`candidate` and checks each op it defines against the target's contract (argument names, in order), so a
candidate whose op takes its arguments in another order is refused wherever it is loaded.

It runs the candidate's code: call it only inside a sandbox. Not here: the sandbox, calling the ops, judging.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from harness.targets.base import Target


@dataclass(frozen=True)
class Loaded:
    module: ModuleType
    ops: tuple[str, ...]      # the target's ops the file defines
    error: str                # '' when it defines at least one and each matches its contract


def load_candidate(path: Path | str, target: Target) -> Loaded:
    spec = importlib.util.spec_from_file_location("candidate", str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules["candidate"] = module
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
