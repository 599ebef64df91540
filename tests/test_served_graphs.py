"""Decode steps from CUDA graphs (harness/served/graphs.py), on the CPU: the bucket and width choice, the
padding (rows and columns at a scratch block no sequence ever owns), the accounting a replay adds, the
fallback when a capture fails, and graphs off on a CPU, said so. CUDA graphs are outside the project,
so here `EagerGraphs` (tests/fakes/cuda_graphs.py) stands in for them. On the GPU the real capture is tested in
tests/test_served_gpu.py."""
from __future__ import annotations

from dataclasses import replace
from itertools import product
from types import SimpleNamespace

import pytest
import torch

from conftest import config_with
from fakes.cuda_graphs import EagerGraphs
from harness.served.engine import Request, make_engine, run_requests, warm_up
from harness.served.graphs import DecodeGraphs, batch_bucket, width_bucket, width_buckets
from harness.served.limits import GraphPlan
from harness.served.ops import AttentionOps
from harness.served.traces import TraceRequest
from harness.targets.attention import decode_baseline

CFG = config_with()
TINY = CFG.served.presets["tiny"]
SERVED = {"init": CFG.served.random_init, "top_k": CFG.served.logprobs}   # make_engine's served policy
BS = CFG.targets.attention.cpu.block_size
CPU = torch.device("cpu")
BUCKETS = tuple(CFG.served.cuda_graphs.batch_buckets)
PLAN = GraphPlan(True, BUCKETS, 1, 64)


def engine(ops: AttentionOps | None = None, graphs: bool = True, fail_at: int | None = None, **preset):
    ops = ops or AttentionOps()
    e = make_engine(TINY.model_copy(update=preset), BS, torch.float32, CPU, ops, **SERVED)
    if graphs:
        e.graphs = DecodeGraphs(e, PLAN, EagerGraphs(ops, fail_at))
    return e


def requests(n: int = 7) -> list[TraceRequest]:
    """Prompts of 5..41 tokens, outputs of 4..16: batches shrink through sizes that are not buckets."""
    return [TraceRequest(i, 0.0, [(13 * i + 5 * j + 1) % TINY.vocab for j in range(5 + 6 * i)], 4 + 2 * i)
            for i in range(n)]


def tokens(out) -> dict[int, list[int]]:
    return {k: [e.token for e in v] for k, v in out.items()}


