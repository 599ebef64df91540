"""Where the served step's time goes: the evidence behind every claim the planner makes.

`profile_served` replays the served trace against the baseline engine in this process (trusted
code: no candidate runs here) under torch.profiler, with every part of the model marked by a
`kevo.*` range (harness/served/model.py). Recorded steps (on CUDA a sample, by a profiler
schedule, so a 60 s replay stays cheap to read; on a CPU all of them) are bucketed: attention prefill, attention decode, GEMM,
normalisation, RoPE, activation, sampling, copies, other (residual adds and anything outside the
marked parts), and idle gaps (time in a step when nothing runs on the device: launch and host
overhead). Each is a share of the served step; they add up to the measured step time. On CUDA
the time is device time of kernels, each attributed through the op that launched it; on a CPU the
time is CPU time of torch ops (idle then means host time outside any op) and is labelled so.
Decode-only steps served from CUDA graphs (harness/served/graphs.py) launch their kernels in one
`cudaGraphLaunch`, so no host range says which part of the model a kernel of theirs belongs to: each
is attributed by its kernel name, in the proportions that name's kernels took when every graph's
forward ran once eagerly before the window (`graph_kernel_regions`) and in the profile's eager steps
(a step with a prefill is eager), else as GEMM by its name (cuBLAS, nvjet), else unattributed
(counted as other, and warned about above 5%). A kernel whose launch was not traced is attributed
by its name the same way where the name is known.
Then the target op's share f and the end-to-end ceilings 1/(1-f+f/s), the shapes the workload
served with their frequencies, and a plain sentence when the target is not where the time goes.
Not covered: multi-stream overlap (the engine uses one stream), the HTTP server's own cost.
"""
from __future__ import annotations

import bisect
import math
import re
import warnings

import torch
from torch.autograd import DeviceType

from harness.amdahl import ceiling
from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.served.engine import make_engine, run_requests, warm_up
from harness.served.limits import plan_for
from harness.served.ops import AttentionOps
from harness.targets import configured
from harness.transport import DTYPES

BUCKETS = {
    "attention_prefill": "attention prefill", "attention_decode": "attention decode", "gemm": "GEMM",
    "norm": "normalisation", "rope": "RoPE", "activation": "activation", "sampling": "sampling",
    "copies": "copies", "other": "other (residual adds, unmarked)", "idle": "idle gaps (launch / host overhead)",
}
REGIONS = {"kevo.attention.prefill": "attention_prefill", "kevo.attention.decode": "attention_decode",
           "kevo.gemm": "gemm", "kevo.norm": "norm", "kevo.rope": "rope", "kevo.activation": "activation",
           "kevo.sampling": "sampling", "kevo.copies": "copies", "kevo.residual": "other",
           "kevo.graph": "graph"}    # a CUDA graph replay: its kernels are attributed by name (attribute_graphs)
TARGET_OPS = {"attention": {"decode": "attention_decode", "prefill": "attention_prefill"}}
SPEEDUPS = (1.25, 1.5, 2.0, 4.0, math.inf)
_RUNTIME_CALL = re.compile(r"^(cuda|cu[A-Z])")   # CUDA runtime and driver API calls seen by the profiler
_GEMM_KERNEL = re.compile(r"gemm|nvjet|cublas", re.IGNORECASE)   # a graph kernel's name never met eagerly


def _region(e) -> str:
    while e is not None:
        if e.name in REGIONS:
            return REGIONS[e.name]
        if e.name == "kevo.step":
            return "other"
        e = e.cpu_parent
    return "other"


def _in_step(e) -> bool:
    while e is not None:
        if e.name == "kevo.step":
            return True
        e = e.cpu_parent
    return False


def _marker(e) -> bool:
    return bool(getattr(e, "is_user_annotation", False)) or e.name.startswith(("kevo.", "ProfilerStep"))


def _annotations(cpu) -> tuple[list[float], list]:
    """The kevo.* ranges on the host, sorted by start, for finding the innermost one around a time."""
    marks = sorted((e for e in cpu if e.name in REGIONS or e.name == "kevo.step"), key=lambda e: e.time_range.start)
    return [e.time_range.start for e in marks], marks


