"""What a kernel file may name: an AST allowlist, checked in the evaluator before any candidate code runs.

A candidate reaches only what it can name, so the compile stage refuses a file that names anything
outside this surface (config `stages.compile`, each entry with its reason):
  - imports of `allowed_names`' modules only (no relative or star imports), and from each module only
    the names it lists ("*": any public name). Aliases are resolved (`import torch as t`,
    `from triton import language as tl`, `from torch import empty as e`), and a module may be used only
    by naming its attributes: `t = torch`, `[torch]`, `f(torch)` are refused, so no alias can escape
    the resolution. A name a module lists admits that name's own attributes (`torch.float32.itemsize`)
    except the forbidden ones;
  - no `forbidden_builtins` (`__import__`, `eval`, `exec`, `open`, `globals`, `type`, ...); `getattr` and
    `hasattr` only called, with a constant name, itself checked as an attribute (never as a value:
    `functools.reduce(getattr, names, x)` would walk computed names);
  - inline assembly (`inline_asm_elementwise`) only called, its text a literal, and no string naming a GPU clock
    or place register (`%globaltimer`, `%clock64`, `%smid`): a kernel that reads one can tell timed or checked
    calls from the others;
  - no attribute set or deleted while `setattr`/`delattr` are forbidden builtins (`out.detach = f` is
    `setattr(out, "detach", f)`), and no class with a base (a torch.Tensor subclass): the trusted code reads
    outputs and inputs through their methods (and, as a second layer, through fresh plain tensors:
    harness/candidate.py `plain_output`);
  - no dunder names or attributes but `readable_dunders` (`__name__`: a string, it grants nothing), no private attributes
    (`x._C`), no string constant that is a dunder name (`{"__torch_function__": f}`), no function or class
    named with a dunder;
  - on any object, none of `forbidden_attributes`: the library compute methods (`x.matmul`, `x.softmax`),
    the ways out of the allowlist (`x.numpy`, frames and code objects: `gi_frame`, `f_globals`), the
    submodules that lead to library or internal surface (`nn`, `ops`, `backends`, `profiler`, ...);
  - no `@` operator outside a `@triton.jit` function while `matmul` is a forbidden attribute (`a @ b` is
    `a.matmul(b)` on tensors; `tl.dot` in a kernel);
  - nothing a wildcard module or a listed name leads to that lives outside the allowlisted packages,
    followed on the real modules here (`tl.core.inspect` is the `inspect` module triton imported);
  - no name the file reads from its module's namespace that nothing in it binds and that is no builtin,
    scope by scope as Python resolves it (symtable): whatever a library put there at run time would be
    reached past this list (Triton's interpreter once copied `inspect` and `np` into a kernel's module).
A refusal names the line and the name. Not covered: what allowed calls do at run time (how much torch work
a candidate issues, which aten ops run): the worker's audit sees every call (harness/stages/common.py).
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import symtable
from dataclasses import dataclass, field

DUNDER = re.compile(r"^__\w+__$")
HARMLESS_STRINGS = {"__main__"}        # `if __name__ == "__main__":` grants nothing
NAMED_ATTR_BUILTINS = {"getattr", "setattr", "delattr", "hasattr"}
# Forbidden builtins that are also ordinary attribute names (`q.device.type`): forbidden as names only.
ATTRIBUTE_SAFE_BUILTINS = frozenset({"type", "dir", "help", "input", "exit", "quit", "memoryview"})
# Why a file may not set attributes or subclass: the trusted code reads outputs and inputs through their methods.
REPLACED_METHODS = ("an output or input whose methods were replaced, on the object or on a torch.Tensor subclass, would "
                    "show the checks other data than its memory holds")
# PTX's special registers of time and place: read in a kernel, they tell a kernel which calls are timed or checked
# (the host's clocks are not reachable; `globaltimer` and `smid`, Triton's own reads of them, are forbidden attributes).
CLOCK_REGISTERS = re.compile(r"%(globaltimer|clock|smid|nsmid|warpid|nwarpid|gridid|pm\d)")
ASM = "inline_asm_elementwise"
# Never after a dot either: a module's own `getattr` would take the computed names the builtin may not.
NAMED_ATTR_WORDS = frozenset({"getattr", "setattr", "delattr"})


class Refused(Exception):
    """The file names something outside the allowlist; the message names the line and the name."""

    def __init__(self, line: int, name: str, why: str) -> None:
        super().__init__(f"line {line}: {name}: {why}")
        self.line, self.name, self.why = line, name, why


@dataclass(frozen=True)
class Rules:
    names: dict[str, tuple[str, ...]]           # module -> what may be named in it ("*": any public name)
    builtins: frozenset[str] = frozenset()      # forbidden builtins
    attributes: frozenset[str] = frozenset()    # forbidden after a dot, on any object
    dunders: frozenset[str] = frozenset({"__name__"})   # dunder names and attributes that may be named

    @classmethod
    def of(cls, names: dict[str, list[str]], builtins: list[str], attributes: list[str],
           dunders: list[str] = ("__name__",)) -> "Rules":
        return cls({m: tuple(v) for m, v in names.items()}, frozenset(builtins), frozenset(attributes), frozenset(dunders))

    @classmethod
    def from_config(cls, c) -> "Rules":
        """From config `stages.compile` (harness.config.CompileConfig)."""
        return cls.of(c.allowed_names, c.forbidden_builtins, c.forbidden_attributes, c.readable_dunders)


@dataclass
class _Alias:
    path: str                 # the dotted path the name stands for: "torch", "triton.language", "torch.empty"
    module: bool              # a module (may be used only through its attributes) or a value


@dataclass
class _Checker:
    rules: Rules
    aliases: dict[str, _Alias] = field(default_factory=dict)
    parents: dict[int, ast.AST] = field(default_factory=dict)

    # -- imports --------------------------------------------------------------------------------------
    def modules(self) -> str:
        return ", ".join(sorted(self.rules.names))

    def _bind(self, node: ast.AST, name: str, alias: _Alias) -> None:
        known = self.aliases.get(name)
        if known is not None and known.path != alias.path:
            raise Refused(node.lineno, name, f"imported as both {known.path} and {alias.path}")
        self.aliases[name] = alias

    def imports(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name not in self.rules.names:
                        raise Refused(node.lineno, a.name, f"imports a module outside the allowlist ({self.modules()})")
                    if a.asname:
                        self._bind(node, a.asname, _Alias(a.name, True))
                    else:
                        root = a.name.split(".")[0]
                        if root not in self.rules.names:
                            raise Refused(node.lineno, root, f"imports a module outside the allowlist ({self.modules()})")
                        self._bind(node, root, _Alias(root, True))
            elif isinstance(node, ast.ImportFrom):
                if node.level or not node.module:
                    raise Refused(node.lineno, "." * node.level + (node.module or ""), "a relative import")
                if node.module not in self.rules.names:
                    raise Refused(node.lineno, node.module, f"imports a module outside the allowlist ({self.modules()})")
                if node.module == "__future__":                 # compiler directives: bind nothing to use
                    for a in node.names:
                        if a.name not in self.rules.names["__future__"]:
                            raise Refused(node.lineno, f"__future__.{a.name}", "not on __future__'s allowlist")
                    continue
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if a.name == "*":
                        raise Refused(node.lineno, full, "a star import (what it binds cannot be checked)")
                    if full in self.rules.names:
                        alias = _Alias(full, True)
                    else:
                        self.check_path(node.lineno, full)
                        alias = _Alias(full, False)
                    self._bind(node, a.asname or a.name, alias)

    # -- paths under a module ---------------------------------------------------------------------------
    def check_path(self, line: int, full: str) -> None:
        """A dotted path rooted at a module: allowed by its module's list, the rest not forbidden."""
        parts = full.split(".")
        for p in parts:
            self.check_word(line, full, p)
        module = max((m for m in self.rules.names if full.startswith(m + ".")), key=len, default=None)
        if module is None:
            raise Refused(line, full, "a module used as a value (name what you use in it)")
        rest = parts[len(module.split(".")):]
        allowed = self.rules.names[module]
        if "*" in allowed:
            beyond, named = rest[1:], []
        else:
            entry = next((e.split(".") for e in allowed if rest[:len(e.split("."))] == e.split(".")), None)
            if entry is None:
                raise Refused(line, full, f"not on {module}'s allowlist (stages.compile.allowed_names.{module})")
            beyond, named = rest[len(entry):], entry
        for p in beyond:
            if p in self.rules.attributes or p in (self.rules.builtins - ATTRIBUTE_SAFE_BUILTINS) | NAMED_ATTR_WORDS:
                raise Refused(line, full, f".{p} is forbidden (stages.compile.forbidden_attributes)")
        self.check_homes(line, full, module, named, rest[len(named):])

    def check_homes(self, line: int, full: str, module: str, named: list[str], unlisted: list[str]) -> None:
        """Follow the chain on the real modules (trusted: nothing of the candidate's runs) and refuse an
        attribute the allowlist did not name that lives outside the allowlisted packages: a wildcard module's
        own imports (`typing.sys`, `triton.language.core.inspect`) would otherwise be reachable through it."""
        try:
            obj = importlib.import_module(module)
            for p in named:
                obj = getattr(obj, p)
        except Exception:                                   # noqa: BLE001 - what cannot be followed here
            return                                          # cannot be reached there either
        if not unlisted and inspect.ismodule(obj) and named:
            raise Refused(line, full, f"the module {obj.__name__} used as a value (name what you use in it)")
        roots = {m.split(".")[0] for m in self.rules.names} | {"builtins"}
        for i, p in enumerate(unlisted):
            try:
                obj = getattr(obj, p) if not inspect.ismodule(obj) or hasattr(obj, p) else \
                    importlib.import_module(f"{obj.__name__}.{p}")       # a submodule not imported yet
            except Exception:                               # noqa: BLE001 - made at run time, or absent
                if inspect.ismodule(obj):                   # nothing there to follow, so nothing checked beyond it
                    raise Refused(line, full, f".{p} is not in {obj.__name__}") from None
                return
            if inspect.ismodule(obj) and (i == len(unlisted) - 1 or not (
                    obj.__name__ in self.rules.names or obj.__name__.startswith(module + "."))):
                # a module at the end of a chain (`c = tl.core`: bound to a name, what lies beyond it would
                # escape these checks), or one outside the listed module's own package (`tl.core.builtins`)
                raise Refused(line, full, f".{p} is the module {obj.__name__}: a module used as a value or "
                                          "outside the allowlist (name what you use in a listed module)")
            home = _home(obj)
            if home.split(".")[0] not in roots:
                raise Refused(line, full, f".{p} is {home}'s, outside the allowlisted modules")

    def check_word(self, line: int, shown: str, word: str) -> None:
        if word in self.rules.dunders:
            return
        if DUNDER.match(word):
            raise Refused(line, shown, "a dunder attribute")
        if word.startswith("_"):
            raise Refused(line, shown, "a private attribute")

    def check_attribute(self, line: int, shown: str, word: str) -> None:
        self.check_word(line, shown, word)
        if word in self.rules.attributes or word in (self.rules.builtins - ATTRIBUTE_SAFE_BUILTINS) | NAMED_ATTR_WORDS:
            raise Refused(line, shown, f".{word} is forbidden on any object (stages.compile.forbidden_attributes)")

    # -- the walk -------------------------------------------------------------------------------------
    def walk(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[id(child)] = node
        self.visit(tree, in_kernel=False)

    def visit(self, node: ast.AST, in_kernel: bool) -> None:
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if DUNDER.match(node.name):
                raise Refused(line, node.name, "defines a dunder (a hook into torch or Python's machinery)")
            if isinstance(node, ast.ClassDef) and (node.bases or node.keywords):
                raise Refused(line, node.name, f"a class with a base ({REPLACED_METHODS})")
            in_kernel = in_kernel or (bool(node.decorator_list) and all(self.is_jit(d) for d in node.decorator_list))
        elif isinstance(node, ast.Name):
            self.name(node)
        elif isinstance(node, ast.Attribute):
            self.attribute(node)
            spelled = {ast.Store: "setattr", ast.Del: "delattr"}.get(type(node.ctx))   # `x.a = v` is setattr(x, "a", v)
            if spelled in self.rules.builtins:
                raise Refused(line, f".{node.attr}", f"sets or deletes an attribute, {spelled} by another spelling "
                                                     f"(a forbidden builtin: {REPLACED_METHODS})")
        elif isinstance(node, ast.Call):
            self.call(node)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and DUNDER.match(node.value)
              and node.value not in HARMLESS_STRINGS):
            raise Refused(line, repr(node.value), "a dunder name as a string (how attributes are reached by name)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and CLOCK_REGISTERS.search(node.value):
            raise Refused(line, CLOCK_REGISTERS.search(node.value).group(0), "a GPU clock or place register (a kernel "
                          "that reads one can tell its timed or checked calls from the others)")
        elif (isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.MatMult) and not in_kernel
              and "matmul" in self.rules.attributes):          # a @ b is a.matmul(b)
            raise Refused(line, "@", "a library matmul on tensors outside a @triton.jit kernel (use tl.dot in one)")
        elif isinstance(node, ast.alias) and node.asname and DUNDER.match(node.asname):
            raise Refused(line, node.asname, "a dunder name")
        elif isinstance(node, ast.arg) and DUNDER.match(node.arg):
            raise Refused(line, node.arg, "a dunder name")
        bound = _bound_name(node)
        if bound in self.aliases and not self.set_to_a_constant(node):    # a use is read as the import, anywhere
            raise Refused(line, bound, f"binds the imported name to something else (it is checked as "
                                       f"{self.aliases[bound].path} wherever it appears)")
        for child in ast.iter_child_nodes(node):
            self.visit(child, in_kernel)

    def set_to_a_constant(self, node: ast.AST) -> bool:
        """`Name = None` for an imported value (`try: from m import X` / `except ImportError: X = None`): a
        constant has nothing of its own that checking the name as the import would miss."""
        parent = self.parents.get(id(node))
        return (isinstance(node, ast.Name) and not self.aliases[node.id].module and isinstance(parent, ast.Assign)
                and isinstance(parent.value, ast.Constant))

    def is_jit(self, deco: ast.AST) -> bool:
        target = deco.func if isinstance(deco, ast.Call) else deco
        path = self.path_of(target)
        return path in ("triton.jit", "triton.autotune", "triton.heuristics")

    def path_of(self, node: ast.AST) -> str | None:
        """The dotted path a Name/Attribute chain stands for, when its root is an imported name."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id].path] + attrs[::-1])
        return None

    def name(self, node: ast.Name) -> None:
        if node.id in self.rules.builtins:
            raise Refused(node.lineno, node.id, "a forbidden builtin (stages.compile.forbidden_builtins)")
        if DUNDER.match(node.id) and not (node.id in self.rules.dunders and isinstance(node.ctx, ast.Load)):
            raise Refused(node.lineno, node.id, "a dunder name")
        if node.id in NAMED_ATTR_BUILTINS and isinstance(node.ctx, ast.Load):
            parent = self.parents.get(id(node))
            if not (isinstance(parent, ast.Call) and parent.func is node):     # `call` checks the name it is given
                raise Refused(node.lineno, node.id, "used as a value (only called, with a constant attribute name): "
                                                    "passed on, it would take computed names")
        alias = self.aliases.get(node.id)
        if alias is not None and alias.path.endswith("." + ASM) and isinstance(node.ctx, ast.Load):
            self.asm_used(node)
        if alias is not None and alias.module and isinstance(node.ctx, ast.Load):
            parent = self.parents.get(id(node))
            if not (isinstance(parent, ast.Attribute) and parent.value is node):
                raise Refused(node.lineno, node.id, f"the module {alias.path} used as a value (name what you use in it)")

    def attribute(self, node: ast.Attribute) -> None:
        if node.attr == ASM:
            self.asm_used(node)
        parent = self.parents.get(id(node))
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return                                        # checked with the whole chain, at its end
        path = self.path_of(node)
        if path is not None:
            self.check_path(node.lineno, path)
            return
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        for word in reversed(chain):
            self.check_attribute(node.lineno, "." + ".".join(reversed(chain)), word)

    def asm_used(self, node: ast.AST) -> None:
        """Inline assembly only called, its text a literal (so no string built at run time reaches it unread)."""
        parent = self.parents.get(id(node))
        if not (isinstance(parent, ast.Call) and parent.func is node):
            raise Refused(node.lineno, ASM, "used as a value (only called, with its assembly as a literal string)")
        text = parent.args[0] if parent.args else next((k.value for k in parent.keywords if k.arg == "asm"), None)
        if not (isinstance(text, ast.Constant) and isinstance(text.value, str)):
            raise Refused(node.lineno, ASM, "with assembly that is not a literal string")

    def call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in NAMED_ATTR_BUILTINS:
            if len(node.args) < 2 or not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                raise Refused(node.lineno, node.func.id, "with a computed attribute name (only a constant string)")
            self.check_attribute(node.lineno, f"{node.func.id}(..., {node.args[1].value!r})", node.args[1].value)


def _bound_name(node: ast.AST) -> str | None:
    """The name a node binds, where it binds one: an assignment's or a loop's target, a parameter, a def or class,
    an `except ... as`, a match capture (an import's alias is bound by `imports`)."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return node.id
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler, ast.MatchAs,
                         ast.MatchStar)):
        return node.name
    if isinstance(node, ast.MatchMapping):
        return node.rest
    return None


