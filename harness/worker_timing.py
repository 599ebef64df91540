"""The worker's side of microbench: timing requests, run on a `Worker` (harness/worker.py) in its process.

`prime` pays the trusted code's first uses before anything is timed; `timed` (the `time` request) times
candidate and baseline interleaved on the evaluator's input sets, the L2 flushed and the launch
hidden behind a spin kernel, events read on the stream and after a full synchronize; `burst` replays
calls back to back from a CUDA graph for the evaluator's own clock. They decide nothing: the evaluator
(harness/stages/microbench.py) distrusts every number they return, and times the library anchor itself.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from harness.targets.base import redrawn
from harness.transport import DTYPES, trim

if TYPE_CHECKING:
    from harness.worker import Worker


def prime(w: "Worker", msg: dict) -> dict:
    """Pay the trusted code's first uses in this process before the first case is timed: for each of `calls`
    (a recipe of a small case, with the name of the baseline the stage times) the torch baseline (its kernels
    loaded), then the L2-flush buffer, the spin kernel and timing events. Calls no candidate code; its outputs
    are dropped; a baseline that raises is counted and left for `time` to meet again (and report)."""
    t0, failed = time.perf_counter(), 0
    for recipe in msg["calls"]:
        op = recipe["case"].op
        args = w.target.ops[op].make_inputs(recipe["case"], recipe["dist"], recipe["seed"], w.device, DTYPES[recipe["dtype"]])
        try:
            w._call(w._fn("baseline", op, args, recipe.get("baseline", "")), op, args)
        except Exception:                       # met again by `time`: a lost context fails the flush below
            failed += 1
        del args
    if w.device.type == "cuda":
        flush = torch.empty(max(1, msg["flush_bytes"] // 4), dtype=torch.int32, device=w.device)
        flush.zero_()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        torch.cuda._sleep(1000)
        ev[1].record()
        torch.cuda.synchronize()
        ev[0].elapsed_time(ev[1])
        del flush
    return {"ok": True, "failed": failed, "seconds": {"prime_s": time.perf_counter() - t0}}


def per_call_seed(msg: dict, s: int, call: int, checked: bool) -> int | None:
    """The seed of the per-call argument (`Op.per_call`: attention's query) set `s` is called with at `call` (a
    timed rep; a warmup round counts on from `reps`), or None where the set keeps its own (a set drawn without
    `per_call_seed`). The checked rep's is the set's own `per_call_seed`, which the trusted side's reference was
    computed with; every other call's comes from the request's secret `per_call_nonce`, so no call of a request
    repeats another's inputs, nor another request's."""
    own = msg["sets"][s].get("per_call_seed")
    if own is None:
        return None
    if checked:
        return own
    return (int(msg["per_call_nonce"]) * 1_000_003 + s * 65_537 + call) % (1 << 63)


def redraw_per_call(args: dict, name: str | None, seed: int | None) -> None:
    """The set's per-call argument `name` rewritten in place (the same buffer, so the same address) from `seed`."""
    if seed is not None:
        args[name].copy_(redrawn(args[name], seed))


