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


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.provider is not None and args.provider not in ("offline", "openai", "anthropic"):
        raise UsageError(f"unknown provider {args.provider!r}; known: offline, openai, anthropic")
    for name in ("budget_minutes", "max_candidates", "max_cost_usd"):
        value = getattr(args, name)
        if value is not None and (value < 0 or (value == 0 and name != "max_cost_usd")):
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not {value}")
    if args.run_id is not None and not args.run_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UsageError(f"--run-id {args.run_id!r}: use letters, digits, '-', '_' and '.' only")
    provider = args.provider or cfg.agent.provider
    if provider != "offline":
        getattr(cfg.providers, provider).api_key(provider)   # an unset key: an error now, not mid-run
        if args.model and args.model not in cfg.providers.prices:
            raise UsageError(f"providers.prices has no entry for model {args.model!r}; add one (0 for a local server)")
    from harness.evaluate import resolve_device          # imports torch: after the cheap checks
    from agent.knowledge import CatalogError
    from agent.ledger import LedgerError
    from agent.loop import RunError, run, settings_from
    from agent.prompts import PromptError
    from agent.providers import ProviderStop
    from agent.view import RunView, print_summary
    settings = settings_from(cfg, resolve_device(cfg).type, target=args.target, provider=args.provider,
                             model=args.model, budget_minutes=args.budget_minutes, max_candidates=args.max_candidates,
                             max_cost_usd=args.max_cost_usd, run_id=args.run_id)
    try:
        with RunView(budget_minutes=settings.budget_minutes, provider=settings.provider) as view:
            result = run(cfg, settings, view)
    except (RunError, ProviderStop, CatalogError, LedgerError, PromptError) as e:
        raise UsageError(str(e)) from None
    print_summary(result)
    if result.fatal:
        raise UsageError(f"run stopped: {result.stop} (ledger: {result.ledger})")
    return 0


def _profile(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.window is not None and args.window <= 0:
        raise UsageError(f"--window must be positive, not {args.window}")
    from harness.profile import TARGET_OPS, profile_served, render   # imports torch: after the cheap checks
    from harness.served.model import ModelError
    if args.target not in TARGET_OPS:
        raise UsageError(f"no served profile for target {args.target!r}; known: {', '.join(TARGET_OPS)}")
    try:
        report = profile_served(cfg, args.target, window_s=args.window)
    except ModelError as e:
        raise UsageError(str(e)) from None
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        except OSError as e:
            raise UsageError(f"{args.json}: cannot write ({e.strerror})") from None
    print(render(report))
    return 0


COMMANDS = {"evaluate": _evaluate, "run": _run, "profile": _profile}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kevo-agent", description="Evolve GPU kernels and tell the truth about them.")
    p.add_argument("--config", default=None, help="config file (default: the project's config.yaml)")
    sub = p.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("evaluate", help="run the staged evaluator on one candidate file")
    ev.add_argument("candidate", help="a Python file defining decode(...) and/or prefill(...)")
    ev.add_argument("--target", default="attention")
    ev.add_argument("--until", default=None, help="stop after this stage")
    ev.add_argument("--json", action="store_true", help="print exactly one JSON object")
    rn = sub.add_parser("run", help="evolve kernels: propose, evaluate, record in a git ledger under runs/")
    rn.add_argument("--target", default="attention")
    rn.add_argument("--provider", default=None, help="offline | openai | anthropic (default: config agent.provider)")
    rn.add_argument("--model", default=None, help="the model for both planner and coder (default: config providers)")
    rn.add_argument("--budget-minutes", type=float, default=None, help="wall-clock budget (default: config, per device)")
    rn.add_argument("--max-candidates", type=int, default=None)
    rn.add_argument("--max-cost-usd", type=float, default=None)
    rn.add_argument("--run-id", default=None, help="the ledger's folder under runs/; an existing kevo run resumes")
    pf = sub.add_parser("profile", help="where the served step's time goes (baseline replay under torch.profiler)")
    pf.add_argument("--target", default="attention")
    pf.add_argument("--json", default=None, metavar="PATH", help="also write the profile as JSON (for the planner)")
    pf.add_argument("--window", type=float, default=None, help="seconds of the trace to replay (default: config served)")
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
