"""Stage 5, replay: the full scored replay of a serving workload, the candidate against the current head.

Three servers of the served model (harness/served/), started at once from one weight seed drawn in
secret for this replay: the reference (torch's baselines in `reference_dtype`, float32: the float
reference every arm is held to), the head (the current head of the candidate's op; with none given,
torch's baselines in the served dtype) and the candidate. Once the reference is up, the trusted side
draws the requests (harness/served/traces.py `draw_requests`: the trace's arrivals, its length pairs
drawn with a secret seed, fresh token ids); the arms see them only when fed. Then:
  1. the continuation: the head serves the requests free-running, untimed, as the timed segments will come (a
     burst a segment): its greedy tokens are the continuation every arm is fed. As each segment's tokens come
     in, the reference scores them (`kevo_score`: the prompt and the tokens in one float32 prefill, no decode
     step): its logprobs of every token and its own top choices are what every arm is held to. The head was a
     candidate once: its tokens are used only if they are the reference's own greedy path up to near-ties
     (score.py `parting`); else the reference decodes its own (the slow way) and the reason says why.
     Meanwhile the candidate serves a window of its own (`warm_pass`: the scored requests' twins, the same
     arrivals and lengths with fresh token ids, so nothing served there answers a scored request): both arms
     have served the steps they are timed on, shape for shape, once before (a server is about 10% slower on
     steps of shapes it has not served yet: docs/SERVED.md). The reference server is stopped before anything
     is timed.
  2. timed, paired: the window is cut into `segments` by arrival time and each segment is replayed to the head
     and to the candidate in turn, in the order AB BA AB ... (a drift over the stage falls on both arms alike),
     each arm fed the continuation (teacher forcing: `kevo_forced`), so both do the same work and every
     generated token can be compared. With `load: burst` a segment's requests come at once, queued together.
  3. gates (harness/served/score.py `compare_forced`): every token's logprob against the reference's, within
     fixed bounds and, on the mean, within `head_factor` x the head's on the same tokens; where an arm's own
     choice is not the reference's, the reference's lead must have been a near-tie.
  4. fallbacks: the candidate's server reports, per op, the calls its `supports()` declined; any on an
     op the candidate implements means no acceptance. Its spot checks (served/spot.py) reject a wrong call.
  5. speed (score.py `paired`): per request the head-over-candidate ratio of TTFT and of TPOT, per
     segment their mean log, over segments a one-sided bound at `false_accept`.
`accepted` is 1 only when the gates pass, nothing fell back and the gain's lower bound beats
`min_margin`. The head's own gates and gain figures are reported beside. A candidate whose server
dies or errs is rejected, saying how; a reference or head that cannot be served is a harness error.
Each server is handed the compiled kernels its sources' earlier sandboxes left (harness/compiled.py: the
candidate's worker, every head compiled alone, the head's servers in earlier replays: harness/stages/carry.py), so
it starts sooner; the warm-up is the same either way.

On a CPU the stage runs the gates only (the `cpu` served preset: tiny, float32, Triton's interpreter): reference and
candidate, the reference's own greedy tokens the continuation, every token compared, nothing timed and nothing
accepted - so a kernel wrong only in serving is rejected on any machine. Not covered: what a candidate does to its
server process beyond attention (its accounting is self-reported; its tokens and the client's clock are not).
"""
from __future__ import annotations

import logging
import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from harness.config import Config
from harness.errors import HarnessError
from harness.records import StageResult
from harness.served.client import ReplayRun
from harness.served.accounting import dispatch, fallbacks, graphs, host_times, spot_checks, stalls, starved, startup
from harness.served.score import Gate, Paired, against_head, compare_forced, paired, parting, summarize
from harness.served.traces import TraceError, TraceRequest, draw_requests, fresh_ids, requests_for
from harness.stages.arms import Servers, served_lines, served_stats
from harness.stages.carry import compile_heads, keep_worker
from harness.stages.common import EvalContext, Rejected

log = logging.getLogger(__name__)     # progress lines (kevo-agent evaluate --progress); nothing decides on them


