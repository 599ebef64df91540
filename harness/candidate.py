"""Loading a candidate's kernel file: the module, the target's ops it defines, and what is wrong with them.

The one loader of candidate code, used where candidate code runs: the evaluator's sandboxed worker
(harness/worker.py) and the sandboxed served process (harness/served/ops.py). It imports the file as
the module `candidate` and checks each op the file defines against the target's contract: its
parameters must be the contract's, by name and order. The module holds only what the file binds: Triton's
interpreter (TRITON_INTERPRET=1, the CPU) would copy its own module's globals (numpy, inspect, ...) into a kernel's
module at its first launch, each a way past the allowlist for a file naming one it never bound on a branch that
never ran (`seal_interpreter`). Not covered: judging what the ops compute (the stages do), or keeping the file's
import from doing harm (the sandbox and the allowlist do).
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from harness.targets import Target


@dataclass(frozen=True)
class Loaded:
    module: ModuleType
    ops: tuple[str, ...]        # the target's ops the file defines
    error: str                  # "" when every defined op has the contract's signature and there is one at least


# The one name the interpreter's rewritten kernels need from it, under a dunder name no kernel file may write.
SEALED_SEMANTIC = "__kevo_interpreter_semantic__"


def seal_interpreter() -> None:
    """Have Triton's interpreter put into a kernel's module only the one object its rewrite of the kernel calls
    (its `interpreter_semantic`, named `SEALED_SEMANTIC` in the calls it writes) in place of all of its module's
    globals. Idempotent; nothing to seal in a Triton without that rewrite (it interprets nothing here then)."""
    from triton.runtime import interpreter

    rewriter, transformer = getattr(interpreter, "FunctionRewriter", None), getattr(interpreter, "ASTTransformer", None)
    if rewriter is None or transformer is None or getattr(rewriter, "kevo_sealed", False):
        return
    visit_assign = transformer.visit_Assign

    def sealed_assign(self, node):          # x = v becomes x = <semantic>.to_tensor(v, False): only that call renamed
        node = visit_assign(self, node)
        node.value.func.value.id = SEALED_SEMANTIC
        return node

    def compile_and_exec(self, tree):
        namespace = {**self.kwargs}
        self.fn.__globals__[SEALED_SEMANTIC] = interpreter.interpreter_semantic
        exec(compile(tree, filename=self.filename, mode="exec"), self.fn.__globals__, namespace)
        return namespace[self.fn.__name__]
    transformer.visit_Assign = sealed_assign
    rewriter._compile_and_exec = compile_and_exec
    rewriter.kevo_sealed = True


def load_candidate(path: Path | str, target: Target, name: str = "candidate") -> Loaded:
    """`name`: the module's name (a served process that also loads the other ops' heads gives each its own)."""
    seal_interpreter()
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


def plain_output(out: object, op: str) -> torch.Tensor:
    """What an op of the candidate returned, as a fresh plain torch.Tensor over the same memory, for the trusted code
    to read (the worker's outputs, the served model and its spot checks): the object the candidate made could carry
    methods of its own (a subclass's `detach`, or `out.detach = ...` on the instance) that show the checks other data
    than the memory holds. A subclass is refused outright (TypeError, naming it)."""
    if type(out) is not torch.Tensor:
        what = (f"a {type(out).__name__} (a torch.Tensor subclass); return a plain torch.Tensor"
                if isinstance(out, torch.Tensor) else f"{type(out).__name__}, not a torch.Tensor")
        raise TypeError(f"{op} returned {what}")
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.as_subclass(out, torch.Tensor)
