"""Putting a process that will run candidate code into kevo's sandbox.

Used by the evaluator's workers (harness/zygote.py) and by the served-model server
(harness/served/server.py), in two steps. `isolate_namespaces`, in an outer process, enters new
mount, PID, network (no interfaces), IPC and UTS namespaces (and a user namespace when not root);
that process then forks the one that is PID 1 of the new PID namespace and `mirror_child`s it.
Inside, `settle_inside` builds a fresh root and locks the process down, in this order:
- a root of its own (tmpfs + pivot_root, as bubblewrap builds one): read-only binds of only what
  the process needs — the system's programs and libraries (/usr, /lib*, /bin, /sbin, a few files of
  /etc), the interpreter (sys.prefix, sys.base_prefix, the sys.path folders, the torch and triton
  packages), the folders named by CUDA_HOME, LD_LIBRARY_PATH and TRITON_PTXAS_PATH, the project's
  `harness/` package (nothing else of the checkout), /sys — then its own folder `/kevo` (a tmpfs of
  `folder_bytes`, also its /tmp), a /dev holding null, zero, full, random, urandom, its own GPU's
  device nodes and a private /dev/shm (a tmpfs of `shm_bytes`), and a /proc of its PID namespace;
  no home folder, no other worker's folder, no other GPU;
- its privileges (harness/sandbox.py): no capabilities (root becomes nobody), rlimits,
  no_new_privs, Landlock (writes only in its folder, /dev, /proc/self), and the seccomp filter last.
With `required`, any step the kernel refuses raises `SandboxError` naming it; otherwise it is
skipped and named in the notes that come back with the worker's first message (the verdict's
sandbox note). Not covered: memory and GPU memory (no cgroup), and the time a process may run
(the stages' deadlines, and RLIMIT_CPU).
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import pwd
import signal
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from harness import sandbox
from harness.config import PROJECT_ROOT, WorkerConfig

FOLDER = "/kevo"                                   # the candidate's own folder, inside its root
_NEWNS, _NEWUTS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
_RDONLY, _NOSUID, _NODEV, _NOEXEC, _REMOUNT, _BIND, _REC, _PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
_NOATIME, _NODIRATIME, _RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH = 2
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
           "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/localtime",
           "/etc/alternatives", "/etc/os-release", "/sys")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_GPU_SHARED = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def sandbox_spec(cfg: WorkerConfig, folder: Path, device: str, scratch: Path, read_only: tuple[str, ...] = ()) -> dict:
    """What `settle_inside` is told (JSON: it crosses the zygote's control socket). `folder`: the
    process's folder on the host, used only where no mount namespace can be had; `scratch`: the
    trusted side's own folder, never exposed; `read_only`: more paths to expose (served weights)."""
    limits = {"FSIZE": cfg.file_size_bytes, "NOFILE": cfg.open_files, "NPROC": cfg.processes,
              "CPU": cfg.cpu_seconds, "CORE": 0}
    if device == "cpu":
        limits["AS"] = cfg.cpu_address_space_bytes
    return {"folder": str(folder), "device": device, "required": cfg.sandbox == "required", "scratch": str(scratch),
            "folder_bytes": cfg.folder_bytes, "shm_bytes": cfg.shm_bytes, "limits": limits, "read_only": list(read_only)}


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc().mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                     data and data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src or ''} on {dst}: {os.strerror(err)}")


