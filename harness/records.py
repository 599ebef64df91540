"""The typed records that flow through the evaluator: one stage's result, the whole verdict, and a span of
wall time (a stage or a start-up step, for the breakdown of where an evaluation's time went).

Metrics are finite numbers, reasons are strings; a bad candidate is a failing record, never an exception.
A metric that is not finite (NaN or ±Inf: a replay without fallback accounting, a ratio over zero) is not
kept: it is dropped at construction and the stage's reason says which one and what it was, so no verdict,
ledger or Done message ever carries one. A stored metric of null (how ledgers written before this check
kept a NaN) is dropped the same way when read back, so resuming such a run never fails on it.
A verdict given from the verdict cache (harness/verdicts.py) says so in `cached_from`; a fresh one has none
and is written exactly as before.
How a stage failed, where it is more than its reason's words, is the typed `failure` (a `FailureKind`), set by
the stage or the driver and read by the slots, the verdict cache and the agent. Ledgers written before it kept
the kind as a metric of 1.0 under the kind's name (`timeout: 1.0`); such a record is read with that `failure`
and without the metric, so an old run still reads (and re-judges) as it was written.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

Status = Literal["passed", "failed", "skipped"]
Finite = Annotated[float, Field(allow_inf_nan=False)]
FailureKind = Literal["timeout", "crashed", "cuda_error", "protocol", "server_failed", "library_ops", "allowlist",
                      "wrong_output"]
FAILURE_KINDS: dict[str, str] = {        # each kind, in words; the keys are FailureKind's values
    "timeout": "the worker gave no reply in time, or the stage's time ran out",
    "crashed": "the worker died (a signal, an exit)",
    "cuda_error": "the candidate raised a CUDA error, and its worker ended on it",
    "protocol": "a reply from the worker or the candidate's server did not fit its schema",
    "server_failed": "the candidate's server failed to start or to serve the replay",
    "library_ops": "the candidate called library compute instead of running its own kernel",
    "allowlist": "the kernel file names what the allowlisted surface does not hold",
    "wrong_output": "the candidate's outputs where it was served were wrong: a spot check against the float64 "
                    "reference, or the served tokens against the reference's",
}


class StageResult(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    name: str
    status: Status
    reason: str = ""
    seconds: Finite = 0.0
    metrics: dict[str, Finite] = Field(default_factory=dict)
    failure: FailureKind | None = None       # how it failed, where the kind matters to a reader; None when it did not

    @model_serializer(mode="wrap")
    def _no_null_failure(self, handler):
        """A stage without a failure kind is written as before the field existed (no `failure: null`)."""
        data = handler(self)
        if isinstance(data, dict) and data.get("failure") is None:
            data.pop("failure", None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _finite_metrics(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
            return data
        kept, dropped = {}, []
        legacy = [k for k in FAILURE_KINDS if data["metrics"].get(k)] if data.get("failure") is None else []
        for key, value in data["metrics"].items():
            if value is None or key in legacy:      # null: a NaN stored by an older kevo; nothing to keep
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
                dropped.append(f"{key} = {value}")
                continue
            kept[key] = value
        data = {**data, "metrics": kept}
        if legacy:                                  # an older kevo's `<kind>: 1.0` metric: the typed field now
            data["failure"] = legacy[0]
        if dropped:
            note = f"(not finite, so not recorded: {', '.join(dropped)})"
            data["reason"] = f"{data.get('reason', '')} {note}".strip()
        return data

    @field_validator("seconds", mode="before")
    @classmethod
    def _finite_seconds(cls, v: Any) -> Any:
        return 0.0 if v is None or (isinstance(v, float) and not math.isfinite(v)) else v

    @classmethod
    def passed(cls, name: str, reason: str = "", **metrics: float) -> "StageResult":
        return cls(name=name, status="passed", reason=reason, metrics=metrics)

    @classmethod
    def failed(cls, name: str, reason: str, failure: FailureKind | None = None, **metrics: float) -> "StageResult":
        return cls(name=name, status="failed", reason=reason, metrics=metrics, failure=failure)

    @classmethod
    def skipped(cls, name: str, reason: str) -> "StageResult":
        return cls(name=name, status="skipped", reason=reason)

    @property
    def worker_lost(self) -> str:
        """How the stage's worker was lost, 'hung' or 'crashed' (harness/evaluate.py records WorkerFailure's
        kind as the stage's `failure`) or 'hit a CUDA error' (the candidate raised one, an illegal address say,
        and its worker ended on it), else the empty string; such a worker may have left the device unwell."""
        return {"timeout": "hung", "crashed": "crashed", "cuda_error": "hit a CUDA error"}.get(self.failure or "", "")


class Span(BaseModel):
    """A stretch of an evaluation's wall time; CLOCK_MONOTONIC seconds, one clock for every process on a host.
    A stage as its slot ran it (named for the stage: harness/slot.py `Done.spans`), or a step of a slot's
    or a command's start-up (`Done.startup`, `kevo-agent evaluate --json`'s `spans`): a plain name is a step
    on the caller's own path, one after another; a dotted name (`zygote.imports`, `worker.warmup`,
    `health.here`) ran in another process or thread, beside or within them. Diagnostics only."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    start: Finite
    end: Finite

    @property
    def seconds(self) -> float:
        return self.end - self.start


class CachedFrom(BaseModel):
    """Where a verdict given from the verdict cache (harness/verdicts.py) was first reached."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    key: str                  # the cache entry's key (runs/.verdicts/<key>.json)
    job: str                  # the job it was reached for (a candidate's id, head-decode, file1)
    where: str                # host/slot
    reached: str              # when, ISO 8601 UTC


class Verdict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ok: bool
    accepted: bool
    failed_stage: str | None
    reason: str
    stages: list[StageResult]
    cached_from: CachedFrom | None = None      # set when the verdict came from the cache, not from the stages

    @model_serializer(mode="wrap")
    def _no_null_cache(self, handler):
        """A verdict reached by the stages is written as before the cache existed (no `cached_from: null`)."""
        data = handler(self)
        if isinstance(data, dict) and data.get("cached_from") is None:
            data.pop("cached_from", None)
        return data

    @field_validator("stages", mode="before")
    @classmethod
    def _revalidate(cls, stages: Any) -> Any:
        """Stage results are checked again here: metrics added to one after it was made (worker_s, cpu_s)
        pass the same finiteness check as those it was made with."""
        if isinstance(stages, list):
            return [s.model_dump() if isinstance(s, StageResult) else s for s in stages]
        return stages

    @classmethod
    def of(cls, stages: list[StageResult]) -> "Verdict":
        stages = [StageResult.model_validate(s.model_dump()) for s in stages]
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
