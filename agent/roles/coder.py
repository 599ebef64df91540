"""The coder role (LLM): one claim -> one complete candidate file, starting from the parent kernel.

A reply without a usable ```python block gets one repair round, then the proposal counts as
malformed. When the compile stage rejects the candidate, `repair` is given the stage's verbatim
feedback; the evaluator role decides how many rounds (config agent.compile_repair_rounds) and
records each. Not here: judging the code (harness), choosing the claim (planner).
"""
from __future__ import annotations

import re

import torch

from harness.config import Config
from harness.targets import TARGETS

from agent.knowledge import Catalog, prompt_text
from agent.llm.prompts import render
from agent.llm.asking import ask_until_usable
from agent.llm.providers import LLM, Meter
from agent.records import Claim, Exchange, Kernel

_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> tuple[str | None, str]:
    """The longest fenced code block, or why there is none."""
    blocks = [b for b in _CODE_BLOCK.findall(reply) if b.strip()]
    if not blocks:
        return None, "the reply holds no ```python code block"
    code = max(blocks, key=len)
    if "def " not in code:
        return None, "the code block defines no function: send the whole candidate file"
    return code.rstrip() + "\n", ""


def allowlist_words(cfg: Config) -> str:
    """The compile stage's allowlist (harness/allowlist.py) as the coder must read it."""
    c = cfg.stages.compile
    listed = "; ".join(f"{m}: {', '.join(names)}" for m, names in c.allowed_names.items() if m != "__future__")
    return (f"{', '.join(m for m in c.allowed_names)}, and of each module name only what it lists ({listed}; "
            "* is any public name). Never name a dunder or private attribute, a computed attribute name "
            f"(getattr with a variable), any of {', '.join(c.forbidden_builtins)}, or any of these attributes on any "
            f"object: {', '.join(c.forbidden_attributes)}; no @ outside a @triton.jit kernel. A file that does is "
            "refused before it runs")


class Coder:
    def __init__(self, llm: LLM, meter: Meter, model: str, cfg: Config, target: str, device: torch.device,
                 catalog: Catalog, arch: str) -> None:
        self.llm, self.meter, self.model, self.cfg = llm, meter, model, cfg
        self.target, self.device, self.catalog, self.arch = target, device, catalog, arch
        self.system = render("coder_system", allowed_imports=allowlist_words(cfg))

    def _ask(self, purpose: str, prompt: str) -> tuple[str | None, list[Exchange], str]:
        code, exchanges, error = ask_until_usable(self.llm, self.meter, self.model, "coder", (purpose, f"{purpose}-format-repair"),
                                                  self.system, prompt, lambda ex: (*extract_code(ex.reply), ""),
                                                  "coder_repair", self.cfg.providers)
        return code, exchanges, "" if code is not None else f"no usable code after one repair round: {error}"

    def prompt(self, claim: Claim, parent: Kernel, anchors: str) -> str:
        """The request for `claim` from `parent`; `anchors`: the measured cuDNN figures (figures.anchors_text)."""
        return render("coder", device=f"{self.device.type} ({self.arch})", contract=TARGETS[self.target].contract,
                      op=claim.op, claim=claim.model_dump_json(indent=1), parent_ref=parent.ref,
                      parent_source=parent.source, anchors=anchors,
                      knowledge=prompt_text(self.catalog, self.target, [claim.op], self.arch))

    def write(self, claim: Claim, parent: Kernel, anchors: str) -> tuple[str | None, list[Exchange], str]:
        return self._ask("code", self.prompt(claim, parent, anchors))

    def repair(self, claim: Claim, source: str, feedback: str, round_no: int) -> tuple[str | None, list[Exchange], str]:
        prompt = render("coder_compile_repair", contract=TARGETS[self.target].contract,
                        claim=claim.model_dump_json(indent=1), source=source, feedback=feedback[-6000:],
                        round=str(round_no), rounds=str(self.cfg.agent.compile_repair_rounds))
        return self._ask("compile-repair", prompt)
