"""Benchmark (not a test): kevo's attention kernels side by side with the library (issue 16's table).

    python tests/bench/vs_library.py [SPEC ...] [--run runs/<id> ...] [--json PATH] [--only decode|prefill] [--rows 32x4096,...] [--graphs]
    SPEC = path/to/kernel.py[:KNOB=VALUE,KNOB=VALUE...]   (repeatable; knob lines rewritten in a temp copy)

With no SPEC it times the two reference kernels (knowledge/attention/decode_paged_splitkv.py,
prefill_causal_tiled.py). `--run DIR` adds a run's current heads and best kernels as its ledger holds them now
(the files DIR/heads/<op>.json names, DIR/best/<op>.py; labelled `<run>:<ref>`, e.g. `h200-b:c002`). Every kernel, cuDNN SDPA and flash SDPA run in this one process on the same
data: bf16, 32 query / 8 kv heads (`--heads`), head_dim 128; the median of `triton.testing.do_bench`'s protocol (its L2
flush before each call), each call on a fresh query (since 2026-12-05: `bench`).
Decode: kevo reads a paged cache (block 16, shuffled pages, a block table `--table-tokens` wide, by
default as wide as the longest row, as a server sizes it; its unused entries point at random pages),
the library reads the same values as contiguous [B, kv heads, L, D] K/V. Prefill: causal, equal
lengths, kevo packed (cu_seqlens), the library one batched [B, H, N, D] call. Figures: decode TB/s
(K/V bytes once, q and out), prefill causal TFLOP/s (4 x D x N(N+1)/2 x H x B), kevo/cuDNN, and a
correctness column, rel L2 against an fp32 reference (decode all heads; prefill the first and last four),
the worse of the first call and one after the timed calls. The library is timed before and after
the row's kernels and counted at its faster time (clock or thermal drift never favours kevo).
--graphs times every call (kevo's and the library's) as the replay of one CUDA graph captured from it,
so the host's Python and launch cost leave the figure (one graph launch stays), as in the served
engine's decode; a call that cannot be captured is an error in its cell, not an eager figure.
--pages in-order gives each sequence consecutive pages of the pool (the served layout, [page, 16, kv heads, D],
unscattered): what kevo loses to the scatter, apart from the layout. --page-layout hnd stores each page head-major,
[page, kv heads, 16, D], and hands the kernel the same [page, 16, kv heads, D] view by strides (one kv head's 16
tokens 4 KB contiguous, as the library's per-head rows are): what the served layout itself costs a kernel.
It prints numbers and asserts nothing. Needs only torch and triton (runs on the H200 image as is).
"""
from __future__ import annotations

import argparse
import datetime
import os
import importlib.util
import json
import math
import pathlib
import re
import statistics
import sys
import tempfile
import traceback
import uuid

if "--dry-run" in sys.argv:          # the CPU check of this script: interpreter, float32, tiny rows
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF_DECODE = ROOT / "knowledge" / "attention" / "decode_paged_splitkv.py"
REF_PREFILL = ROOT / "knowledge" / "attention" / "prefill_causal_tiled.py"
DECODE_ROWS = [(32, 4096), (64, 4096), (128, 1024), (8, 32768), (16, 8192)]
PREFILL_ROWS = [(1, 1024), (4, 2048), (1, 8192), (8, 4096)]
HQ, HKV, D, PAGE = 32, 8, 128, 16
REF_HEADS = [0, 1, 2, 3, 28, 29, 30, 31]
DEV, DT = "cuda", torch.bfloat16
GRAPHS = False                       # --graphs: time the replay of a CUDA graph of each call
PAGES_IN_ORDER = False               # --pages in-order: each sequence's pages consecutive in the pool
HEAD_MAJOR_PAGES = False             # --page-layout hnd: pages stored [kv heads, 16, D], seen through a strided view


