"""Stage 5, replay (CUDA only): the full scored replay of a serving workload — the only stage that accepts.

The served trace (config `served`) is replayed three times against a served process of its own,
each time through the real HTTP client (harness/served/client.py): the baseline, the candidate,
and the baseline again (the two baselines bracket the candidate and give the noise band). Then:
  - gates: the candidate's greedy tokens and logprobs against the first baseline's, request by
    request; divergence is tolerated only at the baseline's near-ties (harness/served/score.py). The
    tolerances grow with the baseline's disagreement with itself;
  - fallbacks: the candidate's server reports, per op, the calls its `supports()` declined; any on
    an op the candidate implements means no acceptance (ops it does not define run the baseline and
    are reported, not held against it);
  - score: every request against p90 bars for TTFT and TPOT (config, or the first baseline's p90),
    by its headroom, the geometric mean of bar/TTFT and bar/TPOT; a replay's score is the geometric
    mean of its requests' (harness/served/score.py says why not the share inside both bars: that
    share flips on a 2% drift). The candidate's score must beat the two baselines' geometric mean by
    a ratio above 1 + max(their relative difference, stages.replay.min_margin).
`accepted` is 1 only when all three hold; otherwise the stage fails with the reason. A candidate
whose server dies or errs is rejected, saying how; a baseline that cannot be served is a harness
error. On CPU the stage is skipped: no CPU figure stands in for a served speedup (the CPU tests call
`run_replay` directly). Not covered: what a candidate does to the server process beyond attention
(its accounting is self-reported; its tokens and the client's clock are not).
"""
from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass

from harness.config import PROJECT_ROOT, Config
from harness.errors import HarnessError
from harness.records import StageResult
from harness.replies import MalformedReply, parse
from harness.served.client import ReplayRun, replay
from harness.served.launch import ServerFailure, ServerHandle, start_server
from harness.served.ops import STALL_MS
from harness.served.score import Gate, attainment, compare, slo_score, summarize
from harness.served.traces import TraceError, TraceRequest, load_trace, requests_for
from harness.stages.common import EvalContext, Rejected


def served_requests(cfg: Config, device: str, window_s: float | None = None) -> list[TraceRequest]:
    served = getattr(cfg.served, device)
    preset = cfg.served.presets[served.preset]
    path = PROJECT_ROOT / served.trace
    try:
        return requests_for(load_trace(path), window_s or served.window_s, preset.vocab, preset.kv_cache_tokens, str(path))
    except TraceError as e:
        raise HarnessError(str(e)) from None


def explain(run: ReplayRun, server: ServerHandle) -> str:
    """Why a replay did not complete, in words: the client's first error, how the server ended."""
    try:
        server.proc.wait(timeout=2)                      # a dying server: let it finish dying
    except subprocess.TimeoutExpired:
        pass
    died = "" if server.alive() else f"the server {server.how_it_ended()} during the replay; "
    tail = server.log_tail()
    return died + run.describe_failures() + (f"; its last output:\n{tail}" if tail else "")


def replay_once(cfg: Config, device: str, source: str | None, requests: list[TraceRequest],
                label: str) -> tuple[ReplayRun, dict | None]:
    """Start a server (with the candidate, or the baseline for None), replay, read its accounting."""
    with start_server(cfg, device, source, [len(r.prompt) for r in requests]) as server:
        run = replay(server.url, server.model, requests, cfg.served.request_timeout_s, cfg.served.drain_timeout_s, label)
        run.server_ready_s = server.ready_s
        if run.failures():
            raise ServerFailure(explain(run, server))
        return run, server.stats()


@dataclass
class ReplayOutcome:
    accepted: bool
    reason: str
    gate: Gate
    metrics: dict[str, float]

    def stage_result(self) -> StageResult:
        if not self.accepted:
            raise Rejected(self.reason, **self.metrics)
        return StageResult.passed("replay", self.reason, **self.metrics)


def _fallbacks(stats: dict | None) -> tuple[float, str]:
    """The share of calls to the candidate's own ops that fell back, and a sentence about all ops."""
    if not stats or not isinstance(stats.get("ops"), dict):
        return float("nan"), "the server reports no fallback accounting (GET /kevo/stats)"
    calls = declined = 0
    words = []
    for op, s in stats["ops"].items():
        n, fell = int(s.get("calls", 0)), int(s.get("unsupported", 0))
        if not s.get("implemented"):
            words.append(f"{op} not implemented ({n} calls ran the baseline)")
            continue
        calls, declined = calls + n, declined + fell
        words.append(f"{op}: {fell} of {n} calls fell back" if fell else f"{op}: all {n} calls the candidate's")
    return (declined / calls if calls else float("nan")), "; ".join(words)


