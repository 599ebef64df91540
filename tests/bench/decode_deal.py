"""Model (not a measurement): how evenly the Gluon decode's persistent programs share a ragged batch's items.

    python tests/bench/decode_deal.py [--programs 132] [--rows 32x2048,64x4096,8x32768] [--ragged 0.5]
                                      [--trials 200] [--item-tokens 256] [SPEC ...]

knowledge/attention/decode_gluon_sm90.py (or each SPEC, `path[:KNOB=VALUE,...]` as in vs_library.py): the grid's
splits come from the module's own `split_range` (its MIN_TOKENS_PER_SPLIT, MAX_SPLITS, ROUND_FILL, MIN_ROUNDS; with
SPLITS_FROM_LENGTHS each batch's count as its `chosen_splits` picks it); each item's tokens from its `item_tokens`
(the kernel's sizing from the real length);
an item costs its tokens plus `--item-tokens` (its fixed cost - Q load, first page, epilogue - as tokens' worth: a
guess). Lengths are drawn as vs_library.py's --ragged draws them (uniform in [LO x L, L]), `--trials` batches a row.
Printed per row and spec: the splits, items a program, and the mean program's load over the busiest's (1.0: all
finish together) for items by index (program p: p, p + P, ...) and dealt longest first (LONGEST_FIRST: sequence
rank, split, kv head; odd rounds from the last program back). The kernel's time follows the busiest program only
while the others' idle SMs leave it no faster: where few SMs stream, each gets more of DRAM (measured figures move
less than these).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import random
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vs_library import load_spec  # noqa: E402

FAMILY = pathlib.Path(__file__).resolve().parents[2] / "knowledge" / "attention" / "decode_gluon_sm90.py"


def balance(lengths: list[int], heads: int, splits: int, programs: int, longest: bool, mod, fixed: int) -> float:
    """The mean program's load over the busiest's, items by index (split-major) or dealt longest first."""
    order = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b)) if longest else range(len(lengths))
    if longest:
        items = [(b, s) for b in order for s in range(splits) for _ in range(heads)]
    else:
        items = [(b, s) for s in range(splits) for b in order for _ in range(heads)]
    loads = [0] * min(programs, len(items))
    for r, (b, s) in enumerate(items):
        k, pos = divmod(r, len(loads))
        tokens = mod.item_tokens(lengths[b], s, splits)
        loads[len(loads) - 1 - pos if longest and k % 2 else pos] += tokens + fixed if tokens else 0
    return sum(loads) / len(loads) / max(loads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", help="kernel file[:KNOB=VALUE,...]; default: the Gluon decode")
    ap.add_argument("--programs", type=int, default=132, help="persistent programs (SMs: 132 on an H100 or H200)")
    ap.add_argument("--rows", default="32x2048,64x4096,8x32768,16x8192,128x1024", help="comma list of BxL")
    ap.add_argument("--heads", type=int, default=8, help="kv heads")
    ap.add_argument("--ragged", type=float, default=0.5, metavar="LO", help="lengths from [LO x L, L]")
    ap.add_argument("--trials", type=int, default=200, help="batches drawn a row (the figures are their means)")
    ap.add_argument("--item-tokens", type=int, default=256, help="an item's fixed cost, in tokens' worth")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="decode_deal_"))
    mods = [load_spec(spec, tmp) for spec in args.specs or [str(FAMILY)]]     # host side only: no GPU needed
    print("| spec | B x L | splits | items a program | by index | longest first |")
    print("|---|---|---|---|---|---|")
    for label, mod in mods:
        for row in args.rows.split(","):
            batch, length = (int(n) for n in row.split("x"))
            lo, hi = mod.split_range(batch, args.heads, length, args.programs)
            programs = min(args.programs, batch * args.heads * lo) if lo < hi else args.programs
            rng = random.Random(args.seed)
            draws = [[rng.randint(max(1, math.ceil(args.ragged * length)), length) for _ in range(batch)]
                     for _ in range(args.trials)]
            splits = [mod.chosen_splits(lengths, args.heads, lo, hi, programs) if lo < hi else lo for lengths in draws]
            cells = [sum(balance(lengths, args.heads, n, programs, longest, mod, args.item_tokens)
                         for lengths, n in zip(draws, splits)) / len(draws) for longest in (False, True)]
            chose = f"{lo} or {hi} ({splits.count(hi) / len(splits):.0%} {hi})" if lo < hi else f"{lo}"
            print(f"| {label} | {row} | {chose} | {batch * args.heads * sum(splits) / len(splits) / programs:.2f} | "
                  + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