def served_requests(cfg: Config, device: str, window_s: float | None = None) -> list[TraceRequest]:
    """The trace's own requests in the window, its own prompts (the profile's and the benches' workload)."""
    served = getattr(cfg.served, device)
    preset = cfg.served.presets[served.preset]
    lines, source = served_lines(cfg, device)
    try:
        return requests_for(lines, window_s or served.window_s, preset.vocab, preset.kv_cache_tokens, source)
    except TraceError as e:
        raise HarnessError(str(e)) from None


def draw(cfg: Config, device: str, rng: random.Random, window_s: float | None = None) -> list[TraceRequest]:
    """This replay's requests: the trace's window, its length pairs and token ids drawn with `rng`,
    outputs cut to `served.<device>.max_output`."""
    served = getattr(cfg.served, device)
    preset = cfg.served.presets[served.preset]
    lines, source = served_lines(cfg, device)
    try:
        reqs = draw_requests(lines, window_s or served.window_s, preset.vocab, preset.kv_cache_tokens, rng, source)
    except TraceError as e:
        raise HarnessError(str(e)) from None
    cap = served.max_output
    return reqs if cap is None else [replace(r, output_len=min(r.output_len, cap)) for r in reqs]


@dataclass
class Continuation:
    """The reference's run on the tokens every arm is fed: their logprobs and its own top choices. `source`: whose
    greedy tokens they are; `parted`: why a source's were not used (they left the reference's choice at a clear lead)."""
    ref: ReplayRun
    source: str
    parted: str = ""


def continuation_pass(cfg: Config, device: str, servers: Servers, requests: list[TraceRequest],
                      source: str | None = None) -> Continuation:
    """The reference's run on a continuation of the requests (untimed). `source` None: the reference's own
    greedy tokens, all sent at once. Else the server of `source` serves them free-running, a burst a segment
    as the timed segments come (its warm pass), and the reference scores each segment's tokens in one
    prefill (`scored`) while the next segment is served: the same logprobs as decoding them, at a prefill's
    cost - its float32 decode was most of the stage's time (docs/BENCHMARKS.md). A source's tokens are used
    only if they are the reference's own greedy path up to near-ties (`parting`): the source is a kernel
    that was a candidate once, and no path it made is followed where the reference would not have gone;
    else the reference decodes its own (the slow way)."""
    greedy = [replace(r, arrival_s=0.0) for r in requests]
    if source is None:
        return Continuation(servers.send("reference", greedy), "reference")
    r = cfg.stages.replay
    with ThreadPoolExecutor(1, thread_name_prefix="scoring") as pool:
        pending = []
        for seg in segments(requests, getattr(cfg.served, device).window_s, r.segments):
            feed = forced(seg, servers.send(source, seg, r.load == "burst"))
            pending.append(pool.submit(servers.send, "reference", [replace(x, arrival_s=0.0, scored=True) for x in feed]))
        log.info("replay: the %s served the continuation, %d segments scored", source, sum(p.done() for p in pending))
        ref = merged("reference", [p.result() for p in pending])
    parted = parting(ref, r.gates[getattr(cfg.targets.attention, device).dtype].near_tie_margin)
    if parted:
        return Continuation(servers.send("reference", greedy), "reference", f"the {source}'s continuation parted: {parted}")
    return Continuation(ref, source)


def forced(requests: list[TraceRequest], run: ReplayRun) -> list[TraceRequest]:
    """The requests with `run`'s tokens, the continuation, to feed back (teacher forcing)."""
    tokens = {c.index: c.tokens for c in run.completions}
    out = []
    for r in requests:
        try:
            ids = tuple(int(t.removeprefix("token_id:")) for t in tokens[r.index])
        except (KeyError, ValueError):
            raise HarnessError(f"the {run.label} server's tokens for request {r.index + 1} are not token ids") from None
        out.append(replace(r, forced=ids))
    return out


def segments(requests: list[TraceRequest], window_s: float, n: int) -> list[list[TraceRequest]]:
    """The requests cut into `n` windows by arrival, each shifted to start at 0; empty ones dropped."""
    width = window_s / n
    out = []
    for j in range(n):
        seg = [replace(r, arrival_s=r.arrival_s - j * width) for r in requests if j * width <= r.arrival_s < (j + 1) * width]
        if seg:
            out.append(seg)
    return out


