"""The served scenario on a real GPU (Qwen3-0.6B-shaped preset, bf16, the long-context trace): the
reference kernels pass the gates in the served replay, a kernel that drops the newest token fails
them, teacher forcing serves the forced tokens, the profile attributes device time to the model's parts, `evaluate` runs through the
replay, decode steps served from CUDA graphs give the eager engine's tokens, and a decode that
syncs the host cannot be captured, so it is served eagerly, said so, and decode calls replayed from CUDA graphs are
spot-checked (a decode wrong only under capture is caught), and a spot check moves none of the candidate's
allocations. Skipped without CUDA. Each test prints the figures docs/BENCHMARKS.md records; acceptance
itself is a measurement, printed, not asserted."""
from __future__ import annotations

import gc
import math
import re
from types import SimpleNamespace

import pytest
import torch

import candidates as C
from conftest import CUDA, ROOT, config_with
from harness.config import PROJECT_ROOT
from harness.gpu_memory import DECODE_INDEX_BYTES
from harness.profile import profile_served, render
from harness.served.engine import make_engine, run_requests, warm_up
from harness.served.limits import GraphPlan
from harness.served.ops import AttentionOps, load_candidate
from harness.served.spot import SpotChecks
from harness.served.traces import TraceRequest
from harness.stages import STAGE_NAMES
from harness.stages.replay import run_replay, served_requests
from harness.targets import TARGETS
from harness.transport import DTYPES

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")]

WINDOW = 20          # seconds of the trace per replay here; the stage's own default is config's (60 s)
CFG = config_with(**{"served.cuda.window_s": WINDOW})
# Both reference kernels in one candidate; the prefill file's module names get a P_ prefix so its knobs
# do not overwrite the decode file's.
_PREFILL_NAMES = r"\b(BLOCK_M|BLOCK_N|NUM_WARPS|NUM_STAGES|CAUSAL_SKIP|_fit_stages|_LOG2E)\b"
BOTH = C.REF_DECODE + "\n\n" + re.sub(_PREFILL_NAMES, r"P_\1", C.REF_PREFILL.split('"""', 2)[2])


def show(outcome) -> None:
    print("\n" + outcome.reason)
    print({k: round(v, 4) for k, v in outcome.metrics.items() if not k.startswith(("baseline_again_",))})


@pytest.mark.parametrize("source", [C.REF_DECODE, C.REF_PREFILL, BOTH], ids=["decode", "prefill", "both"])
def test_reference_kernels_pass_the_gates_in_the_served_replay(source):
    outcome = run_replay(CFG, "cuda", source)
    show(outcome)
    assert outcome.gate.passed, outcome.reason
    assert outcome.metrics["fallback_share"] == 0.0


def test_kernel_that_drops_the_newest_token_fails_the_gates_on_gpu():
    outcome = run_replay(config_with(**{"served.cuda.window_s": WINDOW, "served.spot_share": 0.0}), "cuda",
                         C.DROPS_NEWEST_TOKEN)          # the gates alone: the spot checks may reject it first
    show(outcome)
    assert not outcome.gate.passed and not outcome.accepted


def forcing_on(device: str, cfg=CFG, requests: int = 8, tokens: int = 32) -> float:
    """Free, own-tokens-forced and other-tokens-forced runs of the engine in this process; the largest
    logprob difference between the first two (identical batches: 0 where the kernels are deterministic)."""
    import dataclasses

    from harness.served.engine import make_engine, run_requests
    from harness.served.ops import AttentionOps
    from harness.stages.replay import served_requests
    from harness.transport import DTYPES
    served, section = getattr(cfg.served, device), getattr(cfg.targets.attention, device)
    preset = cfg.served.presets[served.preset]
    reqs = [dataclasses.replace(r, output_len=min(r.output_len, tokens)) for r in served_requests(cfg, device)[:requests]]

    def run(forcing=None):
        engine = make_engine(preset, section.block_size, DTYPES[section.dtype], torch.device(device), AttentionOps(),
                             init=cfg.served.random_init, top_k=cfg.served.logprobs)
        return run_requests(engine, [dataclasses.replace(r, forced=forcing and forcing[r.index]) for r in reqs], realtime=False)

    free = run()
    own = run({i: tuple(e.token for e in evs) for i, evs in free.items()})
    other = {i: tuple((7 * e.token + 3) % preset.vocab for e in evs) for i, evs in free.items()}
    forced = run(other)
    for i, evs in free.items():
        assert [e.token for e in own[i]] == [e.token for e in evs]
        assert tuple(e.token for e in forced[i]) == other[i] and forced[i][0].top[0][0] == evs[0].token
        assert all(e.logprob <= e.top[0][1] + 1e-6 for e in forced[i])
    return max(abs(a.logprob - b.logprob) for i in free for a, b in zip(free[i], own[i]))


