"""LLM providers through their official SDKs: one `LLM` protocol, a registry, retries, cost.

`openai` speaks the Chat Completions API (and, with a base URL, any OpenAI-compatible server: vLLM,
SGLang, llama.cpp, ollama); `anthropic` speaks the Messages API. The SDKs' own retries are off:
tenacity retries rate limits, server errors, timeouts and dropped connections with jittered
exponential backoff. What retrying cannot fix (authentication, an unknown model, a request too
long for the context) raises `ProviderStop`: the run stops with its one line. Retries that run out
mean the provider is down (`ProviderDown`): `ask` then asks the fallback provider if one is configured
(`providers.fallback`, with its own models; it stays first while it answers), and when none answers it
waits (`providers.outage`: doubling waits, capped) and asks again — for up to `give_up_s`, or until the
run must stop (`Meter.halt`: a signal, the time budget). Keys come from the environment
(harness/config.py) and are never recorded.
Not here: what is asked (planner, coder) or what a reply means.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

from tenacity import RetryError, Retrying, retry_if_exception, stop_after_attempt, wait_exponential, wait_random

from harness.config import ProviderConfig, ProvidersConfig
from harness.sandbox import redact

from agent.records import Exchange, Message


class ProviderStop(Exception):
    """An LLM failure that retrying cannot fix; the run stops. The message is one line."""


class ProviderDown(ProviderStop):
    """A provider's retries ran out on transient errors (or the run stopped while waiting for it)."""

    def __init__(self, message: str, attempts: int = 0) -> None:
        super().__init__(message)
        self.attempts = attempts


class Reply:
    def __init__(self, text: str, input_tokens: int, output_tokens: int, finish: str) -> None:
        self.text, self.input_tokens, self.output_tokens, self.finish = text, input_tokens, output_tokens, finish


class LLM(Protocol):
    """`complete` returns the reply and how many calls it took. A provider that can be down also has
    `outage` (how long to wait for it) and `fallback` (another LLM to ask meanwhile, or None)."""
    name: str

    def complete(self, model: str, system: str, messages: list[Message]) -> tuple[Reply, int]: ...


_TRANSIENT_STATUS = {408, 409, 429}
_CHECK_TIMEOUT_S = 20.0         # the key check at start: a service this slow is left to the run's waits


def _sdks():
    """The SDKs, imported on first use: a run of the built-in proposer never needs them."""
    import anthropic
    import openai
    return openai, anthropic


def _status(e: BaseException) -> int | None:
    return getattr(e, "status_code", None)


def _transient(e: BaseException) -> bool:
    openai, anthropic = _sdks()
    if isinstance(e, (openai.APITimeoutError, anthropic.APITimeoutError,
                      openai.APIConnectionError, anthropic.APIConnectionError)):
        return True
    status = _status(e)
    return status is not None and (status in _TRANSIENT_STATUS or status >= 500)