def _pivot(new: str, old: str) -> None:
    if _libc().syscall(155 if os.uname().machine == "x86_64" else 41, new.encode(), old.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")


def isolate_namespaces() -> None:
    """New mount, PID, network, IPC and UTS namespaces (and a user namespace, mapping only this
    user, when not root); the next fork is PID 1 of the new PID namespace."""
    uid, gid = os.geteuid(), os.getegid()
    flags = _NEWNS | _NEWPID | _NEWNET | _NEWIPC | _NEWUTS | (_NEWUSER if uid != 0 else 0)
    if _libc().unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")
    if uid != 0:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def exit_like(status: int) -> NoReturn:
    """End this process the way a child with wait status `status` ended (same code or signal)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def mirror_child(child: int) -> NoReturn:
    """Wait for `child` and exit as it did, so whoever waits for this process learns how it ended."""
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    exit_like(status)


# -- what the fresh root shows -----------------------------------------------------------------
def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def exposed_paths(spec: dict) -> list[str]:
    """The host paths bound read-only into the sandbox, outermost first, none inside another.
    Never the trusted side's scratch, a home folder, the project checkout (only its harness/), or a
    folder that holds any of them."""
    env = os.environ
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    wanted = list(_SYSTEM) + prefixes
    wanted += [p for p in sys.path if os.path.isabs(p)]
    for name in ("torch", "triton"):                 # found, not imported: an import may start threads
        spec_ = importlib.util.find_spec(name)
        if spec_ is not None and spec_.origin:
            wanted.append(os.path.dirname(os.path.dirname(spec_.origin)))
    wanted += [env[k] for k in ("CUDA_HOME",) if env.get(k)]
    wanted += [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if os.path.isabs(p)]
    if env.get("TRITON_PTXAS_PATH"):
        wanted.append(os.path.dirname(env["TRITON_PTXAS_PATH"]))
    wanted += list(spec.get("read_only", ()))
    project = str(PROJECT_ROOT)
    hidden = [project, spec["scratch"], "/root", "/home", "/tmp", "/dev", "/proc", "/run", "/var",
              pwd.getpwuid(os.getuid()).pw_dir]
    chosen: list[str] = []
    for p in sorted({os.path.normpath(q) for w in wanted for q in (w, os.path.realpath(w))}, key=len):
        if not os.path.lexists(p) or p == "/" or any(_within(p, c) for c in chosen):
            continue
        if any(_within(h, p) for h in hidden):     # it holds something hidden (or is it)
            continue
        if _within(p, spec["scratch"]):
            continue
        # Inside the checkout only an interpreter's own folders (the README's .venv lives there) and
        # package folders on sys.path, never the checkout itself or anything else in it (runs/, .git, config).
        if _within(p, project) and not (any(_within(p, x) and not _within(project, x) for x in map(os.path.normpath, prefixes))
                                        or os.path.basename(p) in ("site-packages", "dist-packages")):
            continue
        chosen.append(p)
    return chosen + [os.path.join(project, "harness")]


_mountinfo = -1                                    # /proc/self/mountinfo, opened before the host's /proc moves


def _mount_points_under(path: str) -> list[str]:
    points, chunks = [], []
    os.lseek(_mountinfo, 0, os.SEEK_SET)
    while chunk := os.read(_mountinfo, 1 << 16):
        chunks.append(chunk)
    for line in b"".join(chunks).decode().splitlines():
        mp = line.split()[4]
        for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            mp = mp.replace(code, char)             # no codec lookups here: the host's files are out of reach
        if _within(mp, path):
            points.append(mp)
    return points


def _kept_flags(path: str) -> int:
    """The flags a read-only remount must keep (a user namespace may not clear them)."""
    f = os.statvfs(path).f_flag
    pairs = ((os.ST_NOSUID, _NOSUID), (os.ST_NODEV, _NODEV), (os.ST_NOEXEC, _NOEXEC), (os.ST_NOATIME, _NOATIME),
             (os.ST_NODIRATIME, _NODIRATIME), (os.ST_RELATIME, _RELATIME))
    return sum(ms for st, ms in pairs if f & st)


def _bind(src: str, dst: str, read_only: bool = True) -> None:
    if os.path.islink(src):              # /lib -> usr/lib, /etc/localtime: the link (its target is exposed or not)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.symlink(os.readlink(src), dst)
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, _BIND | _REC)
    if read_only:
        for mp in _mount_points_under(dst):
            _mount(None, mp, None, _REMOUNT | _BIND | _RDONLY | _kept_flags(mp))


def gpu_nodes(device: str, driver: Path = Path("/proc/driver/nvidia/gpus")) -> tuple[list[str], str]:
    """The /dev names of this process's GPU (the first one CUDA_VISIBLE_DEVICES makes visible,
    counted in PCI order, as CUDA counts identical GPUs) plus the driver's shared nodes, and that
    GPU's UUID ("" when unknown). Raises SandboxError when the GPU cannot be told apart."""
    if not device.startswith("cuda"):
        return [], ""
    gpus = []                                                  # (bus, minor, uuid)
    for d in sorted(driver.iterdir()) if driver.is_dir() else []:
        info = dict(line.split(":", 1) for line in (d / "information").read_text().splitlines() if ":" in line)
        gpus.append((d.name, int(info["Device Minor"].strip()), info.get("GPU UUID", "").strip()))
    if not gpus:
        minors = sorted(int(n[6:]) for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit())
        if len(minors) != 1:
            raise sandbox.SandboxError(f"GPU nodes: cannot tell which of {len(minors)} /dev/nvidiaN is this process's")
        gpus = [("", minors[0], "")]
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    if first.isdigit() and int(first) < len(gpus):
        _, minor, uuid = gpus[int(first)]
    else:
        match = [g for g in gpus if g[2] and g[2].startswith(first)]
        if len(match) != 1:
            raise sandbox.SandboxError(f"GPU nodes: CUDA_VISIBLE_DEVICES={first!r} names none of {len(gpus)} GPUs")
        _, minor, uuid = match[0]
    return [n for n in _GPU_SHARED if os.path.exists(f"/dev/{n}")] + [f"nvidia{minor}"], uuid


