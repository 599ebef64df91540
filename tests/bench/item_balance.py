"""Model (not a measurement): how evenly the Gluon prefill's persistent programs share the work items.

    python tests/bench/item_balance.py [--programs 132] [--rows 4x2048,1x8192,8x4096]

knowledge/attention/prefill_gluon_sm90.py's persistent walk (PRODUCER_WARP, PERSISTENT): a work item is 128 query
rows of one head of one sequence, items heaviest query tiles first (heads fastest, then sequences, then query tiles
from the last); program p takes positions p, p + P, p + 2P, ... A position is the item of the same number, or with
ALTERNATE on odd rounds the item of the mirrored program (round r, program p: item r P + P - 1 - p). An item's cost
here is its K/V tiles (64 keys each: the causal keys of its 128 rows); the kernel's time follows the busiest program.
Printed per row: items a program, and the busiest program's work over the mean for the plain walk, ALTERNATE, and
BALANCED (the walk the family's own `deal` makes on the host: each item, heaviest first, to the least loaded program,
which is also what a shared counter, DYNAMIC, approaches).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from vs_library import load_spec  # noqa: E402

HEADS, ROWS, KEYS = 32, 128, 64


def item_costs(batch: int, length: int) -> list[int]:
    """K/V tiles of each work item, in the kernel's item order (SEQUENCE_MAJOR off)."""
    query_tiles = math.ceil(length / ROWS)
    costs = []
    for item in range(HEADS * batch * query_tiles):
        rest = item // HEADS
        m0 = (query_tiles - 1 - rest // batch) * ROWS
        costs.append(math.ceil(min(length, m0 + ROWS) / KEYS))
    return costs


def busiest(costs: list[int], programs: int, alternate: bool) -> int:
    loads = [0] * programs
    for k in range(math.ceil(len(costs) / programs) * programs):
        r, p = divmod(k, programs)
        item = r * programs + (programs - 1 - p if alternate and r % 2 else p)
        if item < len(costs):
            loads[p] += costs[item]
    return max(loads)


def dealt(costs: list[int], programs: int, batch: int, length: int, deal) -> int:
    """The busiest program's work on the family's dealt walk (BALANCED)."""
    walk = deal(HEADS, batch, math.ceil(length / ROWS), programs)[1:]
    return max(sum(costs[i] for i in walk[p::programs] if i < len(costs)) for p in range(programs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=132, help="persistent programs (SMs: 132 on an H100 or H200)")
    ap.add_argument("--rows", default="4x2048,1x8192,8x4096,2x2048,16x1024", help="comma list of BxL")
    args = ap.parse_args(argv)
    family = pathlib.Path(__file__).resolve().parents[2] / "knowledge" / "attention" / "prefill_gluon_sm90.py"
    deal = load_spec(str(family), pathlib.Path(tempfile.mkdtemp(prefix="item_balance_")))[1].deal   # host side only
    print("| B x L | items a program | plain walk | ALTERNATE | BALANCED |")
    print("|---|---|---|---|---|")
    for row in args.rows.split(","):
        batch, length = (int(n) for n in row.split("x"))
        costs = item_costs(batch, length)
        mean = sum(costs) / args.programs
        cells = [busiest(costs, args.programs, False), busiest(costs, args.programs, True),
                 dealt(costs, args.programs, batch, length, deal)]
        print(f"| {row} | {len(costs) / args.programs:.1f} | " + " | ".join(f"{c / mean:.3f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
