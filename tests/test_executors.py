"""Evaluations in parallel: slot processes on this machine (LocalExecutor) and a real Dask cluster of
worker processes on loopback (DaskExecutor) give the verdicts a serial evaluate() gives, in
submission order, each job once — with a slot that cannot be used taken out, and an evaluator
killed mid-job re-queued."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from candidates import CRASH_ON_BOUNDARY, REF_DECODE, SDPA_WRAPPER, WRONG_SHAPE
from conftest import CUDA, ROOT, config_with, runtime_only
from harness.config import ConfigError, load_config
from harness.errors import HarnessError
from harness.evaluate import evaluate
from harness.executors import InOrder
from harness.local_executor import LocalExecutor
from harness.pins import core_shares, deal_cores, local_pins
from harness.slot import Job, Pin, device_health

# Deterministic verdicts (no drawn numbers in their reasons), cheap on the interpreter; a crash among
# them makes its slot check its health again before the next job.
JOBS = [Job(id="c001", source=REF_DECODE, until="parity"), Job(id="c002", source=CRASH_ON_BOUNDARY, until="parity"),
        Job(id="c003", source=SDPA_WRAPPER, until="parity"), Job(id="c004", source=WRONG_SHAPE, until="parity")]
# Slow while its worker imports it, so the test can kill its evaluator mid-job; then passes compile.
SLOW = Job(id="c010", source=REF_DECODE + '\nimport time\ntime.sleep(4)\n', until="compile")


def gist(verdict) -> tuple:
    """What two judgements of one candidate share: the outcome, each stage's, and the reason up to the case it
    names (parity draws each check's sm_scale, unused-slot fill and layer from a fresh secret seed, so the
    case label that follows differs from run to run)."""
    return (verdict.ok, verdict.accepted, verdict.failed_stage, verdict.reason.split(":", 2)[:2],
            [(s.name, s.status) for s in verdict.stages])


@pytest.fixture(scope="module")
def serial(cfg, pool):
    return {job.id: gist(evaluate(job.source, "attention", runtime_only(), pool, until=job.until)) for job in JOBS + [SLOW]}


@pytest.fixture(scope="module")
def local():
    """Two CPU slots, each on its share of the cores, and a third pinned to a core this machine lacks."""
    cfg = runtime_only(**{"executor.cpu_slots": 2})           # JOBS crash through ctypes, SLOW imports time
    missing = Pin(name="cpu-missing", device="cpu", cpus=(os.cpu_count() + 1000,))
    with LocalExecutor(cfg, "attention", local_pins(cfg) + [missing]) as ex:
        yield ex


def drain(queue: InOrder) -> list:
    out = []
    while len(queue):
        out.append(queue.next())
    return out


def test_local_slots_evaluate_at_once_and_agree_with_a_serial_run(local, serial):
    queue = InOrder(local)
    for job in JOBS:
        assert queue.submit(job)
    assert not queue.submit(JOBS[0])                       # already in flight: not evaluated twice
    done = drain(queue)
    assert [d.id for d in done] == [j.id for j in JOBS]    # submission order, each once
    assert {d.id: gist(d.verdict) for d in done} == {j.id: serial[j.id] for j in JOBS}
    assert {d.slot for d in done} == {"cpu0", "cpu1"}
    overlapping = [(a.id, b.id) for a in done for b in done
                   if a.slot != b.slot and a.started < b.ended and b.started < a.ended]
    assert overlapping, [(d.id, d.slot, d.started, d.ended) for d in done]
    assert local.capacity == 2                             # the crash's health re-check kept its slot
    assert len(local.leases) == 3                          # CPU slots: each its own lease, nothing waits on another


def test_each_slot_gets_a_share_of_the_cores_no_other_slot_has():
    cores = sorted(os.sched_getaffinity(0))
    for layout in ("blocks", "interleaved"):
        for n in range(1, len(cores) + 1):
            shares = core_shares(n, layout)
            assert len(shares) == n and all(shares)
            assert sorted(c for s in shares for c in s) == cores          # disjoint, and every core used
        assert len(core_shares(len(cores) + 1, layout)) == len(cores) + 1  # more slots than cores: one core each
    assert core_shares(2, "interleaved") == [tuple(cores[0::2]), tuple(cores[1::2])]
    assert core_shares(3, "none") == [tuple(cores)] * 3


def test_blocks_keep_each_slot_inside_one_cache_group_where_the_host_numbers_them_alternately():
    """On a host whose last-level cache groups alternate core by core (as some two-socket machines number
    them), each slot's block is one group, where runs of numbers would mix both groups in every slot."""
    assert deal_cores(list(range(8)), 2, "blocks", locality=lambda c: (0, c % 2)) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert deal_cores(list(range(8)), 2, "blocks", locality=lambda c: (0, 0)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert deal_cores(list(range(7)), 3, "blocks", locality=lambda c: (c // 4, 0)) == [(0, 1), (2, 3), (4, 5, 6)]


def test_a_slot_whose_device_is_missing_is_taken_out_and_the_rest_go_on(local):
    assert set(local.removed) == {"cpu-missing"}
    assert "cannot pin to CPU cores" in local.removed["cpu-missing"]
    assert local.capacity == 2
    with pytest.raises(HarnessError, match="no evaluation slot passed its health check: cpu-missing"):
        LocalExecutor(config_with(), "attention", [Pin(name="cpu-missing", device="cpu", cpus=(os.cpu_count() + 1000,))])


def test_a_slot_process_killed_mid_job_has_its_job_requeued_and_answered_once(local, serial):
    started = threading.Event()
    fut = local.submit(SLOW, on_stage=lambda name: started.set())
    assert started.wait(120)
    victim = next(slot for slot, job_id in local.running().items() if job_id == SLOW.id)
    os.kill(local.pid(victim), signal.SIGKILL)
    done = fut.result(timeout=120)
    assert local.requeued[SLOW.id] == 1
    assert done.slot != victim and gist(done.verdict) == serial[SLOW.id]
    assert local.submit(SLOW) is fut                       # the id is answered once


# An executor in a process of its own, as a run holds one: SIGTERM only noted (a run finishes the candidates in
# flight), one slow job submitted, "started" printed once it is judged, then how its verdict came.
GROUP_RUN = """
import json, signal, sys, threading
sys.path.insert(0, "tests")
from conftest import runtime_only
from test_executors import SLOW
from harness.local_executor import LocalExecutor
from harness.pins import local_pins
signal.signal(signal.SIGTERM, lambda *_: None)
cfg = runtime_only(**{"executor.cpu_slots": 1})
started = threading.Event()
with LocalExecutor(cfg, "attention", local_pins(cfg)) as ex:
    fut = ex.submit(SLOW, on_stage=lambda name: started.set())
    started.wait(120)
    print("started", flush=True)
    done = fut.result(timeout=120)
    print(json.dumps({"requeued": ex.requeued.get(SLOW.id, 0), "ok": done.verdict.ok, "removed": sorted(ex.removed)}))
"""


def test_a_sigterm_to_the_runs_process_group_leaves_its_slots_judging_the_jobs_in_flight():
    """A service manager, `timeout` or `kill -- -PGID` stops a run by signalling its whole process group. The run
    finishes the candidates in flight; its slots must not die under them (each death re-queues a job, counted
    against executor.requeue_limit)."""
    proc = subprocess.Popen([sys.executable, "-c", GROUP_RUN], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "started", proc.stderr.read()[-2000:]
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == {"requeued": 0, "ok": True, "removed": []}


def test_a_dask_cluster_evaluates_at_once_and_requeues_a_job_whose_worker_was_killed(serial):
    from harness.cluster import TOPIC, DaskExecutor
    cfg = runtime_only(**{"executor.kind": "dask", "executor.cpu_slots": 2})
    jobs = [JOBS[0], JOBS[1], SLOW]            # two at once on the two workers; the slow one next, killed
    with DaskExecutor(cfg, "attention") as ex:
        assert ex.capacity == 2
        queue = InOrder(ex)
        started = threading.Event()
        for job in jobs:
            queue.submit(job, on_stage=(lambda name: started.set()) if job is SLOW else None)
        assert started.wait(120)
        victim = next(worker for worker, job_id in ex.running().items() if job_id == SLOW.id)
        os.kill(ex.client.run(os.getpid)[victim], signal.SIGKILL)
        done = drain(queue)
        assert [d.id for d in done] == [j.id for j in jobs]
        assert {d.id: gist(d.verdict) for d in done} == {j.id: serial[j.id] for j in jobs}
        ran_on = [msg["slot"] for _, msg in ex.client.get_events(TOPIC) if msg["id"] == SLOW.id and msg["stage"] == "compile"]
        assert len(ran_on) == 2 and ran_on[0] == victim and done[-1].slot == ran_on[1] != victim
        a, b = done[0], done[1]
        assert a.slot != b.slot and a.started < b.ended and b.started < a.ended    # evaluated at the same time
        assert ex.submit(SLOW) is ex.submit(SLOW) and not queue.submit(SLOW)       # one verdict per id


@pytest.mark.parametrize("old, new, words", [
    ("  cpu_slots: 1", "  cpu_slots: 1\n  cpu_slot: 2", "executor.cpu_slot: unknown key"),
    ("  gpus: auto", "  gpus: [0, 0]", "executor.gpus: gpus must be auto or a non-empty list of distinct"),
    ("  kind: local", "  kind: ray", "executor.kind: Input should be 'local' or 'dask'"),
    ("  slot_cores: blocks", "  slot_cores: block", "executor.slot_cores: Input should be 'blocks', 'interleaved' or 'none'"),
    ("CUDA_VISIBLE_DEVICES, ", "", "worker.env_passthrough must include CUDA_VISIBLE_DEVICES"),
])
def test_an_executor_mistake_is_one_line_naming_the_key(tmp_path, old, new, words):
    text = (ROOT / "config.yaml").read_text()
    assert old in text
    path = tmp_path / "config.yaml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")
def test_a_gpu_slot_pinned_to_a_missing_gpu_is_taken_out_and_gpu0_evaluates():
    cfg = config_with(**{"executor.gpus": [0, 99], "executor.slots_per_gpu": 2})
    with LocalExecutor(cfg, "attention") as ex:
        assert set(ex.removed) == {"gpu99.0", "gpu99.1"} and "CUDA_VISIBLE_DEVICES=99" in ex.removed["gpu99.0"]
        assert ex.capacity == 2 and len(ex.leases) == 2                 # two slots on GPU 0, one lease per GPU
        done = ex.submit(Job(id="g001", source=REF_DECODE, until="parity")).result(timeout=900)
        assert done.slot in ("gpu0.0", "gpu0.1") and done.verdict.ok, done.verdict.reason


class _PassingDevice:
    """A device's pool whose health check fails `faults` times (a passing fault: ECC, a throttled clock), then passes."""
    device = "cpu"

    def __init__(self, faults: int) -> None:
        self.faults, self.checks = faults, 0

    def check_health(self) -> str:
        self.checks += 1
        return "a known kernel came out wrong" if self.checks <= self.faults else ""


def test_a_device_failing_its_health_check_once_is_checked_again_after_the_retry_and_passes():
    waited = []
    flaky = _PassingDevice(faults=1)
    assert device_health("cpu", flaky, 7.5, sleep=waited.append) == ""
    assert (flaky.checks, waited) == (2, [7.5])


def test_a_device_failing_its_health_check_twice_is_reported_unwell_with_why():
    sick = _PassingDevice(faults=2)
    assert device_health("cpu", sick, 0.0, sleep=lambda s: None) == "a known kernel came out wrong"
    assert sick.checks == 2


class _SickDevice:
    """A launched pool on a device whose known kernel comes out wrong (a faulty GPU) `faults` times; the rest real."""

    def __init__(self, pool, faults: int = 2) -> None:
        self._pool, self.faults = pool, faults

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def ready(self):
        self._pool.ready()
        return self

    def end_health(self, check) -> str:
        real = self._pool.end_health(check)
        self.faults -= 1
        return "a known kernel came out wrong" if self.faults >= 0 else real

    def check_health(self) -> str:
        return self.end_health(self._pool.begin_health())


def test_a_candidate_judged_beside_a_failing_first_health_check_gets_no_verdict():
    """`evaluate_each` runs its first health check beside the first candidate's compile stage: when it fails (and
    fails again after the retry), that candidate is not judged (no later stage, no verdict), nor any after it."""
    from harness.evaluate import evaluate_each
    from harness.pool import Pool
    cfg = config_with(**{"executor.health_retry_s": 0.0})
    sick = _SickDevice(Pool(cfg.worker, "cpu", "attention").launch())
    out = list(evaluate_each([REF_DECODE, REF_DECODE], "attention", cfg, until="parity", pool=sick))
    assert out == ["not judged: cpu: a known kernel came out wrong"] * 2, out


def test_a_candidate_judged_beside_a_first_health_check_that_fails_once_is_judged_afresh_after_the_retry():
    """A check that fails beside the first candidate, then passes once more after the retry: the candidate is judged
    (from its compile stage again) and gets its verdict."""
    from harness.evaluate import evaluate_each
    from harness.pool import Pool
    cfg = config_with(**{"executor.health_retry_s": 0.0})
    flaky = _SickDevice(Pool(cfg.worker, "cpu", "attention").launch(), faults=1)
    out = list(evaluate_each([REF_DECODE], "attention", cfg, until="dispatch", pool=flaky))
    assert len(out) == 1 and not isinstance(out[0], str), out
    assert out[0].verdict.ok and [s.name for s in out[0].verdict.stages] == ["compile", "dispatch"], out[0].verdict
    assert flaky.faults == -1                       # the check beside it, then the one after the retry
