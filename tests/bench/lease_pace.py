"""What the GPU lease lets several slots of one GPU judge (not a test, and not a GPU measurement): the real
`harness.lease.Lease`, one thread per slot, each candidate's stages slept through in turn, scaled down in time.

    python tests/bench/lease_pace.py [--slots 3 4 6 8] [--shared 4.3 0.06 2.25 2.4] [--alone 2.2]
                                     [--ledger runs/<id>] [--scale 100] [--hours 0.5] [--jitter 0.3]

Each slot thread asks the lease for each stage as a slot process does (harness/local_executor.py: `Holding.hold`
with the stage's mode before it, so a timed stage waits for the shared holders, and no shared stage starts while
one waits): the shared stages (default: compile, dispatch, parity and microbench's untimed first part, their
medians in run h200-r24's second segment, docs/BENCHMARKS.md; `--ledger`: a GPU run's own medians, its microbench
split at `alone_s`) and then the timed part alone. Each stage sleeps its
seconds, drawn uniformly within +-jitter, divided by `scale`. It prints, per slot count, candidates an hour and
the share of the time a slot held the GPU alone, with the time scaled back. It leaves out what a real run has
beside the lease: the host's cores shared by the slots (stages grow with more of them), the proposer, the
ledger's commits, replays. So it is an upper bound to hold a run's figures against, not a figure of kevo's.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.lease import Holding, Lease  # noqa: E402


def simulate(slots: int, shared: list[float], alone: float, scale: float, hours: float, jitter: float,
             seed: int = 0) -> dict[str, float]:
    """Candidates an hour and the share of time held alone, `slots` threads on one lease for `hours` (scaled)."""
    lease, stop_at = Lease("gpu"), time.monotonic() + hours * 3600 / scale
    done, held_alone, lock = [0], [0.0], threading.Lock()

    def slot(i: int) -> None:
        rng, holding = random.Random(seed * 1000 + i), Holding(lease, f"slot{i}")
        while time.monotonic() < stop_at:
            for seconds in shared:
                if not holding.hold("shared"):
                    return
                time.sleep(seconds * rng.uniform(1 - jitter, 1 + jitter) / scale)
            if not holding.hold("alone"):
                return
            t0 = time.monotonic()
            time.sleep(alone * rng.uniform(1 - jitter, 1 + jitter) / scale)
            with lock:
                done[0] += 1
                held_alone[0] += time.monotonic() - t0
            holding.release()

    threads = [threading.Thread(target=slot, args=(i,), daemon=True) for i in range(slots)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(max(0.0, stop_at - time.monotonic()))
    lease.close()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"per_hour": done[0] / (wall * scale / 3600), "alone_share": held_alone[0] / wall}


def ledger_medians(path: str) -> tuple[list[float], float]:
    """A GPU run's stage medians over the verdicts its stages reached: compile, dispatch, parity and microbench's
    shared part, then its part held alone (`alone_s`, which harness/evaluate.py records on a GPU)."""
    from agent.ledger.repository import Ledger
    stages = [s for r in Ledger(Path(path)).history() for rnd in r.rounds if rnd.verdict.cached_from is None
              for s in rnd.verdict.stages if s.status != "skipped"]
    timed = [s for s in stages if s.name == "microbench" and "alone_s" in s.metrics]
    if not timed:
        raise SystemExit(f"{path}: no microbench stage with `alone_s` (a GPU run by a kevo that records it)")
    shared = [statistics.median(s.seconds for s in stages if s.name == name) for name in ("compile", "dispatch", "parity")]
    return (shared + [statistics.median(s.seconds - s.metrics["alone_s"] for s in timed)],
            statistics.median(s.metrics["alone_s"] for s in timed))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Candidates an hour that the GPU lease lets N slots judge (a model).")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    ap.add_argument("--shared", type=float, nargs="+", default=[4.26, 0.06, 2.25, 2.42],
                    help="seconds of each shared stage of a candidate, in order")
    ap.add_argument("--alone", type=float, default=2.18, help="seconds of its timed part, the GPU held alone")
    ap.add_argument("--ledger", help="a GPU run's ledger: its own stage medians instead of --shared and --alone")
    ap.add_argument("--scale", type=float, default=100.0, help="time runs this many times faster")
    ap.add_argument("--hours", type=float, default=0.5, help="scaled hours simulated per slot count")
    ap.add_argument("--jitter", type=float, default=0.3)
    args = ap.parse_args(argv)
    if args.ledger:
        args.shared, args.alone = ledger_medians(args.ledger)
    bound = 3600 / args.alone
    print(f"stages {[round(x, 2) for x in args.shared]} s shared, {args.alone:.2f} s alone; one GPU times at most "
          f"{bound:.0f} candidates an hour")
    for n in args.slots:
        r = simulate(n, args.shared, args.alone, args.scale, args.hours, args.jitter)
        free = n * 3600 / (sum(args.shared) + args.alone)
        print(f"{n} slot(s): {r['per_hour']:6.0f} an hour, the GPU held alone {r['alone_share']:.0%} of the time "
              f"(no lease at all: {min(free, bound):.0f} an hour)")


if __name__ == "__main__":
    main()
