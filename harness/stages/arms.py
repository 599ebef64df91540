"""The servers of one replay (stage 5, harness/stages/replay.py): started together from one weight seed,
from the thread that asks (a server dies with the thread that started it), once this process has given
back its working GPU memory and each one's share is free (harness/gpu_memory.py); waited for in any order,
stopped together whatever happens; a replay sent to one of them through the real client; the trace they
are warmed with; and what a failure of each means - the candidate's server failing is the candidate's
rejection, any other's a harness error.
Not covered: what is sent or how it is judged (replay.py), starting one server (harness/served/launch.py).
"""
from __future__ import annotations

import logging
import subprocess

import torch

from harness import replies
from harness.compiled import KEPT
from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.gpu_memory import cache_shortfall, check_servers_fit, release
from harness.served.client import ReplayRun, replay
from harness.served.launch import (ServerFailure, ServerHandle, cache_bytes, ready_timeout, server_cache, start_server,
                                   wait_ready, with_output)
from harness.served.traces import TraceError, TraceRequest, load_trace
from harness.stages.common import Rejected

log = logging.getLogger(__name__)     # progress lines (kevo-agent evaluate --progress); nothing decides on them


def served_lines(cfg: Config, device: str):
    served = getattr(cfg.served, device)
    path = PROJECT_ROOT / served.trace
    try:
        return load_trace(path), str(path)
    except TraceError as e:
        raise HarnessError(str(e)) from None


def warm_lengths(cfg: Config, device: str) -> list[int]:
    """The prompt lengths a server's warm-up meets: every length of the window (the draw picks among them)."""
    served = getattr(cfg.served, device)
    lines, _ = served_lines(cfg, device)
    return [ln.length for ln in lines if ln.arrival_s < served.window_s]


def explain(run: ReplayRun, server: ServerHandle) -> str:
    """Why a replay did not complete, in words: the client's first error, how the server ended."""
    try:
        server.proc.wait(timeout=2)                      # a dying server: let it finish dying
    except subprocess.TimeoutExpired:
        pass
    died = "" if server.alive() else f"the server {server.how_it_ended()} during the replay; "
    tail = server.log_tail()
    return with_output(died + run.describe_failures(), tail)


def send(cfg: Config, server: ServerHandle, requests: list[TraceRequest], label: str, burst: bool = False) -> ReplayRun:
    """One replay through the real client (a burst: at once, one group); a request that did not complete
    is a ServerFailure."""
    run = replay(server.url, server.model, requests, cfg.served.request_timeout_s, cfg.served.drain_timeout_s, label, burst,
                 cfg.served.logprobs)
    run.server_ready_s = server.ready_s
    if run.failures():
        raise ServerFailure(explain(run, server))
    return run


def server_failed(cfg: Config, label: str, e: ServerFailure) -> Exception:
    """What a server's failure means: the candidate's, its rejection; any other's, a harness error. One that ran
    out of GPU memory did so in its own share (harness/gpu_memory.py), which the words say (they decide nothing:
    the output they quote can be the candidate's)."""
    share = ""
    if "out of memory" in str(e).lower():
        share = (f"it ran out of GPU memory in its share, served.gpu_memory_fraction {cfg.served.gpu_memory_fraction:g} "
                 f"of the GPU ({'the head gets the same' if label == 'candidate' else 'raise it, or lower the cache'}): ")
    if label == "candidate":
        return Rejected(f"the candidate's server: {share}{e}", "server_failed")
    return HarnessError(f"the {label} server: {share}{e}")


def served_stats(server: ServerHandle, head: bool = False) -> dict | None:
    """A server's own accounting (GET /kevo/stats), validated like any reply: None when it keeps none. Malformed, the
    candidate's is its rejection, the head's a harness error (it was accepted before)."""
    stats = server.stats()
    if stats is None:
        return None
    try:                                  # a kernel's process wrote it: validated like any reply
        return replies.parse("served_stats", stats).model_dump()
    except replies.MalformedReply as e:
        if head:                          # the head was accepted before: its server's fault is the harness's to report
            raise HarnessError(f"the head's server's accounting (GET /kevo/stats) is malformed: {e}") from None
        raise Rejected(f"the candidate's server's accounting (GET /kevo/stats) is malformed: {e}", "protocol") from None


