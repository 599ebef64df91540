"""Every worker reply is validated (harness/replies.py), and no NaN or Inf reaches a verdict, a Done or the
ledger: hostile replies forged by a real worker's candidate, crafted replies fed to the trusted side's own
functions, records and ledgers holding NaN, and a slot answer that does not validate in a parallel run."""
from __future__ import annotations

import json
import math
import socket
import statistics
import textwrap
import threading
import time
from concurrent.futures import Future
from multiprocessing import Pipe

import pytest
import torch

import candidates as C
from conftest import RUNTIME_ONLY, config_with
from test_ledger import candidate, commit, new_ledger

from harness.evaluate import device_shapes
from harness.lease import Holding, Lease
from harness.executors import EvaluationLost
from harness.local_executor import LocalExecutor, _Entry
from harness.worker_handle import WorkerFailure
from harness.records import StageResult, Verdict
from harness.replies import MalformedReply, loads, parse
from harness.slot import Job
from harness.stages import clock_check as cc
from harness.stages import microbench as mb
from harness.stages.common import EvalContext, Rejected
from harness.targets import TARGETS
from harness.transport import DTYPES, ProtocolError, recv_json, send_json

from agent.ledger.repository import Ledger

# Allowlist opened for sys: these candidates reach into the worker itself, past the static check, to forge replies.
FORGING = {**RUNTIME_ONLY, "stages.compile.allowed_names": {**RUNTIME_ONLY["stages.compile.allowed_names"], "sys": ["*"]}}


def forging(edit: str) -> str:
    """The reference decode, plus a patch of the worker's reply writer: `edit` (statements on `reply`) changes
    each reply the worker sends from the moment the candidate is imported (its own load reply included)."""
    body = textwrap.indent(textwrap.dedent(edit).strip(), "    ")
    return (C.REF_DECODE + "\nimport sys\n_worker = sys.modules['harness.worker']\n_send = _worker.send_json\n\n"
            f"def _forge(sock, reply, *rest):\n{body}\n    _send(sock, reply, *rest)\n\n_worker.send_json = _forge\n")


# -- strict JSON -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ['{"t": NaN}', '{"t": Infinity}', '{"t": -Infinity}', '{"t": 1e999}', '{"t": [1, -1e400]}'])
def test_json_with_nan_infinity_or_an_overflowing_number_is_refused(text):
    with pytest.raises(MalformedReply, match="not strict JSON"):
        loads(text.encode())


def test_a_reply_with_nan_on_the_wire_is_a_protocol_error_not_a_number():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_json(theirs, {"ok": True, "synced_ms": {"candidate:0": [float("nan")]}})    # the worker's writer allows NaN
        with pytest.raises(ProtocolError, match="NaN is not a number JSON allows"):
            recv_json(ours, 1 << 20)


def test_a_reply_trickled_a_byte_at_a_time_is_cut_off_at_the_whole_replys_timeout_not_each_reads():
    ours, theirs = socket.socketpair()
    body = json.dumps({"ok": True, "pad": "x" * 40}).encode()
    data = len(body).to_bytes(4, "big") + body

    def trickle():
        for i in range(len(data)):             # a byte every 0.1 s: each read waits far less than its 0.5 s timeout
            try:
                theirs.send(data[i:i + 1])
            except OSError:
                return
            time.sleep(0.1)
    with ours, theirs:
        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        ours.settimeout(0.5)
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            recv_json(ours, 1 << 20)
        assert time.monotonic() - t0 < 1.0     # the whole reply's 0.5 s, where its 67 bytes would take 6.7 s


def test_outputs_not_asked_for_or_given_twice_are_refused_before_anything_is_read():
    from harness.transport import Arena, read_arena, write_arena
    expect = {"out0": ((2, 3), torch.float32)}
    for tensors, twice in (({"out0": torch.ones(2, 3), "extra": torch.ones(4096)}, False),
                           ({"out0": torch.ones(2, 3)}, True)):
        manifest, fd = write_arena(tensors)
        if twice:
            manifest = manifest + manifest
        with pytest.raises(ProtocolError, match="not asked for, or given twice"):
            read_arena(manifest, "cpu", [Arena(fd, 1 << 30)], expect=expect)
    manifest, fd = write_arena({"out0": torch.ones(2, 3)})
    assert torch.equal(read_arena(manifest, "cpu", [Arena(fd, 1 << 30)], expect=expect)["out0"], torch.ones(2, 3))