def run_specs(run: pathlib.Path) -> list[tuple[str, str]]:
    """(spec, label) for a run's current heads (heads/<op>.json names each one's file: a first head, or the last
    accepted candidate) and its best kernels (best/<op>.py) where those are other files, labelled by the run and
    the ledger's name for each (`h200-b:head:decode`, `h200-b:c002`, `h200-b:best/prefill`)."""
    found, seen = [], set()
    for meta in sorted((run / "heads").glob("*.json")):
        head = json.loads(meta.read_text())
        path = run / head["path"]
        found.append((str(path), f"{run.name}:{head['ref']}"))
        seen.add(path.read_bytes())
    for best in sorted((run / "best").glob("*.py")):
        if best.read_bytes() not in seen:
            found.append((str(best), f"{run.name}:best/{best.stem}"))
    if not found:
        raise SystemExit(f"--run {run}: no heads/*.json there (a kevo run folder: runs/<id>)")
    return found


def load_spec(spec: str, tmp: pathlib.Path, label: str | None = None):
    """(label, module) for `path[:K=V,...]`; knob lines `^K = ...` are rewritten in a temp copy."""
    path, _, knob_text = spec.partition(":")
    path = pathlib.Path(path)
    if not path.is_file():
        raise SystemExit(f"{spec}: no kernel file {path}")
    text = path.read_text()
    knobs = {}
    for item in filter(None, knob_text.split(",")):
        name, _, value = item.partition("=")
        value = {"True": True, "False": False}.get(value, value)
        if isinstance(value, str):
            try:
                value = float(value) if "." in value else int(value)
            except ValueError:
                raise SystemExit(f"{spec}: knob {name} needs True, False or a number, not {value!r}") from None
        pattern = re.compile(rf"^({name}) = ([^#\n]*?)(\s*#.*)?$", re.MULTILINE)
        text, n = pattern.subn(lambda m: f"{m.group(1)} = {value!r}{m.group(3) or ''}", text, count=1)
        if n != 1:
            raise SystemExit(f"{spec}: knob {name} not found in {path}")
        knobs[name] = value
    target = tmp / f"{path.stem}_{uuid.uuid4().hex[:8]}.py"
    target.write_text(text)
    mod_spec = importlib.util.spec_from_file_location(target.stem, target)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    label = (label or path.stem) + ("[" + ",".join(f"{k}={v}" for k, v in knobs.items()) + "]" if knobs else "")
    return label, module