def _region_at(t: float, starts: list[float], marks: list) -> str | None:
    """The region of the innermost kevo.* range open at host time t (ranges nest: walking back from
    the last start before t, the first range still open at t is the innermost)."""
    i = bisect.bisect_right(starts, t) - 1
    for j in range(i, max(-1, i - 4096), -1):
        e = marks[j]
        if e.time_range.end >= t:
            return REGIONS.get(e.name, "other")
    return None


def bucket_device(events, names: dict[str, dict[str, float]] | None = None) -> tuple[dict[str, float], float, int, dict[str, int]]:
    """CUDA: kernel time by the region of the host code that launched it, within each step's window.
    A kernel is traced to its launch two ways, whichever the profiler's build supports: through the
    torch op linked to it (linked correlation id), or through the runtime/driver launch call with its
    correlation id, placed by host time inside the innermost kevo.* range. A kernel of a CUDA graph
    replay goes to the "graph" bucket, and `names` (kernel name -> region -> us, the "graph" region
    too) collects what `attribute_graphs` needs to share it out."""
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    launcher = {e.id: e for e in cpu if e.id > 0 and not _marker(e) and not getattr(e, "linked_correlation_id", 0)}
    launches = {}
    for e in cpu:
        if _RUNTIME_CALL.match(e.name):      # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, cudaMemsetAsync, ...
            for key in (e.id, getattr(e, "linked_correlation_id", 0)):
                if key:
                    launches.setdefault(key, e)
    starts, marks = _annotations(cpu)
    steps = sorted((e.time_range.start, e.time_range.end) for e in cpu if e.name == "kevo.step")
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA and not _marker(e)),
                     key=lambda e: e.time_range.start)
    out = dict.fromkeys(BUCKETS, 0.0) | {"unattributed": 0.0, "graph": 0.0}
    how = {"torch op": 0, "launch call": 0, "unattributed": 0}
    total, k = 0.0, 0
    for start, end in steps:
        busy, last = 0.0, start
        while k < len(kernels) and kernels[k].time_range.start < end:
            e = kernels[k]
            k += 1
            lo, hi = max(e.time_range.start, last), min(e.time_range.end, end)
            if hi <= lo:
                continue
            op = launcher.get(getattr(e, "linked_correlation_id", 0))
            if op is not None:
                region = _region(op)
                how["torch op"] += 1
            else:
                call = launches.get(e.id) or launches.get(getattr(e, "linked_correlation_id", 0))
                region = _region_at(call.time_range.start, starts, marks) if call is not None else None
                how["launch call" if region is not None else "unattributed"] += 1
            out[region or "unattributed"] += hi - lo
            if names is not None:
                by = names.setdefault(e.name, {})
                by[region or "unattributed"] = by.get(region or "unattributed", 0.0) + hi - lo
            busy += hi - lo
            last = hi
        out["idle"] += (end - start) - busy
        total += end - start
    out["other"] += out["unattributed"]           # kept apart too, so a broken attribution shows
    return out, total, len(steps), how


def attribute_graphs(buckets: dict[str, float], names: dict[str, dict[str, float]]) -> dict[str, float]:
    """The "graph" bucket shared out by kernel name: in the proportions each name's kernels took where
    their launch was traced (the eager steps, the graphs' eager forwards), else to GEMM for a GEMM
    library's name, else unattributed. A kernel whose launch was not traced at all (counted as
    unattributed and other) is shared out the same way where its name is known. Returns the time
    (us) each way took, for `graph_kernels_ms`."""
    out = {"kernel name (graph replay)": 0.0, "gemm by name (graph replay)": 0.0, "unattributed (graph replay)": 0.0,
           "kernel name (launch not traced)": 0.0}
    for name, by in names.items():
        t, lost = by.get("graph", 0.0), by.get("unattributed", 0.0)
        traced = {r: v for r, v in by.items() if r not in ("graph", "unattributed")}
        total = sum(traced.values())
        gemm = not total and bool(_GEMM_KERNEL.search(name))
        if lost and (total or gemm):                  # no longer unattributed: known by its name
            buckets["unattributed"] -= lost
            buckets["other"] -= lost
            out["kernel name (launch not traced)"] += lost
        else:
            lost = 0.0
        if total:
            for r, v in traced.items():
                buckets[r] += (t + lost) * v / total
            out["kernel name (graph replay)"] += t
        elif gemm:
            buckets["gemm"] += t + lost
            out["gemm by name (graph replay)"] += t
        elif t:
            buckets["unattributed"] += t
            buckets["other"] += t
            out["unattributed (graph replay)"] += t
    buckets["graph"] = 0.0
    return out


