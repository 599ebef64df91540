"""Benchmark (not a test): how often parity rejects an adversarial kernel, evaluated again and again.

    python tests/bench/parity_catch.py OP BODY [N] [--set KEY=VALUE ...]

BODY (a file of tests/adversarial/) is appended to the reference kernel of OP (decode or prefill) by
candidates.wrap, and the result is evaluated through parity N times (default 20) in one warm pool, with config's
stages.parity as set (each --set a dotted key, its value read as YAML). Prints each verdict's stage and how many
of the N parity rejected, and the checks of the kind named in each rejection."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import candidates as C  # noqa: E402
from conftest import config_with  # noqa: E402
from harness.evaluate import evaluate, open_pool  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    sets = {a.split("=", 1)[0]: yaml.safe_load(a.split("=", 1)[1]) for a in args[args.index("--set") + 1:]} \
        if "--set" in args else {}
    args = args[:args.index("--set")] if "--set" in args else args
    op, body, n = args[0], args[1], int(args[2]) if len(args) > 2 else 20
    reference = {"decode": C.REF_DECODE, "prefill": C.REF_PREFILL}[op]
    source = C.wrap(reference, op, (Path(__file__).resolve().parent.parent / "adversarial" / body).read_text())
    cfg = config_with(**sets)
    verdicts, caught_by = Counter(), Counter()
    with open_pool(cfg, "attention") as pool:
        for _ in range(n):
            v = evaluate(source, "attention", cfg, pool, until="parity")
            verdicts[v.failed_stage or "passed"] += 1
            if v.failed_stage == "parity":
                caught_by["a step's next layer" if "; then the next layer of its step (" in v.reason else
                          "a twin" if "; the check before it again with " in v.reason else "another check"] += 1
            print(f"{v.failed_stage or 'passed'}: {v.reason[:160]}", flush=True)
    print(f"{op} + {body} ({pool.device}, {sets or 'config as is'}): {dict(verdicts)} of {n}; parity's rejections "
          f"by {dict(caught_by)}")


if __name__ == "__main__":
    main()
