"""The compile stage's allowlist (harness/allowlist.py, config stages.compile): each way out of the
allowlisted surface is refused, naming the line and the name; every correct kernel of the project passes.
Pure AST checks against the project's own config: no worker runs here."""
from __future__ import annotations

import ast
import textwrap

import pytest
import yaml

import candidates as C
from conftest import ROOT, config_with
from harness.allowlist import Refused, Rules, check
from harness.config import DEFAULT_CONFIG, ConfigError, load_config

RULES = Rules.from_config(load_config().stages.compile)
HEAD = "import torch\nimport triton\nimport triton.language as tl\n"


def refusal(body: str) -> Refused:
    with pytest.raises(Refused) as err:
        check(ast.parse(HEAD + textwrap.dedent(body)), RULES)
    return err.value


@pytest.mark.parametrize("name, source", [
    ("decode reference", C.REF_DECODE), ("prefill reference", C.REF_PREFILL), ("reblocked", C.REBLOCKED),
    ("torch elementwise (refused later, at run time)", C.TORCH_ELEMENTWISE), ("pointer cache", C.POINTER_CACHE),
    ("writes inputs", C.WRITES_INPUTS), ("nondeterministic", C.NONDETERMINISTIC), ("wrong shape", C.WRONG_SHAPE),
    ("unwritten output", C.UNWRITTEN_OUTPUT), ("GPU hang", C.GPU_HANG_ON_BOUNDARY), ("GPU fault", C.GPU_FAULT_ON_BOUNDARY),
])
def test_every_correct_or_runtime_caught_kernel_of_the_project_passes_the_allowlist(name, source):
    check(ast.parse(source), RULES)


def test_every_knowledge_kernel_passes_the_allowlist():
    kernels = sorted((ROOT / "knowledge").rglob("*.py"))
    assert kernels
    for path in kernels:
        check(ast.parse(path.read_text()), RULES)