def graph_kernel_regions(engine) -> dict[str, dict[str, float]]:
    """Kernel name -> region -> us, from each captured graph's forward run once eagerly under the
    profiler: the same calls on the same shapes as its capture, so the same kernels."""
    names: dict[str, dict[str, float]] = {}
    if engine.graphs is None or not engine.graphs.on:
        return names
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with engine.model.region("kevo.step"):
            engine.graphs.forward_each_eagerly()
        torch.cuda.synchronize()
    bucket_device(prof.events(), names)
    engine.ops.reset()
    return names


def bucket_host(events) -> tuple[dict[str, float], float, int, dict[str, int]]:
    """CPU: self time of each torch op by its region; the rest of each step is host time."""
    out = dict.fromkeys(BUCKETS, 0.0)
    steps = [e for e in events if e.name == "kevo.step" and e.device_type == DeviceType.CPU]
    total = sum(e.time_range.end - e.time_range.start for e in steps)
    for e in events:
        if e.device_type != DeviceType.CPU or _marker(e) or getattr(e, "is_async", False) or not _in_step(e):
            continue
        out[_region(e)] += e.self_cpu_time_total
    out["idle"] = total - sum(out.values())
    return out, total, len(steps), {}


def summarize(buckets_us: dict[str, float], total_us: float, steps: int, target: str, device: str) -> dict:
    buckets_us = dict(buckets_us)
    unattributed = buckets_us.pop("unattributed", 0.0)
    buckets_us.pop("graph", None)
    shares = {k: (v / total_us if total_us else 0.0) for k, v in buckets_us.items()}
    ops = TARGET_OPS[target]
    op_shares = {op: shares[b] for op, b in ops.items()}
    f = sum(op_shares.values())
    largest = max((k for k in shares if k not in ops.values()), key=shares.get)   # the biggest thing that is not the target
    label = "CPU time of torch ops on the host (not GPU figures)" if device == "cpu" else "device time of CUDA kernels"
    if f >= shares[largest]:
        verdict = (f"{target} is where the time goes: {f:.0%} of the served step; a kernel twice as fast "
                   f"would make the step {ceiling(f, 2):.2f}x faster, an infinitely fast one {ceiling(f, math.inf):.2f}x.")
    else:
        verdict = (f"{target} is not where the time goes: {f:.0%} of the served step, while {BUCKETS[largest]} takes "
                   f"{shares[largest]:.0%}. Even an infinitely fast {target} kernel would make the step at most "
                   f"{ceiling(f, math.inf):.2f}x faster.")
    return {
        "target": target, "device": device, "clock": label, "steps_profiled": steps,
        "step_ms_total": total_us / 1e3, "step_ms_mean": total_us / 1e3 / steps if steps else 0.0,
        "buckets": {k: {"label": BUCKETS[k], "ms": v / 1e3, "share": shares[k]} for k, v in buckets_us.items()},
        "target_share": f, "op_shares": op_shares,
        "ceilings": {str(s): ceiling(f, s) for s in SPEEDUPS},
        "op_ceilings": {op: {str(s): ceiling(v, s) for s in SPEEDUPS} for op, v in op_shares.items()},
        "largest_other": largest, "verdict": verdict,
        "unattributed_share": unattributed / total_us if total_us else 0.0,   # kernels whose launching op was not found
    }


