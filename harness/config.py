"""Load and validate config.yaml.

One pydantic model per top-level section; unknown keys are rejected, all errors come back in one line (`ConfigError`),
each naming its key. Here: the sections a verdict depends on (worker pool, stages, targets' served shapes, served
scenario), the top-level `Config` with its cross-section checks, and `load_config`; those that drive a run (agent,
providers, executor) are in config_run.py, the base model and error line in config_base.py."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from harness.config_base import ConfigError, Strict, message
from harness.config_run import (AgentConfig, BudgetMinutes, DaskConfig, ExecutorConfig, OutageConfig, Price,  # noqa: F401
                                ProviderConfig, ProvidersConfig, RetryConfig)
from harness.sandbox import SECRET_NAME

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = PROJECT_ROOT / "config.yaml"


class WorkerConfig(Strict):
    start_timeout_s: float = Field(gt=0)
    sandbox: Literal["required", "best_effort"]
    reply_limit_bytes: int = Field(gt=1024)
    log_tail_chars: int = Field(ge=200)
    env_passthrough: list[str]
    folder_bytes: int = Field(ge=64 << 20)           # the candidate's own folder, a tmpfs (Triton cache, /tmp)
    carry_bytes: int = Field(ge=0)                   # a source's packed Triton cache, kept for its next sandbox (0: off)
    shm_bytes: int = Field(ge=1 << 20)               # its private /dev/shm
    file_size_bytes: int = Field(ge=16 << 20)        # RLIMIT_FSIZE: also bounds each reply's outputs
    open_files: int = Field(ge=64)                   # RLIMIT_NOFILE
    processes: int = Field(ge=64)                    # RLIMIT_NPROC, counted per user (every sandbox's is one)
    cpu_seconds: int = Field(ge=60)                  # RLIMIT_CPU of a worker, its threads together
    cpu_address_space_bytes: int = Field(ge=4 << 30)  # RLIMIT_AS, on the CPU device only
    gpu_memory_fraction: float = Field(gt=0, le=1)   # of the GPU's memory, the most a worker's allocator may hold
    trusted_gpu_bytes: int = Field(ge=0)             # held by the evaluator before any candidate runs (harness/gpu_memory.py)
    gpu_share: float = Field(default=1.0, gt=0, le=1)  # set per slot: 1/n of a GPU n slots share (pins.slot_config)

    @field_validator("env_passthrough")
    @classmethod
    def _no_secrets(cls, names: list[str]) -> list[str]:
        for name in filter(SECRET_NAME.search, names):
            raise ValueError(f"{name} looks like a secret and may not reach a candidate")
        return names


class CompileConfig(Strict):
    """Stage 1; the allowlist of what a kernel file may name is checked by harness/allowlist.py."""
    timeout_s: float = Field(gt=0)
    allowed_names: dict[str, list[str]] = Field(min_length=1)   # module -> dotted names it may be used for ("*": any)
    forbidden_builtins: list[str]
    forbidden_attributes: list[str]
    readable_dunders: list[str]      # dunder names a file may read, as names or attributes

    @field_validator("readable_dunders")
    @classmethod
    def _dunders(cls, v: list[str]) -> list[str]:
        for name in (n for n in v if not re.fullmatch(r"__[A-Za-z]\w*__", n)):
            raise ValueError(f"{name!r} is not a dunder name")
        return v

    @field_validator("allowed_names")
    @classmethod
    def _names(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        word = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
        for module, names in v.items():
            if not all(word.match(p) for p in module.split(".")) and module != "__future__":
                raise ValueError(f"{module!r} is not a module name")
            if not names:
                raise ValueError(f"{module}: an empty list (leave the module out instead)")
            if "*" in names and len(names) > 1:
                raise ValueError(f"{module}: '*' admits every public name; list nothing beside it")
            if bad := [n for n in names if n != "*" and not all(word.match(p) for p in n.split("."))]:
                raise ValueError(f"{module}: {bad[0]!r} is not a dotted public name (no dunder, no private)")
        return v


class DispatchConfig(Strict):
    timeout_s: float = Field(gt=0)
    aux_work_fraction: float = Field(ge=0, le=1)
    forbidden_ops: list[str]
    library_kernel_patterns: list[str]
    min_own_device_share: float = Field(ge=0, le=1)
    plumbing_ops: list[str] = Field(min_length=1)   # aten ops free in the audit: no arithmetic on memory

    @model_validator(mode="after")
    def _plumbing(self) -> "DispatchConfig":
        for name in self.plumbing_ops:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"plumbing_ops: {name!r} is not an aten op name")
            if name in self.forbidden_ops:
                raise ValueError(f"plumbing_ops: {name!r} is a forbidden op (forbidden_ops); it cannot also be free")
        return self


class Floor(Strict):
    max_abs: float = Field(gt=0)
    rel_l2: float = Field(gt=0)


class PerDevice(Strict):
    """A count per device kind (parity's warm: its compiles at once, its draws per shape class)."""
    cuda: int = Field(ge=0, le=64)
    cpu: int = Field(ge=0, le=64)


class ParityConfig(Strict):
    timeout_s: float = Field(gt=0)
    warm_threads: PerDevice = PerDevice(cuda=8, cpu=0)      # Triton compiles at once in the warm (0: no warm)
    warm_draws: PerDevice = PerDevice(cuda=4, cpu=1)        # draws of each shape class the warm compiles for (>= 1)
    distributions: list[Literal["normal", "peaky", "shifted_keys", "served"]] = Field(min_length=1)
    sm_scale: tuple[float, float]                # per check, a factor of 1/sqrt(head_dim) drawn log-uniformly from [lo, hi]
    unused_slots: list[Literal["nan", "zeros", "stale", "random"]] = Field(min_length=1)   # drawn per check
    served_layout: float = Field(ge=0, le=1)     # decode checks handed the cache as served: the whole pool, a layer's view
    batch_drawn: float = Field(ge=0, le=1)       # served-shape checks at a batch drawn from 1..max_running + 1
    twins: float = Field(ge=0, le=1)             # odds that a served-shape check is followed by its twin
    layers: float = Field(ge=0, le=1)            # else, odds that it is followed by its step's next layer
    checks_per_shape: int = Field(ge=1)
    repeat_calls: int = Field(ge=2)
    tolerance_factor: float = Field(ge=1)
    floors: dict[Literal["float32", "bfloat16", "float16"], Floor]

    @field_validator("sm_scale")
    @classmethod
    def _scale_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 < v[0] <= v[1]:
            raise ValueError("sm_scale must be [lo, hi] with 0 < lo <= hi")
        return v


class MicrobenchConfig(Strict):
    timeout_s: float = Field(gt=0)
    warmup_reps: int = Field(ge=1)
    reps: int = Field(ge=5)
    input_sets: int = Field(ge=1)
    lengths_seed: int = Field(ge=0)              # the timed sets' lengths, the same for every candidate
    l2_flush_bytes: int = Field(ge=0)
    min_margin: float = Field(ge=0)
    hbm_bytes_per_s: float = Field(gt=0)
    peak_flops: float = Field(gt=0)
    cover_cycles: int = Field(ge=0)
    clock_check_ms: float = Field(gt=0)
    clock_check_rounds: int = Field(ge=1, le=50)
    clock_check_rest_s: float = Field(ge=0, le=10)
    clock_check_ratio: float = Field(gt=0, le=1)
    stream_escape_ratio: float = Field(gt=0, le=1)
    trusted_baseline_tolerance: float = Field(gt=0)
    disagreement_tries: int = Field(ge=1, le=10)  # times a case is timed while two of its clocks disagree
    anchor: bool
    trusted_baseline_reps: int = Field(ge=5)     # the evaluator's own timing of the baseline, calls timed
    calls_per_graph: int = Field(ge=1, le=1000)  # calls captured in each CUDA graph of the clock check's bursts


class GateConfig(Strict):
    max_abs: float = Field(gt=0)             # |arm - reference| logprob of the reference's token, at every position
    mean_abs: float = Field(gt=0)            # the mean of those over every generated token
    mean_floor: float = Field(gt=0)          # the candidate's mean may always reach this, whatever the head's
    near_tie_margin: float = Field(ge=0)     # the arm's own choice may differ only where the reference's top two were this close


class ReplayConfig(Strict):
    """Stage 5, the full scored replay (harness/stages/replay.py); the served system is `served`."""
    timeout_s: float = Field(gt=0)
    gates: dict[Literal["float32", "bfloat16", "float16"], GateConfig]
    reference_dtype: Literal["float32", "bfloat16", "float16"]   # the reference server's: what every arm is held to
    reference_kv_cache_tokens: int | None = Field(ge=1)   # its KV cache (null: the preset's); it runs untimed, one pass
    head_factor: float = Field(ge=1)          # the candidate's mean difference <= this x the head's on the same tokens
    cpu_gates: bool                           # on a CPU the stage runs its gates (true) or is skipped, saying so
    segments: int = Field(ge=2)               # the window cut into this many, each replayed to head and candidate in turn
    load: Literal["burst", "arrivals"]        # a segment's requests sent at once as one group, or at the trace's arrivals
    false_accept: float = Field(gt=0, lt=0.5)  # the one-sided bound on the paired gain: the stated false-accept rate
    min_margin: float = Field(ge=0)           # the gain's lower bound must beat this


class StagesConfig(Strict):
    compile: CompileConfig
    dispatch: DispatchConfig
    parity: ParityConfig
    microbench: MicrobenchConfig
    replay: ReplayConfig


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
        for op in ("decode", "prefill"):      # a shape twice would give two cases one key (Case.key): give it once
            shapes = [(g.batch, g.lengths) for g in getattr(self, op)]
            if twice := sorted({s for s in shapes if shapes.count(s) > 1}):
                raise ValueError(f"{op}: the shape batch {twice[0][0]}, lengths {list(twice[0][1])} is given twice; give it "
                                 f"once, its weights summed")
        return self


class AttentionConfig(Strict):
    decode_baseline: Literal["masked", "clamped", "per_sequence"]   # harness/targets/attention_baselines.py
    cuda: AttentionDeviceConfig
    cpu: AttentionDeviceConfig

    def baselines(self) -> dict[str, str]:
        """op -> the name of the torch baseline the harness runs for it (harness.targets.configured)."""
        return {"decode": self.decode_baseline}


class TargetsConfig(Strict):
    attention: AttentionConfig


class ModelPreset(Strict):
    """A Qwen3-architecture model for the served scenario (harness/served/model.py)."""
    layers: int = Field(ge=1)
    hidden: int = Field(ge=8)
    q_heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate: int = Field(ge=1)
    vocab: int = Field(ge=8)
    tied_embeddings: bool
    rope_theta: float = Field(gt=0)
    rms_eps: float = Field(gt=0)
    weights: str | None          # a local folder of safetensors files (Hugging Face Qwen3 names); null: random
    seed: int                    # of the random weights
    kv_cache_tokens: int = Field(ge=16)     # paged KV cache capacity
    max_running: int = Field(ge=1)          # sequences batched together at most
    max_prefill_tokens: int = Field(ge=1)   # prompt tokens admitted per step (a longer prompt runs alone)

    @model_validator(mode="after")
    def _shape(self) -> "ModelPreset":
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} must be a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings rotate halves)")
        return self


