"""Load and validate config.yaml.

One pydantic model per top-level section; unknown keys are rejected and the errors come back as one
line (`ConfigError`), every one of them, each naming its key. Covers: the worker pool, the four cheap stages, and the
targets' served shapes. the agent loop and its LLM providers (issue 4). the served scenario and the
replay stage (issue 3). where evaluations run: the executor (issue 6). Later sections add their own
models here.
"""
from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from harness.sandbox import SECRET_NAME

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
    folder_bytes: int = Field(ge=64 << 20)           # the candidate's own folder, a tmpfs (Triton cache, /tmp)
    shm_bytes: int = Field(ge=1 << 20)               # its private /dev/shm
    file_size_bytes: int = Field(ge=16 << 20)        # RLIMIT_FSIZE: also bounds each reply's outputs
    open_files: int = Field(ge=64)                   # RLIMIT_NOFILE
    processes: int = Field(ge=64)                    # RLIMIT_NPROC, counted per user (every sandbox's is one)
    cpu_seconds: int = Field(ge=60)                  # RLIMIT_CPU of a worker, its threads together
    cpu_address_space_bytes: int = Field(ge=4 << 30)  # RLIMIT_AS, on the CPU device only
    gpu_memory_fraction: float = Field(gt=0, le=1)   # of the GPU's memory, the most a worker's allocator may hold
    trusted_gpu_bytes: int = Field(ge=0)             # held by the evaluator before any candidate runs (harness/gpu_memory.py)

    @field_validator("env_passthrough")
    @classmethod
    def _no_secrets(cls, names: list[str]) -> list[str]:
        for name in names:
            if SECRET_NAME.search(name):
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
        for name in v:
            if not re.fullmatch(r"__[A-Za-z]\w*__", name):
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
            for name in names:
                if name != "*" and not all(word.match(p) for p in name.split(".")):
                    raise ValueError(f"{module}: {name!r} is not a dotted public name (no dunder, no private)")
        return v


class DispatchConfig(Strict):
    timeout_s: float = Field(gt=0)
    aux_work_fraction: float = Field(ge=0, le=1)
    forbidden_ops: list[str]
    library_kernel_patterns: list[str]
    min_own_device_share: float = Field(ge=0, le=1)


class Floor(Strict):
    max_abs: float = Field(gt=0)
    rel_l2: float = Field(gt=0)


class WarmThreads(Strict):
    """Per device: Triton compiles at once when parity first compiles the candidate for every shape class (0: no warm)."""
    cuda: int = Field(ge=0, le=64)
    cpu: int = Field(ge=0, le=64)


class ParityConfig(Strict):
    timeout_s: float = Field(gt=0)
    warm_threads: WarmThreads = WarmThreads(cuda=8, cpu=0)
    distributions: list[Literal["normal", "peaky", "shifted_keys", "served"]] = Field(min_length=1)
    sm_scale: tuple[float, float]                # per check, a factor of 1/sqrt(head_dim) drawn log-uniformly from [lo, hi]
    unused_slots: list[Literal["nan", "zeros", "stale", "random"]] = Field(min_length=1)   # drawn per check
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
        return self


class AttentionConfig(Strict):
    cuda: AttentionDeviceConfig
    cpu: AttentionDeviceConfig


class TargetsConfig(Strict):
    attention: AttentionConfig


class BudgetMinutes(Strict):
    """Wall-clock budget of one `kevo-agent run`, per device kind."""
    cuda: float = Field(gt=0)
    cpu: float = Field(gt=0)


class AgentConfig(Strict):
    """The agent loop (issue 4): who proposes, how long a run lasts, what is worth coding."""
    provider: Literal["offline", "openai", "anthropic"]   # offline: the built-in proposer, no keys
    ops: list[str] = Field(min_length=1)                  # which of the target's ops a run evolves
    budget_minutes: BudgetMinutes
    max_candidates: int | None = Field(ge=1)              # null: no limit
    max_cost_usd: float = Field(ge=0)                     # LLM spend after which a run stops
    max_device_minutes: float | None = Field(gt=0)        # evaluator stage time (all sessions) after which a run stops; null: none
    min_ceiling: float = Field(ge=1)                      # claims with a lower end-to-end ceiling are not coded
    compile_repair_rounds: int = Field(ge=0)              # repair rounds for an LLM candidate that fails to compile
    history_in_prompt: int = Field(ge=0)                  # candidates the planner reads in full (older: one line)
    overlap: bool                                         # propose the next candidate while one is evaluated
    proposals_in_flight: int | None = Field(default=None, ge=1)   # with overlap: proposals written or waiting at once; null: 3 per slot
    standin_op_share: dict[str, float]                    # assumed op shares until the served profile exists
    runs_dir: str                                         # run ledgers, relative to the project root
    heads: dict[str, str] = Field(default_factory=dict)   # op -> catalog family a run starts from (default: the reference)

    def in_flight(self, slots: int) -> int:
        """How many proposals a slow proposer may have being written or waiting for the evaluator at once,
        with `slots` evaluation slots: `proposals_in_flight`, or 3 per slot (an LLM call of ~30 s against
        ~12 s a candidate through microbench on the H200: docs/BENCHMARKS.md). Used only with `overlap`."""
        return self.proposals_in_flight or 3 * max(1, slots)

    @model_validator(mode="after")
    def _shares(self) -> "AgentConfig":
        for op in self.ops:
            if op not in self.standin_op_share:
                raise ValueError(f"standin_op_share has no share for op {op!r} (agent.ops)")
        for op, share in self.standin_op_share.items():
            if not 0 < share <= 1:
                raise ValueError(f"standin_op_share.{op} must be in (0, 1]")
        for op in self.heads:
            if op not in self.ops:
                raise ValueError(f"heads names op {op!r}, which is not in agent.ops")
        return self