# -- schemas ----------------------------------------------------------------------------------------------

CALL = {"ok": True, "outputs": [], "launches": {"_k": 1}, "op_elements": {}, "op_calls": {}, "inputs_modified": [],
        "seconds": {"inputs_s": 0.1}}
TIME = {"ok": True, "synced_ms": {"candidate:0": [1.0]}, "streamed_ms": {"candidate:0": [0.9]}, "outputs": []}

WARM = {"ok": True, "launches": {"_k": 1}, "op_calls": {}, "failed": 0, "seconds": {"calls_s": 0.1}}


@pytest.mark.parametrize("kind, reply, words", [
    ("call", [CALL], "a JSON list, not an object"),
    ("call", {**CALL, "launches": [1, 2]}, "field launches: Input should be a valid dictionary"),
    ("call", {k: v for k, v in CALL.items() if k != "outputs"}, "field outputs: Field required"),
    ("call", {**CALL, "launches": {"_k": -1}}, "field launches._k: Input should be greater than or equal to 0"),
    ("call", {**CALL, "launches": {"_k": True}}, "field launches._k: Input should be a valid integer"),
    ("call", {**CALL, "launches": {"_k": "1"}}, "field launches._k: Input should be a valid integer"),
    ("call", {**CALL, "seconds": {"inputs_s": float("nan")}}, "field seconds.inputs_s: Input should be a finite number"),
    ("call", {**CALL, "inputs_modified": ["q"] * 17}, "field inputs_modified: List should have at most 16 items"),
    ("call", {**CALL, "extra": 1}, "field extra: Extra inputs are not permitted"),
    ("call", {**CALL, "ok": "yes"}, "field ok: Input should be True"),
    ("call", {**CALL, "outputs": [{"name": "out0"}]}, "field outputs.0.dtype: Field required"),
    ("time", {**TIME, "seconds": {"decode.speedup": 9.0}}, "field seconds.decode.speedup.[key]: String should match"),
    ("time", {**TIME, "synced_ms": {"candidate:0": [float("nan")]}}, "field synced_ms.candidate:0.0: Input should be a finite number"),
    ("time", {**TIME, "streamed_ms": {"candidate:0": [0.0]}}, "field streamed_ms.candidate:0.0: Input should be greater than 0"),
    ("time", {**TIME, "streamed_ms": {"candidate:0": [-0.5]}}, "field streamed_ms.candidate:0.0: Input should be greater than 0"),
    ("time", {**TIME, "streamed_ms": {"candidate:0": [1e12]}}, "field streamed_ms.candidate:0.0: Input should be less than or equal"),
    ("time", {**TIME, "streamed_ms": {"candidate:0": 0.9}}, "field streamed_ms.candidate:0: Input should be a valid list"),
    ("time", {**TIME, "kernels": [{"name": "_k", "registers": 1 << 17, "spills": 0, "shared_bytes": 0, "warps": 4}]},
     "field kernels.0.registers: Input should be less than or equal to 65536"),
    ("time", {**TIME, "kernels": [{"name": "_k", "registers": 96, "spills": 0, "shared_bytes": 0, "warps": 0}]},
     "field kernels.0.warps: Input should be greater than or equal to 1"),
    ("load", {"ok": True}, "field ops: Field required"),
    ("capture", {"ok": True}, "field graph: Field required"),
    ("profile", {"ok": True, "kernels": {"k": float("inf")}, "launches": {}}, "field kernels.k: Input should be a finite number"),
    ("warm", {**WARM, "failed": -1}, "field failed: Input should be greater than or equal to 0"),
    ("warm", {**WARM, "op_calls": {"mm": 1.5}}, "field op_calls.mm: Input should be a valid integer"),
    ("warm", {**WARM, "outputs": []}, "field outputs: Extra inputs are not permitted"),
])
def test_a_reply_of_the_wrong_shape_is_malformed_naming_the_field(kind, reply, words):
    with pytest.raises(MalformedReply) as err:
        parse(kind, reply)
    assert words in str(err.value), str(err.value)


