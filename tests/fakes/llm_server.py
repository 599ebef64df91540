"""A fake LLM service on loopback speaking the OpenAI Chat Completions and Anthropic Messages APIs over
real HTTP, so the real SDKs talk to it: a request with `stream: true` is answered as an event stream of
the API's chunks, any other as one JSON object. Scripted per model: each model has a queue of steps,
served in order; every request is kept for the test to inspect. A step is a reply text, an HTTP error
(with headers, e.g. retry-after), or a misbehaviour: a 200 HTML page (a proxy's), a stream of invalid
JSON, a JSON body that is invalid, a JSON string, a hang before the first byte, a stall after the first
chunk, a stream that ends before the reply does, a reply cut at the output-token limit. It lists its
models (GET .../models, as both services do), and given `keys` it refuses any other key with 401, as a
real service does, on every request.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

HTML = ("<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body><h1>502 Bad Gateway</h1>"
        "<p>The proxy could not reach the upstream service.</p></body></html>")


@dataclass
class Step:
    text: str = ""
    status: int = 200
    message: str = ""
    headers: dict = field(default_factory=dict)
    kind: str = "reply"             # reply | html | garbage | bad-json | json-string | hang | stall | short
    seconds: float = 0.0            # hang / stall: how long to say nothing
    finish: str = "stop"            # stop, or length (cut at the output-token limit)

    @classmethod
    def error(cls, status: int, message: str = "", headers: dict | None = None) -> "Step":
        return cls(status=status, message=message or f"fake error {status}", headers=headers or {})

    @classmethod
    def odd(cls, kind: str, seconds: float = 0.0, text: str = "") -> "Step":
        return cls(kind=kind, seconds=seconds, text=text)

    @classmethod
    def cut(cls, text: str) -> "Step":
        return cls(text=text, finish="length")


_OPENAI_ERR = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded", 400: "context_length_exceeded"}
_ANTHROPIC_ERR = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 400: "invalid_request_error",
                  529: "overloaded_error"}


def _error(api: str, status: int, message: str) -> tuple[int, dict]:
    if api == "openai":
        return status, {"error": {"message": message, "type": "fake", "code": _OPENAI_ERR.get(status, "server_error")}}
    return status, {"type": "error", "error": {"type": _ANTHROPIC_ERR.get(status, "api_error"), "message": message}}


def _events(api: str, model: str, text: str, finish: str, n_in: int, n_out: int, pieces: int = 4) -> list[bytes]:
    """The API's event stream for one reply, in chunks of the text."""
    size = max(1, -(-len(text) // pieces))
    parts = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    if api == "openai":
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model}
        out = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": p}, "finish_reason": None}]}
               for p in parts]
        out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        out.append({**base, "choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                                      "total_tokens": n_in + n_out}})
        return [f"data: {json.dumps(e)}\n\n".encode() for e in out] + [b"data: [DONE]\n\n"]
    stop = "max_tokens" if finish == "length" else "end_turn"
    out = [("message_start", {"type": "message_start", "message": {
               "id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": n_in, "output_tokens": 1}}}),
           ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})]
    out += [("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": p}})
            for p in parts]
    out += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                               "usage": {"output_tokens": n_out}}),
            ("message_stop", {"type": "message_stop"})]
    return [f"event: {name}\ndata: {json.dumps(e)}\n\n".encode() for name, e in out]


