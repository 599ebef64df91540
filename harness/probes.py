"""Instruments installed inside a worker: which Triton kernels launch, which torch ops run.

`Probes` counts every Triton launch by kernel name (JIT, interpreted and precompiled launches) and every JIT
compile (`compiles`: a specialization met for the first time in the process), can
skip them all ("ablate": is the kernel what produces the output?), can turn them into compiles only
("compiling": each JIT kernel is compiled for the call's specialization, every config of an autotuned
one, in a thread pool through Triton's AsyncCompileMode, and nothing is launched), and audits the aten ops a candidate
issues with a TorchDispatchMode: every op by name (`op_calls`) and the elements each touched (`op_elements`: what it
produced, or its largest tensor argument where that is larger, so that a reduction counts what it read), inside
Triton launches too (a launch runs candidate code: a callable grid, a hook, a global's comparison). The worker
applies the audit to every call it makes for the candidate, in every stage. Runs in the untrusted
process: the compile stage's allowlist leaves a candidate no name to detect or switch off the audit with
(torch.utils, torch._C, private attributes); the trusted comparisons and clocks in the stages are what
holds if it is subverted anyway. `used` keeps each compiled kernel launched since the last `reset`, for
`resources`: its registers and spills a thread, shared memory and warps, as the driver loaded it (figures
the stages only report, never judge by).
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Probes:
    def __init__(self) -> None:
        self.launches: Counter[str] = Counter()
        self.op_elements: Counter[str] = Counter()
        self.op_calls: Counter[str] = Counter()
        self.compiles = 0
        self.used: dict[int, object] = {}       # id -> CompiledKernel launched since the last reset
        self.ablate = False
        self.compile_only = False

    def reset(self) -> None:
        self.launches.clear()
        self.op_elements.clear()
        self.op_calls.clear()
        self.compiles = 0
        self.used.clear()

    def install(self) -> None:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit
        self._wrap(jit.JITFunction, "run", lambda fn, a, kw: kw.get("warmup", False), compiles=True)
        self._wrap(interp.InterpretedFunction, "run", lambda fn, a, kw: kw.get("warmup", False))
        self._wrap_autotuner()
        original_compile, probes = jit.JITFunction._do_compile, self

        def do_compile(fn, *args, **kwargs):
            probes.compiles += 1
            return original_compile(fn, *args, **kwargs)
        jit.JITFunction._do_compile = do_compile
        try:
            from triton.compiler.compiler import CompiledKernel
        except ImportError:                                          # pragma: no cover - other triton
            return
        original_getitem = CompiledKernel.__getitem__

        def getitem(kernel, grid):
            runner = original_getitem(kernel, grid)         # loads the binary: its registers are known from here
            probes.used.setdefault(id(kernel), kernel)

            def launch(*args, **kwargs):
                probes.launches[kernel.name] += 1
                if probes.ablate or probes.compile_only:
                    return None
                return runner(*args, **kwargs)
            return launch
        CompiledKernel.__getitem__ = getitem

    def _wrap(self, cls, attr: str, is_warmup, compiles: bool = False) -> None:
        original = getattr(cls, attr)
        probes = self

        def run(fn, *args, **kwargs):
            if is_warmup(fn, args, kwargs):
                return original(fn, *args, **kwargs)
            name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
            probes.launches[name] += 1
            if probes.ablate:
                return None
            if probes.compile_only:                  # compiled for this call's specialization, not launched
                if compiles:
                    original(fn, *args, **{**kwargs, "warmup": True})
                return None
            kernel = original(fn, *args, **kwargs)          # a JIT launch returns the compiled kernel it ran
            if hasattr(kernel, "metadata"):
                probes.used.setdefault(id(kernel), kernel)
            return kernel
        setattr(cls, attr, run)

    def resources(self, most: int = 32) -> list[dict]:
        """The compiled kernels launched since the last reset (at most `most`): name, registers and spilled 32-bit
        words a thread, static shared memory, warps; a kernel whose figures the driver did not give is left out."""
        out = []
        for kernel in list(self.used.values())[:most]:
            regs, spills, meta = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None), kernel.metadata
            if isinstance(regs, int) and isinstance(spills, int):
                out.append({"name": str(kernel.name)[:256], "registers": regs, "spills": spills,
                            "shared_bytes": int(meta.shared), "warps": int(meta.num_warps)})
        return out

    def _wrap_autotuner(self) -> None:
        """While compiling only, an autotuned kernel compiles every config it would time (its `warmup`), and
        neither times nor picks one: its choice is left for a call that runs."""
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit
        from triton.runtime.autotuner import Autotuner
        original = Autotuner.run
        probes = self

        def run(tuner, *args, **kwargs):
            if not probes.compile_only:
                return original(tuner, *args, **kwargs)
            inner = tuner.fn
            while not isinstance(inner, (jit.JITFunction, interp.InterpretedFunction)) and hasattr(inner, "fn"):
                inner = inner.fn                     # through heuristics to the kernel
            probes.launches[getattr(inner, "__name__", "?")] += 1
            if isinstance(inner, jit.JITFunction):   # the interpreter compiles nothing
                kwargs.pop("warmup", None)
                tuner.warmup(*args, **kwargs)
            return None
        Autotuner.run = run

    @contextlib.contextmanager
    def compiling(self, threads: int):
        """Calls made inside launch nothing: their Triton kernels are compiled, `threads` compiles at once,
        and the exit waits for all of them. A compile that fails is left for a call that runs to report."""
        from concurrent.futures import ThreadPoolExecutor
        try:
            from triton.runtime._async_compile import AsyncCompileMode
        except ImportError:                                          # pragma: no cover - other triton
            AsyncCompileMode = None
        self.compile_only = True
        try:
            with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="kevo-compile") as pool:
                if AsyncCompileMode is None:
                    yield
                else:
                    with AsyncCompileMode(pool, ignore_errors=True):
                        yield
        finally:
            self.compile_only = False

    @contextlib.contextmanager
    def ablated(self):
        self.ablate = True
        try:
            yield
        finally:
            self.ablate = False

    def audit(self) -> "_Audit":
        return _Audit(self)


class _Audit(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: torch leaves this mode's handler unwrapped by `torch._disable_dynamo`, whose first call imports
        torch._dynamo and torch._inductor (2 s on a CPU here, 3.3 s on the H200's host, once per zygote). The
        wrap only keeps a torch.compile trace out of the handler, and nothing in a worker traces: the allowlist
        gives a candidate no torch.compile. Every op is counted either way."""
        return False

    def __init__(self, probes: Probes) -> None:
        super().__init__()
        self.probes = probes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.probes.op_calls[name] += 1
        # Inside a Triton launch too: candidate code runs there (a callable grid, a global's __eq__ when the JIT
        # checks its globals, a tensor-like's data_ptr); the interpreter's own copies there are plumbing ops.
        # What it touched: its output, or its largest argument where that is larger (a reduction over a whole cache
        # produces a few elements and reads them all; an elementwise or broadcast op produces at least what it reads).
        produced = sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        read = max((t.numel() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), default=0)
        self.probes.op_elements[name] += max(produced, read)
        return out
