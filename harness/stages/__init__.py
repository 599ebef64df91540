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
