"""One call to an LLM service and its reply, read through the official SDKs and checked before use.

Every reply is streamed (Chat Completions with `stream_options.include_usage`, Messages with `stream`),
so a silence is seen as it happens: the SDK's read timeout is the idle timeout, a silence before the
first byte or between two chunks (`providers.idle_timeout_s`); the whole call's deadline is kept by the
caller (agent/llm/providers.py). A reply is read as the API's: an event stream whose events are the API's
objects, ended as the API ends it (a finish reason, `message_stop`), or, from a compatible server that
ignores `stream`, one JSON object of the API's shape. Anything else (a proxy's HTML page, invalid JSON,
a JSON string, an object without the API's fields, a stream cut short) is `Malformed`, its message
naming the content type and the first bytes: a fault the caller retries like a 5xx. A reply longer than
`providers.max_reply_chars` is read to its end (its tokens are paid for), its size and sha256 kept, its
text not (`Reply.over`): a malformed answer, never a fault and never sent back whole.
`fault_kind` sorts what a call raised: retried (rate-limited, server, timeout, connection, malformed) or
not (None: authentication, an unknown model, a request refused).
Not here: retries, waits, deadlines, cost, what a reply means (agent/llm/providers.py, planner, coder).
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field

HEAD_BYTES = 120                # the first bytes of a malformed reply that its message quotes
_TRANSIENT_STATUS = {408, 409, 429}


class Fault(Exception):
    """A call that gave no usable reply; the next one may. `kind` names it for the tally."""
    kind = "fault"


class Malformed(Fault):
    kind = "malformed"


class CallTimeout(Fault):
    kind = "timeout"


@dataclass
class Reply:
    text: str
    input_tokens: int
    output_tokens: int
    finish: str                 # the API's own word: stop, length, end_turn, max_tokens, ...
    chars: int = 0              # the reply's size in characters, whole
    sha256: str = ""            # of the whole reply, set when it was over the cap (then `text` is empty)
    estimated: bool = False     # the service reported no usage: tokens estimated from characters
    faults: list[str] = field(default_factory=list)     # the calls that failed before this one, and why

    @property
    def over(self) -> bool:
        return bool(self.sha256)

    @property
    def cut(self) -> bool:
        return self.finish in ("length", "max_tokens")


def sdks():
    """The SDKs, imported on first use: a run of the built-in proposer never needs them."""
    import anthropic
    import openai
    return openai, anthropic


def httpx_module():
    """The SDKs' HTTP client: httpx2 in the SDKs installed here, httpx in older ones."""
    try:
        import httpx2 as module
    except ImportError:
        import httpx as module
    return module


def status_of(e: BaseException) -> int | None:
    return getattr(e, "status_code", None)


def fault_kind(e: BaseException) -> str | None:
    """What kind of retryable fault `e` is, or None when retrying cannot fix it."""
    openai, anthropic = sdks()
    http = httpx_module()
    if isinstance(e, Fault):
        return e.kind
    if isinstance(e, (openai.APITimeoutError, anthropic.APITimeoutError, http.TimeoutException)):
        return "timeout"
    if isinstance(e, (openai.APIConnectionError, anthropic.APIConnectionError, http.TransportError)):
        return "connection"
    status = status_of(e)
    if status == 429:
        return "rate-limited"
    if status is not None and (status in _TRANSIENT_STATUS or status >= 500):
        return "server"
    if status is None and isinstance(e, (openai.APIError, anthropic.APIError)):
        return "server"             # an error event inside a stream
    return None


def answered(e: BaseException) -> bool:
    """Whether the service sent an HTTP reply at all (a status, a body), as opposed to none."""
    return isinstance(e, Malformed) or status_of(e) is not None


def retry_after(e: BaseException) -> float | None:
    """The wait a service asked for (retry-after-ms, else retry-after in seconds), if any."""
    headers = getattr(getattr(e, "response", None), "headers", None) or {}
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            value = float(headers.get(name, ""))
        except ValueError:
            continue
        if value >= 0:
            return value * scale
    return None


def _head(data: bytes | str) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return repr(" ".join(text[:HEAD_BYTES].split()))


