"""Benchmark (not a test): which compiled variant of a decode family's kernels each row of issue 16's table ran,
with the variant's registers, spills and shared memory, beside the row's time.

    python tests/bench/kernel_variants.py SPEC [SPEC ...] [--rows 64x4096,8x32768] [--ragged LO] [--json PATH]
    SPEC = path/to/kernel.py[:KNOB=VALUE,...]   (as tests/bench/vs_library.py)

Triton compiles a kernel once per specialisation of its arguments (an integer argument equal to 1 or divisible by
16, a pointer aligned to 16, the constexprs), so one family can run a different binary on each row. After each
row this prints the variants that row compiled (each row loads the spec afresh, so every `@triton.jit` function's
cache in that module holds that row's variants only): the function, its registers and spills per thread and its shared memory (the driver's figures
once loaded), and the specialisation key's digest. The time is do_bench's median as in vs_library.py, on the same
data (seed 0, the same decode_data). It prints numbers and asserts nothing. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import tempfile

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vs_library import DECODE_ROWS, bench, decode_data, load_spec  # noqa: E402


def jit_functions(module):
    return {name: fn for name, fn in vars(module).items() if isinstance(fn, triton.runtime.jit.JITFunction)}


def compiled(module) -> dict[tuple[str, str], object]:
    """Every compiled kernel of the module's jit functions, keyed by (function, specialisation key)."""
    found = {}
    for name, fn in jit_functions(module).items():
        for caches in fn.device_caches.values():
            for key, kernel in caches[0].items():
                found[(name, str(key))] = kernel
    return found


def describe(name: str, key: str, kernel) -> dict:
    kernel._init_handles()
    return {"fn": name, "key": hashlib.sha256(key.encode()).hexdigest()[:10], "registers": kernel.n_regs,
            "spills": kernel.n_spills, "shared_bytes": kernel.metadata.shared,
            "warps": kernel.metadata.num_warps, "stages": kernel.metadata.num_stages}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="+")
    ap.add_argument("--rows", help="comma list of BxL, e.g. 64x4096,8x32768 (default: issue 16's five)")
    ap.add_argument("--ragged", type=float, default=None, metavar="LO")
    ap.add_argument("--table-tokens", type=int, default=max(L for _, L in DECODE_ROWS))
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_variants.py needs a CUDA GPU")
        return 0
    rows = [tuple(int(x) for x in r.split("x")) for r in args.rows.split(",")] if args.rows else DECODE_ROWS
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kernel_variants_"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for B, L in rows:
        x = decode_data(B, L, args.table_tokens, gen, args.ragged)
        call = (x["q"], x["kc"], x["vc"], x["table"], x["seq_lens"], x["scale"])
        print(f"\ndecode {B} x {L}" + (f" ragged {args.ragged}" if args.ragged else ""), flush=True)
        for spec in args.specs:
            label, mod = load_spec(spec, tmp)          # a fresh module: its caches hold this row's variants only
            mod.decode(*call)
            torch.cuda.synchronize()
            ms = bench(lambda: mod.decode(*call), args.rep, x["q"])
            new = [describe(n, k, kern) for (n, k), kern in compiled(mod).items()]
            out.append({"B": B, "L": L, "kernel": label, "us": ms * 1e3, "variants": new})
            shown = "; ".join(f"{v['fn']} {v['key']} {v['registers']} regs {v['spills']} spills "
                              f"{v['shared_bytes'] / 1024:.1f} KB" for v in new) or "no variant"
            print(f"  {label[:60]:<60} {ms * 1e3:8.1f} us  {shown}", flush=True)
        del x
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