@pytest.mark.parametrize("body, line, name", [
    # imports, however spelled
    ("import torch.nn.functional as F\n", 4, "torch.nn.functional"),
    ("from torch import nn as x\n", 4, "torch.nn"),
    ("from torch.nn import functional\n", 4, "torch.nn"),
    ("import numpy\n", 4, "numpy"),
    ("import os.path\n", 4, "os.path"),
    ("from . import sibling\n", 4, "."),
    ("from math import *\n", 4, "math.*"),
    ("import importlib\n", 4, "importlib"),
    # torch beyond allocation, views, queries and small elementwise work
    ("y = torch.matmul\n", 4, "torch.matmul"),
    ("def f(a, b):\n    return torch.bmm(a, b)\n", 5, "torch.bmm"),
    ("y = torch.nn.functional.scaled_dot_product_attention\n", 4, "torch.nn.functional.scaled_dot_product_attention"),
    ("y = torch.ops.aten.mm\n", 4, "torch.ops.aten.mm"),
    ("y = torch._C\n", 4, "torch._C"),
    ("y = torch.backends.cuda.matmul\n", 4, "torch.backends.cuda.matmul"),
    ("y = torch.profiler.profile\n", 4, "torch.profiler.profile"),
    ("y = torch.autograd.grad\n", 4, "torch.autograd.grad"),
    ("y = torch.library.Library\n", 4, "torch.library.Library"),
    ("y = torch.utils._python_dispatch\n", 4, "torch.utils._python_dispatch"),
    ("torch.cuda.set_per_process_memory_fraction(1.0)\n", 4, "torch.cuda.set_per_process_memory_fraction"),
    ("t = torch.cuda.Event.elapsed_time\n", 4, "torch.cuda.Event.elapsed_time"),
    ("y = torch.einsum\n", 4, "torch.einsum"),
    ("y = torch.Tensor.matmul\n", 4, "torch.Tensor.matmul"),
    ("y = triton.runtime.driver\n", 4, "triton.runtime.driver"),
    # Gluon: its device language and descriptor, not its other host surface or modules as values
    ("import triton.experimental.gluon as g\nf = g.constexpr_function\n", 5,
     "triton.experimental.gluon.constexpr_function"),
    ("from triton.experimental import gluon\n", 4, "triton.experimental"),
    ("from triton.experimental.gluon import language as gl\nm = gl.nvidia.blackwell\n", 5,
     "triton.experimental.gluon.language.nvidia.blackwell"),
    ("from triton.experimental.gluon import language as gl\nm = gl.amd\n", 5, "triton.experimental.gluon.language.amd"),
    ("import triton.experimental.gluon._runtime\n", 4, "triton.experimental.gluon._runtime"),
    ("triton.knobs.runtime.launch_enter_hook = print\n", 4, "triton.knobs.runtime.launch_enter_hook"),
    # the same reached through aliases
    ("import torch as t\ny = t.nn.functional.softmax\n", 5, "torch.nn.functional.softmax"),
    ("from torch import cuda as c\n", 4, "torch.cuda"),
    ("F = torch.nn.functional\n", 4, "torch.nn.functional"),
    ("f = torch.matmul\n", 4, "torch.matmul"),
    ("t = torch\n", 4, "torch"),
    ("mods = [torch]\n", 4, "torch"),
    ("def f(m=torch):\n    return m\n", 4, "torch"),
    ("x = tl\n", 4, "tl"),
    # library compute as tensor methods, on anything
    ("def f(a, b):\n    return a.matmul(b)\n", 5, ".matmul"),
    ("def f(a):\n    return a.softmax(-1)\n", 5, ".softmax"),
    ("def f(a, b):\n    return a.baddbmm_(a, b)\n", 5, ".baddbmm_"),
    ("def f(a, b):\n    return a @ b\n", 5, "@"),
    ("def f(a, b):\n    a @= b\n", 5, "@"),
    ("def f(a):\n    return a.numpy()\n", 5, ".numpy"),
    ("def f(a):\n    return [a][0].nn\n", 5, ".nn"),
    # builtins that import, run strings, open files or reach namespaces
    ("np = __import__('numpy')\n", 4, "__import__"),
    ("eval('1')\n", 4, "eval"),
    ("exec('x = 1')\n", 4, "exec"),
    ("c = compile('1', 'f', 'eval')\n", 4, "compile"),
    ("data = open('/etc/passwd').read()\n", 4, "open"),
    ("g = globals()\n", 4, "globals"),
    ("v = vars()\n", 4, "vars"),
    ("l = locals()\n", 4, "locals"),
    ("breakpoint()\n", 4, "breakpoint"),
    ("s = input()\n", 4, "input"),
    ("k = type(1)\n", 4, "type"),
    # names built or reached by strings, dunders, privates, frames
    ("def f(a, n):\n    return getattr(a, n)\n", 5, "getattr"),
    ("def f(a):\n    return getattr(a, 'mat' + 'mul')\n", 5, "getattr"),
    ("def f(a):\n    return getattr(a, 'matmul')\n", 5, "getattr(..., 'matmul')"),
    ("def f(a):\n    setattr(a, '__class__', a)\n", 5, "setattr(..., '__class__')"),
    # an object's methods replaced, on it or on a subclass (the trusted code reads outputs and inputs through them)
    ("def f(out, g):\n    out.detach = g\n", 5, ".detach"),
    ("def f(bt, w):\n    bt.set_(w)\n", 5, ".set_"),                     # an input's shape swapped under the baseline
    ("def f(q):\n    return q.storage().size()\n", 5, ".storage"),    # parity's buffers told from serving's by their size
    ("def f(out):\n    del out.clone\n", 5, ".clone"),
    ("def f(a, g):\n    setattr(a, 'contiguous', g)\n", 5, "setattr"),
    ("def f(a):\n    delattr(a, 'contiguous')\n", 5, "delattr"),
    ("class Lazy(torch.Tensor):\n    pass\n", 4, "Lazy"),
    ("class Quiet(metaclass=print):\n    pass\n", 4, "Quiet"),
    ("def f(a):\n    return hasattr(a, n)\n", 5, "hasattr"),
    ("def f(a):\n    return a.__class__\n", 5, ".__class__"),
    ("def f(a):\n    return a.__class__.__mro__\n", 5, ".__class__.__mro__"),
    ("b = __builtins__\n", 4, "__builtins__"),
    ("d = {'__torch_function__': print}\n", 4, "'__torch_function__'"),
    ("def __torch_function__(*a):\n    pass\n", 4, "__torch_function__"),
    ("class T:\n    def __torch_dispatch__(self):\n        pass\n", 5, "__torch_dispatch__"),
    ("def f(a):\n    return a._base\n", 5, "._base"),
    ("def f():\n    return (x for x in []).gi_frame.f_back.f_globals\n", 5, ".gi_frame.f_back.f_globals"),
    ("def f(g):\n    return g.f_globals\n", 5, ".f_globals"),
    ("def f(e):\n    return '{0.x}'.format(e)\n", 5, ".format"),
], ids=lambda v: v if isinstance(v, str) and "\n" not in v else None)
def test_a_name_outside_the_allowlist_is_refused_naming_its_line_and_the_name(body, line, name):
    err = refusal(body)
    assert (err.line, err.name) == (line, name), str(err)
    assert str(err).startswith(f"line {line}: {name}: ")


