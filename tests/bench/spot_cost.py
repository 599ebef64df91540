"""Benchmark (not a test): the served process's spot checks (harness/served/spot.py) on the reference kernels.

    python tests/bench/spot_cost.py        # on the GPU (bf16, the served heads); on a CPU it says so and stops

Per served-like shape, twelve calls each checked (share 1): honest, how many failed and the worst error as a
share of the tolerance; with the checked rows scaled by 1.02 (decode: the sequence; prefill: one drawn row of the
checked ones), how many were caught; and what a check adds to a call (its call synchronized, the kernel's own
time taken off), and what judging the 24 checks took when the books were read.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

from harness.config import load_config  # noqa: E402
from harness.served.ops import load_candidate  # noqa: E402
from harness.served.spot import SpotChecks  # noqa: E402
from harness.targets import TARGETS  # noqa: E402
from harness.targets.base import Case  # noqa: E402

KERNELS = {"decode": ("knowledge/attention/decode_paged_gqa.py", [(32, (1000, 4096)), (64, (100, 4096)),
                                                                  (8, (8000, 32768))]),
           "prefill": ("knowledge/attention/prefill_causal_tiled.py", [(4, (100, 2048)), (1, (4000, 8192)),
                                                                        (16, (10, 512))])}


def synced(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("spot_cost: needs an NVIDIA GPU (CUDA); CPU timings are not reported")
    cfg = load_config()
    target = TARGETS["attention"].configured(cfg.targets.attention.baselines())
    floor, factor = cfg.stages.parity.floors["bfloat16"], cfg.stages.parity.tolerance_factor
    root = Path(__file__).resolve().parent.parent.parent
    for op, (path, shapes) in KERNELS.items():
        kernel = getattr(load_candidate(root / path, op), op)
        for batch, lengths in shapes:
            honest, scaled = (SpotChecks(target, 1.0, factor, (floor.max_abs, floor.rel_l2)) for _ in range(2))
            params = {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "batch": batch,
                      "length_range": lengths}
            cost = []
            for seed in range(12):
                x = target.ops[op].make_inputs(Case(op, op, params), "normal", seed, torch.device("cuda"),
                                               torch.bfloat16)
                lens = x["seq_lens"].tolist() if op == "decode" else torch.diff(x["cu_seqlens"]).tolist()
                args = tuple(x[name] for name in target.ops[op].arg_names)
                checked = synced(lambda: honest.after(op, honest.before(op, args, lens), kernel(*args)))
                cost.append(checked - synced(lambda: kernel(*args)))
                pending = scaled.before(op, args, lens)
                out = kernel(*args)
                rows = pending.rows if op == "decode" else pending.rows[random.Random(seed).randrange(len(pending.rows))]
                out[rows] *= 1.02
                scaled.after(op, pending, out)
            t = time.perf_counter()
            h, s = honest.results()[op], scaled.results()[op]
            judged = time.perf_counter() - t
            print(f"{op} batch {batch} lengths {lengths}: honest {h['spot_failed']} of {h['spot_checked']} failed, "
                  f"worst {h['spot_worst']:.3f} of the tolerance; rows x1.02 caught {s['spot_failed']} of "
                  f"{s['spot_checked']}; a check adds {sorted(cost)[6] * 1e3:.2f} ms to a call (median); judging "
                  f"24 checks {judged * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