def merged(label: str, runs: list[ReplayRun]) -> ReplayRun:
    return ReplayRun(label, [c for r in runs for c in r.completions], sum(r.duration_s for r in runs),
                     max((r.max_send_lag_s for r in runs), default=0.0), runs[0].server_ready_s if runs else float("nan"))


@dataclass
class ReplayOutcome:
    accepted: bool
    reason: str
    gate: Gate
    metrics: dict[str, float]
    timed: bool = True
    reference: ReplayRun | None = None    # what every arm was held to (kept for reading, never for judging again)
    runs: dict[str, list[ReplayRun]] | None = None   # the timed segments per arm (kept for reading)

    def stage_result(self) -> StageResult:
        if not self.accepted and (self.timed or not self.gate.passed or self.metrics.get("fallback_share", 0.0) > 0):
            raise Rejected(self.reason, None if self.gate.passed else "wrong_output", **self.metrics)
        return StageResult.passed("replay", self.reason, **self.metrics)


def _gate(cfg: Config, dtype: str, ref: ReplayRun, run: ReplayRun) -> Gate:
    g = cfg.stages.replay.gates[dtype]
    return compare_forced(ref, run, g.max_abs, g.mean_abs, g.near_tie_margin)


def _gate_metrics(prefix: str, gate: Gate) -> dict[str, float]:
    return {f"{prefix}gate_passed": float(gate.passed), f"{prefix}gate_tokens_compared": float(gate.compared),
            f"{prefix}gate_coverage": gate.coverage, f"{prefix}gate_flips": float(gate.flips),
            f"{prefix}gate_flip_lead": gate.flip_lead, f"{prefix}gate_max_logprob_diff": gate.max_abs,
            f"{prefix}gate_p99_logprob_diff": gate.p99_abs, f"{prefix}gate_mean_logprob_diff": gate.mean_abs}