def test_a_failing_reply_is_accepted_for_any_request_and_well_formed_ones_parse():
    assert parse("time", {"ok": False, "error": "boom", "fatal": True}).error == "boom"
    assert parse("call", CALL, wall_s=0.5).wall_s == 0.5
    assert parse("warm", WARM).failed == 0
    use = {"name": "_lean_kernel", "registers": 185, "spills": 0, "shared_bytes": 38912, "warps": 4}
    assert parse("time", {**TIME, "kernels": [use]}).kernels[0].registers == 185
    assert parse("call", {**CALL, "wall_s": 99.0}, wall_s=0.5).wall_s == 0.5       # the evaluator's clock, not the worker's
    assert parse("load", {"ok": False, "ops": [], "error": "defines none"}).ops == []


# -- hostile replies from a real worker, in a serial evaluation -------------------------------------------

@pytest.mark.parametrize("edit, words", [
    ('if "launches" in reply:\n    reply["launches"] = [1, 2]', "malformed reply while running decode served"),
    ('if "launches" in reply:\n    del reply["outputs"]', "field outputs: Field required"),
    ('if "seconds" in reply:\n    reply["seconds"]["inputs_s"] = float("nan")', "reply is not strict JSON: NaN"),
    ('if "ops" in reply:\n    reply["ops"] = {"decode": 1}', "field ops: Input should be a valid list"),
    ('if "launches" in reply:\n    reply["op_elements"] = {"mul": 1e300 * 1e10}', "reply is not strict JSON: Infinity"),
    ('if "launches" in reply:\n    reply["outputs"][0]["arena"] = 3', "wrong output"),
    ('if "launches" in reply:\n    reply["outputs"][0]["offset"] = 1 << 40', "wrong output"),
    ('if "launches" in reply:\n    reply["outputs"][0]["file"] = "/etc/passwd"', "field outputs.0.file: Extra inputs are not permitted"),
], ids=["list-for-dict", "missing-key", "nan-seconds", "dict-for-list", "inf-elements", "an-arena-that-never-came",
        "past-the-end", "a-path-named"])
def test_a_reply_forged_by_the_candidate_is_a_rejection_at_compile_naming_what_was_wrong(evaluate_source, edit, words):
    v = evaluate_source(forging(edit), config=config_with(**FORGING))
    assert not v.ok and v.failed_stage == "compile", v.reason
    assert words in v.stages[-1].reason and v.stages[-1].failure == "protocol", v.stages[-1].reason
    json.loads(v.model_dump_json(), parse_constant=lambda c: pytest.fail(f"{c} in the verdict"))


@pytest.mark.parametrize("times, words", [
    ("[0.0]", "field synced_ms.candidate:0.0: Input should be greater than 0"),
    ("[-1.0]", "field synced_ms.candidate:0.0: Input should be greater than 0"),
    ("[1e12]", "field synced_ms.candidate:0.0: Input should be less than or equal to"),
    ("[float('nan')]", "reply is not strict JSON: NaN is not a number JSON allows"),
    ("[float('inf')]", "reply is not strict JSON: Infinity is not a number JSON allows"),
], ids=["zero", "negative", "absurd", "nan", "inf"])
def test_a_timing_reply_forged_by_a_real_worker_s_candidate_is_refused_by_the_trusted_side(cfg, pool, times, words):
    """Microbench needs CUDA; its reply path does not. A real worker whose candidate rewrites its replies into a
    timing reply (zero, negative, absurd, NaN, Inf times), read by the evaluator's own collect as a timing reply."""
    device = torch.device("cpu")
    shapes = device_shapes(cfg, "attention", device)
    ctx = EvalContext(cfg=cfg, target=TARGETS["attention"], shapes=shapes, device=device, dtype=DTYPES[shapes.dtype],
                      pool=pool, source="", stage="microbench", deadline=time.monotonic() + 120)
    forged = forging(f'reply.clear()\nreply.update({{"ok": True, "synced_ms": {{"candidate:0": {times}}}, '
                     f'"streamed_ms": {{"candidate:0": [1.0]}}, "outputs": []}})')
    ctx.worker = pool.spawn(forged)
    try:
        ctx.send({"cmd": "load", "path": str(ctx.worker.workdir / "candidate.py")}, "importing")   # installs the forger
        with pytest.raises((Rejected, WorkerFailure)) as err:
            ctx.collect("timing decode served", "time")
    finally:
        ctx.worker.close()
    assert words in str(err.value), str(err.value)
    assert "microbench: malformed reply while timing decode served" in str(err.value) or isinstance(err.value, WorkerFailure)


