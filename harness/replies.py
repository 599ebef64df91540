"""What a worker may answer: strict JSON, then one schema per request, checked before anything reads it.

A worker runs the candidate, so every reply is hostile input. `loads` parses JSON and refuses NaN,
Infinity and numbers that overflow to them (Python's json accepts all three). `parse` checks the
object against the schema of the request it answers: only the keys that request's reply has, each of
its type (strict: no "1" for 1, no true for 1.0), numbers finite and inside bounds (times above zero and
under a day, counts non-negative), lists, dicts and strings of bounded size. A reply that fails either
is `MalformedReply`, whose message names the field and what was wrong; the stages turn it into a
rejection (harness/stages/common.py). A failing reply (`ok: false`, the candidate raised) has its own
schema, accepted for any request.
Not here: what the values mean (whether the times agree with the evaluator's clock, the outputs with
float64): the stages judge that.
"""
from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, ValidationError


class MalformedReply(Exception):
    """A reply that is not strict JSON or does not fit its request's schema; the message names the field."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{text[:40]} overflows to {x}")
    return x


def loads(raw: bytes) -> Any:
    """JSON with finite numbers only: NaN, Infinity, -Infinity and 1e999 are refused (MalformedReply)."""
    try:
        return json.loads(raw.decode(), parse_constant=_refuse_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:    # JSONDecodeError is a ValueError
        raise MalformedReply(f"reply is not strict JSON: {e}") from None


Name = Annotated[str, StringConstraints(max_length=256)]
# A key the evaluator turns into a metric's name (`worker_<key>`): no dot, which separates a case's figures
SecondsKey = Annotated[str, StringConstraints(pattern=r"^[a-z0-9_]{1,64}$")]
Text = Annotated[str, StringConstraints(max_length=65536)]
Count = Annotated[int, Field(ge=0, le=1 << 53)]
Seconds = Annotated[float, Field(ge=0, le=86400, allow_inf_nan=False)]
Millis = Annotated[float, Field(gt=0, le=86400e3, allow_inf_nan=False)]    # one timed call: above 0, under a day
Elements = Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)]
Micros = Annotated[float, Field(ge=0, le=86400e6, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Reply(_Strict):
    wall_s: float = 0.0            # set by the evaluator: its own clock from request to reply (never the worker's)
    _arenas: list = PrivateAttr(default_factory=list)   # the sealed output memory that came with it (set here)

    @property
    def arenas(self) -> list:
        return self._arenas

    def release(self) -> None:
        """Let go of the output memory (its mappings close with the last reference)."""
        self._arenas = []

    def get(self, key: str, default: Any = None) -> Any:
        """A field by name, for readers that take a reply as a mapping (parity's)."""
        return getattr(self, key) if key in type(self).model_fields else default

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)


class Failed(Reply):
    """The candidate raised (or the request could not be served): its traceback, trimmed."""
    ok: Literal[False]
    error: Text = ""
    fatal: bool = False
    cuda_error: bool = False


class Loaded(Reply):
    ok: bool
    ops: list[Name] = Field(max_length=16)
    error: Text = ""
    carried: Count = 0                      # files of its source's compiled kernels it unpacked (harness/compiled.py)
    carry_refused: Text = ""


class Packed(Reply):
    """Its compiled kernels, packed: `bytes` of the one sealed memory file that came with the reply."""
    ok: Literal[True]
    bytes: Count
    seconds: dict[SecondsKey, Seconds] = Field(max_length=4)


class Entry(_Strict):
    """One tensor of an output arena: the `arena`-th sealed memory file that came with the reply
    (harness/transport.py reads it; no path is ever named)."""
    name: Name
    dtype: Name
    shape: list[Count] = Field(max_length=8)
    offset: Count
    nbytes: Count
    arena: Annotated[int, Field(ge=0, le=64)]


class Called(Reply):
    ok: Literal[True]
    outputs: list[Entry] = Field(max_length=64)
    launches: dict[Name, Count] = Field(max_length=256)
    op_elements: dict[Name, Elements] = Field(max_length=1024)
    op_calls: dict[Name, Count] = Field(max_length=1024)
    inputs_modified: list[Name] = Field(max_length=16)
    unlaunched: Count = 0                      # calls of the request that launched no Triton kernel
    seconds: dict[SecondsKey, Seconds] = Field(max_length=64)
    step_shared: list[Name] = Field(default_factory=list, max_length=16)   # arguments handed as the previous call's


class Warmed(Reply):
    ok: Literal[True]
    launches: dict[Name, Count] = Field(max_length=256)
    op_calls: dict[Name, Count] = Field(max_length=1024)
    failed: Count
    seconds: dict[SecondsKey, Seconds] = Field(max_length=8)
    compiles: Count = 0                     # Triton compiles it made (a variant met for the first time)


