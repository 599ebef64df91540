"""Benchmark (not a test): a long `kevo-agent run` against an LLM service that misbehaves in turn (issue 17).

    python tests/bench/llm_soak.py [--minutes 30] [--run-id llm-soak] [--outage 12:180] [--json PATH]

The real command line (`python -m agent.cli run --provider openai ...`, a child process in a session of
its own) speaks through the OpenAI SDK to the fake service on loopback (tests/fakes), which answers the
requests, whatever their model, from one cycle: good replies (streamed over a few seconds, as a real
service does), a proxy's HTML page, garbage in the stream, a hang (longer than the idle timeout), a
2,000,000-character reply, a 429 with `retry-after: 600` (past the cap), invalid JSON, a JSON string, a
stream cut short. From minute M for S seconds (`--outage M:S`) every request gets a 503. The run uses
the shorter call timeouts written below (so more faults fit in the time) and small served shapes (the CPU
evaluator runs Triton's interpreter; the soak is about the provider, not the kernels).

Then it prints the account: the exit code, tracebacks in stderr, wall and budget time, what the service
served by kind, the run's own tally of its provider (summary.json), and the replies the service handed
out against the exchanges in the ledger (a reply in flight when the run ends is cut: counted, not recorded). It asserts nothing; the figures go to docs/AGENT.md by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import config_with  # noqa: E402
from fakes import scripts as S  # noqa: E402
from fakes.llm_server import Step  # noqa: E402
from fakes.flaky import FlakyLLM  # noqa: E402

PLANNER, CODER = "fake-planner", "fake-coder"
IDLE_S = 20.0
SETTINGS = {"agent.ops": ["decode"], "agent.provider": "openai",
            "targets.attention.cpu.heads": [[4, 2]],
            "targets.attention.cpu.decode": [{"batch": 2, "lengths": [3, 12], "weight": 1.0}],
            "targets.attention.cpu.prefill": [{"batch": 1, "lengths": [3, 12], "weight": 1.0}],
            "stages.parity.distributions": ["normal"], "stages.parity.checks_per_shape": 1,
            "providers.openai.planner_model": PLANNER, "providers.openai.coder_model": CODER,
            f"providers.prices.{PLANNER}": {"input": 1.25, "output": 10.0},
            f"providers.prices.{CODER}": {"input": 1.25, "output": 10.0},
            "providers.timeout_s": 120, "providers.idle_timeout_s": IDLE_S, "providers.connect_timeout_s": 5,
            "providers.retry": {"attempts": 5, "initial_s": 2.0, "max_s": 30.0, "max_retry_after_s": 60.0},
            "providers.outage": {"wait_s": 30.0, "max_wait_s": 120.0, "give_up_s": 3600.0, "unreached_s": 60.0},
            "agent.max_cost_usd": 1000.0}
CYCLE = ["good", "html", "good", "garbage", "good", "hang", "good", "huge", "good", "429", "good", "bad-json",
         "good", "json-string", "good", "short"]


class Service:
    """The requests' steps, from one cycle shared by both models, and what was handed out, by kind and model."""

    def __init__(self) -> None:
        self.i, self.lock, self.handed = 0, threading.Lock(), Counter()

    def step(self, model: str) -> Step:
        with self.lock:
            kind, self.i = CYCLE[self.i % len(CYCLE)], self.i + 1
            self.handed[(kind, model)] += 1
        text = S.claim(1.3) if model == PLANNER else S.GOOD
        return {"good": Step.odd("stall", 3.0, text=text), "hang": Step.odd("hang", IDLE_S + 15),
                "huge": Step(text="z" * 2_000_000), "429": Step.error(429, "fake: slow down", {"retry-after": "600"}),
                }.get(kind) or Step.odd(kind)


class Endless(list):
    """A model's script that never runs out."""

    def __init__(self, service: Service, model: str) -> None:
        super().__init__([None])
        self.service, self.model = service, model

    def pop(self, i: int = -1):
        return self.service.step(self.model)


def ledger_exchanges(root: Path) -> list[dict]:
    out = []
    for path in sorted((root / "candidates").glob("*/exchanges.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--run-id", default="llm-soak")
    ap.add_argument("--outage", default="12:180", help="M:S: every request gets a 503 from minute M for S seconds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    at_min, for_s = (float(x) for x in args.outage.split(":"))
    runs = ROOT / "runs"
    root = runs / args.run_id
    service = Service()
    t0 = time.monotonic()
    down = lambda api: at_min * 60 <= time.monotonic() - t0 < at_min * 60 + for_s     # noqa: E731
    with FlakyLLM({PLANNER: Endless(service, PLANNER), CODER: Endless(service, CODER)}, down=down) as fake:
        cfg = config_with(**{"agent.runs_dir": str(runs), "providers.openai.base_url": fake.openai_url, **SETTINGS})
        config = runs / f"{args.run_id}.config.yaml"
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        env = {**os.environ, "OPENAI_API_KEY": "sk-soak-0001", "PYTHONUNBUFFERED": "1"}
        with open(runs / f"{args.run_id}.out", "w") as out, open(runs / f"{args.run_id}.err", "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "--config", str(config), "run",
                                     "--run-id", args.run_id, "--budget-minutes", f"{args.minutes:g}"],
                                    cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
            rc = proc.wait()
        wall = time.monotonic() - t0
        served = dict(fake.served)
        outage_requests = sum(1 for s in fake.seen if at_min * 60 <= s.at - t0 < at_min * 60 + for_s)
    stderr = (runs / f"{args.run_id}.err").read_text()
    summary = json.loads((root / "summary.json").read_text())
    exchanges = ledger_exchanges(root)
    replies = {m: service.handed[("good", m)] + service.handed[("huge", m)] for m in (PLANNER, CODER)}
    in_ledger = Counter(e["model"] for e in exchanges)
    account = {
        "rc": rc, "tracebacks": stderr.count("Traceback"), "wall_s": round(wall, 1),
        "budget_s": args.minutes * 60, "elapsed_s": summary["elapsed_s"], "stopped": summary["stopped"],
        "candidates": summary["candidates"], "funnel": {k: v for k, v in summary["funnel"].items() if v},
        "cost_usd": summary["cost_usd"], "served": served, "outage_503s": outage_requests,
        "handed_out": {f"{k} {m}": n for (k, m), n in sorted(service.handed.items())},
        "provider": summary.get("providers", {}),
        "replies_handed_out": replies, "exchanges_in_ledger": dict(in_ledger),     # less the calls cut by the run's end
        "exchanges_over_cap": sum(1 for e in exchanges if e.get("reply_sha256")),
        "exchanges_with_faults": sum(1 for e in exchanges if e.get("faults")),
        "ledger_bytes": sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".git" not in p.parts),
        "end_commit": subprocess.run(["git", "log", "-1", "--format=%B"], cwd=root, capture_output=True,
                                     text=True).stdout.strip(),
    }
    print(json.dumps(account, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(account, indent=1) + "\n")


if __name__ == "__main__":
    main()