def judge(cfg: Config, dtype: str, ref: ReplayRun, head: list[ReplayRun], cand: list[ReplayRun],
          stats: dict | None, head_is_torch: bool = False, head_stats: dict | None = None) -> ReplayOutcome:
    """The verdict from the replays: `head[j]`/`cand[j]` the arms' runs of segment j (teacher-forced); `stats`
    and `head_stats` the arms' servers' accounting."""
    r = cfg.stages.replay
    h_all, c_all = merged("head", head), merged("candidate", cand)
    head_gate = _gate(cfg, dtype, ref, h_all)
    gate = against_head(_gate(cfg, dtype, ref, c_all), head_gate, r.head_factor, r.gates[dtype].mean_floor)
    speed: Paired = paired(head, cand, r.false_accept)
    fallback_share, fallback_words = fallbacks(stats)
    stall_metrics, stall_words = stalls(stats)
    graph_metrics, graph_words = graphs(stats)
    head_graph_metrics, head_graph_words = graphs(head_stats, "head")
    host_metrics, host_words = host_times(stats, head_stats)
    spot_metrics, head_spot_words = spot_checks(stats, head_stats)
    stall_metrics, stall_words = (stall_metrics | graph_metrics | head_graph_metrics | host_metrics | startup(stats)
                                  | startup(head_stats, "head") | dispatch(stats, cfg.stages.dispatch) | spot_metrics), \
        stall_words + graph_words + head_graph_words + host_words
    hs, cs = summarize(h_all), summarize(c_all)
    metrics = {"accepted": 0.0, **_gate_metrics("", gate), **_gate_metrics("head_", head_gate),
               "fallback_share": fallback_share, "gain": speed.gain, "gain_lower": speed.lower,
               "noise_band": speed.band, "required_gain": r.min_margin, "segments": float(len(speed.segments)),
               "tpot_p90_speedup": hs["tpot_p90_ms"] / cs["tpot_p90_ms"] if cs["tpot_p90_ms"] else float("nan"),
               "ttft_p90_speedup": hs["ttft_p90_ms"] / cs["ttft_p90_ms"] if cs["ttft_p90_ms"] else float("nan"),
               "throughput_ratio": cs["throughput_tok_s"] / hs["throughput_tok_s"] if hs["throughput_tok_s"] else float("nan"),
               "head_is_torch": float(head_is_torch)} | stall_metrics
    for name, summary in (("head", hs), ("candidate", cs)):
        metrics.update({f"{name}_{k}": v for k, v in summary.items()})
    for j, x in enumerate(speed.segments):
        metrics[f"segment{j + 1}_log_gain"] = x
    for name, run in (("reference", ref), ("head", h_all), ("candidate", c_all)):
        metrics[f"{name}_server_ready_s"] = run.server_ready_s     # start to ready, the warm-up in it: the stage's cost
    metrics["max_send_lag_s"] = max(h_all.max_send_lag_s, c_all.max_send_lag_s)  # a client that fell behind skews timings
    against = "torch (no head given)" if head_is_torch else "the head"
    score = (f"served {speed.detail.replace('over the head', 'over ' + against)}; p90 TPOT {cs['tpot_p90_ms']:.2f} vs "
             f"{hs['tpot_p90_ms']:.2f} ms, p90 TTFT {cs['ttft_p90_ms']:.1f} vs {hs['ttft_p90_ms']:.1f} ms{stall_words}")
    head_words = (f"the head's gates: {head_gate.detail}" if head_gate.passed
                  else f"the head FAILS its gates: {head_gate.detail}") + head_spot_words
    if not gate.passed:
        return ReplayOutcome(False, f"the served tokens differ from the reference's: {gate.detail}", gate, metrics)
    if not fallback_share == 0.0:
        return ReplayOutcome(False, f"not accepted: {fallback_words}; gates passed ({gate.detail}); {score}", gate, metrics)
    if starved(head_stats) and metrics.get("candidate_cuda_graphs") == 1.0:
        return ReplayOutcome(False, "not accepted: the head's server ran out of GPU memory capturing its CUDA graphs and "
                             "decoded eagerly, the candidate's from graphs: the arms are not comparable (a kernel can "
                             f"hold GPU memory outside its server's share){head_graph_words}; {score}", gate, metrics)
    accepted = speed.lower > r.min_margin
    verdict = "accepted" if accepted else f"not faster than {against} beyond noise (the lower bound must beat {r.min_margin:+.1%})"
    metrics["accepted"] = float(accepted)
    return ReplayOutcome(accepted, f"{verdict}: {score}; gates: {gate.detail}; {head_words}; {fallback_words}", gate, metrics)


def _time_left(deadline: float | None, need_s: float) -> None:
    if deadline is not None and deadline - time.monotonic() < need_s:
        raise Rejected(f"the stage's time (stages.replay.timeout_s) ran out before the next {need_s:g} s of replay", "timeout")


def gates_in(cfg: Config, device: str, servers: Servers, label: str = "candidate",
             deadline: float | None = None, head_label: str | None = None) -> ReplayOutcome:
    """Gates only, on servers already up: fresh requests, the reference's own greedy pass, `label` fed its
    tokens (at the requests' arrival times), every token compared; nothing timed or accepted. With
    `head_label`, that server is fed them too and the candidate's mean is also held to `head_factor` x the head's."""
    dtype = getattr(cfg.targets.attention, device).dtype
    t0 = time.monotonic()
    servers.wait(["reference"])       # it compiles nothing: up first, its pass overlaps the others' warm-up
    requests = draw(cfg, device, random.Random(secrets.randbits(64)))
    ref = continuation_pass(cfg, device, servers, requests).ref
    log.info("replay: the reference's own greedy pass over %d requests (%.0f s)", len(requests), time.monotonic() - t0)
    servers.wait()
    _time_left(deadline, 0)
    feed = forced(requests, ref)
    cand = servers.send(label, feed)
    stats = served_stats(servers.handles[label])
    gate = _gate(cfg, dtype, ref, cand)
    head_metrics = {}
    if head_label is not None:
        head_gate = _gate(cfg, dtype, ref, servers.send(head_label, feed))
        gate = against_head(gate, head_gate, cfg.stages.replay.head_factor, cfg.stages.replay.gates[dtype].mean_floor)
        head_metrics = _gate_metrics("head_", head_gate)
    fallback_share, fallback_words = fallbacks(stats)
    stall_metrics, stall_words = stalls(stats)
    stall_metrics |= dispatch(stats, cfg.stages.dispatch) | spot_checks(stats)[0]
    metrics = {"accepted": 0.0, "timed": 0.0, **_gate_metrics("", gate), **head_metrics, "fallback_share": fallback_share,
               "stage_s": time.monotonic() - t0} | stall_metrics
    if not gate.passed:
        reason = f"the served tokens differ from the reference's: {gate.detail}"
    elif not fallback_share == 0.0:
        reason = f"not accepted: {fallback_words}; gates passed ({gate.detail})"
    else:
        reason = (f"gates passed on the {device} ({gate.detail}); {fallback_words}{stall_words}; nothing timed and nothing "
                  f"accepted: no CPU figure stands in for a served speedup")
    return ReplayOutcome(False, reason, gate, metrics, timed=False, reference=ref)


