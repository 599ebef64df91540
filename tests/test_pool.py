"""The worker pool: one fresh worker per candidate, a warm spare ready, nothing left behind."""
from __future__ import annotations

import os

from conftest import descendants, thread_states
from harness.evaluate import open_pool


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_each_spawn_is_a_new_process_and_close_leaves_no_worker_behind(cfg):
    pool = open_pool(cfg, "attention")
    try:
        first = pool.spawn("def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):\n    return q\n")
        second = pool.spawn("def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):\n    return q\n")
        assert first.pid != second.pid and first.host_folder != second.host_folder
        reply = second.request({"cmd": "load", "path": str(second.workdir / "candidate.py")}, 30, "loading")
        assert reply["ok"] and reply["ops"] == ["decode"]
        pids = [first.pid, second.pid] + ([pool._spare.pid] if pool._spare else [])
        first.close()
        second.close()
    finally:
        zygote = pool.proc.pid
        pool.close()
    for pid in pids + [zygote]:
        assert not alive(pid), pid


def test_a_killed_spare_is_replaced_not_handed_out(cfg):
    pool = open_pool(cfg, "attention")
    try:
        pool.spawn("x = 1\n").close()
        spare = pool._spare
        os.killpg(spare.pid, 9)
        handle = pool.spawn("def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):\n    return q\n")
        assert handle.pid != spare.pid
        assert handle.request({"cmd": "ping"}, 30, "pinging")["ok"]
        handle.close()
    finally:
        pool.close()


def test_using_an_opened_pool_as_a_context_does_not_start_a_second_zygote(cfg):
    pool = open_pool(cfg, "attention")
    first = pool.proc.pid
    with pool as same:
        assert same.proc.pid == first
    assert not alive(first)


def test_replied_says_a_reply_waits_without_reading_it(cfg):
    import time
    pool = open_pool(cfg, "attention")
    try:
        handle = pool.spawn("x = 1\n")
        assert not handle.replied()                          # nothing asked, nothing to read
        handle.send({"cmd": "ping"}, "pinging")
        deadline = time.monotonic() + 30
        while not handle.replied() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.replied() and handle.replied()        # still there: asking read nothing
        assert handle.collect(30, "pinging")["ok"] and not handle.replied()
        handle.close()
        assert handle.replied()                              # a stopped worker: collect would say so at once
    finally:
        pool.close()


def test_a_worker_held_still_for_the_evaluators_own_timing_has_every_thread_stopped_and_answers_nothing_until_continued(cfg):
    import time
    pool = open_pool(cfg, "attention")
    try:
        handle = pool.spawn("x = 1\n")
        assert handle.request({"cmd": "ping"}, 30, "pinging")["ok"]
        procs = descendants(handle.pid)
        assert len(procs) >= 2, procs                       # the shim and the worker
        assert handle.held_still(2.0)
        assert all(thread_states(p) <= {"T", "t"} for p in procs), {p: thread_states(p) for p in procs}
        handle.send({"cmd": "ping"}, "pinging")
        time.sleep(0.5)
        assert not handle.replied()                          # held: nothing of it runs
        handle.hold_still(False)
        assert handle.collect(30, "pinging")["ok"] and not handle.stopped()
        handle.close()
    finally:
        pool.close()


def test_a_workers_audit_and_profiler_import_neither_dynamo_nor_inductor():
    """The zygote's preload and a worker's profiler stay off torch._dynamo and torch._inductor (seconds of import
    on the critical path of every cold evaluation), in a fresh interpreter as the zygote is."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys, torch\nfrom harness import worker\nworker.preload()\n"
            "with worker._profiler(torch.device('cpu')) as prof:\n    (torch.ones(8) * 2).sum()\n"
            "assert prof.key_averages()\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout

def test_priming_the_timing_calls_the_trusted_baseline_and_never_the_candidate(cfg, pool):
    """The worker's `prime` (microbench's first-use costs, paid while the evaluator draws) runs the baseline and
    the anchor on the small case it is named, never the candidate's function: here one that ends its worker."""
    import torch
    from harness.evaluate import device_shapes
    from harness.targets import configured
    target = configured("attention", cfg)
    case = target.compile_case(device_shapes(cfg, "attention", torch.device("cpu")), "decode")
    trap = "def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):\n    raise SystemExit(7)\n"
    handle = pool.spawn(trap)
    try:
        assert handle.request({"cmd": "load", "path": str(handle.workdir / "candidate.py")}, 30, "loading")["ok"]
        recipe = {"case": case, "dist": "normal", "seed": 0, "dtype": "float32", "baseline": target.ops["decode"].baseline_name}
        primed = handle.request({"cmd": "prime", "calls": [recipe], "flush_bytes": 1 << 20}, 60, "priming")
        assert primed["ok"] is True and primed["failed"] <= 1, primed      # on a CPU only the cuDNN anchor may fail
        called = handle.request({"cmd": "call", "op": "decode", "inputs": recipe, "out_shape": [1], "recheck": [],
                                 "drop": []}, 60, "calling the candidate")
        assert called["ok"] is False and called["fatal"] is True          # the trap is live: a call would have shown
    finally:
        handle.close()
