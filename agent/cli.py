"""`kevo-agent`: what each subcommand does (one function each, registered in COMMANDS) and `main`, which
turns an error into its exit status.

Exit codes: agent/cli_parser.py's EXIT_CODES is the one list of them, per subcommand, and each
subcommand's `--help` shows its own. In short: 0 ok, 1 the candidate (or run) was rejected, 2 the command
itself could not run — always one line on stderr, never a traceback. `evaluate` judges every file it
can and exits 2 if any could not be judged (each such file is one line on stderr naming it). Output cut
short by its reader (`| head`) ends the command quietly.
`evaluate` says where its wall time went from the interpreter's start, which `main` reads (`_process_start`).
Not here: the arguments, their help, the exit-status list and UsageError (agent/cli_parser.py); the `evaluate`
command itself (agent/cli_evaluate.py).
"""
from __future__ import annotations

import time

_LOADED = time.monotonic()             # this module's first line: the interpreter's start-up lies behind it

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from harness.config import ConfigError, load_config  # noqa: E402
from agent.ledger import LedgerError  # noqa: E402
from agent.text import printable  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.records import Span  # noqa: E402

from agent.cli_evaluate import evaluate_command  # noqa: E402
from agent.cli_parser import UsageError, parser as cli_parser  # noqa: E402


def _process_start() -> float:
    """When this process started, on time.monotonic's clock (Linux /proc, to a clock tick); this module's
    first line where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])          # starttime: clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return min(_LOADED, time.monotonic() - age)
    except (OSError, ValueError, IndexError, AttributeError):
        return _LOADED


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    if args.provider is not None and args.provider not in ("offline", "openai", "anthropic"):
        raise UsageError(f"unknown provider {args.provider!r}; known: offline, openai, anthropic")
    for name in ("budget_minutes", "max_candidates", "max_cost_usd", "max_device_minutes"):
        value = getattr(args, name)
        if value is not None and (value < 0 or (value == 0 and name != "max_cost_usd")):
            raise UsageError(f"--{name.replace('_', '-')} must be positive, not {value}")
    if args.run_id is not None and not args.run_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UsageError(f"--run-id {args.run_id!r}: use letters, digits, '-', '_' and '.' only")
    if args.run_id is not None and args.resume is not None:
        raise UsageError("give --resume (an existing run) or --run-id (a new run, or an existing one), not both")
    from agent.run.settings import RunError, run_folder, stored
    try:
        root = run_folder(cfg, args.run_id, args.resume)     # a run in progress there: said now, before torch loads
        before = stored(root) if root is not None else None
    except RunError as e:                                # a LedgerError there is main's one line too
        raise UsageError(str(e)) from None
    provider = args.provider or (before or {}).get("provider") or cfg.agent.provider
    if provider != "offline":
        getattr(cfg.providers, provider).api_key(provider)   # an unset key: an error now, not mid-run
        if cfg.providers.fallback not in (None, provider):
            getattr(cfg.providers, cfg.providers.fallback).api_key(cfg.providers.fallback)
        if args.model and args.model not in cfg.providers.prices:
            raise UsageError(f"providers.prices has no entry for model {args.model!r}; add one (0 for a local server)")
        from agent.llm.providers import ProviderStop, check_keys
        try:
            check_keys(cfg.providers, provider)              # a refused key: said now, before the heads' minutes
        except ProviderStop as e:
            raise UsageError(str(e)) from None
    from harness.evaluate import resolve_device          # imports torch: after the cheap checks
    from agent.knowledge import CatalogError
    from agent.run.loop import run, settings_from
    from agent.llm.prompts import PromptError
    from agent.llm.providers import ProviderStop
    from agent.reading.view import RunView, print_summary
    settings = None
    try:
        settings = settings_from(cfg, resolve_device(cfg).type, target=args.target, provider=args.provider,
                                 model=args.model, budget_minutes=args.budget_minutes, max_candidates=args.max_candidates,
                                 max_cost_usd=args.max_cost_usd, max_device_minutes=args.max_device_minutes,
                                 run_id=args.run_id, resume=args.resume)
        with RunView(budget_minutes=settings.budget_minutes, provider=settings.provider) as view:
            result = run(cfg, settings, view)
    except (RunError, ProviderStop, CatalogError, LedgerError, PromptError) as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:                            # a second signal: stopped at once, between commits
        where = (settings.root or settings.run_id) if settings else (args.resume or args.run_id)
        resume = f" (resume: kevo-agent run --resume {where})" if where else ""
        print(f"kevo-agent: stopped at once; the ledger holds every commit made{resume}", file=sys.stderr)
        return 130
    print_summary(result)
    if result.fatal:
        raise UsageError(f"run stopped: {result.stop} (ledger: {result.ledger})")
    if result.signal:
        print(f"kevo-agent: run {result.stop}; resume: kevo-agent run --resume {result.ledger}", file=sys.stderr)
        return 128 + result.signal
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


def _find_run(args: argparse.Namespace):
    """The ledger named on the command line: a path, or a bare run id under the config's agent.runs_dir."""
    from harness.config import PROJECT_ROOT
    from agent.reading.table import find_run
    runs = Path(load_config(args.config).agent.runs_dir)
    try:
        return find_run(args.run, runs if runs.is_absolute() else PROJECT_ROOT / runs)
    except LedgerError as e:
        raise UsageError(str(e)) from None