# -- the microbench's guards: NaN never passes, even if it got past the schema ------------------------------

NAN = float("nan")
RATIO = config_with().stages.microbench.clock_check_ratio


@pytest.mark.parametrize("guard", [
    lambda: mb.check_stream("c", NAN, 1.0, 0.5), lambda: mb.check_stream("c", 1.0, NAN, 0.5),
    lambda: mb.check_floor("c", NAN, 0.01, "events"), lambda: mb.check_floor("c", 0.5, NAN, "events"),
    lambda: mb.check_floor("c", 0.001, 0.01, "events"),
    lambda: cc.check_clock("c", NAN, 1.0, RATIO), lambda: cc.check_clock("c", 1.0, NAN, RATIO),
    lambda: cc.check_clock("c", 0.75, 1.0, RATIO),
    lambda: mb.trusted_baseline("c", NAN, 1.0), lambda: mb.trusted_baseline("c", 1.0, NAN),
    lambda: mb.trusted_baseline("c", 1.0, 0.0),
], ids=["stream-cand", "stream-busy", "floor-cand", "floor-floor", "floor-under", "clock-cand", "clock-wall-c",
        "clock-lie", "trusted-there", "trusted-here", "trusted-zero"])
def test_every_microbench_guard_rejects_nan_and_what_it_guards_against(guard):
    with pytest.raises(Rejected):
        guard()


def test_honest_figures_pass_the_microbench_guards():
    mb.check_stream("c", 1.0, 1.2, 0.5)
    mb.check_floor("c", 0.5, 0.01, "events")
    cc.check_clock("c", 0.5177, 0.5048, RATIO)  # the TMA prefill at 1 x 8192 in the short rounds (H200, fifteenth session)
    cc.check_clock("c", 0.1082, 0.0991, RATIO)  # and at 4 x 512-2048: the clock faster (its inputs warm in the L2)
    cc.check_clock("c", 0.9, 1.0, RATIO)
    assert mb.trusted_baseline("c", 1.0, 1.1) == 1.0


def test_the_candidate_counts_at_the_slower_of_its_events_and_the_evaluators_clock():
    # c003 of the H200 run h200-accept (fifteenth session): 2.80x by the events, 2.01x by the clock
    assert 0.2723 / cc.counted_ms(0.0971, 0.2723, 0.1153, 0.2322) == pytest.approx(0.2322 / 0.1153)
    # the clock's bursts faster for the candidate than for the baseline (its inputs warm in the L2): the events count
    assert cc.counted_ms(0.0677, 0.2617, 0.0573, 0.2490) == 0.0677
    assert math.isnan(cc.counted_ms(0.0677, 0.2617, NAN, 0.2490))     # a NaN from the clock never counts as fast


