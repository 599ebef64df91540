"""Benchmark (not a test): do two of this machine's cores share hardware, and does a busy host slow a core?

    python tests/bench/host_cores.py

A pure-Python busy loop pinned to one core runs 1.5 s and reports its rate; loops on several cores run at
once, and each rate is printed as a share of one loop alone: pairs of cores (neighbours, and cores half
the count apart, where hyperthread siblings are usually numbered), then every other core, the first half,
and all of them. A share well under 1 for a pair means the two share a physical core; for many cores at
once, that the host (hyperthreads below the virtual machine, clocks, neighbours) slows each under load.
Read with tests/bench/compile_contention.py, which does the same for Triton compiles. CPU only; any machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time


def spin(cpu: int) -> float:
    os.sched_setaffinity(0, {cpu})
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < 1.5:
        for _ in range(20000):
            n += 1
    return n / (time.perf_counter() - t)


def rates(cpus: list[int]) -> list[float]:
    procs = [subprocess.Popen([sys.executable, __file__, str(c)], stdout=subprocess.PIPE, text=True) for c in cpus]
    return [float(p.communicate(timeout=60)[0]) for p in procs]


def main() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    n = len(cpus)
    alone = sorted(rates([cpus[0]])[0] for _ in range(3))[1]          # the median of three: the first start is slow
    print(f"{n} cores; one loop alone on core {cpus[0]}: {alone:.3g} iterations/s (median of 3)")
    pairs = {(cpus[0], cpus[1]), (cpus[0], cpus[n // 2]), (cpus[1], cpus[n // 2 + 1]), (cpus[2], cpus[3])} if n >= 4 else set()
    for pair in sorted(pairs):
        print(f"cores {pair}: each at {', '.join(f'{r / alone:.2f}' for r in rates(list(pair)))} of alone", flush=True)
    for name, group in (("every other core", cpus[::2]), ("the first half", cpus[:n // 2]), ("all cores", cpus)):
        r = rates(group)
        print(f"{name} ({len(group)}) at once: mean {sum(r) / len(r) / alone:.2f} of alone, the slowest {min(r) / alone:.2f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(spin(int(sys.argv[1])))
    else:
        main()
