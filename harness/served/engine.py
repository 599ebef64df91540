"""The serving engine: continuous batching over a paged KV cache, greedy sampling with logprobs.

Requests join and leave between steps. Each step admits waiting requests in arrival order (while
there is room: running sequences, prefill tokens per step, KV blocks for the whole request), then
runs ONE forward pass over the new sequences' prompts (varlen prefill) and one new token of every
running sequence (batched paged decode), and samples greedily: the chosen token, its logprob and
the `top_k` most likely tokens with theirs (config served.logprobs; near-ties are judged from the top two). A request ends
after exactly max_tokens tokens (there is no end-of-sequence token: traces fix output lengths).
Teacher forcing: a request may give its `forced` tokens (one per generated token); each step then
appends the forced token instead of the greedy choice and reports the model's logprob of it, with
the model's own top_k beside it (top[0] is what it would have chosen), so another server's
continuation can be scored token by token after the two have parted. A forced request may also be
`scored`: its forced tokens then join its prompt's prefill (all but the last) and every one is scored
in that one forward pass, with no decode step - the same logprobs the model gives decoding them one a
step, at a prefill's cost (how the replay's float32 reference scores a continuation it did not choose).
A decode-only step (no prefill in it) replays a CUDA graph where the engine has them (graphs.py).
Not covered: sampling temperatures other than 0, chunked prefill, preemption, prefix caching.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from harness.served.graphs import DecodeGraphs, decode_rows
from harness.served.kvcache import BlockAllocator, PagedKVCache
from harness.served.limits import GraphPlan
from harness.served.model import Qwen3, StepBatch, build_model
from harness.served.ops import AttentionOps

class EngineError(Exception):
    """A request the engine can never serve; one line."""


@dataclass(frozen=True)
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    forced: tuple[int, ...] | None = None   # teacher forcing: the tokens to append, max_tokens of them
    scored: bool = False                    # the forced tokens scored in the prefill, not decoded one a step

    @property
    def prefill_ids(self) -> list[int]:
        """What its prefill runs over: the prompt, and for a scored request its forced tokens but the last."""
        return self.prompt + list(self.forced[:-1]) if self.scored and self.forced else self.prompt

    @property
    def prefill_rows(self) -> int:
        """The rows of its prefill whose next token is sampled: its last, or one per forced token when scored."""
        return self.max_tokens if self.scored else 1


# At most this many sampled rows in one step: each is a row of float32 logits over the vocabulary (0.6 GB
# for 1024 rows of Qwen3's 151,936); a scored request needing more is admitted alone.
MAX_SAMPLED_ROWS = 1024


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token: int                        # the greedy choice, or the forced token
    logprob: float                    # the model's logprob of `token`
    top: list[tuple[int, float]]     # the engine's top_k most likely tokens and their logprobs, best first
    finished: bool
    step: int = -1                    # the engine step that made it (0, 1, ...): the order of its work, on its own clock


@dataclass
class _Seq:
    req: Request
    budget: int                       # blocks reserved for the whole request
    blocks: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.req.prompt) + len(self.generated)


class Engine:
    def __init__(self, model: Qwen3, ops: AttentionOps, cache: PagedKVCache, max_running: int,
                 max_prefill_tokens: int, top_k: int) -> None:
        self.model, self.ops, self.cache, self.top_k = model, ops, cache, top_k
        self.allocator = BlockAllocator(cache.num_blocks)
        self.bs = cache.block_size
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.device = model.embed.device
        self.waiting: deque[Request] = deque()
        self.running: list[_Seq] = []
        self.steps = 0
        self.tokens_out = 0
        self.graphs: DecodeGraphs | None = None     # decode-only steps from CUDA graphs (make_engine)

    def check(self, req: Request) -> None:
        vocab = self.model.p.vocab
        if not req.prompt:
            raise EngineError("the prompt is empty")
        if min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        if req.max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")
        if req.forced is not None:
            if len(req.forced) != req.max_tokens:
                raise EngineError(f"the forced tokens must be one per generated token: {len(req.forced)} given, "
                                  f"max_tokens is {req.max_tokens}")
            if min(req.forced) < 0 or max(req.forced) >= vocab:
                raise EngineError(f"forced token ids must be in [0, {vocab})")
        elif req.scored:
            raise EngineError("a scored request needs its forced tokens (kevo_forced) to score")
        capacity = self.allocator.num_blocks * self.bs
        if len(req.prompt) + req.max_tokens > capacity:
            raise EngineError(f"the request needs {len(req.prompt) + req.max_tokens} tokens of KV cache; "
                              f"this model holds {capacity}")

    def add(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        self.waiting = deque(r for r in self.waiting if r.id != request_id)
        for s in [s for s in self.running if s.req.id == request_id]:
            self._release(s)
        self.running = [s for s in self.running if s.req.id != request_id]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, s: _Seq) -> None:
        self.allocator.release(s.blocks, s.budget - len(s.blocks))

    def _grow(self, s: _Seq, upto: int) -> None:
        """Blocks for positions [0, upto)."""
        while len(s.blocks) * self.bs < upto:
            s.blocks.append(self.allocator.take())

    def _admit(self) -> list[_Seq]:
        new, tokens, rows = [], 0, len(self.running)
        while self.waiting and len(self.running) + len(new) < self.max_running:
            req = self.waiting[0]
            n = len(req.prefill_ids)
            if new and (tokens + n > self.max_prefill_tokens or rows + req.prefill_rows > MAX_SAMPLED_ROWS):
                break
            budget = math.ceil((len(req.prompt) + req.max_tokens) / self.bs)
            if not self.allocator.reserve(budget):
                break
            self.waiting.popleft()
            s = _Seq(req, budget)
            self._grow(s, n)
            new.append(s)
            tokens += n
            rows += req.prefill_rows
        return new

    def _batch(self, new: list[_Seq], decode: list[_Seq]) -> StepBatch:
        bs, dev = self.bs, self.device
        tokens, positions, slots = [], [], []
        for s in new:
            ids = s.req.prefill_ids
            n = len(ids)
            tokens.append(torch.tensor(ids, dtype=torch.int64))
            positions.append(torch.arange(n))
            slots.append((torch.tensor(s.blocks)[:, None] * bs + torch.arange(bs)).flatten()[:n])
        dec_tokens, dec_pos, dec_slots = decode_rows(decode, bs)
        tokens.append(torch.tensor(dec_tokens, dtype=torch.int64))
        positions.append(torch.tensor(dec_pos, dtype=torch.int64))
        slots.append(torch.tensor(dec_slots, dtype=torch.int64))
        prefill_lens = [len(s.req.prefill_ids) for s in new]
        cu = torch.tensor([0] + prefill_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        width = max((len(s.blocks) for s in decode), default=0)
        table = [s.blocks + [0] * (width - len(s.blocks)) for s in decode]
        sample = [int(c) - k for s, c in zip(new, cu[1:]) for k in range(s.req.prefill_rows, 0, -1)] \
            + [sum(prefill_lens) + i for i in range(len(decode))]
        return StepBatch(
            tokens=torch.cat(tokens).to(dev), positions=torch.cat(positions).to(dev), slots=torch.cat(slots).to(dev),
            prefill_lens=prefill_lens, cu_seqlens=cu.to(dev) if new else None,
            decode_lens=[p + 1 for p in dec_pos],
            block_table=torch.tensor(table, dtype=torch.int32, device=dev) if decode else None,
            seq_lens=torch.tensor([p + 1 for p in dec_pos], dtype=torch.int32, device=dev) if decode else None,
            sample_idx=torch.tensor(sample, dtype=torch.int64, device=dev))

    def step(self) -> list[TokenEvent]:
        R = self.model.region
        with R("kevo.step"):
            decode = list(self.running)
            new = self._admit()
            if not new and not decode:
                return []
            self.running = new + decode     # held from here: a step that raises leaves them to `abort`
            for s in decode:
                self._grow(s, s.length)
            logits = self.graphs.run(decode) if self.graphs is not None and not new else None
            if logits is None:
                with R("kevo.copies"):
                    batch = self._batch(new, decode)
                logits = self.model.forward(batch, self.cache, self.ops)
            # the sampled rows in the batch's order (prefill sequences first, a scored one's rows in order);
            # row j of a sequence produces its token number len(generated) + j
            rows_of = [(s, j) for s in new for j in range(s.req.prefill_rows)] + [(s, 0) for s in decode]
            forced = [-1 if s.req.forced is None else s.req.forced[len(s.generated) + j] for s, j in rows_of]
            with R("kevo.sampling"):
                logp = torch.log_softmax(logits.float(), dim=-1)
                top_lp, top_id = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
                cols = [top_id.double(), top_lp.double()]
                if max(forced) >= 0:              # the forced tokens' logprobs, in the same copy to the host
                    ids = torch.tensor([max(f, 0) for f in forced], dtype=torch.int64, device=logp.device)
                    cols.append(logp.gather(1, ids[:, None]).double())
                rows = torch.cat(cols, dim=1).cpu().tolist()
        k = top_id.shape[1]
        events = []
        for (s, _), f, row in zip(rows_of, forced, rows):
            top = [(int(row[j]), row[k + j]) for j in range(k)]
            token, logprob = top[0] if f < 0 else (f, row[2 * k])
            s.generated.append(token)
            done = len(s.generated) >= s.req.max_tokens
            events.append(TokenEvent(s.req.id, token, logprob, top, done, self.steps))
            if done:
                self._release(s)
        self.running = [s for s in new + decode if len(s.generated) < s.req.max_tokens]
        self.steps += 1
        self.tokens_out += len(events)
        return events


def make_engine(preset: Any, block_size: int, dtype: torch.dtype, device: torch.device,
                ops: AttentionOps, *, init: Any, top_k: int, annotate: bool = False, root=None,
                graphs: GraphPlan | None = None) -> Engine:
    """`init`: the random weights' gains (config served.random_init); `top_k`: the logprobs each token
    reports (served.logprobs); `graphs`: decode-only steps replay CUDA graphs captured by `warm_up` (off on
    a CPU, said so)."""
    model = build_model(preset, dtype, device, init=init, annotate=annotate, root=root)
    num_blocks = max(1, preset.kv_cache_tokens // block_size)
    cache = PagedKVCache(preset.layers, num_blocks, block_size, preset.kv_heads, preset.head_dim, dtype, device)
    engine = Engine(model, ops, cache, preset.max_running, preset.max_prefill_tokens, top_k)
    if graphs is not None:
        engine.graphs = DecodeGraphs(engine, graphs)
    return engine


def run_requests(engine: Engine, requests: list, realtime: bool = True,
                 on_step: Callable[[list[TokenEvent]], None] | None = None) -> dict[int, list[TokenEvent]]:
    """Drive the engine in this process with trace requests (harness/served/traces.py): each joins
    at its arrival time on this clock (realtime), or all at once, forced where it gives `forced`.
    Returns each request's tokens."""
    pending = deque(sorted(requests, key=lambda r: r.arrival_s))
    out: dict[int, list[TokenEvent]] = {r.index: [] for r in requests}
    t0 = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - t0 if realtime else math.inf
        while pending and pending[0].arrival_s <= now:
            r = pending.popleft()
            engine.add(Request(str(r.index), r.prompt, r.output_len, r.forced, r.scored))
        if not engine.has_work():
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        events = engine.step()
        for ev in events:
            out[int(ev.request_id)].append(ev)
        if on_step:
            on_step(events)
    return out


