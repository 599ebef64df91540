"""Compile check (not a test): build a decode family's kernel (decode_paged_gqa.py, decode_paged_lean.py, the
reference decode_paged_splitkv.py, the Gluon decode_gluon_sm90.py), the TMA prefill family's (prefill_causal_tma.py)
or the Gluon prefill's (knowledge/attention/prefill_gluon_sm90.py) for sm90 on a machine without a GPU, with Triton's bundled ptxas, and print its
registers, stack (spills) and shared memory per program, its warpgroup MMAs (wgmma): how many the kernel
issues and how its waits leave them in flight, and its SASS (Triton's bundled nvdisasm): how many instructions,
and how many of them byte permutes (PRMT, the Gluon prefill's P repacked: its knob PACKED_CVT).

    python tests/bench/sm90_compile.py [--batch B] [SPEC ...]      SPEC as in vs_library.py: path[:KNOB=VALUE,...]
    python tests/bench/sm90_compile.py --same-code-as OLD.py SPEC   whether a change kept the PTX a figure was
                                                                    measured on (OLD.py: `git show REV:PATH`)

It covers the issue-16 bench shape only: bf16, a GQA group of 4 (32 q / 8 kv heads), head_dim 128; decode with
page 16, several splits (partials); prefill through tensor descriptors (the bench's packed tokens pass
TMA_MIN_TOKENS); every stride a multiple of 16 and a unit stride the constant 1, as a launch on those tensors
specialises them. The figures are the compiler's, not a measurement: how many programs fit per SM follows from
them (65,536 registers and 228 KB of shared memory per SM on the H200). A wait's `pendings` is how many wgmma
it lets stay in flight: with 0 everywhere, no tensor-core product runs beside the warps' own work once they wait
(in the TMA family's loop only P V, a loop-carried accumulator, stays in flight, until the next tile's wait).
Needs only torch and triton.
"""
from __future__ import annotations

import argparse
import collections
import difflib
import os
import pathlib
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)          # the real compiler, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vs_library import load_spec  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from harness.replies import KernelUse  # noqa: E402
from harness.stages.launched import programs_per_sm  # noqa: E402
DEFAULT = ROOT / "knowledge" / "attention" / "decode_paged_gqa.py"
WAIT = re.compile(r"warp_group_dot_wait .*\{pendings = (\d+) : i32\}")
SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")   # an instruction's opcode
SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
SASS_BACK = re.compile(r"BRA\s.*?`\((\.L_x_\d+)\)")     # a branch to a label (a loop where the label is earlier)
POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "seqlens_ptr": "*i32",
            "out_ptr": "*bf16", "po_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "ticket_ptr": "*i32",
            "chosen_ptr": "*i32"}
