"""The run's account of its LLM calls, shared by every thread that makes one: tokens and dollars (from
the config's price table), how each provider fared (`Fared`: calls, answers, faults by kind, calls cut,
outages), and the run's side of a call — why it must not be made or must end now (`refusal`: a signal,
the time budget, a cost limit the call's worst case would pass), where its live line goes (`notice`),
who commits a paid exchange at once (`on_paid`), and the exchanges an earlier session already paid
for (`prepaid`, per candidate; the thread says which candidate it works on with `bind`).
Not here: making calls (agent/llm/providers.py), the ledger (agent/run/loop.py).
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field
from typing import Callable

from harness.config import ProvidersConfig

from agent.records import Exchange, Message

FAULT_KINDS = ("timeout", "malformed", "rate-limited", "server", "connection")


@dataclass
class Fared:
    """How one provider fared over the run (all its sessions)."""
    calls: int = 0                  # HTTP requests made
    answered: int = 0               # calls that gave a reply that was used (and paid for)
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))
    cut: int = 0                    # calls in flight when the run had to stop (paid, if the service finished them)
    outages: int = 0                # exchanges that waited for it: their retries ran out at least once
    outage_s: float = 0.0           # from the first failed call of each outage to its answer or the run's stop
    reached: bool = False           # an HTTP reply came back at least once (this session)
    first_failure: float = 0.0      # time.monotonic() of this session's first failed call, 0 if none

    def line(self, name: str) -> str:
        failed = sum(self.faults.values())
        kinds = ", ".join(f"{n} {k}" for k, n in self.faults.items() if n)
        return (f"{name}: {self.calls} calls, {self.answered} answered, {failed} failed"
                + (f" ({kinds})" if kinds else "") + f", {self.cut} cut by the run's stop; "
                f"{self.outages} outage(s), {self.outage_s:.0f} s down")

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("reached", "first_failure")}


class Meter:
    def __init__(self, common: ProvidersConfig, spent_usd: float = 0.0, tokens: tuple[int, int] = (0, 0)) -> None:
        self.prices = common.prices
        self.lock = threading.Lock()
        self.cost_usd, (self.input_tokens, self.output_tokens) = spent_usd, tokens
        self.limit_usd: float | None = None     # the run's cost limit (0: nothing may be spent)
        self.halt: Callable[[], str] = lambda: ""
        self.notice: Callable[[str], None] = lambda text: None
        self.on_paid: Callable[[str, Exchange], None] = lambda candidate, exchange: None
        self.prepaid: dict[str, list[Exchange]] = {}
        self.fared: dict[str, Fared] = {}
        self._local = threading.local()

    def charge(self, model: str, input_tokens: int, output_tokens: int) -> float:
        price = self.prices[model]
        cost = (input_tokens * price.input + output_tokens * price.output) / 1e6
        with self.lock:
            self.cost_usd += cost
            self.input_tokens += input_tokens
            self.output_tokens += output_tokens
        return cost

    def of(self, provider: str) -> Fared:
        with self.lock:
            return self.fared.setdefault(provider, Fared())

    def restore(self, fared: dict) -> None:
        """The tally an earlier session committed (summary.json's `providers`)."""
        for name, d in fared.items():
            self.fared[name] = Fared(**{**d, "faults": {**dict.fromkeys(FAULT_KINDS, 0), **d.get("faults", {})}})

    def refusal(self, model: str, system: str, messages: list[Message], max_output_tokens: int) -> str:
        """Why this call must not be made now, or "": the run must stop, or its worst case (every output token
        it may write, its input at 3 characters a token) would pass the cost limit."""
        if why := self.halt():
            return why
        if self.limit_usd is None:
            return ""
        price = self.prices[model]
        n_in = (len(system) + sum(len(m.content) for m in messages)) // 3 + 1
        worst = (n_in * price.input + max_output_tokens * price.output) / 1e6
        with self.lock:
            left = self.limit_usd - self.cost_usd
        if worst > 0 and worst > left:
            return (f"cost limit of ${self.limit_usd:g} reached: the next call ({model}) could cost up to "
                    f"${worst:.4f}, ${max(left, 0):.4f} is left")
        return ""

    # -- paid exchanges ------------------------------------------------------------------------------

    def bind(self, candidate: str) -> None:
        """The candidate this thread's next calls are for."""
        self._local.candidate = candidate

    @property
    def candidate(self) -> str:
        return getattr(self._local, "candidate", "")

    def take_prepaid(self, role: str, purpose: str) -> Exchange | None:
        """The next exchange of this role and purpose an earlier session paid for, for the bound candidate."""
        with self.lock:
            mine = self.prepaid.get(self.candidate, [])
            for i, ex in enumerate(mine):
                if (ex.role, ex.purpose) == (role, purpose):
                    return mine.pop(i)
        return None

    def paid(self, exchange: Exchange) -> None:
        self.on_paid(self.candidate, exchange)