def test_allowed_surface_with_aliases_passes():
    check(ast.parse(HEAD + textwrap.dedent("""
        import torch as t
        from triton import language as lang
        from torch import empty as e, float32
        import math
        from functools import lru_cache
        from __future__ import annotations

        @triton.jit
        def _k(x_ptr, BLOCK: lang.constexpr):
            offs = lang.arange(0, BLOCK)
            a = lang.load(x_ptr + offs)
            lang.store(x_ptr + offs, lang.dot(a, a) if False else a @ a)

        @lru_cache(None)
        def sms(device):
            return t.cuda.get_device_properties(device).multi_processor_count

        def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
            out = e(q.shape, dtype=float32, device=q.device)
            scale = float(sm_scale) * math.log2(math.e)
            n = getattr(t.cuda.get_device_properties(0), "shared_memory_per_block_optin", 0)
            _k[(triton.cdiv(q.numel(), 16),)](out, BLOCK=16)
            if __name__ == "__main__":
                pass
            return out.view(q.shape).to(q.dtype)
    """)), RULES)


def test_the_allowlist_lives_in_the_config_and_a_widened_one_admits_more():
    wide = config_with(**{"stages.compile.allowed_names": {"torch": ["*"]}}).stages.compile
    check(ast.parse("import torch\ny = torch.einsum\n"), Rules.from_config(wide))


@pytest.mark.parametrize("names, words", [
    ({"torch": []}, "an empty list"),
    ({"torch": ["*", "empty"]}, "list nothing beside it"),
    ({"torch": ["_C"]}, "not a dotted public name"),
    ({"torch": ["cuda.__dict__"]}, "not a dotted public name"),
    ({"os path": ["*"]}, "not a module name"),
], ids=["empty", "star-and-more", "private", "dunder", "bad-module"])
def test_a_malformed_allowlist_is_a_config_error_naming_the_key(tmp_path, names, words):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["stages"]["compile"]["allowed_names"] = names
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "stages.compile.allowed_names" in str(err.value) and words in str(err.value), str(err.value)


def test_name_may_be_read_as_a_name_or_an_attribute_and_nothing_else_dunder():
    check(ast.parse("def f(g):\n    return g.__name__ if __name__ != '__main__' else ''\n"), RULES)
    with pytest.raises(Refused, match="line 1: __name__: a dunder name"):
        check(ast.parse("__name__ = 'x'\n"), RULES)
    with pytest.raises(Refused, match="line 2: __import__: a dunder name"):
        check(ast.parse("def f():\n    return __import__('os')\n"), Rules.from_config(
            config_with(**{"stages.compile.forbidden_builtins": []}).stages.compile))


def test_a_readable_dunder_that_is_not_a_dunder_is_a_config_error(tmp_path):
    raw = yaml.safe_load(DEFAULT_CONFIG.read_text())
    raw["stages"]["compile"]["readable_dunders"] = ["name"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="stages.compile.readable_dunders"):
        load_config(path)