def test_teacher_forcing_serves_the_forced_tokens_on_gpu():
    gap = forcing_on("cuda")
    print(f"\nforcing its own tokens: largest logprob difference from the free run {gap:.2e}")
    assert gap < 1e-3


def test_the_float32_reference_scores_a_continuation_in_its_prefill_as_decoding_it_would_on_gpu():
    """The replay's reference path: the 0.6B preset in float32, a continuation (the model's own tokens, every
    third one not) scored in the prefill (`scored`) against the same tokens forced one a step."""
    import dataclasses
    served, section = CFG.served.cuda, CFG.targets.attention.cuda
    preset = CFG.served.presets[served.preset].model_copy(update={"kv_cache_tokens": 65536})
    reqs = [dataclasses.replace(r, output_len=min(r.output_len, 48)) for r in served_requests(CFG, "cuda")[:6]]

    def run(reqs):
        engine = make_engine(preset, section.block_size, torch.float32, torch.device("cuda"), AttentionOps(),
                             init=CFG.served.random_init, top_k=CFG.served.logprobs)
        return run_requests(engine, reqs, realtime=False)

    free = run(reqs)
    cont = {i: tuple((5 * e.token + 1) % preset.vocab if j % 3 == 2 else e.token for j, e in enumerate(evs))
            for i, evs in free.items()}
    decoded = run([dataclasses.replace(r, forced=cont[r.index]) for r in reqs])
    scored = run([dataclasses.replace(r, forced=cont[r.index], scored=True) for r in reqs])
    gap = max(abs(a.logprob - b.logprob) for i in cont for a, b in zip(decoded[i], scored[i]))
    same_top = sum(a.top[0][0] == b.top[0][0] for i in cont for a, b in zip(decoded[i], scored[i]))
    n = sum(len(c) for c in cont.values())
    print(f"\nscored in the prefill vs decoded, float32: largest logprob difference {gap:.2e}; top choice equal "
          f"at {same_top} of {n}")
    assert all(tuple(e.token for e in scored[i]) == cont[i] for i in cont)
    assert gap < 1e-3 and same_top >= 0.99 * n          # an exact float32 tie may fall either way


def test_profile_attributes_device_time_to_the_models_parts():
    report = profile_served(CFG, "attention", device=torch.device("cuda"), window_s=WINDOW)
    print("\n" + render(report))
    assert report["device"] == "cuda" and "device time" in report["clock"]
    assert math.isclose(sum(b["share"] for b in report["buckets"].values()), 1.0, rel_tol=1e-9)
    assert report["unattributed_share"] < 0.05
    assert report["buckets"]["attention_decode"]["share"] > 0 and report["buckets"]["gemm"]["share"] > 0


def test_evaluate_runs_the_reference_decode_kernel_through_the_replay(evaluate_source):
    """The reference kernel passes the four cheap stages (microbench: about 4x the served baseline) and is
    served through the whole replay, its gates passed and every decode call its own; whether the replay then
    accepts it is a measurement over a 20 s window, printed, not asserted."""
    v = evaluate_source(C.REF_DECODE, config=CFG)
    print("\n" + v.reason + "\n" + v.stages[-1].reason)
    assert [s.name for s in v.stages] == list(STAGE_NAMES), v.reason
    assert [s.status for s in v.stages[:-1]] == ["passed"] * (len(STAGE_NAMES) - 1), v.reason
    replay = v.stages[-1]
    assert replay.status in ("passed", "failed") and replay.metrics.get("gate_passed") == 1.0, replay.reason
    assert replay.metrics["fallback_share"] == 0.0 and replay.metrics["gate_tokens_compared"] > 0


