"""Several slots on one GPU: only the timed stages hold it alone. The lease itself (harness/lease.py):
shared holders together, a holder alone with nobody else, writer preference, first asked first served,
closing wakes every waiter. And real CPU slot processes sharing one lease key (as slots_per_gpu slots
share their GPU's): each stage a slot ran (Done.spans) never overlaps a timed stage of another slot,
the lease grants two jobs' shared stages at once, and a slot that hangs while holding the lease is
killed, which releases it, and its job is re-queued; a candidate's worker is stopped while its slot
waits; slots sharing a GPU split its memory cap. Slot processes are stopped (SIGSTOP) to hold a stage open, so
the order of events is forced, never waited for by the clock."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from candidates import REF_DECODE
from conftest import CUDA, ROOT, config_with, runtime_only
from harness.config import ConfigError, load_config
from harness.local_executor import LocalExecutor
from harness.lease import Holding, Lease, LeaseState, Parked, mode_of
from harness.pins import core_shares, slot_config
from harness.slot import Job, Pin
from harness.stages import STAGE_NAMES, TIMED_STAGES, WHOLE_GPU_STAGES, preparing

KEY = "gpu:one"          # the lease both CPU slots share, as two slots of one GPU do


def until(condition, what: str, limit_s: float = 120.0) -> None:
    """Wait for a condition another thread or process brings about (a hang guard, not a measurement)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def acquiring(lease: Lease, holder: str, mode: str) -> tuple[threading.Thread, list]:
    """`holder` asks in a thread; what it got lands in the list: True, False (closed) or the Parked it raised."""
    got: list = []

    def ask() -> None:
        try:
            got.append(lease.acquire(holder, mode))
        except Parked as e:
            got.append(e)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    return t, got


def parks(lease: Lease, holder: str, mode: str) -> bool:
    """`holder` asks, in a thread so that a wait shows as a failure and not a hang: was it parked at once?"""
    t, got = acquiring(lease, holder, mode)
    t.join(5)
    if t.is_alive():
        lease.close()                                             # it waits: wake it, so the test ends
        t.join(5)
    return len(got) == 1 and isinstance(got[0], Parked)


# -- the lease ----------------------------------------------------------------------------------------

def test_timed_stages_hold_the_gpu_alone_the_replay_whole_and_every_other_stage_shares_it():
    assert TIMED_STAGES == {"microbench", "replay"} and WHOLE_GPU_STAGES == {"replay"} and TIMED_STAGES < set(STAGE_NAMES)
    assert [mode_of(s) for s in STAGE_NAMES] == ["shared", "shared", "shared", "alone", "whole"]


def test_shared_holders_hold_together_and_a_holder_alone_waits_for_all_of_them():
    lease = Lease(KEY)
    assert lease.acquire("a", "shared") and lease.acquire("b", "shared")
    t, got = acquiring(lease, "w", "alone")
    until(lambda: lease.state().waiting_alone == ("w",), "w waits")
    lease.release("a")
    assert lease.state().alone is None and lease.state().waiting_alone == ("w",)    # b still holds it
    lease.release("b")
    t.join(10)
    assert got == [True] and lease.state().alone == "w" and not lease.state().shared


def test_once_a_timed_stage_waits_no_new_shared_holder_starts_before_it():
    lease = Lease(KEY)
    assert lease.acquire("a", "shared")
    tw, got_w = acquiring(lease, "w", "alone")
    until(lambda: lease.state().waiting_alone == ("w",), "w waits")
    tb, got_b = acquiring(lease, "b", "shared")                  # a newcomer, or a slot's next shared stage
    until(lambda: "b" in lease.state().waiting_shared, "b waits")
    assert lease.state().shared == {"a"}                          # b did not start beside a while w waits
    lease.release("a")
    tw.join(10)
    state = lease.state()
    assert got_w == [True] and state.alone == "w" and state.waiting_shared == {"b"} and not got_b
    lease.release("w")
    tb.join(10)
    assert got_b == [True] and lease.state().shared == {"b"}


