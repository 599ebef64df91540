"""The process-level locks of kevo's sandbox: seccomp, capabilities, rlimits, Landlock, the environment.

Each function applies one of the kernel's own mechanisms to the calling process, for good, and
raises `SandboxError` (one line, naming what could not be applied) when the kernel refuses it:
- `seccomp_filter` loads a libseccomp filter (libseccomp.so.2, the library systemd, Docker and
  bubblewrap's users load their filters with) that denies, with EPERM, setting any clock, making
  device nodes, mounting, changing root, tracing or reading other processes, loading kernels or
  modules, keyrings, BPF, new namespaces, leaving the process group (setsid, setpgid), swap,
  reboot, userfaultfd, io_uring, file handles, personality changes and every socket family but
  AF_UNIX (clone3 answers ENOSYS, so threads and children are made with clone, whose namespace
  flags are checked). perf_event_open stays allowed: torch.profiler's CUDA activity runs inside
  the worker, and as an unprivileged user under the kernel's perf_event_paranoid it measures only
  the caller's own process;
- `drop_privileges` drops every capability (the bounding set, the ambient set, then capset to
  nothing) after switching root (uid 0 outside any user namespace) to the unprivileged `nobody`;
- `limit_resources` sets rlimits (file size, open files, processes, CPU time, core files, and the
  address space where asked);
- `confine` (Landlock) keeps writes to the listed folders and scopes signals, a second layer
  beneath the private mount namespace of harness/isolation.py and the only one without it.
Not covered here: memory cgroups (no RLIMIT caps resident memory or GPU memory), and the mount,
PID, network, IPC and UTS namespaces, which harness/isolation.py sets up.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import resource
import signal
import struct

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446   # the same numbers on x86_64 and aarch64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP = 1, 4, 24
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4

# LANDLOCK_ACCESS_FS_* rights that create, change or remove files. Reads and execution stay allowed.
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in range(6, 13))                  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2

# What a secret's name looks like, the one list kevo has: such variables never reach a candidate (clean_env,
# and config's env_passthrough refuses them) and their values are blanked in what kevo writes (redact).
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)
NOBODY = 65534                 # the uid and gid a sandbox started by root runs as

# Denied outright (EPERM). Names the running architecture lacks (mknod on aarch64) are skipped.
DENIED_SYSCALLS = (
    "clock_settime", "clock_adjtime", "adjtimex", "settimeofday", "stime",
    "mknod", "mknodat", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
    "fspick", "open_tree", "move_mount", "mount_setattr", "ptrace", "process_vm_readv",
    "process_vm_writev", "pidfd_getfd", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "create_module", "keyctl", "add_key", "request_key", "bpf", "unshare", "setns",
    "swapon", "swapoff", "reboot", "userfaultfd", "open_by_handle_at", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "quotactl", "quotactl_fd", "acct", "syslog", "iopl", "ioperm",
    "sethostname", "setdomainname", "vhangup", "uselib", "lookup_dcookie", "nfsservctl",
    "setsid", "setpgid")               # leaving the worker's process group would leave a process the hold cannot stop
_CLONE_NEW = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
              0x40000000)                              # TIME, NS, CGROUP, UTS, IPC, USER, PID, NET
_AF_UNIX = 1
_ACT_ALLOW, _ACT_ERRNO = 0x7FFF0000, 0x00050000
_CMP_NE, _CMP_MASKED_EQ = 1, 7
_FLTATR_CTL_TSYNC = 4


class SandboxError(Exception):
    pass


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> SandboxError:
    return SandboxError(f"{what}: {os.strerror(ctypes.get_errno())}")


# -- seccomp -----------------------------------------------------------------------------------
class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def _libseccomp():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        raise SandboxError("seccomp: libseccomp.so.2 is not installed (Debian/Ubuntu package libseccomp2)") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    return lib


def seccomp_filter() -> int:
    """Load the filter described in the module docstring into this process (all its threads).
    Returns how many rules it holds."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SandboxError("seccomp: seccomp_init failed")
    rules = 0
    if lib.seccomp_attr_set(ctx, _FLTATR_CTL_TSYNC, 1) < 0:      # every thread of the process, not only this one
        lib.seccomp_release(ctx)
        raise SandboxError("seccomp: cannot ask for the filter on every thread (TSYNC)")

    def add(name: str, err: int, *cmps: tuple[int, int, int, int]) -> None:
        nonlocal rules
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:                                    # not a syscall of this architecture
            return
        arr = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
        rc = lib.seccomp_rule_add_array(ctx, _ACT_ERRNO | err, nr, len(cmps), arr)
        if rc < 0:
            raise SandboxError(f"seccomp: cannot add the rule for {name}: {os.strerror(-rc)}")
        rules += 1

    try:
        for name in DENIED_SYSCALLS:
            add(name, errno.EPERM)
        add("socket", errno.EPERM, (0, _CMP_NE, _AF_UNIX, 0))
        # personality(0) (Linux) and personality(0xffffffff) (a query) only. A rule may test an argument
        # once, so: deny "bit b set, bit 31 clear" and "bit 31 set, bit b clear" for each b < 31, which
        # leaves exactly those two values of the 32 bits the kernel reads.
        for b in range(31):
            add("personality", errno.EPERM, (0, _CMP_MASKED_EQ, (1 << b) | (1 << 31), 1 << b))
            add("personality", errno.EPERM, (0, _CMP_MASKED_EQ, (1 << b) | (1 << 31), 1 << 31))
        for flag in _CLONE_NEW:
            add("clone", errno.EPERM, (0, _CMP_MASKED_EQ, flag, flag))
        add("clone3", errno.ENOSYS)                   # its flags are in memory a filter cannot read
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise SandboxError(f"seccomp: cannot load the filter: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)
    return rules


# -- capabilities, users, rlimits ---------------------------------------------------------------
def drop_privileges() -> str:
    """No capabilities left in any set; root (outside a user namespace) becomes nobody. Says who it runs as."""
    libc = _libc()
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            raise _fail(f"capabilities: cannot drop {cap} from the bounding set")
    if os.getuid() == 0 and _in_initial_user_namespace():
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)           # clears the permitted and effective sets
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)       # keep /proc/self readable to itself (CUDA reads it)
    if libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
        raise _fail("capabilities: cannot clear the ambient set")
    header = ctypes.create_string_buffer(struct.pack("=Ii", 0x20080522, 0), 8)   # _LINUX_CAPABILITY_VERSION_3
    data = ctypes.create_string_buffer(24)                                       # two zeroed cap_user_data_t
    if libc.capset(header, data) != 0:
        raise _fail("capabilities: capset")
    status = open("/proc/self/status").read()
    if any(re.search(rf"^{k}:\s*0*[1-9a-f]", status, re.M) for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb")):
        raise SandboxError("capabilities: some remain after dropping them all")
    return f"uid {os.getuid()}, no capabilities"


def _in_initial_user_namespace() -> bool:
    try:
        return open("/proc/self/uid_map").read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True


def no_new_privs() -> None:
    if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise _fail("prctl(NO_NEW_PRIVS)")


def limit_resources(limits: dict[str, int]) -> None:
    """`limits`: RLIMIT name without the prefix (FSIZE, NOFILE, NPROC, CPU, CORE, AS) -> value, set as
    both the soft and the hard limit (no process in the sandbox can raise them again)."""
    for name, value in limits.items():
        try:
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
        except (ValueError, OSError) as e:
            raise SandboxError(f"rlimit {name}={value}: {e}") from None


# -- Landlock ----------------------------------------------------------------------------------
def landlock_abi() -> int:
    """The kernel's Landlock ABI version, or 0 when Landlock is unavailable."""
    try:
        r = _libc().syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(0, r)


def confine(writable: list[str]) -> int:
    """Restrict this process (and its future children) for good: files may be made or written only
    beneath `writable`; no TCP bind or connect (ABI >= 4); no signals or abstract Unix sockets
    outside the sandbox (ABI >= 6). Returns the ABI used."""
    abi = landlock_abi()
    if abi < 1:
        raise SandboxError("Landlock is not available in this kernel")
    libc = _libc()
    fs = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    if abi >= 2:
        fs |= _REFER
    if abi >= 3:
        fs |= _TRUNCATE
    net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    fd = libc.syscall(_SYS_CREATE, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if fd < 0:
        raise _fail("landlock_create_ruleset")
    try:
        for path in writable:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = ctypes.create_string_buffer(struct.pack("=Qi", fs, pfd), 12)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                                ctypes.c_uint32(0)) != 0:
                    raise _fail(f"landlock_add_rule({path})")
            finally:
                os.close(pfd)
        no_new_privs()
        if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(fd)
    return abi


# -- processes and environment -----------------------------------------------------------------
def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (PR_SET_PDEATHSIG), so a killed
    evaluator never leaves a zygote, worker or server holding GPU memory (seen on the H200: two
    orphaned servers held 123 GB). Call first thing in every process kevo starts or forks, and again
    after a change of user (which clears it); the parent must be a thread that lives as long as the
    child should."""
    parent = os.getppid()
    if _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise SandboxError("prctl(PDEATHSIG) failed")
    if os.getppid() != parent:                       # the parent died before the prctl took effect
        os._exit(1)


def clean_env(passthrough: list[str], extra: dict[str, str]) -> dict[str, str]:
    """An environment built from an allowlist: nothing secret-looking ever passes."""
    env = {k: os.environ[k] for k in passthrough if k in os.environ and not SECRET_NAME.search(k)}
    env.update(extra)
    return env


def redact(text: str) -> str:
    """Blank out the values of this process's secret-looking environment variables."""
    for name, value in os.environ.items():
        if len(value) >= 6 and SECRET_NAME.search(name) and value in text:
            text = text.replace(value, f"[{name} redacted]")
    return text
