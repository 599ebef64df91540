"""The planner role (LLM): reads the evidence, writes one Claim.

It is shown the knowledge entries for the target's ops and the GPU in use (notes, and the kernel families
with their knobs), the profile evidence, the measured cuDNN anchors per served shape (the heads'
microbench: the library to beat), the current kernel of each op, and the run's history (the last few candidates in full, older ones a line
each, rejections included). Its reply must hold one JSON claim; a reply without a valid one gets one
repair round, then the proposal counts as malformed. The op's share f comes from the profile and the
ceiling is computed by code: if the model sends either, it is ignored and the exchange says so.
Not here: writing code (coder), deciding whether a claim is worth coding (proposers).
"""
from __future__ import annotations

import json
import re

import torch
from pydantic import ValidationError

from harness.stages import STAGE_NAMES
from harness.targets import TARGETS

from agent.reading.figures import anchors_text
from agent.knowledge import Catalog, prompt_text
from agent.run.profile import kernel_figures
from agent.llm.prompts import render
from agent.llm.asking import ask_until_usable
from agent.llm.providers import LLM, Meter
from agent.records import CandidateRecord, Claim, ClaimDraft, Exchange
from agent.run.state import ProposalState

_JSON_BLOCK = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL)
_NOT_THE_MODELS = ("ceiling", "op_share", "share_source")


def parse_claim(reply: str, state: ProposalState, share_source: str) -> tuple[Claim | None, str, str]:
    """(claim, error, note): the claim, or why the reply holds none; note lists fields kevo ignored."""
    blocks = _JSON_BLOCK.findall(reply)
    text = blocks[0] if blocks else reply[reply.find("{"): reply.rfind("}") + 1]
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"no JSON object could be read ({e.msg} at line {e.lineno})", ""
    if not isinstance(data, dict):
        return None, "the JSON is not an object", ""
    ignored = {k: data.pop(k) for k in _NOT_THE_MODELS if k in data}
    note = f"ignored what the model sent for {', '.join(f'{k}={v!r}' for k, v in ignored.items())}" if ignored else ""
    try:
        draft = ClaimDraft.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        return None, f"invalid claim: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}", note
    if draft.op not in state.ops:
        return None, f"invalid claim: op must be one of {', '.join(state.ops)}, not {draft.op!r}", note
    if draft.kill_test.stage not in STAGE_NAMES:
        return None, f"invalid claim: kill_test.stage must be one of {', '.join(STAGE_NAMES)}", note
    claim = Claim(**draft.model_dump(), op_share=state.profile.ops[draft.op].share, share_source=share_source)
    return claim, "", note


def history_text(history: list[CandidateRecord], full: int) -> str:
    if not history:
        return "(none yet)"
    lines = []
    for i, r in enumerate(history):
        head = f"{r.id} [{r.op}, from {r.parent}] {r.outcome} at {r.stage}"
        if i < len(history) - full:
            lines.append(f"- {head}: {r.conclusion.learned[:140]}")
            continue
        lines.append(f"- {head}")
        if r.claim:
            lines.append(f"  claim: {r.claim.hypothesis} (predicted s {r.claim.expected_speedup:.3f}, "
                         f"ceiling {r.claim.ceiling:.4f}; kill test at {r.claim.kill_test.stage})")
        if r.verdict:
            lines.append(f"  verdict: {r.verdict.reason[:400]}")
        lines.append(f"  observed: {f'{r.local_speedup:.3f}x over its parent' if r.local_speedup else 'no local speedup measured'}"
                     f"{f', {r.speedup:.3f}x over torch' if r.speedup else ''}")
        lines.append(f"  conclusion: {r.conclusion.learned}")
    return "\n".join(lines)


class Planner:
    def __init__(self, llm: LLM, meter: Meter, model: str, cfg, target: str, device: torch.device,
                 catalog: Catalog, arch: str) -> None:
        self.llm, self.meter, self.model, self.cfg = llm, meter, model, cfg
        self.target, self.device, self.catalog, self.arch = target, device, catalog, arch

    def _prompt(self, state: ProposalState) -> str:
        profile = "\n".join([state.profile.note] + [f"- {line}" for op in state.ops for line in state.profile.ops[op].lines])
        kernels = "\n\n".join(
            f"### {op}: {k.ref}\n" + "\n".join(kernel_figures(k, self.cfg, self.target, self.device))
            + f"\n```python\n{k.source}\n```" for op, k in state.parents.items())
        pending = "\n".join(f"- {p.id} [{p.op}]: {p.claim.hypothesis}" for p in state.pending if p.claim) or "(nothing)"
        return render("planner", target=self.target, ops=", ".join(state.ops), device=f"{self.device.type} ({self.arch})",
                      contract=TARGETS[self.target].contract, profile=profile,
                      knowledge=prompt_text(self.catalog, self.target, state.ops, self.arch), kernels=kernels,
                      anchors=anchors_text(state.heads, self.target, state.ops),
                      history=history_text(state.history, self.cfg.agent.history_in_prompt), pending=pending,
                      min_ceiling=f"{state.min_ceiling}")

    def plan(self, state: ProposalState) -> tuple[Claim | None, list[Exchange], str]:
        """The claim (or None), the exchanges that produced it, and why there is none."""
        system = render("planner_system", claim_schema=json.dumps(ClaimDraft.model_json_schema(), indent=1),
                        stages=", ".join(STAGE_NAMES))
        claim, exchanges, error = ask_until_usable(
            self.llm, self.meter, self.model, "planner", ("claim", "claim-repair"), system, self._prompt(state),
            lambda ex: parse_claim(ex.reply, state, state.profile.source), "planner_repair", self.cfg.providers)
        return claim, exchanges, "" if claim is not None else f"no valid claim after one repair round: {error}"