def timed(w: "Worker", msg: dict) -> dict:
    """Interleaved timing: for each rep, each input set, each implementation (rotating order).
    Before each timed call the L2 is flushed and the GPU is held busy by a spin kernel while the
    host launches the call, so the events measure device time, not Python launch overhead.
    Two intervals per call: to the event after the call on its stream, and to an event recorded
    after a full device synchronize (which also covers work on other streams). Each rep and each warmup round
    calls a set on a query of its own (`per_call_seed`; candidate and baseline on the same one), written before
    the flush: an output kept for inputs seen before would be timed as the lookup it is. The checked rep's
    query is left in the sets at the end, for the clock's bursts (`burst`), whose output is checked too."""
    op, impls = msg["op"], list(msg["impls"])
    t0 = time.perf_counter()
    sets = [w._inputs(f"{op}#{i}", r) for i, r in enumerate(msg["sets"])]
    check_rep, fresh = msg.get("check_rep", msg["reps"] - 1), w.target.ops[op].per_call
    seconds = {"inputs_s": time.perf_counter() - t0}
    w.timed_sets[op] = sets
    calls: dict[str, list] = {}
    for impl in dict.fromkeys(impls):
        call = w._watched if impl == "candidate" else w._call
        calls[impl] = [(lambda a=a, fn=w._fn(impl, op, a, msg.get("baseline", "")), call=call: call(fn, op, a))
                       for a in sets]
    w.probes.reset()
    flush = torch.empty(max(1, msg["flush_bytes"] // 4), dtype=torch.int32, device=w.device)
    seconds["prepare_s"], t0 = time.perf_counter() - t0 - seconds["inputs_s"], time.perf_counter()
    for round_ in range(msg["warmup"]):
        for s, a in enumerate(sets):
            redraw_per_call(a, fresh, per_call_seed(msg, s, msg["reps"] + round_, checked=False))
            for impl in dict.fromkeys(impls):
                calls[impl][s]()
    w._sync()
    seconds["warmup_s"], t0 = time.perf_counter() - t0, time.perf_counter()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    synced = {f"{k}:{i}": [] for i, k in enumerate(impls)}
    streamed = {k: [] for k in synced}
    last: dict[str, torch.Tensor] = {}
    for rep in range(msg["reps"]):
        order = list(enumerate(impls))
        order = order[rep % len(order):] + order[:rep % len(order)]
        for s in range(len(sets)):
            redraw_per_call(sets[s], fresh, per_call_seed(msg, s, rep, checked=rep == check_rep))
            for i, impl in order:
                flush.zero_()
                torch.cuda.synchronize()
                torch.cuda._sleep(msg["cover_cycles"])
                ev[0].record()
                out = calls[impl][s]()
                ev[1].record()
                torch.cuda.synchronize()
                ev[2].record()
                torch.cuda.synchronize()
                synced[f"{impl}:{i}"].append(ev[0].elapsed_time(ev[2]))
                streamed[f"{impl}:{i}"].append(ev[0].elapsed_time(ev[1]))
                if impl == "candidate" and rep == check_rep:
                    last[f"set{s}"] = out        # the rep the evaluator drew in secret is the one checked
    if msg["reps"]:
        for s, a in enumerate(sets):             # the bursts replay the checked query
            redraw_per_call(a, fresh, per_call_seed(msg, s, check_rep, checked=True))
    seconds["reps_s"] = time.perf_counter() - t0
    return {"ok": True, "synced_ms": synced, "streamed_ms": streamed, "outputs": w._save(last) if last else [],
            "op_calls": dict(w.probes.op_calls), "seconds": seconds, "compiles": w.probes.compiles,
            "kernels": w.probes.resources()}


def burst(w: "Worker", msg: dict) -> dict:
    """Back-to-back calls on the first input set of the last `time` request, replayed from a CUDA
    graph (so launch overhead does not hide device time) where the implementation can be
    captured; the evaluator clocks the request. `prepare` captures without timing, `per_graph` calls in
    the graph (config stages.microbench.calls_per_graph); a burst of `n` replays it n // per_graph times.
    With `check` (an index the evaluator draws after the capture), the reply carries the output that the
    graph's call of that index wrote in the burst's last replay, for the evaluator to check: the graph's
    calls must each do the work, or the clock would time less than the candidate's calls do."""
    op, impl = msg["op"], msg["impl"]
    args = w.timed_sets[op][0]
    fn = w._fn(impl, op, args, msg.get("baseline", ""))
    if msg.get("prepare"):
        per_graph = int(msg["per_graph"])
        call = w._watched if impl == "candidate" else w._call
        w.probes.reset()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    call(fn, op, args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):       # the same calls as the two watched above, recorded
                outs = [w._call(fn, op, args) for _ in range(per_graph)]
            w.graphs[(op, impl)] = (graph, per_graph, outs)
            return {"ok": True, "graph": True, "op_calls": dict(w.probes.op_calls)}
        except Exception as e:
            w.graphs.pop((op, impl), None)
            torch.cuda.synchronize()
            return {"ok": True, "graph": False, "error": trim(f"{type(e).__name__}: {e}", 400),
                    "op_calls": dict(w.probes.op_calls)}
    graph, per_graph, outs = w.graphs.get((op, impl), (None, 1, []))
    n = int(msg["n"])
    if graph is not None:
        for _ in range(max(1, n // per_graph)):
            graph.replay()
    else:                                   # the baseline only: the candidate must be captured
        for _ in range(n):
            w._call(fn, op, args)
    w._sync()
    check = msg.get("check")
    if check is None or graph is None:
        return {"ok": True, "outputs": []}
    return {"ok": True, "outputs": w._save({"burst": outs[int(check) % len(outs)]})}
