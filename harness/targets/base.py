"""What a target is: its ops, their contract, and the cases the stages run them on.

A target module defines everything about one operator family in one place — contract, float64
reference, input generators, served and boundary cases, baseline, library anchor and cost model —
so the stages stay generic. Nothing here imports candidate code.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

Inputs = dict[str, Any]  # contract argument name -> Tensor or Python scalar

# The distribution for calls that launch nothing (the worker's warm, which only compiles and drops its outputs):
# an op's `make_inputs` returns every shape, dtype and host fact (lengths, block tables, offsets, sm_scale) that
# any distribution would draw from the same seed, and leaves the payload as allocated, unwritten.
UNFILLED = "unfilled"


def redrawn(t: torch.Tensor, seed: int) -> torch.Tensor:
    """A tensor of t's shape, dtype and device drawn afresh from `seed` (standard normal, as the `normal` distribution
    draws its payloads), the same in any process on that device: microbench's per-call argument (`Op.per_call`), in
    the worker for every timed call and on the trusted side for the call it checks (harness/worker_timing.py)."""
    gen = torch.Generator(device=t.device).manual_seed(seed)
    return torch.randn(tuple(t.shape), generator=gen, dtype=torch.float32, device=t.device).to(t.dtype)


# The params a case's key names first, with their short tags, in this order; any other param follows under its
# own name, and `size` (derived from these, for ordering cases) is left out.
_KEY_TAGS = {"batch": "b", "length_range": "len", "lengths": "lens", "q_heads": "hq", "kv_heads": "hkv",
             "head_dim": "d", "block_size": "bs"}


def _key_value(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "-".join(_key_value(x) for x in v)
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return format(v, "g").replace(".", "p")
    return str(v)


@dataclass(frozen=True)
class Case:
    """One shape to run an op on. `weight` > 0 marks a served shape and its share of the mix."""
    op: str
    label: str
    params: dict[str, Any]
    weight: float = 0.0

    @property
    def key(self) -> str:
        """The case's shape as a stable, readable name, the one place it is made: the op, then each param
        with its tag (`decode_b32_len1024-2048_hq32_hkv8_d128_bs16`). Two cases of one shape share it; the
        weight and the label do not enter it. Letters, digits, '_' and '-' only (no '.')."""
        p = self.params
        named = [f"{tag}{_key_value(p[name])}" for name, tag in _KEY_TAGS.items() if name in p]
        named += [f"{name}{_key_value(v)}" for name, v in p.items() if name not in _KEY_TAGS and name != "size"]
        return "_".join([self.op, *named])


@dataclass(frozen=True)
class Cost:
    bytes: float      # fewest bytes the op must move through device memory
    flops: float      # floating-point operations of the math itself
    madds: float      # multiply-adds: the yardstick for how much work torch ops may do beside the kernel


@dataclass(frozen=True)
class Op:
    name: str
    arg_names: tuple[str, ...]                       # the contract's argument order
    make_inputs: Callable[[Case, str, int, torch.device, torch.dtype], Inputs]  # (case, distribution, seed, ...)
    reference: Callable[..., torch.Tensor]           # float64, trusted
    baseline: Callable[..., torch.Tensor]            # what a user runs today, in the served dtype
    cost: Callable[[Inputs], Cost]
    output_shape: Callable[[Inputs], tuple[int, ...]]
    anchor: Callable[..., torch.Tensor] | None = None  # strongest library kernel on equivalent shapes
    anchor_inputs: Callable[[Inputs], Inputs] | None = None  # built once, outside the timed region
    anchor_name: str = ""
    unit: str = "TB/s"                                # the figure reported: TB/s (bytes) or TFLOP/s
    # Host-side facts the baseline may use without reading them back from the GPU (a serving engine
    # holds them on the host anyway, e.g. sequence bounds): extra keyword arguments, built outside
    # any timed region, so that a device-to-host sync inside the baseline never inflates its time.
    baseline_host: Callable[[Inputs], dict[str, Any]] | None = None
    # The torch ways to the op a config may choose among, by name (`with_baseline`); `baseline` is one of them.
    baselines: Mapping[str, Callable[..., torch.Tensor]] = field(default_factory=dict)
    # What sets a parity check's tolerance: its error against the float64 reference on the check's inputs
    # (None: the baseline's). An op names another torch way only where it errs as the baseline does and is
    # cheaper to run on fresh inputs (harness/stages/common.py `draw`).
    calibration: Callable[..., torch.Tensor] | None = None
    # The arguments a served step hands each of its layers as the same objects (its lengths, tables, offsets): a
    # parity check of a step's next layer is handed the previous call's (harness/worker.py).
    step_shared: tuple[str, ...] = ()
    # The argument microbench draws afresh for every call it times (`redrawn`; attention: the query, new at every
    # served call): on its set's inputs again, a call could be answered from an output kept for them. None: the
    # timed calls repeat their set's inputs.
    per_call: str | None = None

    def calibrate(self, inputs: Inputs) -> torch.Tensor:
        """The output whose error against the reference sets a check's tolerance."""
        return (self.calibration or self.baseline)(**inputs)

    @property
    def baseline_name(self) -> str:
        """The name `baselines` gives the baseline ("": an op with one way, unnamed)."""
        return next((n for n, f in self.baselines.items() if f is self.baseline), "")

    def with_baseline(self, name: str) -> "Op":
        """This op with the baseline `baselines` names so (the function itself: no extra frame per call)."""
        if name not in self.baselines:
            raise ValueError(f"{self.name} has no baseline {name!r}; it has {', '.join(self.baselines) or 'one, unnamed'}")
        return replace(self, baseline=self.baselines[name])

    def prepared_baseline(self, inputs: Inputs) -> Callable[..., torch.Tensor]:
        """The baseline, called with the contract's arguments, its host-side facts already computed."""
        extra = self.baseline_host(inputs) if self.baseline_host is not None else {}
        return functools.partial(self.baseline, **extra) if extra else self.baseline


