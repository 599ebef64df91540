"""The served model and engine in this process (tiny preset, CPU, float32): continuous batching gives
each request what it gets alone, decoding from the paged cache matches recomputing the sequence,
teacher forcing appends the forced tokens with the model's own logprobs of them (scored in one prefill,
the same as decoding them), blocks are reserved
and reused, weights load from safetensors, and attention goes through `AttentionOps` with fallbacks
counted."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import config_with
from harness.served.engine import Engine, EngineError, Request, make_engine, run_requests, warm_up
from harness.served.kvcache import PagedKVCache
from harness.served.model import ModelError, StepBatch, hf_shapes, random_weights
from harness.served.ops import TARGET, AttentionOps
from harness.served.traces import TraceRequest, generate, requests_for
from harness.targets.attention import decode_baseline, prefill_baseline

CFG = config_with()
TINY = CFG.served.presets["tiny"]
INIT = CFG.served.random_init
SERVED = {"init": INIT, "top_k": CFG.served.logprobs}   # make_engine's served policy, as config.yaml sets it
BS = CFG.targets.attention.cpu.block_size
CPU = torch.device("cpu")


def engine(ops: AttentionOps | None = None, **preset) -> Engine:
    return make_engine(TINY.model_copy(update=preset), BS, torch.float32, CPU, ops or AttentionOps(), **SERVED)


def trace(n: int = 8, seed: int = 1) -> list[TraceRequest]:
    lines = generate(seed, duration_s=n / 4, rate=4.0, prompt_median=12, prompt_sigma=0.6, output_median=8,
                     output_sigma=0.3, max_prompt=40, max_output=12)
    return requests_for(lines, 100.0, TINY.vocab, TINY.kv_cache_tokens)


def test_continuous_batching_gives_each_request_what_it_gets_alone():
    reqs = trace()
    together = run_requests(engine(), reqs, realtime=False)          # all join at once, leave as they finish
    for r in reqs:
        alone = run_requests(engine(), [r], realtime=False)[r.index]
        assert [e.token for e in together[r.index]] == [e.token for e in alone]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(together[r.index], alone)) < 1e-4
        assert len(alone) == r.output_len and alone[-1].finished and not any(e.finished for e in alone[:-1])


def test_requests_join_and_leave_between_steps():
    e = engine()
    e.add(Request("a", [5, 6, 7], 6))
    first = e.step()
    assert [ev.request_id for ev in first] == ["a"]                  # prefill of a
    e.add(Request("b", [9] * 10, 2))
    second = e.step()
    assert sorted(ev.request_id for ev in second) == ["a", "b"]      # b's prefill beside a's decode, one pass
    e.step()
    assert [s.req.id for s in e.running] == ["a"]                    # b finished after its 2 tokens and left
    while e.has_work():
        e.step()
    assert e.allocator.available() == e.cache.num_blocks             # every block came back


def test_decoding_from_the_scattered_paged_cache_matches_recomputing_the_whole_sequence():
    reqs = trace(6, seed=4)
    e = engine()
    scattered = []
    out = run_requests(e, reqs, realtime=False,
                       on_step=lambda ev: scattered.extend(s.blocks for s in e.running if len(s.blocks) > 1))
    assert any(b != list(range(b[0], b[0] + len(b))) for b in scattered)   # blocks of a sequence are not contiguous
    for r in reqs[:3]:
        tokens = [ev.token for ev in out[r.index]]
        for k in range(1, len(tokens)):                              # prefill of prompt + first k tokens predicts token k
            ev = run_requests(engine(), [TraceRequest(0, 0.0, r.prompt + tokens[:k], 1)], realtime=False)[0][0]
            assert ev.token == tokens[k] and abs(ev.logprob - out[r.index][k].logprob) < 1e-4


def direct_logprobs(e: Engine, tokens: list[int]) -> torch.Tensor:
    """The model's log-softmax after every position of one sequence: one prefill pass of the engine's
    model over a cache of its own, outside the engine's step. Row n predicts token n + 1."""
    n = len(tokens)
    cache = PagedKVCache(TINY.layers, math.ceil(n / BS), BS, TINY.kv_heads, TINY.head_dim, torch.float32, CPU)
    batch = StepBatch(tokens=torch.tensor(tokens), positions=torch.arange(n), slots=torch.arange(n), prefill_lens=[n],
                      cu_seqlens=torch.tensor([0, n], dtype=torch.int32), decode_lens=[], block_table=None,
                      seq_lens=None, sample_idx=torch.arange(n))
    return torch.log_softmax(e.model.forward(batch, cache, AttentionOps()).float(), dim=-1)


