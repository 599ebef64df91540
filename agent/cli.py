"""`kevo-agent`: the command line. One function per subcommand, registered in COMMANDS.

Exit codes: 0 ok, 1 the candidate (or run) was rejected, 2 the command itself could not run — always
one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.config import ConfigError, load_config
from harness.errors import HarnessError


class UsageError(Exception):
    """The command cannot run as asked; the message is one line."""


def _evaluate(args: argparse.Namespace) -> int:
    path = Path(args.candidate)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read ({e})") from None
    cfg = load_config(args.config)
    from harness.evaluate import evaluate, open_pool      # imports torch: after the cheap checks
    from harness.stages import STAGE_NAMES
    from harness.targets import TARGETS
    if args.target not in TARGETS:
        raise UsageError(f"unknown target {args.target!r}; known: {', '.join(TARGETS)}")
    if args.until and args.until not in STAGE_NAMES:
        raise UsageError(f"unknown stage {args.until!r}; stages: {', '.join(STAGE_NAMES)}")
    with open_pool(cfg, args.target) as pool:
        verdict = evaluate(source, args.target, cfg, pool, until=args.until)
    if args.json:
        print(verdict.model_dump_json())
    else:
        from agent.view import print_verdict
        print_verdict(verdict, str(path))
    return 0 if verdict.ok else 1


COMMANDS = {"evaluate": _evaluate}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kevo-agent", description="Evolve GPU kernels and tell the truth about them.")
    p.add_argument("--config", default=None, help="config file (default: the project's config.yaml)")
    sub = p.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("evaluate", help="run the staged evaluator on one candidate file")
    ev.add_argument("candidate", help="a Python file defining decode(...) and/or prefill(...)")
    ev.add_argument("--target", default="attention")
    ev.add_argument("--until", default=None, help="stop after this stage")
    ev.add_argument("--json", action="store_true", help="print exactly one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (UsageError, ConfigError, HarnessError) as e:
        print(f"kevo-agent: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kevo-agent: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