def reference_feed(cfg: Config, device: str, servers: Servers, source: str | None = None,
                   warm: tuple[str, ...] = ()) -> tuple[Continuation, list[TraceRequest], float]:
    """Fresh requests drawn once the reference (and `source`) is up, the reference's run on their
    continuation (`continuation_pass`), and the requests with the continuation to feed the arms; the
    seconds to the reference's last logprob (the servers' start included). Meanwhile each server in `warm`
    is sent a warm pass once it is up (`warm_pass`)."""
    t0 = time.monotonic()
    servers.wait(["reference"] + ([source] if source else []))
    requests = draw(cfg, device, random.Random(secrets.randbits(64)))
    with ThreadPoolExecutor(1, thread_name_prefix="reference") as pool:
        pending = pool.submit(continuation_pass, cfg, device, servers, requests, source)
        try:
            if warm:
                servers.wait(list(warm))
                warm_pass(cfg, device, servers, warm, requests)
        except BaseException:
            for label in ("reference", source):  # an arm failed: its failure is the verdict, not the pass cut short
                if label:
                    servers.stop(label)
            pending.exception()
            raise
        cont = pending.result()
    log.info("replay: the reference %s of %d requests (%.0f s)", "decoded its own continuation" if cont.source == "reference"
             else f"scored the {cont.source}'s continuation", len(requests), time.monotonic() - t0)
    return cont, forced(requests, cont.ref), time.monotonic() - t0


def warm_pass(cfg: Config, device: str, servers: Servers, labels: tuple[str, ...], like: list[TraceRequest]) -> None:
    """Each server of `labels` served a window of its own, untimed, free-running, a burst a segment: the twins of `like`
    (the scored requests: their arrivals and lengths, fresh token ids, `fresh_ids`), as the head served the scored
    requests themselves (its continuation). A server warmed on another draw ran them 10% slower (docs/SERVED.md)."""
    burst = cfg.stages.replay.load == "burst"
    preset = cfg.served.presets[getattr(cfg.served, device).preset]
    segs = segments(fresh_ids(like, preset.vocab, random.Random(secrets.randbits(64))),
                    getattr(cfg.served, device).window_s, cfg.stages.replay.segments)
    for label in labels:
        for seg in segs:
            servers.send(label, seg, burst)
        log.info("replay: the %s server served its warm window", label)


def timed_pair(cfg: Config, device: str, servers: Servers, ref: ReplayRun, feed: list[TraceRequest],
               head_label: str = "head", cand_label: str = "candidate", deadline: float | None = None,
               head_is_torch: bool = False) -> ReplayOutcome:
    """The timed half on servers up and warm, the reference's feed given: the segments to the two arms in
    the order AB BA ..., judged (see the module's docstring)."""
    r = cfg.stages.replay
    dtype = getattr(cfg.targets.attention, device).dtype
    window = getattr(cfg.served, device).window_s
    runs: dict[str, list[ReplayRun]] = {head_label: [], cand_label: []}
    parts = segments(feed, window, r.segments)
    for j, seg in enumerate(parts):
        _time_left(deadline, window / r.segments)
        for label in ((head_label, cand_label) if j % 2 == 0 else (cand_label, head_label)):
            runs[label].append(servers.send(label, seg, r.load == "burst"))
        log.info("replay: timed segment %d of %d served to both arms", j + 1, len(parts))
    stats = served_stats(servers.handles[cand_label])
    outcome = judge(cfg, dtype, ref, runs[head_label], runs[cand_label], stats, head_is_torch,
                    served_stats(servers.handles[head_label], head=True))
    outcome.reference, outcome.runs = ref, runs
    return outcome