def test_two_timed_stages_never_hold_one_gpu_together_and_are_served_first_asked_first():
    for _ in range(10):                                           # which waiter wakes first is the scheduler's choice
        lease = Lease(KEY)
        assert lease.acquire("m1", "alone")
        t2, got2 = acquiring(lease, "m2", "alone")
        until(lambda: lease.state().waiting_alone == ("m2",), "m2 waits")
        t3, got3 = acquiring(lease, "m3", "alone")
        until(lambda: lease.state().waiting_alone == ("m2", "m3"), "m3 waits behind m2")
        tb, got_b = acquiring(lease, "b", "shared")
        until(lambda: "b" in lease.state().waiting_shared, "b waits")
        lease.release("m1")
        t2.join(10)
        assert got2 == [True] and lease.state().alone == "m2" and not got3 and not got_b
        lease.release("m2")
        t3.join(10)
        assert got3 == [True] and lease.state().alone == "m3" and not got_b
        lease.release("m3")
        tb.join(10)
        assert got_b == [True]


def test_a_holding_lets_go_before_it_asks_again_so_two_slots_moving_to_timed_stages_cannot_deadlock():
    lease = Lease(KEY)
    a, b = Holding(lease, "a"), Holding(lease, "b")
    assert a.hold("shared") and b.hold("shared")                  # both in parity
    t, got = [], []
    t.append(threading.Thread(target=lambda: got.append(a.hold("alone")), daemon=True))
    t[0].start()                                                  # a's microbench waits for b's parity
    until(lambda: lease.state().waiting_alone == ("a",), "a waits")
    assert lease.state().shared == {"b"}                          # a let go of its parity's share
    t.append(threading.Thread(target=lambda: got.append(b.hold("alone")), daemon=True))
    t[1].start()                                                  # b's microbench: a goes first, then b
    t[0].join(10)
    assert lease.state().alone == "a" and lease.state().waiting_alone == ("b",)
    a.release()
    t[1].join(10)
    assert got == [True, True] and lease.state().alone == "b"
    b.release()
    assert lease.state() == Lease(KEY).state()


def test_releasing_a_holder_frees_what_it_held_in_either_mode_and_closing_wakes_every_waiter():
    lease = Lease(KEY)
    assert lease.acquire("dead", "alone")
    lease.release("dead")
    lease.release("never-held")                                   # nothing held: nothing happens
    assert lease.acquire("x", "shared")
    with pytest.raises(RuntimeError, match="asked for the gpu:one lease while holding it"):
        lease.acquire("x", "alone")
    tw, got_w = acquiring(lease, "w", "alone")
    until(lambda: lease.state().waiting_alone == ("w",), "w waits")
    tb, got_b = acquiring(lease, "b", "shared")
    until(lambda: "b" in lease.state().waiting_shared, "b waits")
    lease.close()
    tw.join(10)
    tb.join(10)
    assert got_w == [False] and got_b == [False]
    assert not lease.state().waiting_alone and not lease.state().waiting_shared


def test_a_replay_holds_the_gpu_whole_once_every_other_slots_job_has_ended_and_parks_each_that_asks_meanwhile():
    lease = Lease(KEY)
    for holder in ("a", "b", "w"):
        assert lease.begin_job(holder)
    assert lease.acquire("a", "shared")                           # a in its parity
    tw, got_w = acquiring(lease, "w", "whole")                    # w's replay: first in line, the GPU drains for it
    until(lambda: lease.state().draining == "w", "w drains the GPU")
    assert parks(lease, "b", "shared")                            # b, in a job, asks for its next stage: parked
    lease.end_job("b")                                            # b's slot ended its job (worker closed, memory back)
    lease.release("a")
    assert parks(lease, "a", "alone")                             # a's parity is over; its microbench is parked too
    assert not got_w and lease.state().jobs == {"a", "w"}         # a's job has not ended yet: w still waits
    th, got_h = acquiring(lease, "h", "shared")                   # a health check is no job: it waits, unparked
    until(lambda: "h" in lease.state().waiting_shared, "h waits")
    begun: list[bool] = []
    tc = threading.Thread(target=lambda: begun.append(lease.begin_job("c")), daemon=True)
    tc.start()                                                    # no job begins while the GPU drains or is held whole
    lease.end_job("a")
    tw.join(10)
    assert got_w == [True] and lease.state().alone == "w" and lease.state().jobs == {"w"}
    assert not begun and not got_h and tc.is_alive()
    lease.release("w")                                            # the replay is over
    tc.join(10)
    th.join(10)
    assert begun == [True] and got_h == [True] and lease.state().draining is None and lease.state().shared == {"h"}