def _home(obj) -> str:
    """The module an object belongs to: a module's own name, a function's or class's __module__, else its type's."""
    if inspect.ismodule(obj):
        return obj.__name__
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
        home = getattr(obj, "__module__", None)
        if isinstance(home, str):
            return home
    return type(obj).__module__


def unbound_names(tree: ast.Module) -> set[str]:
    """The names `tree` reads from its module's namespace (at module level, or as globals in a function or class)
    that no statement of it binds there (an assignment, a def, an import, a `global` assignment anywhere)."""
    bound, read, tables = set(), set(), [symtable.symtable(ast.unparse(tree), "<candidate>", "exec")]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for sym in table.get_symbols():
            if table.get_type() == "module" or sym.is_global():
                if sym.is_assigned() or sym.is_imported():
                    bound.add(sym.get_name())
                if sym.is_referenced():
                    read.add(sym.get_name())
    return read - bound


def check(tree: ast.Module, rules: Rules) -> None:
    """Raise Refused for the first thing `tree` names outside `rules`."""
    checker = _Checker(rules)
    checker.imports(tree)
    checker.walk(tree)
    unbound = unbound_names(tree) - set(dir(builtins)) - rules.dunders
    if unbound:
        first = min((n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in unbound),
                    key=lambda n: (n.lineno, n.col_offset))
        raise Refused(first.lineno, first.id, "a name the file never binds and no builtin (what a library puts in "
                                              "the module at run time is not the allowlist's to give)")
