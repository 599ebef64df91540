"""The verdict cache: a candidate judged before, with everything its verdict depends on unchanged, gets
that verdict again instead of the stages (`evaluate_cached`, used by every evaluation slot and a
run in the loop's own pool: `kevo-agent evaluate`, a run's heads and its candidates; config `executor.verdict_cache`).

A verdict's key is a digest of what it depends on (`VerdictCache.parts`, kept readable in the entry):
the candidate's source, the `until` stage and the `beat` its microbench must beat; the harness's
version (every file under harness/, and the files the config names: traces, recorded shapes, the
listing of a weights folder); the config sections the stages read (stages, targets.<target>.<device>,
served, worker); the device (a GPU's name, compute capability and memory, or the CPU's model and the
cores this process may use), the driver, torch, triton and Python. A verdict that reached the replay
depends on the head served beside it too, and on the other ops' heads both arms serve: its base key then
holds only that mark, and the verdict lives under the base key and those sources together (a verdict that stopped earlier is reused
whatever the head).

Only verdicts the device or the machine's load could have decided are left out: a worker that hung,
crashed, hit a CUDA error or broke the protocol, a sandbox that failed, a candidate server that failed
(`UNCACHEABLE`, stage failure kinds); an evaluation that raised HarnessError leaves no verdict. One JSON file per key under
`<agent.runs_dir>/.verdicts/`, written atomically (a temporary file renamed), read only by the trusted
side: workers and servers are sandboxed and see no runs/ (with `worker.sandbox: best_effort` a worker
may see the host's files, so the cache is off). An entry is validated as an `Entry` holding a `Verdict`
when read; a corrupt, foreign or inconsistent file is a miss, said so on stderr, never a crash. A
verdict given from the cache carries `cached_from` (its key, and the job, place and time it was first
reached). Not here: when to evaluate (agent/), the stages (harness/stages/).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import stat
import sys
import tempfile
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from harness.config import PROJECT_ROOT, Config
from harness.records import CachedFrom, FailureKind, Verdict

FORMAT = 1
MAX_ENTRY_BYTES = 8 << 20
# Stage failure kinds that mark a verdict the device or the host decided rather than the candidate alone.
UNCACHEABLE: tuple[FailureKind, ...] = ("timeout", "crashed", "cuda_error", "protocol", "server_failed")


class Entry(BaseModel):
    """One file of the cache. `by_head`: the verdict reached the replay and is stored under its head's key."""
    model_config = ConfigDict(extra="forbid")
    kevo_verdict_cache: Literal[1]
    key: str
    parts: dict[str, Any]
    by_head: bool = False
    verdict: Verdict | None = None
    job: str = ""
    where: str = ""
    reached: str = ""