def test_forcing_the_models_own_tokens_gives_what_a_free_run_gives():
    reqs = trace(6, seed=2)
    free = run_requests(engine(), reqs, realtime=False)
    forced = run_requests(engine(), [dataclasses.replace(r, forced=tuple(ev.token for ev in free[r.index])) for r in reqs],
                          realtime=False)
    assert forced == free                               # tokens, logprobs, top and finished, event for event


def test_forced_tokens_are_appended_with_the_models_logprob_of_each_and_its_own_choice_on_top():
    reqs = trace(6, seed=5)
    free = run_requests(engine(), reqs, realtime=False)
    vocab = TINY.vocab
    forcing = {r.index: tuple((7 * ev.token + 3) % vocab for ev in free[r.index]) for r in reqs[:3]}
    e = engine()
    out = run_requests(e, [dataclasses.replace(r, forced=forcing.get(r.index)) for r in reqs], realtime=False)
    differ = 0
    for r in reqs[:3]:                                  # forced: the forced tokens, scored by a direct forward
        lp = direct_logprobs(e, r.prompt + list(forcing[r.index]))
        assert [ev.token for ev in out[r.index]] == list(forcing[r.index])
        for j, ev in enumerate(out[r.index]):
            row = lp[len(r.prompt) - 1 + j]
            assert abs(ev.logprob - float(row[ev.token])) < 1e-4
            assert ev.top[0][0] == int(row.argmax()) and abs(ev.top[0][1] - float(row.max())) < 1e-4
            differ += ev.top[0][0] != ev.token
    assert differ > 0.8 * sum(len(f) for f in forcing.values())    # the forced tokens are not the model's choices
    for r in reqs[3:]:                                  # unforced requests in the same batches: as in a free run
        assert out[r.index] == free[r.index]


def test_scoring_forced_tokens_in_the_prefill_gives_what_decoding_them_gives_in_one_step_each():
    reqs = trace(8, seed=6)
    vocab = TINY.vocab
    free = run_requests(engine(), reqs, realtime=False)
    forcing = {r.index: tuple((5 * ev.token + 1) % vocab if j % 3 == 2 else ev.token for j, ev in enumerate(free[r.index]))
               for r in reqs}                            # the model's own tokens, every third one not
    decoded = run_requests(engine(), [dataclasses.replace(r, forced=forcing[r.index]) for r in reqs], realtime=False)
    e = engine(max_running=3)                            # scored requests beside a running one, admitted a few a step
    steps = []
    mixed = [dataclasses.replace(r, forced=forcing[r.index], scored=r.index % 2 == 0) for r in reqs]
    scored = run_requests(e, mixed, realtime=False, on_step=lambda evs: steps.append([ev.request_id for ev in evs]))
    for r in reqs:
        assert [ev.token for ev in scored[r.index]] == list(forcing[r.index])
        assert [ev.finished for ev in scored[r.index]] == [ev.finished for ev in decoded[r.index]]
        for a, b in zip(scored[r.index], decoded[r.index]):
            assert abs(a.logprob - b.logprob) < 1e-4 and a.top[0][0] == b.top[0][0] and abs(a.top[0][1] - b.top[0][1]) < 1e-4
    for r in reqs[::2]:                                  # a scored request: every token in the step that admitted it
        firsts = [i for i, ids in enumerate(steps) if str(r.index) in ids]
        assert len(firsts) == 1 and steps[firsts[0]].count(str(r.index)) == r.output_len
    assert e.allocator.available() == e.cache.num_blocks and not e.has_work()


def test_a_scored_request_without_forced_tokens_is_refused():
    with pytest.raises(EngineError, match="a scored request needs its forced tokens"):
        engine().add(Request("a", [1, 2, 3], 3, None, scored=True))


