"""A stand-in for CUDA's timing calls on a CPU, where there are none: `install()` puts an `Event` that records
time.perf_counter, and a `synchronize` and `_sleep` that do nothing, into torch.cuda. It lets the worker's timing
code (harness/worker_timing.py `timed`) run on a CPU in a process of its own, so that what it calls, in which order
and on which inputs can be tested there; the figures it yields are CPU wall times, never reported as anything.
`python tests/fakes/cuda_timing.py REQUEST RESULT` runs one `time` request in a CPU worker on the candidate
file the request names and writes what came back (tests/test_microbench_queries.py)."""
from __future__ import annotations

import sys
import time

import torch


class Event:
    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "Event") -> float:
        return (end.at - self.at) * 1e3


def install() -> None:
    torch.cuda.Event = Event
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda._sleep = lambda cycles: None


def run(request_path: str, result_path: str) -> None:
    """One `time` request (torch.save'd: the message, the candidate's source) in a CPU worker, its candidate's
    calls logged (each call's query, and the value of the candidate's `HIT` probe after it, where it has one)."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from harness.transport import Arena, read_arena
    from harness.worker import Worker
    from harness.worker_timing import timed

    install()
    request = torch.load(request_path, weights_only=False)
    folder = Path(tempfile.mkdtemp())
    (folder / "candidate.py").write_text(request["source"])
    spec = importlib.util.spec_from_file_location("candidate", folder / "candidate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    op, log = request["msg"]["op"], []
    real = getattr(module, op)

    def logged(*args):
        out = real(*args)
        log.append({"q": args[0].clone(), "hit": module.HIT() if hasattr(module, "HIT") else None})
        return out

    setattr(module, op, logged)
    worker = Worker(folder, "attention", "cpu", 1 << 20)
    worker.module = module
    reply = timed(worker, request["msg"])
    outputs = read_arena(reply["outputs"], "cpu", [Arena(fd, 1 << 30) for fd in worker.pending])
    torch.save({"calls": log, "outputs": outputs, "left": [s["q"].clone() for s in worker.timed_sets[op]],
                "synced_ms": reply["synced_ms"]}, result_path)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2]))