def test_a_timed_stage_first_in_line_goes_before_a_replay_and_is_not_parked_by_it():
    lease = Lease(KEY)
    for holder in ("m", "w"):
        assert lease.begin_job(holder)
    assert lease.acquire("x", "shared")
    tm, got_m = acquiring(lease, "m", "alone")
    until(lambda: lease.state().waiting_alone == ("m",), "m waits")
    tw, got_w = acquiring(lease, "w", "whole")
    until(lambda: lease.state().waiting_alone == ("m", "w"), "w waits behind m")
    assert lease.state().draining is None                         # w is not first in line: nothing drains yet
    lease.release("x")
    tm.join(10)
    assert got_m == [True] and lease.state().alone == "m"
    lease.release("m")                                            # m's microbench done: now w is first, and m's job
    until(lambda: lease.state().draining == "w", "w drains")      # must end before w holds the GPU whole
    assert not got_w
    lease.end_job("m")
    tw.join(10)
    assert got_w == [True]


def test_a_second_replay_asked_for_while_the_gpu_drains_for_the_first_is_parked():
    lease = Lease(KEY)
    for holder in ("w1", "w2"):
        assert lease.begin_job(holder)
    t1, got1 = acquiring(lease, "w1", "whole")
    until(lambda: lease.state().draining == "w1", "w1 drains the GPU")
    assert parks(lease, "w2", "whole")                            # w2's candidate passed microbench too: parked
    assert lease.state().waiting_alone == ("w1",) and not got1
    lease.end_job("w2")
    t1.join(10)
    assert got1 == [True] and lease.state().alone == "w1"


def test_closing_the_lease_wakes_a_drain_and_a_job_waiting_to_begin():
    lease = Lease(KEY)
    assert lease.begin_job("a") and lease.begin_job("w")
    tw, got_w = acquiring(lease, "w", "whole")
    until(lambda: lease.state().draining == "w", "w drains")
    begun: list[bool] = []
    tc = threading.Thread(target=lambda: begun.append(lease.begin_job("c")), daemon=True)
    tc.start()
    lease.close()
    tw.join(10)
    tc.join(10)
    assert got_w == [False] and begun == [False] and lease.state().draining is None


def test_slots_per_gpu_is_a_positive_count_named_when_wrong(tmp_path):
    src = (ROOT / "config.yaml").read_text()
    assert "\n  slots_per_gpu: 2\n" in src
    path = tmp_path / "config.yaml"
    path.write_text(src.replace("\n  slots_per_gpu: 2\n", "\n  slots_per_gpu: 0\n", 1))
    with pytest.raises(ConfigError, match="executor.slots_per_gpu: Input should be greater than or equal to 1"):
        load_config(path)


def test_slots_sharing_a_gpu_split_its_memory_cap_so_one_candidate_cannot_take_another_slots_memory():
    cfg = runtime_only()
    pins = [Pin(name="gpu0.0", device="cuda", visible="0", lease="gpu:0"),
            Pin(name="gpu0.1", device="cuda", visible="0", lease="gpu:0"),
            Pin(name="gpu1", device="cuda", visible="1", lease="gpu:1"), Pin(name="cpu0", device="cpu")]
    share = [slot_config(cfg, p, pins).worker.gpu_memory_fraction for p in pins]
    whole = cfg.worker.gpu_memory_fraction
    assert share == [whole / 2, whole / 2, whole, whole]
    assert slot_config(cfg, pins[0], pins).worker.model_dump(exclude={"gpu_memory_fraction", "gpu_share"}) == cfg.worker.model_dump(
        exclude={"gpu_memory_fraction", "gpu_share"}) and cfg.worker.gpu_memory_fraction == whole   # nothing else changed


