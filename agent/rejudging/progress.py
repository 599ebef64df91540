"""A re-judging under way, saved after every kernel it finishes: one killed at any moment (SIGKILL
included) loses only the kernels it was evaluating, and `kevo-agent replay runs/<id> --resume` continues it.

Where it lives: a ref of its own in the run's repository, `refs/kevo/replay-unfinished/<UTC time>-<device>`,
never a branch. Each save is a commit of the run's tip tree plus `replay/unfinished.json` (an `Unfinished`),
on the previous save (the first on the run's tip), written as objects with an in-memory index
(Ledger.commit_beside, agent/ledger/repository.py); then `git update-ref` moves the ref, given its old value: git writes a ref
through a lock file renamed into place, so the ref holds the last save whole (or the one before), and a
second process continuing the same re-judging is refused instead of interleaved. The run's branch, .git/index
and working tree are never touched. Once the whole re-judging is committed (report.commit_rejudging, the
same branch as for one never interrupted), `finish` deletes the ref.
`--resume` takes the newest such ref, and only if this machine saved it, and the run's tip, this machine (device,
GPU, kevo commit) and the harness settings are those it started with; its --until and --only are the saved ones.
This machine's saves: a receipt for each, an empty file named by the save's commit under `<agent.runs_dir>/.replays/`
(written before the ref moves, the previous save's dropped after), beside the verdict cache and as trusted as it.
A ref that came with a copied ledger has no receipt here, however well its fields match this machine: its rows are
another machine's word, so it is not resumed.
Not covered: a kill between the final commit and `finish` leaves the ref, and a --resume then finds every
kernel done and commits the re-judging again (a second branch). Refs of re-judgings never resumed stay until
deleted (`git update-ref -d <ref>`).
Not here: judging the kernels (rejudge), the final commit (report).
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

import git
from pydantic import Field, ValidationError

from agent.ledger.repository import Ledger
from agent.ledger.store import open_repo
from agent.records import Record
from agent.rejudging.report import Rejudging, VerdictRow
from agent.run.settings import runs_dir
from harness.config import Config

PREFIX = "refs/kevo/replay-unfinished/"
FILE = "replay/unfinished.json"
_NONE = "0" * 40                        # update-ref's old value for "the ref must not exist yet"


class ProgressError(Exception):
    """The unfinished re-judging cannot be saved, read or continued as asked; one line."""


class Unfinished(Record):
    """What a re-judging has done so far, and what a --resume must keep the same to continue it."""
    run: str
    tip: str                            # the run's commit it re-judges (hexsha)
    at: str                             # UTC, when it started (its branch is named for it)
    until: str | None = None
    only: list[str] | None = None
    now: dict[str, str]                 # device, gpu, kevo_commit it runs on
    config_changes: list[str]           # harness settings: the run's -> today's
    rows: list[VerdictRow] = Field(default_factory=list)    # kernels evaluated, in the order they finished


def receipts_of(cfg: Config) -> Path:
    """Where this machine keeps the receipts of the saves it made."""
    return runs_dir(cfg) / ".replays"


class Saved:
    """One unfinished re-judging's ref: `save` after each kernel; `finish` drops it once the re-judging is committed."""

    def __init__(self, root: Path, state: Unfinished, receipts: Path, ref: str = "", sha: str = "") -> None:
        self.root, self.state, self.receipts, self.ref, self.sha = root, state, receipts, ref, sha
        self.ledger = Ledger(root)
        self.repo = self.ledger.repo

    @classmethod
    def start(cls, root: Path, state: Unfinished, receipts: Path) -> "Saved":
        """A new unfinished re-judging; its ref is named and written with its first row."""
        return cls(root, state, receipts)

    def mine(self) -> bool:
        """Whether this machine saved the ref's commit (its receipt is here)."""
        return bool(self.sha) and (self.receipts / self.sha).is_file()

    def _name(self) -> str:
        taken = set(_refs(self.repo))
        base = f"{PREFIX}{datetime.fromisoformat(self.state.at).strftime('%Y%m%dT%H%M%SZ')}-{self.state.now['device']}"
        ref, n = base, 1
        while ref in taken:
            n += 1
            ref = f"{base}-{n}"
        return ref

    def save(self, row: VerdictRow) -> None:
        state = self.state.model_copy(update={"rows": [*self.state.rows, row]})
        tip = self.repo.commit(state.tip)
        parent = self.repo.commit(self.sha) if self.sha else tip
        commit = self.ledger.commit_beside(
            {FILE: state.model_dump_json(indent=1)},
            f"re-judging {state.run} unfinished: {len(state.rows)} kernel(s) done, the last {row.ref}",
            f"A re-judging started {state.at}; `kevo-agent replay <run> --resume` continues it.", base=tip, parent=parent)
        self.ref = self.ref or self._name()
        self.receipts.mkdir(parents=True, exist_ok=True)
        (self.receipts / commit.hexsha).touch()
        try:
            self.repo.git.update_ref("-m", "kevo re-judging: a kernel done", self.ref, commit.hexsha, self.sha or _NONE)
        except git.GitCommandError:
            raise ProgressError(f"{self.root}: {self.ref} moved under this re-judging (another process is continuing "
                                "it); this one stops") from None
        _drop(self.receipts, self.sha)
        self.state, self.sha = state, commit.hexsha

    def done(self) -> dict[str, VerdictRow]:
        return {r.ref: r for r in self.state.rows}