# strides of 1 on the bench's contiguous tensors, which a launch specialises as the constant 1 (the reference's)
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_pod", "stride_btp")
CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_split_kernel(mod, batch=32):
    """(registers, stack bytes, shared bytes) of the module's decode kernel (decode_paged_gqa.py's
    `_split_kernel`, decode_paged_lean.py's `_lean_kernel`, the reference decode_paged_splitkv.py's
    `_decode_split_kernel`) at the bench shape, `batch` sequences (as a launch specialises it: BLOCK_B its next
    power of two, `batch` marked a multiple of 16 when it is one, unit strides the constant 1) and mod's
    knobs, with the register cap the module launches it with (`register_cap()`, where it has one)."""
    fn = getattr(mod, "_split_kernel", None) or getattr(mod, "_lean_kernel", None) or mod._decode_split_kernel
    names = fn.arg_names
    page, block_n = 16, mod.BLOCK_N
    knob = lambda name, default=0: getattr(mod, name, default)  # noqa: E731
    consts = dict(GROUP=4, BLOCK_G=16, GP=4, HEAD_DIM=128, BLOCK_N=block_n, PAGE_SIZE=page,
                  PAGES=max(1, block_n // page), PAGE_LOADS=bool(knob("PAGE_LOADS")) and block_n % page == 0,
                  KV_TMA=bool(knob("KV_TMA")) and block_n % page == 0,
                  PREFETCH=bool(knob("PREFETCH")) and not (knob("KV_TMA") and block_n % page == 0),
                  SINGLE=knob("MAX_SPLITS", 2) == 1, FUSED=bool(knob("FUSED_COMBINE")) and knob("MAX_SPLITS") != 1,
                  SPLIT_CHUNK=2, CG=True, DOT_PRECISION="tf32", PERSISTENT=bool(knob("PERSISTENT")),
                  BLOCK_B=triton.next_power_of_2(batch), MERGE_CHUNK=knob("MERGE_CHUNK", 8), SEPARATE=bool(knob("MERGE_LAUNCH")),
                  SINGLE_SPLIT=False, **dict.fromkeys(UNIT_STRIDES, 1))
    consts = {k: v for k, v in consts.items() if k in names}
    desc = f"tensordesc<bf16[{page}, 128]>" if consts.get("KV_TMA") else "*bf16"   # KV_TMA: a page a copy
    sig = {n: POINTERS.get(n) or ("constexpr" if n in consts else "fp32" if n == "qk_scale" else
                                  desc if n.endswith("_desc") else "i32") for n in names}
    attrs = [n for n in names if n in POINTERS or (n.startswith("stride_") and n not in consts) or (n == "batch" and batch % 16 == 0)]
    cap = mod.register_cap() if hasattr(mod, "register_cap") else None
    return _compile(fn, sig, consts, attrs, mod, cap, stages=1 if consts.get("PREFETCH") else None)


def compile_prefill_kernel(mod):
    """A prefill kernel at the bench shape, its Q/K/V through tensor descriptors: the TMA family's
    `_prefill_kernel` (Triton) or prefill_gluon_sm90.py's (Gluon: descriptors carry their shared layouts)."""
    fn = mod.kernel() if hasattr(mod, "kernel") else mod._prefill_kernel
    names = fn.arg_names
    gluon = getattr(fn, "is_gluon", lambda: False)()
    options = mod.launch_options() if hasattr(mod, "launch_options") else {}
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_M=mod.BLOCK_M, BLOCK_N=mod.BLOCK_N, TMA=True,
                  HEAVY_FIRST=bool(getattr(mod, "HEAVY_FIRST", True)), WS=bool(getattr(mod, "WARP_SPECIALIZE", False)),
                  LAZY=bool(getattr(mod, "LAZY_RESCALE", False)), LAZY_LOG2=8.0, DOT_PRECISION="tf32",
                  STAGES=getattr(mod, "NUM_STAGES", 1), num_warps=options.get("num_warps", mod.NUM_WARPS))
    consts = {k: v for k, v in consts.items() if k in names}
    consts.update({n: getattr(mod, n) for n in names if n.isupper() and n not in consts and hasattr(mod, n)})
    if "WALK" in names:
        consts["WALK"] = mod.walk()     # the Gluon family's walk, from its knobs
    q_layout, kv_layout = (f",{layout!r}" for layout in mod.layouts(128)) if gluon else ("", "")
    descs = {"q": f"tensordesc<bf16[{mod.BLOCK_M}, 128]{q_layout}>", "k": f"tensordesc<bf16[{mod.BLOCK_N}, 128]{kv_layout}>",
             "v": f"tensordesc<bf16[{mod.BLOCK_N}, 128]{kv_layout}>", "o_ptr": "*bf16", "cu_ptr": "*i32",
             "work_ptr": "*i32", "counter_ptr": "*i32"}      # (counter_ptr: the same argument before 2026-12-05)
    sig = {n: "constexpr" if n in consts else descs.get(n.split("_")[0] if n.endswith(("_src", "_desc")) else n)
           or ("fp32" if n == "qk_scale" else "i32") for n in names}
    attrs = [n for n in names if sig[n].startswith("*") or n.startswith("stride_")]
    return _compile(fn, sig, consts, attrs, mod, options.get("maxnreg"), options.get("num_warps", mod.NUM_WARPS))


