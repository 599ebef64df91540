"""What a kernel's served process reports of itself (GET /kevo/stats, harness/served/server.py), read for the
replay's verdict: the share of the candidate's own ops' calls that fell back, the calls that held the host in the
window, the host time of each arm's calls, whether each arm decoded from CUDA graphs, how long each arm's server
took to start, by part (`startup`: diagnostics, nothing decides on them), the candidate's calls as watched there
(`dispatch`), and each arm's spot checks. Each gives metrics and words for the reason. The process the candidate
runs in wrote these figures: the replay validates them (harness/replies.py) before they get here; the fallbacks
(any at all means no acceptance), the watched calls (held to the worker's dispatch rules) and the candidate's spot
checks decide. Not covered: fetching the stats (launch.py) or judging tokens and timings (score.py).
"""
from __future__ import annotations

from harness.stages.common import Rejected, dispatch_rules


def fallbacks(stats: dict | None) -> tuple[float, str]:
    """The share of calls to the candidate's own ops that fell back, and a sentence about all ops."""
    if not stats or not isinstance(stats.get("ops"), dict):
        return float("nan"), "the server reports no fallback accounting (GET /kevo/stats)"
    calls = declined = 0
    words = []
    for op, s in stats["ops"].items():
        n, fell = int(s.get("calls", 0)), int(s.get("unsupported", 0))
        if not s.get("implemented"):
            by_head = int(s.get("other_head", 0))
            words.append(f"{op} not implemented ({by_head} of {n} calls ran its head beside the candidate, the rest "
                         "the baseline)" if by_head else f"{op} not implemented ({n} calls ran the baseline)")
            continue
        calls, declined = calls + n, declined + fell
        words.append(f"{op}: {fell} of {n} calls fell back" if fell else f"{op}: all {n} calls the candidate's")
    return (declined / calls if calls else float("nan")), "; ".join(words)


def dispatch(stats: dict | None, rules) -> dict[str, float]:
    """The candidate's calls in its served process held to the rules its calls in the worker met (`rules`: config
    stages.dispatch; harness/stages/common.py `dispatch_rules`): every call launched a Triton kernel, and its
    audited calls (all of the warm-up and graph captures, a secret share of the served ones) issued no library
    compute and torch compute within its share. Rejected otherwise; the audited calls per op as metrics."""
    ops = stats.get("ops") if isinstance(stats, dict) else None
    metrics = {}
    for op, s in (ops or {}).items():
        if not isinstance(s, dict) or not s.get("implemented"):
            continue
        where = f"{op} in the candidate's served process"
        if s.get("no_launch"):
            raise Rejected(f"{where}: {s['no_launch']} of its calls launched no Triton kernel (every call in parity "
                           "did): the output is computed elsewhere when served", "library_ops")
        dispatch_rules(rules, f"{where} ({s.get('audited', 0)} calls audited)", s.get("op_calls") or {},
                       s.get("op_elements") or {}, float(s.get("audit_madds", 0.0)))
        metrics[f"served_{op}_audited_calls"] = float(s.get("audited", 0))
    return metrics


def _spot_failures(stats: dict | None, who: str) -> list[str]:
    """Each implemented op of `who`'s served process with served calls outside parity's tolerance, in words."""
    ops = stats.get("ops") if isinstance(stats, dict) else None
    return [f"{op} in the {who}'s served process: {s['spot_failed']} of the {s['spot_checked']} served calls checked "
            f"(a secret share) differ from the float64 reference beyond parity's tolerance; the first: "
            f"{s.get('spot_first', '')}"
            for op, s in (ops or {}).items() if isinstance(s, dict) and s.get("implemented") and s.get("spot_failed")]


