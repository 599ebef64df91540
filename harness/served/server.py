"""The served process: the model, a candidate's kernels, and an OpenAI-compatible streaming endpoint.

Started by harness/served/launch.py only, as `python -m harness.served.server LISTEN_FD SPEC_JSON`,
with an environment built from an allowlist (no keys) and a loopback socket its parent bound and
put into listening state: its network namespace has no interfaces and its seccomp filter no
socket but AF_UNIX, so it only accepts on that socket. Before any candidate code is imported it
enters the same sandbox as the evaluator's workers (harness/isolation.py): it is PID 1 of new
namespaces, in a root of its own holding the interpreter, the libraries, harness/, the preset's
weights and its own folder (to which it copies the candidate's file and the heads served beside it, read
before it went in), with
no capabilities, rlimits and seccomp. It then builds the engine, warms it up, and serves:
  POST /v1/completions   prompt as token ids, max_tokens, temperature 0, logprobs <= 5, stream,
                         kevo_forced, kevo_score, kevo_group (optional, kevo's own extensions: no
                         other server has them)
  GET  /v1/models, /health, /kevo/stats (calls per op, fallbacks, shapes served, engine error, CUDA graphs)
Each streamed chunk also carries `kevo_step`, the engine step that made its token (the order of the engine's
work, which no client-side clock can tell apart from its threads' scheduling).
Tokens are reported as "token_id:N" (vLLM's return_tokens_as_token_ids convention); text is "<N>".
`kevo_forced`, a list of max_tokens token ids in [0, vocab), is teacher forcing: the server appends
those tokens instead of its own choices and reports, for each, the model's logprob of the forced
token and its own top logprobs (the first is what it would have chosen); null is as if absent,
anything else is a 400 naming what was wrong. `kevo_score: true` beside it scores those tokens in
the prompt's prefill, all in one forward pass (no decode step; harness/served/engine.py). `kevo_group`, {"id", "size", "position"} (kevo's own too),
holds a request until all `size` members of its group have come in, then queues them in their
positions between two steps: a burst every server it is sent to schedules alike (EngineLoop).
The engine runs in its own thread; the HTTP side is aiohttp (asyncio). Not covered: text prompts,
n > 1, stop sequences, sampling temperatures other than 0.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace


def _enter_sandbox(spec: dict, keep_fd: int) -> tuple[Path, list[str]]:
    """The workers' sandbox (harness/isolation.py). Returns the folder and the notes; in the shim
    (the process left outside the new PID namespace) it never returns: it mirrors the server's exit."""
    from harness import sandbox
    from harness.isolation import isolate_namespaces, mirror_child, settle_inside
    box = spec["sandbox"]
    notes: list[str] = []
    try:
        isolate_namespaces()
    except OSError as e:
        if box["required"]:
            raise SystemExit(f"sandbox: cannot create namespaces ({e}); set worker.sandbox: best_effort to run without")
        notes.append(f"no namespaces ({e})")
        namespaces = False
    else:
        namespaces = True
        child = os.fork()
        if child:
            os.close(keep_fd)
            mirror_child(child)
        sandbox.die_with_parent()
    try:
        folder, more = settle_inside(box, namespaces)
    except sandbox.SandboxError as e:
        raise SystemExit(f"sandbox: {e}; set worker.sandbox: best_effort to run without") from None
    return folder, notes + more


