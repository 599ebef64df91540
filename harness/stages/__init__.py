"""The staged evaluator's stages, in cost order. Each takes the EvalContext and returns a StageResult
or raises Rejected; only the last, the full scored replay, can accept."""
from harness.stages.compile import compile_stage
from harness.stages.dispatch import dispatch_stage
from harness.stages.microbench import microbench_stage
from harness.stages.parity import parity_stage
from harness.stages.replay import replay_stage

STAGES = (
    ("compile", compile_stage),
    ("dispatch", dispatch_stage),
    ("parity", parity_stage),
    ("microbench", microbench_stage),
    ("replay", replay_stage),
)
STAGE_NAMES = tuple(name for name, _ in STAGES)
# The stages whose figures are timings (the worker's events, the replay's client clock): each holds its GPU
# alone, with nothing else of kevo's running on it (harness/lease.py); every other stage may share it.
TIMED_STAGES = frozenset({"microbench", "replay"})
# The stages that start servers of the served model (three of them, most of a GPU's memory): each holds its GPU
# alone and with every other slot of that GPU out of its job, its memory handed back (harness/lease.py, "whole").
WHOLE_GPU_STAGES = frozenset({"replay"})
# A timed stage whose first part needs no quiet GPU: microbench draws its references and inputs, has the worker
# prime the trusted code and builds the library's plans, none of it timed, before it times anything. That part
# holds the GPU shared, under the name `preparing(stage)`; the stage asks for the GPU alone only where its timing
# begins (`EvalContext.begin_timing`), so another slot's compile or parity overlaps it and a timed stage holds the
# GPU alone for less (H200, run h200-b: 1.6 s of a 6.1 s microbench was drawing and priming).
PREPARED_STAGES = frozenset({"microbench"})
_PREPARING = "-prepare"


def preparing(stage: str) -> str:
    """The name under which `stage`'s untimed first part asks for its GPU (a lease grant, a span, a live view)."""
    return stage + _PREPARING


def stage_of(name: str) -> str:
    """The stage a name given to `on_stage` belongs to (a stage's own name, or `preparing(stage)`)."""
    return name.removesuffix(_PREPARING)
