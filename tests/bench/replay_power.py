"""What the scored replay (stage 5) can see, measured: its time, its noise band, its power, its gates.

    python tests/bench/replay_power.py [--aa 3] [--shift 0.05] [--kernel FILE] [--json OUT]
    python tests/bench/replay_power.py --errors-only | --noise ROUNDS

On the GPU, with config's defaults (the window, the segments, the load, the bf16 gates), the reference
decode (knowledge/attention/decode_paged_splitkv.py), or `--kernel`'s file, as the head:
  1. the stage itself, start to verdict: `run_replay(head, head=head)` - an A/A comparison;
  2. more A/A comparisons on one set of servers, all fed one continuation the reference scored (the timed half,
     `timed_pair`, is what they measure): the gain, its lower bound and the noise band of each;
  3. the head made `shift` slower in its decode (a spin after every decode call, sized from the A/A's
     p50 TPOT: shift x TPOT over the layers' calls) against the head, which must be rejected, and the
     head against it (its decode then `shift` faster), which must be accepted.
--errors-only: the gates alone on the head and three subtle errors of it (attending only to the last
4096 tokens, dropping keys whose weight is under 1e-3 of the largest, an accumulator rounded to bf16).
--noise: the timed half's band alone, on free-running requests, with three ways of scoring it.
Prints one line per measurement; --json writes them all. A bench, not a test: it asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import candidates as C  # noqa: E402
from conftest import config_with  # noqa: E402
from harness.config import load_config  # noqa: E402
from harness.stages.arms import Servers  # noqa: E402
from harness.stages.replay import reference_feed, run_replay, timed_pair, warm_pass  # noqa: E402

KEYS = ("accepted", "gain", "gain_lower", "noise_band", "segments", "gate_passed", "gate_coverage", "gate_max_logprob_diff",
        "gate_p99_logprob_diff", "gate_mean_logprob_diff", "gate_flips", "gate_flip_lead", "head_gate_passed",
        "head_gate_max_logprob_diff", "head_gate_p99_logprob_diff", "head_gate_mean_logprob_diff", "head_gate_flip_lead",
        "head_tpot_p50_ms", "candidate_tpot_p50_ms", "head_ttft_p50_ms", "candidate_ttft_p50_ms", "stage_s", "reference_done_s", "arms_ready_s",
        "candidate_stalls", "head_requests", "segment1_log_gain", "segment2_log_gain", "segment3_log_gain",
        "segment4_log_gain", "segment5_log_gain", "segment6_log_gain", "segment7_log_gain", "segment8_log_gain")


def cycles_per_ms() -> float:
    """torch.cuda._sleep's spin rate on this GPU (cycles per millisecond), timed with events."""
    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / start.elapsed_time(end)


def slowed(source: str, cycles: int) -> str:
    """The head with a spin of `cycles` after each of its decode calls (its prefill untouched)."""
    return C.wrap_decode(f"""
def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    if {cycles}:
        torch.cuda._sleep({cycles})
    return out
""") if source == C.REF_DECODE else source


def row(name: str, outcome, t0: float) -> dict:
    m = {k: outcome.metrics[k] for k in KEYS if k in outcome.metrics}
    m["seconds"] = round(time.monotonic() - t0, 1)
    text = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items())
    print(f"{name}: {text}\n  {outcome.reason[:600]}", flush=True)
    per_request = {label: [[[c.index, round(1e3 * c.ttft, 2), round(1e3 * (c.tpot or 0), 3)] for c in run.completions]
                           for run in runs] for label, runs in (outcome.runs or {}).items()}
    return {"name": name, **m, "reason": outcome.reason, "per_request": per_request}


def errors_only(cfg, out: str | None) -> None:
    """The head and the three errors fed one continuation (the head's, scored by the reference, as the stage
    does), all requests at once (untimed)."""
    import dataclasses
    import random

    from harness.served.score import against_head
    from harness.stages.replay import _gate, continuation_pass, draw, forced
    arms = {"A": C.REF_DECODE, "window4096": C.recent_window(4096), "drops<1e-3": C.DROPS_SMALL_WEIGHTS,
            "bf16acc": C.ACCUMULATES_IN_BF16}
    t0 = time.monotonic()
    rows = []
    with Servers(cfg, "cuda", {"reference": None, **arms}, secrets.randbits(31)) as servers:
        print(f"servers up in {time.monotonic() - t0:.1f} s", flush=True)
        requests = draw(cfg, "cuda", random.Random(secrets.randbits(64)))
        t0 = time.monotonic()
        cont = continuation_pass(cfg, "cuda", servers, requests, source="A")
        ref = cont.ref
        print(f"{cont.source}'s continuation {cont.parted and '(' + cont.parted + ') '}from the reference in "
              f"{time.monotonic() - t0:.1f} s, {sum(len(c.tokens) for c in ref.completions)} tokens", flush=True)
        feed = [dataclasses.replace(r, arrival_s=0.0) for r in forced(requests, ref)]
        gates = {}
        for label in arms:
            t0 = time.monotonic()
            gates[label] = _gate(cfg, "bfloat16", ref, servers.send(label, feed))
            print(f"{label} fed in {time.monotonic() - t0:.1f} s", flush=True)
    r = cfg.stages.replay
    for label, g in gates.items():
        final = g if label == "A" else against_head(g, gates["A"], r.head_factor, r.gates["bfloat16"].mean_floor)
        row = {"arm": label, "passed": final.passed, "max": g.max_abs, "p99": g.p99_abs, "mean": g.mean_abs,
               "mean_over_head": g.mean_abs / gates["A"].mean_abs, "flips": g.flips, "flip_lead": g.flip_lead,
               "compared": g.compared, "detail": final.detail}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))