def digest(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@lru_cache(maxsize=8)
def tree_digest(folder: Path) -> str:
    """Every file under `folder` (but __pycache__ and .pyc), by relative path and content."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                       and p.suffix != ".pyc"):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + digest(path.read_bytes()).encode() + b"\0")
    return h.hexdigest()


def named_files(cfg: Config) -> str:
    """The files the config names that the stages read, by content (traces, recorded shapes) or, for a
    weights folder, by each file's name, size and modification time (weights are large)."""
    out: dict[str, str] = {}
    names = [cfg.served.cuda.trace, cfg.served.cpu.trace] + ([cfg.served.recorded_shapes] if cfg.served.recorded_shapes else [])
    for name in names:
        path = PROJECT_ROOT / name
        out[name] = digest(path.read_bytes()) if path.is_file() else "missing"
    for preset in cfg.served.presets.values():
        if preset.weights:
            folder = PROJECT_ROOT / preset.weights
            files = sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []
            out[preset.weights] = digest(_canonical([[str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns]
                                                     for p in files]))
    return digest(_canonical(out))


def _nvidia_driver() -> str:
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        first = ""
    api = getattr(torch._C, "_cuda_getDriverVersion", None)
    return " ".join(first.split()) + (f"; CUDA driver API {api()}" if api else "")


@lru_cache(maxsize=2)
def machine(device_type: str) -> dict[str, str]:
    """What a verdict depends on about this machine: the device (for CUDA, the GPU this process sees first,
    which is its slot's), the driver and the software that compiles and runs kernels."""
    if device_type == "cuda":
        p = torch.cuda.get_device_properties(0)
        dev = f"{p.name}, compute capability {p.major}.{p.minor}, {p.total_memory} bytes"
        driver = _nvidia_driver()
    else:
        try:
            model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name")), platform.processor())
        except OSError:
            model = platform.processor()
        dev, driver = f"cpu: {model}, {len(os.sched_getaffinity(0))} cores", ""
    import triton
    return {"device": dev, "driver": driver, "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
            "triton": triton.__version__, "python": platform.python_version()}


def cacheable(verdict: Verdict) -> bool:
    """Whether the candidate alone decided this verdict: no stage lost its worker, broke the protocol or timed out."""
    return verdict.cached_from is None and not any(s.failure in UNCACHEABLE for s in verdict.stages)


def reached_replay(verdict: Verdict) -> bool:
    """Whether the replay stage was reached (run or skipped there): its verdict then depends on the head."""
    return any(s.name == "replay" for s in verdict.stages)


def _stderr(text: str) -> None:
    print(f"kevo: {text}", file=sys.stderr, flush=True)


class VerdictCache:
    def __init__(self, folder: Path, base: dict[str, Any], say: Callable[[str], None] = _stderr) -> None:
        self.folder, self.base, self.say = Path(folder), base, say

    @classmethod
    def for_run(cls, cfg: Config, target: str, device_type: str) -> "VerdictCache | None":
        """The cache for evaluations under `cfg` on this machine; None when config turns it off, or when workers
        may run without their sandbox (they might then reach the cache's folder)."""
        if not cfg.executor.verdict_cache or cfg.worker.sandbox != "required":
            return None
        runs = Path(cfg.agent.runs_dir)
        return cls((runs if runs.is_absolute() else PROJECT_ROOT / runs) / ".verdicts",
                   cls.base_parts(cfg, target, device_type))

    @staticmethod
    def base_parts(cfg: Config, target: str, device_type: str, harness: Path = PROJECT_ROOT / "harness") -> dict[str, Any]:
        sections = {"stages": cfg.stages, f"targets.{target}.{device_type}": getattr(getattr(cfg.targets, target), device_type),
                    "served": cfg.served, "worker": cfg.worker}
        return {"format": FORMAT, "target": target, "harness": tree_digest(harness), "named_files": named_files(cfg),
                "config": {name: digest(_canonical(s.model_dump(mode="json"))) for name, s in sections.items()},
                **machine(device_type)}

    def parts(self, source: str, until: str | None, beat: float, head: str | None = None, by_head: bool = False,
              other_heads: dict[str, str] | None = None) -> dict:
        out = {**self.base, "source": digest(source), "until": until, "beat": repr(max(1.0, float(beat)))}
        if by_head:
            out["head"] = digest(head) if head is not None else "torch"
            if other_heads:                    # the other ops' heads both arms served (none: the keys of before)
                out["other_heads"] = {op: digest(text) for op, text in sorted(other_heads.items())}
        return out

    @staticmethod
    def key(parts: dict) -> str:
        return digest(_canonical(parts))

    def lookup(self, source: str, until: str | None, beat: float, head: str | None,
               other_heads: dict[str, str] | None = None) -> Verdict | None:
        """The stored verdict for these inputs, marked with where it came from; None on a miss."""
        key = self.key(self.parts(source, until, beat))
        entry = self._read(key)
        if entry is not None and entry.by_head:
            key = self.key(self.parts(source, until, beat, head, by_head=True, other_heads=other_heads))
            entry = self._read(key)
            if entry is not None and (entry.by_head or entry.verdict is None or not reached_replay(entry.verdict)):
                return self._inconsistent(key, "an entry for a head that holds no verdict which reached the replay")
        elif entry is not None and (entry.verdict is None or reached_replay(entry.verdict)):
            return self._inconsistent(key, "a verdict that reached the replay stored without its head")
        if entry is None:
            return None
        if not cacheable(entry.verdict):
            return self._inconsistent(key, "a verdict that is never cached (its worker was lost or it timed out)")
        return entry.verdict.model_copy(update={"cached_from": CachedFrom(key=key, job=entry.job, where=entry.where,
                                                                           reached=entry.reached)})

    def store(self, source: str, until: str | None, beat: float, head: str | None, verdict: Verdict,
              job: str, where: str, other_heads: dict[str, str] | None = None) -> bool:
        """Keep a fresh verdict (not one that is never cached); False when it was not kept."""
        if not cacheable(verdict):
            return False
        base = self.parts(source, until, beat)
        reached = datetime.now(timezone.utc).isoformat(timespec="seconds")
        if reached_replay(verdict):
            full = self.parts(source, until, beat, head, by_head=True, other_heads=other_heads)
            return (self._write(Entry(kevo_verdict_cache=FORMAT, key=self.key(full), parts=full, verdict=verdict,
                                      job=job, where=where, reached=reached))
                    and self._write(Entry(kevo_verdict_cache=FORMAT, key=self.key(base), parts=base, by_head=True)))
        return self._write(Entry(kevo_verdict_cache=FORMAT, key=self.key(base), parts=base, verdict=verdict,
                                 job=job, where=where, reached=reached))

    # -- the files -----------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def _inconsistent(self, key: str, why: str) -> None:
        self.say(f"verdict cache: {self.path(key)}: {why}; judging afresh")
        return None

    def _read(self, key: str) -> Entry | None:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            return self._inconsistent(key, f"cannot be opened ({e.strerror})")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ENTRY_BYTES:
                return self._inconsistent(key, f"not a regular file of at most {MAX_ENTRY_BYTES} bytes")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_ENTRY_BYTES + 1)
            entry = Entry.model_validate(json.loads(raw, parse_constant=_no_constant))
        except (OSError, ValueError, ValidationError) as e:    # ValueError: not JSON, not UTF-8, NaN
            return self._inconsistent(key, f"not a verdict cache entry ({' '.join(str(e).split())[:200]})")
        finally:
            os.close(fd)
        if entry.key != key:
            return self._inconsistent(key, f"holds the entry of another key ({entry.key[:16]}...)")
        return entry

    def _write(self, entry: Entry) -> bool:
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(entry.model_dump_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(entry.key))
            return True
        except OSError as e:                # a cache that cannot be written costs a re-evaluation, not the verdict
            self.say(f"verdict cache: cannot write {self.path(entry.key)} ({e.strerror}); the verdict is not kept")
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a verdict holds")