def test_a_batch_is_padded_to_the_next_bucket_and_a_table_to_the_next_power_of_two():
    assert [batch_bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert [width_bucket(w) for w in (0, 1, 2, 3, 4, 5, 1025)] == [1, 1, 2, 4, 4, 8, 2048]
    assert width_buckets(1, 17408, 16) == tuple(1 << i for i in range(12))  # 1088 blocks: up to 2048, not 16384
    assert width_buckets(1500, 17408, 16) == (128, 256, 512, 1024, 2048)     # none narrower than the shortest prompt's
    e = engine(max_running=16)
    assert e.graphs.batches == (1, 2, 4, 8, 16) and max(BUCKETS) > 16       # buckets above max_running dropped


def test_padded_rows_and_columns_point_at_a_scratch_block_no_sequence_owns():
    e = engine()
    scratch = e.graphs.scratch
    for i, n in enumerate((3, 9)):
        e.add(Request(str(i), list(range(1, n + 1)), 4))
    e.step()                                                        # both prefilled
    seqs = e.running
    for s in seqs:
        e._grow(s, s.length)
    lens = e.graphs.stage(seqs, 4, 4)
    g = e.graphs._batch(4, 4)
    assert lens == [s.length for s in seqs] == g.seq_lens[:2].tolist()
    assert g.seq_lens[2:].tolist() == [1, 1] and g.tokens[2:].tolist() == [0, 0]
    assert g.slots[2:].tolist() == [scratch * BS] * 2 and g.positions[2:].tolist() == [0, 0]
    for i, s in enumerate(seqs):
        row = g.block_table[i].tolist()
        assert row[:len(s.blocks)] == s.blocks and set(row[len(s.blocks):]) == {scratch}
        assert g.tokens[i] == s.generated[-1] and g.slots[i] == s.blocks[(s.length - 1) // BS] * BS + (s.length - 1) % BS
    assert g.block_table[2:].unique().tolist() == [scratch]
    assert scratch not in e.allocator.free and e.allocator.num_blocks == e.cache.num_blocks - 1


def test_graph_served_tokens_equal_eager_tokens_and_no_sequence_is_given_the_scratch_block():
    reqs = requests()
    e = engine(kv_cache_tokens=40 * BS)                              # tight: every block but the scratch one in use
    warm_up(e)
    owned = []
    graphs = run_requests(e, reqs, realtime=False, on_step=lambda _: owned.extend(b for s in e.running for b in s.blocks))
    eager = run_requests(engine(graphs=False, kv_cache_tokens=40 * BS), reqs, realtime=False)
    assert e.graphs.on and e.graphs.replays > 10 and e.graphs.eager_decode_steps == 0
    assert tokens(graphs) == tokens(eager)
    assert max(abs(a.logprob - b.logprob) for k in eager for a, b in zip(graphs[k], eager[k])) < 1e-4
    assert e.graphs.scratch not in owned and len(set(owned)) > 20


def test_each_replay_adds_the_calls_its_capture_made_and_the_real_shapes_served():
    reqs = requests()
    e, plain = engine(), engine(graphs=False)
    warm_up(e)
    run_requests(e, reqs, realtime=False)
    run_requests(plain, reqs, realtime=False)
    assert e.graphs.replays > 10
    assert e.ops.stats() == plain.ops.stats()                        # per op: calls, candidate, unsupported, not implemented
    assert e.ops.shapes.summary() == plain.ops.shapes.summary()      # the real batch and lengths, not the bucket's


def test_under_graphs_supports_sees_the_bucket_and_its_decision_is_counted_at_every_replay():
    seen = []

    def supports(op, **shape):
        seen.append((shape["batch"], shape["max_seq_len"]))
        return shape["max_seq_len"] <= 8 * BS

    candidate = SimpleNamespace(decode=lambda q, k_cache, v_cache, block_table, seq_lens, sm_scale:
                                decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale), supports=supports)
    ops = AttentionOps(candidate)
    e = engine(ops)
    e.graphs.capture()
    g = e.graphs
    assert set(seen) == {(b, w * BS) for b in g.batches for w in g.widths}   # the bucket's batch, the width's context
    longest_first = [TraceRequest(r.index, 0.0, r.prompt, 16 - 2 * r.index) for r in requests()]
    run_requests(e, longest_first, realtime=False)
    assert g.replays > 10
    d = ops.stats()["decode"]
    assert d["candidate"] > 0 and d["unsupported"] > 0 and d["calls"] == d["candidate"] + d["unsupported"]
    captured = {k: g.calls["decode"] for k, g in e.graphs.graphs.items()}
    assert all(c == ({"candidate": TINY.layers} if w <= 8 else {"unsupported": TINY.layers}) for (b, w), c in captured.items())


def test_a_capture_that_fails_turns_graphs_off_for_the_whole_server_and_says_why():
    reqs = requests(4)
    e = engine(fail_at=2)
    warm_up(e)
    st = e.graphs.stats()
    assert st["on"] is False and st["fell_back"] is True and st["graphs"] == 0 and e.graphs.graphs == {}
    assert "capturing the decode step at batch" in st["reason"]
    assert "(RuntimeError: CUDA error: operation not permitted when stream is capturing; then RuntimeError: " in st["reason"]
    assert "decoding eagerly" in st["reason"]
    out = run_requests(e, reqs, realtime=False)
    assert tokens(out) == tokens(run_requests(engine(graphs=False), reqs, realtime=False)) and e.graphs.replays == 0
    assert e.ops.stats()["decode"]["calls"] > 0 and e.ops.host_lengths is True


def test_keys_over_the_plans_memory_bound_are_not_captured_and_their_steps_run_eagerly_and_are_counted():
    bound = 8 * 4 * BS                      # batch x width x block: (8, 4) and (4, 8) fit, (8, 8) does not
    ops = AttentionOps()
    e = make_engine(TINY, BS, torch.float32, CPU, ops, **SERVED)
    e.graphs = g = DecodeGraphs(e, replace(PLAN, max_padded_tokens=bound), EagerGraphs(ops))
    warm_up(e)
    every = set(product(g.batches, g.widths))
    assert {(4, 8), (8, 4)} <= set(g.graphs) == {(B, W) for B, W in every if B * W * BS <= bound} != every
    assert g.stats()["left_out"] == len(every) - len(g.graphs) and g.stats()["on"] is True
    reqs = requests()
    out = run_requests(e, reqs, realtime=False)
    assert g.replays > 0 and g.eager_decode_steps > 0        # the seven sequences' widest steps are over the bound
    assert tokens(out) == tokens(run_requests(engine(graphs=False), reqs, realtime=False))
    none = DecodeGraphs(e, replace(PLAN, max_padded_tokens=BS - 1), EagerGraphs(ops))
    assert not none.keys and none.reason.startswith("off: no key's padded decode (batch x width x block")
    assert none.stats()["fell_back"] is False and none.stats()["on"] is False


def test_on_a_cpu_graphs_are_off_and_the_stats_say_so():
    e = make_engine(TINY, BS, torch.float32, CPU, AttentionOps(), graphs=PLAN, **SERVED)
    warm_up(e)
    st = e.graphs.stats()
    assert st["on"] is False and st["fell_back"] is False and "CUDA graphs need a GPU; this engine runs on the cpu" in st["reason"]
    assert e.allocator.num_blocks == e.cache.num_blocks              # no scratch block held where nothing is captured
    off = make_engine(TINY, BS, torch.float32, CPU, AttentionOps(), graphs=GraphPlan(False, BUCKETS, 1, 64), **SERVED)
    assert "served.cuda_graphs.enabled: false" in off.graphs.stats()["reason"]


def test_the_scratch_block_is_not_counted_in_what_the_cache_holds():
    e = engine(kv_cache_tokens=8 * BS)
    with pytest.raises(Exception, match=f"needs {8 * BS} tokens of KV cache; this model holds {7 * BS}"):
        e.add(Request("all", [1] * (8 * BS - 1), 1))


def test_running_every_graphs_forward_eagerly_for_the_profile_writes_only_the_scratch_block():
    calls = []
    e = engine(AttentionOps(SimpleNamespace(decode=lambda q, k_cache, v_cache, block_table, seq_lens, sm_scale:
                                            calls.append(q.shape[0]) or decode_baseline(q, k_cache, v_cache, block_table,
                                                                                         seq_lens, sm_scale))))
    e.graphs.capture()
    run_requests(e, requests(3), realtime=False)                     # served from graphs: real K/V, real static inputs
    assert e.graphs.replays > 0
    scratch = e.graphs.scratch
    # serving's padded rows wrote the same padding K/V there that the eager forwards write (bit for bit, where a
    # row's values do not depend on its batch's size): a sentinel, so that what they write shows
    e.cache.k[:, scratch] = float("nan")
    e.cache.v[:, scratch] = float("nan")
    k, v = e.cache.k.clone(), e.cache.v.clone()
    calls.clear()
    e.graphs.forward_each_eagerly()
    assert sorted(set(calls)) == list(e.graphs.batches) and len(calls) == len(e.graphs.graphs) * TINY.layers
    others = [b for b in range(e.cache.num_blocks) if b != scratch]
    assert torch.equal(e.cache.k[:, others], k[:, others]) and torch.equal(e.cache.v[:, others], v[:, others])
    assert not e.cache.k[:, scratch].isnan().all() and not e.cache.v[:, scratch].isnan().all()   # written there, and only there
