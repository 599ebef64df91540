"""The agent's typed records: a claim, an LLM exchange, one candidate's whole story, the run's header.

What flows: a proposer writes a `Proposal` (claim, source, the exchanges that made it); the evaluator
role adds `Round`s (each evaluated source and its Verdict); the conclusion role adds a `Conclusion`;
together they become a `CandidateRecord`, the unit the ledger commits and the next planner reads.
The claim's ceiling is computed from s and f (harness/amdahl.py), never taken from a model.
Not here: how records are made (planner, coder, offline), stored (ledger) or shown (view).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, computed_field, field_validator, model_validator

from harness.amdahl import ceiling
from harness.records import Verdict

Knob = int | float | bool
# A candidate's id names its folder in the ledger (candidates/<id>/): c and digits, nothing a path could be made of
CandidateId = Annotated[str, StringConstraints(pattern=r"^c[0-9]+$")]
OpName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]*$")]
ParentRef = Annotated[str, StringConstraints(pattern=r"^(|head:[a-z][a-z0-9_]*|c[0-9]+)$")]
Outcome = Literal["accepted", "passed", "rejected", "not-worth-coding", "malformed", "unevaluated"]


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KillTest(Record):
    stage: str                      # the evaluator stage whose observation would kill the claim
    observation: str                # what would be seen there


class ClaimDraft(Record):
    """What a planner writes. The op's share and the ceiling are not the planner's to set."""
    op: str
    hypothesis: str = Field(min_length=10)
    evidence: list[str] = Field(min_length=1)       # profile / measurement facts, numbers quoted
    expected_speedup: float = Field(gt=0, le=100)   # s: the op's own speedup over its parent kernel
    risks: list[str] = Field(min_length=1)          # how it could be wrong (correctness first)
    kill_test: KillTest

    @field_validator("evidence")
    @classmethod
    def _numbers_quoted(cls, items: list[str]) -> list[str]:
        if not any(any(ch.isdigit() for ch in item) for item in items):
            raise ValueError("evidence must quote numbers from the profile or the measurements")
        return items


class Claim(ClaimDraft):
    op_share: float = Field(gt=0, le=1)             # f, from the profile (never from the planner)
    share_source: str                               # where f came from, e.g. an assumed stand-in

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data):
        if isinstance(data, dict) and "ceiling" in data:   # a stored claim carries its computed ceiling
            data = {k: v for k, v in data.items() if k != "ceiling"}
        return data

    @computed_field
    @property
    def ceiling(self) -> float:
        return ceiling(self.op_share, self.expected_speedup)


class Message(Record):
    role: Literal["user", "assistant"]
    content: str


class Exchange(Record):
    """One LLM call as it happened: what was sent, what came back, what it cost. Never a key."""
    role: Literal["planner", "coder"]
    purpose: str                    # claim, claim-repair, code, code-repair, compile-repair
    provider: str
    model: str
    system: str
    messages: list[Message]
    reply: str
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    attempts: int = 1               # HTTP calls made, retries included
    seconds: float = 0.0
    note: str = ""                  # e.g. keys the model sent that kevo ignored
    finish: str = ""                # the API's finish reason (length / max_tokens: cut at the output-token limit)
    faults: list[str] = Field(default_factory=list)     # the failed calls before the answer, each with its cause
    reply_chars: int = 0            # set, with reply_sha256, for a reply over providers.max_reply_chars (reply empty)
    reply_sha256: str = ""


class Proposal(Record):
    """A claim and the candidate written for it, before the evaluator has seen it."""
    id: CandidateId
    op: OpName
    parent: ParentRef               # "head:<op>" or the id of the candidate it starts from
    proposer: str
    outcome: Literal["ready", "not-worth-coding", "malformed"]
    stage: str = ""                 # for the two failures: planner, coder or ceiling
    reason: str = ""
    claim: Claim | None = None
    knobs: dict[str, Knob] = Field(default_factory=dict)   # a parametric family's settings (offline)
    source: str | None = None
    exchanges: list[Exchange] = Field(default_factory=list)


class Round(Record):
    """One evaluated source: the first is the coder's, later ones compile repairs, or the same source judged
    again (`again`) because the head it was accepted against was replaced before its verdict was committed."""
    source: str
    verdict: Verdict
    against: str = ""               # the head its replay serves beside it (head:decode, c005); empty: none (torch)
    again: str = ""                 # why it was judged again; empty: a first or repair round


class Conclusion(Record):
    learned: str                    # one or two sentences: what the next planner should know
    kill_test_fired: bool | None    # None: its stage did not run here
    predicted: float | None         # the claim's s
    observed: float | None          # measured local speedup over the parent, when both were measured


class CandidateRecord(Record):
    id: CandidateId
    op: OpName
    parent: ParentRef
    proposer: str
    outcome: Outcome
    stage: str                      # where it stopped: a stage name, or planner / coder / ceiling / budget
    reason: str
    claim: Claim | None = None
    knobs: dict[str, Knob] = Field(default_factory=dict)
    rounds: list[Round] = Field(default_factory=list)
    speedup: float | None = None    # served-mix speedup over the torch baseline (microbench), if measured
    local_speedup: float | None = None   # over the parent kernel, if both were measured
    conclusion: Conclusion
    cost_usd: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    started: str = ""

    @property
    def source(self) -> str | None:
        return self.rounds[-1].source if self.rounds else None

    @property
    def verdict(self) -> Verdict | None:
        return self.rounds[-1].verdict if self.rounds else None


class Kernel(Record):
    """A kernel the loop builds on: a head (the reference, or the last accepted) or a candidate."""
    ref: str                        # "head:<op>" or a candidate id
    op: str
    path: str                       # where its source lives, relative to the ledger (or the project)
    source: str
    knobs: dict[str, Knob] = Field(default_factory=dict)
    speedup: float | None = None
    verdict: Verdict | None = None
    # The served step's gain over torch's (roles/conclusion.py `served_over_torch`): a head's own replay against
    # torch; an accepted candidate's gain over the head it met times that head's (chained, replays apart); None: unknown
    served_over_torch: float | None = None


class OpEvidence(Record):
    share: float                    # f
    lines: list[str]                # facts with numbers, as the planner will quote them


class Profile(Record):
    source: Literal["stand-in", "served"]
    note: str                       # what it is and is not (a stand-in says so)
    device: str
    arch: str
    ops: dict[str, OpEvidence]


class RunHeader(Record):
    id: str
    target: str
    provider: str
    planner_model: str = ""
    coder_model: str = ""
    device: str
    arch: str
    ops: list[str]
    budget_minutes: float
    max_candidates: int | None
    max_cost_usd: float
    started: str
    kevo_commit: str