def compile_gluon_decode(mod, batch=32):
    """The Gluon decode family's kernel (knowledge/attention/decode_gluon_sm90.py) at the bench shape, `batch`
    sequences: pages of 16 through tensor descriptors, several splits (partials; FUSED_COMBINE: merged in the
    kernel, 8 splits in the grid; LEAN: equal stretches, pieces merged in the kernel; LONGEST_FIRST: the
    sequences' ranks as many lanes as the batch takes; SPLITS_FROM_LENGTHS: the choice, where the batch's plan at
    32k tokens has one)."""
    fn = mod._decode_kernel
    shape = getattr(mod, "kernel_shape", lambda hq, hkv, page: (hq // hkv, 1, hkv, mod.BLOCK_N))
    rows, kv_heads, _, block_n = shape(32, 8, 16)
    layout = mod.gl.NVMMASharedLayout.get_default_for([block_n * kv_heads, 128], mod.gl.bfloat16)
    consts = dict(GROUP=rows, HEAD_DIM=128, BLOCK_N=block_n, PAGE=16, STAGES=mod.NUM_STAGES, SINGLE=False,
                  KV_HEADS=kv_heads, FUSED=bool(getattr(mod, "FUSED_COMBINE", False)),
                  LEAN=bool(getattr(mod, "LEAN", False)), RB=getattr(mod, "rank_lanes", lambda b: 0)(batch),
                  ITEM_COST=getattr(mod, "ITEM_COST_TOKENS", 0))
    if hasattr(mod, "split_range"):     # SPLITS_FROM_LENGTHS: the plan 8 x 32k takes on 132 programs, where it chooses
        lo, hi = mod.split_range(batch, 8, 32768, 132) if batch <= 32 else (1, 1)
        consts["CHOOSE"] = lo < hi
    if hasattr(mod, "fused_merge_shape"):
        consts["GP"], consts["SPLIT_CHUNK"] = mod.fused_merge_shape(rows, 8)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    desc = f"tensordesc<bf16[{16 * kv_heads}, 128],{layout!r}>"
    sig = {n: "constexpr" if n in consts else desc if n.endswith("_desc") else POINTERS.get(n)
           or ("fp32" if n == "qk_scale" else "i32") for n in fn.arg_names}
    options = mod.launch_options()
    attrs = [n for n in fn.arg_names if sig[n].startswith("*") or n.startswith("stride_")]
    return _compile(fn, sig, consts, attrs, mod, options["maxnreg"], options["num_warps"])


def _compile(fn, sig, consts, divisible, mod, cap, num_warps=None, stages=None):
    """(registers, stack bytes, shared bytes, wgmma issued, Counter of its waits' pendings, PTX) for sm90; `stages`:
    the pipelining depth the module launches with where it is not its NUM_STAGES."""
    names = fn.arg_names
    source = GluonASTSource if getattr(fn, "is_gluon", lambda: False)() else ASTSource
    src = source(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                 attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps or mod.NUM_WARPS, "num_stages": stages or mod.NUM_STAGES,
                                     **({"maxnreg": cap} if cap else {})})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(CUOBJDUMP.parent / "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    fields = dict(tok.split(":", 1) for line in usage.splitlines() if "REG:" in line for tok in line.split())
    ttgir = kernel.asm["ttgir"]
    waits = collections.Counter(int(m.group(1)) for m in WAIT.finditer(ttgir))
    issued = len(re.findall(r"= ttng\.warp_group_dot ", ttgir))
    ops = collections.Counter(m.group(1) for m in SASS_OP.finditer(sass))
    return (int(fields["REG"]), int(fields["STACK"]), kernel.metadata.shared, issued, waits, kernel.asm["ptx"],
            sum(ops.values()), ops["PRMT"], softmax_steps(sass))


def softmax_steps(sass: str) -> list[tuple[int, int]]:
    """(instructions, of them ex2) of each innermost SASS loop that computes exponentials: a K/V step's body, one
    a loop variant (unmasked, on the diagonal, ...), in code order. Divided by BLOCK_N: instructions a key."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        if m := SASS_LABEL.match(line):
            pending.append(m.group(1))
        elif SASS_OP.search(line):
            labels.update(dict.fromkeys(pending, len(instrs)))
            pending = []
            instrs.append(line)
    loops = [(labels[m.group(1)], end) for end, line in enumerate(instrs)
             if (m := SASS_BACK.search(line)) and labels.get(m.group(1), end + 1) <= end]
    ex2 = [(a, b, sum("MUFU.EX2" in line for line in instrs[a:b + 1])) for a, b in loops]
    ex2 = [(a, b, n) for a, b, n in ex2 if n]
    inner = [(a, b, n) for a, b, n in ex2 if not any(a <= c and d <= b and (c, d) != (a, b) for c, d, _ in ex2)]
    return [(b - a + 1, n) for a, b, n in sorted(inner)]


def code_lines(ptx: str) -> list[str]:
    """A kernel's PTX instructions, its debug sections, source locations, file names and comments dropped: two builds
    with equal lists run the same instructions. Registers and labels keep their numbers: the compiler numbers them
    alike for the same code, and unnumbering them would hide operands swapped (a comparison inverted compiles to the
    same setp with its selp's operands exchanged)."""
    code = ptx.split("\t.section\t.debug")[0]
    lines = []
    for line in code.splitlines():
        line = line.split("//")[0].strip()
        if line and not line.startswith((".loc", ".file")) and not re.fullmatch(r"\$L__tmp\d+:", line):
            lines.append(line)
    return lines


def _build(spec: str, tmp: pathlib.Path, batch: int):
    label, mod = load_spec(spec, tmp)
    if hasattr(mod, "_decode_kernel"):
        return label, mod, compile_gluon_decode(mod, batch)
    compiled = compile_prefill_kernel(mod) if hasattr(mod, "_prefill_kernel") else compile_split_kernel(mod, batch)
    return label, mod, compiled


def main(argv=None):
    ap = argparse.ArgumentParser(description="Compile a decode or the TMA prefill family's kernel for sm90 without a "
                                             "GPU; print its registers, stack (spills), shared memory and wgmma waits.")
    ap.add_argument("specs", nargs="*", help="kernel file[:KNOB=VALUE,...]; default: the GQA decode family")
    ap.add_argument("--batch", type=int, default=32, help="sequences in the launch the kernel is specialised for")
    ap.add_argument("--same-code-as", metavar="FILE", help="also build FILE (another version of each SPEC's file, "
                    "e.g. from `git show REV:PATH`) with the SPEC's knobs and say how many PTX lines differ")
    ap.add_argument("--ptx", metavar="DIR", type=pathlib.Path, help="also write each SPEC's PTX to DIR/<i>.ptx")
    args = ap.parse_args(argv)
    batch, specs = args.batch, args.specs or [str(DEFAULT)]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sm90_compile_"))
    for i, spec in enumerate(specs):
        label, mod, compiled = _build(spec, tmp, batch)
        regs, stack, shared, issued, waits, ptx, sass, permutes, steps = compiled
        if args.ptx:
            args.ptx.mkdir(parents=True, exist_ok=True)
            (args.ptx / f"{i}.ptx").write_text(ptx)
        per_sm = programs_per_sm(KernelUse(name=label[:256], registers=regs, spills=stack // 4, shared_bytes=shared,
                                           warps=getattr(mod, "launch_warps", lambda: mod.NUM_WARPS)()))
        # sm90's limits, as microbench counts them
        print(f"{label:<60} {regs:4d} registers  {stack:4d} B stack  {shared / 1024:6.1f} KB shared  "
              f"-> at most {per_sm} programs per SM; wgmma {issued} in the code, waits by pendings "
              f"{dict(sorted(waits.items())) or 'none'}; SASS {sass} instructions, {permutes} byte permutes (PRMT)"
              + (f"; softmax steps {', '.join(f'{n} ({e} ex2)' for n, e in steps)} instructions" if steps else ""))
        if args.same_code_as:
            other = _build(args.same_code_as + spec[len(spec.partition(":")[0]):], tmp, batch)[2][5]
            mine, theirs = code_lines(ptx), code_lines(other)
            differ = [line for line in difflib.unified_diff(theirs, mine, lineterm="", n=0)
                      if line[:1] in "+-" and not line.startswith(("+++", "---"))]
            print(f"    against {args.same_code_as}: {len(mine)} vs {len(theirs)} PTX lines, {len(differ)} differ"
                  + "".join(f"\n      {line}" for line in differ[:6]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