def spot_checks(stats: dict | None, head_stats: dict | None = None) -> tuple[dict[str, float], str]:
    """The arms' served calls checked against the float64 reference (harness/served/spot.py: a secret share, one
    sequence each; both arms' servers check at the same share, so both pay for it in the window). The candidate's:
    Rejected if any fell outside parity's tolerance; the calls checked per op as metrics. The head's (where given):
    said and counted, not held against the candidate. A head accepted once can still be wrong where it is served
    (2026-12-06, H100: s50's c022 failed a spot check in a later replay)."""
    failed = _spot_failures(stats, "candidate")
    if failed:
        raise Rejected(failed[0], "wrong_output")
    ops = stats.get("ops") if isinstance(stats, dict) else None
    metrics = {}
    for op, s in (ops or {}).items():
        if isinstance(s, dict) and s.get("implemented"):
            metrics[f"served_{op}_spot_checked"] = float(s.get("spot_checked", 0))
            metrics[f"served_{op}_spot_replayed"] = float(s.get("spot_replayed", 0))
    head_failed = _spot_failures(head_stats, "head")
    if head_stats is not None:
        metrics["head_spot_failed_ops"] = float(len(head_failed))
    return metrics, "".join(f"; the head FAILS its spot checks: {f}" for f in head_failed)


def stalls(stats: dict | None) -> tuple[dict[str, float], str]:
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
    return metrics, (f"; {n} candidate call{'s' if n > 1 else ''} held the host over served.stall_ms in the window "
                     f"({total:.0f} ms in all, the worst {worst:.0f} ms): compiles the warm-up did not reach, or waits on the GPU")


def host_times(stats: dict | None, head_stats: dict | None) -> tuple[dict[str, float], str]:
    """The host time an eager call of each op took in each arm's server, on average, launch, audit and the
    kernel's own host code included (a call well under served.stall_ms is no stall, yet 28 layers of it add up
    in every prefill step): metrics, and a clause per op the candidate implements."""
    def per_call(st: dict | None) -> dict[str, float]:
        ops = st.get("ops") if isinstance(st, dict) else None
        return {op: float(s["host_ms"]) / int(s["host_calls"]) for op, s in (ops.items() if isinstance(ops, dict) else ())
                if isinstance(s, dict) and s.get("implemented") and s.get("host_calls")}
    mine, head = per_call(stats), per_call(head_stats)
    metrics = {f"{who}_{op}_host_ms_per_call": ms for who, arm in (("candidate", mine), ("head", head)) for op, ms in arm.items()}
    words = [f"{op} {ms:.3f} ms" + (f" (the head's {head[op]:.3f} ms)" if op in head else "") for op, ms in mine.items()]
    return metrics, ("; host time an eager call: " + ", ".join(words)) if words else ""


def startup(stats: dict | None, who: str = "candidate") -> dict[str, float]:
    """`who`'s server's start, by part, as its process reports it (harness/served/server.py: unpacking what was
    carried, loading the kernels, building the engine, each part of its warm-up): metrics `<who>_start_<part>_s`,
    twelve short names at most (a server with the sweep on reports eight)."""
    parts = stats.get("startup_s") if isinstance(stats, dict) else None
    if not isinstance(parts, dict):
        return {}
    return {f"{who}_start_{part}_s": float(s) for part, s in list(parts.items())[:12]
            if isinstance(part, str) and part.isidentifier() and len(part) <= 16 and type(s) in (int, float)}


def graphs(stats: dict | None, who: str = "candidate") -> tuple[dict[str, float], str]:
    """Whether `who`'s server decoded from CUDA graphs (harness/served/graphs.py): metrics, and a clause for
    the reason when it did not and says why (a decode that cannot be captured)."""
    g = stats.get("graphs") if isinstance(stats, dict) else None
    if not isinstance(g, dict) or not isinstance(g.get("on"), bool):
        return {}, ""
    left = g.get("left_out")                      # the server's own figure: a number or nothing
    metrics = {f"{who}_cuda_graphs": float(g["on"]),
               f"{who}_graph_keys_left_out": float(left) if type(left) in (int, float) else float("nan")}
    words = f"; the {who}'s server decoded eagerly: CUDA graphs {str(g.get('reason', ''))[:400]}"
    return metrics, (words if g.get("fell_back") is True else "")


def starved(stats: dict | None) -> bool:
    """Whether a server's CUDA graphs fell back for want of GPU memory (its accounting's `graphs`): beside a candidate
    whose kernels took memory outside the allocator's cap (a large local frame the driver reserves), not a property
    of that server's own kernels."""
    g = stats.get("graphs") if isinstance(stats, dict) else None
    return isinstance(g, dict) and g.get("fell_back") is True and "out of memory" in str(g.get("reason", "")).lower()
