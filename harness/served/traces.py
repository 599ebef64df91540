"""Serving traces: read and check a JSONL trace, write one, and generate synthetic ones from a seed.

One request per line: `{"arrival_s": 0.42, "prompt_len": 812, "output_len": 97}`, or with
`"prompt_tokens": [ids...]` instead of `prompt_len`. Arrivals are seconds from the start and never
go back in time. Two ways to turn a trace's window into requests:
- `requests_for`: a `prompt_len` becomes token ids drawn from a generator seeded by the request's
  index, so every replay of a trace sends the same prompts;
- `draw_requests`: fresh inputs from the caller's (secret) generator: the arrivals stay, the
  (prompt, output) length pairs are dealt out anew among them, and the prompt ids are drawn, so
  nothing about them is known before the draw.
A malformed trace is a `TraceError` naming the file and line. Not covered: tokenizing text
(prompts are token ids; the served model has no tokenizer).

Regenerate a shipped trace: python -m harness.served.traces --out PATH --seed N --duration S ...
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

class TraceError(Exception):
    """A trace that cannot be replayed; the message is one line naming the file and line."""


class TraceLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    arrival_s: float = Field(ge=0)
    prompt_len: int | None = Field(default=None, ge=1)
    prompt_tokens: list[int] | None = Field(default=None, min_length=1)
    output_len: int = Field(ge=1)

    @model_validator(mode="after")
    def _one_prompt(self) -> "TraceLine":
        if (self.prompt_len is None) == (self.prompt_tokens is None):
            raise ValueError("give exactly one of prompt_len and prompt_tokens")
        if self.prompt_tokens is not None and min(self.prompt_tokens) < 0:
            raise ValueError("prompt_tokens must be non-negative token ids")
        return self

    @property
    def length(self) -> int:
        return self.prompt_len if self.prompt_tokens is None else len(self.prompt_tokens)


@dataclass(frozen=True)
class TraceRequest:
    """A request as it is sent: its index in the trace, when, which tokens, how many to generate, and
    (teacher forcing) the tokens the server is to append instead of its own, output_len of them; `scored`:
    those scored in the prompt's prefill instead of decoded one a step (`kevo_score`, harness/served/engine.py)."""
    index: int
    arrival_s: float
    prompt: list[int]
    output_len: int
    forced: tuple[int, ...] | None = None
    scored: bool = False


