"""Spot checks: a secret share of a served candidate's calls held to parity's tolerance, in the served process.

The replay's gates judge tokens, and a served step reaches a token through a few of attention's rows: the last
layer's prefill rows but each sequence's last reach no logit, and an error within the bf16 gates passes them. So a
kernel that tells serving from parity (the objects a step's layers share, the call order) could be wrong where
only serving sends it. Here, on a share of the candidate's eager served calls drawn in secret (config
served.spot_share), before the call, one sequence is drawn and what the reference needs of it is copied: decode,
its query and its keys; prefill, ROWS query rows at a secret phase and its last, and its keys. After the call its
output rows are compared, as parity compares (harness/compare.py), with the float64 reference, the tolerance being
`factor` times the error of torch's SDPA in the served dtype on the same rows, with parity's floors. (Not the op's
configured baseline: a decode check through it, with the float64 reference, cost 50-65 ms on the H200, cause not
profiled; a prefill check through this path cost 1.1-1.7 ms, docs/BENCHMARKS.md.)

Nothing waits on the GPU during serving: the reference, torch's rows and the candidate's rows are computed on the
serving stream and kept (small: one sequence's heads, a few rows; at most KEEP per op, a uniform sample of the
checks made, so a long window cannot fill the server's memory); the comparisons run when the books are read
(`results`, GET /kevo/stats after the window). On CUDA the checks allocate from a memory pool of their own, so the
candidate's allocations land where they would with no check: its output's address does not tell a checked call.

A decode step replayed from a CUDA graph runs no Python, so no call of it can be drawn before it runs: the capture
holds each candidate call's inputs and output (`Held`: tensors the graph rewrites at every replay, kept alive so
nothing else of the capture takes their memory), and after a replay each of them is checked at the same share,
on the lengths really served (`replayed`). What a check reads then is what the replay left: the query and output
of its layer, and the layer's cache (which the step's later layers do not write). A kernel could tell a capture
from an eager call (the bucket's shapes, the calls' order) and launch something else there; without this, nothing
but the gates would see it, and on the GPU most decode calls are replayed.
This module runs in the served process beside the candidate, as harness/served/ops.py does: it keeps books.
"""
from __future__ import annotations

import contextlib
import math
import random
import secrets
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.compare import Tolerance, diff
from harness.targets.base import Target

ROWS = 16           # prefill query rows per check (and the sequence's last)
KEEP = 256          # checks kept per op for judging, a uniform sample of those made (a prefill check: ~0.4 MB)


@dataclass
class Kept:
    what: str                   # the call and the rows checked, for a rejection's reason
    got: torch.Tensor | None    # the candidate's rows (None until its call returned)
    ref: torch.Tensor           # float64
    torch_rows: torch.Tensor    # torch in the served dtype: what sets the tolerance
    replayed: bool = False      # a call of a CUDA graph's replay


@dataclass
class Held:
    """A candidate call made while a CUDA graph was captured: its arguments and output, tensors each replay rewrites.
    `shared`: its output lies in one allocation with another call's of the same capture (a candidate's own buffer)."""
    args: tuple
    out: torch.Tensor
    shared: bool


@dataclass
class Pending:
    """A call drawn for a check: what was copied before it, and how its output rows are picked."""
    kept: Kept
    rows: slice | torch.Tensor