def _fresh_root(spec: dict) -> str:
    """Build the root described in the module docstring and move into it. Returns the folder."""
    nodes, uuid = gpu_nodes(spec["device"])
    paths = exposed_paths(spec)
    owner = os.getuid() == 0 and sandbox._in_initial_user_namespace()
    ids = f",uid={sandbox.NOBODY},gid={sandbox.NOBODY}" if owner else ""
    global _mountinfo
    _mountinfo = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
    _mount(None, "/", None, _REC | _PRIVATE)
    _mount("tmpfs", "/tmp", "tmpfs", _NOSUID | _NODEV, "size=1m,mode=0700")   # hidden in this namespace only
    os.chdir("/tmp")
    os.mkdir("oldroot")
    _pivot(".", "oldroot")                         # the host's tree is now /oldroot, whatever covered /tmp
    os.chdir("/")
    new = "/newroot"
    os.mkdir(new)
    _mount("tmpfs", new, "tmpfs", _NOSUID | _NODEV, "size=1m,mode=0755")
    for p in paths:
        _bind("/oldroot" + p, new + p)
    dev = new + "/dev"
    os.mkdir(dev)
    _mount("tmpfs", dev, "tmpfs", _NOSUID | _NODEV | _NOEXEC, "size=64k,mode=0755")
    for n in _DEVICES + tuple(nodes):
        _bind(f"/oldroot/dev/{n}", f"{dev}/{n}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(dev + "/shm")
    _mount("tmpfs", dev + "/shm", "tmpfs", _NOSUID | _NODEV | _NOEXEC, f"size={spec['shm_bytes']},mode=1777")
    _mount(None, dev, None, _REMOUNT | _RDONLY | _NOSUID | _NODEV | _NOEXEC, "size=64k,mode=0755")
    os.mkdir(new + "/proc")
    _mount("proc", new + "/proc", "proc", _NOSUID | _NODEV | _NOEXEC)
    os.mkdir(new + FOLDER)
    _mount("tmpfs", new + FOLDER, "tmpfs", _NOSUID | _NODEV, f"size={spec['folder_bytes']},mode=0700{ids}")
    for sub in ("tmp", "triton", "cache"):
        os.mkdir(f"{new}{FOLDER}/{sub}")
        if owner:
            os.chown(f"{new}{FOLDER}/{sub}", sandbox.NOBODY, sandbox.NOBODY)
    if not os.path.lexists(new + "/tmp"):           # a read-only path under /tmp (a PYTHONPATH there) keeps
        os.mkdir(new + "/tmp")                       # /tmp read-only; TMPDIR is /kevo/tmp either way
        _mount(f"{new}{FOLDER}/tmp", new + "/tmp", None, _BIND)
    _mount(None, new, None, _REMOUNT | _RDONLY | _NOSUID | _NODEV, "size=1m,mode=0755")
    os.chdir(new)
    _pivot(".", ".")                               # the old tree is stacked on "/" ...
    if _libc().umount2(b".", _MNT_DETACH) != 0:     # ... and detached: nothing of it is left to reach
        raise OSError(ctypes.get_errno(), "detaching the host's tree")
    os.chdir("/")
    os.close(_mountinfo)
    if uuid:
        os.environ["CUDA_VISIBLE_DEVICES"] = uuid      # CUDA in here looks for no other GPU
    return FOLDER


# -- the whole sequence ------------------------------------------------------------------------
def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle_inside(spec: dict, namespaces: bool) -> tuple[Path, list[str]]:
    """In the process that will run candidate code (PID 1 of its namespaces when `namespaces`).
    Returns its folder and the notes: what was applied, and (best effort only) what was skipped."""
    required, notes = spec["required"], []
    try:                     # the first the kernel's OOM killer takes: a candidate that eats the host's RAM
        with open("/proc/self/oom_score_adj", "w") as f:    # dies before the evaluator or another slot
            f.write("1000")
    except OSError as e:
        notes.append(f"oom_score_adj not raised ({e.strerror})")
    threads = _threads()
    if threads != 1:         # capabilities, no_new_privs and Landlock are per thread: none may run unlocked
        raise sandbox.SandboxError(f"the process to confine has {threads} threads, not 1")

    def step(name: str, fn):
        try:
            return fn()
        except (OSError, sandbox.SandboxError, ValueError) as e:
            if required:
                raise sandbox.SandboxError(f"{name}: {e}") from None
            notes.append(f"no {name} ({e})")
            return None

    folder = step("private root", lambda: _fresh_root(spec)) if namespaces else None
    if folder is None:
        folder = spec["folder"]
        if os.getuid() == 0:
            os.chown(folder, sandbox.NOBODY, sandbox.NOBODY)
        for sub in ("tmp", "triton", "cache"):
            os.makedirs(os.path.join(folder, sub), exist_ok=True)
            if os.getuid() == 0:
                os.chown(os.path.join(folder, sub), sandbox.NOBODY, sandbox.NOBODY)
    else:
        notes.append(f"private root, network, IPC and PID namespaces; /kevo {spec['folder_bytes'] >> 20} MiB, "
                     f"/dev/shm {spec['shm_bytes'] >> 20} MiB")
    os.environ.update(HOME=folder, TMPDIR=f"{folder}/tmp", TRITON_CACHE_DIR=f"{folder}/triton",
                      XDG_CACHE_HOME=f"{folder}/cache")
    tempfile.tempdir = f"{folder}/tmp"              # a parent may have cached its own before the fork
    os.chdir(folder)
    who = step("dropping privileges", sandbox.drop_privileges)
    sandbox.die_with_parent()                      # a change of user clears it
    step("rlimits", lambda: sandbox.limit_resources(spec["limits"]))
    step("no_new_privs", sandbox.no_new_privs)
    writable = [folder, "/dev", "/proc/self"]       # /dev: the GPU's nodes open for writing; /proc/self: CUDA
    abi = step("Landlock", lambda: sandbox.confine(writable) if sandbox.landlock_abi() else None)
    if _threads() != 1:
        raise sandbox.SandboxError("a thread was started while the sandbox was being set up")
    rules = step("seccomp", sandbox.seccomp_filter)
    notes += [n for n in (who, abi and f"Landlock ABI {abi}", rules and f"seccomp ({rules} rules)") if n]
    if not abi and not any(n.startswith("no Landlock") for n in notes):
        notes.append("no Landlock (not in this kernel; the private root keeps writes in)")
    return Path(folder), notes