@pytest.mark.parametrize("body, line, name", [
    ("y = tl.core.inspect.getmembers\n", 4, "triton.language.core.inspect.getmembers"),
    ("y = tl.core.contextmanager\n", 4, "triton.language.core.contextmanager"),
    ("import math\ny = math.pi.hex\n", 5, None),
], ids=["tl-core-inspect", "tl-core-contextlib", "math-constant-method"])
def test_a_wildcard_module_s_own_imports_are_not_reachable_through_it(body, line, name):
    if name is None:                                   # a builtin value's method: builtins, allowed
        check(ast.parse(HEAD + body), RULES)
        return
    err = refusal(body)
    assert (err.line, err.name) == (line, name), str(err)
    assert "outside the allowlist" in err.why, str(err)


def test_typing_is_listed_name_by_name():
    for body in ("import typing\ny = typing.get_type_hints\n", "import typing\ny = typing.sys\n"):
        with pytest.raises(Refused, match="not on typing's allowlist"):
            check(ast.parse(body), RULES)


# The review of 2026-12-01 reached Python itself through each of these, past the allowlist as it stood then
# (the first two end to end in a real worker: `os.popen("id")` and torch SDPA through `eval`).
@pytest.mark.parametrize("body, words", [
    ("x = tl.core.builtins.eval('1')\n", "builtins"),                     # through a wildcard module's submodule
    ("c = tl.core\nc.inspect.os.popen('id')\n", "triton.language.core"),                # a module bound to a name
    ("(c := tl.core).inspect.os\n", "triton.language.core"),                            # ... by a walrus
    ("def f(c=tl.core):\n    return c.inspect.os\n", "triton.language.core"),           # ... as a default argument
    ("y = [tl.core][0].inspect.os\n", "triton.language.core"),                          # ... in a list
    ("y = getattr(tl.core, 'inspect').os\n", "triton.language.core"),                   # ... through getattr
    ("e = tl.extra\n", "triton.language.extra"),                          # a submodule, as a value
    ("f = tl.core.getattr\n", ".getattr"),                                # a module's getattr, by any name
    ("L = triton.language\nL.core\n", "triton.language"),                 # a listed module, as a value
    ("def k(x):\n    pass\ny = k.get_capture_scope()\n", ".get_capture_scope"),   # a kernel's globals
    ("def k(x):\n    pass\nz = k.used_global_vals\n", ".used_global_vals"),
    ("def k(x):\n    pass\nz = k.fn\n", ".fn"),
    ("w = functools.reduce(getattr, ['_' + '_self__'], print)\n", "getattr: used as a value"),   # getattr passed on
    ("w = functools.partial(functools.reduce, getattr)\n", "getattr: used as a value"),
    ("g = getattr\n", "getattr: used as a value"),
    ("w = list(map(getattr, [q], ['shape']))\n", "getattr: used as a value"),
    ("w = {1: hasattr}[1]\n", "hasattr: used as a value"),
    ("def f(x, g=getattr):\n    pass\n", "getattr: used as a value"),
    ("@triton.jit\ndef k(p):\n    t = tl.extra.cuda.globaltimer()\n", ".globaltimer"),    # the GPU's clock in a kernel
    ("@triton.jit\ndef k(p):\n    t = tl.inline_asm_elementwise('mov.u64 $0, %clock64;', '=l', [], dtype=tl.int64, "
     "is_pure=False, pack=1)\n", "%clock"),
    ("A = 'mov.u64 $0, %glob' + 'altimer;'\n@triton.jit\ndef k(p):\n    t = tl.inline_asm_elementwise(A, '=l', [], "
     "dtype=tl.int64, is_pure=False, pack=1)\n", "assembly that is not a literal string"),
    ("f = tl.inline_asm_elementwise\n", "inline_asm_elementwise: used as a value"),
    ("x = q.eval\n", ".eval"),                                             # a forbidden builtin after a dot
    ("x = q.exec\n", ".exec"),
    ("keep = lambda f: f\n@keep\n@triton.jit\ndef mm(a, b):\n    return a @ b\n", "@"),   # not only Triton's decorators
])
def test_the_reviewed_ways_out_of_the_allowlist_are_refused(body, words):
    err = refusal(body)
    assert words in str(err), str(err)