class ProviderConfig(Strict):
    base_url: str | None            # null: the vendor's API; else any compatible server (vLLM, SGLang, ...)
    api_key_env: str | None         # the environment variable holding the key; null: the server needs none
    planner_model: str
    coder_model: str

    def api_key(self, name: str) -> str:
        """The key from the environment; an error naming the variable when it is needed and unset."""
        if self.api_key_env is None:
            return "unused"
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise ConfigError(f"{self.api_key_env} is not set; providers.{name} needs it "
                              f"(or set providers.{name}.api_key_env: null for a server without keys)")
        return key


class RetryConfig(Strict):
    attempts: int = Field(ge=1)     # calls in all, the first included, on rate limits, 5xx, timeouts and malformed replies
    initial_s: float = Field(ge=0)  # first backoff; doubles each retry, with jitter
    max_s: float = Field(ge=0)
    max_retry_after_s: float = Field(ge=0)  # a service's Retry-After / retry-after-ms is honoured up to this


class OutageConfig(Strict):
    """When a provider's retries run out (it is down): wait, then ask again, doubling the wait up to max_wait_s."""
    wait_s: float = Field(ge=0)             # the first wait after a round of retries ran out
    max_wait_s: float = Field(ge=0)
    give_up_s: float | None = Field(ge=0)   # an outage longer than this stops the run; null: wait as long as the budget lasts
    unreached_s: float | None = Field(ge=0)  # a service never reached since the run started stops it after this; null: wait


class Price(Strict):
    input: float = Field(ge=0)      # USD per million input tokens
    output: float = Field(ge=0)     # USD per million output tokens


class ProvidersConfig(Strict):
    openai: ProviderConfig
    anthropic: ProviderConfig
    timeout_s: float = Field(gt=0)          # one call, whole: the reply streamed to its end
    connect_timeout_s: float = Field(gt=0)  # reaching the service
    idle_timeout_s: float = Field(gt=0)     # the longest silence within a call (before its first byte, between chunks)
    max_output_tokens: int = Field(ge=256)
    max_reply_chars: int = Field(ge=1000)   # a longer reply is malformed: its size and hash are kept, not its text
    retry: RetryConfig
    outage: OutageConfig
    fallback: Literal["openai", "anthropic"] | None   # asked (with its own models) while the run's provider is down
    prices: dict[str, Price]

    @model_validator(mode="after")
    def _priced(self) -> "ProvidersConfig":
        for name in ("openai", "anthropic"):
            p = getattr(self, name)
            for role in ("planner_model", "coder_model"):
                model = getattr(p, role)
                if model not in self.prices:
                    raise ValueError(f"prices has no entry for {model!r} (providers.{name}.{role}); add one (0 for a local server)")
        return self


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

    @model_validator(mode="after")
    def _known_presets(self) -> "ServedConfig":
        for dev in ("cuda", "cpu"):
            name = getattr(self, dev).preset
            if name not in self.presets:
                raise ValueError(f"{dev}.preset {name!r} is not one of the presets ({', '.join(self.presets)})")
        return self


class DaskConfig(Strict):
    scheduler: str | None          # a running `dask scheduler` (tcp://host:8786); null: a local cluster, one worker per slot
    start_timeout_s: float = Field(gt=0)   # connecting, and waiting for the first worker with a GPU slot


class ExecutorConfig(Strict):
    """Where candidates are evaluated (harness/executors.py, harness/cluster.py; docs/CLUSTER.md)."""
    kind: Literal["local", "dask"]             # local: slot processes on this machine; dask: a Dask cluster
    gpus: Literal["auto"] | list[int]          # CUDA: the GPUs given a slot each (indices among those visible)
    cpu_slots: int = Field(ge=1)               # CPU: slots, each on its own share of the cores
    slot_cores: Literal["blocks", "interleaved", "none"] = "blocks"   # how the cores are dealt to the slots
    requeue_limit: int = Field(ge=0)           # a job whose slot process or Dask worker died is re-queued at most this often
    verdict_cache: bool = True                 # reuse a verdict whose inputs are all unchanged (harness/verdicts.py)
    health_retry_s: float = Field(default=5.0, ge=0)   # a device failing its health check is checked once more after this
    dask: DaskConfig
    slots_per_gpu: int = Field(default=2, ge=1)   # CUDA: slot processes per GPU; only the timed stages hold it alone (harness/lease.py)

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, v):
        if v != "auto" and (not v or len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("gpus must be auto or a non-empty list of distinct GPU indices (two slots on one GPU would time each other)")
        return v


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
                raise ValueError(f"served.{dev}.preset {name!r} has heads [{p.q_heads}, {p.kv_heads}] and head_dim "
                                 f"{p.head_dim}; targets.attention.{dev} has heads {[list(h) for h in sec.heads]} "
                                 f"and head_dim {sec.head_dim}")
        return self


def _message(err: ValidationError, source: str) -> str:
    """Every error, each naming its key, on one line; unknown keys (typos) first, each with the likeliest
    missing key beside it as a guess."""
    errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    parts = []
    for e in errors:
        loc = tuple(str(p) for p in e["loc"])
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            siblings = [str(m["loc"][-1]) for m in errors if m["type"] == "missing" and m["loc"][:-1] == e["loc"][:-1]]
            close = difflib.get_close_matches(loc[-1], siblings, n=1) if loc else []
            msg = "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
        elif e["type"] == "missing":
            msg = "missing key"
        parts.append(f"{'.'.join(loc) or '(top level)'}: {msg}")
    count = f"{len(parts)} errors: " if len(parts) > 1 else ""
    return f"{source}: {count}" + "; ".join(" ".join(p.split()) for p in parts)


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
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_message(e, str(path))) from None