def paired_in(cfg: Config, device: str, servers: Servers, head_label: str = "head", cand_label: str = "candidate",
              deadline: float | None = None, keep_reference: bool = False, head_is_torch: bool = False) -> ReplayOutcome:
    """The timed comparison on servers already up: fresh requests, the head's continuation scored by the
    reference (the candidate's warm pass beside them), then the two arms fed it in alternating segments,
    judged (see the module's docstring)."""
    t0 = time.monotonic()
    cont, feed, ref_s = reference_feed(cfg, device, servers, source=head_label, warm=(cand_label,))
    servers.wait()
    arms_s = time.monotonic() - t0
    if not keep_reference:
        servers.stop("reference")            # nothing but the two arms on the GPU while they are timed
    outcome = timed_pair(cfg, device, servers, cont.ref, feed, head_label, cand_label, deadline, head_is_torch)
    outcome.metrics.update(reference_done_s=ref_s, arms_ready_s=arms_s,   # from the call, servers' start included
                           continuation_from_head=float(cont.source == head_label))
    if cont.parted:
        outcome.reason += f"; {cont.parted}, so the reference's own greedy tokens were fed"
    return outcome


def run_gates(cfg: Config, device: str, source: str, deadline: float | None = None,
              other_heads: dict[str, str] | None = None) -> ReplayOutcome:
    """The CPU path: reference and candidate, every token compared, nothing timed or accepted."""
    t0 = time.monotonic()
    with Servers(cfg, device, {"reference": None, "candidate": source}, secrets.randbits(31), wait=False,
                 other_heads=other_heads) as servers:
        outcome = gates_in(cfg, device, servers, "candidate", deadline)
    outcome.metrics.update(stage_s=time.monotonic() - t0, **servers.carried_mib())
    return outcome


def run_replay(cfg: Config, device: str, source: str, head: str | None = None,
               deadline: float | None = None, other_heads: dict[str, str] | None = None) -> ReplayOutcome:
    """The timed stage (CUDA; callable on any device, as the tests do): see the module's docstring. `other_heads`:
    the heads of the ops the candidate is not about, served in both arms (`Servers`)."""
    t0 = time.monotonic()
    with Servers(cfg, device, {"reference": None, "head": head, "candidate": source}, secrets.randbits(31),
                 wait=False, other_heads=other_heads) as servers:
        outcome = paired_in(cfg, device, servers, "head", "candidate", deadline, head_is_torch=head is None)
    outcome.metrics.update(stage_s=time.monotonic() - t0, evaluator_gpu_held_gib=servers.held / (1 << 30),
                           gpu_free_gib=servers.free / (1 << 30), **servers.carried_mib())
    return outcome


def replay_stage(ctx: EvalContext) -> StageResult:
    if ctx.worker is not None:            # the cheap stages' worker holds memory the servers need
        keep_worker(ctx.cfg, ctx.worker, ctx.source)       # and compiled kernels they can use
        ctx.worker.close()
        ctx.worker = None
    if ctx.device.type != "cuda" and not ctx.cfg.stages.replay.cpu_gates:
        return StageResult.skipped("replay", "skipped: needs CUDA to time, and stages.replay.cpu_gates is off, so "
                                             "its gates did not run either")
    ctx.parity = None                     # and so do the evaluator's draws (its reserve: `Servers`)
    alone = compile_heads(ctx)
    if ctx.device.type != "cuda":
        outcome = run_gates(ctx.cfg, "cpu", ctx.source, ctx.deadline or None, ctx.other_heads)
    else:
        outcome = run_replay(ctx.cfg, "cuda", ctx.source, ctx.head, ctx.deadline or None, ctx.other_heads)
    if alone:
        outcome.metrics["heads_compiled_alone_s"] = alone
    return outcome.stage_result()
