"""LLM providers through their official SDKs: one `LLM` protocol, a registry, retries, outages, cost.

`openai` speaks the Chat Completions API (and, with a base URL, any OpenAI-compatible server: vLLM,
SGLang, llama.cpp, ollama); `anthropic` speaks the Messages API. Each call is streamed and read by
agent/llm/replies.py; here it is bounded: it runs in a thread of its own while the caller watches the
clock, so it ends at `providers.timeout_s`, at `idle_timeout_s` of silence (the SDK's read timeout),
or at once when the run must stop (`Meter.halt`: a signal, the time budget); meanwhile the live line
says "waiting for <model> 41 s (call 2/5)". Before each call the run may refuse it (`Meter.refusal`:
a signal, the time budget, a cost limit its worst case would pass): nothing is bought then. The SDKs'
own retries are off: rate limits, server errors, timeouts, dropped connections and malformed replies
are retried with jittered exponential backoff, or after the wait a Retry-After / retry-after-ms header
asks for (capped at `retry.max_retry_after_s`), with a countdown on the live line. What retrying cannot
fix (authentication, an unknown model, a request too long) raises `ProviderStop`: the run stops with
its one line. Retries that run out mean the provider is down (`ProviderDown`; agent/llm/asking.py waits
for it). A service that never sent an HTTP reply since the run started (a wrong URL, a closed port)
stops the run after `outage.unreached_s`, naming the provider and its URL. Every failed call is counted
in `Meter.fared`. Keys come from the environment (harness/config.py) and are never recorded.
Not here: outages and the recorded exchange (agent/llm/asking.py), how a reply is read (agent/llm/replies.py),
what is asked (planner, coder).
"""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable, Protocol

from harness.config import ProviderConfig, ProvidersConfig
from harness.sandbox import redact

from agent.llm.meter import Fared, Meter
from agent.records import Message
from agent.llm.replies import (CallTimeout, Reply, httpx_module, status_of, anthropic_reply, answered, fault_kind, openai_reply,
                           retry_after, sdks)

__all__ = ["LLM", "Meter", "PROVIDERS", "ProviderDown", "ProviderStop", "Halted", "Reply", "check_keys"]

_CHECK_TIMEOUT_S = 20.0         # the key check at start: a service this slow is left to the run's waits
_TICK_S = 0.25                  # how often a caller looks at a call in flight (the run's stop, the deadline)


class ProviderStop(Exception):
    """An LLM failure that retrying cannot fix; the run stops. The message is one line."""


class ProviderDown(ProviderStop):
    """A provider's retries ran out on transient errors (or the run stopped while waiting for it)."""

    def __init__(self, message: str, attempts: int = 0, faults: list[str] | None = None, first: float = 0.0) -> None:
        super().__init__(message)
        self.attempts, self.faults, self.first = attempts, faults or [], first


class Halted(ProviderDown):
    """The run must stop (a signal, the time budget, the cost limit): a call not made, or cut short."""

    def __init__(self, why: str, attempts: int = 0, faults: list[str] | None = None) -> None:
        super().__init__(why, attempts, faults)
        self.why = why


class LLM(Protocol):
    """`complete` returns the reply and how many calls it took. A provider that can be down also has
    `outage` (how long to wait for it) and `fallback` (another LLM to ask meanwhile, or None)."""
    name: str

    def complete(self, model: str, system: str, messages: list[Message], meter: Meter | None = None) -> tuple[Reply, int]: ...