class _Text:
    """A reply's text as it streams: kept up to the cap, counted and hashed whole."""

    def __init__(self, cap: int) -> None:
        self.cap, self.parts, self.kept, self.chars = cap, [], 0, 0
        self.hash = hashlib.sha256()

    def add(self, piece) -> None:
        if not isinstance(piece, str):
            raise Malformed(f"text/event-stream: a text delta that is not a string: {_head(repr(piece))}")
        self.chars += len(piece)
        self.hash.update(piece.encode())
        if self.kept < self.cap:
            self.parts.append(piece)
            self.kept += len(piece)

    def reply(self, input_tokens, output_tokens, finish: str) -> Reply:
        over = self.chars > self.cap
        estimated = not isinstance(output_tokens, int) or not isinstance(input_tokens, int)
        return Reply(text="" if over else "".join(self.parts),
                     input_tokens=input_tokens if isinstance(input_tokens, int) else 0,
                     output_tokens=output_tokens if isinstance(output_tokens, int) else max(1, self.chars // 4),
                     finish=finish, chars=self.chars, sha256=self.hash.hexdigest() if over else "", estimated=estimated)


def _whole_json(response, cap: int) -> dict:
    """A body that is not an event stream: the API's JSON object, or Malformed naming what it is."""
    ctype = response.headers.get("content-type", "(none)")
    data = b""
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > 4 * cap + 65536:
            break
    response.close()
    if "json" not in ctype:
        return _malformed(f"{ctype}, not the API's reply: {_head(data)}")
    try:
        body = json.loads(data)
    except ValueError:
        return _malformed(f"{ctype}, invalid JSON: {_head(data)}")
    if not isinstance(body, dict):
        return _malformed(f"{ctype}, a JSON {type(body).__name__}, not an object: {_head(data)}")
    return body


def _malformed(message: str):
    raise Malformed(message)


def _streamed(response) -> bool:
    return "text/event-stream" in response.headers.get("content-type", "")


def _events(stream):
    """The SDK's stream, its JSON and shape errors as Malformed naming the event's first bytes."""
    try:
        yield from stream
    except json.JSONDecodeError as e:
        raise Malformed(f"text/event-stream, an event that is not JSON: {_head(e.doc)}") from None
    except (TypeError, AttributeError, KeyError, ValueError) as e:
        raise Malformed(f"text/event-stream, an event not of the API's shape ({type(e).__name__}: {_head(str(e))})") from None


def _get(obj, name: str, kind: type | tuple):
    value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    if not isinstance(value, kind):
        raise Malformed(f"{'an event' if not isinstance(obj, dict) else 'the JSON'} without the API's "
                        f"{name!r} ({type(value).__name__}): {_head(repr(obj))}")
    return value


def openai_reply(client, model: str, system: str, messages: list[dict], max_tokens: int, timeout,
                 cap: int, cancel: threading.Event) -> Reply:
    sent = [{"role": "system", "content": system}] + messages
    stream = client.chat.completions.create(model=model, messages=sent, max_completion_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True}, timeout=timeout)
    text = _Text(cap)
    if not _streamed(stream.response):
        body = _whole_json(stream.response, cap)
        choice = _get(body, "choices", list)[:1]
        message = _get(choice[0], "message", dict) if choice else {}
        text.add(message.get("content") or "")
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        return text.reply(usage.get("prompt_tokens"), usage.get("completion_tokens"),
                          (choice[0].get("finish_reason") if choice else "") or "")
    finish, usage = "", None
    try:
        for chunk in _events(stream):
            if cancel.is_set():
                raise CallTimeout("cut while streaming")
            for c in _get(chunk, "choices", list):
                delta = getattr(c, "delta", None)
                if delta is not None and getattr(delta, "content", None) is not None:
                    text.add(delta.content)
                finish = getattr(c, "finish_reason", None) or finish
            usage = getattr(chunk, "usage", None) or usage
    finally:
        stream.close()
    if not finish:
        raise Malformed(f"text/event-stream ended before the reply did (no finish_reason after {text.chars} characters)")
    return text.reply(getattr(usage, "prompt_tokens", None), getattr(usage, "completion_tokens", None), finish)


def anthropic_reply(client, model: str, system: str, messages: list[dict], max_tokens: int, timeout,
                    cap: int, cancel: threading.Event) -> Reply:
    stream = client.messages.create(model=model, system=system, max_tokens=max_tokens, messages=messages, stream=True,
                                    timeout=timeout)
    text = _Text(cap)
    if not _streamed(stream.response):
        body = _whole_json(stream.response, cap)
        for block in _get(body, "content", list):
            if isinstance(block, dict) and block.get("type") == "text":
                text.add(block.get("text") or "")
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        return text.reply(usage.get("input_tokens"), usage.get("output_tokens"), body.get("stop_reason") or "")
    finish, n_in, n_out, ended = "", None, None, False
    try:
        for event in _events(stream):
            if cancel.is_set():
                raise CallTimeout("cut while streaming")
            kind = _get(event, "type", str)
            if kind == "message_start":
                n_in = getattr(getattr(getattr(event, "message", None), "usage", None), "input_tokens", None)
            elif kind == "content_block_delta" and getattr(event.delta, "type", "") == "text_delta":
                text.add(event.delta.text)
            elif kind == "message_delta":
                finish = getattr(event.delta, "stop_reason", None) or finish
                n_out = getattr(getattr(event, "usage", None), "output_tokens", None)
            elif kind == "message_stop":
                ended = True
    finally:
        stream.close()
    if not ended:
        raise Malformed(f"text/event-stream ended before message_stop (after {text.chars} characters)")
    return text.reply(n_in, n_out, finish)