def test_a_forbidden_builtin_that_is_also_an_attribute_name_stays_readable_as_an_attribute():
    check(ast.parse(HEAD + "def f(q):\n    return q.device.type == 'cuda'\n"), RULES)


def test_a_parse_that_met_the_interpreters_ast_depth_race_is_parsed_again_and_other_errors_are_not(monkeypatch):
    """CPython 3.11's `AST constructor recursion depth mismatch` (python/cpython#106905) comes from another
    thread's AST work, not from the source: `parse` parses again. `ast.parse` is the standard library's, faked
    here to fail as the race makes it fail."""
    from harness import syntax
    real, failures = ast.parse, []

    def racing(source, filename="<unknown>", *args, **kwargs):      # only the test's own file: pytest parses too
        if filename == "k.py" and len(failures) < 2:
            failures.append(filename)
            raise SystemError("AST constructor recursion depth mismatch (before=57, after=66)")
        return real(source, filename, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", racing)
    assert isinstance(syntax.parse("x = 1\n", "k.py"), ast.Module) and failures == ["k.py", "k.py"]

    def broken(source, filename="<unknown>", *args, **kwargs):
        if filename == "other.py":
            raise SystemError("some other interpreter error")
        return real(source, filename, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", broken)
    with pytest.raises(SystemError, match="some other"):
        syntax.parse("x = 1\n", "other.py")


@pytest.mark.parametrize("body, line, name", [
    ("import math\ndef gen():\n    yield 1\ndef frame_of(math):\n    return math.gi_frame\n", 7, "math"),  # a parameter
    ("f = lambda tl: tl.zeros\n", 4, "tl"),
    ("try:\n    pass\nexcept Exception as tl:\n    pass\n", 6, "tl"),
    ("from triton import jit\nimport functools\njit = functools.lru_cache\n", 6, "jit"),
    ("tl = None\n", 4, "tl"),                                  # a module's name, even to a constant
    ("for torch in [1]:\n    pass\n", 4, "torch"),
    ("y = [0 for torch in range(2)]\n", 4, "torch"),
    ("def triton():\n    pass\n", 4, "triton"),
    ("del torch\n", 4, "torch"),
    ("y = (tl := 3)\n", 4, "tl"),
], ids=["parameter", "lambda", "except-as", "assigned", "module-to-constant", "for", "comprehension", "def", "del",
        "walrus"])
def test_an_imported_name_bound_to_anything_else_is_refused(body, line, name):
    """The check reads an imported name as the import wherever it appears: `math.gi_frame` with `math` a
    parameter was checked as the math module's (nothing there, so nothing refused) and ran on a generator
    (an attacker's review, 2026-12-08: a frame's builtins, then any module)."""
    err = refusal(body)
    assert (err.line, err.name) == (line, name), str(err)
    assert "binds the imported name to something else" in err.why


def test_an_imported_value_may_be_set_to_a_constant_where_its_import_fails():
    check(ast.parse(HEAD + "try:\n    from triton.tools.tensor_descriptor import TensorDescriptor\n"
                           "except ImportError:\n    TensorDescriptor = None\n"), RULES)


def test_a_name_a_wildcard_module_does_not_have_is_refused():
    err = refusal("import math\ny = math.nothing_here.hex\n")
    assert (err.line, err.name) == (5, "math.nothing_here.hex") and ".nothing_here is not in math" in err.why


@pytest.mark.parametrize("body, word", [
    ("def f(s):\n    return s.semantic.TritonSemantic\n", ".semantic"),
    ("def f(s):\n    return s.lang.inspect\n", ".lang"),
])
def test_a_class_attribute_holding_a_module_is_refused_from_a_name_of_the_candidates_own(body, word):
    """TritonSemantic.lang is triton.language, whose inspect leads to os: from a local, only the words are checked."""
    err = refusal(body)
    assert f"{word} is forbidden" in err.why, str(err)
