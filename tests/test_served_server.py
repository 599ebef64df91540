"""The served process end to end on the CPU (tiny preset): the real openai SDK against the real HTTP
server, tokens timed on the client's clock; a request with kevo_forced gets the forced tokens; bad
requests are 400s naming the problem; the server is sandboxed like the workers; a server killed
mid-replay is a clear failure. What the trusted side tells the server (embedded_spec): a weight seed
of the replay's own, a shape sweep in the warm-up for a candidate only, and that warm-up's compile-only sweep when
configured."""
from __future__ import annotations

import http.server
import math
import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import openai
import pytest
import torch

import candidates as C
from conftest import config_with
from harness.errors import HarnessError
from harness.served.accounting import startup
from harness.served.client import replay
from harness.served.launch import ServerFailure, ServerHandle, embedded_spec, start_server, wait_ready
from harness.served.model import build_model
from harness.served.score import summarize
from harness.served.traces import TraceRequest
from harness.stages.arms import explain
from harness.stages.replay import served_requests

CFG = config_with()


@pytest.fixture(scope="module")
def server():
    with start_server(CFG, "cpu", None) as s:
        yield s


def test_tiny_preset_serves_a_trace_end_to_end_through_the_openai_sdk(server):
    requests = served_requests(CFG, "cpu")
    run = replay(server.url, server.model, requests, request_timeout_s=60, drain_timeout_s=60, logprobs=CFG.served.logprobs)
    assert run.failures() == [], run.describe_failures()
    for r, c in zip(requests, run.completions):
        assert len(c.tokens) == r.output_len and all(t.startswith("token_id:") for t in c.tokens)
        assert c.sent_s >= r.arrival_s and c.ttft > 0 and c.token_times == sorted(c.token_times)
        assert all(len(top) == CFG.served.logprobs and top[0][0] == tok and top[0][1] == lp >= top[1][1]
                   for top, tok, lp in zip(c.top, c.tokens, c.logprobs))
    s = summarize(run)
    assert s["requests"] == len(requests) and s["tokens"] == sum(r.output_len for r in requests)
    assert all(math.isfinite(s[k]) and s[k] > 0 for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p90_ms", "throughput_tok_s"))
    stats = server.stats()
    assert stats["tokens"] == s["tokens"] and stats["ops"]["decode"]["not_implemented"] > 0 and stats["error"] == ""
    assert stats["graphs"]["on"] is False and "CUDA graphs need a GPU" in stats["graphs"]["reason"]   # said, on a CPU


def test_the_same_request_gets_the_same_tokens_streamed_or_not(server):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    whole = client.completions.create(model=server.model, prompt=[5, 9, 2, 7], max_tokens=6, temperature=0, logprobs=2)
    parts = [c.choices[0].logprobs.tokens[0] for c in client.completions.create(
        model=server.model, prompt=[5, 9, 2, 7], max_tokens=6, temperature=0, logprobs=2, stream=True)]
    assert whole.choices[0].logprobs.tokens == parts and len(parts) == 6
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"


def test_a_forced_streamed_request_gets_the_forced_tokens_scored_by_the_model(server):
    prompt = [5, 9, 2, 7]
    own = replay(server.url, server.model, [TraceRequest(0, 0.0, prompt, 6)], 60, 60).completions[0]
    ids = [int(t.removeprefix("token_id:")) for t in own.tokens]
    other = tuple((7 * t + 3) % 512 for t in ids)
    again, forced = replay(server.url, server.model, [TraceRequest(0, 0.0, prompt, 6, tuple(ids)),
                                                      TraceRequest(1, 0.0, prompt, 6, other)], 60, 60).completions
    assert own.complete and again.complete and forced.complete, (own.error, again.error, forced.error)
    assert again.tokens == own.tokens                                      # its own tokens forced: as a free run
    assert max(abs(a - b) for a, b in zip(again.logprobs, own.logprobs)) < 1e-4   # (batched with the other: not bitwise)
    assert forced.tokens == [f"token_id:{t}" for t in other]
    assert forced.top[0][0][0] == own.tokens[0] and forced.logprobs[0] < forced.top[0][0][1]   # same prompt: its own choice on top
    assert all(lp <= top[0][1] for lp, top in zip(forced.logprobs, forced.top))


def test_a_scored_request_gets_in_one_response_what_forcing_its_tokens_one_a_step_gets(server):
    prompt = [4, 8, 15, 16, 23]
    cont = tuple((11 * j + 5) % 512 for j in range(7))
    forced, scored = replay(server.url, server.model, [TraceRequest(0, 0.0, prompt, 7, cont),
                                                       TraceRequest(1, 0.0, prompt, 7, cont, scored=True)], 60, 60).completions
    assert forced.complete and scored.complete, (forced.error, scored.error)
    assert scored.tokens == forced.tokens == [f"token_id:{t}" for t in cont]
    assert max(abs(a - b) for a, b in zip(scored.logprobs, forced.logprobs)) < 1e-4
    assert [t[0][0] for t in scored.top] == [t[0][0] for t in forced.top]
    before = server.stats()["ops"]
    alone = replay(server.url, server.model, [TraceRequest(2, 0.0, prompt, 7, cont, scored=True)], 60, 60).completions[0]
    after = server.stats()["ops"]
    assert alone.tokens == scored.tokens and after["prefill"]["calls"] > before["prefill"]["calls"]
    assert after["decode"]["calls"] == before["decode"]["calls"]              # scored in its prefill: no decode step


def test_the_client_asks_for_as_many_top_logprobs_as_it_is_given(server):
    one = replay(server.url, server.model, [TraceRequest(0, 0.0, [3, 1, 4], 3)], 60, 60, logprobs=1).completions[0]
    assert one.error == "" and len(one.tokens) == 3 and all(len(top) == 1 for top in one.top)


@pytest.mark.parametrize("kwargs, words", [
    ({"prompt": "hello"}, "list of token ids"),
    ({"prompt": [1, 2], "temperature": 0.7}, "only greedy decoding (temperature 0)"),
    ({"prompt": [1, 2], "logprobs": CFG.served.logprobs + 1}, f"logprobs must be an integer in 0..{CFG.served.logprobs}"),
    ({"prompt": [1, 512]}, "prompt token ids must be in [0, 512)"),
    ({"prompt": [1] * 4000, "max_tokens": 200}, "needs 4200 tokens of KV cache; this model holds 4096"),
    ({"prompt": [1, 2], "extra_body": {"kevo_forced": [1, 2, 3]}}, "forced tokens must be one per generated token: 3 given, max_tokens is 4"),
    ({"prompt": [1, 2], "extra_body": {"kevo_forced": [1, 2, 512, 3]}}, "forced token ids must be in [0, 512)"),
    ({"prompt": [1, 2], "extra_body": {"kevo_forced": "1 2 3 4"}}, "kevo_forced must be a list of token ids"),
    ({"prompt": [1, 2], "extra_body": {"kevo_forced": [1, 2.0, 3, 4]}}, "kevo_forced must be a list of token ids"),
    ({"prompt": [1, 2], "extra_body": {"kevo_group": {"id": "g", "size": 2, "position": 2}}}, "kevo_group must be"),
    ({"prompt": [1, 2], "extra_body": {"kevo_group": {"id": "g", "size": 2}}}, "kevo_group must be"),
    ({"prompt": [1, 2], "extra_body": {"kevo_score": True}}, "kevo_score needs kevo_forced"),
    ({"prompt": [1, 2], "extra_body": {"kevo_forced": [1, 2, 3, 4], "kevo_score": "yes"}}, "kevo_score must be true or false"),
], ids=["text-prompt", "temperature", "too-many-logprobs", "token-outside-vocab", "too-long", "forced-wrong-length",
        "forced-outside-vocab", "forced-not-a-list", "forced-not-ids", "group-position-outside", "group-no-position",
        "score-without-forced", "score-not-a-bool"])
def test_bad_request_is_a_400_naming_the_problem(server, kwargs, words):
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=server.model, **{"max_tokens": 4, **kwargs})
    assert words in str(err.value)