def profile_served(cfg: Config, target: str = "attention", device: torch.device | None = None,
                   window_s: float | None = None) -> dict:
    from harness.evaluate import resolve_device
    from harness.stages.replay import served_requests
    if target not in TARGET_OPS:
        raise HarnessError(f"no served profile for target {target!r}; known: {', '.join(TARGET_OPS)}")
    device = device or resolve_device(cfg)
    served = getattr(cfg.served, device.type)
    section = getattr(getattr(cfg.targets, target), device.type)
    requests = served_requests(cfg, device.type, window_s)
    ops = AttentionOps(None, section.dtype, target=configured(target, cfg), stall_ms=cfg.served.stall_ms)
    engine = make_engine(cfg.served.presets[served.preset], section.block_size, DTYPES[section.dtype], device, ops,
                         init=cfg.served.random_init, top_k=cfg.served.logprobs, annotate=True, root=PROJECT_ROOT, graphs=plan_for(cfg, device.type))
    warm_up(engine, [len(r.prompt) for r in requests], served.warm_requests, served.warm_passes)
    acc = dict.fromkeys(BUCKETS, 0.0) | {"unattributed": 0.0, "graph": 0.0}
    totals = [0.0, 0]
    names = graph_kernel_regions(engine) if device.type == "cuda" else {}
    reader = (lambda events: bucket_device(events, names)) if device.type == "cuda" else bucket_host

    traced: dict[str, int] = {}

    def collect(prof) -> None:
        b, t, n, how = reader(prof.events())
        for k, v in how.items():
            traced[k] = traced.get(k, 0) + v
        for k, v in b.items():
            acc[k] = acc.get(k, 0.0) + v
        totals[0] += t
        totals[1] += n

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cycle = getattr(cfg.served.profile_cycle, device.type)     # null: every step recorded
    if cycle is None:
        with torch.profiler.profile(activities=activities) as prof:
            run_requests(engine, requests, realtime=True)
        collect(prof)
    else:
        schedule = torch.profiler.schedule(wait=cycle.wait, warmup=cycle.warmup, active=cycle.active)
        with warnings.catch_warnings():    # "events are cleared each cycle": collect() reads every cycle
            warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle.*")
            with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=collect) as prof:
                run_requests(engine, requests, realtime=True, on_step=lambda events: prof.step())
    if not totals[1]:
        raise HarnessError("the profile recorded no served step (the trace is too short for the profiler's schedule)")
    graph_us = attribute_graphs(acc, names)
    report = summarize(acc, totals[0], totals[1], target, device.type)
    report.update(kernels_traced_by=traced, graph_kernels_ms={k: v / 1e3 for k, v in graph_us.items()},
                  cuda_graphs=engine.graphs.stats() if engine.graphs is not None else {"on": False}, preset=served.preset, trace=served.trace, window_s=window_s or served.window_s,
                  requests=len(requests), steps=engine.steps, served_shapes=ops.shapes.summary(),
                  heads=[engine.model.p.q_heads, engine.model.p.kv_heads], head_dim=engine.model.p.head_dim,
                  block_size=section.block_size, dtype=section.dtype)
    return report


def render(report: dict) -> str:
    lines = [f"served step of {report['preset']} on {report['trace']} ({report['requests']} requests, "
             f"{report['steps_profiled']} of {report['steps']} steps profiled, mean {report['step_ms_mean']:.3f} ms); "
             f"time is {report['clock']}"]
    g = report.get("cuda_graphs") or {}
    lines += [f"CUDA graphs: on, {g['graphs']} captured in {g['capture_s']:.1f} s, {g['replays']} decode steps replayed, "
              f"{g['eager_decode_steps']} decode-only steps outside them ran eagerly" if g.get("on")
              else f"CUDA graphs: {g.get('reason') or 'off'}", ""]
    for k, b in sorted(report["buckets"].items(), key=lambda kv: -kv[1]["share"]):
        lines.append(f"  {b['label']:<36} {b['share']:7.1%}  {b['ms']:10.2f} ms")
    lines.append(f"  {'total':<36} {sum(b['share'] for b in report['buckets'].values()):7.1%}  "
                 f"{report['step_ms_total']:10.2f} ms")
    f = report["target_share"]
    ceil = ", ".join(f"{'inf' if s == 'inf' else s}x -> {v:.3f}x" for s, v in report["ceilings"].items())
    lines += ["", f"{report['target']} share f = {f:.3f} ("
              + ", ".join(f"{op} {v:.3f}" for op, v in report["op_shares"].items()) + ")",
              f"end-to-end ceiling 1/(1-f+f/s): {ceil}", report["verdict"]]
    if report["unattributed_share"] > 0.05:
        lines.append(f"warning: {report['unattributed_share']:.0%} of the step's kernels could not be traced to the op "
                     "that launched them; they are counted as other")
    lines += ["", "served shapes (by work):"]
    for op, rows in report["served_shapes"].items():
        for r in rows:
            lines.append(f"  {op:<8} batch {r['batch']:>4}  lengths {r['lengths'][0]}..{r['lengths'][1]}  "
                         f"weight {r['weight']:.3f}  ({r['calls']} calls, {r['call_share']:.1%} of {op} calls)")
    return "\n".join(lines)