@pytest.mark.parametrize("gib", [80, 141])
def test_every_slots_reserve_and_every_worker_at_its_cap_fit_on_a_gpu_however_many_slots_share_it(gib):
    """A candidate's out-of-memory error is its own only if its cap was there to be had: the reserves of the
    slots sharing a GPU are bounded so that all of them, what each keeps outside any cap, and every worker at its
    cap fit at once. Two slots (the default) keep the configured reserve on an H200, less on an 80 GB GPU; too many for
    the GPU is a harness error."""
    from harness.errors import HarnessError
    from harness.gpu_memory import CONTEXT_BYTES, reserve_bytes
    cfg, total = runtime_only(), gib << 30
    outside = 3 * CONTEXT_BYTES + cfg.stages.microbench.l2_flush_bytes
    fits = []
    for n in range(1, 17):
        pins = [Pin(name=f"gpu0.{k}", device="cuda", visible="0", lease="gpu:0") for k in range(n)]
        slot = slot_config(cfg, pins[0], pins)
        try:
            working = reserve_bytes(slot, total)
        except HarnessError as e:
            assert f"{n} slots share a GPU of {gib:.1f} GiB" in str(e) and "fewer slots per GPU" in str(e)
            break
        assert n * (working + outside) + n * slot.worker.gpu_memory_fraction * total <= total, n
        assert working >= 1 << 30
        fits.append(n)
    else:
        pytest.fail("sixteen slots fit beside their workers' caps")
    assert fits[:2] == [1, 2]
    two = reserve_bytes(slot_config(cfg, pins[0], pins[:2]), total)          # on an H200 the configured 16 GiB fits
    assert two == cfg.worker.trusted_gpu_bytes if gib == 141 else two < cfg.worker.trusted_gpu_bytes


# -- real slots sharing one lease -------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_gpu():
    """Two CPU slot processes sharing one lease key; parity's checks cut to one per shape (a job through
    microbench in seconds); a dispatch stage may take 4 s and a slot silent 1 s past that is hung."""
    cfg = runtime_only(**{"executor.cpu_slots": 2, "stages.parity.checks_per_shape": 1, "stages.dispatch.timeout_s": 4})
    pins = [Pin(name=f"cpu{i}", device="cpu", cpus=cpus, lease=KEY) for i, cpus in enumerate(core_shares(2))]
    with LocalExecutor(cfg, "attention", pins, slack_s=1.0) as ex:
        assert list(ex.leases) == [KEY] and ex.capacity == 2
        yield ex


class Stages:
    """The executor's on_stage calls of a job (each made once its stage was granted), and a hook per stage."""

    def __init__(self, hooks: dict | None = None) -> None:
        self.seen: list[str] = []
        self.hooks = hooks or {}

    def __call__(self, name: str) -> None:
        self.seen.append(name)
        if name in self.hooks:
            self.hooks[name]()


def slot_of(ex: LocalExecutor, job_id: str) -> str:
    return next(slot for slot, running in ex.running().items() if running == job_id)


