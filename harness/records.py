"""The typed records that flow through the evaluator: one stage's result and the whole verdict.

Metrics are numbers, reasons are strings; a bad candidate is a failing record, never an exception.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal["passed", "failed", "skipped"]


class StageResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    status: Status
    reason: str = ""
    seconds: float = 0.0
    metrics: dict[str, float] = Field(default_factory=dict)

    @classmethod
    def passed(cls, name: str, reason: str = "", **metrics: float) -> "StageResult":
        return cls(name=name, status="passed", reason=reason, metrics=metrics)

    @classmethod
    def failed(cls, name: str, reason: str, **metrics: float) -> "StageResult":
        return cls(name=name, status="failed", reason=reason, metrics=metrics)

    @classmethod
    def skipped(cls, name: str, reason: str) -> "StageResult":
        return cls(name=name, status="skipped", reason=reason)

    @property
    def worker_lost(self) -> str:
        """How the stage's worker was lost, 'hung' or 'crashed' (harness/evaluate.py records WorkerFailure's
        kind as a metric) or 'hit a CUDA error' (the candidate raised one, an illegal address say, and its
        worker ended on it), else the empty string; such a worker may have left the device unwell."""
        m = self.metrics
        return ("hung" if m.get("timeout") else "crashed" if m.get("crashed")
                else "hit a CUDA error" if m.get("cuda_error") else "")


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool
    accepted: bool
    failed_stage: str | None
    reason: str
    stages: list[StageResult]

    @classmethod
    def of(cls, stages: list[StageResult]) -> "Verdict":
        failed = next((s for s in stages if s.status == "failed"), None)
        # Only the full scored replay may accept; it sets the metric `accepted` to 1 when it does.
        accepted = failed is None and any(
            s.name == "replay" and s.status == "passed" and s.metrics.get("accepted") == 1.0 for s in stages)
        if failed:
            reason = f"rejected at {failed.name}: {failed.reason}"
        elif accepted:
            reason = "accepted by the full scored replay"
        else:
            not_run = [s.name for s in stages if s.status == "skipped"]
            reason = "passed every stage that ran" + (f"; skipped: {', '.join(not_run)}" if not_run else "")
        return cls(ok=failed is None, accepted=accepted, failed_stage=failed.name if failed else None,
                   reason=reason, stages=stages)
