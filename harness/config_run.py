"""The config sections that drive a run rather than judge a candidate: the agent loop (`agent`), its LLM
providers (`providers`) and where evaluations run (`executor`).

Not here: the sections a verdict depends on (worker, stages, targets, served: harness/config.py, which
also loads the file), or the base models and error lines (harness/config_base.py).
"""
from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from harness.config_base import ConfigError, Strict


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
    explore: bool = True                                  # built-in proposer: measure untried steps once none is worth coding
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


class DaskConfig(Strict):
    scheduler: str | None          # a running `dask scheduler` (tcp://host:8786); null: a local cluster, one worker per slot
    start_timeout_s: float = Field(gt=0)   # connecting, and waiting for the first worker with a GPU slot


class ExecutorConfig(Strict):
    """Where candidates are evaluated (harness/executors.py, harness/local_executor.py, harness/cluster.py; docs/CLUSTER.md)."""
    kind: Literal["local", "dask"]             # local: slot processes on this machine; dask: a Dask cluster
    gpus: Literal["auto"] | list[int]          # CUDA: the GPUs given a slot each (indices among those visible)
    cpu_slots: int = Field(ge=1)               # CPU: slots, each on its own share of the cores
    slot_cores: Literal["blocks", "interleaved", "none"] = "blocks"   # how the cores are dealt to the slots
    requeue_limit: int = Field(ge=0)           # a job whose slot process or Dask worker died is re-queued at most this often
    verdict_cache: bool = True                 # reuse a verdict whose inputs are all unchanged (harness/verdicts.py)
    health_retry_s: float = Field(default=5.0, ge=0)   # a device failing its health check is checked once more after this
    dask: DaskConfig
    slots_per_gpu: int = Field(ge=1)   # CUDA: slot processes per GPU; microbench holds it alone, the replay whole (harness/lease.py)

    @field_validator("gpus")
    @classmethod
    def _distinct(cls, v):
        if v != "auto" and (not v or len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("gpus must be auto or a non-empty list of distinct GPU indices (two slots on one GPU would time each other)")
        return v