def stopped_below(pid: int) -> list[int]:
    """The processes below `pid` (its pool's zygote, workers) that are stopped, from the host's /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for task in os.listdir(f"/proc/{p}/task")
                    for c in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:
            continue
        for c in kids:
            try:
                stat = open(f"/proc/{c}/stat").read()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2] == "T":
                out.append(c)
            todo.append(c)
    return out


def overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


def test_no_stage_of_another_slot_runs_beside_a_timed_stage_while_shared_stages_of_two_jobs_overlap(one_gpu):
    lease = one_gpu.leases[KEY]
    a_job, b_job = Job(id="a1", source=REF_DECODE, until="microbench"), Job(id="b1", source=REF_DECODE, until="compile")
    in_parity = threading.Event()
    a_stages = Stages({"parity": in_parity.set})
    a = one_gpu.submit(a_job, on_stage=a_stages)
    assert in_parity.wait(120)
    a_slot = slot_of(one_gpu, "a1")
    os.kill(one_gpu.pid(a_slot), signal.SIGSTOP)                  # a's parity held open ...
    try:
        in_compile, beside = threading.Event(), []
        b_stages = Stages({"compile": lambda: (beside.append(lease.state().shared), in_compile.set())})
        b = one_gpu.submit(b_job, on_stage=b_stages)
        assert in_compile.wait(120)                               # ... while b's compile starts beside it
        b_slot = slot_of(one_gpu, "b1")
        os.kill(one_gpu.pid(b_slot), signal.SIGSTOP)              # b's compile held open
    finally:
        os.kill(one_gpu.pid(a_slot), signal.SIGCONT)
    try:
        until(lambda: lease.state().waiting_alone == (a_slot,), "a's microbench waits for b's compile")
        assert "microbench" not in a_stages.seen and lease.state().shared == {b_slot}
        assert stopped_below(one_gpu.pid(a_slot))                 # a's candidate is held still while a waits
    finally:
        os.kill(one_gpu.pid(b_slot), signal.SIGCONT)
    done_a, done_b = a.result(timeout=300), b.result(timeout=300)
    assert done_a.verdict.ok and done_b.verdict.ok, (done_a.verdict.reason, done_b.verdict.reason)
    assert [s.name for s in done_a.spans] == a_stages.seen == ["compile", "dispatch", "parity", "microbench"]
    assert [s.name for s in done_b.spans] == b_stages.seen == ["compile"]
    spans = [(d.slot, s) for d in (done_a, done_b) for s in d.spans]
    beside_timed = [(x.name, y.name) for sx, x in spans for sy, y in spans
                    if sx != sy and (x.name in TIMED_STAGES or y.name in TIMED_STAGES) and overlaps(x, y)]
    assert not beside_timed, spans
    assert beside == [{a_slot, b_slot}]                           # two jobs' shared stages granted at once
    parity, micro, compile_b = done_a.spans[2], done_a.spans[3], done_b.spans[0]
    assert parity.end < compile_b.end <= micro.start              # a's microbench waited for b's compile
    assert lease.state() == LeaseState(None, frozenset(), (), frozenset())       # each job let go at its end


def test_a_slot_that_hangs_holding_the_lease_is_killed_which_releases_it_and_its_job_is_requeued(one_gpu):
    lease = one_gpu.leases[KEY]
    stopped: list[str] = []

    def stop_its_slot() -> None:                                  # the slot hangs at its dispatch stage
        if not stopped:
            stopped.append(slot_of(one_gpu, "h1"))
            os.kill(one_gpu.pid(stopped[0]), signal.SIGSTOP)

    hung = one_gpu.submit(Job(id="h1", source=REF_DECODE, until="dispatch"), on_stage=Stages({"dispatch": stop_its_slot}))
    until(lambda: bool(stopped), "h1 reaches dispatch")
    assert stopped[0] in lease.state().shared
    timed = one_gpu.submit(Job(id="t1", source=REF_DECODE, until="microbench"))
    done_t, done_h = timed.result(timeout=180), hung.result(timeout=180)     # no deadlock on the dead share
    assert done_t.verdict.ok and [s.name for s in done_t.spans][-1] == "microbench"
    assert done_h.verdict.ok and one_gpu.requeued["h1"] == 1
    assert lease.state().alone is None and not lease.state().waiting_alone


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")
def test_on_a_gpu_two_slots_overlap_cheap_stages_and_no_stage_runs_beside_a_microbench():
    cfg = config_with(**{"executor.gpus": [0], "executor.slots_per_gpu": 2})
    jobs = [Job(id=f"g{i}", source=REF_DECODE, until="microbench" if i % 2 else "parity") for i in range(4)]
    with LocalExecutor(cfg, "attention") as ex:
        assert ex.capacity == 2 and len(ex.leases) == 1
        done = [f.result(timeout=900) for f in [ex.submit(j) for j in jobs]]
    assert all(d.verdict.failed_stage in (None, "microbench") for d in done), [d.verdict.reason for d in done]
    # microbench's untimed first part (its draws, the worker's prime) shares the GPU; only its timing holds it alone
    assert [s.name for s in done[1].spans][-2:] == [preparing("microbench"), "microbench"]
    assert done[1].verdict.stages[-1].status != "skipped" and mode_of(preparing("microbench")) == "shared"
    spans = [(d.slot, s) for d in done for s in d.spans]
    pairs = [(x, y) for sx, x in spans for sy, y in spans if sx != sy and overlaps(x, y)]
    assert not [(x.name, y.name) for x, y in pairs if x.name in TIMED_STAGES or y.name in TIMED_STAGES], spans
    assert pairs                                                  # the cheap stages did run side by side


def test_a_replay_parks_the_job_another_slot_of_its_gpu_is_in_and_that_job_runs_again_after_it(one_gpu):
    lease = one_gpu.leases[KEY]
    parked_before = dict(one_gpu.parked)
    other: list = []
    p_stages = Stages()

    def begin_the_other_job() -> None:                            # w1 holds the GPU alone (its microbench): p1
        other.append(one_gpu.submit(Job(id="p1", source=REF_DECODE, until="parity"), on_stage=p_stages))
        until(lambda: "p1" in one_gpu.running().values() and slot_of(one_gpu, "p1") in
              lease.state().waiting_shared | lease.state().shared, "p1 asks for its compile")    # begins its job

    w_stages = Stages({"microbench": begin_the_other_job})
    w = one_gpu.submit(Job(id="w1", source=REF_DECODE, until="replay"), on_stage=w_stages)
    done_w = w.result(timeout=300)
    done_p = other[0].result(timeout=300)
    assert done_w.verdict.failed_stage is None and done_p.verdict.ok, (done_w.verdict.reason, done_p.verdict.reason)
    assert w_stages.seen == ["compile", "dispatch", "parity", "microbench", "replay"]
    assert one_gpu.parked.get("p1", 0) - parked_before.get("p1", 0) == 1 and "p1" not in one_gpu.requeued
    # parked at its first ask for a stage after w1 asked for the replay: before its compile ran, or after it
    assert p_stages.seen in (["compile", "dispatch", "parity"], ["compile", "compile", "dispatch", "parity"]), p_stages.seen
    replay = done_w.spans[-1]
    assert replay.name == "replay" and [s.name for s in done_p.spans] == ["compile", "dispatch", "parity"]
    assert all(s.start >= replay.end for s in done_p.spans), (replay, done_p.spans)     # run again after the replay
    assert lease.state() == LeaseState(None, frozenset(), (), frozenset())           # no job, no drain left behind


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")
def test_on_a_gpu_a_replay_parks_the_other_slots_job_and_its_three_servers_fit_beside_that_slot():
    cfg = config_with(**{"executor.gpus": [0], "executor.slots_per_gpu": 2, "served.cuda.window_s": 10})
    with LocalExecutor(cfg, "attention") as ex:
        lease = next(iter(ex.leases.values()))
        other: list = []

        def begin_the_other_job() -> None:                        # the replay's job holds the GPU alone (microbench)
            other.append(ex.submit(Job(id="o1", source=REF_DECODE, until="parity")))
            until(lambda: "o1" in ex.running().values() and slot_of(ex, "o1") in
                  lease.state().waiting_shared | lease.state().shared, "o1 asks for its compile", 300)

        w = ex.submit(Job(id="w1", source=REF_DECODE, until="replay"), on_stage=Stages({"microbench": begin_the_other_job}))
        done_w = w.result(timeout=900)                            # servers that did not fit: a HarnessError here
        done_o = other[0].result(timeout=900)
    replay = done_w.verdict.stages[-1]
    assert replay.name == "replay" and replay.status != "skipped" and "gate_passed" in replay.metrics, replay.reason
    assert done_o.verdict.ok and ex.parked == {"o1": 1}, (done_o.verdict.reason, ex.parked)
    assert all(s.start >= done_w.spans[-1].end for s in done_o.spans)
    print(f"\nreplay {replay.seconds:.1f} s: {replay.reason[:300]}; evaluator held "
          f"{replay.metrics.get('evaluator_gpu_held_gib', float('nan')):.2f} GiB, "
          f"{replay.metrics.get('gpu_free_gib', float('nan')):.1f} GiB free; o1 parked once and judged after it")
