"""What a case's timed calls launched, as the worker reported it (harness/replies.py `KernelUse`): registers,
spills and how many programs of each kernel fit on an SM at once. Shown in the records and the planner's
evidence, never judged by.
"""
from __future__ import annotations

import torch

from harness.replies import KernelUse


def programs_per_sm(k: KernelUse, regs_sm: int = 65536, smem_sm: int = 233472, threads_sm: int = 2048,
                    warp: int = 32) -> int:
    """How many programs of kernel `k` fit on one SM at once, by registers (allocated 8 a thread at a time),
    shared memory (1 KB reserved a program) and threads; the defaults are sm90's (the H100 and H200)."""
    threads = warp * k.warps
    return min(regs_sm // (max(8, -(-k.registers // 8) * 8) * threads), smem_sm // (k.shared_bytes + 1024),
               threads_sm // threads, 32)


def launched_resources(kernels: list[KernelUse], device: torch.device) -> dict[str, float]:
    """What a case's timed calls launched, as the worker reported it (shown, never judged by): the most registers
    and spilled 32-bit words a thread among its kernels, and the fewest programs of any one of them that fit on an
    SM of this device at once. A persistent grid sized for more programs than fit runs the rest as a second wave
    (knowledge/attention/decode.md)."""
    if not kernels or device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    limits = (getattr(props, "regs_per_multiprocessor", 0) or 65536, props.shared_memory_per_multiprocessor,
              props.max_threads_per_multi_processor, getattr(props, "warp_size", 0) or 32)
    return {"kernel_registers": float(max(k.registers for k in kernels)),
            "kernel_spills": float(max(k.spills for k in kernels)),
            "kernel_programs_per_sm": float(min(programs_per_sm(k, *limits) for k in kernels))}