def warm_up(engine: Engine, prompts: Sequence[int] = (), limit: int | None = None, passes: int = 1,
            sweep: Callable[[], ContextManager] | None = None) -> dict[str, float]:
    """Compile and tune before anything is timed. First, fixed: prompts either side of a cache block,
    all admitted in one prefill, then decode batches that shrink as they finish (5, 4, 3, 2, 1).

    Then, given the served requests' prompt lengths, the shape classes that serving them will
    produce: Triton specializes integer arguments (1, multiples of 16) and a kernel file may choose
    constexprs from the shape, so a class first met inside the timed window compiles there and stalls
    every request in flight (up to 1.3 s a class for the reference kernels on the H200: docs/BENCHMARKS.md).
    Up to `limit` (default: the engine's max_running) of the served prompt lengths, spread over the list:
    - sent at once, `passes` times (in the served order, then longest first); their outputs outlast the
      prefill steps that admit them all and are one token longer each, so they end one a step and decode
      runs at every batch size from the largest the KV cache holds down to 1, over contexts of the served
      lengths: in the second pass the longest contexts leave first;
    - then each distinct length alone, as a prompt arriving at an idle server is served.
    With `sweep` (a context in which kernel calls compile and launch nothing: harness/probes.py `compiling`, its
    compiles a thread pool's), those two parts are served once inside it first: the shape classes they meet compile
    side by side, and the parts served for real after it find them compiled (the outputs of the sweep's steps are
    whatever the unlaunched kernels left: its tokens are nobody's). A sweep that raises is stopped there; the real
    parts meet what it missed.
    Prompt tokens are filler, never the served ones, so nothing learnt here answers a served request.
    Then the engine's CUDA graphs, if it has them, are captured (harness/served/graphs.py).
    Counts and recorded shapes start afresh. Returns each part's seconds (fixed, sweep, served, alone, capture)."""
    from harness.served.traces import TraceRequest
    took: dict[str, float] = {}
    t = time.perf_counter()

    def lap(part: str) -> None:
        nonlocal t
        took[part] = time.perf_counter() - t
        t = time.perf_counter()
    bs, cap, vocab = engine.bs, engine.allocator.num_blocks * engine.bs, engine.model.p.vocab
    lengths = [n for n in (1, bs - 1, bs + 1, 2 * bs + 3, 100) if 1 <= n and n + 6 <= cap // 8]
    reqs = [TraceRequest(i, 0.0, [(7 * i + j) % vocab for j in range(n)], 2 + i) for i, n in enumerate(lengths)]
    run_requests(engine, reqs, realtime=False)
    lap("fixed")
    k = min(len(prompts), engine.max_running if limit is None else limit)
    if k:
        spread = [prompts[i * len(prompts) // k] for i in range(k)]
        distinct = sorted(set(prompts))
        m = min(k, len(distinct))                   # the shortest and the longest among them
        alone = sorted({distinct[round(i * (len(distinct) - 1) / max(1, m - 1))] for i in range(m)})

        def filler(i: int, n: int, out: int) -> TraceRequest:
            n = max(1, min(n, cap - out))
            return TraceRequest(i, 0.0, [(11 * i + 3 * j + 1) % vocab for j in range(n)], out)

        admitting = math.ceil(sum(spread) / engine.max_prefill_tokens) + math.ceil(k / engine.max_running)

        def served() -> None:
            for order in (spread, sorted(spread, reverse=True))[:passes]:
                run_requests(engine, [filler(i, n, 2 + admitting + i) for i, n in enumerate(order)], realtime=False)

        def each_alone() -> None:
            for i, n in enumerate(alone):
                run_requests(engine, [filler(k + i, n, 2)], realtime=False)
        if sweep is not None:
            try:
                with sweep():
                    served()
                    each_alone()
            except Exception as e:
                logging.getLogger(__name__).warning("the warm-up's compile-only sweep stopped: %s", e)
                for rid in {r.id for r in engine.waiting} | {s.req.id for s in engine.running}:
                    engine.abort(rid)
            lap("sweep")
        served()
        lap("served")
        each_alone()
        lap("alone")
    if engine.graphs is not None:
        engine.graphs.capture()
        lap("capture")
    engine.ops.reset()
    engine.steps = engine.tokens_out = 0
    return took