def _stalls(stats: dict | None) -> tuple[dict[str, float], str]:
    """The candidate's calls that held the server's host in the window (compiles inside it, or waits
    on the GPU): metrics, and a clause for the reason (empty when there were none)."""
    ops = stats.get("ops") if isinstance(stats, dict) else None
    rows = [s for s in ops.values() if isinstance(s, dict) and "stalls" in s] if isinstance(ops, dict) else []
    if not rows:
        return {}, ""
    n, total = sum(int(s["stalls"]) for s in rows), sum(float(s["stall_ms"]) for s in rows)
    worst = max(float(s["worst_stall_ms"]) for s in rows)
    metrics = {"candidate_stalls": float(n), "candidate_stall_ms": total}
    if not n:
        return metrics, ""
    return metrics, (f"; {n} candidate call{'s' if n > 1 else ''} held the host over {STALL_MS:g} ms in the window "
                     f"({total:.0f} ms in all, the worst {worst:.0f} ms): compiles the warm-up did not reach, or waits on the GPU")


def _graphs(stats: dict | None) -> tuple[dict[str, float], str]:
    """Whether the candidate's server decoded from CUDA graphs (harness/served/graphs.py): a metric, and
    a clause for the reason when it did not and says why (a decode that cannot be captured)."""
    g = stats.get("graphs") if isinstance(stats, dict) else None
    if not isinstance(g, dict) or not isinstance(g.get("on"), bool):
        return {}, ""
    words = f"; the candidate's server decoded eagerly: CUDA graphs {str(g.get('reason', ''))[:400]}"
    return {"candidate_cuda_graphs": float(g["on"])}, (words if g.get("fell_back") is True else "")


def judge(cfg: Config, dtype: str, base: ReplayRun, cand: ReplayRun, again: ReplayRun, stats: dict | None) -> ReplayOutcome:
    r = cfg.stages.replay
    g = r.gates[dtype]
    noise_lp = compare(base, again, float("inf"), float("inf")).max_logprob_diff
    tol = max(g.logprob_tolerance, r.noise_factor * noise_lp)
    margin = max(g.near_tie_margin, 2 * tol)
    itself = compare(base, again, tol, margin)
    if not itself.passed:
        raise HarnessError(f"the baseline disagrees with itself, so the gates cannot judge: {itself.detail} "
                           f"(widen stages.replay.gates.{dtype})")
    gate = compare(base, cand, tol, margin)
    s = {name: summarize(run) for name, run in (("baseline", base), ("candidate", cand), ("baseline_again", again))}
    ttft_bar = r.ttft_p90_ms or s["baseline"]["ttft_p90_ms"]
    tpot_bar = r.tpot_p90_ms or s["baseline"]["tpot_p90_ms"]
    runs = (("baseline", base), ("candidate", cand), ("baseline_again", again))
    att = {name: attainment(run, ttft_bar, tpot_bar) for name, run in runs}
    sc = {name: slo_score(run, ttft_bar, tpot_bar) for name, run in runs}
    noise = abs(sc["baseline"] / sc["baseline_again"] - 1)
    base_sc = math.sqrt(sc["baseline"] * sc["baseline_again"])
    need = max(noise, r.min_margin)
    gain = sc["candidate"] / base_sc - 1
    fallback_share, fallback_words = _fallbacks(stats)
    stall_metrics, stall_words = _stalls(stats)
    graph_metrics, graph_words = _graphs(stats)
    stall_metrics, stall_words = stall_metrics | graph_metrics, stall_words + graph_words
    b, c = s["baseline"], s["candidate"]
    metrics = {
        "accepted": 0.0, "gate_passed": float(gate.passed), "gate_tokens_compared": float(gate.compared), "gate_near_ties": float(gate.near_ties),
        "gate_max_logprob_diff": gate.max_logprob_diff, "logprob_tolerance": tol, "near_tie_margin": margin,
        "fallback_share": fallback_share, "ttft_bar_ms": ttft_bar, "tpot_bar_ms": tpot_bar,
        "slo_score": sc["candidate"], "slo_score_baseline": sc["baseline"], "slo_score_baseline_again": sc["baseline_again"],
        "attainment": att["candidate"], "attainment_baseline": att["baseline"], "attainment_baseline_again": att["baseline_again"],
        "noise": noise, "required_gain": need, "gain": gain,
        "tpot_p90_speedup": b["tpot_p90_ms"] / c["tpot_p90_ms"], "ttft_p90_speedup": b["ttft_p90_ms"] / c["ttft_p90_ms"],
        "throughput_ratio": c["throughput_tok_s"] / b["throughput_tok_s"] if b["throughput_tok_s"] else float("nan"),
    } | stall_metrics
    for name, summary in s.items():
        metrics.update({f"{name}_{k}": v for k, v in summary.items()})
    for name, run in (("baseline", base), ("candidate", cand), ("baseline_again", again)):
        metrics[f"{name}_max_send_lag_s"] = run.max_send_lag_s     # a client that fell behind skews its timings
        metrics[f"{name}_server_ready_s"] = run.server_ready_s     # start to ready, the warm-up in it: the stage's cost
    score = (f"SLO score {sc['candidate']:.3f} against the baselines' {sc['baseline']:.3f} and {sc['baseline_again']:.3f} "
             f"({gain:+.1%}; p90 bars TTFT {ttft_bar:.1f} ms, TPOT {tpot_bar:.2f} ms; inside both: {att['candidate']:.2f} vs "
             f"{att['baseline']:.2f} and {att['baseline_again']:.2f}); p90 TPOT {c['tpot_p90_ms']:.2f} vs "
             f"{b['tpot_p90_ms']:.2f} ms, p90 TTFT {c['ttft_p90_ms']:.1f} vs {b['ttft_p90_ms']:.1f} ms, "
             f"{c['throughput_tok_s']:.0f} vs {b['throughput_tok_s']:.0f} tokens/s{stall_words}")
    if not gate.passed:
        return ReplayOutcome(False, f"the served tokens differ from the baseline's: {gate.detail}", gate, metrics)
    if not fallback_share == 0.0:
        return ReplayOutcome(False, f"not accepted: {fallback_words}; gates passed ({gate.detail}); {score}", gate, metrics)
    accepted = gain > need
    verdict = "accepted" if accepted else f"not better than the baseline beyond noise (needs {need:+.1%})"
    metrics["accepted"] = float(accepted)
    return ReplayOutcome(accepted, f"{verdict}: {score}; gates: {gate.detail}; {fallback_words}", gate, metrics)


