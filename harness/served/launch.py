"""Start a served process for the replay and the tests, and stop it: the trusted side of the server.

`start_server` starts the embedded server (harness/served/server.py) — or, when config gives
`served.external`, the user's own OpenAI-compatible server — with the candidate's source (or none:
the baseline), and returns once it answers GET /v1/models. The embedded server's warm-up sweeps the
served shapes only where a candidate may compile something (never for the torch baseline), and its
random weights can be drawn from a seed chosen per replay. For the embedded server the loopback
socket is bound and put into listening state here and handed over as a file descriptor (the
server is not allowed to bind); its environment is built from the worker allowlist, so no key
reaches it. An external server gets the allowlist plus its own `env_passthrough`, the candidate's
path in $KEVO_CANDIDATE ("" for the baseline) and the port in $KEVO_PORT and in "{port}" of its
command; it is not sandboxed (kevo cannot confine a server it does not control).
`ServerFailure` says, in words, how a server failed to start or died.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness import replies
from harness.config import PROJECT_ROOT, Config
from harness.detach import foreign, spawn_detached
from harness.errors import HarnessError
from harness.isolation import sandbox_spec
from harness.sandbox import clean_env, redact
from harness.served.limits import plan_for, served_limits


logger = logging.getLogger(__name__)   # not `log`: here that names a server's output file
GONE_TIMEOUT_S = 180.0               # a stopped server's threads, to leave the driver


class ServerFailure(Exception):
    """A served process that did not start, or died; the message says how (and its last output)."""


def with_output(what: str, tail: str) -> str:
    """What went wrong with a server, its last line of output beside it on the first line (a report cut to
    one line still names the cause: the exception it died of, say), then its last output in full. The
    server may run a candidate's code: the line is its own words, printable characters only."""
    if not tail.strip():
        return what
    last = "".join(c for c in tail.strip().splitlines()[-1].strip() if c.isprintable())
    return f"{what}: {last[:300]}; its last output:\n{tail}"


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)              # wakes the read waiting on it
    except OSError:                                  # closed already
        pass


def get_within(url: str, limit: int, within_s: float) -> tuple[int, bytes] | None:
    """GET `url`: its status and body, the whole exchange (the connect, the headers, the body) within `within_s`
    seconds; None when the body is over `limit` bytes, later, or there is no answer. A server that runs a
    candidate may trickle its headers or its body a byte at a time, each read within a socket's timeout: at the
    deadline the socket is shut, whatever read is waiting on it (the socket as connected: a response that closes
    its connection takes it from the connection object)."""
    deadline, parts = time.monotonic() + within_s, urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=within_s)
    try:
        conn.connect()
        cut = threading.Timer(max(deadline - time.monotonic(), 0.0), _shut, (conn.sock,))
        cut.start()
        try:
            conn.request("GET", parts.path or "/")
            reply = conn.getresponse()
            chunks, got = [], 0
            while got <= limit and (chunk := reply.read1(1 << 20)):    # as it comes: no buffer of `limit` made up front
                chunks.append(chunk)
                got += len(chunk)
        finally:
            cut.cancel()
    except (OSError, ValueError, http.client.HTTPException):     # BadStatusLine is no OSError
        return None
    finally:
        conn.close()
    if time.monotonic() > deadline or got > limit:              # a cut read returns what it had
        return None
    return reply.status, b"".join(chunks)


def _watch(pid: int | None) -> int | None:
    """A pidfd on `pid` (None when there is none to watch): readable once every thread of it has exited."""
    if pid is None:
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:                  # gone already
        return None