def _ledger(args: argparse.Namespace) -> int:
    from agent.reading.table import print_rows, rows
    ledger = _find_run(args)
    try:
        items = rows(ledger)
    except ValueError as e:                               # a record.json that is not a candidate record
        raise UsageError(f"{ledger.root}: unreadable ledger ({e})") from None
    if args.json:
        print(json.dumps([r.model_dump() for r in items], indent=1))
    else:
        print_rows(ledger.header(), items)
    return 0


def _report(args: argparse.Namespace) -> int:
    ledger = _find_run(args)
    from agent.reading.report import write                        # imports matplotlib: after the cheap checks
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        raise UsageError(f"--out {out}: no such folder {out.parent}")
    try:
        path = write(ledger, out)
    except ValueError as e:                               # a record.json that is not a candidate record
        raise UsageError(f"{ledger.root}: unreadable ledger ({e})") from None
    except OSError as e:
        raise UsageError(f"{out or ledger.root}: cannot write the report ({e.strerror})") from None
    print(f"report: {path}")
    return 0


def _rejudge(args: argparse.Namespace) -> int:
    if args.llm is not None and args.llm != "recorded":
        raise UsageError(f"--llm {args.llm!r}: only 'recorded' is known (the run's recorded exchanges, no key needed)")
    if args.llm and (args.only or args.until or args.resume):
        raise UsageError("--only, --until and --resume are for re-judging; --llm recorded re-runs the run's decisions from "
                         "its start")
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only is not None else None
    if only == []:
        raise UsageError("--only: give candidate ids (or head:<op>) separated by commas, e.g. --only c003,c007")
    cfg = load_config(args.config)
    root = _find_run(args).root
    from harness.stages import STAGE_NAMES               # imports torch: after the cheap checks
    if args.until and args.until not in STAGE_NAMES:
        raise UsageError(f"unknown stage {args.until!r}; stages: {', '.join(STAGE_NAMES)}")
    from rich.console import Console
    from agent.knowledge import CatalogError
    from agent.run.loop import RunError
    from agent.llm.prompts import PromptError
    from agent.llm.providers import ProviderStop
    from agent.rejudging.rerun import RejudgeError, rerun
    from agent.rejudging.rejudge import rejudge
    from agent.rejudging.progress import ProgressError, finish, receipts_of
    from agent.rejudging.report import commit_rejudging, print_rejudging
    from agent.run.session import RunBusy, RunLock
    from agent.reading.view import RunView
    err = Console(stderr=True)
    try:
        if args.llm:
            with RunView(console=err, provider="recorded") as view:
                done = rerun(root, cfg, view)
        else:
            done = rejudge(root, cfg, only=only, until=args.until, resume=args.resume,
                           progress=lambda line: err.print(line, highlight=False, soft_wrap=True))
        with RunLock(root):                               # a resume's recovery never races this commit
            done = commit_rejudging(root, done)
            if not args.llm:
                finish(root, done, receipts_of(cfg))    # the unfinished re-judging's ref: committed in full now
    except (RejudgeError, ProgressError, RunError, ProviderStop, CatalogError, LedgerError, PromptError, RunBusy) as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        if args.llm:
            raise
        print(f"kevo-agent: re-judging interrupted; the kernels it finished are saved (continue: kevo-agent replay "
              f"{args.run} --resume)", file=sys.stderr)
        return 130
    if args.json:
        print(done.model_dump_json())
    else:
        print_rejudging(done, Console())
    return 1 if done.failures else 0


COMMANDS = {"evaluate": evaluate_command, "run": _run, "profile": _profile, "ledger": _ledger, "report": _report,
            "replay": _rejudge}


def _cut_short() -> None:
    """The reader of stdout went away (| head): stdout to /dev/null, so that nothing more, not even the
    interpreter's last flush, tries to write to the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _exit_now(code: int) -> None:
    """End an `evaluate` process once its verdicts are out and its pool is closed, without the interpreter's
    teardown of torch (0.6 s on the CPU machine, for nothing: every worker is gone and every output written)."""
    sys.stdout.flush()                                    # a closed pipe is found here, as for the other commands
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """`argv` None: the command line, and this process is the command (its start is evaluate's origin)."""
    parser = cli_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "evaluate" and argv is None:      # the breakdown from the interpreter's start
            origin = _process_start()
            code = evaluate_command(args, origin, [Span(name="python", start=origin, end=_LOADED),
                                            Span(name="imports", start=_LOADED, end=time.monotonic())])
            _exit_now(code)
        code = COMMANDS[args.command](args)
        sys.stdout.flush()                                # a closed pipe is found here, not at exit
        return code
    except BrokenPipeError:
        _cut_short()
        return 0 if args.command == "ledger" else 141
    except (UsageError, ConfigError, HarnessError, LedgerError) as e:
        print(printable(f"kevo-agent: {e}".splitlines()[0]), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kevo-agent: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
