"""`kevo-agent evaluate FILE ...`: reading the files (and `--head`, `--other-head`), judging them in one worker pool
(harness/evaluate.py's `evaluate_each`), the JSON objects or tables it prints, the `--progress` lines, and where its
wall time went (`spans`, `wall_s` with --json; a `time:` line without: `_breakdown`). Not here: the arguments and
the exit statuses (agent/cli_parser.py), `main` (agent/cli.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from harness.config import load_config
from harness.records import Span

from agent.cli_parser import UsageError


def _other_heads(given: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """`--other-head OP=FILE ...` as op -> file and op -> source; UsageError naming a malformed one or an
    unreadable file."""
    files: dict[str, str] = {}
    out: dict[str, str] = {}
    for item in given:
        op, eq, path = item.partition("=")
        if not (eq and op and path):
            raise UsageError(f"--other-head {item}: give OP=FILE, e.g. --other-head decode=knowledge/attention/decode_paged_splitkv.py")
        if op in out:
            raise UsageError(f"--other-head {item}: {op} is given twice")
        try:
            files[op], out[op] = path, read_candidate(Path(path))
        except UsageError as e:
            raise UsageError(f"--other-head {op}={e}") from None
    return files, out


def read_candidate(path: Path) -> str:
    """A candidate file's text, or UsageError naming the path and why it cannot be read."""
    try:
        if path.is_dir():
            raise UsageError(f"{path}: is a folder, not a candidate file (give its files, e.g. {path}/*.py)")
        if path.exists() and not path.is_file():            # a FIFO would block the read; a device never ends
            raise UsageError(f"{path}: not a regular file")
        return path.read_text()
    except FileNotFoundError:
        why = "a link to a missing file" if path.is_symlink() else "no such file"
        raise UsageError(f"{path}: {why}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: cannot read (not UTF-8 text: {e.reason} at byte {e.start})") from None
    except OSError as e:                                     # permission denied, a loop of links, ...
        raise UsageError(f"{path}: cannot read ({e.strerror or e})") from None


@contextlib.contextmanager
def _progress(names: list[str], origin: float, on: bool):
    """`evaluate --progress`: a line on stderr as each file's stage starts, and the replay's own steps (the
    harness's progress log, harness/stages/replay.py and arms.py), each with the seconds since the command began.
    Yields the stage callback (None when `on` is false); the log is as it was after it."""
    import logging
    if not on:
        yield None
        return

    class Since(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"kevo-agent: {time.monotonic() - origin:.1f} s: {record.getMessage()}"

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Since())
    log = logging.getLogger("harness")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    def told(i: int, stage: str) -> None:
        log.info("%s: %s", names[i], stage)
    try:
        yield told
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _breakdown(spans: list[Span], origin: float) -> dict:
    """`spans` in seconds from `origin` (the process's start), and the wall time from it to now."""
    return {"spans": [{"name": s.name, "start": round(s.start - origin, 3), "end": round(s.end - origin, 3)}
                      for s in sorted(spans, key=lambda s: s.start)],
            "wall_s": round(time.monotonic() - origin, 3)}


def _time_line(times: dict) -> str:
    """The breakdown in one line: the steps one after another (plain names) and what they leave unaccounted
    since the first of them began (a later file's: since its own first step)."""
    steps = [(s["name"], s["end"] - s["start"]) for s in times["spans"] if "." not in s["name"]]
    since = min((s["start"] for s in times["spans"] if "." not in s["name"]), default=0.0)
    other = times["wall_s"] - since - sum(x for _, x in steps)
    return (f"time: {times['wall_s']:.2f} s since the process started: "
            + ", ".join(f"{n} {x:.2f}" for n, x in steps) + f", other {other:.2f}")


def evaluate_command(args: argparse.Namespace, origin: float | None = None, spans: list[Span] | None = None) -> int:
    """`origin`: when the command started (the process's start, from the command line; else now); `spans`: what
    it did before this (the interpreter's start-up, the CLI's imports)."""
    t0 = time.monotonic()
    origin, spans = t0 if origin is None else origin, [] if spans is None else spans
    cfg = load_config(args.config)
    try:
        head = read_candidate(Path(args.head)) if args.head else None
    except UsageError as e:
        raise UsageError(f"--head {e}") from None
    other_files, other_heads = _other_heads(args.other_head)
    spans.append(Span(name="config", start=t0, end=(t0 := time.monotonic())))
    from harness.pool import Pool, likely_device
    pool = Pool(cfg.worker, likely_device(cfg.device), args.target).launch()   # its imports beside ours
    spans.append(Span(name="launch", start=t0, end=(t0 := time.monotonic())))
    try:
        from harness.evaluate import evaluate_each            # imports torch: after the cheap checks
        from harness.stages import STAGE_NAMES
        from harness.targets import TARGETS
        spans.append(Span(name="torch", start=t0, end=(t0 := time.monotonic())))
        if args.target not in TARGETS:
            raise UsageError(f"unknown target {args.target!r}; known: {', '.join(TARGETS)}")
        if args.until and args.until not in STAGE_NAMES:
            raise UsageError(f"unknown stage {args.until!r}; stages: {', '.join(STAGE_NAMES)}")
        if unknown := [op for op in other_heads if op not in TARGETS[args.target].ops]:
            raise UsageError(f"--other-head {unknown[0]}=...: {args.target} has no op {unknown[0]!r}; its ops: "
                             f"{', '.join(TARGETS[args.target].ops)}")
        files: list[tuple[str, str | None, str]] = []      # (name, source or None, why not)
        for name in args.candidates:
            try:
                files.append((name, read_candidate(Path(name)), ""))
            except UsageError as e:
                files.append((name, None, str(e)))
        spans.append(Span(name="read", start=t0, end=time.monotonic()))
        readable = [name for name, src, _ in files if src is not None]
        on = sys.stderr.isatty() if args.progress is None else args.progress
        with _progress(readable, origin, on) as told:
            judged = evaluate_each([src for _, src, _ in files if src is not None], args.target, cfg, until=args.until,
                                   pool=pool, head=head, other_heads=other_heads, on_stage=told) if readable else iter(())
            worst = 0
            for name, source, why in files:
                outcome = next(judged) if source is not None else why
                if isinstance(outcome, str):                    # unreadable, or the slot judges nothing more
                    why = outcome if source is None else f"{name}: {outcome}"
                    print(f"kevo-agent: {why}".splitlines()[0], file=sys.stderr)
                    if args.json:
                        print(json.dumps({"file": name, "error": why}), flush=True)
                    worst = 2
                    continue
                times = _breakdown(spans + outcome.startup + outcome.spans, origin)
                spans = []                                      # the next file's: its own start-ups and stages
                if args.json:
                    named = {"head": args.head} if args.head else {}
                    named |= {"other_heads": other_files} if other_files else {}
                    print(json.dumps({"file": name, **named, **outcome.verdict.model_dump(),
                                      **times}), flush=True)
                else:
                    from agent.reading.view import print_verdict
                    print_verdict(outcome.verdict, name)
                    print(_time_line(times))
                worst = max(worst, 0 if outcome.verdict.ok else 1)
            return worst
    finally:
        pool.close()                                        # closed by its slot already, unless none was made
