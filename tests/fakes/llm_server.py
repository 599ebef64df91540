"""A fake LLM service on loopback speaking the OpenAI Chat Completions and Anthropic Messages APIs over
real HTTP, so the real SDKs talk to it. Scripted per model: each model has a queue of steps, a reply
text or an HTTP error, served in order; every request is kept for the test to inspect. It lists its
models (GET .../models, as both services do), and given `keys` it refuses any other key with 401, as a
real service does, on every request.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


@dataclass
class Step:
    text: str = ""
    status: int = 200
    message: str = ""

    @classmethod
    def error(cls, status: int, message: str = "") -> "Step":
        return cls(status=status, message=message or f"fake error {status}")


_OPENAI_ERR = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded", 400: "context_length_exceeded"}
_ANTHROPIC_ERR = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 400: "invalid_request_error",
                  529: "overloaded_error"}


def _error(api: str, status: int, message: str) -> tuple[int, dict]:
    if api == "openai":
        return status, {"error": {"message": message, "type": "fake", "code": _OPENAI_ERR.get(status, "server_error")}}
    return status, {"type": "error", "error": {"type": _ANTHROPIC_ERR.get(status, "api_error"), "message": message}}


@dataclass
class Seen:
    api: str            # openai | anthropic
    model: str
    headers: dict
    body: dict


@dataclass
class FakeLLM:
    scripts: dict[str, list[Step | str | Callable[[dict], Step | str]]]
    seen: list[Seen] = field(default_factory=list)        # completions asked for
    keys: set[str] | None = None                          # None: any key is taken
    listed: list[Seen] = field(default_factory=list)      # model lists asked for
    lists_models: bool = True                             # False: a compatible server without that endpoint

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                api = "anthropic" if self.path.rstrip("/").endswith("/messages") else "openai"
                self._send(*(fake._refused(api, self.headers) or fake._answer(api, dict(self.headers), body)))

            def do_GET(self) -> None:
                api = "anthropic" if "anthropic-version" in {k.lower() for k in self.headers} else "openai"
                fake.listed.append(Seen(api, "", dict(self.headers), {}))
                if not fake.lists_models or not self.path.split("?")[0].rstrip("/").endswith("/models"):
                    return self._send(404, {"detail": "Not Found"})
                self._send(*(fake._refused(api, self.headers) or fake._models(api)))

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "FakeLLM":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
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

    def _answer(self, api: str, headers: dict, body: dict) -> tuple[int, dict]:
        model = body.get("model", "")
        with self.lock:
            self.seen.append(Seen(api, model, headers, body))
            queue = self.scripts.get(model)
            step = queue.pop(0) if queue else Step.error(400, f"fake: no script left for model {model!r}")
        if callable(step):
            step = step(body)
        if isinstance(step, str):
            step = Step(text=step)
        if step.status != 200:
            return _error(api, step.status, step.message)
        n_in, n_out = len(json.dumps(body)) // 4, max(1, len(step.text) // 4)
        if api == "openai":
            return 200, {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": model,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": step.text},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}
        return 200, {"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
                     "content": [{"type": "text", "text": step.text}], "stop_reason": "end_turn",
                     "stop_sequence": None, "usage": {"input_tokens": n_in, "output_tokens": n_out}}
