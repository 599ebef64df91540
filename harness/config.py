"""Load and validate config.yaml.

One pydantic model per top-level section; unknown keys are rejected and every error comes back as
one line naming the key (`ConfigError`). Covers: the worker pool, the four cheap stages, and the
targets' served shapes. Later sections (served scenario, agent, providers) add their own models here.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = PROJECT_ROOT / "config.yaml"


class ConfigError(Exception):
    """A config file that cannot be used; the message is one line naming the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WorkerConfig(Strict):
    start_timeout_s: float = Field(gt=0)
    sandbox: Literal["required", "best_effort"]
    reply_limit_bytes: int = Field(gt=1024)
    log_tail_chars: int = Field(ge=200)
    env_passthrough: list[str]

    @field_validator("env_passthrough")
    @classmethod
    def _no_secrets(cls, names: list[str]) -> list[str]:
        for name in names:
            if any(word in name.upper() for word in ("KEY", "TOKEN", "SECRET", "PASSWORD")):
                raise ValueError(f"{name} looks like a secret and may not reach a candidate")
        return names


class CompileConfig(Strict):
    timeout_s: float = Field(gt=0)
    allowed_imports: list[str]


class DispatchConfig(Strict):
    timeout_s: float = Field(gt=0)
    aux_work_fraction: float = Field(ge=0, le=1)
    forbidden_ops: list[str]
    library_kernel_patterns: list[str]
    min_own_device_share: float = Field(ge=0, le=1)


class Floor(Strict):
    max_abs: float = Field(gt=0)
    rel_l2: float = Field(gt=0)


class ParityConfig(Strict):
    timeout_s: float = Field(gt=0)
    distributions: list[Literal["normal", "peaky", "shifted_keys"]] = Field(min_length=1)
    checks_per_shape: int = Field(ge=1)
    repeat_calls: int = Field(ge=2)
    tolerance_factor: float = Field(ge=1)
    floors: dict[Literal["float32", "bfloat16", "float16"], Floor]


class MicrobenchConfig(Strict):
    timeout_s: float = Field(gt=0)
    warmup_reps: int = Field(ge=1)
    reps: int = Field(ge=5)
    input_sets: int = Field(ge=1)
    l2_flush_bytes: int = Field(ge=0)
    min_margin: float = Field(ge=0)
    hbm_bytes_per_s: float = Field(gt=0)
    peak_flops: float = Field(gt=0)
    cover_cycles: int = Field(ge=0)
    clock_check_ms: float = Field(gt=0)
    clock_check_ratio: float = Field(gt=0, le=1)
    stream_escape_ratio: float = Field(gt=0, le=1)
    trusted_baseline_tolerance: float = Field(gt=0)
    anchor: bool


class StagesConfig(Strict):
    compile: CompileConfig
    dispatch: DispatchConfig
    parity: ParityConfig
    microbench: MicrobenchConfig


class ShapeGroup(Strict):
    """`batch` sequences with lengths drawn uniformly from `lengths` = [lo, hi]; `weight` in the mix."""
    batch: int = Field(ge=1)
    lengths: tuple[int, int]
    weight: float = Field(gt=0)

    @field_validator("lengths")
    @classmethod
    def _ordered(cls, v: tuple[int, int]) -> tuple[int, int]:
        if not 1 <= v[0] <= v[1]:
            raise ValueError("lengths must be [lo, hi] with 1 <= lo <= hi")
        return v


class AttentionDeviceConfig(Strict):
    dtype: Literal["float32", "bfloat16", "float16"]
    head_dim: int
    block_size: int = Field(ge=1)
    heads: list[tuple[int, int]] = Field(min_length=1)
    decode: list[ShapeGroup] = Field(min_length=1)
    prefill: list[ShapeGroup] = Field(min_length=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> "AttentionDeviceConfig":
        for q, kv in self.heads:
            if kv < 1 or q % kv:
                raise ValueError(f"heads [{q}, {kv}]: query heads must be a multiple of kv heads")
        if self.head_dim & (self.head_dim - 1) or not 16 <= self.head_dim <= 256:
            raise ValueError("head_dim must be a power of two in 16..256")
        return self


class AttentionConfig(Strict):
    cuda: AttentionDeviceConfig
    cpu: AttentionDeviceConfig


class TargetsConfig(Strict):
    attention: AttentionConfig


class Config(Strict):
    device: Literal["auto", "cuda", "cpu"]
    worker: WorkerConfig
    stages: StagesConfig
    targets: TargetsConfig


def _one_line(err: ValidationError, source: str) -> str:
    """The most useful error first: an unknown key (a typo) explains the missing one beside it."""
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    key = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        siblings = [str(e["loc"][-1]) for e in errors if e["type"] == "missing" and e["loc"][:-1] == first["loc"][:-1]]
        close = difflib.get_close_matches(str(first["loc"][-1]), siblings, n=1)
        msg = "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
    elif first["type"] == "missing":
        msg = "missing key"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {key}: {msg}{more}"


def load_config(path: Path | str | None = None) -> Config:
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e, str(path))) from None
