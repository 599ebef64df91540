"""Benchmark (not a test): one kernel's time per call by each way microbench could clock it, per served case.

    python tests/bench/clock_protocols.py [FILE ...] [--only prefill|decode] [--json PATH]

Why: microbench's clock check rejects a candidate whose speedup by the worker's CUDA events is more than
1/clock_check_ratio its speedup by the evaluator's clock over CUDA-graph bursts. The two protocols differ:
the events time each call alone, after an L2 flush and a spin; a burst replays calls back to back on one
input set, its inputs warm in the L2. On the H200 (fifteenth session) the TMA prefill family was rejected
so at batch 4, 512..2048: its events 0.097 ms and clock 0.115 ms, the baseline's 0.272 and 0.232.
This prints, for FILE's op function(s) (default: the reference kernels and the TMA prefill family) and the
torch baseline, on every served case of the embedded config:
  events   the worker's protocol (flush, synchronize, spin, events), median of `--reps`;
  short    the clock check until the eighteenth session: five rounds of 10 ms bursts, each after a 50 ms rest, the median;
  warm     graph bursts of back-to-back calls on one input set, 60 ms (the clock check until the fifteenth session);
  rotated  graph bursts cycling through copies of the inputs that together exceed the flush size, so that
           no call finds its inputs in the L2 (no flush to subtract);
  flushed  graph bursts of [flush, call] less bursts of [flush] alone;
  warm_600ms  as warm, ten times as long (whether sustained load slows the clocks; the time stamp `at` lines the
           rows up with an nvidia-smi log of SM clock and power);
each by wall clock ((wall of 2n calls - wall of n) / n), with its ratio to `events`, and then each
protocol's speedup of the kernel over the baseline. It asserts nothing.

    python tests/bench/clock_protocols.py --ab [--repeat 6] [--json PATH]

instead compares ways of running the clock check itself (`VARIANTS`: rounds x rest before each round, the
check's 10 ms bursts), each repeated `--repeat` times in turn per implementation and case: the median and spread
of its time per call over the repeats, its ratio to `events`, its speedup over the baseline, and the seconds it
took. Whether fewer rounds or a shorter rest clock the same as the check of 5 x 50 ms is the question; a
variant that lets the power cap bite reads slower, one with too few rounds spreads wider.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.config import load_config  # noqa: E402
from harness.evaluate import device_shapes  # noqa: E402
from harness.stages.microbench import _time_here  # noqa: E402
from harness.targets import configured  # noqa: E402
from harness.transport import DTYPES  # noqa: E402

DEFAULT = ["knowledge/attention/decode_paged_splitkv.py", "knowledge/attention/prefill_causal_tiled.py",
           "knowledge/attention/prefill_causal_tma.py"]


def load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clock() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC_RAW)


def capture(body, per_graph: int):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(per_graph):
            body(j)
    return graph


def burst_ms(graph, per_graph: int, per_call_ms: float, budget_ms: float = 60.0) -> float:
    n = max(1, int(budget_ms / max(per_call_ms, 1e-3) / per_graph))
    walls = []
    for k in (n, 2 * n):
        torch.cuda.synchronize()
        t0 = clock()
        for _ in range(k):
            graph.replay()
        torch.cuda.synchronize()
        walls.append(clock() - t0)
    return (walls[1] - walls[0]) * 1e3 / (n * per_graph)


def short_ms(graph, per_graph: int, per_call_ms: float, rounds: int = 5, budget_ms: float = 10.0,
             rest_s: float = 0.05) -> float:
    """microbench's bursts since the fifteenth session: short rounds, each after a rest, the median."""
    out = []
    for _ in range(rounds):
        time.sleep(rest_s)
        out.append(burst_ms(graph, per_graph, per_call_ms, budget_ms))
    return statistics.median(out)


def nbytes(inputs: dict) -> int:
    return sum(t.nbytes for t in inputs.values() if isinstance(t, torch.Tensor))


def measure(call_on, inputs: list[dict], flush, args) -> dict:
    """call_on(i) calls the implementation on inputs[i]."""
    ev = _time_here(lambda: call_on(0), args.reps, flush, args.cover)     # the worker's protocol
    per_graph = 10
    graph = capture(lambda j: call_on(0), per_graph)
    time.sleep(0.2)
    short = short_ms(graph, per_graph, ev)
    warm = burst_ms(graph, per_graph, ev)
    k = len(inputs)
    rot_graph_calls = per_graph * math.ceil(k / per_graph)
    rotated = burst_ms(capture(lambda j: call_on(j % k), rot_graph_calls), rot_graph_calls, ev)
    with_flush = burst_ms(capture(lambda j: (flush.zero_(), call_on(0)), per_graph), per_graph, ev)
    flush_only = burst_ms(capture(lambda j: flush.zero_(), per_graph), per_graph, ev)
    long = burst_ms(capture(lambda j: call_on(0), per_graph), per_graph, ev, budget_ms=600.0)
    return {"events": ev, "short": short, "warm": warm, "rotated": rotated, "flushed": with_flush - flush_only, "flush": flush_only,
            "warm_600ms": long, "at": time.time()}


