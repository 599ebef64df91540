"""Benchmark (not a test): prefill kernel files served as the replay's arms serve them, every prefill call
timed on the device, in one process: what a prefill kernel does to serving without the replay's servers (it showed
the Gluon prefill faster while the replay, then biased against the candidate's arm, rejected it: docs/SERVED.md).

    python tests/bench/served_prefill.py [SPEC ...] [--window 40] [--json OUT]
    SPEC = path/to/kernel.py[:KNOB=VALUE,...]   (default: the reference prefill, then the TMA family)

Each spec runs in a fresh process with an empty Triton cache: the served preset's engine on CUDA with the
torch decode (the configured baseline) and that prefill, CUDA graphs as configured, as a replay's arm
serves a prefill file; the server's warm-up on the window's prompt lengths, then the window's
requests offered as the replay offers them (config stages.replay.segments bursts, one after another), each
prefill call between two CUDA events. Prints per spec: the warm-up's seconds, the window's, the calls that
held the host over served.stall_ms (compiles the warm-up did not cover), the prefill calls' device time in
all and by packed tokens (power-of-two buckets), and the window's p50 / p90 TPOT and TTFT (from its burst's
start). `--checks`: the launch probes, audits and spot checks the replay's servers run, at config's shares. The same requests and
weights for every spec (fixed seeds: a bench, not a verdict). Asserts nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT = ["knowledge/attention/prefill_causal_tiled.py", "knowledge/attention/prefill_causal_tma.py"]


def one(spec: str, window: float, checks: bool = False) -> dict:
    import random

    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests" / "bench"))
    from vs_library import load_spec
    from harness.config import PROJECT_ROOT, load_config
    from harness.served.engine import make_engine, run_requests, warm_up
    from harness.gpu_memory import server_graph_bound
    from harness.probes import Probes
    from harness.served.limits import plan_for
    from harness.served.spot import SpotChecks
    from harness.served.ops import TARGET, AttentionOps
    from harness.stages.replay import draw, segments
    from harness.transport import DTYPES
    cfg = load_config()
    device = "cuda" if torch.cuda.is_available() else "cpu"     # on a CPU: a smoke test of this bench, no figure
    served, section = getattr(cfg.served, device), getattr(cfg.targets.attention, device)
    window = window or served.window_s
    cuda = device == "cuda"
    label, pre = load_spec(spec, pathlib.Path(tempfile.mkdtemp()))
    calls: list[tuple[int, object]] = []   # packed tokens, (start, end) events or ms

    def timed_prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
        if not cuda:
            t = time.perf_counter()
            out = pre.prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale)
            calls.append((q.shape[0], (time.perf_counter() - t) * 1e3))
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = pre.prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale)
        end.record()
        calls.append((q.shape[0], (start, end)))
        return out

    # as a replay's arm serves a prefill file: torch's configured decode, the configured CUDA graphs
    target = TARGET.configured(cfg.targets.attention.baselines())
    watch = {}
    if checks:                       # as the replay's server: launches probed, a share audited and spot-checked
        probes = Probes()
        probes.install()
        floor = cfg.stages.parity.floors[section.dtype]
        watch = {"probes": probes, "audit_share": cfg.served.audit_share,
                 "spot": SpotChecks(target, cfg.served.spot_share, cfg.stages.parity.tolerance_factor, (floor.max_abs, floor.rel_l2))}
    ops = AttentionOps(SimpleNamespace(prefill=timed_prefill), section.dtype, target=target, stall_ms=cfg.served.stall_ms, **watch)
    torch.manual_seed(0)
    engine = make_engine(cfg.served.presets[served.preset], section.block_size, DTYPES[section.dtype], torch.device(device),
                         ops, init=cfg.served.random_init, top_k=cfg.served.logprobs, root=PROJECT_ROOT,
                         graphs=plan_for(cfg, device, server_graph_bound(cfg, device, False)) if cuda else None)
    requests = draw(cfg, device, random.Random(1), window)
    t = time.perf_counter()
    warm_up(engine, [len(r.prompt) for r in requests], served.warm_requests)   # ends with ops.reset()
    ops.audit_all = False
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t
    calls.clear()
    tpot: list[float] = []
    ttft: list[float] = []
    t = time.perf_counter()
    for seg in segments(requests, window, cfg.stages.replay.segments):
        burst = [dataclasses.replace(r, arrival_s=0.0) for r in seg]
        seen: dict[int, list[float]] = defaultdict(list)

        def on_step(events) -> None:
            now = time.perf_counter()
            for ev in events:
                seen[int(ev.request_id)].append(now)

        t_seg = time.perf_counter()
        run_requests(engine, burst, realtime=False, on_step=on_step)
        ttft += [(ts[0] - t_seg) * 1e3 for ts in seen.values()]
        tpot += [(ts[-1] - ts[0]) / (len(ts) - 1) * 1e3 for ts in seen.values() if len(ts) > 1]
    if cuda:
        torch.cuda.synchronize()
    window_s = time.perf_counter() - t
    by_tokens: dict[int, list[float]] = defaultdict(list)
    for tokens, timed in calls:
        by_tokens[1 << max(0, tokens - 1).bit_length()].append(timed[0].elapsed_time(timed[1]) if cuda else timed)
    stalls = list(ops.stalls["prefill"])
    q = statistics.quantiles(tpot, n=10, method="inclusive")
    f = statistics.quantiles(ttft, n=10, method="inclusive")
    return {"spec": label, "checks": checks, "device": device, "warm_up_s": round(warm_s, 1), "window_s": round(window_s, 2), "requests": len(requests),
            "prefill_calls": len(calls), "prefill_ms": round(sum(sum(v) for v in by_tokens.values()), 1),
            "prefill_stalls": len(stalls), "prefill_stall_ms": round(sum(stalls)),
            "worst_prefill_stalls_ms": [round(ms) for ms in sorted(stalls, reverse=True)[:5]],
            "decode_stalls": len(ops.stalls["decode"]),
            "by_tokens": {f"<={k}": [len(v), round(sum(v), 1)] for k, v in sorted(by_tokens.items())},
            "tpot_ms_p50": round(q[4], 2), "tpot_ms_p90": round(q[8], 2), "ttft_ms_p50": round(f[4], 1), "ttft_ms_p90": round(f[8], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", default=DEFAULT)
    ap.add_argument("--window", type=float, default=None, help="override served.cuda.window_s")
    ap.add_argument("--one", help=argparse.SUPPRESS)            # the child: one spec, in this process
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--checks", action="store_true", help="probes, audits and spot checks at config's shares, as the replay's servers")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a.window, a.checks)))
        return
    rows = []
    for spec in a.specs:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            cmd = [sys.executable, __file__, "--one", spec] + (["--window", str(a.window)] if a.window else []) \
                + (["--checks"] if a.checks else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode:
            print(f"{spec}: exit {out.returncode}\n{out.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