@pytest.mark.parametrize("forced, words", [
    ((1, 2), "the forced tokens must be one per generated token: 2 given, max_tokens is 3"),
    ((1, 2, 512), r"forced token ids must be in \[0, 512\)"),
    ((1, -1, 2), r"forced token ids must be in \[0, 512\)"),
], ids=["wrong-length", "outside-vocab", "negative"])
def test_forced_tokens_of_the_wrong_length_or_outside_the_vocabulary_are_refused(forced, words):
    with pytest.raises(EngineError, match=words):
        engine().add(Request("a", [1, 2, 3], 3, forced))


def test_admission_waits_for_kv_blocks_and_never_overcommits():
    e = engine(kv_cache_tokens=8 * BS)                               # room for 8 blocks
    e.add(Request("big", [1] * (5 * BS), BS))                        # reserves 6 blocks
    e.add(Request("next", [2] * BS, BS))                             # takes the last 2
    e.add(Request("third", [3] * BS, BS))                            # must wait for blocks to come back
    e.step()
    assert sorted(s.req.id for s in e.running) == ["big", "next"] and [r.id for r in e.waiting] == ["third"]
    while e.waiting:
        e.step()
        assert e.allocator.available() >= 0
    with pytest.raises(EngineError, match="needs 40 tokens of KV cache; this model holds 32"):
        e.add(Request("huge", [1] * 36, 4))


def test_greedy_decoding_has_clear_winners_not_a_sea_of_near_ties():
    out = run_requests(engine(), trace(12, seed=9), realtime=False)
    leads = [ev.top[0][1] - ev.top[1][1] for evs in out.values() for ev in evs]
    repeats = [a.token == b.token for evs in out.values() for a, b in zip(evs, evs[1:])]
    assert statistics.median(leads) > 0.5 and sum(lead < 0.05 for lead in leads) / len(leads) < 0.1
    assert sum(repeats) / len(repeats) < 0.6                         # not one token forever


def test_random_weights_are_the_same_in_every_build_for_a_seed():
    a, b = random_weights(TINY, torch.float32, CPU, INIT), random_weights(TINY, torch.float32, CPU, INIT)
    c = random_weights(TINY.model_copy(update={"seed": 1}), torch.float32, CPU, INIT)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_weights_from_a_local_safetensors_folder_serve_the_same_tokens(tmp_path):
    from safetensors.torch import save_file
    save_file(random_weights(TINY.model_copy(update={"seed": 5}), torch.float32, CPU, INIT), str(tmp_path / "model.safetensors"))
    reqs = trace(3)
    from_seed = run_requests(engine(seed=5), reqs, realtime=False)
    from_file = run_requests(engine(weights=str(tmp_path), seed=0), reqs, realtime=False)
    assert {k: [e.token for e in v] for k, v in from_seed.items()} == {k: [e.token for e in v] for k, v in from_file.items()}


def test_unusable_weights_folder_is_one_line_naming_what_is_wrong(tmp_path):
    from safetensors.torch import save_file
    with pytest.raises(ModelError, match="no such weights folder"):
        engine(weights=str(tmp_path / "nope"))
    with pytest.raises(ModelError, match=r"no \*\.safetensors files"):
        engine(weights=str(tmp_path))
    weights = random_weights(TINY, torch.float32, CPU, INIT)
    weights.pop("model.layers.1.mlp.up_proj.weight")
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"model.norm.weight has shape \[3\]; the preset says \[64\]"):
        engine(weights=str(tmp_path))
    assert "lm_head.weight" not in hf_shapes(TINY) and "lm_head.weight" in hf_shapes(TINY.model_copy(update={"tied_embeddings": False}))


def test_ops_a_candidate_lacks_or_declines_run_the_baseline_and_are_counted():
    seen = []

    def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
        seen.append(q.shape[0])
        return decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale)

    candidate = SimpleNamespace(decode=decode, supports=lambda op, **shape: shape["max_seq_len"] <= 14)
    ops = AttentionOps(candidate)
    reqs = [TraceRequest(0, 0.0, list(range(3, 11)), 10), TraceRequest(1, 0.0, list(range(20, 36)), 6)]
    with_candidate = run_requests(engine(ops), reqs, realtime=False)
    baseline = run_requests(engine(), reqs, realtime=False)
    stats = ops.stats()
    assert stats["prefill"]["implemented"] is False and stats["prefill"]["not_implemented"] == stats["prefill"]["calls"] > 0
    assert stats["decode"]["candidate"] == len(seen) > 0 and stats["decode"]["unsupported"] > 0
    assert stats["decode"]["calls"] == stats["decode"]["candidate"] + stats["decode"]["unsupported"]
    assert {k: [e.token for e in v] for k, v in with_candidate.items()} == {k: [e.token for e in v] for k, v in baseline.items()}