VARIANTS = {"5x50ms": (5, 0.05), "3x50ms": (3, 0.05), "5x20ms": (5, 0.02), "3x20ms": (3, 0.02)}


def ab(call_on, flush, args) -> dict:
    """Each clock-check variant `args.repeat` times, the variants interleaved: per variant its per-call times, the
    seconds one check took (median), beside the events' figure."""
    ev = _time_here(lambda: call_on(0), args.reps, flush, args.cover)
    per_graph = 10
    graph = capture(lambda j: call_on(0), per_graph)
    got: dict[str, list[float]] = {v: [] for v in VARIANTS}
    took: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeat):
        for v, (rounds, rest) in VARIANTS.items():
            t0 = time.perf_counter()
            got[v].append(short_ms(graph, per_graph, ev, rounds=rounds, rest_s=rest))
            took[v].append(time.perf_counter() - t0)
    return {"events": ev, **{v: {"median": statistics.median(x), "spread": max(x) / min(x) - 1, "all": x,
                                 "seconds": statistics.median(took[v])} for v, x in got.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", default=DEFAULT)
    ap.add_argument("--only", choices=["decode", "prefill"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cover", type=int, default=2_000_000)
    ap.add_argument("--json")
    ap.add_argument("--ab", action="store_true", help="compare clock-check variants (VARIANTS) instead")
    ap.add_argument("--repeat", type=int, default=6, help="--ab: checks per variant")
    args = ap.parse_args()
    cfg = load_config()
    device = torch.device("cuda")
    shapes = device_shapes(cfg, "attention", device)
    target = configured("attention", cfg)
    dtype = DTYPES[shapes.dtype]
    flush = torch.empty(cfg.stages.microbench.l2_flush_bytes // 4, dtype=torch.int32, device=device)
    modules = [(Path(f).stem, load(f)) for f in args.files]
    rows = []
    for case in target.served_cases(shapes):
        if args.only and case.op != args.only:
            continue
        spec = target.ops[case.op]
        first = spec.make_inputs(case, "normal", 1, device, dtype)
        copies = max(1, math.ceil(2 * flush.nbytes / nbytes(first)))
        inputs = [first] + [{n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in first.items()}
                            for _ in range(copies - 1)]
        impls = [("baseline", [spec.prepared_baseline(a) for a in inputs])]
        impls += [(name, [getattr(mod, case.op)] * len(inputs)) for name, mod in modules if hasattr(mod, case.op)]
        figures = {}
        for name, fns in impls:
            def call_on(i, fns=fns):
                return fns[i](*[inputs[i][n] for n in spec.arg_names])
            call_on(0)
            torch.cuda.synchronize()
            if args.ab:
                figures[name] = f = ab(call_on, flush, args)
                print(f"{case.label} | {name:24s} events {f['events']:.4f} ms | " + " | ".join(
                    f"{v} {f[v]['median']:.4f} ({f[v]['median'] / f['events']:.2f}, spread {f[v]['spread']:.1%}, "
                    f"{f[v]['seconds']:.2f} s)" for v in VARIANTS), flush=True)
                continue
            figures[name] = measure(call_on, inputs, flush, args)
            f = figures[name]
            print(f"{case.label} | {name:24s} events {f['events']:.4f} ms | " + " | ".join(
                f"{p} {f[p]:.4f} ({f[p] / f['events']:.2f})" for p in ("short", "warm", "rotated", "flushed", "warm_600ms"))
                + f" | flush alone {f['flush']:.4f}; at {f['at']:.1f}; {copies} input copies of {nbytes(first) / 1e6:.1f} MB", flush=True)
        base = figures["baseline"]
        for name, f in figures.items():
            if args.ab:
                if name != "baseline":
                    print(f"{case.label} | {name:24s} speedup events {base['events'] / f['events']:.2f}x | " + " | ".join(
                        f"{v} {base[v]['median'] / f[v]['median']:.2f}x" for v in VARIANTS), flush=True)
                continue
            if name != "baseline":
                sp = {p: base[p] / f[p] for p in ("events", "short", "warm", "rotated", "flushed", "warm_600ms")}
                print(f"{case.label} | {name:24s} speedup " + " | ".join(f"{p} {v:.2f}x" for p, v in sp.items())
                      + " | by warm / by events " + f"{sp['warm'] / sp['events']:.2f}", flush=True)
        rows.append({"case": case.label, "figures": figures})
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(),
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