def evaluate_cached(source: str, target: str, cfg: Config, pool, *, job: str = "", where: str = "",
                    until: str | None = None, on_stage=None, beat: float = 1.0, head: str | None = None,
                    other_heads: dict[str, str] | None = None, settled=None, fresh: bool = False) -> Verdict:
    """`harness.evaluate.evaluate`, through the verdict cache when config turns it on: a hit is the stored
    verdict with `cached_from` set (no stage runs, `on_stage` is not called); a fresh verdict is stored when
    the candidate alone decided it. `job` and `where` (a host/slot) are recorded with a stored verdict.
    `settled()`, when given, is called before any verdict is stored or returned (it raises to withhold it: a
    health check run beside the job that failed). `fresh`: the stages judge it whatever the cache holds (their verdict
    is stored)."""
    from harness.evaluate import evaluate
    from harness.stages import STAGE_NAMES
    from harness.targets import TARGETS
    valid = target in TARGETS and (until is None or until in STAGE_NAMES)     # else evaluate says what is wrong
    cache = VerdictCache.for_run(cfg, target, pool.device) if valid else None
    if cache is not None and not fresh and (hit := cache.lookup(source, until, beat, head, other_heads)) is not None:
        if settled is not None:
            settled()
        return hit
    verdict = evaluate(source, target, cfg, pool, until=until, on_stage=on_stage, beat=beat, head=head, other_heads=other_heads)
    if settled is not None:
        settled()
    if cache is not None:
        cache.store(source, until, beat, head, verdict, job, where or socket.gethostname(), other_heads)
    return verdict