class EngineLoop:
    """Runs engine steps in a thread; requests come in through a queue, tokens go out to sinks.
    A request of a group (`kevo_group`) is held until every member of its group has come in; then the
    whole group joins the engine's queue between two steps, in the members' positions, so the engine's
    own admission (harness/served/engine.py) schedules it alike on every server it is sent to."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, object] = {}
        self.held: dict[str, tuple[int, dict[int, object]]] = {}   # group id -> (its size, position -> request)
        self.error = ""
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def submit(self, req, sink, group: tuple[str, int, int] | None = None) -> None:
        """`group`: (its id, how many members, this one's position among them)."""
        if self.error:
            raise RuntimeError(self.error)
        self.inbox.put(("add", (req, group), sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id, None))

    def _take(self, block: bool) -> None:
        while True:
            try:
                kind, item, sink = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                req, group = item
                self.sinks[req.id] = sink
                if group is None:
                    self.engine.add(req)
                    continue
                name, size, position = group
                known, members = self.held.setdefault(name, (size, {}))
                if position in members or size != known:     # the group is malformed: this member fails alone
                    self._fail_request(req.id, f"kevo_group {name!r}: a second member at position {position}, or a size "
                                               f"other than its first member's {known}")
                    continue
                members[position] = req
                if len(members) == size:
                    del self.held[name]
                    for p in sorted(members):
                        self.engine.add(members[p])
            else:
                self.sinks.pop(item, None)
                for name, (_, members) in list(self.held.items()):
                    for p in [p for p, r in members.items() if r.id == item]:
                        del members[p]
                    if not members:
                        del self.held[name]
                self.engine.abort(item)

    def _fail_request(self, request_id: str, why: str) -> None:
        sink = self.sinks.pop(request_id, None)
        if sink is not None:
            sink(why)

    def _run(self) -> None:
        while True:
            self._take(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                events = self.engine.step()
            except BaseException as e:                       # noqa: BLE001 - the candidate's failure, reported
                self.error = "the engine failed: " + "".join(traceback.format_exception_only(type(e), e)).strip()
                print(traceback.format_exc(), file=sys.stderr, flush=True)
                for sink in self.sinks.values():
                    sink(self.error)
                self.sinks.clear()
                return
            for ev in events:
                sink = self.sinks.get(ev.request_id)
                if sink is not None:
                    sink(ev)
                    if ev.finished:
                        del self.sinks[ev.request_id]


def _parse(body: object, top_k: int) -> tuple[dict, str]:
    """The request's fields, or an error message for a 400."""
    if not isinstance(body, dict):
        return {}, "the body must be a JSON object"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return {}, "prompt must be a non-empty list of token ids (this server has no tokenizer)"
    max_tokens = body.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return {}, "max_tokens must be a positive integer"
    if body.get("temperature") not in (None, 0, 0.0):
        return {}, "only greedy decoding (temperature 0) is served"
    if body.get("n") not in (None, 1):
        return {}, "only n = 1 is served"
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or not 0 <= logprobs <= top_k):
        return {}, f"logprobs must be an integer in 0..{top_k}"
    forced = body.get("kevo_forced")
    if forced is not None:            # its length and ids are the engine's to check (Engine.check)
        if not (isinstance(forced, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in forced)):
            return {}, "kevo_forced must be a list of token ids, one per generated token"
        forced = tuple(forced)
    scored = body.get("kevo_score", False)
    if not isinstance(scored, bool):
        return {}, "kevo_score must be true or false"
    if scored and forced is None:
        return {}, "kevo_score needs kevo_forced: the tokens to score"
    group = body.get("kevo_group")
    if group is not None:
        ok = isinstance(group, dict) and set(group) == {"id", "size", "position"} and isinstance(group["id"], str) \
            and 0 < len(group["id"]) <= 64 and all(isinstance(group[k], int) and not isinstance(group[k], bool)
                                                   for k in ("size", "position"))
        if not ok or not 0 <= group["position"] < group["size"] <= 4096:
            return {}, ("kevo_group must be {\"id\": a string of 1-64 characters, \"size\": 1-4096, \"position\": "
                        "0..size-1}")
        group = (group["id"], group["size"], group["position"])
    return {"prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs, "stream": bool(body.get("stream")),
            "forced": forced, "scored": scored, "group": group}, ""


def build_app(loop: EngineLoop, model_name: str, notes: list[str], startup: dict[str, float] | None = None,
              pack=lambda: b""):
    """`pack`: the process's compiled kernels, packed (harness/compiled.py), for GET /kevo/compiled."""
    from aiohttp import web

    from harness.served.engine import EngineError, Request
    counter = iter(range(1 << 62))

    def error(status: int, message: str):
        return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                             else "server_error"}}, status=status)

    def logprobs_of(ev, n: int, offset: int) -> dict:
        return {"tokens": [f"token_id:{ev.token}"], "token_logprobs": [ev.logprob],
                "top_logprobs": [{f"token_id:{t}": lp for t, lp in ev.top[:n]}], "text_offset": [offset]}

    def chunk(rid: str, ev, n: int | None, offset: int) -> dict:
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": f"<{ev.token}>", "logprobs": None if n is None else logprobs_of(ev, n, offset),
                             "finish_reason": "length" if ev.finished else None}], "kevo_step": ev.step}

    async def completions(request: web.Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the body is not JSON")
        args, problem = _parse(body, loop.engine.top_k)
        if problem:
            return error(400, problem)
        rid = f"cmpl-{next(counter)}"
        req = Request(rid, args["prompt"], args["max_tokens"], args["forced"], args["scored"])
        try:
            loop.engine.check(req)
        except EngineError as e:
            return error(400, str(e))
        out: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        try:
            loop.submit(req, lambda item: aio.call_soon_threadsafe(out.put_nowait, item), args["group"])
        except RuntimeError as e:
            return error(500, str(e))
        n, offset = args["logprobs"], 0
        if not args["stream"]:
            events = []
            while not events or not events[-1].finished:
                item = await out.get()
                if isinstance(item, str):
                    return error(500, item)
                events.append(item)
            lp = None if n is None else {k: [v for ev in events for v in logprobs_of(ev, n, 0)[k]]
                                         for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                                      "model": model_name, "choices": [{"index": 0, "text": "".join(f"<{e.token}>" for e in events),
                                                                        "logprobs": lp, "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(events),
                                                "total_tokens": len(req.prompt) + len(events)}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            while True:
                item = await out.get()
                if isinstance(item, str):
                    await resp.write(b"data: " + json.dumps({"error": {"message": item, "type": "server_error"}}).encode() + b"\n\n")
                    break
                await resp.write(b"data: " + json.dumps(chunk(rid, item, n, offset)).encode() + b"\n\n")
                offset += len(f"<{item.token}>")
                if item.finished:
                    await resp.write(b"data: [DONE]\n\n")
                    break
        except (ConnectionError, asyncio.CancelledError):
            loop.abort(rid)
            raise
        return resp

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "kevo"}]})

    async def health(_):
        return web.json_response({"ok": not loop.error})

    async def stats(_):
        e = loop.engine
        return web.json_response({"ops": e.ops.stats(), "steps": e.steps, "tokens": e.tokens_out, "error": loop.error,
                                  "sandbox": "; ".join(notes), "shapes": e.ops.shapes.summary(), "startup_s": startup or {},
                                  "graphs": e.graphs.stats() if e.graphs is not None else {"on": False, "reason": "not configured"}})

    async def packed(_):
        return web.Response(body=await asyncio.get_running_loop().run_in_executor(None, pack),
                            content_type="application/octet-stream")

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/health", health), web.get("/kevo/stats", stats), web.get("/kevo/compiled", packed)])
    return app