class ServedDevice(Strict):
    preset: str                  # a key of served.presets
    trace: str                   # JSONL trace, relative to the project root
    window_s: float = Field(gt=0)   # requests arriving within this many seconds are replayed
    max_output: int | None = Field(default=None, ge=1)   # the replay stage's outputs cut to this many tokens (None: the trace's)
    warm_requests: int | None = Field(default=None, ge=0)   # the warm-up's served-length requests (None: max_running)
    warm_passes: int = Field(default=1, ge=1, le=2)   # those requests sent in the served order (1), then longest first (2)
    warm_sweep_threads: int = Field(default=0, ge=0)   # those parts first swept compile-only, compiles at once (0: no sweep)


class CudaGraphsConfig(Strict):
    """Decode-only steps replayed from CUDA graphs (harness/served/graphs.py); never on a CPU."""
    enabled: bool
    batch_buckets: list[int] = Field(min_length=1)   # padded batch sizes captured; those above max_running are dropped

    @field_validator("batch_buckets")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if v[0] < 1 or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"must be positive and strictly increasing, got {v}")
        return v


class ExternalServer(Strict):
    """The user's own OpenAI-compatible server instead of the embedded one."""
    command: list[str] = Field(min_length=1)   # argv; "{port}" is replaced; $KEVO_CANDIDATE holds the candidate's path
    model: str                                 # the model name requests carry
    start_timeout_s: float = Field(gt=0)
    env_passthrough: list[str]                 # beside worker.env_passthrough

    @field_validator("env_passthrough")
    @classmethod
    def _no_secrets(cls, names: list[str]) -> list[str]:
        return WorkerConfig._no_secrets(names)