def _whole(api: str, model: str, text: str, finish: str, n_in: int, n_out: int) -> dict:
    if api == "openai":
        return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}
    return {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": text}], "stop_reason": "max_tokens" if finish == "length" else "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": n_in, "output_tokens": n_out}}


@dataclass
class Seen:
    api: str            # openai | anthropic
    model: str
    headers: dict
    body: dict
    at: float = 0.0     # time.monotonic() when it came


@dataclass
class FakeLLM:
    scripts: dict[str, list[Step | str | Callable[[dict], Step | str]]]
    seen: list[Seen] = field(default_factory=list)        # completions asked for
    keys: set[str] | None = None                          # None: any key is taken
    listed: list[Seen] = field(default_factory=list)      # model lists asked for
    lists_models: bool = True                             # False: a compatible server without that endpoint
    served: dict[str, int] = field(default_factory=dict)  # what was served, by step kind (or HTTP status)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                api = "anthropic" if self.path.rstrip("/").endswith("/messages") else "openai"
                refused = fake._refused(api, self.headers)
                try:
                    if refused:
                        return self._send(*refused)
                    self._step(api, body, fake._next(api, dict(self.headers), body))
                except (BrokenPipeError, ConnectionResetError):
                    pass                                  # the client gave up on it: as a real service sees it

            def do_GET(self) -> None:
                api = "anthropic" if "anthropic-version" in {k.lower() for k in self.headers} else "openai"
                fake.listed.append(Seen(api, "", dict(self.headers), {}, time.monotonic()))
                if not fake.lists_models or not self.path.split("?")[0].rstrip("/").endswith("/models"):
                    return self._send(404, {"detail": "Not Found"})
                self._send(*(fake._refused(api, self.headers) or fake._models(api)))

            def _send(self, status: int, payload, ctype: str = "application/json", headers: dict | None = None) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, chunks: list[bytes], stall: float = 0.0, last: bool = True) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i, c in enumerate(chunks):
                    self.wfile.write(f"{len(c):x}\r\n".encode() + c + b"\r\n")
                    self.wfile.flush()
                    if i == 0 and stall:
                        fake._quiet(stall)
                if last:
                    self.wfile.write(b"0\r\n\r\n")
                self.close_connection = not last

            def _step(self, api: str, body: dict, step: Step) -> None:
                model, stream = body.get("model", ""), bool(body.get("stream"))
                fake._count(step.kind if step.status == 200 else str(step.status))
                if step.status != 200:
                    return self._send(*_error(api, step.status, step.message), headers=step.headers)
                n_in, n_out = len(json.dumps(body)) // 4, max(1, len(step.text) // 4)
                if step.kind == "hang":
                    fake._quiet(step.seconds)
                    return self._send(*_error(api, 504, "fake: hung, then gave up"))
                if step.kind == "html":
                    return self._send(200, HTML.encode(), "text/html; charset=utf-8")
                if step.kind == "bad-json":
                    return self._send(200, b'{"id": "chatcmpl-fake", "choices": [{"index": 0, "mess', "application/json")
                if step.kind == "json-string":
                    return self._send(200, b'"upstream says: try again later"', "application/json")
                if not stream:
                    return self._send(200, _whole(api, model, step.text, step.finish, n_in, n_out))
                events = _events(api, model, step.text, step.finish, n_in, n_out)
                if step.kind == "garbage":
                    name = b"event: content_block_delta\n" if api == "anthropic" else b""
                    return self._stream([events[0], name + b"data: {\"choices\": [{\"delta\": <<garbage>>\n\n"])
                if step.kind == "short":
                    return self._stream(events[:-3])      # a whole HTTP body, but the reply stops mid-way
                self._stream(events, stall=step.seconds if step.kind == "stall" else 0.0)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None     # a client that hung up mid-request
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "FakeLLM":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    @property
    def anthropic_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def left(self, model: str) -> int:
        return len(self.scripts.get(model, []))

    def _quiet(self, seconds: float) -> None:
        self.stopping.wait(seconds)

    def _count(self, kind: str) -> None:
        with self.lock:
            self.served[kind] = self.served.get(kind, 0) + 1

    def _refused(self, api: str, headers) -> tuple[int, dict] | None:
        if self.keys is None:
            return None
        key = headers.get("x-api-key") or headers.get("Authorization", "").removeprefix("Bearer ")
        return None if key in self.keys else _error(api, 401, "fake: incorrect API key provided")

    def _models(self, api: str) -> tuple[int, dict]:
        ids = sorted(self.scripts)
        if api == "openai":
            return 200, {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "fake"}
                                                    for m in ids]}
        data = [{"id": m, "type": "model", "display_name": m, "created_at": "2026-01-01T00:00:00Z"} for m in ids]
        return 200, {"data": data, "has_more": False, "first_id": ids[0] if ids else None,
                     "last_id": ids[-1] if ids else None}

    def _next(self, api: str, headers: dict, body: dict) -> Step:
        """The model's next step (every request is kept in `seen`)."""
        model = body.get("model", "")
        with self.lock:
            self.seen.append(Seen(api, model, headers, body, time.monotonic()))
            queue = self.scripts.get(model)
            step = queue.pop(0) if queue else Step.error(400, f"fake: no script left for model {model!r}")
        if callable(step):
            step = step(body)
        return Step(text=step) if isinstance(step, str) else step
