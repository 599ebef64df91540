"""The replay client: the openai SDK against a served endpoint, every token timed on this clock.

Each trace request is sent at its arrival time (asyncio, AsyncOpenAI, streaming completions with
prompt token ids, temperature 0, the top `logprobs` logprobs, and vLLM's `ignore_eos` and
`return_tokens_as_token_ids` so external servers answer alike). Every streamed token is stamped
with time.perf_counter() when its chunk arrives here. A request that gives `forced` tokens is sent
with them as `kevo_forced` (teacher forcing, harness/served/server.py; only kevo's own server knows
the field), and with `kevo_score` when they are to be scored in the prompt's prefill. A request that errs, breaks off or does not finish within the drain time is recorded
with its error; nothing is retried; the garbage collector is held off while a replay runs.
Per-request TTFT (first token minus send time) and TPOT (mean gap between later tokens) are read off
the stamps.
A burst (`burst=True`) sends every request at once as one `kevo_group` (a fresh id; each request's
position its place in the list): kevo's server queues them together once all have come in, so the
engine admits and batches them alike on every server (harness/served/server.py); arrival times are
then ignored, and TTFT counts from the group's start: the moment the last member was taken in (its
response began), or the burst's first token if that came sooner. Another server ignores the field
and takes them as they come.
Not covered: judging the results (harness/served/score.py does).
"""
from __future__ import annotations

import asyncio
import gc
import math
import secrets
import time
from dataclasses import dataclass, field, replace

from harness.served.traces import TraceRequest


@dataclass
class Completion:
    """One request as the client saw it; times are seconds from the replay's start."""
    index: int
    scheduled_s: float
    expected: int
    sent_s: float = float("nan")
    token_times: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[str, float]]] = field(default_factory=list)   # best first
    error: str = ""
    accepted_s: float = float("nan")   # when the server's response began (its headers: the request was taken in)
    origin_s: float | None = None      # what TTFT counts from, when not its send: in a burst, the group's start

    @property
    def complete(self) -> bool:
        return not self.error and len(self.tokens) == len(self.logprobs) == len(self.top) == self.expected

    @property
    def ttft(self) -> float:
        return self.token_times[0] - (self.sent_s if self.origin_s is None else self.origin_s)

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass
class ReplayRun:
    label: str
    completions: list[Completion]
    duration_s: float          # first send to last token
    max_send_lag_s: float      # how late this client sent a request, at worst
    server_ready_s: float = float("nan")   # the server's start to ready (launch.ServerHandle.ready_s), when known

    def failures(self) -> list[Completion]:
        return [c for c in self.completions if not c.complete]

    def describe_failures(self) -> str:
        bad = self.failures()
        if not bad:
            return ""
        first = bad[0]
        what = first.error or f"received {len(first.tokens)} of {first.expected} tokens"
        return f"{len(bad)} of {len(self.completions)} requests did not complete; first: request {first.index + 1}: {what}"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


async def _replay(url: str, model: str, requests: list[TraceRequest], request_timeout_s: float,
                  drain_timeout_s: float, label: str, burst: bool, logprobs: int) -> ReplayRun:
    import openai                                  # the SDK takes a second to import: only when replaying
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=request_timeout_s)
    if burst:
        requests = [replace(r, arrival_s=0.0) for r in requests]
    results = {r.index: Completion(r.index, r.arrival_s, r.output_len) for r in requests}
    group = secrets.token_hex(8)
    position = {r.index: i for i, r in enumerate(requests)}
    t0 = time.perf_counter()

    async def one(r: TraceRequest) -> None:
        c = results[r.index]
        delay = r.arrival_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        extra: dict = {"ignore_eos": True, "return_tokens_as_token_ids": True}
        if r.forced is not None:
            extra["kevo_forced"] = list(r.forced)
            if r.scored:
                extra["kevo_score"] = True
        if burst:
            extra["kevo_group"] = {"id": group, "size": len(requests), "position": position[r.index]}
        c.sent_s = time.perf_counter() - t0
        try:
            stream = await client.completions.create(
                model=model, prompt=r.prompt, max_tokens=r.output_len, temperature=0, logprobs=logprobs, stream=True,
                extra_body=extra)
            c.accepted_s = time.perf_counter() - t0
            async for chunk in stream:
                now = time.perf_counter() - t0
                for choice in chunk.choices:
                    lp = choice.logprobs
                    if lp is None or not lp.tokens:
                        continue
                    for j, tok in enumerate(lp.tokens):
                        c.tokens.append(tok)
                        c.token_times.append(now)
                        c.logprobs.append(float(lp.token_logprobs[j]))
                        top = (lp.top_logprobs or [None] * (j + 1))[j] or {}
                        c.top.append(sorted(((k, float(v)) for k, v in top.items()), key=lambda kv: -kv[1]))
        except Exception as e:          # noqa: BLE001 - whatever a server's stream breaks, the request errored, said so
            c.error = _one_line(e)

    tasks = {asyncio.create_task(one(r)): r.index for r in requests}
    last_arrival = max(r.arrival_s for r in requests)
    _, pending = await asyncio.wait(tasks, timeout=last_arrival + drain_timeout_s)
    for task in pending:
        task.cancel()
        results[tasks[task]].error = f"did not finish within {drain_timeout_s:g} s of the last arrival"
    await asyncio.gather(*pending, return_exceptions=True)
    await client.close()
    comps = [results[r.index] for r in requests]
    if burst:                     # the group starts once its last member is in, not at each one's own send
        accepted = [c.accepted_s for c in comps]
        if comps and not any(math.isnan(t) for t in accepted):     # else some were never taken in: failures
            origin = min([max(accepted)] + [c.token_times[0] for c in comps if c.token_times])
            for c in comps:
                c.origin_s = origin
    stamps = [t for c in comps for t in c.token_times]
    sent = [c.sent_s for c in comps if c.sent_s == c.sent_s]
    duration = (max(stamps) - min(sent)) if stamps and sent else 0.0
    lag = max((c.sent_s - c.scheduled_s for c in comps if c.sent_s == c.sent_s), default=0.0)
    return ReplayRun(label, comps, duration, lag)


def _unpaused(fn):
    """Run `fn` with the cyclic garbage collector held off: a full collection over what the caller holds
    (a reference pass's tokens, say) pauses this loop, and every token arriving meanwhile is stamped late."""
    gc.collect()
    gc.disable()
    try:
        return fn()
    finally:
        gc.enable()


def replay(url: str, model: str, requests: list[TraceRequest], request_timeout_s: float,
           drain_timeout_s: float, label: str = "", burst: bool = False, logprobs: int = 2) -> ReplayRun:
    """Send the requests at their arrival times (a burst: all at once, as one group) and wait for every
    stream (at most drain_timeout_s after the last arrival). `logprobs`: the top logprobs asked per token
    (the stage asks for config's served.logprobs)."""
    return _unpaused(lambda: asyncio.run(_replay(url, model, requests, request_timeout_s, drain_timeout_s, label, burst,
                                                 logprobs)))