class RandomInit(Strict):
    """The served model's random weights (harness/served/model.py): how far a kernel's error moves its tokens."""
    logit_std: float = Field(gt=0)                # the logits' std for a unit-RMS final state
    query_gain: float = Field(gt=0)               # every q_norm weight: how sharply attention picks out keys
    embed_per_output_gain: float = Field(gt=0)    # attention and MLP output gain = max(1, embedding std / this)


class ProfileCycle(Strict):
    """One cycle of torch.profiler.schedule: steps skipped, warmed, recorded."""
    wait: int = Field(ge=0)
    warmup: int = Field(ge=0)
    active: int = Field(ge=1)


class ProfileCycles(Strict):
    """Per device, the served profile's cycle (harness/profile.py); null: every step recorded."""
    cuda: ProfileCycle | None
    cpu: ProfileCycle | None


class ServedConfig(Strict):
    """The served scenario (issue 3): models, traces, the server and the replay client."""
    presets: dict[str, ModelPreset] = Field(min_length=1)
    cuda: ServedDevice
    cpu: ServedDevice
    start_timeout_s: float = Field(gt=0)    # model build and warm-up, until the server answers
    request_timeout_s: float = Field(gt=0)  # one streamed request, on the client
    drain_timeout_s: float = Field(gt=0)    # after the last arrival, the wait for streams to finish
    external: ExternalServer | None
    cuda_graphs: CudaGraphsConfig
    recorded_shapes: str | None              # a profile JSON whose served_shapes replace the placeholders
    logprobs: int = Field(ge=2, le=20)       # top logprobs the embedded engine serves and the replay client asks for
    stall_ms: float = Field(gt=0)            # a candidate call holding the server's host this long is counted a stall
    audit_share: float = Field(ge=0, le=1)   # served candidate calls audited as the worker audits every call
    spot_share: float = Field(ge=0, le=1)    # served candidate calls checked against the float64 reference
    gpu_memory_fraction: float = Field(gt=0, le=1)   # the most an embedded server's allocator may hold (harness/gpu_memory.py)
    gpu_overhead_bytes: int = Field(ge=0)    # what a server needs beside that share (CUDA context, libraries)
    random_init: RandomInit
    profile_cycle: ProfileCycles

    @model_validator(mode="after")
    def _known_presets(self) -> "ServedConfig":
        for dev in ("cuda", "cpu"):
            name = getattr(self, dev).preset
            if name not in self.presets:
                raise ValueError(f"{dev}.preset {name!r} is not one of the presets ({', '.join(self.presets)})")
        if 3 * self.gpu_memory_fraction > 1:
            raise ValueError(f"gpu_memory_fraction {self.gpu_memory_fraction:g} x 3 (the replay's servers) is over the GPU: at most 0.333")
        return self