def test_the_server_reports_how_long_each_part_of_its_start_took_and_the_replay_reads_it_as_metrics(server):
    stats = server.stats()
    parts = stats["startup_s"]
    assert list(parts) == ["carry", "load", "build", "warm_fixed", "warm_capture"]     # no served lengths on a CPU's server
    assert all(s >= 0.0 for s in parts.values()) and 0.0 < parts["warm_fixed"] < sum(parts.values()) < server.ready_s
    assert startup(stats, "head") == {f"head_start_{p}_s": s for p, s in parts.items()}
    hostile = {"startup_s": {"warm_fixed": "1", "x" * 40: 1.0, "a b": 2.0, "build": 3, **{f"p{i}": 0.5 for i in range(9)}}}
    assert startup(hostile) == {"candidate_start_build_s": 3.0, **{f"candidate_start_p{i}_s": 0.5 for i in range(8)}}


def test_a_group_is_held_until_all_its_members_came_in_then_admitted_in_their_positions(server):
    """Position 1 is sent first and waits for position 0; the two prompts do not fit one prefill step
    (max_prefill_tokens 512), so the engine admits position 0 first, as it would had they come in order. The
    order is read from the engine steps that made the first tokens (`kevo_step`): the client's receive times
    once saw them 1.4 ms the wrong way round, its threads' scheduling, not the engine's order."""
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    seen: dict[int, dict] = {}

    def send(position: int) -> None:
        seen[position] = {"sent": time.perf_counter()}
        stream = client.completions.create(model=server.model, prompt=[(3 * position + j) % 512 for j in range(300)],
                                           max_tokens=3, temperature=0, stream=True,
                                           extra_body={"kevo_group": {"id": "held-pair", "size": 2, "position": position}})
        chunks = [(time.perf_counter(), chunk.model_extra["kevo_step"]) for chunk in stream]
        seen[position]["tokens"], seen[position]["steps"] = [t for t, _ in chunks], [k for _, k in chunks]

    first = threading.Thread(target=send, args=(1,))
    first.start()
    time.sleep(0.5)
    send(0)
    first.join(timeout=60)
    assert len(seen[0]["tokens"]) == len(seen[1]["tokens"]) == 3
    assert seen[1]["tokens"][0] > seen[0]["sent"]            # held: nothing of it ran before its group was complete
    assert seen[0]["steps"][0] < seen[1]["steps"][0]         # then admitted in position order, not in arrival order