def bench(fn, rep, q=None):
    """The median ms of fn over about `rep` ms of calls (`triton.testing.do_bench`'s protocol: the 256 MB flush
    before each call, a warmup of a quarter of `rep`, 10 ms at least, events around each call). With `q` (a query
    tensor fn reads), each call is on a fresh query, written into q before the flush and outside the call's events,
    as microbench does (harness/worker_timing.py), so that a kernel keeping its output for inputs it saw before
    (tests/adversarial/content_cache_prefill.py) is timed doing the work; q is restored afterwards for the
    correctness check."""
    if DEV == "cpu":
        import time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    if GRAPHS:
        fn = graphed(fn)
    if q is None:
        return triton.testing.do_bench(fn, warmup=max(10, rep // 4), rep=rep, return_mode="median")
    base, flush = q.clone(), torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=q.device)

    def timed(n):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            q.copy_(torch.randn(q.shape, device=q.device, dtype=torch.float32))
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    estimate = statistics.median(timed(5))
    timed(max(1, int(max(10, rep // 4) / estimate)))
    times = timed(max(1, int(rep / estimate)))
    q.copy_(base)
    return statistics.median(times)


def graphed(fn):
    """The replay of a CUDA graph captured from one call of fn (warmed first on a side stream, so that
    compiles, library plan choices and first-call buffers happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def rel_l2(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


def cudnn_sdpa(q, k, v, causal, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def flash_sdpa(q, k, v, causal, scale):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def library(name, fn, lib, causal, scale, rep):
    """(output, ms, note): the call on the given K/V; if it refuses GQA, on K/V expanded beforehand."""
    try:
        out = fn(*lib, causal, scale)
    except RuntimeError:
        q, k, v = lib
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out = fn(q, k, v, causal, scale)
        return out, bench(lambda: fn(q, k, v, causal, scale), rep, q), "K/V expanded to the q heads before timing"
    return out, bench(lambda: fn(*lib, causal, scale), rep, lib[0]), ""


def time_library(row, lib, causal, scale, rep, err_of, work, unit):
    """cuDNN and flash SDPA on the row's data. Called before the kernels (err_of given: checks the
    output) and again after them (err_of None); a library's figure is its faster time of the two, so
    that clock or thermal drift across a row never favours kevo, and kevo/cuDNN is set from it."""
    for name, fn in (("cudnn", cudnn_sdpa), ("flash", flash_sdpa)):
        if err_of is None and "ms" not in row.get(name, {}):
            continue
        try:
            out, ms, note = library(name, fn, lib, causal, scale, rep)
        except Exception as e:  # a library path missing on this build: recorded, not fatal
            row[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:160]}
            continue
        if err_of is not None:
            row[name] = {"ms": ms, unit: work / ms, "relL2": err_of(out), "ms_before": ms}
            if note:
                row[name]["note"] = note
        else:
            e = row[name]
            e["ms_after"] = ms
            e["ms"] = min(e["ms_before"], ms)
            e[unit] = work / e["ms"]
    if err_of is None and "ms" in row.get("cudnn", {}):
        for entry in row["kernels"].values():
            if "ms" in entry:
                entry["vs_cudnn"] = entry[unit] / row["cudnn"][unit]     # rates: a ragged row's bytes differ a little


def decode_data(B, L, table_tokens, gen, ragged=None):
    """One decode row: every sequence L tokens, or with `ragged` lo (0 < lo <= 1) lengths drawn uniformly from
    [lo x L, L] (kevo reads exactly those; the library reads contiguous K/V of their mean length: the bytes
    the paged call reads, as the microbench's anchor)."""
    dev = DEV
    q = torch.randn(B, HQ, D, device=dev, generator=gen).to(DT)
    k = torch.randn(B, L, HKV, D, device=dev, generator=gen).to(DT)   # contiguous truth
    v = torch.randn(B, L, HKV, D, device=dev, generator=gen).to(DT)
    pages = L // PAGE
    width = max(pages, -(-table_tokens // PAGE))
    pool = B * pages + 64
    perm = torch.arange(pool, device=dev) if PAGES_IN_ORDER else torch.randperm(pool, device=dev, generator=gen)
    table = torch.randint(0, pool, (B, width), device=dev, generator=gen, dtype=torch.int32)
    table[:, :pages] = perm[:B * pages].view(B, pages).to(torch.int32)
    kc = torch.randn(pool, PAGE, HKV, D, device=dev, generator=gen).to(DT)  # spare pages: noise
    vc = torch.randn_like(kc)
    if HEAD_MAJOR_PAGES:     # the same values, each page stored head-major; the kernel sees [pool, PAGE, HKV, D]
        kc, vc = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (kc, vc))
    idx = table[:, :pages].reshape(-1).long()
    kc[idx] = k.view(B * pages, PAGE, HKV, D)
    vc[idx] = v.view(B * pages, PAGE, HKV, D)
    seq_lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    if ragged is not None:
        seq_lens = torch.randint(max(1, math.ceil(ragged * L)), L + 1, (B,), device=dev, generator=gen, dtype=torch.int32)
    scale = 1.0 / math.sqrt(D)
    # fp32 reference on the contiguous truth, each sequence to its length
    qg = q.float().view(B, HKV, HQ // HKV, D)
    s = torch.einsum("bkgd,blkd->bkgl", qg, k.float()) * scale
    s = s.masked_fill(torch.arange(L, device=dev)[None, None, None, :] >= seq_lens[:, None, None, None], float("-inf"))
    ref = torch.einsum("bkgl,blkd->bkgd", s.softmax(-1), v.float()).reshape(B, HQ, D)
    n = L if ragged is None else round(float(seq_lens.float().mean()))
    lib = (q[:, :, None, :].contiguous(), k[:, :n].transpose(1, 2).contiguous(), v[:, :n].transpose(1, 2).contiguous())
    return dict(q=q, kc=kc, vc=vc, table=table, seq_lens=seq_lens, scale=scale, ref=ref, lib=lib, lib_len=n)


def prefill_data(B, N, gen):
    dev = DEV
    q = torch.randn(B * N, HQ, D, device=dev, generator=gen).to(DT)
    k = torch.randn(B * N, HKV, D, device=dev, generator=gen).to(DT)
    v = torch.randn(B * N, HKV, D, device=dev, generator=gen).to(DT)
    cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * N
    scale = 1.0 / math.sqrt(D)
    lib = tuple(t.view(B, N, -1, D).transpose(1, 2).contiguous() for t in (q, k, v))
    heads = torch.tensor(REF_HEADS, device=dev)
    ref = torch.empty(B, len(REF_HEADS), N, D, device=dev)
    causal = torch.ones(N, N, device=dev, dtype=torch.bool).tril()
    for b in range(B):
        for i, h in enumerate(REF_HEADS):
            qh = lib[0][b, h].float()
            kh, vh = lib[1][b, h // (HQ // HKV)].float(), lib[2][b, h // (HQ // HKV)].float()
            s = (qh @ kh.T * scale).masked_fill(~causal, float("-inf"))
            ref[b, i] = s.softmax(-1) @ vh
    return dict(q=q, k=k, v=v, cu=cu, N=N, scale=scale, ref=ref, lib=lib, heads=heads)


def run_decode(kernels, rows, table_tokens, rep, gen, ragged=None):
    results = []
    for B, L in rows:
        x = decode_data(B, L, table_tokens, gen, ragged)
        nbytes = 2 * int(x["seq_lens"].sum()) * HKV * D * 2 + 2 * B * HQ * D * 2
        lib_bytes = 2 * B * x["lib_len"] * HKV * D * 2 + 2 * B * HQ * D * 2
        row = {"B": B, "L": L, "table_tokens": x["table"].shape[1] * PAGE, "bytes": nbytes, "kernels": {}}
        if ragged is not None:
            row.update(ragged=ragged, lengths=x["seq_lens"].tolist(), library_length=x["lib_len"])
        lib = x["lib"]
        # ragged: the library runs other data (the mean length), so it has no error column
        lib_err = (lambda o: rel_l2(o[:, :, 0], x["ref"])) if ragged is None else (lambda o: float("nan"))
        time_library(row, lib, False, x["scale"], rep, lib_err, lib_bytes / 1e9, "TBps")
        for label, mod in kernels:
            if not hasattr(mod, "decode"):
                continue
            args = (x["q"], x["kc"], x["vc"], x["table"], x["seq_lens"], x["scale"])
            try:
                out = mod.decode(*args)
                sync()
                err = rel_l2(out, x["ref"])
                ms = bench(lambda: mod.decode(*args), rep, x["q"])
                err = max(err, rel_l2(mod.decode(*args), x["ref"]))   # again after the timed calls
                entry = {"ms": ms, "TBps": nbytes / ms / 1e9, "relL2": err}
            except Exception as e:
                entry = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
                traceback.print_exc(limit=2)
            row["kernels"][label] = entry
        time_library(row, lib, False, x["scale"], rep, None, lib_bytes / 1e9, "TBps")
        results.append(row)
        del x
        if DEV == "cuda":
            torch.cuda.empty_cache()
        print_row("decode", row, "TBps", flush=True)
    return results


def run_prefill(kernels, rows, rep, gen):
    results = []
    for B, N in rows:
        x = prefill_data(B, N, gen)
        flops = 4 * D * N * (N + 1) / 2 * HQ * B
        row = {"B": B, "N": N, "flops": flops, "kernels": {}}
        lib, heads = x["lib"], x["heads"]
        time_library(row, lib, True, x["scale"], rep, lambda o: rel_l2(o[:, heads], x["ref"]), flops / 1e9, "TFLOPs")
        for label, mod in kernels:
            if not hasattr(mod, "prefill"):
                continue
            args = (x["q"], x["k"], x["v"], x["cu"], N, x["scale"])
            try:
                out = mod.prefill(*args)
                sync()
                err = rel_l2(out.view(B, N, HQ, D).transpose(1, 2)[:, heads], x["ref"])
                ms = bench(lambda: mod.prefill(*args), rep, x["q"])
                err = max(err, rel_l2(mod.prefill(*args).view(B, N, HQ, D).transpose(1, 2)[:, heads], x["ref"]))
                entry = {"ms": ms, "TFLOPs": flops / ms / 1e9, "relL2": err}
            except Exception as e:
                entry = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
                traceback.print_exc(limit=2)
            row["kernels"][label] = entry
        time_library(row, lib, True, x["scale"], rep, None, flops / 1e9, "TFLOPs")
        results.append(row)
        del x
        if DEV == "cuda":
            torch.cuda.empty_cache()
        print_row("prefill", row, "TFLOPs", flush=True)
    return results


def _cell(e, unit):
    if "error" in e:
        return f"ERR {e['error'][:60]}"
    ratio = f"  {e['vs_cudnn']:.3f}x" if "vs_cudnn" in e else ""
    return f"{e['ms'] * 1e3:8.1f} us {e[unit]:7.2f} {unit}  relL2 {e['relL2']:.1e}{ratio}"


def print_row(op, row, unit, flush=False):
    shape = f"{row['B']} x {row.get('L', row.get('N'))}"
    extra = f" (table {row['table_tokens']} tokens)" if "table_tokens" in row else ""
    print(f"\n{op} {shape}{extra}", flush=flush)
    for name in ("cudnn", "flash"):
        e = row[name]
        drift = (f"  (before {e['ms_before'] * 1e3:.1f} us, after {e['ms_after'] * 1e3:.1f} us)"
                 if "ms_after" in e else "")
        print(f"  {name:<58} {_cell(e, unit)}{drift}")
    ok = {k: e for k, e in row["kernels"].items() if "ms" in e}
    best = min(ok, key=lambda k: ok[k]["ms"]) if ok else None
    for label, e in row["kernels"].items():
        mark = "*" if label == best else " "
        print(f" {mark}{label[:58]:<58} {_cell(e, unit)}", flush=flush)


def summary(decode, prefill):
    print("\n| op | B x len | best kevo kernel | kevo | cuDNN | flash | kevo / cuDNN | relL2 |")
    print("|---|---|---|---|---|---|---|---|")
    for op, rows, unit in (("decode", decode, "TBps"), ("prefill", prefill, "TFLOPs")):
        for row in rows:
            ok = {k: e for k, e in row["kernels"].items() if "ms" in e}
            if not ok:
                continue
            best = min(ok, key=lambda k: ok[k]["ms"])
            e, c, f = ok[best], row["cudnn"], row["flash"]
            fmt = (lambda r: f"{r[unit]:.2f}" if "ms" in r else "ERR")
            print(f"| {op} | {row['B']} x {row.get('L', row.get('N'))} | {best} | {e[unit]:.2f} | {fmt(c)} | "
                  f"{fmt(f)} | {e.get('vs_cudnn', float('nan')):.3f} | {e['relL2']:.1e} |")


def copy_ceiling():
    if DEV == "cpu":
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), 100)
    return 2 * a.numel() / ms / 1e9


def main(argv=None):
    global DEV, DT, DECODE_ROWS, PREFILL_ROWS, GRAPHS, PAGES_IN_ORDER, HEAD_MAJOR_PAGES, HQ, HKV, REF_HEADS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", help="kernel file[:KNOB=VALUE,...]; default: the reference kernels")
    ap.add_argument("--run", type=pathlib.Path, action="append", default=[],
                    help="a run folder (runs/<id>): add its heads and best kernels (repeatable)")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--only", choices=["decode", "prefill"])
    ap.add_argument("--rows", help="comma list of BxL to keep, e.g. 32x4096,1x8192")
    ap.add_argument("--decode-rows", help="comma list of BxL timed in place of issue 16's decode rows, e.g. "
                                          "16x1024,16x8192")
    ap.add_argument("--table-tokens", type=int, default=max(L for _, L in DECODE_ROWS),
                    help="decode block-table width in tokens (at least each row's length)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--ragged", type=float, default=None, metavar="LO",
                    help="decode lengths drawn from [LO x L, L] per row (the library: contiguous K/V of their mean)")
    ap.add_argument("--no-refs", action="store_true", help="do not add the two reference kernels")
    ap.add_argument("--graphs", action="store_true",
                    help="time each call as a CUDA graph replay (no host Python or launch cost in the figure)")
    ap.add_argument("--dry-run", action="store_true",
                    help="check this script on the CPU: Triton's interpreter, float32, tiny rows, no timing")
    ap.add_argument("--pages", choices=["shuffled", "in-order"], default="shuffled",
                    help="decode: each sequence's pages drawn at random from the pool (default), or consecutive")
    ap.add_argument("--heads", default=f"{HQ}x{HKV}", metavar="QxKV",
                    help="query x kv heads (the served model's: 16x8; default the issue's 32x8)")
    ap.add_argument("--page-layout", choices=["nhd", "hnd"], default="nhd",
                    help="decode: pages stored [16, kv heads, D] (default, served) or head-major [kv heads, 16, D]")
    args = ap.parse_args(argv)
    try:
        HQ, HKV = (int(n) for n in args.heads.split("x"))
    except ValueError:
        raise SystemExit(f"--heads {args.heads!r}: query x kv heads, e.g. 16x8") from None
    if HKV < 1 or HQ < HKV or HQ % HKV:
        raise SystemExit(f"--heads {args.heads}: the query heads must be a multiple of the kv heads")
    REF_HEADS = sorted({h % HQ for h in (0, 1, 2, 3, -4, -3, -2, -1)})
    GRAPHS, PAGES_IN_ORDER = args.graphs, args.pages == "in-order"
    HEAD_MAJOR_PAGES = args.page_layout == "hnd"
    if args.decode_rows:
        DECODE_ROWS = [tuple(int(n) for n in row.split("x")) for row in args.decode_rows.split(",")]
        args.table_tokens = max(args.table_tokens, max(L for _, L in DECODE_ROWS))
    if args.dry_run:
        DEV, DT = "cpu", torch.float32
        DECODE_ROWS, PREFILL_ROWS = [(2, 48)], [(2, 40)]
        args.table_tokens = 96
    elif not torch.cuda.is_available():
        print("vs_library.py needs a CUDA GPU (or --dry-run)")
        return 0
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="vs_library_"))
    named = [(s, None) for s in ([] if args.no_refs else [str(REF_DECODE), str(REF_PREFILL)]) + list(args.specs)]
    named += [pair for run in args.run for pair in run_specs(run)]
    specs = [s for s, _ in named]
    kernels = [load_spec(s, tmp, label) for s, label in named]
    keep = set(args.rows.split(",")) if args.rows else None
    pick = lambda rows: [r for r in rows if keep is None or f"{r[0]}x{r[1]}" in keep]  # noqa: E731
    gen = torch.Generator(device=DEV).manual_seed(0)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "triton": triton.__version__,
            "specs": specs, "argv": sys.argv[1:], "timing": "cuda-graph replay" if GRAPHS else "eager calls",
            "pages": args.pages, "page_layout": args.page_layout, "heads": [HQ, HKV]}
    info["copy_TBps"] = copy_ceiling()
    print(f"{info['gpu']}  torch {info['torch']}  triton {info['triton']}  copy {info['copy_TBps']:.2f} TB/s  "
          f"timing: {info['timing']}  pages: {args.pages}, {args.page_layout}")
    decode = [] if args.only == "prefill" else run_decode(kernels, pick(DECODE_ROWS), args.table_tokens,
                                                          args.rep, gen, args.ragged)
    prefill = [] if args.only == "decode" else run_prefill(kernels, pick(PREFILL_ROWS), args.rep, gen)
    summary(decode, prefill)
    if args.json:
        args.json.write_text(json.dumps({**info, "decode": decode, "prefill": prefill}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