def _engine(decode, graphs: GraphPlan | None, spot: SpotChecks | None = None, **preset):
    """The served preset on CUDA with `decode` (None: the torch baseline), its memory given back first."""
    gc.collect()
    torch.cuda.empty_cache()
    served, section = CFG.served.cuda, CFG.targets.attention.cuda
    ops = AttentionOps(None if decode is None else SimpleNamespace(decode=decode), section.dtype, spot=spot)
    return make_engine(CFG.served.presets[served.preset].model_copy(update=preset), section.block_size,
                       DTYPES[section.dtype], torch.device("cuda"), ops, init=CFG.served.random_init, top_k=CFG.served.logprobs,
                       root=PROJECT_ROOT, graphs=graphs)


def _reference_decode():
    return load_candidate(ROOT / "knowledge/attention/decode_paged_splitkv.py").decode


@pytest.mark.parametrize("kernel", ["reference", "baseline"])
def test_graph_served_decode_gives_the_eager_engines_tokens(kernel):
    """12 requests of the trace at once, 40 tokens each: prefill steps, then decode-only steps from
    batch 12 down. The eager and the graph-served engine must agree token by token, as the replay's
    gates judge (logprobs within their bf16 tolerance; tokens may part only at a near-tie, and the
    rest of that request is not compared). Graphs pad the block table to a power of two, which changes
    the reference kernel's split count and so its float32 summation order: bit-equal logits are not
    expected, equal tokens are."""
    decode = _reference_decode() if kernel == "reference" else None
    reqs = [TraceRequest(r.index, 0.0, r.prompt, 40) for r in served_requests(CFG, "cuda", WINDOW)[:12]]
    longest = max(len(r.prompt) for r in reqs) + 40
    eager_engine = _engine(decode, None)
    warm_up(eager_engine)
    eager = run_requests(eager_engine, reqs, realtime=False)
    books = ("calls", "candidate", "unsupported", "not_implemented")
    eager_calls = {op: [c[k] for k in books] for op, c in eager_engine.ops.stats().items()}
    del eager_engine
    e = _engine(decode, GraphPlan(True, tuple(CFG.served.cuda_graphs.batch_buckets), min(len(r.prompt) for r in reqs) + 1, longest))
    warm_up(e)
    st = e.graphs.stats()
    print("\n", kernel, st)
    if kernel == "baseline" and not st["on"]:
        pytest.skip(f"the torch baseline decode is not capturable here: {st['reason']}")
    assert st["on"], st["reason"]
    graphs = run_requests(e, reqs, realtime=False)
    # The gates' figures for a baseline whose own A/A disagreement is the configured tolerance: padding
    # changes GEMM shapes (bucket rows) and split counts, the kind of change two baseline servers see.
    gate = CFG.stages.replay.gates["bfloat16"]
    tol, margin = gate.max_abs, gate.near_tie_margin
    compared = same = parted = 0
    worst, problems = 0.0, []
    for k, base in eager.items():
        for i, (a, b) in enumerate(zip(base, graphs[k])):
            if a.token != b.token:
                parted += 1
                if a.top[0][1] - a.top[1][1] > margin:
                    problems.append(f"request {k}, token {i}: {b.token} where eager has {a.token}, lead {a.top[0][1] - a.top[1][1]:.3f}")
                break
            compared += 1
            same += a.logprob == b.logprob
            worst = max(worst, abs(a.logprob - b.logprob))
    total = sum(len(v) for v in eager.values())
    print(f"{kernel}: {compared} of {total} tokens compared, {same} with bit-equal logprobs, max |dlogprob| {worst:.4f}, "
          f"{parted} requests parted at a near-tie; {e.graphs.replays} decode steps replayed, "
          f"{e.graphs.eager_decode_steps} ran eagerly")
    assert not problems, problems
    assert worst <= tol and e.graphs.replays > 0 and e.graphs.eager_decode_steps == 0
    assert {op: [c[k] for k in books] for op, c in e.ops.stats().items()} == eager_calls   # replays counted as calls