def _time_left(deadline: float | None, cfg: Config, device: str) -> None:
    need = getattr(cfg.served, device).window_s
    if deadline is not None and deadline - time.monotonic() < need:
        raise Rejected(f"the stage's time (stages.replay.timeout_s) ran out before the next {need:g} s replay", timeout=1.0)


def _baseline(cfg: Config, device: str, requests: list[TraceRequest], label: str) -> ReplayRun:
    try:
        return replay_once(cfg, device, None, requests, label)[0]
    except ServerFailure as e:
        raise HarnessError(f"the {label} server: {e}") from None


def run_replay(cfg: Config, device: str, source: str, deadline: float | None = None) -> ReplayOutcome:
    requests = served_requests(cfg, device)
    dtype = getattr(cfg.targets.attention, device).dtype
    base = _baseline(cfg, device, requests, "baseline")
    _time_left(deadline, cfg, device)
    try:
        cand, stats = replay_once(cfg, device, source, requests, "candidate")
    except ServerFailure as e:
        raise Rejected(f"the candidate's server: {e}", server_failed=1.0) from None
    if stats is not None:                 # the candidate's process wrote it: validated like any reply
        try:
            stats = parse("served_stats", stats).model_dump()
        except MalformedReply as e:
            raise Rejected(f"the candidate's server's accounting (GET /kevo/stats) is malformed: {e}", protocol=1.0) from None
    _time_left(deadline, cfg, device)
    again = _baseline(cfg, device, requests, "baseline again")
    return judge(cfg, dtype, base, cand, again, stats)


def replay_stage(ctx: EvalContext) -> StageResult:
    if ctx.device.type != "cuda":
        return StageResult.skipped("replay", "skipped: needs CUDA; this machine has none, and no CPU figure "
                                             "stands in for a served speedup")
    if ctx.worker is not None:            # the cheap stages' worker holds GPU memory the servers need
        ctx.worker.close()
        ctx.worker = None
    return run_replay(ctx.cfg, "cuda", ctx.source, ctx.deadline).stage_result()