def _log_ratios(head, cand, how: str) -> list[float]:
    """Per segment, the mean over its requests of log(head / candidate) of: `ttft` (from the group's
    start), `ttft_sent` (from each request's own send), `tpot`, or `score` (the stage's own mix)."""
    import dataclasses
    import math

    from harness.served.score import _ratio
    out = []
    for h, c in zip(head, cand):
        others = {x.index: x for x in c.completions}
        rs = []
        for x in h.completions:
            y = others.get(x.index)
            if y is None or not (x.token_times and y.token_times):
                continue
            if how == "score":
                rs.append(_ratio(x, y))
            elif how == "tpot":
                if x.tpot and y.tpot:
                    rs.append(math.log(x.tpot / y.tpot))
            else:
                if how == "ttft_sent":
                    x, y = dataclasses.replace(x, origin_s=None), dataclasses.replace(y, origin_s=None)
                rs.append(math.log(max(x.ttft, 1e-9) / max(y.ttft, 1e-9)))
        out.append(sum(rs) / len(rs))
    return out


def noise(cfg, rounds: int, out: str | None) -> None:
    """The timed half alone, without a reference: two servers of the head, fresh free-running requests
    (lengths fixed by max_tokens, so the schedule is fixed too), the window's segments replayed AB BA
    ... `rounds` times, each round once as the stage does and once with a short untimed request to the
    arm just before each of its segments (`primed`). Prints, per round, the band of each score."""
    import math
    import random

    from harness.served.score import t_quantile
    from harness.served.traces import TraceRequest
    from harness.stages.replay import draw, segments
    r = cfg.stages.replay
    device = "cuda" if torch.cuda.is_available() else "cpu"     # on a CPU: a smoke test of the bench, no figure
    served = getattr(cfg.served, device)
    t0 = time.monotonic()
    rows = []
    with Servers(cfg, device, {"A": C.REF_DECODE, "B": C.REF_DECODE}, secrets.randbits(31)) as servers:
        print(f"servers up in {time.monotonic() - t0:.1f} s", flush=True)
        for k in range(rounds):
            requests = draw(cfg, device, random.Random(secrets.randbits(64)))
            segs = segments(requests, served.window_s, r.segments)
            for primed in (False, True):
                t0 = time.monotonic()
                runs: dict[str, list] = {"A": [], "B": []}
                for j, seg in enumerate(segs):
                    for label in (("A", "B") if j % 2 == 0 else ("B", "A")):
                        if primed:
                            servers.send(label, [TraceRequest(10**6, 0.0, [1] * 16, 2)])
                        runs[label].append(servers.send(label, seg, r.load == "burst"))
                row = {"round": k + 1, "primed": primed, "segments": len(segs), "seconds": round(time.monotonic() - t0, 1)}
                for how in ("score", "ttft", "ttft_sent", "tpot"):
                    xs = _log_ratios(runs["A"], runs["B"], how)
                    mean = sum(xs) / len(xs)
                    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
                    first = [x if j % 2 == 0 else -x for j, x in enumerate(xs)]   # + : the arm served first was slower
                    row[how] = {"gain": round(math.expm1(mean), 4), "band": round(t_quantile(1 - r.false_accept, len(xs) - 1)
                                * sd / math.sqrt(len(xs)), 4), "segments": [round(x, 4) for x in xs],
                                "first_served_penalty": round(sum(first) / len(first), 4)}
                for label in ("A", "B"):
                    comps = [c for run in runs[label] for c in run.completions]
                    row[f"{label}_mean_ttft_ms"] = round(1e3 * sum(c.ttft for c in comps) / len(comps), 1)
                    row[f"{label}_mean_tpot_ms"] = round(1e3 * sum(c.tpot for c in comps if c.tpot) / len(comps), 2)
                    row[f"{label}_segment_s"] = [round(run.duration_s, 2) for run in runs[label]]
                    row[f"{label}_send_skew_ms"] = max(round(1e3 * (max(c.accepted_s for c in run.completions)
                                                                     - min(c.sent_s for c in run.completions)), 1) for run in runs[label])
                rows.append(row)
                print(json.dumps(row), flush=True)
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aa", type=int, default=3, help="A/A comparisons in all (the first is the stage itself)")
    p.add_argument("--shift", type=float, default=0.05, help="how much slower the slowed head is made in serving")
    p.add_argument("--skip-stage", action="store_true", help="leave out the stage's own run (1)")
    p.add_argument("--only-stage", action="store_true", help="run (1) alone (a smoke test)")
    p.add_argument("--window", type=float, help="override served.cuda.window_s")
    p.add_argument("--segments", type=int, help="override stages.replay.segments")
    p.add_argument("--load", choices=("burst", "arrivals"), help="override stages.replay.load")
    p.add_argument("--errors-only", action="store_true",
                   help="only the gates on the three errors and the head, all from one reference pass, sent at once")
    p.add_argument("--noise", type=int, metavar="ROUNDS",
                   help="only the timed half's noise: two servers of the head, no reference, ROUNDS rounds")
    p.add_argument("--kernel", type=Path, help="the kernel file served as head and candidate (default: the reference decode); "
                   "the slowed comparisons need the reference decode and are left out for any other")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    overrides = {k: v for k, v in (("served.cuda.window_s", a.window), ("stages.replay.segments", a.segments),
                                   ("stages.replay.load", a.load)) if v}
    cfg = config_with(**overrides) if overrides else load_config()
    if a.noise:
        return noise(cfg, a.noise, a.json)
    if a.errors_only:                     # five servers at once: smaller caches for the arms
        presets = dict(cfg.served.presets)
        presets[cfg.served.cuda.preset] = presets[cfg.served.cuda.preset].model_copy(update={"kv_cache_tokens": 65536})
        cfg = cfg.model_copy(update={"served": cfg.served.model_copy(update={"presets": presets}), "stages": cfg.stages.model_copy(
            update={"replay": cfg.stages.replay.model_copy(update={"reference_kv_cache_tokens": 131072})})})
        return errors_only(cfg, a.json)
    head = a.kernel.read_text() if a.kernel else C.REF_DECODE
    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"     # on a CPU: a smoke test of the bench, no figure
    served = getattr(cfg.served, device)
    print(f"window {served.window_s:g} s, {cfg.stages.replay.segments} segments, load {cfg.stages.replay.load}, max_output "
          f"{served.max_output}, false_accept {cfg.stages.replay.false_accept}", flush=True)
    if not a.skip_stage:
        t0 = time.monotonic()
        rows.append(row("stage A/A (run_replay, start to verdict)", run_replay(cfg, device, head, head=head), t0))
    if a.only_stage:
        return
    t0 = time.monotonic()
    with Servers(cfg, device, {"reference": None, "A": head, "B": head}, secrets.randbits(31), wait=False) as servers:
        cont, feed, ref_s = reference_feed(cfg, device, servers, source="A", warm=("B",))
        ref = cont.ref
        servers.wait()
        servers.stop("reference")
        print(f"servers up, A's continuation scored and B's warm pass done in {time.monotonic() - t0:.1f} s (the reference's "
              f"last {ref_s:.1f} s from the start); every comparison below is fed these requests", flush=True)
        for i in range(a.aa - (0 if a.skip_stage else 1)):
            t0 = time.monotonic()
            pair = ("A", "B") if i % 2 == 0 else ("B", "A")
            rows.append(row(f"A/A {i + 1} ({pair[0]} as the head)", timed_pair(cfg, device, servers, ref, feed, *pair), t0))
        if head != C.REF_DECODE:
            print("no slowed comparisons: they spin after the reference decode's calls", flush=True)
            if a.json:
                Path(a.json).write_text(json.dumps(rows, indent=1))
            return
        tpot = [r["head_tpot_p50_ms"] for r in rows if "head_tpot_p50_ms" in r]
        tpot_ms = sorted(tpot)[len(tpot) // 2]
        layers = cfg.served.presets[served.preset].layers
        cycles = int(a.shift * tpot_ms / layers * cycles_per_ms()) if device == "cuda" else 0
        print(f"slowed head: {cycles} cycles after each decode call ({a.shift:.0%} of a {tpot_ms:.2f} ms p50 TPOT "
              f"over {layers} layers)", flush=True)
        servers.stop("B")
        servers.add("S", slowed(head, cycles))
        warm_pass(cfg, device, servers, ("S",), feed)
        t0 = time.monotonic()
        rows.append(row(f"slowed {a.shift:.0%} against the head (must be rejected)",
                        timed_pair(cfg, device, servers, ref, feed, "A", "S"), t0))
        t0 = time.monotonic()
        rows.append(row(f"the head against the slowed (its decode {a.shift:.0%} faster: must be accepted)",
                        timed_pair(cfg, device, servers, ref, feed, "S", "A"), t0))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
