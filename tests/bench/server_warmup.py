"""Benchmark (not a test): where a served server's warm-up spends its time, compiling or serving.

    python tests/bench/server_warmup.py [--decode FILE] [--prefill FILE]

The replay's servers each warm up before anything is timed (harness/served/engine.py `warm_up`: the fixed
requests, the served prompt lengths, each length alone, the CUDA graph captures); with the Gluon kernels that
took 54-64 s a server on an H100 (docs/BENCHMARKS.md, fifty-ninth session). Here, in this process's children
(no sandbox, no HTTP), the engine the replay's server builds (config served.cuda: its preset, its graph plan, its
dtype) with the two kernel files (default: the Gluon decode and prefill) warms up three ways:
- "cold": a fresh process and an empty Triton cache folder, then the same warm-up again in that process, where
  every kernel is compiled in memory ("again"): the difference is what compiling (and first calls) cost;
- "disk": a fresh process whose Triton cache folder the cold one filled: what a server would pay if its source's
  compiled kernels were kept from its earlier server;
- "sweep": a fresh process and another empty folder, the warm-up's served parts first swept compile-only with
  `--threads` compiles at once (`warm_up`'s `sweep`).
Prints each part's seconds and the kernels in the cache folder. GPU only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
GLUON = ("knowledge/attention/decode_gluon_sm90.py", "knowledge/attention/prefill_gluon_sm90.py")


def warm_once(decode: str, prefill: str, times: int, threads: int) -> list[dict]:
    import torch

    from harness.config import PROJECT_ROOT, load_config
    from harness.gpu_memory import server_graph_bound
    from harness.probes import Probes
    from harness.served.engine import make_engine, warm_up
    from harness.served.limits import plan_for
    from harness.served.ops import AttentionOps, load_candidate
    from harness.stages.arms import warm_lengths
    from harness.transport import DTYPES
    cfg = load_config()
    served, section = cfg.served.cuda, cfg.targets.attention.cuda
    kernels = SimpleNamespace(decode=load_candidate(ROOT / decode).decode, prefill=load_candidate(ROOT / prefill).prefill)
    probes = Probes()
    probes.install()                    # as the server does, before the kernels are called
    ops = AttentionOps(kernels, section.dtype, stall_ms=cfg.served.stall_ms, probes=probes)
    t = time.perf_counter()
    engine = make_engine(cfg.served.presets[served.preset], section.block_size, DTYPES[section.dtype], torch.device("cuda"),
                         ops, init=cfg.served.random_init, top_k=cfg.served.logprobs, root=PROJECT_ROOT,
                         graphs=plan_for(cfg, "cuda", server_graph_bound(cfg, "cuda", False)))
    out = [{"build_s": round(time.perf_counter() - t, 1)}]
    lengths = warm_lengths(cfg, "cuda")
    for i in range(times):
        t = time.perf_counter()
        parts = warm_up(engine, lengths, served.warm_requests, served.warm_passes,
                        sweep=(lambda: probes.compiling(threads)) if threads else None)
        torch.cuda.synchronize()
        out.append({k: round(v, 1) for k, v in parts.items()} | {"total_s": round(time.perf_counter() - t, 1)})
    return out


def child(cache: str, decode: str, prefill: str, times: int, threads: int) -> list[dict] | str:
    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "--child", str(times), "--threads", str(threads), "--decode", decode,
                           "--prefill", prefill],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        return f"exit {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", default=GLUON[0])
    ap.add_argument("--prefill", default=GLUON[1])
    ap.add_argument("--threads", type=int, default=8, help="the sweep's compiles at once")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(warm_once(a.decode, a.prefill, a.child, a.threads)))
        return
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as fresh:
        for label, folder, times, threads in (("cold, then again", cache, 2, 0), ("disk", cache, 1, 0),
                                              (f"sweep ({a.threads} threads)", fresh, 1, a.threads)):
            t = time.perf_counter()
            got = child(folder, a.decode, a.prefill, times, threads)
            wall = time.perf_counter() - t
            if isinstance(got, str):
                print(f"{label}: {got}")
                return
            kernels = sum(1 for p in Path(folder).rglob("*.cubin"))
            print(f"{label}: process {wall:.1f} s; build {got[0]['build_s']} s; "
                  + " | ".join(", ".join(f"{k} {v}" for k, v in parts.items()) for parts in got[1:])
                  + f"; {kernels} cubins in the cache folder", flush=True)


if __name__ == "__main__":
    main()
