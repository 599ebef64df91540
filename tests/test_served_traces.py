"""Traces: the generator is deterministic for a seed, traces round-trip through JSONL, the shipped
ones load, fresh inputs are drawn from the caller's generator within the window's lengths, and every
malformed trace is one line naming the file and the line."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from conftest import ROOT
from harness.served.traces import TraceError, TraceLine, draw_requests, generate, load_trace, requests_for, write_trace

ARGS = dict(duration_s=30, rate=2.0, prompt_median=64, prompt_sigma=0.7, output_median=16, output_sigma=0.5,
            max_prompt=300, max_output=40)


def test_generator_is_deterministic_for_a_seed_and_differs_across_seeds():
    a, b, c = generate(7, **ARGS), generate(7, **ARGS), generate(8, **ARGS)
    assert a == b and a != c
    arrivals = [line.arrival_s for line in a]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 30
    assert 20 <= len(a) <= 100                                       # about rate x duration = 60
    assert all(1 <= line.prompt_len <= 300 and 1 <= line.output_len <= 40 for line in a)


def test_generated_trace_round_trips_through_jsonl(tmp_path):
    lines = generate(3, **ARGS)
    write_trace(tmp_path / "t.jsonl", lines)
    assert load_trace(tmp_path / "t.jsonl") == lines


@pytest.mark.parametrize("name", ["chat.jsonl", "long_context.jsonl", "tiny.jsonl"])
def test_shipped_traces_load(name):
    lines = load_trace(ROOT / "harness/served/traces" / name)
    assert len(lines) >= 5


def test_prompts_are_the_same_on_every_replay_and_within_the_vocabulary():
    lines = [TraceLine(arrival_s=0.0, prompt_len=50, output_len=3), TraceLine(arrival_s=0.5, prompt_tokens=[1, 2, 3], output_len=2),
             TraceLine(arrival_s=9.0, prompt_len=5, output_len=1)]
    first, again = requests_for(lines, 5.0, 100, 1000), requests_for(lines, 5.0, 100, 1000)
    assert first == again and len(first) == 2                        # the third arrives after the window
    assert all(0 <= t < 100 for t in first[0].prompt) and len(first[0].prompt) == 50
    assert first[1].prompt == [1, 2, 3]


def test_a_request_the_model_cannot_hold_is_refused_naming_it():
    lines = [TraceLine(arrival_s=0.0, prompt_len=10, output_len=2), TraceLine(arrival_s=0.1, prompt_len=900, output_len=200)]
    with pytest.raises(TraceError, match="request 2 needs 1100 tokens of KV cache; the served model holds at most 1000"):
        requests_for(lines, 5.0, 100, 1000)
    with pytest.raises(TraceError, match="request 1 has token id 100; the model's vocabulary is 100"):
        requests_for([TraceLine(arrival_s=0.0, prompt_tokens=[5, 100], output_len=1)], 5.0, 100, 1000)


def test_fresh_inputs_are_drawn_from_the_generator_within_the_windows_lengths_at_the_traces_arrivals():
    lines = generate(5, **ARGS)
    window = [line for line in lines if line.arrival_s < 20]
    assert len({(line.prompt_len, line.output_len) for line in window}) > 10      # several length pairs to deal
    draw = lambda seed: draw_requests(lines, 20.0, 100, 1000, random.Random(seed))   # noqa: E731
    a, again, other = draw(1), draw(1), draw(2)
    assert a == again
    pairs = lambda reqs: [(len(r.prompt), r.output_len) for r in reqs]             # noqa: E731
    assert pairs(a) != pairs(other)                                               # another pairing of lengths and arrivals
    head = lambda x, y: min(len(x.prompt), len(y.prompt))                        # noqa: E731
    assert not any(x.prompt[:head(x, y)] == y.prompt[:head(x, y)] for x, y in zip(a, other))   # other ids at every index
    fixed = requests_for(lines, 20.0, 100, 1000)
    assert not any(r.prompt == f.prompt for r, f in zip(a, fixed))               # not the trace's fixed prompts
    for reqs in (a, other):
        assert [(r.index, r.arrival_s) for r in reqs] == [(i, line.arrival_s) for i, line in enumerate(window)]
        assert Counter(pairs(reqs)) == Counter((line.prompt_len, line.output_len) for line in window)
        assert all(0 <= t < 100 for r in reqs for t in r.prompt) and all(r.forced is None for r in reqs)
    assert len({t for r in a for t in r.prompt}) == 100                           # ids from the whole vocabulary


def test_fresh_inputs_keep_a_lines_explicit_prompt_and_refuse_what_the_model_cannot_hold():
    lines = [TraceLine(arrival_s=0.0, prompt_len=10, output_len=2), TraceLine(arrival_s=0.5, prompt_tokens=[1, 2, 3], output_len=4),
             TraceLine(arrival_s=0.7, prompt_len=20, output_len=3)]
    for seed in range(4):
        reqs = draw_requests(lines, 5.0, 100, 1000, random.Random(seed))
        assert reqs[1].prompt == [1, 2, 3] and reqs[1].output_len == 4
        assert sorted((len(r.prompt), r.output_len) for r in (reqs[0], reqs[2])) == [(10, 2), (20, 3)]
    too_long = [TraceLine(arrival_s=0.0, prompt_len=10, output_len=2), TraceLine(arrival_s=0.1, prompt_len=900, output_len=200)]
    with pytest.raises(TraceError, match="needs 1100 tokens of KV cache; the served model holds at most 1000"):
        draw_requests(too_long, 5.0, 100, 1000, random.Random(0))
    with pytest.raises(TraceError, match="request 1 has token id 100; the model's vocabulary is 100"):
        draw_requests([TraceLine(arrival_s=0.0, prompt_tokens=[5, 100], output_len=1)], 5.0, 100, 1000, random.Random(0))
    with pytest.raises(TraceError, match="t.jsonl: no request arrives within the 0.5 s window"):
        draw_requests([TraceLine(arrival_s=1.0, prompt_len=4, output_len=1)], 0.5, 100, 1000, random.Random(0), "t.jsonl")


GOOD = '{"arrival_s": 0.1, "prompt_len": 4, "output_len": 2}'


@pytest.mark.parametrize("second_line, words", [
    ('{"arrival_s": 0.2, "prompt_len": 4', ":2: not valid JSON"),
    ('{"arrival_s": 0.2, "prompt_len": 4}', ":2: output_len: missing key"),
    ('{"arrival_s": 0.2, "prompt_len": 4, "prompt_tokens": [1], "output_len": 2}', ":2: give exactly one of prompt_len and prompt_tokens"),
    ('{"arrival_s": 0.05, "prompt_len": 4, "output_len": 2}', ":2: arrival_s 0.05 is before the previous line's 0.1"),
    ('{"arrival_s": 0.2, "prompt_tokens": [1, -3], "output_len": 2}', ":2: prompt_tokens must be non-negative"),
    ('{"arrival_s": 0.2, "prompt_len": 4, "output_len": 2, "temperature": 1}', ":2: temperature: unknown key"),
    ('{"arrival_s": 0.2, "prompt_len": 0, "output_len": 2}', ":2: prompt_len: Input should be greater than or equal to 1"),
    ('[1, 2]', ":2: expected a JSON object"),
], ids=["bad-json", "missing-key", "two-prompts", "time-goes-back", "negative-token", "unknown-key", "empty-prompt", "not-an-object"])
def test_malformed_trace_is_one_line_naming_file_and_line(tmp_path, second_line, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD + "\n" + second_line + "\n")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(err.value).startswith(str(path)) and words in str(err.value) and "\n" not in str(err.value)


def test_missing_and_empty_traces_are_one_line_errors(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="the trace has no requests"):
        load_trace(tmp_path / "empty.jsonl")