def test_the_host_time_of_the_candidates_own_calls_is_counted_and_the_baselines_is_not():
    def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
        time.sleep(0.005)                           # its own host code: 5 ms a call, well under any stall
        return prefill_baseline(q, k, v, cu_seqlens, max_seqlen, sm_scale)

    ops = AttentionOps(SimpleNamespace(prefill=prefill))
    run_requests(engine(ops), [TraceRequest(0, 0.0, list(range(3, 11)), 4), TraceRequest(1, 0.0, list(range(20, 36)), 3)],
                 realtime=False)
    st = ops.stats()
    assert st["prefill"]["host_calls"] == st["prefill"]["candidate"] > 0
    assert 5.0 * st["prefill"]["host_calls"] <= st["prefill"]["host_ms"] < 500.0 * st["prefill"]["host_calls"]
    assert st["decode"]["host_calls"] == 0 and st["decode"]["host_ms"] == 0.0 and st["decode"]["calls"] > 0   # the baseline's


def test_the_baseline_decode_gathers_no_more_than_its_bound_in_one_call_and_serves_the_same_tokens():
    """A server's eager decode steps the graphs leave out for memory call the torch baseline in chunks of rows, each
    within the graph plan's bound (harness/gpu_memory.py): as much memory as the largest key captured, no more."""
    gathers, tight = [], []

    def recorded(q, k_cache, v_cache, block_table, seq_lens, sm_scale, lengths=None):
        gathers.append(block_table.shape[0] * block_table.shape[1] * k_cache.shape[1])
        tight.append(block_table.shape[1] == -(-int(seq_lens.max()) // k_cache.shape[1]))   # cut to its widest row
        return decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale, lengths)

    target = dataclasses.replace(TARGET, ops={**TARGET.ops, "decode": dataclasses.replace(TARGET.ops["decode"], baseline=recorded)})
    reqs = [TraceRequest(i, 0.0, list(range(1 + i, 6 + 7 * i)), 6) for i in range(6)]     # prompts of 5 to 40 tokens
    bound = 3 * BS * 4
    bounded = run_requests(engine(AttentionOps(target=target, gather_bound=bound)), reqs, realtime=False)
    assert max(gathers) <= bound and all(tight)
    whole = len(gathers)
    gathers.clear()
    plain = run_requests(engine(AttentionOps(target=target)), reqs, realtime=False)
    assert max(gathers) > bound and len(gathers) < whole
    assert {k: [e.token for e in v] for k, v in bounded.items()} == {k: [e.token for e in v] for k, v in plain.items()}
    assert max(abs(a.logprob - b.logprob) for k in plain for a, b in zip(bounded[k], plain[k])) < 1e-5


def test_an_op_the_candidate_does_not_define_is_served_by_its_head_beside_it_and_counted_as_not_the_candidates():
    """A prefill candidate's server decodes with the decode head (the step the run would ship), not torch's
    decode; the head's own `supports` may decline a shape (then the baseline), and a candidate that defines
    the op keeps it."""
    head_calls, cand_calls = [], []

    def head_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
        head_calls.append(int(seq_lens.max()))
        return decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale)

    def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
        cand_calls.append(int(max_seqlen))
        return prefill_baseline(q, k, v, cu_seqlens, max_seqlen, sm_scale)

    head = SimpleNamespace(decode=head_decode, supports=lambda op, **shape: shape["max_seq_len"] <= 14)
    ops = AttentionOps(SimpleNamespace(prefill=prefill), other_heads={"decode": head})
    reqs = [TraceRequest(0, 0.0, list(range(3, 11)), 10), TraceRequest(1, 0.0, list(range(20, 36)), 6)]
    served = run_requests(engine(ops), reqs, realtime=False)
    stats = ops.stats()
    assert stats["decode"]["implemented"] is False and stats["decode"]["candidate"] == 0
    assert stats["decode"]["other_head"] == len(head_calls) > 0 and max(head_calls) <= 14
    assert stats["decode"]["not_implemented"] > 0                      # the shapes the head declined: torch's
    assert stats["decode"]["calls"] == stats["decode"]["other_head"] + stats["decode"]["not_implemented"]
    assert stats["prefill"]["candidate"] == len(cand_calls) > 0
    baseline = run_requests(engine(), reqs, realtime=False)
    assert {k: [e.token for e in v] for k, v in served.items()} == {k: [e.token for e in v] for k, v in baseline.items()}
    def own_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
        return decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale)

    mine = AttentionOps(SimpleNamespace(decode=own_decode), other_heads={"decode": head})
    assert mine._route("decode", {"max_seq_len": 1}) is own_decode and "decode" not in mine.other_heads


