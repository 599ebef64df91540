"""Benchmark (not a test): one whole `kevo-agent run` left alone, then its account — issues 4 and 5's H200 runs.

    python tests/bench/h200_run.py --run-id h200-offline [--minutes 20] [--profile PATH] [--slots 2] [--share 0.29] [--archive PATH]
    python tests/bench/h200_run.py --run-id h200-faults --faults [--window 20] [--outage 2:150] [--kill-at 240]
    python tests/bench/h200_run.py --run-id h200-heads --heads [--minutes 10] [--window 20]
    python tests/bench/h200_run.py --run-id h200-llm30 --llm-s 30 [--minutes 20] [--slots 2]
    python tests/bench/h200_run.py --run-id h200-20 --minutes 20 --stop-at 500 --archive a.tgz   # one segment
    tar xzf a.tgz && python tests/bench/h200_run.py --run-id h200-20 --resume --stop-at 420 --archive b.tgz

Writes the run's config to runs/<id>.config.yaml (config.yaml, plus `served.recorded_shapes` when a
profile is given, and the served window when one is given) and runs the real command line
(`python -m agent.cli run ...`) as a child process.

`--faults` drives the run through the OpenAI SDK against a fake service on loopback (tests/fakes) whose
scripted candidates are real kernels — knob variants of the reference kernels — and three injected
faults: a candidate that hangs the GPU, one that faults it (an illegal address), and one that does not
compile — its first three candidates, so that they are reached however long the heads' replay takes.
The service goes down (503) for S seconds once it has answered K claims (`--outage K:S`); the run
itself is SIGKILLed `--kill-at` seconds after its first claim was answered and resumed with
`--resume`, as a person would after a reboot. Nothing is patched: the faults reach the run only through its provider
and its candidates.

`--heads` drives a decode-only run (`agent.ops: [decode]`) through the same fake service with no fault,
outage or kill: first the GQA decode family as written (knowledge/attention/decode_paged_gqa.py: 1.3-2.0x
the reference decode's bandwidth on the 32 x 4k and 16 x 8k rows, docs/BENCHMARKS.md), then knob steps
of it, so that an accepted kernel becomes the head and the later candidates are judged against it in the
replay. (Knob steps of the reference decode alone were all rejected at microbench on the H200, none 3%
faster than it: eleventh session.)

While the run goes, nvidia-smi is sampled every 500 ms (the GPU's busy share over the run, from its first
proposal on, and in each phase of its live view: judging its heads, a replay holding the GPU whole, a microbench
timing alone, only untimed stages running, nothing running) and the run's output is read for the time of its
first proposal (its own clock: how long the heads took). `--llm-s S` drives the run through the same fake
service with no fault: knob steps of the reference kernels, each proposal taking S seconds of the model's time
(half in the planner's answer, half in the coder's), so the run must keep several proposals in flight
(agent.proposals_in_flight) to keep the GPU fed.

Then it prints the account from the ledger alone: candidates per outcome and stage, per hour (per GPU-hour on one GPU), the
faulted candidates' verdicts, how many timed cases counted the torch baseline at the evaluator's own timing (its
worker read it slow: harness/stages/microbench.py `trusted_baseline`), the outage notes, and whether every proposal the service answered is in
the ledger. The figures go to docs/BENCHMARKS.md by hand, with the date.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import candidates as C  # noqa: E402
from fakes.flaky import FlakyLLM  # noqa: E402
from fakes.scripts import claim, code  # noqa: E402

from agent.ledger.repository import Ledger  # noqa: E402
from agent.reading.pace import pace  # noqa: E402
from agent.run.state import head_changes  # noqa: E402

PLANNER, CODER = "fake-planner", "fake-coder"

# (op, knob changes or a fault's source, hypothesis, expected local speedup)
DECODE_STEPS = [({"BLOCK_N": 128}, "Double BLOCK_N to 128: half the loop trips on the 2.5k-15k served contexts", 1.05),
                ({"NUM_WARPS": 8}, "Eight warps per split program put more K/V loads in flight", 1.03),
                ({"NUM_STAGES": 3}, "A third pipeline stage hides more HBM latency on the K/V stream", 1.04),
                ({"SPLITS_PER_SM_TARGET": 4}, "Four split programs per SM fill the H200 at batch 1-10", 1.06),
                ({"MIN_TOKENS_PER_SPLIT": 512}, "Coarser splits halve the merge work on long contexts", 1.02),
                ({"BLOCK_N": 32}, "BLOCK_N 32 wastes fewer masked lanes on the ragged last tile", 1.02),
                ({"NUM_WARPS": 2}, "Two warps leave registers for deeper pipelining", 1.02),
                ({"MAX_SPLITS": 16}, "At most 16 splits per sequence cuts the merge pass", 1.02),
                ({"NUM_STAGES": 4}, "Four pipeline stages for the longest contexts", 1.03),
                ({"SPLITS_PER_SM_TARGET": 1}, "One split program per SM: fewer partials to merge", 1.02)]
PREFILL_STEPS = [({"BLOCK_N": 128}, "BLOCK_N 128 halves K/V loop trips on the 2.5k-15k prompts", 1.05),
                 ({"NUM_STAGES": 4}, "A fourth pipeline stage hides the K/V load latency", 1.03),
                 ({"BLOCK_M": 64}, "BLOCK_M 64 doubles the programs for single long prompts", 1.04),
                 ({"NUM_WARPS": 4}, "Four warps per 128-row tile cut register pressure", 1.02),
                 ({"BLOCK_N": 32}, "BLOCK_N 32: smaller K/V tiles, more of them in flight", 1.02),
                 ({"NUM_STAGES": 2}, "Two pipeline stages leave shared memory for larger tiles", 1.02),
                 ({"CAUSAL_SKIP": False}, "Visit every tile with one uniform mask: no diagonal branch", 1.01)]
FAULTS = {0: ("decode", C.GPU_HANG_ON_BOUNDARY, "Skip the split merge for single-token contexts (injected fault: "
                                                "hangs the GPU on a length-1 sequence)"),
          1: ("decode", C.GPU_FAULT_ON_BOUNDARY, "Write the partials in place (injected fault: an illegal address "
                                                 "on a length-1 sequence)"),
          2: ("decode", C.REF_DECODE.replace("def decode(", "def decode((", 1),
              "Inline the split heuristic (injected fault: a syntax error, then two repair rounds)")}


GQA_DECODE = (ROOT / "knowledge" / "attention" / "decode_paged_gqa.py").read_text()
GQA_STEPS = [({}, "The GQA family: the whole query group in one tile, K/V read once per kv head, splits sized "
                  "from the real lengths on the device", 1.4),
             ({"PAGE_LOADS": True}, "One block-table read per page instead of one per token", 1.08),
             ({"BLOCK_N": 128}, "BLOCK_N 128: half the loop trips over the served contexts", 1.08),
             ({"NUM_STAGES": 3}, "A third pipeline stage hides more HBM latency on the K/V stream", 1.08),
             ({"PROGRAMS_PER_SM": 8}, "Eight resident programs per SM for more loads in flight", 1.08),
             ({"MIN_TOKENS_PER_SPLIT": 512}, "Coarser splits: fewer partials to merge on long contexts", 1.08),
             ({"NUM_WARPS": 8}, "Eight warps per split program", 1.08)]


def decode_script(n: int = 200) -> list[tuple[str, str, str, float]]:
    """`--heads`: the GQA decode family, then its knob steps, over and over."""
    return [("decode", C.with_knobs(GQA_DECODE, **knobs), text, s)
            for knobs, text, s in (GQA_STEPS[i % len(GQA_STEPS)] for i in range(n))]


def combined(steps: list[tuple[dict, str, float]]) -> list[tuple[dict, str, float]]:
    """Every set of steps that set different knobs, one source each: the steps alone, then in pairs, in threes...
    (a scripted service that proposed the same source twice would be answered by the verdict cache the second time,
    and its run's rate would count the cache, not the evaluator)."""
    out = []
    for k in range(1, len(steps) + 1):
        for group in itertools.combinations(steps, k):
            knobs = {name: value for step in group for name, value in step[0].items()}
            if len(knobs) == sum(len(step[0]) for step in group):
                out.append((knobs, "; ".join(step[1] for step in group), max(step[2] for step in group)))
    return out


def script(n: int = 600, faults: bool = True) -> list[tuple[str, str, str, float]]:
    """The candidates the fake service proposes, in order: knob steps of the reference kernels and their
    combinations (`combined`: each source once, until they run out, then over again), with the faults first
    (unless `faults` is off); (op, source, hypothesis, expected speedup)."""
    decode, prefill = combined(DECODE_STEPS), combined(PREFILL_STEPS)
    steps = []
    for i in range(n):
        if faults and i in FAULTS:
            op, source, text = FAULTS[i]
            steps.append((op, source, text, 1.05))
            continue
        if i % 3 == 2:
            knobs, text, s = prefill[(i // 3) % len(prefill)]
            steps.append(("prefill", C.with_knobs(C.REF_PREFILL, **knobs), text, s))
        else:
            knobs, text, s = decode[(i - i // 3) % len(decode)]
            steps.append(("decode", C.with_knobs(C.REF_DECODE, **knobs), text, s))
    return steps


class Service:
    """The fake provider: the planner's i-th answer is step i's claim, the coder answers with the code of
    the claim its request quotes (so a compile repair gets the same code again); down during the outage."""

    def __init__(self, steps, outage: tuple[int, float] | None, answer_s: float = 0.0) -> None:
        self.steps, self.outage = steps, outage
        self.answer_s = answer_s             # a proposal's model time: half in the planner's answer, half in the coder's
        self.first_answer: float | None = None   # when the first claim was answered: the kill's clock
        self.down_since: float | None = None
        self.answered = 0                    # claims handed out
        self.current = 0                     # the last one
        self.lock = threading.Lock()
        self.fake = FlakyLLM({PLANNER: [self._plan] * len(steps), CODER: [self._code] * (4 * len(steps))},
                             down=self._down)

    def _down(self, api: str) -> bool:
        return self.down_since is not None and time.monotonic() - self.down_since < self.outage[1]

    def _plan(self, body: dict) -> str:
        time.sleep(self.answer_s / 2)       # the model's time first: a call the run cuts meanwhile hands out no claim
        with self.lock:
            i, self.current = self.answered, self.answered
            self.answered += 1
            self.first_answer = self.first_answer or time.monotonic()
            if self.outage and self.answered == self.outage[0]:
                self.down_since = time.monotonic()
        op, _, text, s = self.steps[i]
        return claim(s, op=op, hypothesis=text, evidence=[f"scripted step {i + 1} of the fake service"],
                     kill_test={"stage": "microbench", "observation": "no gain beyond the parent's bar"})

    def _code(self, body: dict) -> str:
        asked = json.dumps(body)            # the claim it codes (or repairs) is quoted in the request
        hits = [i for i in range(self.answered) if json.dumps(self.steps[i][2])[1:-1] in asked]
        time.sleep(self.answer_s / 2)
        return code(self.steps[hits[-1] if hits else self.current][1])


class Sampler:
    """nvidia-smi's utilization.gpu per GPU, every 500 ms, in a thread; nothing where there is no nvidia-smi."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []        # (monotonic time, gpu index, percent busy)
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "500"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                self.samples.append((time.monotonic(), int(parts[0]), int(parts[1])))

    def busy(self, t0: float, t1: float) -> dict[str, float]:
        by = defaultdict(list)
        for t, gpu, pct in self.samples:
            if t0 <= t <= t1:
                by[gpu].append(pct)
        return {f"gpu{g}": round(sum(v) / len(v), 1) for g, v in sorted(by.items())}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


def write_config(run_id: str, profile: str | None, url: str | None, minutes: float, window: float | None,
                 ops: list[str] | None = None, slots: int | None = None, faults: bool = False,
                 share: float | None = None) -> Path:
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    if slots:
        cfg["executor"]["slots_per_gpu"] = slots
    if share:
        cfg["served"]["gpu_memory_fraction"] = share
    if ops:
        cfg["agent"]["ops"] = ops
    if profile:
        cfg["served"]["recorded_shapes"] = profile
    if window:
        cfg["served"]["cuda"]["window_s"] = window
    cfg["agent"]["budget_minutes"] = {"cuda": minutes, "cpu": minutes}
    if url:
        cfg["providers"]["openai"].update(base_url=url, planner_model=PLANNER, coder_model=CODER)
        cfg["providers"]["prices"][PLANNER] = cfg["providers"]["prices"][CODER] = {"input": 0.0, "output": 0.0}
        cfg["providers"]["retry"].update(attempts=3, initial_s=1.0, max_s=4.0)
        cfg["providers"]["outage"].update(wait_s=15.0, max_wait_s=60.0, give_up_s=3600.0)
    if faults:      # a hung candidate costs this much of the run (only here: the stages' config is in a verdict's key)
        cfg["stages"]["parity"]["timeout_s"] = 120
    path = ROOT / "runs" / f"{run_id}.config.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def launch(config: Path, args: list[str], env: dict, watch: "Watch | None" = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "--config", str(config), "run", *args],
                            cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE if watch else None,
                            text=True if watch else None)
    if watch:
        threading.Thread(target=watch.read, args=(proc.stdout,), daemon=True).start()
    return proc


class Watch:
    """The run's own output, passed through; when it first proposed (its live view's clock, seconds from the
    run's start: `[  36.5 s] proposing c001`) and when that was on this process's clock; and what the GPU was
    held for from moment to moment (`phase_of` each live-view line), for the busy share of each phase."""

    FIRST = re.compile(r"\[\s*([\d.]+) s\] proposing c\d+")
    LINE = re.compile(r"^\[\s*[\d.]+ s\] (.*)$")

    def __init__(self) -> None:
        self.first_claim_s: float | None = None
        self.first_claim_at: float | None = None
        self.phases: list[tuple[float, str]] = []        # (monotonic time, phase from then on)

    def read(self, stream) -> None:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()
            if self.first_claim_s is None and (m := self.FIRST.search(line)):
                self.first_claim_s, self.first_claim_at = float(m[1]), time.monotonic()
            if (m := self.LINE.match(line)) and (phase := phase_of(m[1])) and (not self.phases or self.phases[-1][1] != phase):
                self.phases.append((time.monotonic(), phase))


SHARED = ("compile", "dispatch", "parity", "microbench-prepare")


def phase_of(activity: str) -> str | None:
    """What the GPU is held for, from one live-view activity: `heads` (the run judging its heads), `replay` (a
    candidate's replay holds it whole), `timing` (a microbench holds it alone), `shared` (only compile, dispatch,
    parity or microbench's untimed part running), `idle` (candidates only queued); None for a line that says
    nothing of it (a proposal alone, a verdict)."""
    if activity.startswith("evaluating the "):
        return "heads"
    if not activity.startswith("evaluating "):
        return None
    stages = {part.split(": ", 1)[1] for part in activity.removeprefix("evaluating ").split("; ")[0].split(", ")
              if ": " in part}
    return ("replay" if "replay" in stages else "timing" if "microbench" in stages
            else "shared" if stages & set(SHARED) else "idle")


def by_phase(phases: list[tuple[float, str]], samples: list[tuple[float, int, int]], t1: float) -> dict[str, dict]:
    """Each phase's seconds (until t1) and the GPU's mean busy percent over the samples taken in it."""
    out: dict[str, dict] = {}
    for (t, phase), (t_next, _) in zip(phases, phases[1:] + [(t1, "")]):
        row = out.setdefault(phase, {"s": 0.0, "samples": []})
        row["s"] += max(0.0, t_next - t)
        row["samples"] += [pct for at, _, pct in samples if t <= at < t_next]
    return {k: {"s": round(v["s"], 1), "gpu_busy_percent": round(sum(v["samples"]) / len(v["samples"]), 1)
                if v["samples"] else None} for k, v in out.items()}


ALONE_FIGURES = {"timing_s", "clock_check_s", "trusted_baseline_s", "anchor_s"}     # microbench's per-case seconds


def judged(root: Path) -> set[str]:
    """The ids of the candidates the run's ledger holds a verdict for (none before its first commit)."""
    return {r.id for r in Ledger(root).history() if r.rounds} if (root / ".git").exists() else set()


def claims_in_ledger(ledger: Ledger, history: list, pending: list) -> dict:
    """The claims the run's ledger holds (judged, pending, and paid claims whose code the run's stop cut), and the
    calls its providers say the stop cut (summary.json)."""
    paid = [cid for cid, (exchanges, proposal) in ledger.unjudged_exchanges().items()
            if proposal is None and any(e.role == "planner" and e.purpose == "claim" for e in exchanges)]
    cut = sum(p.get("cut", 0) for p in ledger.summary().get("providers", {}).values())
    return {"claims_in_ledger": len(history) + len(pending) + len(paid), "paid_claims_cut": paid, "calls_cut": cut}


def replay_phases(metrics: list[dict]) -> dict[str, float] | None:
    """Where the candidates' replays went, summed over them (each replay's own metrics): its servers' start, to the
    last one ready (their warm-up: first calls at the served shapes, CUDA graphs' capture), the untimed
    continuation, its scoring and the warm pass, and the timed segments, the only part whose figures need a quiet
    GPU. The stage holds the GPU whole throughout (harness/lease.py). Then each arm's server's start by part, as
    the server reports it (`<arm>_start_<part>_s`, summed; replays from before the servers reported it have none)."""
    if not metrics:
        return None
    up = [max(v for k, v in m.items() if k.endswith("_server_ready_s")) for m in metrics]
    parts = defaultdict(float)
    for m in metrics:
        for k, v in m.items():
            if "_start_" in k and k.endswith("_s"):
                parts[k.removesuffix("_s")] += v
    return {"servers_up": round(sum(up), 1),
            "untimed": round(sum(m["arms_ready_s"] - u for m, u in zip(metrics, up)), 1),
            "timed": round(sum(m["stage_s"] - m["arms_ready_s"] for m in metrics), 1)} | {
        k: round(v, 1) for k, v in sorted(parts.items())}


def account(root: Path, wall_s: float, service: Service | None, first_claim_s: float | None = None,
            before: frozenset[str] = frozenset()) -> dict:
    """The run's account from its ledger; the rates count only the candidates judged after `before` (a
    resumed segment's own)."""
    if not (root / ".git").exists():                      # the run ended before its first commit
        return {"ledger": None, "wall_s": round(wall_s, 1)}
    ledger = Ledger(root)
    history, started = ledger.history(), ledger.heads(at_start=True)
    pending = ledger.pending()
    evaluated = [r for r in history if r.rounds and r.id not in before]
    stage_s = sum(s.seconds for r in evaluated for rnd in r.rounds for s in rnd.verdict.stages)
    by_stage = defaultdict(list)        # each stage's seconds per candidate that ran it (a cached verdict ran none)
    alone, compiles = [], 0.0           # microbench's part with the GPU held alone; Triton compiles inside it
    baseline_here = [0, 0]              # timed cases, and those whose worker read the baseline slow (the evaluator's counted)
    for st in (st for r in evaluated for rnd in r.rounds if rnd.verdict.cached_from is None for st in rnd.verdict.stages):
        if st.seconds:
            by_stage[st.name].append(st.seconds)
        if st.name == "microbench":
            if per_case := [v for k, v in st.metrics.items() if k.rsplit(".", 1)[-1] in ALONE_FIGURES]:
                alone.append(sum(per_case))
            compiles += sum(v for k, v in st.metrics.items() if k.endswith(".worker_compiles"))
            counted_here = [v for k, v in st.metrics.items() if k.endswith(".baseline_sets_counted_here")]
            baseline_here = [baseline_here[0] + len(counted_here), baseline_here[1] + sum(1 for v in counted_here if v)]
    replays = [st.metrics for r in evaluated for rnd in r.rounds if rnd.verdict.cached_from is None
               for st in rnd.verdict.stages if st.name == "replay" and "arms_ready_s" in st.metrics]
    search_s = wall_s - first_claim_s if first_claim_s is not None else None
    cached = sum(1 for r in evaluated if r.rounds[-1].verdict.cached_from is not None)
    judging_s = search_s - sum(by_stage.get("replay", [])) if search_s else None   # candidates' replays: whole GPU
    out = {"candidates": len(history), "pending": len(pending), "judged_before_this_segment": len(before),
           "by_outcome": dict(Counter(f"{r.outcome} at {r.stage}" for r in history)),
           "evaluated": len(evaluated), "wall_s": round(wall_s, 1), "stage_s": round(stage_s, 1),
           "candidates_per_hour": round(len(evaluated) / (wall_s / 3600), 1) if wall_s else None,
           "candidates_per_hour_after_first_claim": round(len(evaluated) / (search_s / 3600), 1) if search_s else None,
           # the evaluator's own rate: a verdict from the cache (an earlier run's, a source proposed again) ran no stage
           "judged_by_the_stages_per_hour": round((len(evaluated) - cached) / (wall_s / 3600), 1) if wall_s else None,
           "candidates_per_hour_after_first_claim_outside_replays":
               round(len(evaluated) / (judging_s / 3600), 1) if judging_s and judging_s > 0 else None,
           "stage_median_s": {k: round(sorted(v)[len(v) // 2], 2) for k, v in by_stage.items()},
           "microbench_alone_median_s": round(sorted(alone)[len(alone) // 2], 2) if alone else None,
           "compiles_while_timed": compiles,
           # harness/stages/microbench.py `trusted_baseline`: how often a worker read the torch baseline slow
           "cases_with_the_baseline_counted_here": f"{baseline_here[1]} of {baseline_here[0]}",
           "stage_runs": {k: len(v) for k, v in by_stage.items()},
           "replay_s": round(sum(by_stage.get("replay", [])), 1),
           "replay_phases_s": replay_phases(replays),
           "cached_verdicts": cached,
           "accepted": [r.id for r in history if r.outcome == "accepted"],
           # (candidate, the head it replaced, the head it was judged against): the last two differ for a kernel
           # that became the head unmeasured against its predecessor (empty: a ledger from before rounds named it)
           "head_changes": head_changes(started, history),
           # the whole run's, as its summary.md says it: every session, the heads' stages, the waits for the GPU
           "pace": pace(started, history, ledger.summary().get("elapsed_s", 0.0)).record(),
           "lost_workers": [(r.id, s.name, s.worker_lost) for r in history for rnd in r.rounds
                            for s in rnd.verdict.stages if s.worker_lost],
           "exchange_notes": [f"{r.id}: {note}" for r in history
                              for line in (ledger.committed(f"candidates/{r.id}/exchanges.jsonl") or "").splitlines()
                              if (note := json.loads(line).get("note"))]}
    if service is not None:
        out["claims_answered"] = service.answered
        out.update(claims_in_ledger(ledger, history, pending))
        # the service counts a claim once its model time is over, even when the run cut the call meanwhile
        out["every_answer_in_ledger"] = (out["claims_in_ledger"] <= service.answered
                                         <= out["claims_in_ledger"] + out["calls_cut"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--profile", default=None, help="a recorded served profile (served.recorded_shapes)")
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--heads", action="store_true", help="a decode-only scripted run, no faults (see above)")
    ap.add_argument("--window", type=float, default=None, help="served.cuda.window_s (default: config's)")
    ap.add_argument("--slots", type=int, default=None, help="executor.slots_per_gpu (default: config's)")
    ap.add_argument("--share", type=float, default=None,
                    help="served.gpu_memory_fraction (default: config's; four slots on an 80 GB card need 0.28)")
    ap.add_argument("--outage", default="2:150", help="K:S, down for S seconds once K claims are answered (--faults)")
    ap.add_argument("--kill-at", type=float, default=240.0,
                    help="SIGKILL the run this long after the first claim, then resume it (--faults; 0: never)")
    ap.add_argument("--llm-s", type=float, default=None, metavar="S",
                    help="knob steps of the reference kernels from a fake service taking S seconds a proposal (no faults)")
    ap.add_argument("--stop-at", type=float, default=None, metavar="S",
                    help="SIGTERM the run S seconds after its start (a segment; see above)")
    ap.add_argument("--grace", type=float, default=45.0, help="then SIGKILL it this many seconds later")
    ap.add_argument("--resume", action="store_true", help="go on with runs/<run-id> (unpacked from an --archive)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--archive", default=None, metavar="PATH",
                    help="also write runs/<id>, its config and the verdict cache (runs/.verdicts) as one .tar.gz, to bring "
                         "the ledger back from a lent machine and go on there later with --resume")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    service = None
    if args.faults or args.heads or args.llm_s is not None:
        k, secs = args.outage.split(":")
        if args.heads:
            service = Service(decode_script(), None)
        elif args.llm_s is not None:
            service = Service(script(faults=False), None, answer_s=args.llm_s)
        else:
            service = Service(script(), (int(k), float(secs)))
        service.fake.__enter__()
        env["OPENAI_API_KEY"] = "sk-fake-local-service"
    if args.heads or args.llm_s is not None:
        args.kill_at = 0
    config = write_config(args.run_id, args.profile, service.fake.openai_url if service else None, args.minutes,
                          args.window, ["decode"] if args.heads else None, args.slots, share=args.share,
                          faults=service is not None and not args.heads and args.llm_s is None)
    provider = ["--provider", "openai"] if service else ["--provider", "offline"]
    root = ROOT / "runs" / args.run_id
    if args.resume and not (root / ".git").exists():
        sys.exit(f"--resume: no run at {root} (unpack its --archive in the project root first)")
    before = frozenset(judged(root)) if args.resume else frozenset()
    sampler, watch = Sampler(), Watch()
    t0 = time.monotonic()
    proc = launch(config, ["--resume", args.run_id, *provider] if args.resume
                  else ["--target", "attention", *provider, "--run-id", args.run_id], env, watch)
    events = []
    if args.stop_at is not None:
        threading.Thread(target=stop_at, args=(proc, t0, args.stop_at, args.grace, events), daemon=True).start()
    if service and args.kill_at:
        while proc.poll() is None and (service.first_answer is None or time.monotonic() - service.first_answer < args.kill_at):
            time.sleep(0.5)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            events.append(f"SIGKILLed the run's process group at {time.monotonic() - t0:.0f} s "
                          f"({args.kill_at:g} s after the first claim); resumed")
            proc = launch(config, ["--resume", args.run_id], env, watch)
    rc = proc.wait()
    t1 = time.monotonic()
    sampler.close()
    wall = t1 - t0
    out = {"run": args.run_id, "rc": rc, "events": events, "first_claim_s": watch.first_claim_s,
           "gpu_busy_percent": sampler.busy(t0, t1),
           "gpu_busy_percent_after_first_claim": sampler.busy(watch.first_claim_at, t1) if watch.first_claim_at else None,
           "by_phase": by_phase(watch.phases, sampler.samples, t1),
           **account(root, wall, service, watch.first_claim_at - t0 if watch.first_claim_at else None, before)}
    if service is not None:
        service.fake.__exit__(None, None, None)
        out["service_requests"] = len(service.fake.seen)
    print(json.dumps(out, indent=1))
    if args.archive:            # before the json: a poller that waits for the json finds the archive whole
        archive(args.run_id, Path(args.archive))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def stop_at(proc: subprocess.Popen, t0: float, at: float, grace: float, events: list[str]) -> None:
    """End a segment: SIGTERM to the run's own process `at` seconds after t0, as `kill PID` would (it finishes
    and commits the candidates being judged), then SIGKILL to the whole process group `grace` seconds later if it
    is still running. (Before dd1d7ff a SIGTERM to the group also ended the slot processes, whose jobs started
    again from compile; slots now run in a session of their own, and die with the run.)"""
    for sig, when in ((signal.SIGTERM, at), (signal.SIGKILL, at + grace)):
        while proc.poll() is None and time.monotonic() - t0 < when:
            time.sleep(0.2)
        if proc.poll() is not None:     # it ended by itself
            return
        try:
            os.kill(proc.pid, sig) if sig == signal.SIGTERM else os.killpg(proc.pid, sig)
        except ProcessLookupError:      # it ended meanwhile
            return
        events.append(f"{sig.name} at {time.monotonic() - t0:.0f} s (end of the segment)")


def archive(run_id: str, path: Path) -> None:
    """The run's ledger, its config and the verdict cache in one .tar.gz, paths relative to the project root;
    written under a temporary name and renamed, so the path never holds a part of one (the twenty-fifth session
    copied one mid-write)."""
    partial = path.with_name(path.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for part in (f"runs/{run_id}", f"runs/{run_id}.config.yaml", "runs/.verdicts"):
            if (ROOT / part).exists():
                tar.add(ROOT / part, arcname=part)
    partial.replace(path)
    print(f"archived {run_id} (ledger, config, verdict cache) to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