def test_a_decode_that_syncs_the_host_cannot_be_captured_and_is_served_eagerly_said_so():
    ref = _reference_decode()

    def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
        if seq_lens.max().item() < 1:             # a host sync: an error inside a CUDA graph capture
            raise ValueError("empty sequence")
        return ref(q, k_cache, v_cache, block_table, seq_lens, sm_scale)

    e = _engine(decode, GraphPlan(True, (1, 2, 4), 1, 4096), kv_cache_tokens=16384)
    warm_up(e)
    st = e.graphs.stats()
    print("\n", st)
    assert not st["on"] and st["graphs"] == 0 and "capturing the decode step at batch" in st["reason"]
    out = run_requests(e, [TraceRequest(i, 0.0, [(7 * i + j) % 1000 for j in range(100 + 50 * i)], 8) for i in range(3)],
                       realtime=False)
    assert all(len(v) == 8 for v in out.values()) and e.graphs.replays == 0
    assert e.ops.stats()["decode"]["candidate"] > 0          # served eagerly, by the candidate


@pytest.mark.parametrize("kernel", ["honest", "wrong under capture"])
def test_decode_calls_replayed_from_cuda_graphs_are_spot_checked_on_gpu(kernel):
    """4 requests at once, 24 tokens each: after their prefill every step is decode-only and replayed, and every
    candidate call of a replay is checked (share 1). The wrong kernel is the reference with its output scaled by
    1.02 only while a graph is captured, so its eager calls are right and its replays are not."""
    ref = _reference_decode()

    def decode(*args):
        out = ref(*args)
        return out * 1.02 if kernel != "honest" and torch.cuda.is_current_stream_capturing() else out

    parity = CFG.stages.parity
    floor = parity.floors[CFG.targets.attention.cuda.dtype]
    spot = SpotChecks(TARGETS["attention"], 1.0, parity.tolerance_factor, (floor.max_abs, floor.rel_l2))
    e = _engine(decode, GraphPlan(True, (1, 2, 4, 8), 1, 4096), spot=spot, kv_cache_tokens=16384)
    warm_up(e)
    e.ops.audit_all = False                   # serving from here, as the server does after its warm-up
    run_requests(e, [TraceRequest(i, 0.0, [(7 * i + j) % 1000 for j in range(300 + 400 * i)], 24) for i in range(4)],
                 realtime=False)
    r = spot.results()["decode"]
    print(f"\n{kernel}: {e.graphs.replays} replays, {spot.made['decode']} checks made, {r}")
    assert e.graphs.on and e.graphs.replays > 0 and e.graphs.eager_decode_steps == 0, e.graphs.stats()
    assert r["spot_checked"] == r["spot_replayed"] > 0, r
    if kernel == "honest":
        assert r["spot_failed"] == 0, r
    else:
        assert r["spot_failed"] == r["spot_checked"] and ", replayed from the CUDA graph of batch " in r["spot_first"], r


def test_a_spot_check_moves_none_of_the_candidates_allocations_on_gpu():
    """A kernel could tell a checked call by where its output lands, since the check copies what it needs just before
    the call. Served eagerly, the same requests three times, the first two unchecked, the third with every call
    checked: the candidate's outputs must land at the same addresses, call by call, in all three."""
    ref, seen = _reference_decode(), []

    def decode(*args):
        out = ref(*args)
        seen.append(out.data_ptr())
        return out

    parity = CFG.stages.parity
    floor = parity.floors[CFG.targets.attention.cuda.dtype]
    spot = SpotChecks(TARGETS["attention"], 0.0, parity.tolerance_factor, (floor.max_abs, floor.rel_l2))
    e = _engine(decode, None, spot=spot, kv_cache_tokens=16384)
    warm_up(e)
    e.ops.audit_all = False
    reqs = [TraceRequest(i, 0.0, [(7 * i + j) % 1000 for j in range(300 + 400 * i)], 16) for i in range(4)]
    runs = []
    for share in (0.0, 0.0, 1.0):
        spot.share = share
        seen.clear()
        run_requests(e, reqs, realtime=False)
        runs.append(list(seen))
    print(f"\n{len(runs[0])} calls a run; {spot.made['decode']} checked in the third; distinct addresses "
          f"{[len(set(r)) for r in runs]}; the runs agree: {runs[0] == runs[1]}, {runs[1] == runs[2]}")
    assert spot.made["decode"] == len(runs[2]) > 0 and spot.results()["decode"]["spot_failed"] == 0
    assert runs[0] == runs[1] == runs[2]


