"""`kevo-agent`'s command line as a grammar: every subcommand's arguments and help, and EXIT_CODES, the one
list of every subcommand's exit statuses (each subcommand's `--help` shows its own). Parsing a command
line imports nothing heavy: the registries' names (targets, stages) are filled into help only when help
is shown.
UsageError, the error a subcommand raises for a command line it cannot run, is here too.
Not here: what a subcommand does, or how an error becomes an exit status (agent/cli.py).
"""
from __future__ import annotations

import argparse
import textwrap


# Every exit status of every subcommand: the one list, shown in each subcommand's --help.
_COMMAND_FAILED = "the command could not run (one line on stderr naming why, never a traceback)"
_INTERRUPTED = "interrupted (Ctrl-C)"
_CUT_SHORT = "its output was closed by its reader (| head) before it was done; nothing on stderr"
EXIT_CODES: dict[str, dict[int, str]] = {
    "evaluate": {0: "every file passed every stage that ran", 1: "at least one was rejected",
                 2: "a file could not be judged (missing, a folder, unreadable: a one-line error naming it, and the "
                    "other files are still judged) or " + _COMMAND_FAILED, 130: _INTERRUPTED, 141: _CUT_SHORT},
    "run": {0: "the run ended at its budget or limits, its end commit written",
            2: "the run could not start, or stopped on a fatal error (its end commit written); one line on stderr "
               "naming why, never a traceback",
            130: "stopped by SIGINT after the candidate in evaluation was committed (resume with --resume); "
                 "a second signal: stopped at once, between commits",
            141: _CUT_SHORT,
            143: "stopped by SIGTERM after the candidate in evaluation was committed (resume with --resume)"},
    "profile": {0: "the profile was printed (and written with --json)", 2: _COMMAND_FAILED, 130: _INTERRUPTED,
                141: _CUT_SHORT},
    "ledger": {0: "the rows were printed, also when the reader stopped early (| head)", 2: _COMMAND_FAILED,
               130: _INTERRUPTED},
    "report": {0: "the page was written", 2: _COMMAND_FAILED, 130: _INTERRUPTED, 141: _CUT_SHORT},
    "replay": {0: "every kernel (or decision) is as it was, or changed without a regression",
               1: "a kernel that passed then is rejected now, or (--llm recorded) a decision differs",
               2: _COMMAND_FAILED, 130: "interrupted; re-judging keeps the kernels it finished (--resume)",
               141: _CUT_SHORT},
}


class UsageError(Exception):
    """The command cannot run as asked (any subcommand's: `main` makes it exit 2); the message is one line."""


def _exit_codes(command: str) -> str:
    return "exit status:\n" + "\n".join(textwrap.fill(f"{code:>3}  {why}", 78, initial_indent="  ", subsequent_indent=" " * 7)
                                        for code, why in EXIT_CODES[command].items())


def _registry_names() -> dict[str, str]:
    """The names help lists: the targets, the stages, the profiled targets (imports torch: only for --help)."""
    from harness.profile import TARGET_OPS
    from harness.stages import STAGE_NAMES
    from harness.targets import TARGETS
    return {"{targets}": ", ".join(TARGETS), "{stages}": ", ".join(STAGE_NAMES), "{profiled}": ", ".join(TARGET_OPS)}


class _Parser(argparse.ArgumentParser):
    """argparse, with the registries' names filled into help when help is shown, so that parsing a
    command line imports nothing heavy."""

    def format_help(self) -> str:
        if any("{" in (a.help or "") for a in self._actions):
            names = _registry_names()
            for a in self._actions:
                for slot, value in names.items():
                    if a.help and slot in a.help:
                        a.help = a.help.replace(slot, value)
        return super().format_help()