def _describe(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    url: str                   # base URL of the OpenAI API, e.g. http://127.0.0.1:PORT/v1
    model: str
    workdir: Path
    external: bool
    log_limit: int
    log: int                        # a memory file holding the server's stdout and stderr (made here)
    ready_s: float = float("nan")   # from start to answering GET /v1/models: the import, the model, the warm-up
    started: float = field(default_factory=time.monotonic)   # when its process was started

    def alive(self) -> bool:
        return self.proc.poll() is None

    def how_it_ended(self) -> str:
        return _describe(self.proc.poll())

    def log_tail(self) -> str:
        try:
            size = os.fstat(self.log).st_size
            data = os.pread(self.log, 4 * self.log_limit, max(0, size - 4 * self.log_limit))
        except OSError:
            return ""
        return redact(data.decode(errors="replace")[-self.log_limit:].strip())

    def _fetch(self, path: str, limit: int, within_s: float) -> bytes | None:
        """GET `path` of the server: its answer's body (`get_within`); None when it is not a 200."""
        got = get_within(self.url.removesuffix("/v1") + path, limit, within_s)
        return got[1] if got is not None and got[0] == 200 else None

    def stats(self, within_s: float = 10.0) -> dict | None:
        """The server's own accounting (calls, fallbacks, shapes); None when it keeps none."""
        raw = self._fetch("/kevo/stats", 1 << 22, within_s)
        try:
            data = replies.loads(raw) if raw is not None else None     # the candidate's process wrote it: strict JSON only
        except replies.MalformedReply:
            return None
        return data if isinstance(data, dict) else None

    def compiled(self, limit: int, within_s: float = 30.0) -> bytes:
        """The server's compiled kernels, packed by its own process (GET /kevo/compiled; harness/compiled.py): opaque
        bytes, at most `limit` of them (b"": none, more, later, or no answer)."""
        return self._fetch("/kevo/compiled", limit, within_s) or b""

    def _inner_pid(self) -> int | None:
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def stop(self) -> None:
        """Stop the server's process group (an external server first gets SIGTERM and 30 s to shut down
        gracefully) and wait until it is gone, its GPU memory with it: every thread of the sandboxed server
        (PID 1 of its namespace, whose exit waits for the namespace's other processes) has exited. Its first
        thread is a zombie before that: on the H200 the others were still in the driver, giving the GPU's
        memory back (docs/BENCHMARKS.md, 2026-12-04, twenty-seventh session)."""
        inner = _watch(self._inner_pid())
        if self.external and self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)           # whatever is left of the group
        except ProcessLookupError:
            pass
        self.proc.wait()
        if inner is not None:
            try:
                if not select.select([inner], [], [], GONE_TIMEOUT_S)[0]:
                    logger.warning("a stopped server's process still had threads %.0f s after its SIGKILL (its GPU "
                                "memory may not be free yet)", GONE_TIMEOUT_S)
            finally:
                os.close(inner)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.log >= 0:
            os.close(self.log)
            self.log = -1

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _scratch() -> Path:
    """A fresh folder of the trusted side's own: written before the server starts, never read back."""
    return Path(tempfile.mkdtemp(prefix="kevo-served-"))


def _log() -> int:
    return os.memfd_create("kevo-server-log", os.MFD_CLOEXEC)


def wait_ready(h: ServerHandle, timeout_s: float) -> ServerHandle:
    """Wait until the server answers; its start-to-ready time is counted from its process's start."""
    started = h.started
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if not h.alive():
            tail = h.log_tail()
            h.stop()
            raise ServerFailure(with_output(f"the server {h.how_it_ended()} before it was ready", tail))
        got = get_within(h.url + "/models", 1 << 20, 2.0)
        if got is not None and got[0] == 200:
            h.ready_s = time.monotonic() - started
            return h
        time.sleep(0.1)
    tail = h.log_tail()
    h.stop()
    raise ServerFailure(with_output(f"the server was not ready within {timeout_s:.0f} s", tail))


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def server_cache(cfg: Config, device: str, reference: bool) -> tuple[str, str, int]:
    """An embedded server's paged KV cache: the config key that sizes it, its dtype, its tokens. The replay's
    reference server computes in `stages.replay.reference_dtype` with `stages.replay.reference_kv_cache_tokens` (or
    the preset's); every other server in the served dtype with the preset's."""
    served = getattr(cfg.served, device)
    tokens = cfg.served.presets[served.preset].kv_cache_tokens
    if reference and cfg.stages.replay.reference_kv_cache_tokens:
        return "stages.replay.reference_kv_cache_tokens", cfg.stages.replay.reference_dtype, \
            cfg.stages.replay.reference_kv_cache_tokens
    key = f"served.presets.{served.preset}.kv_cache_tokens"
    return key, cfg.stages.replay.reference_dtype if reference else getattr(cfg.targets.attention, device).dtype, tokens