def _padded_decode_inputs(B: int = 32, W: int = 256):
    """A padded decode batch at the served preset's heads: B rows of a W-page table, every other row full, the rest
    one token long (as padded rows are); and the per-position bytes the graph plan counts."""
    p = CFG.served.presets[CFG.served.cuda.preset]
    bs, dev = CFG.targets.attention.cuda.block_size, torch.device("cuda")
    k_cache = torch.randn(B * W + 1, bs, p.kv_heads, p.head_dim, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, p.q_heads, p.head_dim, dtype=torch.bfloat16, device=dev)
    table = torch.randperm(B * W, device=dev, dtype=torch.int32).view(B, W)
    lens = torch.full((B,), W * bs, dtype=torch.int32, device=dev)
    lens[1::2] = 1
    return (q, k_cache, v_cache, table, lens), 2 * p.kv_heads * p.head_dim * 2


def _peak_beyond_inputs(fn, *args, **kwargs):
    """(fn's output, the most memory it allocated beyond what was allocated before it)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def test_the_baseline_decodes_peak_memory_per_padded_position_is_within_the_graph_plans_figure():
    """The graph plan's bound (harness/gpu_memory.py) counts the torch baseline's decode at one layer's K and V
    and DECODE_INDEX_BYTES per position of batch x width x block; the configured baseline, run at the served
    preset's heads on a padded batch, must not take more."""
    decode = TARGETS["attention"].configured(CFG.targets.attention.baselines()).ops["decode"].baseline
    args, kv = _padded_decode_inputs()
    _, peak = _peak_beyond_inputs(decode, *args, 0.088)
    per = peak / args[3].numel() / CFG.targets.attention.cuda.block_size
    print(f"\nthe baseline decode's peak beyond its inputs: {per:.1f} bytes per padded position "
          f"(K and V {kv}, the plan counts {kv + DECODE_INDEX_BYTES})")
    assert per <= kv + DECODE_INDEX_BYTES


def test_an_eager_baseline_decode_over_the_graph_bound_gathers_within_it_and_gives_the_same_output_on_gpu():
    """A decode step whose key the graph plan left out for memory runs eagerly, and the served ops call the torch
    baseline on it in chunks of rows within the bound (harness/served/ops.py): its peak stays within the bound's
    bytes where one call over the padded batch takes four times them, and its output is the one call's (to the bf16
    spot checks' floor: a chunk's matrix products may take other kernels)."""
    target = TARGETS["attention"].configured(CFG.targets.attention.baselines())
    args, kv = _padded_decode_inputs()
    lens = [int(n) for n in args[4].tolist()]
    bs = CFG.targets.attention.cuda.block_size
    bound = args[3].numel() * bs // 4                             # positions: a quarter of the padded batch's
    whole, whole_peak = _peak_beyond_inputs(AttentionOps(target=target, dtype="bfloat16").decode, *args, 0.088, lens)
    part, part_peak = _peak_beyond_inputs(AttentionOps(target=target, dtype="bfloat16", gather_bound=bound).decode,
                                          *args, 0.088, lens)
    limit = bound * (kv + DECODE_INDEX_BYTES) + 2 * args[0].numel() * args[0].element_size()   # and the output
    print(f"\npeak beyond the inputs: one call {whole_peak / 2**20:.0f} MiB, in chunks {part_peak / 2**20:.0f} MiB "
          f"(the bound's {limit / 2**20:.0f} MiB); max |difference| {(whole - part).abs().max().item():.3g}")
    assert part_peak <= limit < whole_peak
    torch.testing.assert_close(part, whole, atol=0.016, rtol=0)   # the bf16 spot checks' max abs floor
