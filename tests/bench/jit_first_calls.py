"""Benchmark (not a test): does a kernel file compile again on shapes the served warm-up never showed it?

    python tests/bench/jit_first_calls.py [--prefill knowledge/attention/prefill_causal_tiled.py]
                                          [--decode knowledge/attention/decode_paged_splitkv.py]

Triton specializes integer arguments (equal to 1, divisible by 16) and a kernel file may pick constexprs
from the shape, so a shape class the warm-up did not cover compiles during the timed replay and stalls
every request in the batch. This calls each op first on the shapes of the served warm-up's fixed part
(prompts 1, 15, 17, 35, 100 in one prefill; decode batches 5..1 on short contexts; until 2026-11-30 the
whole warm-up), then on served-like shapes, and prints each call's wall time: first call and a repeat.
tests/bench/served_stalls.py measures the whole warm-up in the engine. A first call far above its repeat is a
compile inside the served window. GPU only; the figures are wall times of single calls, not kernel times.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.served.ops import load_candidate  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def prefill_case(mod, lengths, hq=16, hkv=8, d=128):
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    n = sum(lengths)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return lambda: mod.prefill(q, k, v, cu, max(lengths), d ** -0.5)


def decode_case(mod, lens, hq=16, hkv=8, d=128, page=16):
    pages = [(n + page - 1) // page for n in lens]
    width = max(pages)
    kc = torch.randn(sum(pages) + 1, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    at = 0
    for i, p in enumerate(pages):
        table[i, :p] = torch.arange(at, at + p, dtype=torch.int32)
        at += p
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return lambda: mod.decode(q, kc, vc, table, sl, d ** -0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="knowledge/attention/prefill_causal_tiled.py")
    ap.add_argument("--decode", default="knowledge/attention/decode_paged_splitkv.py")
    a = ap.parse_args()
    p, dmod = load_candidate(a.prefill), load_candidate(a.decode)
    rows = [("prefill", "warm-up: 1,15,17,35,100", prefill_case(p, [1, 15, 17, 35, 100]))]
    rows += [("decode", f"warm-up: batch {b}, contexts <= 108", decode_case(dmod, [8 + 20 * i for i in range(b)])) for b in (5, 4, 3, 2, 1)]
    rows += [("prefill", "one prompt of 40", prefill_case(p, [40])),
             ("prefill", "one prompt of 1000", prefill_case(p, [1000])),
             ("prefill", "one prompt of 2048", prefill_case(p, [2048])),
             ("prefill", "three prompts 3000..9000", prefill_case(p, [3000, 6000, 9000])),
             ("decode", "batch 8, contexts 2000..4000", decode_case(dmod, [2000 + 250 * i for i in range(8)])),
             ("decode", "batch 16, contexts 2000..4000", decode_case(dmod, [2000 + 125 * i for i in range(16)])),
             ("decode", "batch 32, contexts 1024..2048", decode_case(dmod, [1024 + 32 * i for i in range(32)])),
             ("decode", "batch 7, contexts 16000..30000", decode_case(dmod, [16000 + 2000 * i for i in range(7)]))]
    print(f"{'op':8} {'shape':36} {'first ms':>10} {'repeat ms':>10}")
    for op, name, fn in rows:
        first = timed(fn)
        again = min(timed(fn) for _ in range(3))
        print(f"{op:8} {name:36} {first:10.1f} {again:10.2f}")


if __name__ == "__main__":
    main()