class Servers:
    """The replay's servers, started at once from this thread (a server dies with the thread that started
    it) and stopped together whatever happens, those still starting too. `wait` waits for some or all of
    them; a server that failed to start is the failure of its label (the candidate's first)."""

    def __init__(self, cfg: Config, device: str, sources: dict[str, str | None], weight_seed: int,
                 wait: bool = True, other_heads: dict[str, str] | None = None) -> None:
        """`other_heads`: per op, the source of its head, served by every server but the reference where its own
        kernel does not define that op (harness/served/ops.py): both arms serve the step the run would ship."""
        self.cfg, self.device, self.weight_seed, self.other_heads = cfg, device, weight_seed, other_heads or {}
        self.held = 0                    # the bytes this process's allocator still held when they started
        self.free = 0                    # the bytes free on the GPU then
        if device == "cuda" and not cfg.served.external:     # each server's share free before any starts
            self.held = release(torch.device("cuda"))       # this process's own working reserve too
            free = self.free = check_servers_fit(cfg, torch.device("cuda"), len(sources))
            total = torch.cuda.mem_get_info(torch.device("cuda"))[1]
            for label in sources:
                reference = label == "reference"
                why = cache_shortfall(label, server_cache(cfg, device, reference)[0], cache_bytes(cfg, device, reference),
                                      total, cfg.served.gpu_memory_fraction)
                if why:
                    raise HarnessError(why)
            log.info("replay: %.1f GiB of GPU memory free for %d servers, each capped at %g of the GPU (%.1f GiB "
                     "still held here)", free / (1 << 30), len(sources), cfg.served.gpu_memory_fraction, self.held / (1 << 30))
        warm = warm_lengths(cfg, device)
        self.handles: dict[str, ServerHandle] = {}
        self.starting: dict[str, ServerHandle] = {}
        self.runs: dict[str, list[str | None]] = {}      # per label, the sources whose code its server runs
        self.carried: dict[str, int] = {}                # per label, the bytes of compiled kernels it was handed
        failure: tuple[str, ServerFailure] | None = None
        for label, source in sources.items():
            try:
                reference = label == "reference"
                self.runs[label] = [] if reference else [source, *self.other_heads.values()]
                carried = KEPT.given(self.runs[label]) if self.carries() else []
                self.carried[label] = sum(map(len, carried))
                self.starting[label] = start_server(cfg, device, source, warm, weight_seed=weight_seed, wait=False,
                                                    reference=reference, other_heads=None if reference else self.other_heads,
                                                    carried=carried)
            except ServerFailure as e:
                failure = failure or (label, e)
        if failure:
            self.close()
            raise server_failed(self.cfg, *failure)
        names = list(self.starting)
        log.info("replay: the %s servers are starting (model build and warm-up)",
                 ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names))
        if wait:
            self.wait()

    def wait(self, labels: list[str] | None = None) -> None:
        failure: tuple[str, ServerFailure] | None = None
        for label in list(self.starting if labels is None else labels):
            h = self.starting.pop(label, None)
            if h is None:
                continue
            try:
                self.handles[label] = wait_ready(h, ready_timeout(self.cfg))
                log.info("replay: the %s server is up (%.0f s from its start)", label, self.handles[label].ready_s)
            except ServerFailure as e:
                failure = failure if failure and failure[0] == "candidate" else (label, e)
        if failure:
            self.close()
            raise server_failed(self.cfg, *failure)

    def add(self, label: str, source: str | None) -> ServerHandle:
        """One more server from the same weights (the benches': one arm after another)."""
        try:
            h = start_server(self.cfg, self.device, source, warm_lengths(self.cfg, self.device), weight_seed=self.weight_seed,
                             other_heads=self.other_heads)
        except ServerFailure as e:
            raise server_failed(self.cfg, label, e) from None
        self.handles[label] = h
        return h

    def carries(self) -> bool:
        """Whether compiled kernels are carried to and from these servers (embedded ones only: harness/compiled.py)."""
        return bool(self.cfg.worker.carry_bytes) and not self.cfg.served.external

    def carried_mib(self) -> dict[str, float]:
        """Metrics: the compiled kernels each server that was handed some was handed, MiB."""
        return {f"{label}_carried_mib": n / (1 << 20) for label, n in self.carried.items() if n}

    def send(self, label: str, requests: list[TraceRequest], burst: bool = False) -> ReplayRun:
        """`send` to the server of `label`; a request that did not complete is that label's failure (`server_failed`)."""
        try:
            return send(self.cfg, self.handles[label], requests, label, burst)
        except ServerFailure as e:
            raise server_failed(self.cfg, label, e) from None

    def stop(self, label: str) -> None:
        """Stop `label`'s server, first keeping what it compiled for the next server of the same sources (one that
        started: harness/compiled.py)."""
        h = self.handles.pop(label, None)
        if h is not None:
            try:
                if self.carries() and any(self.runs.get(label, ())) and h.alive():
                    KEPT.keep_from(self.runs[label], h.compiled(self.cfg.worker.carry_bytes))
            finally:                            # whatever the fetch met, the server and its GPU memory go
                h.stop()

    def close(self) -> None:
        for label in list(self.handles):
            self.stop(label)
        while self.starting:
            self.starting.popitem()[1].stop()

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
