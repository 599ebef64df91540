"""Each attack of tests/adversarial/, then a correct candidate in the same pool: the attack does what
it can only to itself, the next verdict passes, and the checkout's files are byte for byte the same.

The attacks are run by loading them straight into a worker (the compile stage's static check, which
would refuse most of them, is another layer: this proves the sandbox beneath it). A root-run test
also runs the sandbox as an ordinary user (uid 65534, in a user namespace)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import site
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import candidates as C
from conftest import ROOT, config_with, descendants, thread_states
from test_agent_unattended import SMALL
from harness.errors import HarnessError
from harness.evaluate import evaluate, open_pool
from harness.stages.common import EvalContext, Rejected, collect_trial, diff, draw, run_trial, send_trial
from harness.targets import TARGETS
from harness.transport import DTYPES

ADVERSARIAL = Path(__file__).resolve().parent / "adversarial"
SHM, FOLDER = 32 << 20, 64 << 20


@pytest.fixture(scope="module")
def cfg():
    return config_with(**{"worker.shm_bytes": SHM, "worker.folder_bytes": FOLDER})


@pytest.fixture(scope="module")
def small_cfg():
    """The pool's config on the small parity plan (SMALL), for the correct candidate judged after each attack:
    what it proves is that the pool still judges correctly, not parity's plan again."""
    return config_with(**{"worker.shm_bytes": SHM, "worker.folder_bytes": FOLDER}, **SMALL)


@pytest.fixture(scope="module")
def pool(cfg):
    p = open_pool(cfg, "attention")
    yield p
    p.close()


def checkout() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return {n.decode(): hashlib.sha256((ROOT / n.decode()).read_bytes()).hexdigest()
            for n in names if n and (ROOT / n.decode()).is_file()}


def attack(pool, name: str, **fill) -> dict:
    """Run tests/adversarial/NAME.py in a fresh worker of `pool`; return what it reported."""
    source = (ADVERSARIAL / f"{name}.py").read_text()
    for key, value in fill.items():
        source = source.replace(f"@{key}@", str(value))
    handle = pool.spawn(source)
    try:
        reply = handle.request({"cmd": "load", "path": str(handle.workdir / "candidate.py")}, 180, "running the attack")
    finally:
        handle.close()
    error = str(reply.get("error", ""))
    assert "REPORT " in error, error
    return json.loads(error.rsplit("REPORT ", 1)[1].strip().splitlines()[0])


@pytest.fixture
def then_a_correct_candidate_passes(small_cfg, pool):
    """Snapshot the checkout; after the test, a correct kernel in the same pool must pass and the
    checkout must be unchanged."""
    before = checkout()
    yield
    v = evaluate(C.REF_DECODE, "attention", small_cfg, pool, until="parity")
    assert v.ok, v.reason
    assert checkout() == before