def _what(e: BaseException) -> str:
    status = _status(e)
    body = getattr(e, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    text = (inner.get("message") if isinstance(inner, dict) else None) or str(e) or type(e).__name__
    first = redact(" ".join(str(text).split()))[:240]
    return f"{status} {first}" if status else f"{type(e).__name__}: {first}"


def _why_fatal(e: BaseException, provider: str, key_env: str | None) -> str:
    status = _status(e)
    if status in (401, 403):
        return f"{provider}: authentication failed ({_what(e)}); check {key_env or 'the server'}"
    if status == 404:
        return f"{provider}: unknown model or endpoint ({_what(e)})"
    if status in (400, 413, 422):
        return f"{provider}: request refused, not retried ({_what(e)})"
    return f"{provider}: {_what(e)}"


class _Base:
    name = "base"

    def __init__(self, pcfg: ProviderConfig, common: ProvidersConfig) -> None:
        self.pcfg, self.common = pcfg, common
        self.key = pcfg.api_key(self.name)
        self.outage = common.outage
        other = common.fallback
        self.fallback = PROVIDERS[other](getattr(common, other), common) if other and other != self.name else None
        self.prefer_fallback = False    # set while the fallback answers and this one is down

    def _once(self, model: str, system: str, messages: list[Message]) -> Reply:
        raise NotImplementedError

    def complete(self, model: str, system: str, messages: list[Message]) -> tuple[Reply, int]:
        """The reply and how many calls it took."""
        r = self.common.retry
        wait = wait_exponential(multiplier=r.initial_s, max=r.max_s) + wait_random(0, r.initial_s)   # jittered
        retrying = Retrying(stop=stop_after_attempt(r.attempts), wait=wait,
                            retry=retry_if_exception(_transient), reraise=False)
        try:
            for attempt in retrying:
                with attempt:
                    return self._once(model, system, messages), attempt.retry_state.attempt_number
        except RetryError as e:
            last = e.last_attempt.exception()
            raise ProviderDown(f"{self.name}: gave up after {r.attempts} attempts; last: {_what(last)}", r.attempts) from None
        except tuple(sdk.APIError for sdk in _sdks()) as e:
            raise ProviderStop(_why_fatal(e, self.name, self.pcfg.api_key_env)) from None
        raise AssertionError("unreachable")

    def check(self) -> None:
        """One call that costs no tokens (listing models): a key the service refuses raises ProviderStop now.
        Anything else (the service down, a compatible server without that endpoint) is left to the run's
        own retries and waits."""
        try:
            self._list(self.client.with_options(timeout=min(self.common.timeout_s, _CHECK_TIMEOUT_S)))
        except tuple(sdk.APIError for sdk in _sdks()) as e:
            if _status(e) in (401, 403):
                raise ProviderStop(_why_fatal(e, self.name, self.pcfg.api_key_env)) from None

    def _list(self, client) -> None:
        raise NotImplementedError


class OpenAIChat(_Base):
    name = "openai"

    def __init__(self, pcfg: ProviderConfig, common: ProvidersConfig) -> None:
        super().__init__(pcfg, common)
        self.client = _sdks()[0].OpenAI(api_key=self.key, base_url=pcfg.base_url, timeout=common.timeout_s, max_retries=0)

    def _once(self, model: str, system: str, messages: list[Message]) -> Reply:
        sent = [{"role": "system", "content": system}] + [m.model_dump() for m in messages]
        r = self.client.chat.completions.create(model=model, messages=sent,
                                                max_completion_tokens=self.common.max_output_tokens)
        choice = r.choices[0] if r.choices else None
        usage = r.usage
        return Reply((choice.message.content if choice else "") or "", getattr(usage, "prompt_tokens", 0) or 0,
                     getattr(usage, "completion_tokens", 0) or 0, (choice.finish_reason if choice else "") or "")

    def _list(self, client) -> None:
        client.models.list()


class AnthropicMessages(_Base):
    name = "anthropic"

    def __init__(self, pcfg: ProviderConfig, common: ProvidersConfig) -> None:
        super().__init__(pcfg, common)
        self.client = _sdks()[1].Anthropic(api_key=self.key, base_url=pcfg.base_url, timeout=common.timeout_s,
                                           max_retries=0)

    def _once(self, model: str, system: str, messages: list[Message]) -> Reply:
        r = self.client.messages.create(model=model, system=system, max_tokens=self.common.max_output_tokens,
                                        messages=[m.model_dump() for m in messages])
        text = "".join(getattr(b, "text", "") for b in r.content if getattr(b, "type", "") == "text")
        return Reply(text, r.usage.input_tokens or 0, r.usage.output_tokens or 0, r.stop_reason or "")

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


class Meter:
    """Tokens and dollars, per call and in total, from the config's price table; thread-safe. The run also
    tells its calls through it when to stop waiting for a provider (`halt`: why, or "") and where to say
    that it waits (`notice`)."""

    def __init__(self, common: ProvidersConfig, spent_usd: float = 0.0, tokens: tuple[int, int] = (0, 0)) -> None:
        self.prices = common.prices
        self.lock = threading.Lock()
        self.cost_usd, (self.input_tokens, self.output_tokens) = spent_usd, tokens
        self.halt: Callable[[], str] = lambda: ""
        self.notice: Callable[[str], None] = lambda text: None

    def charge(self, model: str, input_tokens: int, output_tokens: int) -> float:
        price = self.prices[model]
        cost = (input_tokens * price.input + output_tokens * price.output) / 1e6
        with self.lock:
            self.cost_usd += cost
            self.input_tokens += input_tokens
            self.output_tokens += output_tokens
        return cost


def _pause(seconds: float, halt: Callable[[], str]) -> str:
    """Sleep in short steps; why the run must stop, as soon as it must."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if why := halt():
            return why
        time.sleep(min(0.2, left))
    return halt()


def _outlast(llm: LLM, meter: Meter, model: str, role: str, system: str, messages: list[Message]):
    """(reply, calls, the LLM that answered, its model, a note on the outage): `llm`, its fallback while it
    is down, waiting between rounds as `llm.outage` says. Raises ProviderStop when nothing can fix it."""
    outage, fallback = getattr(llm, "outage", None), getattr(llm, "fallback", None)
    chain = [(llm, model)] + ([(fallback, getattr(fallback.pcfg, f"{role}_model"))] if fallback is not None else [])
    if getattr(llm, "prefer_fallback", False):
        chain.reverse()
    calls, since, wait, waits, down = 0, 0.0, outage.wait_s if outage else 0.0, 0, []
    while True:
        for who, m in chain:
            try:
                reply, n = who.complete(m, system, messages)
            except ProviderDown as e:
                calls, last, since = calls + e.attempts, str(e), since or time.monotonic()
                down += [who.name] if who.name not in down else []
                if outage is None or (outage.give_up_s == 0 and fallback is None):
                    raise ProviderStop(last) from None      # configured not to wait
                continue
            if fallback is not None:
                llm.prefer_fallback = who is fallback      # the one that answered is asked first next time
            note = "" if not down else (f"{' and '.join(down)} down for {time.monotonic() - since:.0f} s "
                                        f"({waits} wait(s)); answered by {who.name} {m}")
            return reply, calls + n, who, m, note
        names, lasted = " and ".join(down), time.monotonic() - since
        if outage.give_up_s is not None and lasted + wait > outage.give_up_s:
            raise ProviderStop(f"{names} down for {lasted / 60:.1f} min, past providers.outage.give_up_s "
                               f"({outage.give_up_s:g} s); last: {last}")
        meter.notice(f"{names} down ({last}); asking again in {wait:.0f} s ({lasted:.0f} s down so far)")
        if why := _pause(wait, meter.halt):
            raise ProviderDown(f"stopped waiting for {names}: {why}; last: {last}", 0)
        waits, wait = waits + 1, min(wait * 2 if wait else 1.0, outage.max_wait_s)


def ask(llm: LLM, meter: Meter, model: str, role: str, purpose: str, system: str,
        messages: list[Message]) -> Exchange:
    """One recorded exchange, made through outages. Raises ProviderStop (ProviderDown when the run stopped
    while waiting); a reply cut short is returned, marked in `note`."""
    t0 = time.monotonic()
    reply, attempts, who, used, outage_note = _outlast(llm, meter, model, role, system, messages)
    cost = meter.charge(used, reply.input_tokens, reply.output_tokens)
    notes = [outage_note, "the reply was cut at the output-token limit" if reply.finish in ("length", "max_tokens") else ""]
    return Exchange(role=role, purpose=purpose, provider=who.name, model=used, system=system, messages=messages,
                    reply=reply.text, input_tokens=reply.input_tokens, output_tokens=reply.output_tokens,
                    cost_usd=round(cost, 6), attempts=attempts, seconds=round(time.monotonic() - t0, 3),
                    note="; ".join(n for n in notes if n))