def _rows_attention(q, k, v, rows: torch.Tensor, sm_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Causal attention of query rows `rows` (their queries `q` [R, H, D]) over keys 0..row of k, v [n, KVH, D],
    computed in `dtype` (float64: the reference; else torch's SDPA as a user would run it)."""
    R, H, D = q.shape
    n, KVH, _ = k.shape
    G = H // KVH
    qg = q.to(dtype).reshape(R, KVH, G, D).permute(1, 0, 2, 3).reshape(KVH, R * G, D)
    allowed = torch.arange(n, device=q.device)[None, :] <= rows.repeat_interleave(G)[:, None]     # [R*G, n]
    kd, vd = k.to(dtype).transpose(0, 1), v.to(dtype).transpose(0, 1)
    if dtype == torch.float64:
        p = (qg @ kd.transpose(1, 2) * sm_scale).masked_fill(~allowed[None], float("-inf")).softmax(-1)
        out = p @ vd
    else:
        out = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=allowed[None], scale=sm_scale)
    return out.reshape(KVH, R, G, D).permute(1, 0, 2, 3).reshape(R, H, D)


def _decode(q, k_cache, v_cache, block_table, sm_scale, lens: list[int], b: int, where: str = "") -> Pending:
    """Sequence b's query over its keys, gathered from its pages in order: its last row of a causal prefill.
    `where`: said after the batch (a graph replay's bucket)."""
    n, (_, bs, KVH, D) = lens[b], k_cache.shape
    pages = block_table[b, :math.ceil(n / bs)].long()
    k, v = k_cache[pages].reshape(-1, KVH, D)[:n], v_cache[pages].reshape(-1, KVH, D)[:n]
    last = torch.full((1,), n - 1, device=q.device, dtype=torch.long)      # no copy from the host: see _rows
    qb = q[b:b + 1]
    return Pending(Kept(f"decode batch {len(lens)}{where}, sequence {b} of length {n}, all {q.shape[1]} heads", None,
                        _rows_attention(qb, k, v, last, sm_scale, torch.float64),
                        _rows_attention(qb, k, v, last, sm_scale, q.dtype)), slice(b, b + 1))


def _rows(n: int, rng: random.Random, device: torch.device) -> torch.Tensor:
    """ROWS of a sequence's n rows, evenly spaced from a secret phase, and its last: each row as likely as any.
    Made on the device (arange, full): a tensor copied from the host would wait for the serving stream."""
    if n <= ROWS:
        return torch.arange(n, device=device)
    spaced = torch.arange(ROWS, device=device, dtype=torch.float64) * (n / ROWS) + rng.random() * (n / ROWS)
    return torch.cat([spaced.floor().long(), torch.full((1,), n - 1, device=device, dtype=torch.long)])


def _prefill(q, k, v, sm_scale, lens: list[int], b: int, rng: random.Random) -> Pending:
    start, n = sum(lens[:b]), lens[b]
    rows = _rows(n, rng, q.device)
    qr, kb, vb = q[start + rows], k[start:start + n], v[start:start + n]
    ref = _rows_attention(qr, kb, vb, rows, sm_scale, torch.float64)
    torch_rows = _rows_attention(qr, kb, vb, rows, sm_scale, q.dtype)
    return Pending(Kept(f"prefill of {len(lens)} sequences, sequence {b} of length {n}, {len(rows)} of its rows "
                        f"(the last among them)", None, ref, torch_rows), start + rows)


class SpotChecks:
    def __init__(self, target: Target, share: float, factor: float, floor: tuple[float, float],
                 keep: int = KEEP) -> None:
        """`share`: of the candidate's eager served calls, checked; `factor` and `floor` (max abs, relative L2):
        the tolerance, as parity's (config stages.parity.tolerance_factor and floors of the served dtype); `keep`:
        the checks kept per op, however long the server runs (a reservoir: each check made as likely as any)."""
        self.share, self.factor, self.floor, self.keep = share, factor, floor, keep
        self.made = {op: 0 for op in target.ops}
        self._rng = random.Random(secrets.randbits(64))     # which calls, sequences and rows: no one can know
        self.kept: dict[str, list[Kept]] = {op: [] for op in target.ops}
        self._judged: dict[str, dict] | None = None
        self._pool = None                                   # on CUDA, the checks' own memory (_own_memory)

    def before(self, op: str, args: tuple, lens: list[int]) -> Pending | None:
        """Whether this call is checked (drawn in secret), and if so what the check copied of its inputs."""
        if not self.share or self._rng.random() >= self.share or not lens:
            return None
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None
        b = self._rng.randrange(len(lens))
        with self._own_memory(args[0].device):
            if op == "decode":
                q, k_cache, v_cache, block_table, _, sm_scale = args
                return _decode(q, k_cache, v_cache, block_table, sm_scale, lens, b)
            q, k, v, _, _, sm_scale = args
            return _prefill(q, k, v, sm_scale, lens, b, self._rng)

    def _own_memory(self, device: torch.device):
        """On CUDA, the checks allocate from a pool of their own: the candidate's next allocations land where they
        would have landed with no check (its output's address would otherwise tell a checked call from another)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._pool is None:
            self._pool = torch.cuda.MemPool()
        return torch.cuda.use_mem_pool(self._pool, device)

    def after(self, op: str, pending: Pending | None, out: torch.Tensor) -> None:
        if pending is None:
            return
        with self._own_memory(out.device):
            pending.kept.got = out[pending.rows].clone()
        self.made[op] += 1
        kept, slot = self.kept[op], self._rng.randrange(self.made[op])
        if len(kept) < self.keep:
            kept.append(pending.kept)
        elif slot < self.keep:
            kept[slot] = pending.kept
        self._judged = None

    def hold(self, held: list[Held], args: tuple, out: torch.Tensor) -> None:
        """A decode call made while a CUDA graph is captured: kept in `held` (the graph's), to be checked after its
        replays."""
        if not self.share:
            return
        at, shared = out.untyped_storage().data_ptr(), False
        for h in held:
            if h.out.untyped_storage().data_ptr() == at:
                h.shared = shared = True
        held.append(Held(args, out, shared))

    def replayed(self, held: list[Held], lens: list[int], bucket: int) -> None:
        """After a CUDA graph's replay: each decode call its capture held, checked at the share as an eager call is,
        one sequence of those served (`lens`; the bucket's other rows are padding)."""
        if not self.share or not lens:
            return
        for h in held:
            if self._rng.random() >= self.share:
                continue
            q, k_cache, v_cache, block_table, _, sm_scale = h.args
            where = f", replayed from the CUDA graph of batch {bucket}" + (
                " (its output lies in the allocation of another call's of the step)" if h.shared else "")
            with self._own_memory(q.device):
                pending = _decode(q, k_cache, v_cache, block_table, sm_scale, lens, self._rng.randrange(len(lens)), where)
            pending.kept.replayed = True
            self.after("decode", pending, h.out)

    def results(self) -> dict[str, dict]:
        """Per op: calls checked, how many fell outside the tolerance, the worst error over it, and the first
        failure said in a line. Computed once for what is kept (reading the kept tensors waits for the GPU)."""
        if self._judged is None:
            with self._own_memory(next((k.ref.device for kept in self.kept.values() for k in kept), torch.device("cpu"))):
                self._judged = {op: self._judge(kept) for op, kept in self.kept.items()}
        return self._judged

    def _judge(self, kept: list[Kept]) -> dict:
        """`spot_replayed`: of those checked, calls of CUDA graph replays."""
        failed, worst, first = 0, 0.0, ""
        for k in kept:
            tol = Tolerance.beside(diff(k.torch_rows, k.ref), self.factor, *self.floor)
            d = diff(k.got, k.ref, atol=tol.max_abs)
            worst = max(worst, d.max_abs / tol.max_abs, d.rel_l2 / tol.rel_l2)
            if not tol.admits(d):
                failed += 1
                first = first or (f"{k.what}: {d.describe()} (tolerance: max abs {tol.max_abs:.3g}, relative L2 "
                                  f"{tol.rel_l2:.3g})")
        return {"spot_checked": len(kept), "spot_replayed": sum(k.replayed for k in kept), "spot_failed": failed,
                "spot_worst": min(worst, 1e12), "spot_first": first[:600]}