@pytest.mark.parametrize("synced, streamed, words", [
    ({"candidate:0": [1.0]}, {"candidate:0": [1.0]}, "has keys ['candidate:0'], expected"),
    ({"candidate:0": [1.0, 1.0], "baseline:1": [1.0], "baseline:2": [1.0, 1.0]},
     {"candidate:0": [1.0, 1.0], "baseline:1": [1.0, 1.0], "baseline:2": [1.0, 1.0]}, "synced_ms.baseline:1 holds 1 times, expected 2"),
    ({"candidate:0": [1.0] * 2, "baseline:1": [1.0] * 2, "baseline:2": [1.0] * 2, "spare:9": [1.0] * 2},
     {"candidate:0": [1.0] * 2, "baseline:1": [1.0] * 2, "baseline:2": [1.0] * 2}, "has keys"),
], ids=["missing-baselines", "too-few-times", "unasked-key"])
def test_a_timing_reply_must_hold_exactly_what_was_asked(synced, streamed, words):
    reply = parse("time", {**TIME, "synced_ms": synced, "streamed_ms": streamed})
    with pytest.raises(Rejected, match="malformed reply while timing") as err:
        mb.timed_medians(reply, ["candidate", "baseline", "baseline"], 2, "decode served")
    assert words in str(err.value), str(err.value)


def test_a_timing_reply_holding_what_was_asked_gives_each_implementations_medians():
    reply = parse("time", {**TIME, "synced_ms": {k: [1.0, 2.0] for k in ("candidate:0", "baseline:1", "baseline:2")},
                           "streamed_ms": {k: [1.0, 3.0] for k in ("candidate:0", "baseline:1", "baseline:2")}})
    synced, streamed = mb.timed_medians(reply, ["candidate", "baseline", "baseline"], 2, "x")
    assert synced["candidate:0"] == 1.5 and streamed["baseline:2"] == 2.0


def _reps(set_times: list[list[float]]) -> list[float]:
    """Times as a timing reply holds them: rep by rep, within a rep one call per input set."""
    return [t for rep in zip(*set_times) for t in rep]


def test_two_input_sets_of_different_work_are_each_their_own_median_so_one_stall_moves_nothing():
    # the baseline's two arms at batch 4, 512..2048 tokens: one draw 0.10 ms a call, the other 0.15 ms (run h200-r24)
    light, heavy = [0.100 + 1e-4 * (i % 3) for i in range(30)], [0.150 + 1e-4 * (i % 5) for i in range(30)]
    stalled = [0.300] + light[1:]                        # one call of the second arm's light set met a host stall
    arm1, arm2 = _reps([light, heavy]), _reps([stalled, heavy])
    assert statistics.median(arm2) / statistics.median(arm1) > 1.15          # one value moves the median of them all
    assert mb.per_set_median(arm2, 2) == pytest.approx(mb.per_set_median(arm1, 2), rel=1e-3)
    assert mb.per_set_median(arm1, 2) == pytest.approx((statistics.median(light) + statistics.median(heavy)) / 2)
    reply = parse("time", {**TIME, "synced_ms": {"candidate:0": arm1, "baseline:1": arm1, "baseline:2": arm2},
                           "streamed_ms": {"candidate:0": arm1, "baseline:1": arm1, "baseline:2": arm2}})
    _, streamed = mb.timed_medians(reply, ["candidate", "baseline", "baseline"], 60, "x", sets=2)
    assert abs(streamed["baseline:1"] - streamed["baseline:2"]) / streamed["baseline:1"] < 1e-3      # the noise band


# -- records and the ledger -------------------------------------------------------------------------------

def test_a_non_finite_metric_is_dropped_and_named_never_written():
    s = StageResult.failed("replay", "not accepted", fallback_share=float("nan"), gain=float("inf"), noise=0.01)
    assert s.metrics == {"noise": 0.01}
    assert "fallback_share = nan" in s.reason and "gain = inf" in s.reason
    s.metrics["worker_s"] = float("nan")                    # added after construction, as evaluate() adds metrics
    v = Verdict.of([s])
    assert "worker_s" not in v.stages[0].metrics and "worker_s = nan" in v.reason
    text = v.model_dump_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(c))
    assert Verdict.model_validate_json(text) == v