def _explain(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    msg = "unknown key" if first["type"] == "extra_forbidden" else "missing key" if first["type"] == "missing" else first["msg"].removeprefix("Value error, ")
    return f"{key}: {msg}" if key else msg


def load_trace(path: Path | str) -> list[TraceLine]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace ({e})") from None
    lines, last = [], 0.0
    for no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{no}: not valid JSON ({e.msg})") from None
        if not isinstance(data, dict):
            raise TraceError(f"{path}:{no}: expected a JSON object")
        try:
            line = TraceLine.model_validate(data)
        except ValidationError as e:
            raise TraceError(f"{path}:{no}: {_explain(e)}") from None
        if line.arrival_s < last:
            raise TraceError(f"{path}:{no}: arrival_s {line.arrival_s} is before the previous line's {last}")
        last = line.arrival_s
        lines.append(line)
    if not lines:
        raise TraceError(f"{path}: the trace has no requests")
    return lines


def _window(lines: list[TraceLine], window_s: float, source: str) -> list[TraceLine]:
    """The lines before the first one that arrives at or after the window's end."""
    inside = list(itertools.takewhile(lambda line: line.arrival_s < window_s, lines))
    if not inside:
        raise TraceError(f"{source}: no request arrives within the {window_s:g} s window")
    return inside


def _request(i: int, line: TraceLine, prompt: list[int], output_len: int, vocab: int, max_tokens: int,
             source: str) -> TraceRequest:
    """Request i (0-based) as sent, once it fits the served model's vocabulary and KV cache."""
    if max(prompt) >= vocab:
        raise TraceError(f"{source}: request {i + 1} has token id {max(prompt)}; the model's vocabulary is {vocab}")
    if len(prompt) + output_len > max_tokens:
        raise TraceError(f"{source}: request {i + 1} needs {len(prompt) + output_len} tokens of KV cache; "
                         f"the served model holds at most {max_tokens}")
    return TraceRequest(i, line.arrival_s, prompt, output_len)


def requests_for(lines: list[TraceLine], window_s: float, vocab: int, max_tokens: int,
                 source: str = "trace") -> list[TraceRequest]:
    """The requests that arrive within the window, with their prompt tokens. `max_tokens` is what one
    request may hold in the served model's KV cache (prompt plus output)."""
    out = []
    for i, line in enumerate(_window(lines, window_s, source)):
        if line.prompt_tokens is not None:
            prompt = list(line.prompt_tokens)
        else:
            rng = random.Random(f"kevo-prompt:{i}")
            prompt = [rng.randrange(vocab) for _ in range(line.prompt_len)]
        out.append(_request(i, line, prompt, line.output_len, vocab, max_tokens, source))
    return out


def draw_requests(lines: list[TraceLine], window_s: float, vocab: int, max_tokens: int, rng: random.Random,
                  source: str = "trace") -> list[TraceRequest]:
    """Fresh requests for the window, drawn from `rng` (the caller seeds it in secret): each request
    keeps its arrival time; the (prompt_len, output_len) pairs of the window's lines are shuffled
    among them, so the window's length distribution and its load (total prompt and output tokens)
    are the trace's; and the prompt ids are drawn uniformly from the vocabulary. A line that gives
    explicit `prompt_tokens` keeps them and its output_len (such prompts are then not secret: the
    trace file holds them). `max_tokens` as in `requests_for`, with the same checks and errors."""
    inside = _window(lines, window_s, source)
    pairs = [(line.prompt_len, line.output_len) for line in inside if line.prompt_tokens is None]
    rng.shuffle(pairs)
    dealt = iter(pairs)
    ids = range(vocab)
    out = []
    for i, line in enumerate(inside):
        if line.prompt_tokens is not None:
            out.append(_request(i, line, list(line.prompt_tokens), line.output_len, vocab, max_tokens, source))
            continue
        prompt_len, output_len = next(dealt)
        out.append(_request(i, line, rng.choices(ids, k=prompt_len), output_len, vocab, max_tokens, source))
    return out


def fresh_ids(requests: list[TraceRequest], vocab: int, rng: random.Random) -> list[TraceRequest]:
    """Twins of `requests` with the same arrivals, prompt and output lengths and new token ids drawn from `rng`:
    every step a server batches for them has the shapes the originals' steps have, and none of their prompts is
    an original's (the replay's warm pass: harness/stages/replay.py)."""
    ids = range(vocab)
    return [TraceRequest(r.index, r.arrival_s, rng.choices(ids, k=len(r.prompt)), r.output_len) for r in requests]


def generate(seed: int, duration_s: float, rate: float, prompt_median: float, prompt_sigma: float,
             output_median: float, output_sigma: float, max_prompt: int, max_output: int) -> list[TraceLine]:
    """Poisson arrivals at `rate` per second for `duration_s`; lognormal prompt and output lengths
    (medians and log-space sigmas), clipped to [1, max]. The same arguments give the same trace."""
    rng = random.Random(seed)
    lines, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return lines
        p = min(max_prompt, max(1, round(rng.lognormvariate(math.log(prompt_median), prompt_sigma))))
        o = min(max_output, max(1, round(rng.lognormvariate(math.log(output_median), output_sigma))))
        lines.append(TraceLine(arrival_s=round(t, 4), prompt_len=p, output_len=o))


def write_trace(path: Path | str, lines: list[TraceLine]) -> None:
    Path(path).write_text("".join(json.dumps(line.model_dump(exclude_none=True)) + "\n" for line in lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write a synthetic serving trace (Poisson arrivals, lognormal lengths).")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    p.add_argument("--prompt-median", type=float, required=True)
    p.add_argument("--prompt-sigma", type=float, default=0.6)
    p.add_argument("--output-median", type=float, required=True)
    p.add_argument("--output-sigma", type=float, default=0.5)
    p.add_argument("--max-prompt", type=int, required=True)
    p.add_argument("--max-output", type=int, required=True)
    a = p.parse_args(argv)
    lines = generate(a.seed, a.duration, a.rate, a.prompt_median, a.prompt_sigma, a.output_median,
                     a.output_sigma, a.max_prompt, a.max_output)
    write_trace(a.out, lines)
    print(f"{a.out}: {len(lines)} requests over {a.duration:g} s")


if __name__ == "__main__":
    main()