def _what(e: BaseException) -> str:
    status = status_of(e)
    body = getattr(e, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    text = (inner.get("message") if isinstance(inner, dict) else None) or str(e) or type(e).__name__
    if e.__cause__ is not None and str(e.__cause__) and str(e.__cause__) not in text:
        text = f"{text} ({e.__cause__})"
    first = redact(" ".join(str(text).split()))[:240]
    return f"{status} {first}" if status else f"{type(e).__name__}: {first}"


def _why_fatal(e: BaseException, provider: str, key_env: str | None) -> str:
    status = status_of(e)
    if status in (401, 403):
        return f"{provider}: authentication failed ({_what(e)}); check {key_env or 'the server'}"
    if status == 404:
        return f"{provider}: unknown model or endpoint ({_what(e)})"
    if status in (400, 413, 422):
        return f"{provider}: request refused, not retried ({_what(e)})"
    return f"{provider}: {_what(e)}"


def pause(seconds: float, halt: Callable[[], str], say: Callable[[float], None] = lambda left: None) -> str:
    """Sleep in short steps, saying how long is left each second; why the run must stop, as soon as it must."""
    end, said = time.monotonic() + seconds, None
    while (left := end - time.monotonic()) > 0:
        if why := halt():
            return why
        if said != int(left):
            said = int(left)
            say(left)
        time.sleep(min(0.2, left))
    return halt()


class _Base:
    name = "base"
    env_url = ""                    # the SDK's environment variable for the base URL

    def __init__(self, pcfg: ProviderConfig, common: ProvidersConfig) -> None:
        self.pcfg, self.common = pcfg, common
        self.key = pcfg.api_key(self.name)
        self.outage = common.outage
        other = common.fallback
        self.fallback = PROVIDERS[other](getattr(common, other), common) if other and other != self.name else None
        self.prefer_fallback = False    # set while the fallback answers and this one is down

    @property
    def url(self) -> str:
        return str(self.client.base_url).rstrip("/")

    def _read(self, model: str, system: str, messages: list[dict], timeout, cancel: threading.Event) -> Reply:
        raise NotImplementedError

    def _unreached(self, fared: Fared, more_s: float = 0.0) -> str:
        """The one line that stops a run whose service never answered, once unreached_s is (or would be) past."""
        limit = self.common.outage.unreached_s
        if fared.reached or limit is None or not fared.first_failure:
            return ""
        if time.monotonic() - fared.first_failure + more_s < limit:
            return ""
        return (f"{self.name}: {self.url} never answered since the run started ({fared.calls} calls over "
                f"{time.monotonic() - fared.first_failure:.0f} s); check providers.{self.name}.base_url"
                f"{f' (or {self.env_url})' if self.env_url and self.pcfg.base_url is None else ''} and that the "
                f"service is up, or set providers.outage.unreached_s: null to wait for it")

    def _call(self, model: str, system: str, messages: list[Message], meter: Meter, n: int) -> Reply:
        """One call, in a thread of its own, bounded by the whole-call deadline and the run's stop."""
        c, http = self.common, httpx_module()
        timeout = http.Timeout(connect=c.connect_timeout_s, read=c.idle_timeout_s, write=c.idle_timeout_s,
                               pool=c.connect_timeout_s)
        cancel, fut = threading.Event(), Future()
        sent = [m.model_dump() for m in messages]

        def work() -> None:
            try:
                fut.set_result(self._read(model, system, sent, timeout, cancel))
            except BaseException as e:                  # handed to the caller as it is
                fut.set_exception(e)
        threading.Thread(target=work, name=f"kevo-{self.name}-call", daemon=True).start()
        t0 = time.monotonic()
        while True:
            try:
                return fut.result(timeout=_TICK_S)
            except FutureTimeout:
                pass
            if why := meter.halt():
                cancel.set()
                raise Halted(why)
            if time.monotonic() - t0 >= c.timeout_s:
                cancel.set()
                raise CallTimeout(f"no whole reply in {c.timeout_s:g} s (providers.timeout_s)")
            meter.notice(f"waiting for {model} {time.monotonic() - t0:.0f} s (call {n}/{c.retry.attempts})")

    def _cause(self, e: BaseException, kind: str) -> str:
        if kind == "timeout" and not isinstance(e, CallTimeout):
            connecting = isinstance(e.__cause__, httpx_module().ConnectTimeout)
            return (f"timeout: {'no connection' if connecting else 'silent'} for "
                    f"{self.common.connect_timeout_s if connecting else self.common.idle_timeout_s:g} s "
                    f"(providers.{'connect' if connecting else 'idle'}_timeout_s)")
        return f"{kind}: {_what(e)}"

    def complete(self, model: str, system: str, messages: list[Message], meter: Meter | None = None) -> tuple[Reply, int]:
        """The reply and how many calls it took."""
        meter = meter or Meter(self.common)
        r, fared, faults, first = self.common.retry, meter.of(self.name), [], 0.0
        for n in range(1, r.attempts + 1):
            if why := meter.refusal(model, system, messages, self.common.max_output_tokens):
                raise Halted(why, n - 1, faults)
            fared.calls += 1
            try:
                reply = self._call(model, system, messages, meter, n)
            except Halted as e:
                fared.cut += 1
                raise Halted(e.why, n, faults) from None
            except Exception as e:
                kind = fault_kind(e)
                if kind is None:
                    if isinstance(e, tuple(sdk.APIError for sdk in sdks())):
                        fared.reached = True
                        raise ProviderStop(_why_fatal(e, self.name, self.pcfg.api_key_env)) from None
                    raise
                fared.reached |= answered(e)
                fared.faults[kind] += 1
                first = first or time.monotonic()
                fared.first_failure = fared.first_failure or first
                cause = self._cause(e, kind)
                faults.append(f"call {n}: {cause}")
                if n == r.attempts:
                    raise ProviderDown(f"{self.name}: gave up after {n} attempts; last: {_what(e)}", n, faults, first) from None
                wait = min(r.initial_s * 2 ** (n - 1), r.max_s) + random.uniform(0, r.initial_s)
                asked, why_wait = retry_after(e), ""
                if asked is not None:
                    wait = max(wait, min(asked, r.max_retry_after_s))
                    why_wait = f" (Retry-After {asked:g} s" + (f", capped at providers.retry.max_retry_after_s"
                                                                if asked > r.max_retry_after_s else "") + ")"
                    faults[-1] += f"; waited {wait:.0f} s{why_wait}"
                if stop := self._unreached(fared, wait):
                    raise ProviderStop(stop) from None
                line = f"{model}: {cause[:160]}; retry {n + 1}/{r.attempts} in "
                if why := pause(wait, meter.halt, lambda left: meter.notice(f"{line}{left:.0f} s{why_wait}")):
                    raise Halted(why, n, faults) from None
                continue
            fared.answered += 1
            fared.reached = True
            reply.faults = faults
            return reply, n
        raise AssertionError("unreachable")

    def check(self) -> None:
        """One call that costs no tokens (listing models): a key the service refuses raises ProviderStop now, and
        so does a service that sends no HTTP reply at all for `outage.unreached_s`. Anything else (a compatible
        server without that endpoint, a slow one) is left to the run's own retries and waits."""
        limit, t0, calls = self.common.outage.unreached_s, time.monotonic(), 0
        client = self.client.with_options(timeout=min(self.common.timeout_s, _CHECK_TIMEOUT_S))
        while True:
            calls += 1
            try:
                return self._list(client)
            except tuple(sdk.APIError for sdk in sdks()) as e:
                if status_of(e) in (401, 403):
                    raise ProviderStop(_why_fatal(e, self.name, self.pcfg.api_key_env)) from None
                if answered(e) or limit is None or fault_kind(e) != "connection":
                    return
                if time.monotonic() - t0 >= limit:
                    fared = Fared(first_failure=t0, calls=calls)
                    raise ProviderStop(self._unreached(fared) + f"; last: {_what(e)}") from None
                time.sleep(min(2.0, limit / 10 + 0.01))

    def _list(self, client) -> None:
        raise NotImplementedError


class OpenAIChat(_Base):
    name, env_url = "openai", "OPENAI_BASE_URL"

    def __init__(self, pcfg: ProviderConfig, common: ProvidersConfig) -> None:
        super().__init__(pcfg, common)
        self.client = sdks()[0].OpenAI(api_key=self.key, base_url=pcfg.base_url, timeout=common.timeout_s, max_retries=0)

    def _read(self, model, system, messages, timeout, cancel) -> Reply:
        return openai_reply(self.client, model, system, messages, self.common.max_output_tokens, timeout,
                            self.common.max_reply_chars, cancel)

    def _list(self, client) -> None:
        client.models.list()


class AnthropicMessages(_Base):
    name, env_url = "anthropic", "ANTHROPIC_BASE_URL"

    def __init__(self, pcfg: ProviderConfig, common: ProvidersConfig) -> None:
        super().__init__(pcfg, common)
        self.client = sdks()[1].Anthropic(api_key=self.key, base_url=pcfg.base_url, timeout=common.timeout_s,
                                          max_retries=0)

    def _read(self, model, system, messages, timeout, cancel) -> Reply:
        return anthropic_reply(self.client, model, system, messages, self.common.max_output_tokens, timeout,
                               self.common.max_reply_chars, cancel)

    def _list(self, client) -> None:
        client.models.list(limit=1)


PROVIDERS: dict[str, type[_Base]] = {"openai": OpenAIChat, "anthropic": AnthropicMessages}


def check_keys(common: ProvidersConfig, provider: str) -> None:
    """The keys of `provider` and of its fallback, tried before a run starts: a wrong one is said in one
    line (ProviderStop) before the heads are evaluated, which takes minutes on a GPU, not after."""
    llm = PROVIDERS[provider](getattr(common, provider), common)
    for who in (llm, llm.fallback):
        if who is not None:
            who.check()