def test_a_candidate_output_of_the_wrong_shape_is_an_error_naming_it():
    candidate = SimpleNamespace(decode=lambda q, k_cache, v_cache, block_table, seq_lens, sm_scale: q[:, :1])
    e = engine(AttentionOps(candidate))
    e.add(Request("a", [1, 2, 3], 3))
    e.step()
    with pytest.raises(TypeError, match=r"the candidate's decode returned \[1, 1, 16\] torch.float32 on cpu; expected \[1, 4, 16\]"):
        e.step()


def test_the_served_model_reads_what_a_candidates_output_holds_whatever_methods_the_object_carries():
    """A decode that returns zeros whose methods (`reshape`, `view`, `clone`, `contiguous`, `detach`) give the right
    answer: the engine reads the memory (through a fresh plain tensor: harness/candidate.py `plain_output`), so it
    serves what zeros give, not the baseline's tokens."""
    def forged(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
        out = torch.zeros_like(q)
        right = decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
        for name in ("reshape", "view", "clone", "contiguous", "detach", "flatten"):
            setattr(out, name, getattr(right, name))
        return out

    def zeros(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
        return torch.zeros_like(q)
    reqs = trace(4, seed=3)

    def tokens(ops):
        return {k: [e.token for e in v] for k, v in run_requests(engine(ops), reqs, realtime=False).items()}
    assert tokens(AttentionOps(SimpleNamespace(decode=forged))) == tokens(AttentionOps(SimpleNamespace(decode=zeros)))
    assert tokens(AttentionOps(SimpleNamespace(decode=zeros))) != tokens(AttentionOps())


def _shape_spy() -> tuple[SimpleNamespace, dict[str, list]]:
    """A candidate that runs the baselines and notes the shapes it is called on."""
    seen: dict[str, list] = {"decode_batch": [], "decode_context": [], "prefill_prompts": []}

    def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
        seen["decode_batch"].append(q.shape[0])
        seen["decode_context"].append(int(seq_lens.max()))
        return decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale)

    def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
        seen["prefill_prompts"].append(cu_seqlens.diff().tolist())
        return prefill_baseline(q, k, v, cu_seqlens, max_seqlen, sm_scale)

    return SimpleNamespace(decode=decode, prefill=prefill), seen


def test_warm_up_meets_every_decode_batch_size_and_the_served_prompt_lengths_before_the_window():
    prompts = [len(r.prompt) for r in trace(12, seed=3)]
    spread = [prompts[i * len(prompts) // 7] for i in range(7)]
    candidate, seen = _shape_spy()
    e = engine(AttentionOps(candidate))
    warm_up(e, prompts, limit=7)
    assert set(range(1, 8)) <= set(seen["decode_batch"])             # 7 at once, then one fewer a step, down to 1
    assert max(seen["decode_context"]) >= max(spread)                  # decode over contexts of the served lengths
    met = sorted(n for call in seen["prefill_prompts"] for n in call)
    for n in spread + [min(prompts), max(prompts)]:
        assert n in met
    alone = [call[0] for call in seen["prefill_prompts"] if len(call) == 1]
    assert len(set(alone) & set(prompts)) == 7 and {min(prompts), max(prompts)} <= set(alone)   # 7 lengths alone
    assert e.ops.stats()["decode"]["calls"] == 0 and e.steps == 0      # counts start afresh for the window


def test_served_warm_passes_sends_the_served_lengths_in_the_served_order_then_longest_first_each_meeting_every_batch():
    prompts = [len(r.prompt) for r in trace(12, seed=3)]
    spread = [prompts[i * len(prompts) // 7] for i in range(7)]
    orders = {1: {tuple(spread)}, 2: {tuple(spread), tuple(sorted(spread, reverse=True))}}
    for passes in (1, 2):
        candidate, seen = _shape_spy()
        warm_up(engine(AttentionOps(candidate)), prompts, limit=7, passes=passes)
        assert set(range(1, 8)) <= set(seen["decode_batch"]), passes
        sent = {tuple(call) for call in seen["prefill_prompts"] if sorted(call) == sorted(spread)}
        assert sent == orders[passes], (passes, sent)


class _Sweep:
    """A stand-in for the compile-only context (harness/probes.py `compiling`): notes whether a call is made inside
    it; with `fail_after`, the n-th call inside raises."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.inside, self.calls, self.fail_after = False, 0, fail_after

    @contextlib.contextmanager
    def __call__(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def spied(self) -> tuple[SimpleNamespace, dict[str, list]]:
        """A shape spy whose notes say inside or out: ("in" | "out", batch)."""
        seen: dict[str, list] = {"decode": [], "prefill": []}

        def note(kind: str, what) -> None:
            if self.inside:
                self.calls += 1
                if self.fail_after is not None and self.calls >= self.fail_after:
                    raise RuntimeError("the sweep's call failed")
            seen[kind].append(("in" if self.inside else "out", what))

        def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
            note("decode", q.shape[0])
            return decode_baseline(q, k_cache, v_cache, block_table, seq_lens, sm_scale)

        def prefill(q, k, v, cu_seqlens, max_seqlen, sm_scale):
            note("prefill", tuple(cu_seqlens.diff().tolist()))
            return prefill_baseline(q, k, v, cu_seqlens, max_seqlen, sm_scale)
        return SimpleNamespace(decode=decode, prefill=prefill), seen


def test_warm_up_sweeps_the_served_parts_compile_only_first_then_serves_the_same_shapes_for_real():
    prompts = [len(r.prompt) for r in trace(12, seed=3)]
    sweep = _Sweep()
    candidate, seen = sweep.spied()
    e = engine(AttentionOps(candidate))
    took = warm_up(e, prompts, limit=7, sweep=sweep)
    for kind in ("decode", "prefill"):
        inside = [w for where, w in seen[kind] if where == "in"]
        outside = [w for where, w in seen[kind] if where == "out"]
        assert inside and set(inside) <= set(outside), kind              # every class swept is served for real too
        first_in = [where for where, _ in seen[kind]].index("in")
        assert "out" in [where for where, _ in seen[kind][first_in:]], kind   # ... after the sweep
    assert set(range(1, 8)) <= {b for where, b in seen["decode"] if where == "in"}
    assert list(took) == ["fixed", "sweep", "served", "alone"]
    assert e.ops.stats()["decode"]["calls"] == 0 and e.steps == 0


@pytest.mark.parametrize("fail_after", [1, 5])     # a prefill step admitting new requests; a decode step
def test_a_sweep_that_raises_is_cut_short_and_the_real_parts_still_meet_every_batch_size(fail_after):
    prompts = [len(r.prompt) for r in trace(12, seed=3)]
    sweep = _Sweep(fail_after=fail_after)
    candidate, seen = sweep.spied()
    e = engine(AttentionOps(candidate))
    free = e.allocator.available()
    warm_up(e, prompts, limit=7, sweep=sweep)
    assert sweep.calls == fail_after                                   # stopped at the failing call
    assert set(range(1, 8)) <= {b for where, b in seen["decode"] if where == "out"}
    assert not e.has_work() and e.allocator.available() == free      # nothing of the sweep left behind


def test_warm_up_without_served_lengths_is_the_fixed_one():
    candidate, seen = _shape_spy()
    warm_up(engine(AttentionOps(candidate)))
    assert sorted(set(seen["decode_batch"])) == [1, 2, 3, 4, 5] and max(seen["decode_context"]) <= 106