@pytest.fixture
def project_copy(tmp_path):
    copy = tmp_path / "project"
    shutil.copytree(ROOT / "harness", copy / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_name_planted_for_the_next_worker_reaches_nothing_outside_the_attacker(
        kind, pool, project_copy, then_a_correct_candidate_passes):
    target = project_copy / "harness" / "__init__.py"
    before = tree(project_copy)
    seen = attack(pool, f"plant_{kind}", TARGET=target)
    assert set(seen["planted"]) <= {"/kevo", "/tmp", "/dev/shm"}, seen     # no other worker's folder to find
    assert not seen.get("target_written"), seen
    assert tree(project_copy) == before


def test_filling_dev_shm_and_the_folder_fails_only_the_attacker(pool, then_a_correct_candidate_passes):
    seen = attack(pool, "fill_shm", LIMIT=4 * FOLDER)
    for place, limit in (("/dev/shm", SHM), ("/kevo", FOLDER)):
        assert seen[place]["error"] and seen[place]["written"] <= limit, seen


def test_a_secret_file_in_the_evaluators_home_is_not_there_to_read(pool, then_a_correct_candidate_passes):
    home = Path(os.path.expanduser("~"))
    secret = home / f".kevo-test-secret-{secrets.token_hex(4)}"
    token = "kevo-secret-" + secrets.token_hex(16)
    secret.write_text(token)
    try:
        handle = pool.spawn((ADVERSARIAL / "read_secret.py").read_text().replace("@SECRET@", str(secret)))
        try:
            reply = handle.request({"cmd": "load", "path": str(handle.workdir / "candidate.py")}, 60, "reading")
        finally:
            handle.close()
    finally:
        secret.unlink()
    assert token not in json.dumps(reply) and "No such file or directory" in reply["error"], reply["error"][-500:]


def test_no_device_node_can_be_made(pool, then_a_correct_candidate_passes):
    seen = attack(pool, "mknod")
    assert seen and all(v == "Operation not permitted" for v in seen.values()), seen


def test_no_clock_can_be_set_or_slewed(pool, then_a_correct_candidate_passes):
    seen = attack(pool, "set_clock")
    eperm = 1
    assert seen == {"clock_settime": eperm, "settimeofday": eperm, "adjtimex_read": eperm, "adjtimex_tick": eperm,
                    "clock_adjtime_tick": eperm}, seen


def test_no_socket_reaches_outside_but_a_unix_socket_inside(pool, tmp_path, then_a_correct_candidate_passes):
    tcp = socket.create_server(("127.0.0.1", 0))
    port = tcp.getsockname()[1]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", port))
    path, abstract = str(tmp_path / "outside.sock"), f"kevo-test-{secrets.token_hex(4)}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    hidden = socket.socket(socket.AF_UNIX)
    hidden.bind("\0" + abstract)
    listeners = [tcp, udp, unix, hidden]
    for s in (unix, hidden):
        s.listen()
    for s in listeners:
        s.setblocking(False)
    try:
        seen = attack(pool, "sockets", PORT=port, UNIX_PATH=path, ABSTRACT=abstract)
        for name in ("udp", "tcp", "raw", "ipv6", "netlink", "packet"):
            assert seen[name] == "Operation not permitted", seen
        assert seen["unix_path"] == "No such file or directory" and seen["unix_abstract"] == "Connection refused", seen
        for s in listeners:
            with pytest.raises(BlockingIOError):
                s.recv(16) if s is udp else s.accept()
    finally:
        for s in listeners:
            s.close()


def test_only_the_workers_own_device_nodes_are_there(pool, then_a_correct_candidate_passes):
    """On a CPU: no GPU node at all, and nothing of the host's /dev but the five harmless ones
    (a GPU machine is checked by tests/bench/sandbox_probe.py)."""
    seen = attack(pool, "other_gpu")
    nodes = {"null", "zero", "full", "random", "urandom"}
    assert set(seen["dev"]) == nodes | {"shm", "fd", "stdin", "stdout", "stderr"}, seen["dev"]
    assert seen["opened"] == [], seen
    assert all(v == "No such file or directory" for v in seen["refused"].values()), seen


def test_a_child_without_cuda_visible_devices_sees_no_more_than_its_parent(pool, then_a_correct_candidate_passes):
    seen = attack(pool, "child_without_cuda_visible")
    assert seen["returncode"] == 0, seen
    assert seen["nvidia"] == [] and seen["cuda_devices"] == 0, seen


def test_a_child_the_candidate_starts_cannot_leave_the_workers_group_and_is_stopped_when_the_worker_is_held(
        pool, then_a_correct_candidate_passes):
    handle = pool.spawn((ADVERSARIAL / "leave_group.py").read_text())
    try:
        reply = handle.request({"cmd": "load", "path": str(handle.workdir / "candidate.py")}, 60, "running the attack")
        seen = json.loads(str(reply["error"]).rsplit("REPORT ", 1)[1].strip().splitlines()[0])
        assert seen == {"setsid": "Operation not permitted", "setpgid": "Operation not permitted",
                        "same_group": True}, seen
        procs = descendants(handle.pid)
        assert len(procs) >= 3, procs                       # the shim, the worker, the child spinning
        assert "R" in set().union(*map(thread_states, procs))
        assert handle.held_still(2.0)
        assert all(thread_states(p) <= {"T", "t"} for p in procs), {p: thread_states(p) for p in procs}
        handle.hold_still(False)
    finally:
        handle.close()


@contextlib.contextmanager
def loaded(cfg, pool, source: str):
    """`source` loaded straight into a fresh worker of `pool` (past the allowlist, which refuses what these attacks
    name: another layer), and one decode check drawn for it: the context and the trial; the worker closed after."""
    shapes = getattr(cfg.targets.attention, "cpu")
    ctx = EvalContext(cfg=cfg, target=TARGETS["attention"], shapes=shapes, device=torch.device("cpu"),
                      dtype=DTYPES[shapes.dtype], pool=pool, source="")
    ctx.deadline = time.monotonic() + 120
    ctx.worker = pool.spawn(source)
    try:
        assert ctx.request({"cmd": "load", "path": str(ctx.worker.workdir / "candidate.py")}, "loading", "load")["ok"]
        yield ctx, draw(ctx, ctx.target.compile_case(ctx.shapes, "decode"), "normal")
    finally:
        ctx.worker.close()


def test_an_output_file_the_worker_can_still_change_is_refused(cfg, pool, then_a_correct_candidate_passes):
    with loaded(cfg, pool, (ADVERSARIAL / "unsealed_output.py").read_text()) as (ctx, trial):
        with pytest.raises(Rejected, match="not sealed"):
            run_trial(ctx, trial)


def test_an_output_whose_methods_give_the_right_answer_is_read_by_its_memory(cfg, pool, then_a_correct_candidate_passes):
    source = (ADVERSARIAL / "forged_output_methods.py").read_text().replace("@MODE@", "instance")
    with loaded(cfg, pool, source) as (ctx, trial):
        outs, _ = run_trial(ctx, trial)
        assert float(outs[0].abs().max()) == 0.0                # the zeros it wrote, not the answer its methods give
        assert not trial.tol.admits(diff(outs[0], trial.ref))


def test_an_output_of_a_tensor_subclass_is_refused_naming_it(cfg, pool, then_a_correct_candidate_passes):
    source = (ADVERSARIAL / "forged_output_methods.py").read_text().replace("@MODE@", "subclass")
    with loaded(cfg, pool, source) as (ctx, trial):
        with pytest.raises(Rejected, match="returned a Forged \\(a torch.Tensor subclass\\)"):
            run_trial(ctx, trial)


def test_a_write_to_an_input_is_seen_whatever_methods_the_candidate_gave_that_input(cfg, pool,
                                                                                    then_a_correct_candidate_passes):
    with loaded(cfg, pool, (ADVERSARIAL / "hidden_input_write.py").read_text()) as (ctx, trial):
        _, reply = run_trial(ctx, trial)
        assert reply.get("inputs_modified") == ["k_cache"], reply.get("inputs_modified")


def test_each_call_of_a_repeat_check_is_read_as_it_was_and_a_kept_output_as_its_memory_is_later(
        cfg, pool, then_a_correct_candidate_passes):
    """The calls of a repeat check are read as each returned them (one buffer written 1, then 2); the output kept
    for a recheck is the memory the candidate returned, read again after a later call (written 3): a recheck of a
    copy could never see it change (decode and prefill returning views of one buffer)."""
    with loaded(cfg, pool, (ADVERSARIAL / "same_buffer_repeats.py").read_text()) as (ctx, trial):
        shape = tuple(ctx.target.ops["decode"].output_shape(trial.inputs))
        send_trial(ctx, trial, repeat=2, keep=0)
        outs, _ = collect_trial(ctx, trial, repeat=2)
        assert float(outs[0].max()) == 1.0 and float(outs[1].max()) == 2.0
        send_trial(ctx, trial, recheck=[0])
        outs, _ = collect_trial(ctx, trial, also={"kept0": shape})
        assert float(outs[0].max()) == 3.0 and float(outs[1].max()) == 3.0      # this call's, and the kept one now


def _as_nobody(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *argv], **kw)


