"""A killed evaluator leaves nothing running: its zygote, workers and served servers die with it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from conftest import ROOT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                    # a zombie not yet reaped counts as gone
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def _kill_and_expect_gone(proc: subprocess.Popen, pids: list[int]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]


def test_killing_the_evaluator_kills_its_zygote_and_workers(tmp_path):
    script = textwrap.dedent("""
        import os, sys, time
        from harness.config import load_config
        from harness.evaluate import open_pool
        pool = open_pool(load_config(), "attention")
        w = pool.spawn("while True: pass\\n")
        w.send({"cmd": "load", "path": str(w.workdir / "candidate.py")}, "loading")
        print(pool.proc.pid, w.pid, pool._spare.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    for shim in pids[1:]:                   # each shim's child is the worker, PID 1 of its namespace
        pids += [int(c) for c in open(f"/proc/{shim}/task/{shim}/children").read().split()]
    assert len(pids) == 5 and all(_alive(p) for p in pids)
    _kill_and_expect_gone(proc, pids)


def test_killing_the_evaluator_kills_its_served_server():
    script = textwrap.dedent("""
        import time
        from harness.config import load_config
        from harness.served.launch import start_server
        server = start_server(load_config(), "cpu", None)
        print(server.proc.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    outer = int(proc.stdout.readline())
    pids = [outer] + [int(c) for c in open(f"/proc/{outer}/task/{outer}/children").read().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    _kill_and_expect_gone(proc, pids)