def test_a_verdict_stored_with_a_null_metric_by_an_older_kevo_reads_back():
    stored = ('{"ok": false, "accepted": false, "failed_stage": "replay", "reason": "r", "stages": [{"name": "replay", '
              '"status": "failed", "reason": "r", "seconds": null, "metrics": {"fallback_share": null, "gain": 0.1}}]}')
    v = Verdict.model_validate_json(stored)
    assert v.stages[0].metrics == {"gain": 0.1} and v.stages[0].seconds == 0.0


def test_a_run_with_a_nan_metric_resumes_and_its_ledger_holds_no_nan(tmp_path):
    ledger = new_ledger(tmp_path / "run")
    r = candidate("c001", "rejected", "replay", None)
    r.rounds[0].verdict.stages[-1].metrics["fallback_share"] = float("nan")   # as replay records a server without stats
    commit(ledger, r)
    ledger.commit(f"summary", [], {"summary.json": json.dumps({"best": float("nan"), "n": [float("inf")]})}, {})
    again = Ledger(tmp_path / "run")
    assert [h.id for h in again.history()] == ["c001"]
    for rel in ("candidates/c001/record.json", "summary.json"):
        json.loads(again.committed(rel), parse_constant=lambda c: pytest.fail(f"{c} in {rel}"))
    assert again.summary() == {"best": None, "n": [None]}


# -- a parallel run: a slot answer that does not validate settles its future ---------------------------------

def test_a_slot_answer_that_does_not_validate_settles_the_job_s_future_instead_of_hanging():
    ours, theirs = Pipe()
    entry = _Entry(Job(id="c001", source="x"), Future(), None)
    bad = '{"id": "c001", "verdict": {"ok": true}, "slot": "cpu0", "started": 0, "ended": 1}'
    feeder = threading.Thread(target=lambda: (theirs.recv(), theirs.send(("done", bad))), daemon=True)
    feeder.start()
    holding = Holding(Lease("cpu:test"), "cpu0")
    executor = object.__new__(LocalExecutor)                 # no slot processes: only its reading of one job's answer
    executor.cfg, executor.slack_s = config_with(), None
    outcome = executor._run(ours, entry, holding, None)
    assert outcome == "check"
    with pytest.raises(EvaluationLost, match="c001: the slot's answer does not validate"):
        entry.future.result(timeout=5)


def test_a_done_with_a_nan_metric_crosses_the_slot_pipe_intact():
    """What made the run hang: a verdict with a NaN metric became null in the slot's JSON and failed to validate
    in the executor. Now the record keeps no NaN, so the Done round-trips."""
    from harness.slot import Done
    v = Verdict.of([StageResult.failed("replay", "r", fallback_share=math.nan)])
    done = Done(id="c001", verdict=v, slot="cpu0", started=0.0, ended=1.0)
    assert Done.model_validate_json(done.model_dump_json()) == done


# -- the served candidate's accounting, read by the replay stage --------------------------------------------

STATS = {"ops": {"decode": {"calls": 3, "candidate": 3, "unsupported": 0, "not_implemented": 0, "implemented": True,
                            "stalls": 0, "stall_ms": 0.0, "worst_stall_ms": 0.0}}, "steps": 5, "error": None}


@pytest.mark.parametrize("edit, words", [
    (lambda s: s["ops"].update(decode=[1]), "field ops.decode: Input should be a valid dictionary"),
    (lambda s: s["ops"]["decode"].update(stall_ms=float("nan")), "field ops.decode.stall_ms: Input should be a finite number"),
    (lambda s: s["ops"]["decode"].pop("calls"), "field ops.decode.calls: Field required"),
    (lambda s: s.pop("ops"), "field ops: Field required"),
], ids=["list-for-dict", "nan", "missing", "no-ops"])
def test_the_served_candidate_s_accounting_is_validated_like_any_reply(edit, words):
    stats = json.loads(json.dumps(STATS))
    assert parse("served_stats", stats).ops["decode"].calls == 3
    edit(stats)
    with pytest.raises(MalformedReply) as err:
        parse("served_stats", stats)
    assert words in str(err.value), str(err.value)
