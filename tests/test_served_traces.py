"""Traces: the generator is deterministic for a seed, traces round-trip through JSONL, the shipped
ones load, and every malformed trace is one line naming the file and the line."""
from __future__ import annotations

import pytest

from conftest import ROOT
from harness.served.traces import TraceError, TraceLine, generate, load_trace, requests_for, write_trace

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
