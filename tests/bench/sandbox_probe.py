"""Self-check (not a test): what a candidate in kevo's sandbox can and cannot do, here, on this device.

    python tests/bench/sandbox_probe.py [--device auto|cuda|cpu] [--config config.yaml]

Starts a worker pool as a run would (GPU when one is visible), loads a probe candidate straight into a
worker (past the compile stage's static check, to see the sandbox itself) and prints, one row each,
what the probe tried and what happened: reading /root and /home, writing outside its folder, mknod,
setting clocks, sockets, other device nodes, a child without CUDA_VISIBLE_DEVICES, its limits and
its CUDA. Then a correct kernel (knowledge/attention/decode_paged_splitkv.py) goes through compile,
dispatch and parity in the same pool, and the time a fresh sandboxed worker takes to start is shown.
Asserts nothing: read the "expected" column. Run on the H200 as root, from the project root.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.config import load_config  # noqa: E402
from harness.evaluate import evaluate, open_pool  # noqa: E402

PROBE = r'''
import ctypes, json, os, socket, stat, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
rows = []

def row(what, expected, fn):
    try:
        got = fn()
    except OSError as e:
        got = f"{type(e).__name__}: {e.strerror}"
    except Exception as e:
        got = f"{type(e).__name__}: {e}"[:200]
    rows.append([what, expected, str(got)[:200]])

def errno_of(rc):
    return "succeeded" if rc >= 0 else os.strerror(ctypes.get_errno())

row("uid, /proc/self/status caps", "65534 (root) or yours; all caps 0",
    lambda: (os.getuid(), [l.split()[1] for l in open("/proc/self/status") if l.startswith(("CapEff", "CapBnd", "CapAmb"))]))
row("no_new_privs, seccomp mode", "1, 2", lambda: [l.split()[1] for l in open("/proc/self/status")
                                                  if l.startswith(("Seccomp:", "NoNewPrivs"))])
row("/ holds", "bin dev etc kevo lib* proc root(empty) sbin sys tmp usr + venv/checkout dirs", lambda: sorted(os.listdir("/")))
row("list /root", "empty or only the interpreter's path", lambda: sorted(os.listdir("/root")))
row("list /home", "FileNotFoundError", lambda: os.listdir("/home"))
row("read /etc/shadow", "FileNotFoundError", lambda: open("/etc/shadow").read()[:10])
row("project checkout visible", "only harness/", lambda: sorted(os.listdir(CHECKOUT)))
for path in ("/usr/kevo-probe", "/etc/kevo-probe", "/kevo-probe", "/sys/kernel/kevo-probe", CHECKOUT + "/kevo-probe"):
    row(f"write {path}", "OSError (read-only/permission)", lambda p=path: open(p, "w").write("x"))
row("write /kevo/x (own folder)", "succeeded", lambda: open("/kevo/x", "w").write("x") and "succeeded")
row("mknod /kevo/disk (block 8:0)", "Operation not permitted",
    lambda: os.mknod("/kevo/disk", stat.S_IFBLK | 0o600, os.makedev(8, 0)) or "made")
ts = (ctypes.c_long * 2)()
libc.clock_gettime(0, ts)
row("clock_settime(REALTIME, now)", "Operation not permitted", lambda: errno_of(libc.clock_settime(0, ts)))
tx = (ctypes.c_long * 26)()
row("adjtimex (read)", "Operation not permitted", lambda: errno_of(libc.adjtimex(tx)))
row("socket AF_INET UDP", "Operation not permitted", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM) and "opened")
row("socket AF_INET TCP", "Operation not permitted", lambda: socket.socket() and "opened")
row("socket raw ICMP", "Operation not permitted", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, 1) and "opened")
row("socket AF_NETLINK", "Operation not permitted", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW) and "opened")
row("socket AF_UNIX", "opened", lambda: socket.socket(socket.AF_UNIX) and "opened")
row("/dev holds", "null zero full random urandom shm fd std*, nvidiactl, nvidia-uvm(-tools), ONE nvidiaN",
    lambda: sorted(os.listdir("/dev")))
def opens():
    out = {}
    for i in range(16):
        try:
            os.close(os.open(f"/dev/nvidia{i}", os.O_RDWR)); out[i] = "opened"
        except OSError as e:
            if e.errno != 2:
                out[i] = e.strerror
    return out or "none of /dev/nvidia0..15 exists"
row("open /dev/nvidia0..15", "only its own GPU opens", opens)
row("open /dev/vda, /dev/sda, /dev/nvme0n1", "FileNotFoundError", lambda: [n for n in ("vda", "sda", "nvme0n1")
                                                                        if os.path.exists("/dev/" + n)] or
                                                                       open("/dev/sda").read(1))
def shm():
    st = os.statvfs("/dev/shm")
    return f"{st.f_blocks * st.f_frsize >> 20} MiB"
row("/dev/shm size", "worker.shm_bytes", shm)
row("/kevo size", "worker.folder_bytes", lambda: f"{os.statvfs('/kevo').f_blocks * os.statvfs('/kevo').f_frsize >> 20} MiB")
import resource
row("rlimits FSIZE NOFILE NPROC CPU CORE AS", "from worker config; AS unlimited on CUDA",
    lambda: [resource.getrlimit(getattr(resource, "RLIMIT_" + n))[1] for n in ("FSIZE", "NOFILE", "NPROC", "CPU", "CORE", "AS")])
row("CUDA_VISIBLE_DEVICES inside", "its GPU's UUID (CUDA)", lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
import torch
row("torch.cuda.device_count()", "1 on a GPU, 0 on a CPU", torch.cuda.device_count)
if torch.cuda.is_available():
    row("a CUDA op", "8.0", lambda: float((torch.ones(8, device="cuda") @ torch.ones(8, device="cuda")).item()))
    from torch.profiler import ProfilerActivity, profile
    def prof():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            (torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum().item()
        return f"{sum(1 for e in p.key_averages() if 'CUDA' in str(getattr(e, 'device_type', '')))} device events"
    row("torch.profiler with CUDA activity", "some device events", prof)
child = ("import os, torch; print(torch.cuda.device_count(), sorted(n for n in os.listdir('/dev') if n.startswith('nvidia')))")
env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
row("child without CUDA_VISIBLE_DEVICES: GPUs, nodes", "<=1 GPU, its own node only",
    lambda: (lambda d: d.stdout.strip() or d.stderr[-200:])(subprocess.run([sys.executable, "-c", child], env=env,
                                                                          capture_output=True, text=True, timeout=300)))
raise RuntimeError("REPORT " + json.dumps(rows))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.device != "auto":
        cfg = cfg.model_copy(update={"device": args.device})
    print(f"host: uid {os.getuid()}; device nodes:", " ".join(
        f"{n}({oct(os.stat('/dev/' + n).st_mode & 0o777)})" for n in sorted(os.listdir("/dev")) if n.startswith("nvidia")) or "none")
    t0 = time.perf_counter()
    pool = open_pool(cfg, "attention")
    print(f"pool started in {time.perf_counter() - t0:.1f} s on {pool.device}")
    try:
        t0 = time.perf_counter()
        handle = pool.spawn(PROBE.replace("CHECKOUT", repr(str(ROOT))))
        first = time.perf_counter() - t0
        print(f"sandbox: {handle.sandbox}")
        try:
            reply = handle.request({"cmd": "load", "path": str(handle.workdir / "candidate.py")}, 600, "probing")
        except Exception as e:                          # noqa: BLE001 - a self-check says what happened
            reply = {"error": f"{type(e).__name__}: {e}"}
        tail = handle.log_tail()
        handle.close()
        error = str(reply.get("error", ""))
        if "REPORT " not in error:
            print("the probe did not report:\n" + error[-3000:] + "\nlog:\n" + tail)
        else:
            rows = json.loads(error.rsplit("REPORT ", 1)[1].strip().splitlines()[0])
            w = [max(len(r[i]) for r in rows + [["tried", "expected", "got"]]) for i in range(2)]
            print(f"\n{'tried':<{w[0]}}  {'expected':<{w[1]}}  got")
            for what, expected, got in rows:
                print(f"{what:<{w[0]}}  {expected:<{w[1]}}  {got}")
        starts = []
        for _ in range(3):                      # the spare is forked while the previous one works
            t0 = time.perf_counter()
            pool._fork().close()
            starts.append(time.perf_counter() - t0)
        print(f"\na fresh sandboxed worker to its first message: {', '.join(f'{s:.3f}' for s in starts)} s "
              f"(first spawn incl. warm-up: {first:.2f} s)")
        source = (ROOT / "knowledge" / "attention" / "decode_paged_splitkv.py").read_text()
        v = evaluate(source, "attention", cfg, pool, until="parity")
        print(f"\ncorrect kernel: {'passed' if v.ok else 'REJECTED'}: {v.reason[:300]}")
        for s in v.stages:
            print(f"  {s.name:<10} {s.status:<8} {s.seconds:7.2f} s  {s.reason[:150]}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