def cache_bytes(cfg: Config, device: str, reference: bool) -> int:
    """The bytes of that cache (K and V, every layer, whole blocks): what the server allocates before anything else
    it holds."""
    _, dtype, tokens = server_cache(cfg, device, reference)
    preset = cfg.served.presets[getattr(cfg.served, device).preset]
    block = getattr(cfg.targets.attention, device).block_size
    per_token = 2 * preset.layers * preset.kv_heads * preset.head_dim * DTYPE_BYTES[dtype]
    return max(1, tokens // block) * block * per_token


def embedded_spec(cfg: Config, device: str, candidate: Path | None, workdir: Path, warm: Sequence[int] = (),
                  weight_seed: int | None = None, reference: bool = False, other_heads: dict[str, Path] | None = None,
                  carried: Sequence[Path] = ()) -> dict:
    """What the embedded server is told: the preset, the attention layout, the candidate's file, the files of
    the heads served beside it (per op it does not define), and the prompt lengths it will serve. Its
    warm-up meets their shapes before anything is timed, for kernels only: the baselines (no candidate,
    no head beside) are torch's and compile nothing, so a server without one gets the fixed part of the
    warm-up alone. `weight_seed` replaces the preset's `seed` of the
    random weights (a preset with `weights:` reads its files whatever the seed). `reference`: the replay's
    reference server, torch's baselines in `stages.replay.reference_dtype` with a cache of
    `stages.replay.reference_kv_cache_tokens` (it runs untimed; a float reference needs the memory). `carried`: the
    files of packed caches its sources compiled before (harness/compiled.py), unpacked in its sandbox."""
    served = getattr(cfg.served, device)
    section = getattr(cfg.targets.attention, device)
    preset = cfg.served.presets[served.preset].model_dump()
    if weight_seed is not None:
        preset["seed"] = weight_seed
    dtype = section.dtype
    other_heads = other_heads or {}
    if reference:
        assert candidate is None and not other_heads, "the reference server runs torch's baselines"
        key, dtype, preset["kv_cache_tokens"] = server_cache(cfg, device, reference=True)
        need = served_limits(cfg, device).longest_context      # what an arm serves at once for one request
        if preset["kv_cache_tokens"] < need:
            raise HarnessError(f"{key}: {preset['kv_cache_tokens']} tokens cannot "
                               f"hold the served trace's longest request ({need} tokens, prompt and output)")
    weights = () if preset["weights"] is None else (str(PROJECT_ROOT / preset["weights"]),)   # absolute stays absolute
    return {"preset": preset, "block_size": section.block_size,
            "dtype": dtype, "device": device, "candidate": str(candidate) if candidate else None,
            "other_heads": {op: str(path) for op, path in other_heads.items()},
            "workdir": str(workdir), "sandbox": sandbox_spec(cfg.worker, workdir, device, workdir, weights),
            "carried": [str(p) for p in carried], "carry_bytes": cfg.worker.carry_bytes,
            "model_name": f"kevo-{served.preset}",
            "root": str(PROJECT_ROOT), "warm_prompts": list(warm) if candidate or other_heads else [], "warm_limit": served.warm_requests,
            "warm_passes": served.warm_passes, "warm_sweep_threads": served.warm_sweep_threads,
            "cuda_graphs": dataclasses.asdict(plan_for(cfg, device, _graph_bound(cfg, device, reference))),
            "baselines": cfg.targets.attention.baselines(), "stall_ms": cfg.served.stall_ms,
            "audit_share": cfg.served.audit_share, "spot_share": cfg.served.spot_share,
            "spot_tolerance": [cfg.stages.parity.tolerance_factor, cfg.stages.parity.floors[dtype].max_abs,
                               cfg.stages.parity.floors[dtype].rel_l2],
            "gpu_memory_fraction": cfg.served.gpu_memory_fraction,
            "random_init": cfg.served.random_init.model_dump(), "logprobs": cfg.served.logprobs}


def _graph_bound(cfg: Config, device: str, reference: bool) -> int:
    """A GPU server's bound on its CUDA graph keys (harness/gpu_memory.py), 0 elsewhere. torch is imported here
    only: this module is read by tools that never touch a GPU."""
    if device != "cuda":
        return 0
    from harness.gpu_memory import server_graph_bound
    return server_graph_bound(cfg, device, reference)


def start_embedded(cfg: Config, device: str, source: str | None, warm: Sequence[int] = (),
                   weight_seed: int | None = None, wait: bool = True, reference: bool = False,
                   other_heads: dict[str, str] | None = None, carried: Sequence[bytes] = ()) -> ServerHandle:
    workdir = _scratch()
    candidate = None
    if source is not None:
        candidate = workdir / "candidate.py"
        candidate.write_text(source)
    files = {}
    for op, text in (other_heads or {}).items():
        files[op] = workdir / f"other_{op}.py"
        files[op].write_text(text)
    blobs = [workdir / f"carried_{i}.bin" for i in range(len(carried))]
    for path, blob in zip(blobs, carried):
        path.write_bytes(blob)
    spec = embedded_spec(cfg, device, candidate, workdir, warm, weight_seed, reference, files, blobs)
    (workdir / "spec.json").write_text(json.dumps(spec))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    pythonpath = os.pathsep.join([str(PROJECT_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    extra = {"PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(workdir)}
    if device == "cpu":
        extra["TRITON_INTERPRET"] = "1"
    log = _log()
    proc = spawn_detached([sys.executable, "-m", "harness.served.server", str(sock.fileno()), str(workdir / "spec.json")],
                          pass_fds=[sock.fileno()], env=clean_env(cfg.worker.env_passthrough, extra), cwd=workdir,
                          stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    sock.close()
    h = ServerHandle(proc, f"http://127.0.0.1:{port}/v1", spec["model_name"], workdir, False, cfg.worker.log_tail_chars, log)
    return wait_ready(h, cfg.served.start_timeout_s) if wait else h


def start_external(cfg: Config, source: str | None, wait: bool = True) -> ServerHandle:
    ext = cfg.served.external
    workdir = _scratch()
    candidate = ""
    if source is not None:
        (workdir / "candidate.py").write_text(source)
        candidate = str(workdir / "candidate.py")
    with socket.socket() as s:                       # a free port; the server binds it itself
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [a.replace("{port}", str(port)) for a in ext.command]
    env = clean_env(cfg.worker.env_passthrough + ext.env_passthrough,
                    {"KEVO_CANDIDATE": candidate, "KEVO_PORT": str(port), "HOME": os.environ.get("HOME", str(workdir))})
    program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if not program or not os.access(workdir / program, os.X_OK):   # it starts through harness/detach.py
        shutil.rmtree(workdir, ignore_errors=True)
        raise ServerFailure(f"cannot start the external server {shlex.join(argv)}: no executable {argv[0]}"
                            + ("" if "/" in argv[0] else " on its PATH"))
    log = _log()
    try:
        proc = spawn_detached(foreign(argv), env=env, cwd=workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    except OSError as e:
        shutil.rmtree(workdir, ignore_errors=True)
        os.close(log)
        raise ServerFailure(f"cannot start the external server {shlex.join(argv)}: {e}") from None
    h = ServerHandle(proc, f"http://127.0.0.1:{port}/v1", ext.model, workdir, True, cfg.worker.log_tail_chars, log)
    return wait_ready(h, ext.start_timeout_s) if wait else h


def start_server(cfg: Config, device: str, source: str | None, warm: Sequence[int] = (),
                 weight_seed: int | None = None, wait: bool = True, reference: bool = False,
                 other_heads: dict[str, str] | None = None, carried: Sequence[bytes] = ()) -> ServerHandle:
    """`warm`: the prompt lengths about to be served, for the embedded server's warm-up (a server with a
    kernel only: `embedded_spec`). `weight_seed`: the embedded server's random weights, in place of the
    preset's seed. `other_heads`: per op, the source of the head that serves it where `source` does not define
    it (the embedded server only). An external server warms itself up as its own command does, serves its own
    weights, and is handed the candidate's file alone: none of the three applies to it, nor `carried` (the packed caches
    of kernels its sources compiled before, harness/compiled.py). `wait=False` returns at once: `wait_ready` (with `ready_timeout`) then
    waits, from the thread that started it (its process dies with that thread: PR_SET_PDEATHSIG)."""
    if cfg.served.external:
        return start_external(cfg, source, wait)
    return start_embedded(cfg, device, source, warm, weight_seed, wait, reference, other_heads, carried)


def ready_timeout(cfg: Config) -> float:
    return cfg.served.external.start_timeout_s if cfg.served.external else cfg.served.start_timeout_s