class Primed(Reply):
    ok: Literal[True]
    failed: Count
    seconds: dict[SecondsKey, Seconds] = Field(max_length=8)


class Profiled(Reply):
    ok: Literal[True]
    kernels: dict[Annotated[str, StringConstraints(max_length=2048)], Micros] = Field(max_length=4096)
    launches: dict[Name, Count] = Field(max_length=256)
    op_calls: dict[Name, Count] = Field(default_factory=dict, max_length=1024)


class KernelUse(_Strict):
    """A compiled kernel a timed request launched, as the worker's driver loaded it (reported, never judged by)."""
    name: Name
    registers: Annotated[int, Field(ge=0, le=1 << 16)]    # a thread (sm90 allows at most 255)
    spills: Annotated[int, Field(ge=0, le=1 << 20)]       # 32-bit words of local memory a thread
    shared_bytes: Annotated[int, Field(ge=0, le=1 << 20)]
    warps: Annotated[int, Field(ge=1, le=32)]


class Timed(Reply):
    ok: Literal[True]
    synced_ms: dict[Name, list[Millis]] = Field(max_length=8)
    streamed_ms: dict[Name, list[Millis]] = Field(max_length=8)
    outputs: list[Entry] = Field(max_length=64)
    op_calls: dict[Name, Count] = Field(default_factory=dict, max_length=1024)
    seconds: dict[SecondsKey, Seconds] = Field(default_factory=dict, max_length=8)    # where the request's time went
    compiles: Count = 0                     # Triton compiles inside the request (microbench warms them before)
    kernels: list[KernelUse] = Field(default_factory=list, max_length=32)   # what its timed calls launched


class Captured(Reply):
    ok: Literal[True]
    graph: bool
    error: Text = ""
    op_calls: dict[Name, Count] = Field(default_factory=dict, max_length=1024)


class Burst(Reply):
    ok: Literal[True]
    outputs: list[Entry] = Field(default_factory=list, max_length=1)   # the checked call's, when asked for


class OpStats(_Strict):
    calls: Count
    candidate: Count
    unsupported: Count
    not_implemented: Count
    other_head: Count = 0                     # calls of an op the candidate does not define that its head served
    implemented: bool
    stalls: Count
    stall_ms: Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]
    worst_stall_ms: Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]
    # its calls eagerly launched (not from a CUDA graph's replay) and the host time they held, launch included
    host_calls: Count = 0
    host_ms: Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)] = 0.0
    # its calls watched as the worker watches every call (harness/served/ops.py): over the server's life
    audited: Count = 0
    no_launch: Count = 0                      # calls that launched no Triton kernel
    audit_madds: Elements = 0.0               # the audited calls' multiply-adds (the torch-work cap's yardstick)
    op_calls: dict[Name, Count] = Field(default_factory=dict, max_length=1024)
    op_elements: dict[Name, Elements] = Field(default_factory=dict, max_length=1024)
    # a secret share of its served calls checked against the float64 reference (harness/served/spot.py)
    spot_checked: Count = 0
    spot_replayed: Count = 0                  # of those, calls of a CUDA graph's replay
    spot_failed: Count = 0
    spot_worst: Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)] = 0.0    # the worst error over tolerance
    spot_first: Annotated[str, Field(max_length=600)] = ""                            # the first failure, said


class ServedStats(Reply):
    """A served candidate's accounting (GET /kevo/stats, harness/served/ops.py): its process runs the
    candidate, so it is a reply like any other. Only `ops` is read; the rest is diagnostics."""
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    ops: dict[Name, OpStats] = Field(max_length=16)


SCHEMAS: dict[str, type[Reply]] = {"load": Loaded, "call": Called, "warm": Warmed, "profile": Profiled, "prime": Primed, "time": Timed,
                                   "capture": Captured, "burst": Burst, "served_stats": ServedStats, "pack": Packed}


def _where(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(the reply itself)"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"field {loc}: {first['msg']}{more}"


def parse(kind: str, raw: Any, wall_s: float = 0.0, arenas: list | None = None) -> Reply:
    """The reply to a `kind` request (a key of SCHEMAS), validated: its own schema, or `Failed` for `ok: false`
    (a load that found problems answers with its own schema). MalformedReply names the field."""
    schema = SCHEMAS[kind]
    if not isinstance(raw, dict):
        raise MalformedReply(f"the reply is a JSON {type(raw).__name__}, not an object")
    if raw.get("ok") is False and not (kind == "load" and "ops" in raw) and kind != "served_stats":
        schema = Failed
    try:
        reply = schema.model_validate({**raw, "wall_s": float(wall_s)})
    except ValidationError as e:
        raise MalformedReply(f"{_where(e)} (a {kind} reply)") from None
    reply._arenas = list(arenas or [])
    return reply