class Config(Strict):
    device: Literal["auto", "cuda", "cpu"]
    worker: WorkerConfig
    stages: StagesConfig
    targets: TargetsConfig
    agent: AgentConfig
    providers: ProvidersConfig
    served: ServedConfig
    executor: ExecutorConfig

    @model_validator(mode="after")
    def _slots_can_pin(self) -> "Config":
        if "CUDA_VISIBLE_DEVICES" not in self.worker.env_passthrough:
            raise ValueError("worker.env_passthrough must include CUDA_VISIBLE_DEVICES: each evaluation slot is "
                             "pinned to its GPU by it, and its workers must inherit the pin")
        return self

    @model_validator(mode="after")
    def _served_fits_target(self) -> "Config":
        for dev in ("cuda", "cpu"):
            name = getattr(self.served, dev).preset
            p, sec = self.served.presets[name], getattr(self.targets.attention, dev)
            if [p.q_heads, p.kv_heads] not in [list(h) for h in sec.heads] or p.head_dim != sec.head_dim:
                raise ValueError(f"served.{dev}.preset {name!r} has heads [{p.q_heads}, {p.kv_heads}] and head_dim {p.head_dim}; "
                                 f"targets.attention.{dev} has heads {[list(h) for h in sec.heads]} and head_dim {sec.head_dim}")
        return self


def load_config(path: Path | str | None = None) -> Config:
    path = Path(path) if path else DEFAULT_CONFIG
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a config file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{path}:{f' line {mark.line + 1}' if mark else ''} not valid YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(message(e, str(path))) from None