def _refs(repo: git.Repo) -> dict[str, str]:
    """Unfinished re-judgings' refs -> their commits, oldest first (the names start with the UTC time)."""
    out = repo.git.for_each_ref("--format=%(refname) %(objectname)", PREFIX)
    return dict(sorted(tuple(line.split()) for line in out.splitlines() if line.strip()))


def _drop(receipts: Path, sha: str) -> None:
    if sha:
        (receipts / sha).unlink(missing_ok=True)


def newest(root: Path, receipts: Path) -> Saved | None:
    """The newest unfinished re-judging of the run, or None."""
    repo = open_repo(root)
    refs = _refs(repo)
    if not refs:
        return None
    ref, sha = list(refs.items())[-1]
    try:
        state = Unfinished.model_validate_json((repo.commit(sha).tree / FILE).data_stream.read())
    except (KeyError, ValueError, ValidationError):
        raise ProgressError(f"{root}: {ref} cannot be read by this kevo; delete it (git update-ref -d {ref}) "
                            "and start a new re-judging") from None
    return Saved(root, state, receipts, ref, sha)


def resumed(saved: Saved, tip: str, now: dict[str, str], config_changes: list[str], until: str | None,
            only: list[str] | None) -> tuple[str | None, list[str] | None]:
    """The saved --until and --only, once this machine saved it, and the run, this machine and the harness are the
    ones it started with; an explicit flag must match the saved one."""
    s = saved.state
    what = f"the unfinished re-judging of {s.at}"
    if not saved.mine():
        raise ProgressError(f"{saved.root}: {what} ({saved.ref}) was not saved on this machine (it came with the "
                            f"ledger); start a new re-judging (without --resume), or delete it (git update-ref -d {saved.ref})")
    if until is not None and until != s.until:
        raise ProgressError(_mismatch("--until", until, s.until, what))
    if only is not None and (s.only is None or set(only) != set(s.only)):
        raise ProgressError(_mismatch("--only", ",".join(only), ",".join(s.only) if s.only else None, what))
    if tip != s.tip:
        raise ProgressError(f"{saved.root}: the run has commits since {what} (it re-judged {s.tip[:12]}, the tip is "
                            f"{tip[:12]}); start a new re-judging (without --resume)")
    if now != s.now:
        raise ProgressError(f"{what} ran on {_where(s.now)}; this is {_where(now)}: start a new re-judging (without --resume)")
    if config_changes != s.config_changes:
        differ = sorted(set(config_changes) ^ set(s.config_changes)) or ["their order"]
        raise ProgressError(f"the harness settings differ from those {what} ran with ({differ[0]}); restore them or "
                            "start a new re-judging (without --resume)")
    return s.until, s.only


def _where(now: dict[str, str]) -> str:
    return f"{now['device']} ({now['gpu']}), kevo {now['kevo_commit']}"


def _mismatch(flag: str, given: str, kept: str | None, what: str) -> str:
    return f"{flag} {given}: {what} ran {f'with {flag} {kept}' if kept else f'without {flag}'}; give the same or leave it out"


def finish(root: Path, done: Rejudging, receipts: Path) -> None:
    """Delete the unfinished ref of a re-judging now committed in full (nothing if it had none), and its receipt."""
    repo = open_repo(root)
    for ref, sha in _refs(repo).items():
        try:
            state = Unfinished.model_validate_json((repo.commit(sha).tree / FILE).data_stream.read())
        except (KeyError, ValueError, ValidationError):
            continue
        if (state.run, state.at) == (done.run, done.at):
            try:
                repo.git.update_ref("-d", ref, sha)
            except git.GitCommandError:             # moved meanwhile: another process continues it, and keeps it
                continue
            _drop(receipts, sha)