@dataclass(frozen=True)
class Target:
    name: str
    ops: dict[str, Op]
    served_cases: Callable[[Any], list[Case]]        # device section of the target's config -> cases
    boundary_cases: Callable[[Any], list[Case]]
    contract: str                                    # the text a coder is given
    # The largest calls the served engine makes (device section, harness/served/limits.py's limits -> cases).
    limit_cases: Callable[[Any, Any], list[Case]] | None = None
    # One parity check's draws from its secret seed: (case, distribution, random.Random, EvalContext) -> the case varied.
    vary: Callable[[Case, str, Any, Any], Case] | None = None
    # Microbench's timed sets: (case, random.Random) -> the case with its drawn shape (lengths) fixed by that
    # generator, each set's seed still drawing its payload, so that every candidate is timed on the same work.
    pin: Callable[[Case, Any], Case] | None = None
    # A twin check (parity): (an earlier check's case, its seed, its inputs, random.Random of the twin's seed) -> the
    # case whose inputs are the earlier ones with a part redrawn, the part named in its label (None: no twins).
    twin: Callable[[Case, int, Inputs, Any], Case] | None = None
    # A step's next layer (parity), called as `twin` is: the case whose inputs share the earlier check's lengths and
    # host facts, every payload redrawn (None: no such checks).
    layer: Callable[[Case, int, Inputs, Any], Case] | None = None

    def configured(self, baselines: Mapping[str, str]) -> "Target":
        """This target with the named ops' baselines chosen by name (op -> a name among its `baselines`)."""
        unknown = sorted(set(baselines) - set(self.ops))
        if unknown:
            raise ValueError(f"target {self.name} has no op {unknown[0]!r}")
        return replace(self, ops={n: op.with_baseline(baselines[n]) if n in baselines else op for n, op in self.ops.items()})

    def compile_case(self, shapes: Any, op: str) -> Case:
        """The smallest served case of an op: cheap to compile and launch."""
        cases = [c for c in self.served_cases(shapes) if c.op == op]
        return min(cases, key=lambda c: c.params["size"])
