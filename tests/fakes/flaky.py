"""A fake LLM service that is down: 503 to every request while `down(api)` says so, its script kept for
when it is back. For outages longer than a provider's retries."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from fakes.llm_server import FakeLLM, Seen, Step


@dataclass
class FlakyLLM(FakeLLM):
    down: Callable[[str], bool] = lambda api: False

    def _next(self, api: str, headers: dict, body: dict) -> Step:
        if not self.down(api):
            return super()._next(api, headers, body)
        with self.lock:
            self.seen.append(Seen(api, body.get("model", ""), headers, body, time.monotonic()))
        return Step.error(503, "fake outage")


def down_for(seconds: float) -> Callable[[str], bool]:
    """Down from the first request on, for `seconds`."""
    first: list[float] = []

    def down(api: str) -> bool:
        first.append(time.monotonic())
        return first[-1] - first[0] < seconds
    return down
