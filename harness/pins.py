"""Where each of the local executor's slots runs: its GPU (CUDA_VISIBLE_DEVICES), its share of this
process's CPU cores, the key of the GPU lease it shares with the other slots of its GPU, and its share
of that GPU's memory (`slot_config`).
Not here: the slots themselves (harness/slot.py), the lease (harness/lease.py), feeding them jobs
(harness/local_executor.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from harness.config import Config
from harness.evaluate import resolve_device
from harness.slot import Pin


def core_locality(cpu: int) -> tuple[int, int]:
    """(NUMA node, first core of its last-level cache group) from sysfs; (0, 0) where the host says nothing."""
    sysfs = Path("/sys/devices/system/cpu") / f"cpu{cpu}"
    node = next((int(p.name[4:]) for p in sysfs.glob("node[0-9]*")), 0)
    group = 0
    for idx in sorted(sysfs.glob("cache/index[0-9]*")):
        try:
            if (idx / "level").read_text().strip() == "3":
                group = int((idx / "shared_cpu_list").read_text().strip().replace("-", ",").split(",")[0])
        except (OSError, ValueError):
            pass
    return node, group


def core_shares(n: int, layout: str = "blocks") -> list[tuple[int, ...]]:
    """This process's CPU cores dealt out to n slots (`deal_cores`)."""
    return deal_cores(sorted(os.sched_getaffinity(0)), n, layout)


def deal_cores(cores: list[int], n: int, layout: str, locality: Callable[[int], tuple] = core_locality) -> list[tuple[int, ...]]:
    """The cores dealt out to n slots (one core each where there are fewer cores than slots). blocks:
    contiguous runs of the cores ordered by `locality` (NUMA node and last-level cache), so that a slot
    shares as little cache with another as the host allows; interleaved: every n-th core to each; none:
    every slot gets every core."""
    if layout == "none":
        return [tuple(cores)] * n
    if n > len(cores):
        return [(cores[i % len(cores)],) for i in range(n)]
    if layout == "interleaved":
        return [tuple(cores[i::n]) for i in range(n)]
    ordered = sorted(cores, key=lambda c: (*locality(c), c))
    cuts = [len(cores) * i // n for i in range(n + 1)]
    return [tuple(sorted(ordered[a:b])) for a, b in zip(cuts, cuts[1:])]


def local_pins(cfg: Config, per_gpu: int | None = None) -> list[Pin]:
    """`per_gpu` pins per GPU (None: executor.slots_per_gpu; executor.gpus: indices among the GPUs this
    process sees), sharing that GPU's lease (`shared` when there are several); or cpu_slots pins, each its own lease.
    Either way each slot gets its own share of this process's CPU cores: an evaluation is mostly host
    work, and on the 2-GPU H200 host a job took about 10% longer with a second slot free to use every
    core (docs/BENCHMARKS.md, 2026-11-30 fourth session)."""
    ex = cfg.executor
    if resolve_device(cfg).type == "cuda":
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [v.strip() for v in seen.split(",")] if seen else [str(i) for i in range(torch.cuda.device_count())]
        indices = list(range(len(names)) if ex.gpus == "auto" else ex.gpus)
        # an index past the GPUs seen fails the slot's health check honestly; past a CUDA_VISIBLE_DEVICES
        # list it must not become a physical index (another slot's GPU, maybe): "-1" makes none visible
        missing = "-1" if seen else None
        n = ex.slots_per_gpu if per_gpu is None else per_gpu
        slots = [(i, k, names[i] if i < len(names) else (missing or str(i))) for i in indices for k in range(n)]
        return [Pin(name=f"gpu{i}" if n == 1 else f"gpu{i}.{k}", device="cuda", visible=gpu, cpus=cpus, lease=f"gpu:{gpu}",
                    shared=n > 1) for (i, k, gpu), cpus in zip(slots, core_shares(len(slots), ex.slot_cores))]
    return [Pin(name=f"cpu{i}", device="cpu", cpus=s) for i, s in enumerate(core_shares(ex.cpu_slots, ex.slot_cores))]


def slot_config(cfg: Config, pin: Pin, pins: list[Pin]) -> Config:
    """The config a slot runs under: on a GPU that n slots share, each worker's allocator may hold
    worker.gpu_memory_fraction / n of it, so that one candidate cannot take the memory another slot's
    candidate, references or replay servers need (a slot's own workers, one at a time, keep the whole
    share), and the slot's own reserve is bounded by its 1/n of the rest (`gpu_share`: harness/gpu_memory.py
    `reserve_bytes`), so that every slot's reserve and every worker at its cap fit on the GPU at once. The cap is
    in the worker section, so it is part of each verdict's cache key."""
    n = sum(1 for p in pins if p.device == "cuda" and (p.lease or p.name) == (pin.lease or pin.name))
    if pin.device != "cuda" or n <= 1:
        return cfg
    worker = cfg.worker.model_copy(update={"gpu_memory_fraction": cfg.worker.gpu_memory_fraction / n, "gpu_share": 1 / n})
    return cfg.model_copy(update={"worker": worker})
