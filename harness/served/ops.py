"""The served model's attention: a candidate's kernels where it has them, the baselines elsewhere.

`AttentionOps` holds the attention target's baselines (as config targets.attention chooses them: the
server passes the configured target) and, optionally, a candidate module, and the heads served beside it
(`other_heads`: the run's current kernel of each op the candidate is not about, so that the step served is the
one the run would ship). Each call goes to the candidate's function unless the candidate does not define
that op, or its optional module-level `supports(op, **shape) -> bool` declines the shape; then the
baseline runs and the call is counted as a fallback. An op the candidate does not define goes to its
head beside it if one is given (counted `other_head`; the head's own `supports` may decline a shape, and
then the baseline runs), else to the baseline. The counts, and the shapes served, are what the replay and the
profile read. The candidate's outputs are checked for shape, dtype and device here; their values
are judged by the replay's gates. With `probes` (harness/probes.py, installed in the served process) each
candidate call is also watched as the worker's stages watch every call: its Triton launches counted, and its
aten ops audited (`audits`) on every call of the warm-up and the graph captures (`audit_all`) and on a share
of the served calls drawn in secret (`audit_share`), since the served process must not be a place where a
candidate runs otherwise than where parity looked; and a share of its served calls is checked against the float64
reference (`spot`, harness/served/spot.py), those replayed from a CUDA graph too (`held`: what the capture made).
This module runs inside the served process, next to the candidate: it keeps the books, it does not judge (the
replay holds the books to the dispatch rules).

Under CUDA graphs (harness/served/graphs.py) the ops run only while a decode step is captured, on
the bucket's shapes: `supports()` then sees the bucket's batch and the width bucket's max_seq_len
(width x block_size), the baseline gets no host lengths (a baseline that needs them reads seq_lens,
which cannot be captured), and every replay adds the calls the capture made (`replayed`) with the
real lengths served.
"""
from __future__ import annotations

import itertools
import math
import random
import secrets
import time
from collections import Counter
from pathlib import Path
from types import ModuleType

import torch

from harness.served.shapes import ShapeRecorder
from harness.served.spot import SpotChecks
from harness.candidate import load_candidate as load, plain_output
from harness.targets.attention import TARGET
from harness.targets.base import Target


def load_candidate(path: Path | str, name: str = "candidate") -> ModuleType:
    """The candidate's module (harness/candidate.py, the one loader), refused like the worker refuses it:
    an op whose parameters are not the contract's. `name`: its module name (a head beside it gets its own)."""
    loaded = load(path, TARGET, name)
    if loaded.error:
        raise TypeError(f"the {'candidate' if name == 'candidate' else name.replace('_', ' ')} {loaded.error}")
    return loaded.module