def serve(spec: dict, fd: int, notes: list[str], folder: Path, carried: list[bytes]) -> None:
    """`carried`: the packed caches of kernels its sources compiled before, unpacked into `folder` first."""
    import torch
    from aiohttp import web

    from harness import compiled
    from harness.gpu_memory import expandable_segments
    from harness.probes import Probes
    from harness.served.engine import make_engine, warm_up
    from harness.served.limits import GraphPlan
    from harness.served.ops import TARGET, AttentionOps, load_candidate
    from harness.served.spot import SpotChecks
    from harness.transport import DTYPES
    t0 = time.perf_counter()
    files, refused = compiled.carry_in(carried, str(folder), int(spec["carry_bytes"]))
    notes += [words for words in (files and f"compiled files carried in: {files}", refused) if words]
    startup = {"carry": time.perf_counter() - t0}
    t0 = time.perf_counter()
    device = torch.device(spec["device"])
    if device.type == "cuda":          # before the candidate's code runs: its share, as the head's (harness/gpu_memory.py)
        expandable_segments()
        torch.cuda.set_per_process_memory_fraction(float(spec["gpu_memory_fraction"]), torch.cuda.current_device())
    probes = Probes()
    probes.install()                   # before the candidate's code runs: its launches counted, its calls audited
    module = load_candidate(spec["candidate"]) if spec["candidate"] else None
    other_heads = {op: load_candidate(path, f"{op}_head") for op, path in spec.get("other_heads", {}).items()}
    target = TARGET.configured(spec["baselines"])
    factor, *floor = spec["spot_tolerance"]
    ops = AttentionOps(module, spec["dtype"], target=target, stall_ms=spec["stall_ms"], other_heads=other_heads,
                       probes=probes, audit_share=float(spec["audit_share"]),
                       spot=SpotChecks(target, float(spec["spot_share"]), float(factor), (float(floor[0]), float(floor[1]))),
                       gather_bound=int(spec["cuda_graphs"]["max_padded_tokens"]))
    g = spec["cuda_graphs"]
    startup["load"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = make_engine(SimpleNamespace(**spec["preset"]), spec["block_size"], DTYPES[spec["dtype"]], device, ops,
                         init=SimpleNamespace(**spec["random_init"]), top_k=spec["logprobs"],
                         root=Path(spec["root"]), graphs=GraphPlan(g["enabled"], tuple(g["batch_buckets"]), g["shortest_context"], g["longest_context"],
                                          int(g["max_padded_tokens"])))
    startup["build"] = time.perf_counter() - t0
    threads = int(spec["warm_sweep_threads"])
    startup |= {f"warm_{part}": s for part, s in warm_up(engine, spec.get("warm_prompts", ()), spec.get("warm_limit"),
                                                         spec["warm_passes"],
                                                         (lambda: probes.compiling(threads)) if threads else None).items()}
    ops.audit_all = False              # serving from here: a share of the calls audited, drawn in secret
    gc.collect()
    gc.freeze()            # what the build and warm-up made stays out of every later collection (as vLLM does)
    loop = EngineLoop(engine)
    loop.thread.start()
    app = build_app(loop, spec["model_name"], notes, startup, lambda: compiled.carry_out(str(folder), int(spec["carry_bytes"])))

    async def run() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, socket.socket(fileno=fd)).start()
        print(f"serving {spec['model_name']} on fd {fd}; sandbox: {'; '.join(notes)}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


def main() -> None:
    from harness.detach import release_group_signals
    from harness.sandbox import die_with_parent
    die_with_parent()
    release_group_signals()
    fd, spec = int(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    # every file the served process runs, read before the sandbox hides it, and written into its own folder
    files = {"candidate": spec["candidate"]} if spec["candidate"] else {}
    files |= {f"other_{op}": path for op, path in spec.get("other_heads", {}).items()}
    sources = {name: Path(path).read_text() for name, path in files.items()}
    carried = [Path(path).read_bytes() for path in spec.get("carried", [])]     # opaque here: unpacked in the sandbox
    folder, notes = _enter_sandbox(spec, fd)
    for name, source in sources.items():
        out = os.open(folder / f"{name}.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(out, "w") as f:
            f.write(source)
    if "candidate" in sources:
        spec["candidate"] = str(folder / "candidate.py")
    spec["other_heads"] = {op: str(folder / f"other_{op}.py") for op in spec.get("other_heads", {})}
    serve(spec, fd, notes, folder, carried)


if __name__ == "__main__":
    main()