def _interpreter_for_nobody() -> str | None:
    """This interpreter if uid 65534 may run it; else the system's of the same version (the venv's
    packages then come through PYTHONPATH): here the venv's base lives in /root, closed to others."""
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        again = f"import os; os.execv({exe!r}, [{exe!r}, '-c', 'pass'])"        # as the pool will start it
        if os.path.exists(exe) and _as_nobody(exe, "-c", again, capture_output=True).returncode == 0:
            return exe
    return None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not _interpreter_for_nobody(),
                    reason="needs root, setpriv and an interpreter uid 65534 may run, to become an ordinary user")
def test_the_sandbox_holds_for_an_ordinary_user():
    """The same attacks, the sandbox made in a user namespace by uid 65534 (as when kevo is not run as root)."""
    exe = _interpreter_for_nobody()
    tmp_path = Path(tempfile.mkdtemp(prefix="kevo-as-user-"))
    script = tmp_path / "as_user.py"
    script.write_text(f"""
import json, sys
sys.executable = {exe!r}
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
from conftest import config_with
from harness.errors import HarnessError
from harness.evaluate import evaluate, open_pool
import candidates as C
import test_sandbox_attacks as T
cfg = config_with(**{{"worker.shm_bytes": T.SHM, "worker.folder_bytes": T.FOLDER}})
pool = open_pool(cfg, "attention")
try:
    out = {{"mknod": T.attack(pool, "mknod"), "clock": T.attack(pool, "set_clock"),
           "gpu": T.attack(pool, "other_gpu"), "fill": T.attack(pool, "fill_shm", LIMIT=4 * T.FOLDER)}}
    h = pool.spawn("x = 1\\n")
    out["sandbox"] = h.sandbox
    h.close()
    v = evaluate(C.REF_DECODE, "attention", cfg, pool, until="parity")
    out["next"] = [v.ok, v.reason]
finally:
    pool.close()
print("RESULT " + json.dumps(out))
""")
    os.chmod(tmp_path, 0o755)
    os.chmod(script, 0o644)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG")} | {"HOME": str(tmp_path), "TMPDIR": "/tmp",
                                                                          "PYTHONPATH": ":".join(site.getsitepackages())}
    try:
        done = _as_nobody(exe, str(script), env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    assert "RESULT " in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.rsplit("RESULT ", 1)[1])
    assert "uid 65534, no capabilities" in out["sandbox"] and "seccomp" in out["sandbox"], out["sandbox"]
    assert all(v == "Operation not permitted" for v in out["mknod"].values()), out
    assert set(out["clock"].values()) == {1}, out
    assert out["gpu"]["opened"] == [] and "vda" not in out["gpu"]["dev"], out
    assert out["fill"]["/dev/shm"]["written"] <= SHM and out["fill"]["/kevo"]["written"] <= FOLDER, out
    assert out["next"][0], out["next"]


def test_a_layer_the_kernel_refuses_stops_a_required_sandbox_in_one_line_and_is_named_when_best_effort():
    """More open files than the kernel allows any process (fs.nr_open): the rlimit cannot be applied."""
    too_many = 1 << 31
    strict = config_with(**{"worker.open_files": too_many})
    pool = open_pool(strict, "attention")
    try:
        with pytest.raises(HarnessError) as refused:
            pool.spawn("x = 1\n")
    finally:
        pool.close()
    message = str(refused.value)
    assert "\n" not in message and "rlimits" in message and "NOFILE" in message and "best_effort" in message, message
    lenient = config_with(**{"worker.open_files": too_many, "worker.sandbox": "best_effort"})
    pool = open_pool(lenient, "attention")
    try:
        v = evaluate(C.REF_DECODE, "attention", lenient, pool, until="compile")
    finally:
        pool.close()
    assert v.ok and "no rlimits" in v.stages[0].reason and "seccomp" in v.stages[0].reason, v.stages[0].reason
