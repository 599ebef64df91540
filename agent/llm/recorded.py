"""The recorded LLM: a past run's planner and coder exchanges, answered again with no key and no network.

`kevo-agent replay runs/<id> --llm recorded` drives the real loop with it (agent/rejudging/rerun.py). The
proposer says which candidate it is writing or repairing (per thread: a repair and the next proposal
overlap); each planner or coder call then takes that candidate's next recorded exchange of the same
role, in the order it was made (candidates/<id>/exchanges.jsonl). When the prompt sent today differs
from the recorded one — prompts, knowledge or evidence changed — the recorded reply is still given and
the first difference is kept as a `Divergence`; when nothing is left to answer with, the call stops the
run (`ProviderStop`) naming the candidate and the role. Recorded token counts are replayed, so the cost
meter and a cost limit read as they did then; nothing is spent.
Not here: reading the run, comparing decisions (rejudging/rerun.py), deciding anything (loop, roles).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from harness.config import Config
from harness.sandbox import redact

from agent.roles.coder import Coder
from agent.knowledge import Catalog
from agent.roles.planner import Planner
from agent.roles.proposers import LLMProposer, Proposer
from agent.llm.providers import Meter, ProviderStop, Reply
from agent.records import Exchange, Message, Proposal, Record
from agent.run.state import ProposalState

ROLES = ("planner", "coder")


class Divergence(Record):
    """A call answered from the recording although today's prompt differs from the recorded one."""
    candidate: str
    role: str
    purpose: str                    # the recorded exchange's
    what: str                       # the first difference, today's text against the recorded


def _first_difference(label: str, now: str, then: str) -> str:
    a, b = now.splitlines() or [""], then.splitlines() or [""]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    x, y = (a[i] if i < len(a) else "(ends)"), (b[i] if i < len(b) else "(ends)")
    return f"{label} differs at line {i + 1}: today {x[:120]!r}, recorded {y[:120]!r}"


def difference(ex: Exchange, model: str, system: str, messages: list[Message]) -> str:
    """The first way today's request differs from the recorded one; empty when it is the same."""
    if model != ex.model:
        return f"model {model!r} today, {ex.model!r} recorded"
    if len(messages) != len(ex.messages):
        return f"{len(messages)} message(s) sent today, {len(ex.messages)} recorded"
    if redact(system) != ex.system:
        return _first_difference("the system prompt", redact(system), ex.system)
    for i, (m, r) in enumerate(zip(messages, ex.messages), 1):
        if m.role != r.role:
            return f"message {i} is from the {m.role} today, from the {r.role} recorded"
        if redact(m.content) != r.content:
            return _first_difference(f"message {i} ({m.role})", redact(m.content), r.content)
    return ""


class Recording:
    """A run's exchanges per candidate, handed out in order per role; thread-safe."""

    def __init__(self, exchanges: dict[str, list[Exchange]]) -> None:
        self.exchanges = exchanges
        self.used: dict[tuple[str, str], int] = {}
        self.divergences: list[Divergence] = []
        self._lock = threading.Lock()
        self._local = threading.local()

    @property
    def calls(self) -> int:
        return sum(len(v) for v in self.exchanges.values())

    def bind(self, candidate: str) -> None:
        """The candidate this thread's next calls are for."""
        self._local.candidate = candidate

    def answer(self, role: str, model: str, system: str, messages: list[Message]) -> Exchange:
        cid = getattr(self._local, "candidate", "(no candidate)")
        with self._lock:
            mine = [e for e in self.exchanges.get(cid, []) if e.role == role]
            n = self.used.get((cid, role), 0)
            if n >= len(mine):
                miss = (f"nothing matches: {cid} asked the {role} for reply {n + 1}; the run recorded "
                        f"{len(mine)} {role} exchange(s) for {cid}")
                raise ProviderStop(f"recorded: {miss}")
            self.used[(cid, role)] = n + 1
            ex = mine[n]
            what = difference(ex, model, system, messages)
            if what:
                self.divergences.append(Divergence(candidate=cid, role=role, purpose=ex.purpose, what=what))
            return ex

    def unasked(self) -> list[str]:
        """Recorded exchanges today's run never asked for, per candidate and role."""
        lines = []
        for cid, exchanges in sorted(self.exchanges.items()):
            for role in ROLES:
                left = [e for e in exchanges if e.role == role][self.used.get((cid, role), 0):]
                if left:
                    lines.append(f"{cid}: {len(left)} recorded {role} exchange(s) never asked for "
                                 f"({', '.join(e.purpose for e in left)})")
        return lines


class RecordedLLM:
    """The `LLM` protocol for one role, answered from a Recording."""
    name = "recorded"

    def __init__(self, recording: Recording, role: str) -> None:
        self.recording, self.role = recording, role

    def complete(self, model: str, system: str, messages: list[Message], meter: Meter | None = None) -> tuple[Reply, int]:
        ex = self.recording.answer(self.role, model, system, messages)
        finish = ex.finish or ("length" if "output-token limit" in ex.note else "stop")
        return Reply(ex.reply, ex.input_tokens, ex.output_tokens, finish, ex.reply_chars, ex.reply_sha256), 1


class RecordedProposer(LLMProposer):
    """The LLM proposer (planner and coder) that tells the recording which candidate it works on."""

    def __init__(self, recording: Recording, name: str, planner: Planner, coder: Coder) -> None:
        super().__init__(name, planner, coder)
        self.recording = recording

    def propose(self, state: ProposalState) -> Proposal:
        self.recording.bind(state.next_id)
        return super().propose(state)

    def repair(self, proposal: Proposal, source: str, feedback: str, round_no: int):
        self.recording.bind(proposal.id)
        return super().repair(proposal, source, feedback, round_no)


def recorded_proposer(recording: Recording) -> Callable[..., Proposer]:
    """A factory with the signature of agent/roles/proposers.py's PROPOSERS entries."""
    def make(cfg: Config, target: str, device: torch.device, arch: str, catalog: Catalog, meter: Meter,
             planner_model: str, coder_model: str) -> Proposer:
        planner = Planner(RecordedLLM(recording, "planner"), meter, planner_model, cfg, target, device, catalog, arch)
        coder = Coder(RecordedLLM(recording, "coder"), meter, coder_model, cfg, target, device, catalog, arch)
        return RecordedProposer(recording, f"recorded:{planner_model}/{coder_model}", planner, coder)
    return make