class AttentionOps:
    def __init__(self, candidate: ModuleType | None = None, dtype: str = "float32", *, target: Target = TARGET,
                 stall_ms: float = math.inf, other_heads: dict[str, ModuleType] | None = None, probes=None,
                 audit_share: float = 0.0, spot: SpotChecks | None = None, gather_bound: int = 0) -> None:
        """`target`: the attention target with its configured baselines (harness.targets.configured); `stall_ms`:
        a candidate call that holds the host this long (config served.stall_ms; inf: none counted) compiled (a
        shape class the warm-up did not meet), autotuned, or waited on the GPU. A launch alone takes microseconds.
        `other_heads`: per op, the module of the head that serves it where the candidate does not define it.
        `spot`: the spot checks of its served calls (None: none). `gather_bound`: the most padded positions the torch
        baseline's decode may gather in one call (the graph plan's `max_padded_tokens`; 0: no bound)."""
        self.dtype, self.target, self.stall_ms = dtype, target, stall_ms
        self.impl = {op: getattr(candidate, op, None) if candidate else None for op in TARGET.ops}
        self.supports = getattr(candidate, "supports", None) if candidate else None
        self.other_heads = {op: (getattr(m, op), getattr(m, "supports", None)) for op, m in (other_heads or {}).items()
                       if op in TARGET.ops and self.impl[op] is None and callable(getattr(m, op, None))}
        self.host_lengths = True           # False while a CUDA graph is captured: host lengths are the bucket's
        self.probes, self.audit_share, self.audit_all = probes, audit_share, True   # audit_all: until served
        self.spot, self.gather_bound = spot, gather_bound
        self.held: list | None = None      # while a CUDA graph is captured: its candidate calls, for spot checks of replays
        self._draw = random.Random(secrets.randbits(64)).random   # which served calls are audited: no one can know
        self.audits = {op: {"audited": 0, "no_launch": 0, "audit_madds": 0.0, "op_calls": Counter(),
                            "op_elements": Counter()} for op in TARGET.ops}   # the server's whole life: never reset
        self.reset()

    def reset(self) -> None:
        self.calls: dict[str, Counter] = {op: Counter() for op in TARGET.ops}
        self.stalls: dict[str, list[float]] = {op: [] for op in TARGET.ops}     # ms, calls over stall_ms
        self.host: dict[str, list[float]] = {op: [0, 0.0] for op in TARGET.ops}   # the calls timed, their host ms
        self.shapes = ShapeRecorder()

    def _route(self, op: str, shape: dict):
        fn = self.impl[op]
        if fn is None and op in self.other_heads:
            head, supports = self.other_heads[op]
            if supports is None or supports(op, **shape):
                self.calls[op]["other_head"] += 1
                return head
        if fn is None:
            self.calls[op]["not_implemented"] += 1
            return self.target.ops[op].baseline
        if self.supports is not None and not self.supports(op, **shape):
            self.calls[op]["unsupported"] += 1
            return self.target.ops[op].baseline
        self.calls[op]["candidate"] += 1
        return fn

    def _timed(self, op: str, madds: float, lens: list[int], fn, *args):
        probes = self.probes
        pending = self.spot.before(op, args, lens) if self.spot is not None and not self.audit_all else None
        watch = probes is not None and (self.audit_all or self._draw() < self.audit_share)
        launched = probes.launches.total() if probes is not None else 0
        if watch:
            calls, elements = Counter(probes.op_calls), Counter(probes.op_elements)
        t = time.perf_counter()
        if watch:
            with probes.audit():
                out = fn(*args)
        else:
            out = fn(*args)
        ms = (time.perf_counter() - t) * 1e3
        if ms > self.stall_ms:
            self.stalls[op].append(ms)
        self.host[op][0] += 1
        self.host[op][1] += ms
        if probes is not None:
            books = self.audits[op]
            books["no_launch"] += probes.launches.total() == launched
            if watch:
                books["audited"] += 1
                books["audit_madds"] += madds
                books["op_calls"].update(probes.op_calls - calls)
                books["op_elements"].update(probes.op_elements - elements)
        out = self._checked(op, out, args[0])
        if pending is not None:
            self.spot.after(op, pending, out)
        elif self.held is not None and self.spot is not None:
            self.spot.hold(self.held, args, out)
        return out

    @staticmethod
    def _checked(op: str, out, q: torch.Tensor) -> torch.Tensor:
        out = plain_output(out, f"the candidate's {op}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            got = f"{list(out.shape)} {out.dtype} on {out.device}"
            raise TypeError(f"the candidate's {op} returned {got}; expected {list(q.shape)} {q.dtype} on {q.device}")
        return out

    def decode(self, q, k_cache, v_cache, block_table, seq_lens, sm_scale, lens: list[int]) -> torch.Tensor:
        B, H, D = q.shape
        shape = {"batch": B, "q_heads": H, "kv_heads": k_cache.shape[2], "head_dim": D,
                 "block_size": k_cache.shape[1], "max_seq_len": max(lens), "dtype": self.dtype}
        self.shapes.record("decode", lens)
        fn = self._route("decode", shape)
        if fn is self.target.ops["decode"].baseline:           # the engine's host-side lengths: no device read
            return self._baseline_decode(fn, q, k_cache, v_cache, block_table, seq_lens, sm_scale, lens)
        if fn is not self.impl["decode"]:                      # the head beside the candidate: not its stalls
            return self._checked("decode", fn(q, k_cache, v_cache, block_table, seq_lens, sm_scale), q)
        madds = 2.0 * sum(lens) * H * D     # the target's cost model (decode_cost), from host lengths: no device read
        return self._timed("decode", madds, lens, fn, q, k_cache, v_cache, block_table, seq_lens, sm_scale)

    def _baseline_decode(self, fn, q, k_cache, v_cache, block_table, seq_lens, sm_scale, lens: list[int]) -> torch.Tensor:
        """The torch baseline's decode in as many chunks of rows as keep each call's gather (rows x the table's width x
        the block size) within `gather_bound`, each chunk's table cut to its own widest row: an eager step the graphs
        do not cover (a key left out for memory) then needs no more than the largest key captured. One call where it
        fits, as under every capture (the keys captured are within the bound)."""
        B, W = block_table.shape
        bs = k_cache.shape[1]
        rows = max(1, self.gather_bound // (W * bs)) if self.gather_bound and W else B
        if rows >= B or not self.host_lengths:
            return fn(q, k_cache, v_cache, block_table, seq_lens, sm_scale, lengths=lens if self.host_lengths else None)
        out = torch.empty_like(q)
        for i in range(0, B, rows):
            j = min(B, i + rows)
            w = -(-max(lens[i:j]) // bs)
            out[i:j] = fn(q[i:j], k_cache, v_cache, block_table[i:j, :w], seq_lens[i:j], sm_scale, lengths=lens[i:j])
        return out

    def prefill(self, q, k, v, cu_seqlens, max_seqlen, sm_scale, lens: list[int]) -> torch.Tensor:
        T, H, D = q.shape
        shape = {"batch": len(lens), "q_heads": H, "kv_heads": k.shape[1], "head_dim": D,
                 "total_tokens": T, "max_seqlen": max_seqlen, "dtype": self.dtype}
        self.shapes.record("prefill", lens)
        fn = self._route("prefill", shape)
        if fn is self.target.ops["prefill"].baseline:
            return fn(q, k, v, cu_seqlens, max_seqlen, sm_scale, bounds=[0, *itertools.accumulate(lens)])
        if fn is not self.impl["prefill"]:
            return self._checked("prefill", fn(q, k, v, cu_seqlens, max_seqlen, sm_scale), q)
        madds = 2.0 * sum(n * (n + 1) / 2 for n in lens) * H * D     # as prefill_cost counts them, from host lengths
        return self._timed("prefill", madds, lens, fn, q, k, v, cu_seqlens, max_seqlen, sm_scale)

    def replayed(self, calls: dict[str, Counter], lens: list[int], held: list = (), bucket: int = 0) -> None:
        """A CUDA graph replay: the calls per op its capture made, on the real lengths served; and the candidate's
        decode calls its capture held (`held`), spot-checked at the share on what the replay left in them."""
        for op, c in calls.items():
            self.calls[op].update(c)
            if c.total():
                self.shapes.record(op, lens, c.total())
        if self.spot is not None and held:
            self.spot.replayed(held, lens, bucket)

    def stats(self) -> dict:
        """Per op: calls, how many the candidate served, fell back (declined shapes), or were never the
        candidate's (ops it does not define: `other_head` of them its head's, the rest the baseline's); and the
        candidate's calls that held the host over stall_ms (how many, their total and the worst, in ms)."""
        out, spot = {}, self.spot.results() if self.spot is not None else {}
        for op, c in self.calls.items():
            st = self.stalls[op]
            out[op] = {"calls": sum(c.values()), "candidate": c["candidate"], "unsupported": c["unsupported"],
                       "not_implemented": c["not_implemented"], "other_head": c["other_head"], "implemented": self.impl[op] is not None,
                       "stalls": len(st), "stall_ms": sum(st), "worst_stall_ms": max(st, default=0.0),
                       "host_calls": int(self.host[op][0]), "host_ms": self.host[op][1],
                       **{k: dict(v) if isinstance(v, Counter) else v for k, v in self.audits[op].items()},
                       **spot.get(op, {})}
        return out
