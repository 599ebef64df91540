"""Nothing the candidate's process can reach decides its verdict, holds a secret, or changes the
project: one adversarial candidate per property, each checked from outside the sandbox."""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, runtime_only, runtime_only_yaml


@pytest.fixture
def evaluate_source(evaluate_source):
    """These probe the sandbox, the layer behind the compile stage's allowlist (which refuses their
    __import__, os and socket at once): evaluated with the allowlist opened (conftest.RUNTIME_ONLY)."""
    return lambda source, **kw: evaluate_source(source, **{"config": runtime_only(), **kw})

# Each probe reports what it saw by raising at import: the text comes back as compile feedback.
REPORT = """
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return q
raise RuntimeError("REPORT " + repr(seen))
"""


def probe(body: str) -> str:
    return textwrap.dedent(body) + REPORT


def test_no_secret_reaches_the_candidate_or_the_verdict(tmp_path):
    secret = "sk-kevo-" + secrets.token_hex(16)
    leak = tmp_path / "leak.py"
    leak.write_text(probe("""
        os = __import__("os")
        found = [f"{k}={v}" for k, v in os.environ.items()]
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        for p in pids:
            try:
                found.append(open(f"/proc/{p}/environ", "rb").read().decode(errors="replace"))
            except OSError:
                pass
        blob = " ".join(found)
        seen = {"pids": pids, "reversed": blob[::-1], "spaced": " ".join(blob)}   # dodges plain redaction
    """))
    env = dict(os.environ, OPENAI_API_KEY=secret, ANTHROPIC_API_KEY=secret, KEVO_SERVICE_TOKEN=secret)
    config = runtime_only_yaml(tmp_path / "config.yaml")
    done = subprocess.run([sys.executable, "-m", "agent.cli", "--config", str(config), "evaluate", "--json", str(leak)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    verdict = json.loads(done.stdout)
    reason = verdict["stages"][0]["reason"]
    assert verdict["failed_stage"] == "compile" and "REPORT" in reason, reason
    for form in (secret, secret[::-1], " ".join(secret), " ".join(secret[::-1])):
        assert form not in done.stdout + done.stderr
    assert "'pids': [1]" in reason                 # a private PID namespace: nothing else to read


def test_candidate_cannot_write_project_files_or_a_run_ledger(evaluate_source):
    ledger = ROOT / "runs" / f"test-ledger-{secrets.token_hex(4)}"
    ledger.mkdir(parents=True)
    (ledger / "HEAD").write_text("ref: refs/heads/main\n")
    config_hash = hashlib.sha256((ROOT / "config.yaml").read_bytes()).hexdigest()
    targets = [ROOT / "config.yaml", ROOT / "kevo-pwned.txt", ledger / "HEAD", ledger / "forged-commit"]
    try:
        v = evaluate_source(probe(f"""
            seen = {{}}
            for path in {[str(t) for t in targets]!r}:
                try:
                    with open(path, "a") as f:
                        f.write("pwned")
                    seen[path] = "written"
                except OSError as e:
                    seen[path] = type(e).__name__
        """))
        assert "REPORT" in v.stages[0].reason
        assert hashlib.sha256((ROOT / "config.yaml").read_bytes()).hexdigest() == config_hash
        assert not (ROOT / "kevo-pwned.txt").exists()
        assert (ledger / "HEAD").read_text() == "ref: refs/heads/main\n"
        assert not (ledger / "forged-commit").exists()
    finally:
        (ROOT / "kevo-pwned.txt").unlink(missing_ok=True)
        for f in ledger.iterdir():
            f.unlink()
        ledger.rmdir()


def test_candidate_cannot_open_network_connections(evaluate_source):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    v = evaluate_source(probe(f"""
        socket = __import__("socket")
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2).send(b"hello")
            seen = "connected"
        except OSError as e:
            seen = type(e).__name__
    """))
    assert "REPORT" in v.stages[0].reason
    try:
        listener.accept()
        raise AssertionError("the candidate reached a TCP port on loopback")
    except BlockingIOError:
        pass
    finally:
        listener.close()


def test_candidate_cannot_signal_the_evaluator(evaluate_source):
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    try:
        v = evaluate_source(probe(f"""
            os = __import__("os")
            try:
                os.kill({os.getpid()}, 10)
                seen = "sent"
            except OSError as e:
                seen = type(e).__name__
        """))
        assert "REPORT" in v.stages[0].reason
        assert not received
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_each_candidate_gets_a_fresh_private_folder(evaluate_source):
    body = probe("""
        os, tempfile = __import__("os"), __import__("tempfile")
        seen = {"cwd": os.getcwd(), "tmp": tempfile.gettempdir(), "home": os.environ.get("HOME"),
                "left": sorted(os.listdir("."))}
        open("left-by-the-last-one", "w").close()
    """)
    first, second = (evaluate_source(body).stages[0].reason for _ in range(2))
    for r in (first, second):
        assert "'cwd': '/kevo'" in r and "'tmp': '/kevo/tmp'" in r and "'home': '/kevo'" in r, r
        assert "left-by-the-last-one" not in r


def test_a_worker_gets_the_node_of_the_gpu_cuda_visible_devices_names_first(tmp_path, monkeypatch):
    """Which /dev/nvidiaN a sandbox exposes, read from the driver's /proc/driver/nvidia/gpus (faked
    here: three GPUs whose minors are not in bus order); CUDA counts identical GPUs in PCI order."""
    from harness.isolation import gpu_nodes
    from harness.sandbox import SandboxError
    for bus, minor, uuid in (("0000:19:00.0", 2, "GPU-aaaa"), ("0000:3b:00.0", 0, "GPU-bbbb"), ("0000:4c:00.0", 1, "GPU-cccc")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(f"Model: \t NVIDIA H200\nGPU UUID: \t {uuid}\n"
                                                     f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\n")
    for visible, node, uuid in (("1", "nvidia0", "GPU-bbbb"), ("2,0", "nvidia1", "GPU-cccc"), ("GPU-aa", "nvidia2", "GPU-aaaa")):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        nodes, got = gpu_nodes("cuda", tmp_path)
        assert nodes[-1] == node and got == uuid and all(not n[6:].isdigit() for n in nodes[:-1]), (visible, nodes)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_nodes("cuda", tmp_path)[0][-1] == "nvidia2"          # unset: CUDA's device 0, the first by bus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-zzzz")
    with pytest.raises(SandboxError, match="names none"):
        gpu_nodes("cuda", tmp_path)
    assert gpu_nodes("cpu", tmp_path) == ([], "")
