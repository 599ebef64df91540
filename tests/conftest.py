"""Shared fixtures: the project's config (optionally edited), one warm worker pool per session, and
`evaluate_source`, which runs the real staged evaluator on a candidate's source text."""
from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import yaml

from harness.config import DEFAULT_CONFIG, Config
from harness.evaluate import evaluate, open_pool

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


CPU_GATES = {"stages.replay.cpu_gates": True}


def config_with(**overrides) -> Config:
    """The project's config with dotted-path overrides, e.g. config_with(**{"stages.parity.timeout_s": 20}).
    The verdict cache is off unless an override turns it on: a test judges its candidate itself, never
    a verdict an earlier run of the suite left under runs/.verdicts. One proposal is written at a time unless
    an override says otherwise: a scripted LLM answers in the order it is asked, and its scripts are written
    for the ids of a run that asks in id order. On a CPU the replay stage's gates are off unless an override
    turns them on (`CPU_GATES`): each costs two server starts per candidate, the tests of the agent's loop
    judge many candidates, and the gates' own tests (test_replay.py, test_stages.py) turn them on."""
    raw = copy.deepcopy(yaml.safe_load(DEFAULT_CONFIG.read_text()))
    raw["executor"]["verdict_cache"] = False
    raw["agent"]["proposals_in_flight"] = 1
    raw["stages"]["replay"]["cpu_gates"] = False
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return Config.model_validate(raw)


# The compile stage's allowlist opened wide (every public torch name; ctypes, numpy, os and time importable; no
# builtin or attribute forbidden; __import__ readable), as overrides for config_with: for candidates written to test the defenses
# behind it (a crash through ctypes, work in numpy, a patched timer, a slow import). The allowlist is the first
# line, not the only one; these prove the later ones hold without it.
RUNTIME_ONLY = {
    "stages.compile.allowed_names": {**yaml.safe_load(DEFAULT_CONFIG.read_text())["stages"]["compile"]["allowed_names"],
                                     "torch": ["*"], "torch.nn.functional": ["*"], "ctypes": ["*"], "numpy": ["*"],
                                     "os": ["*"], "posix": ["*"], "time": ["*"]},
    "stages.compile.forbidden_builtins": [], "stages.compile.forbidden_attributes": [],
    "stages.compile.readable_dunders": ["__name__", "__import__"]}


def runtime_only(**overrides) -> Config:
    return config_with(**RUNTIME_ONLY, **overrides)


def runtime_only_yaml(path: Path) -> Path:
    """RUNTIME_ONLY as a config file, for tests that go through `kevo-agent --config`."""
    cfg = runtime_only()
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


@pytest.fixture(scope="session")
def cfg() -> Config:
    return config_with()


@pytest.fixture(scope="session")
def pool(cfg):
    p = open_pool(cfg, "attention")
    yield p
    p.close()


@pytest.fixture
def evaluate_source(cfg, pool):
    def run(source: str, until: str | None = None, config: Config | None = None, beat: float = 1.0):
        return evaluate(source, "attention", config or cfg, pool, until=until, beat=beat)
    return run


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, read from the host's /proc (each thread's children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in os.listdir(f"/proc/{p}/task"):
            todo += [int(c) for c in open(f"/proc/{p}/task/{task}/children").read().split()]
    return found


def thread_states(pid: int) -> set[str]:
    """The run state of every thread of `pid`, read from the host's /proc."""
    states = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        stat = open(f"/proc/{pid}/task/{task}/stat").read()
        states.add(stat[stat.rindex(")") + 2])
    return states