def parser() -> argparse.ArgumentParser:
    config = argparse.ArgumentParser(add_help=False)     # --config, before or after the subcommand
    config.add_argument("--config", default=argparse.SUPPRESS, metavar="PATH",
                        help="config file (default: the project's config.yaml); before or after the subcommand")
    p = _Parser(prog="kevo-agent", description="Evolve GPU kernels and tell the truth about them.",
                epilog="Each subcommand's --help lists its exit statuses.")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="config file (default: the project's config.yaml); before or after the subcommand")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=textwrap.fill(description or help, 78), parents=[config],
                              epilog=_exit_codes(name), formatter_class=argparse.RawDescriptionHelpFormatter)

    ev = command("evaluate", "run the staged evaluator on candidate files, in order, in one worker pool",
                 "Judge candidate files in the order given, in one worker pool, as a run's evaluation slot judges them.")
    ev.add_argument("candidates", nargs="+", metavar="FILE", help="a Python file defining decode(...) and/or prefill(...)")
    ev.add_argument("--target", default="attention", help="one of: {targets} (default: attention)")
    ev.add_argument("--until", default=None, metavar="STAGE", help="stop after this stage, one of: {stages}")
    ev.add_argument("--head", default=None, metavar="FILE",
                    help="the kernel each file must beat in the replay, served beside it (the current best of its op; "
                         "default: torch's baseline); microbench still only has to beat torch's baseline")
    ev.add_argument("--other-head", action="append", default=[], metavar="OP=FILE",
                    help="the kernel that serves OP in both of the replay's arms where a file does not define OP (as a "
                         "run serves its other ops' heads; repeatable; default: torch's baseline)")
    ev.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="a line on stderr as each stage starts, and the replay's steps (its servers up, the reference's "
                         "pass, each timed segment); default: on when stderr is a terminal")
    ev.add_argument("--json", action="store_true",
                    help="print one JSON object per line, one per file in order: file, ok, accepted, failed_stage, "
                         "reason, stages (each with name, status, reason, seconds, metrics, and failure where it "
                         "failed in a named way: timeout, crashed, ...); a file that could not "
                         "be judged: file, error")
    rn = command("run", "evolve kernels: propose, evaluate, record in a git ledger under runs/")
    rn.add_argument("--target", default=None, help="one of: {targets} (default: attention; a resumed run: its own)")
    rn.add_argument("--provider", default=None, help="offline | openai | anthropic (default: config agent.provider; "
                                                     "a resumed run: its own)")
    rn.add_argument("--model", default=None, help="the model for both planner and coder (default: config providers)")
    rn.add_argument("--budget-minutes", type=float, default=None,
                    help="wall-clock budget, all sessions of the run together (default: config, per device)")
    rn.add_argument("--max-candidates", type=int, default=None, help="candidates in all")
    rn.add_argument("--max-cost-usd", type=float, default=None, help="LLM spend in all")
    rn.add_argument("--max-device-minutes", type=float, default=None, help="the evaluator's stage time in all")
    rn.add_argument("--run-id", default=None, help="the ledger's folder under runs/; an existing kevo run resumes")
    rn.add_argument("--resume", default=None, metavar="RUN",
                    help="continue a stopped run (a path, or a run id under runs/) with its own settings; "
                         "flags given replace them")
    pf = command("profile", "where the served step's time goes (baseline replay under torch.profiler)")
    pf.add_argument("--target", default="attention", help="one of: {profiled} (default: attention)")
    pf.add_argument("--json", default=None, metavar="PATH", help="also write the profile as JSON (for the planner)")
    pf.add_argument("--window", type=float, default=None, help="seconds of the trace to replay (default: config served)")
    lg = command("ledger", "one row per candidate of a run: claim, stage, verdict, predicted vs observed, cost")
    lg.add_argument("run", help="the run's ledger (runs/<id>), or a bare run id under agent.runs_dir")
    lg.add_argument("--json", action="store_true", help="print the rows as JSON")
    rp = command("report", "a run as one self-contained HTML page with plots and the best kernels")
    rp.add_argument("run", help="the run's ledger (runs/<id>), or a bare run id under agent.runs_dir")
    rp.add_argument("--out", default=None, metavar="PATH", help="where to write it (default: runs/<id>/report.html)")
    rl = command("replay", "a past run again: re-judging its kernels with today's harness (the default), or "
                           "re-running its decisions (--llm recorded); then vs now, committed on a replay/ branch of "
                           "the run; re-judging saves each kernel as it finishes (--resume) and uses every "
                           "evaluation slot of config executor")
    rl.add_argument("run", help="the run's ledger (runs/<id>), or a bare run id under agent.runs_dir")
    rl.add_argument("--only", default=None, metavar="IDS", help="only these candidates (or head:<op>), e.g. c003,c007")
    rl.add_argument("--until", default=None, metavar="STAGE",
                    help="stop after this stage, one of: {stages} (both verdicts cut there)")
    rl.add_argument("--resume", action="store_true",
                    help="continue the newest unfinished (killed) re-judging of the run with its --until and --only: "
                         "only the kernels it had not finished are evaluated")
    rl.add_argument("--llm", default=None, metavar="recorded",
                    help="re-run the run's decisions: its planner and coder answered from the recorded exchanges")
    rl.add_argument("--json", action="store_true", help="print exactly one JSON object")
    return p