PROBE = """
import errno, os, socket
seen = {"secret": any("kevo-secret" in v for v in os.environ.values()), "home": os.environ.get("HOME", "")}
for what, call in (("bind", lambda s: s.bind(("127.0.0.1", 0))), ("connect", lambda s: s.connect(("127.0.0.1", __PORT__)))):
    try:
        call(socket.socket())
        seen[what] = "allowed"
    except PermissionError:
        seen[what] = "denied"
    except OSError as e:
        seen[what] = f"other error {e}"
try:
    open("/tmp/kevo-served-escape.txt", "w").write("x")
    seen["write"] = "allowed"
except OSError as e:                   # Landlock's EACCES, or EROFS where /tmp is bound read-only (a project under /tmp)
    seen["write"] = "denied" if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else f"other error {e}"
raise RuntimeError("REPORT " + repr(seen))
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return q
"""


def test_candidate_in_the_server_sees_no_secret_and_cannot_bind_connect_or_write_outside(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-kevo-secret-0123456789")
    port = int(server.url.split(":")[-1].split("/")[0])
    with pytest.raises(ServerFailure) as err:
        start_server(CFG, "cpu", PROBE.replace("__PORT__", str(port)))
    report = str(err.value)
    assert "before it was ready" in report and "REPORT" in report, report
    assert "'secret': False" in report and "'bind': 'denied'" in report and "'connect': 'denied'" in report
    assert "'write': 'denied'" in report and not os.path.exists("/tmp/kevo-served-escape.txt")
    assert "Landlock" in server.stats()["sandbox"]


def test_server_killed_mid_replay_gives_a_clear_failure():
    requests = [TraceRequest(i, 0.2 * i, [3 + i] * 8, 400) for i in range(4)]
    result = {}
    with start_server(CFG, "cpu", None) as doomed:
        worker = threading.Thread(target=lambda: result.update(run=replay(doomed.url, doomed.model, requests, 60, 60)))
        worker.start()
        for _ in range(2400):                                      # wait until it is serving tokens
            if (doomed.stats() or {}).get("tokens") or not doomed.alive():
                break
            time.sleep(0.05)
        assert doomed.alive() and doomed.stats()["tokens"] > 0
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        worker.join(timeout=120)
        reason = explain(result["run"], doomed)
    assert "the server killed by signal 9 (SIGKILL) during the replay" in reason, reason
    assert "4 of 4 requests did not complete; first: request 1:" in reason


class _TricklesItsHeaders(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        try:
            self.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
            for _ in range(200):                       # 10 s of one header, a byte each 50 ms
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def test_a_server_that_trickles_its_headers_is_given_up_on_when_waited_for_and_when_asked_for_its_cache(tmp_path):
    """Each byte of a header within a socket's timeout: waiting for the server to be ready, and fetching its packed
    cache, each give up at their bound (the headers are read within it too), not when the server stops."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TricklesItsHeaders)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        h = ServerHandle(proc, f"http://127.0.0.1:{httpd.server_address[1]}/v1", "m", tmp_path / "w", False, 0, -1)
        t0 = time.monotonic()
        assert h.compiled(1 << 20, within_s=1.0) == b""
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        with pytest.raises(ServerFailure, match="not ready within 3 s"):
            wait_ready(h, 3.0)
        assert time.monotonic() - t0 < 5.5
    finally:
        proc.kill()
        httpd.shutdown()


def test_a_replays_weight_seed_gives_the_served_model_its_weights(tmp_path):
    def embed(seed):       # as the server builds its model from the spec it is handed
        preset = embedded_spec(CFG, "cpu", None, tmp_path, weight_seed=seed)["preset"]
        return build_model(SimpleNamespace(**preset), torch.float32, torch.device("cpu"), init=CFG.served.random_init).embed
    assert torch.equal(embed(7), embed(7)) and not torch.equal(embed(7), embed(8))
    assert torch.equal(embed(None), embed(CFG.served.presets[CFG.served.cpu.preset].seed))   # none given: the preset's
    assert not torch.equal(embed(None), embed(7))


def test_only_a_candidates_server_sweeps_the_served_shapes_in_its_warm_up(tmp_path):
    baseline = embedded_spec(CFG, "cpu", None, tmp_path, [12, 30, 7])
    candidate = embedded_spec(CFG, "cpu", tmp_path / "candidate.py", tmp_path, [12, 30, 7])
    assert baseline["warm_prompts"] == [] and candidate["warm_prompts"] == [12, 30, 7]
    head_of_another_op = embedded_spec(CFG, "cpu", None, tmp_path, [12, 30, 7], other_heads={"decode": tmp_path / "d.py"})
    assert head_of_another_op["warm_prompts"] == [12, 30, 7]       # a head beside torch's compiles too


def test_a_prefill_candidates_server_decodes_with_the_decode_head_it_is_handed():
    """Through a real served process: the head's file goes into its sandbox with the candidate's, and every
    decode call is the head's, by the server's own accounting (GET /kevo/stats)."""
    with start_server(CFG, "cpu", C.REF_PREFILL, other_heads={"decode": C.REF_DECODE}) as s:
        run = replay(s.url, s.model, served_requests(CFG, "cpu")[:2], request_timeout_s=120, drain_timeout_s=120)
        assert run.failures() == [], run.describe_failures()
        ops = s.stats()["ops"]
    assert ops["prefill"]["candidate"] == ops["prefill"]["calls"] > 0
    assert ops["decode"]["other_head"] == ops["decode"]["calls"] > 0 and ops["decode"]["candidate"] == 0


def test_a_candidates_sandboxed_server_sweeps_its_served_parts_compile_only_when_configured_then_serves():
    """Through a real served process: `served.<device>.warm_sweep_threads` reaches its warm-up, whose sweep runs in
    the sandbox as a part of its own, and the server then serves. (Triton's interpreter compiles nothing: on a CPU
    the compile threads are never started.)"""
    cfg = config_with(**{"served.cpu.warm_requests": 3, "served.cpu.warm_sweep_threads": 2})
    lengths = [len(r.prompt) for r in served_requests(cfg, "cpu")][:3]
    with start_server(cfg, "cpu", C.REF_DECODE, lengths) as s:
        parts = s.stats()["startup_s"]
        run = replay(s.url, s.model, served_requests(cfg, "cpu")[:2], request_timeout_s=120, drain_timeout_s=120)
        assert run.failures() == [], run.describe_failures()
        ops = s.stats()["ops"]
    assert list(parts) == ["carry", "load", "build", "warm_fixed", "warm_sweep", "warm_served", "warm_alone", "warm_capture"]
    assert ops["decode"]["candidate"] == ops["decode"]["calls"] > 0


def _live_threads(pid: int) -> list[str]:
    """The threads of `pid` that have not exited (a zombie first thread has exited; the others have not)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    live = []
    for t in tasks:
        try:
            state = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in "ZX":
            live.append(f"{t} {state}")
    return live


def test_a_stopped_server_is_gone_with_every_thread_of_its_sandboxed_process_when_stop_returns():
    # On the H200 the sandboxed server's first thread was a zombie while others were still in the driver, giving
    # the GPU's memory back; in the served GPU test the next replay's servers then did not fit (docs/BENCHMARKS.md).
    s = start_server(CFG, "cpu", None)
    inner = s._inner_pid()
    assert inner is not None and len(os.listdir(f"/proc/{inner}/task")) > 1    # PID 1 of its namespace, threaded
    s.stop()
    assert _live_threads(inner) == []


def test_a_reference_cache_too_small_for_the_traces_longest_request_is_refused_in_one_line(tmp_path):
    """The reference scores every request the arms serve; one its cache cannot hold whole would never be admitted.
    The tiny trace's longest request is 22 tokens, prompt and output: 22 is enough, 21 is refused naming the key."""
    fits = config_with(**{"stages.replay.reference_kv_cache_tokens": 22})
    assert embedded_spec(fits, "cpu", None, tmp_path, reference=True)["preset"]["kv_cache_tokens"] == 22
    short = config_with(**{"stages.replay.reference_kv_cache_tokens": 21})
    with pytest.raises(HarnessError, match=r"^stages\.replay\.reference_kv_cache_tokens: 21 tokens cannot hold the "
                                           r"served trace's longest request \(22 tokens, prompt and output\)$"):
        embedded_spec(short, "cpu", None, tmp_path, reference=True)


def _serving(completions) -> tuple[str, callable]:
    """A fake OpenAI-compatible server on loopback (aiohttp, in a thread): `completions` answers its POSTs. Its URL,
    and a function that stops it."""
    import asyncio
    import socket as socketlib

    from aiohttp import web
    sock = socketlib.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions)])
    runner = web.AppRunner(app)

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        loop.run_forever()
    threading.Thread(target=serve, daemon=True).start()

    def stop():
        loop.call_soon_threadsafe(loop.stop)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", stop


def test_a_stream_with_fewer_logprobs_than_tokens_fails_its_request_saying_so_and_raises_nothing():
    import json

    from aiohttp import web

    async def completions(request):
        n = (await request.json())["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):                      # the last token comes without its logprob
            lp = {"tokens": [f"token_id:{i}"], "token_logprobs": [-0.5] if i < n - 1 else [],
                  "top_logprobs": [{f"token_id:{i}": -0.5}], "text_offset": [0]}
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": "t", "logprobs": lp, "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    url, stop = _serving(completions)
    try:
        run = replay(url, "m", [TraceRequest(0, 0.0, [1, 2, 3], 3)], 10, 10, "candidate", True, 2)
    finally:
        stop()
    assert run.failures() == run.completions and "IndexError" in run.completions[0].error, run.completions[0].error
