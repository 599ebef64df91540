"""Who proposes: the `Proposer` protocol and its registry (offline, openai, anthropic).

A proposer turns a ProposalState into a Proposal (or None when it has nothing left to try), and may
repair a candidate the compile stage rejected. The LLM proposer is a planner and a coder, each with
its own model; a claim under the minimum ceiling is returned as not worth coding, unwritten.
Not here: evaluating, recording, budgets (loop).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from harness.config import Config

from agent.roles.coder import Coder
from agent.reading.figures import anchors_text
from agent.knowledge import Catalog
from agent.roles.offline import OfflineProposer
from agent.roles.planner import Planner
from agent.llm.providers import PROVIDERS, Meter
from agent.records import Exchange, Proposal
from agent.run.state import ProposalState


class Proposer(Protocol):
    name: str
    instant: bool           # answers at once: no point proposing ahead while a candidate is evaluated

    def propose(self, state: ProposalState) -> Proposal | None: ...

    def repair(self, proposal: Proposal, source: str, feedback: str, round_no: int) -> tuple[str | None, list[Exchange]]: ...


class LLMProposer:
    instant = False

    def __init__(self, name: str, planner: Planner, coder: Coder) -> None:
        self.name, self.planner, self.coder = name, planner, coder

    def propose(self, state: ProposalState) -> Proposal:
        self.planner.meter.bind(state.next_id)      # its paid exchanges are committed under this id at once
        claim, exchanges, error = self.planner.plan(state)
        base = dict(id=state.next_id, proposer=self.name, exchanges=exchanges)
        if claim is None:
            return Proposal(**base, op=state.ops[0] if len(state.ops) == 1 else "unknown", parent="",
                            outcome="malformed", stage="planner", reason=error)
        parent = state.parents[claim.op]
        base.update(op=claim.op, parent=parent.ref, claim=claim)
        if claim.ceiling < state.min_ceiling:
            return Proposal(**base, outcome="not-worth-coding", stage="ceiling",
                            reason=f"ceiling {claim.ceiling:.4f} is under the minimum {state.min_ceiling}: "
                                   f"{claim.expected_speedup:.3f}x expected on an op holding {claim.op_share:.0%} of the step")
        source, more, error = self.coder.write(claim, parent, anchors_text(state.heads, self.coder.target, [claim.op]))
        base["exchanges"] = exchanges + more
        if source is None:
            return Proposal(**base, outcome="malformed", stage="coder", reason=error)
        return Proposal(**base, outcome="ready", source=source)

    def repair(self, proposal: Proposal, source: str, feedback: str, round_no: int) -> tuple[str | None, list[Exchange]]:
        self.coder.meter.bind(proposal.id)
        fixed, exchanges, _ = self.coder.repair(proposal.claim, source, feedback, round_no)
        return fixed, exchanges


def _offline(cfg: Config, target: str, device: torch.device, arch: str, catalog: Catalog, meter: Meter,
             planner_model: str, coder_model: str) -> Proposer:
    return OfflineProposer(catalog, target, cfg.agent.ops, arch)


def _llm(provider: str) -> Callable[..., Proposer]:
    def make(cfg: Config, target: str, device: torch.device, arch: str, catalog: Catalog, meter: Meter,
             planner_model: str, coder_model: str) -> Proposer:
        llm = PROVIDERS[provider](getattr(cfg.providers, provider), cfg.providers)
        planner = Planner(llm, meter, planner_model, cfg, target, device, catalog, arch)
        coder = Coder(llm, meter, coder_model, cfg, target, device, catalog, arch)
        return LLMProposer(f"{provider}:{planner_model}/{coder_model}", planner, coder)
    return make


PROPOSERS: dict[str, Callable[..., Proposer]] = {"offline": _offline, "openai": _llm("openai"),
                                                 "anthropic": _llm("anthropic")}
