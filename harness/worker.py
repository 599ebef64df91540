"""The candidate's side: load one candidate file and run what the evaluator asks, nothing else.

Runs inside the sandboxed worker process (harness/zygote.py makes it). Each request names inputs
in an arena file; the worker copies them into persistent device buffers (the same addresses every
check, so a cache keyed by pointer is caught), poisons the allocator, calls the candidate, and hands
outputs back in sealed memory files sent with the reply (harness/transport.py). It decides nothing:
the evaluator compares, clocks and judges. Replies are JSON. The candidate's source arrives in a
message and is written here, into the worker's own folder, before it is imported. The timing
requests microbench sends (`prime`, `time`, `burst`) are harness/worker_timing.py.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from harness import compiled
from harness.candidate import load_candidate, plain_output
from harness.probes import Probes
from harness.targets import TARGETS
from harness.targets.base import UNFILLED
from harness.transport import DTYPES, recv_pickle, sealed, send_json, trim, write_arena
from harness.worker_timing import burst, prime, timed


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view that compares bit for bit (NaN == NaN)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()]) if t.is_floating_point() else t


class Worker:
    def __init__(self, workdir: Path, target: str, device: str, log_limit: int) -> None:
        self.workdir, self.target, self.device, self.log_limit = workdir, TARGETS[target], torch.device(device), log_limit
        self.module: Any = None
        self.probes = Probes()
        self.probes.install()
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.pending: list[int] = []                 # output descriptors for the reply being built
        self.kept: dict[int, torch.Tensor] = {}          # outputs as returned, held for a later recheck (parity)
        self.timed_sets: dict[str, list[dict[str, Any]]] = {}
        self.graphs: dict[tuple[str, str], Any] = {}
        self.last_args: tuple[str, dict[str, Any]] = ("", {})   # the previous call's op and arguments (a step's)

    # -- helpers -------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _inputs(self, key: str, recipe: dict) -> dict[str, Any]:
        """Rebuild the evaluator's inputs from its recipe (case, distribution, seed) and copy them into
        persistent buffers keyed by (key, name, dtype) that only ever grow: the same addresses check
        after check, so an output cached by pointer comes back stale and is caught. Each keeps its layout: a
        view into a larger tensor (a cache handed as served, one layer's view) stays one, at its offset."""
        op = self.target.ops[recipe["case"].op]
        fresh = op.make_inputs(recipe["case"], recipe["dist"], recipe["seed"], self.device, DTYPES[recipe["dtype"]])
        args: dict[str, Any] = {}
        for name, t in fresh.items():
            if not isinstance(t, torch.Tensor):
                args[name] = t
                continue
            bkey, span = (key, name, t.dtype), t.untyped_storage().nbytes() // t.element_size()
            buf = self.buffers.get(bkey)
            if buf is None or buf.numel() < span:
                size = max(span * 3 // 2, 1)                # headroom: fewer moves as lengths vary
                buf = self.buffers[bkey] = torch.empty(size, dtype=t.dtype, device=self.device)
            view = buf.as_strided(t.shape, t.stride(), t.storage_offset())
            view.copy_(t)
            args[name] = view
        del fresh
        return args

    def _poison(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Leave NaN in the memory the next allocations of this size will get."""
        if dtype.is_floating_point:
            blocks = [torch.full(shape, float("nan"), dtype=dtype, device=self.device) for _ in range(3)]
            del blocks

    def _fn(self, impl: str, op: str, args: dict[str, Any] | None = None, baseline: str = ""):
        """`baseline`: the name of the torch way the evaluator runs (config targets.<name>; "": the op's own)."""
        if impl == "candidate":
            return getattr(self.module, op)
        if impl == "baseline":
            spec = self.target.ops[op].with_baseline(baseline) if baseline else self.target.ops[op]
            return spec.baseline if args is None else spec.prepared_baseline(args)
        raise ValueError(f"unknown implementation {impl!r}")

    def _watched(self, fn, op: str, args: dict[str, Any]) -> torch.Tensor:
        """A call of the candidate's, with its aten ops outside Triton launches counted (`Probes.audit`):
        every call made for the candidate is watched alike, so none is a safe moment for library compute."""
        with self.probes.audit():
            return self._call(fn, op, args)

    def _save(self, tensors: dict[str, torch.Tensor]) -> list[dict]:
        manifest, fd = write_arena(tensors, len(self.pending))
        self.pending.append(fd)
        return manifest

    def _call(self, fn, op: str, args: dict[str, Any]) -> torch.Tensor:
        spec = self.target.ops[op]
        out = plain_output(fn(*[args[n] for n in spec.arg_names]), op)
        if out.device.type != self.device.type:
            raise TypeError(f"{op} returned a tensor on {out.device}, expected {self.device.type}")
        return out

    # -- requests ------------------------------------------------------------------------------
    def source(self, msg: dict) -> dict:
        """Write the candidate's file into this worker's fresh folder (never over anything)."""
        fd = os.open(self.workdir / "candidate.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(msg["text"])
        return {"ok": True}

    def load(self, msg: dict) -> dict:
        if self.device.type == "cuda" and msg.get("gpu_memory_fraction"):
            # before the candidate's code runs: the rest of the GPU's memory stays the evaluator's
            torch.cuda.set_per_process_memory_fraction(float(msg["gpu_memory_fraction"]),
                                                       torch.cuda.current_device() if self.device.index is None else self.device.index)
        carried, refused = compiled.carry_in(msg.get("carried", []), str(self.workdir), int(msg.get("carry_bytes", 0)))
        loaded = load_candidate(Path(msg["path"]), self.target)
        self.module = loaded.module
        return {"ok": not loaded.error, "ops": list(loaded.ops), "error": loaded.error, "carried": carried,
                "carry_refused": refused}

    def pack(self, msg: dict) -> dict:
        """This worker's compiled kernels, packed for its source's next sandbox (harness/compiled.py), in one sealed
        memory file; `bytes` 0 when there is nothing to carry."""
        t0 = time.perf_counter()
        blob = compiled.carry_out(str(self.workdir), int(msg["limit"]))
        self.pending.append(sealed(len(blob), [(0, blob)] if blob else []))
        return {"ok": True, "bytes": len(blob), "seconds": {"pack": time.perf_counter() - t0}}

    def call(self, msg: dict) -> dict:
        op, mode, repeat = msg["op"], msg.get("mode", "run"), int(msg.get("repeat", 1))
        t0 = time.perf_counter()
        args = self._inputs(op, msg["inputs"])
        shared = self._step_shared(op, args) if msg.get("step") else []
        self.last_args = (op, args)
        pristine = {n: v.clone() for n, v in args.items() if isinstance(v, torch.Tensor)}
        held = {n: plain_output(args[n], n) for n in pristine}    # objects the candidate never holds: read after it
        out_shape = tuple(msg["out_shape"])
        self.probes.reset()
        outs: dict[str, torch.Tensor] = {}
        seconds = {"inputs_s": time.perf_counter() - t0}
        unlaunched = 0
        for i in range(repeat):
            t0, launched = time.perf_counter(), self.probes.launches.total()
            self._poison(out_shape, DTYPES[msg["inputs"]["dtype"]])
            if mode == "ablate":
                with self.probes.ablated():
                    out = self._watched(self._fn("candidate", op), op, args)
            elif msg.get("impl", "candidate") == "candidate":          # "audit" and "run" alike
                out = self._watched(self._fn("candidate", op), op, args)
            else:
                out = self._call(self._fn(msg["impl"], op, args), op, args)
            self._sync()
            unlaunched += self.probes.launches.total() == launched
            if i == 0:
                returned = out                        # the first call's memory, live: what a later recheck reads again
            outs[f"out{i}"] = out if repeat == 1 else out.clone()    # as it was: the next call may write the same memory
            seconds[f"call{i}_s"] = time.perf_counter() - t0
        for key in msg.get("recheck", ()):            # earlier outputs as they are now: no later call may change them
            if key in self.kept:
                outs[f"kept{key}"] = self.kept[key]
        for key in msg.get("drop", ()):
            self.kept.pop(key, None)
        if "keep" in msg:
            self.kept[msg["keep"]] = returned
        modified = [n for n, v in pristine.items() if not torch.equal(_bits(v), _bits(held[n]))]
        return {"ok": True, "outputs": self._save(outs), "launches": dict(self.probes.launches),
                "op_elements": dict(self.probes.op_elements), "op_calls": dict(self.probes.op_calls),
                "inputs_modified": modified, "unlaunched": unlaunched, "seconds": seconds, "step_shared": shared}

    def _step_shared(self, op: str, args: dict[str, Any]) -> list[str]:
        """The next layer of the previous call's step: the op's `step_shared` arguments replaced by the previous
        call's objects, as a served step hands each layer the same ones (their values are equal by the draw;
        any that is not is left as drawn). Returns the names replaced."""
        last_op, last = self.last_args
        same = [n for n in self.target.ops[op].step_shared
                if last_op == op and torch.equal(last[n], args[n])]
        args.update({n: last[n] for n in same})
        return same

    def warm(self, msg: dict) -> dict:
        """Compile the candidate's kernels for every call in `calls` (each a recipe: the shape classes parity
        will run) before any is checked: each call runs watched with nothing launched, on inputs whose payload is
        left unwritten (targets.base.UNFILLED: the recipe's shapes and host facts, nothing drawn), its kernels
        compiled `threads` at once (`Probes.compiling`), so the checks that follow find them compiled in this process.
        Its outputs are nobody's: dropped. A call that raises is counted, not reported: the check that runs it
        says why."""
        self.probes.reset()
        failed, t0, inputs_s = 0, time.perf_counter(), 0.0
        with self.probes.compiling(int(msg.get("threads", 1))):
            for recipe in msg["calls"]:
                op = recipe["case"].op
                t_in = time.perf_counter()
                args = self.target.ops[op].make_inputs(recipe["case"], UNFILLED, recipe["seed"], self.device,
                                                      DTYPES[recipe["dtype"]])   # nothing launched: no payload
                inputs_s += time.perf_counter() - t_in
                try:
                    self._watched(self._fn("candidate", op), op, args)
                except Exception as e:
                    if "CUDA" in str(e):            # the context is gone with it: reported as any call's
                        raise
                    failed += 1
                del args
            called = time.perf_counter() - t0
        self._sync()
        return {"ok": True, "launches": dict(self.probes.launches), "op_calls": dict(self.probes.op_calls),
                "failed": failed, "seconds": {"inputs_s": inputs_s, "calls_s": called - inputs_s,
                            "compiles_s": time.perf_counter() - t0 - called},
                "compiles": self.probes.compiles}

    def profile(self, msg: dict) -> dict:
        op = msg["op"]
        args = self._inputs(op, msg["inputs"])
        fn = self._fn("candidate", op)
        self.probes.reset()
        self._watched(fn, op, args)
        self._sync()
        with _profiler(self.device) as prof:
            for _ in range(int(msg.get("repeat", 3))):
                self._watched(fn, op, args)
            self._sync()
        kernels: dict[str, float] = {}
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
            if us and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
                kernels[e.key] = kernels.get(e.key, 0.0) + float(us)
        return {"ok": True, "kernels": kernels, "launches": dict(self.probes.launches), "op_calls": dict(self.probes.op_calls)}

    def ping(self, msg: dict) -> dict:
        return {"ok": True}

    def warmup(self, msg: dict) -> dict:
        """Pay the per-process start-up costs before any candidate is loaded: the CUDA context, the
        profiler's first start, cuBLAS. Touches nothing a candidate could later read. Its reply says when it
        ran (`span`, monotonic seconds: the pool's start-up breakdown). `profiler` false (the health check's
        worker, which runs no candidate): the CUDA context only."""
        t0 = time.monotonic()
        if self.device.type == "cuda":
            x = torch.randn(64, 64, device=self.device)
            if msg.get("profiler", True):
                with _profiler(self.device):
                    (x @ x).sum().item()
            torch.cuda.synchronize()
        return {"ok": True, "span": [t0, time.monotonic()]}


def _profiler(device: torch.device):
    """Kineto's CPU (and CUDA) profiler, as torch.profiler.profile makes it inside, without that wrapper: its
    start asks `hasattr(torch, "_inductor")`, which imports torch._inductor and torch._dynamo (3.3 s on the
    H200's host, in each process). The same events, the same `key_averages`."""
    from torch.autograd.profiler import profile
    return profile(use_cpu=True, use_device="cuda" if device.type == "cuda" else None, use_kineto=True)


def preload() -> None:
    """Run once in the zygote, before any fork: first-use costs that need no GPU (the dispatch-mode audit's, now
    milliseconds: torch.profiler's wrapper and a dispatch mode's default wrap would import torch._dynamo and
    torch._inductor, 2 s on a CPU here and 3.3 s on the H200's host, which `_profiler` and
    `_Audit._should_skip_dynamo` avoid). Fork-safe: CPU only."""
    import torch.autograd.profiler  # noqa: F401
    with Probes().audit():
        (torch.ones(4) * 2).sum()


def serve(sock: socket.socket, workdir: Path, target: str, device: str, log_limit: int) -> None:
    """Answer requests until the evaluator hangs up. A CUDA error ends the process after replying."""
    worker = Worker(workdir, target, device, log_limit)
    handlers = {"source": worker.source, "load": worker.load, "call": worker.call, "warm": worker.warm, "profile": worker.profile,
                "prime": lambda msg: prime(worker, msg), "time": lambda msg: timed(worker, msg),
                "burst": lambda msg: burst(worker, msg), "ping": worker.ping, "warmup": worker.warmup, "pack": worker.pack}
    while True:
        try:
            msg = recv_pickle(sock)
        except (EOFError, OSError):
            return
        try:
            reply = handlers[msg["cmd"]](msg)
        except BaseException as e:                                   # the candidate's failure, reported
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            cuda_error = "CUDA" in str(e)                              # the context is gone with it
            fatal = isinstance(e, (SystemExit, KeyboardInterrupt)) or cuda_error
            reply = {"ok": False, "error": trim(text, log_limit), "fatal": fatal, "cuda_error": cuda_error}
        fds, worker.pending = worker.pending, []
        try:
            send_json(sock, reply, fds if reply.get("ok") else [])
        finally:
            for fd in fds:
                os.close(fd)
        if reply.get("fatal"):
            return
