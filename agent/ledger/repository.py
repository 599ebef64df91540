"""The run's ledger: a git repository in runs/<run-id>/, written with gitpython.

First commit: run.json (the run's header), config.yaml (the config in force), environment.json,
profile.json (the baseline profile), replay.json (the baseline replay, or why there is none) and
heads/ (the kernels the run starts from, with their verdicts). Then one commit per candidate,
whatever became of it, under candidates/<id>/: record.json (claim, every round's source and
verdict with all stage metrics, conclusion, cost), candidate.py, README.md (for people) and
exchanges.jsonl (every LLM call: prompts, replies, tokens, cost); what each commit says (subject, body,
trailers, that README) is agent/ledger/messages.py. Tags:
best-<op> (the best so far; the head until a candidate beats it) and head-<op>. summary.json is
rewritten in every commit; settings.json holds the settings in force (rewritten by each resume).
An LLM's proposal is committed before it is evaluated (candidates/<id>/proposal.json, subject
`propose <id> [<op>]: <change>`, trailer `Proposal`), so a run killed mid-evaluation evaluates it when resumed
(`pending()`) instead of losing or buying it again. Each paid LLM exchange is committed as soon as it is
answered (candidates/<id>/exchanges.jsonl, subject `paid <id> ...`), so one answered before a fatal
failure or a kill is kept and a resumed run takes it from there (`unjudged_exchanges()`). Every text is redacted of secret-looking
environment values before it is written. `history()` reads the candidates back, so a run can be
resumed from its ledger alone; a `pinned` Ledger reads the tip it was opened at throughout (re-judging a run).
`commit_beside()` writes a commit from objects only, on no branch the run moves (re-judging's `replay/` branch
and its saves, agent/rejudging/): the run's branch, index and working tree are left as they were.

Crash consistency: a commit is the unit of record. Files are written, then committed through the repository
as agent/ledger/store.py opens it, so a SIGKILL at any moment leaves the last commit whole, plus perhaps stale
lock and temporary files, unreferenced whole objects and uncommitted files. `recover()` (by the holder of the
run's lock, agent/run/session.py) removes those and resets the working tree to the last commit; reading is
always from committed state. A power cut is another matter: nothing here calls fsync.
Not here: deciding anything (loop), the run folder's lock (session), the words of a commit (messages).
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path

import git
from git.index.typ import BaseIndexEntry, IndexEntry
from gitdb.base import IStream
from pydantic import ValidationError

from harness.sandbox import redact

from agent.ledger import messages
from agent.ledger import LedgerError
from agent.ledger.store import folder_state, init_repo, open_repo, write_inside
from agent.records import CandidateRecord, Exchange, Kernel, Profile, Proposal, RunHeader
from agent.text import printable
from agent.run.session import LOCK_NAME

AUTHOR = git.Actor("kevo", "kevo@localhost")


def _finite(obj):
    """`obj` with every float that is not finite replaced by None: the ledger never holds NaN or Inf."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json(obj) -> str:
    return json.dumps(_finite(obj), indent=1, allow_nan=False)


def id_number(cid: str) -> int:
    """c007 -> 7; candidates sort by number (c1000 after c999), anything else first."""
    return int(cid[1:]) if cid[:1] == "c" and cid[1:].isdigit() else -1


def _as_read(rel: str, text: str) -> str:
    """A file as committed: what people read (a .md) with its control characters written as \\xNN."""
    return printable(text) if rel.endswith(".md") else text


def exchange_text(exchanges: list[Exchange]) -> str:
    """An exchanges.jsonl: one JSON record a line."""
    return "".join(e.model_dump_json() + "\n" for e in exchanges)


def exchange_lines(text: str) -> list[Exchange]:
    """An exchanges.jsonl's records (`exchange_text`). Split at "\n" only: a reply's U+2028 or U+0085 is written raw
    inside its JSON string, and `str.splitlines` would cut the record there (the ledger then unreadable)."""
    return [Exchange.model_validate_json(line) for line in text.split("\n") if line.strip()]


class Ledger:
    """The one reader and writer of a run's repository. Reads are of the last commit, or, `pinned`, of the tip
    when it was opened (re-judging a run reads one commit throughout, whatever a resumed run commits meanwhile)."""

    def __init__(self, root: Path, pinned: bool = False) -> None:
        self.root = root
        self._pin: git.Commit | None = None
        try:
            self.repo = open_repo(root)
        except (git.exc.InvalidGitRepositoryError, git.exc.NoSuchPathError):
            raise LedgerError(f"{root} is not a run ledger (no git repository)") from None
        if pinned:
            try:
                self._pin = self.repo.head.commit
            except ValueError:
                raise LedgerError(f"{root}: the run has no commit yet") from None

    @property
    def tip(self) -> git.Commit:
        """The commit every read is of."""
        return self._pin if self._pin is not None else self.repo.head.commit

    @property
    def first(self) -> git.Commit:
        """The run's first commit: its config, environment and the heads it started from."""
        return next(self.repo.iter_commits(self.tip, max_parents=0))

    def recover(self) -> list[str]:
        """The working tree as the last commit again, after a run was killed: stale git lock files and
        object temp files removed, files written but never committed discarded (their paths returned).
        Only the holder of the run's lock may call this: it assumes no one else writes."""
        gitdir = self.root / ".git"
        for p in gitdir.rglob("*.lock"):
            p.unlink(missing_ok=True)
        for p in (gitdir / "objects").glob("obj*"):     # gitdb writes objects to obj* files, then renames them
            if p.is_file():
                p.unlink()
        self.exclude(LOCK_NAME)
        try:
            changed = [line[3:] for line in self.repo.git.status("--porcelain", "--untracked-files=all").splitlines()]
        except git.exc.GitCommandError:                  # an unreadable index: rebuilt from the last commit
            (gitdir / "index").unlink(missing_ok=True)
            changed = ["(the git index)"]
        if changed:
            self.repo.git.reset("--hard", "--quiet", "HEAD")
            self.repo.git.clean("-fdq")
        return changed

    def exclude(self, pattern: str) -> None:
        """Keep files matching `pattern` out of the ledger for good (its .git/info/exclude)."""
        exclude = self.root / ".git" / "info" / "exclude"
        text = exclude.read_text() if exclude.is_file() and not exclude.is_symlink() else ""
        if pattern not in text.splitlines():
            write_inside(self.root, ".git/info/exclude",
                         (text + ("" if not text or text.endswith("\n") else "\n") + pattern + "\n").encode())

    # -- writing ----------------------------------------------------------------------------------

    @classmethod
    def create(cls, root: Path, header: RunHeader, config_yaml: str, environment: dict, profile: Profile,
               replay: dict, heads: dict[str, Kernel], summary: dict, settings: str | None = None) -> "Ledger":
        if folder_state(root) != "new":
            raise LedgerError(f"{root} already exists; give another --run-id (the same one resumes a kevo run)")
        root.mkdir(parents=True, exist_ok=True)
        init_repo(root)
        ledger = cls(root)
        ledger.exclude(LOCK_NAME)
        files = {"run.json": header.model_dump_json(indent=1), "config.yaml": config_yaml,
                 "environment.json": _json(environment), "profile.json": profile.model_dump_json(indent=1),
                 "replay.json": _json(replay), "summary.json": _json(summary),
                 "README.md": f"# kevo run {header.id}\n\n`git log` is this run's history: one commit per candidate, "
                              "rejections included. See candidates/<id>/README.md for each.\n"}
        if settings is not None:
            files["settings.json"] = settings
        for op, k in heads.items():
            files[f"heads/{op}.py"] = k.source
            files[f"heads/{op}.json"] = k.model_dump_json(indent=1, exclude={"source"})
        sha = ledger.commit(f"start {header.id}: heads evaluated, baseline profile recorded",
                            messages.start_body(header, profile, replay, heads), files,
                            {"Run": header.id, "Target": header.target, "Proposer": header.provider})
        for op in heads:
            ledger.tag(f"head-{op}", sha)
            ledger.tag(f"best-{op}", sha)
        return ledger

    def write(self, rel: str, text: str) -> None:
        """root/rel written (through no symbolic link, never outside the run folder: store.write_inside)."""
        if rel.endswith(".json"):                       # whoever made it: no NaN or Infinity reaches the ledger
            obj = json.loads(text)
            if _finite(obj) != obj:                    # NaN != NaN, and Inf becomes None
                text = _json(obj)
        write_inside(self.root, rel, redact(text).encode())

    def commit(self, subject: str, body: list[str], files: dict[str, str], trailers: dict[str, object]) -> str:
        for rel, text in files.items():
            self.write(rel, _as_read(rel, text))
        self.repo.index.add(list(files))
        message = printable(redact(subject + "\n\n" + "\n\n".join(b for b in body if b) + "\n\n"
                                   + messages.trailers(trailers) + "\n"))
        return self.repo.index.commit(message, author=AUTHOR, committer=AUTHOR, skip_hooks=True).hexsha

    def commit_beside(self, files: dict[str, str], subject: str, body: str, trailers: dict[str, object] | None = None,
                      base: git.Commit | None = None, parent: git.Commit | None = None) -> git.Commit:
        """A commit of `base`'s tree (default: the tip's) with `files` (redacted) added, on `parent` (default:
        `base`), written as objects only: no ref moves, and the run's branch, .git/index and working tree are
        not touched (the index is in memory). For what is kept beside the run (re-judging it), never the
        run's own history; the caller names the ref."""
        base = base or self.tip
        index = git.IndexFile.new(self.repo, base.tree)
        for rel, text in files.items():
            data = redact(_as_read(rel, text)).encode()
            blob = self.repo.odb.store(IStream("blob", len(data), io.BytesIO(data)))
            index.entries[(rel, 0)] = IndexEntry.from_base(BaseIndexEntry((0o100644, blob.binsha, 0, rel)))
        message = subject + "\n\n" + body.rstrip("\n") + ("\n\n" + messages.trailers(trailers) if trailers else "") + "\n"
        return git.Commit.create_from_tree(self.repo, index.write_tree(), printable(redact(message)),
                                           parent_commits=[parent or base], head=False, author=AUTHOR, committer=AUTHOR)

    def tag(self, name: str, sha: str) -> None:
        self.repo.create_tag(name, ref=sha, force=True)

    def commit_proposal(self, proposal: Proposal, summary: dict) -> str:
        """An LLM's proposal, before its verdict: if the run dies now, the resumed run evaluates it (or, one
        that is malformed or not worth coding, records it as such)."""
        d = f"candidates/{proposal.id}"
        if self.committed(f"{d}/proposal.json") is not None or self.committed(f"{d}/record.json") is not None:
            raise LedgerError(f"{proposal.id} is already in the ledger; a candidate id is never reused")
        return self.commit(messages.proposal_subject(proposal), messages.proposal_body(proposal),
                           {f"{d}/proposal.json": proposal.model_dump_json(indent=1), "summary.json": _json(summary)},
                           messages.proposal_trailers(proposal))

    def commit_candidate(self, record: CandidateRecord, exchanges: list[Exchange], summary: dict,
                         new_best: bool, files: dict[str, str] | None = None,
                         trailers: dict[str, object] | None = None) -> str:
        """The candidate's verdict, under `subject(record)`; `files` and `trailers` add to it (an accepted
        kernel's new head and profile, a health check), so everything one candidate changes is one commit."""
        d = f"candidates/{record.id}"
        if self.committed(f"{d}/record.json") is not None:
            raise LedgerError(f"{record.id} already has a verdict in the ledger; a candidate is evaluated once")
        files = {**(files or {}), f"{d}/record.json": record.model_dump_json(indent=1),
                 f"{d}/README.md": messages.readme(record), "summary.json": _json(summary)}
        if exchanges:
            files[f"{d}/exchanges.jsonl"] = exchange_text(exchanges)
        for i, rnd in enumerate(record.rounds):
            files[f"{d}/candidate.py" if i == len(record.rounds) - 1 else f"{d}/round{i}.py"] = rnd.source
        if new_best:
            files[f"best/{record.op}.py"] = record.source or ""
        sha = self.commit(messages.subject(record), messages.candidate_body(record), files,
                          messages.candidate_trailers(record, trailers))
        if new_best:
            self.tag(f"best-{record.op}", sha)
        if record.outcome == "accepted":
            self.tag(f"head-{record.op}", sha)
        return sha

    # -- reading: always the last commit, never the working tree (a live run may be writing it) -----

    def committed(self, rel: str, commit: git.Commit | None = None) -> str | None:
        """A file as the last commit (or `commit`) holds it, or None."""
        try:
            return ((commit or self.tip).tree / rel).data_stream.read().decode()
        except (KeyError, ValueError):
            return None

    def read(self, rel: str, commit: git.Commit | None = None) -> str:
        """A committed file that a kevo run always has; LedgerError when it is not there."""
        text = self.committed(rel, commit)
        if text is None:
            raise LedgerError(f"{self.root}: no {rel}; not a kevo run ledger")
        return text

    def _load(self, model, rel: str, text: str | None = None):
        try:
            record = model.model_validate_json(self.read(rel) if text is None else text)
        except ValidationError as e:
            err = e.errors()[0]
            raise LedgerError(f"{self.root}/{rel} cannot be read by this kevo "
                              f"({'.'.join(map(str, err['loc']))}: {err['msg']})") from None
        folder = rel.split("/")[1] if rel.startswith("candidates/") else None
        if folder is not None and getattr(record, "id", folder) != folder:     # the id names the folder it is in
            raise LedgerError(f"{self.root}/{rel} says it is {record.id!r}: a record is its folder's candidate")
        return record

    def _each(self, folder: str, name: str) -> dict[str, str]:
        """{subfolder: the text of its `name`} for every subfolder of `folder` that has one committed."""
        try:
            tree = self.tip.tree / folder
        except (KeyError, ValueError):
            return {}
        out = {}
        for sub in tree.trees:
            try:
                out[sub.name] = (sub / name).data_stream.read().decode()
            except KeyError:
                pass
        return out

    def header(self) -> RunHeader:
        return self._load(RunHeader, "run.json")

    def profile(self) -> Profile:
        return Profile.model_validate_json(self.read("profile.json"))

    def summary(self) -> dict:
        return json.loads(self.read("summary.json"))

    def heads(self, at_start: bool = False) -> dict[str, Kernel]:
        """The heads now (an accepted candidate moves its op's), or, `at_start`, those the run started from,
        with their verdicts then (its first commit)."""
        commit = self.first if at_start else self.tip
        try:
            blobs = (commit.tree / "heads").blobs
        except KeyError:
            raise LedgerError(f"{self.root}: no heads/ committed; not a kevo run ledger") from None
        heads = {}
        for blob in sorted(blobs, key=lambda b: b.name):
            if blob.name.endswith(".json"):
                rel = f"heads/{blob.name}"
                try:
                    data = json.loads(blob.data_stream.read().decode())
                    source = self.read(str(data["path"]), commit)
                except (ValueError, KeyError, TypeError):
                    raise LedgerError(f"{self.root}/{rel} cannot be read by this kevo (not a JSON object naming its "
                                      "kernel's path)") from None
                heads[blob.name[:-5]] = self._load(Kernel, rel, json.dumps({**data, "source": source}))
        return heads

    def history(self) -> list[CandidateRecord]:
        """Every candidate with a verdict committed, in id order (a proposal still waiting for one is not history)."""
        records = [self._load(CandidateRecord, f"candidates/{cid}/record.json", t)
                   for cid, t in self._each("candidates", "record.json").items()]
        return sorted(records, key=lambda r: (id_number(r.id), r.id))

    def exchanges(self) -> dict[str, list[Exchange]]:
        """The LLM exchanges of every candidate with a verdict: candidate id -> its exchanges, in order."""
        judged = self._each("candidates", "record.json")
        out = {}
        for cid, text in self._each("candidates", "exchanges.jsonl").items():
            if cid not in judged:
                continue
            try:
                out[cid] = exchange_lines(text)
            except ValidationError as e:
                raise LedgerError(f"{self.root}/candidates/{cid}/exchanges.jsonl cannot be read by this kevo "
                                  f"({e.errors()[0]['msg']})") from None
        return dict(sorted(out.items(), key=lambda kv: (id_number(kv[0]), kv[0])))

    def pending(self) -> list[Proposal]:
        """Proposals committed but never evaluated (the run was stopped in between), oldest first."""
        judged = self._each("candidates", "record.json")
        found = [self._load(Proposal, f"candidates/{cid}/proposal.json", t)
                 for cid, t in self._each("candidates", "proposal.json").items() if cid not in judged]
        return sorted(found, key=lambda p: (id_number(p.id), p.id))

    def unjudged_exchanges(self) -> dict[str, tuple[list[Exchange], Proposal | None]]:
        """Candidates without a verdict whose paid exchanges were committed as they were answered
        (candidates/<id>/exchanges.jsonl): their exchanges, and the proposal if one was committed."""
        judged = self._each("candidates", "record.json")
        proposals = self._each("candidates", "proposal.json")
        out = {}
        for cid, text in self._each("candidates", "exchanges.jsonl").items():
            if cid in judged:
                continue
            try:
                said = exchange_lines(text)
            except ValidationError as e:
                raise LedgerError(f"{self.root}/candidates/{cid}/exchanges.jsonl cannot be read by this kevo "
                                  f"({e.errors()[0]['msg']})") from None
            out[cid] = (said, self._load(Proposal, f"candidates/{cid}/proposal.json", proposals[cid])
                        if cid in proposals else None)
        return out

    def last_id(self) -> int:
        """The highest candidate number in the ledger (verdicts and proposals); new ids start above it."""
        try:
            return max((id_number(t.name) for t in (self.tip.tree / "candidates").trees), default=0)
        except (KeyError, ValueError):
            return 0

    def verdict_commits(self) -> dict[str, str]:
        """Candidate id -> the commit of its verdict (trailer `Candidate`)."""
        out = {}
        for line in self.repo.git.log("--format=%H %(trailers:key=Candidate,valueonly,separator=%x2C)").splitlines():
            sha, _, cid = line.partition(" ")
            if cid.strip():
                out.setdefault(cid.strip(), sha)
        return out

    def retag(self, best: dict[str, str], heads: dict[str, str]) -> None:
        """Point best-<op> and head-<op> at the commits of these kernels (a ref or `head:<op>`): a run killed
        between a commit and its tag gets the tag right when resumed."""
        first = self.repo.git.rev_list("--max-parents=0", "HEAD").split()[0]
        commits = self.verdict_commits()
        for prefix, refs in (("best", best), ("head", heads)):
            for op, ref in refs.items():
                self.tag(f"{prefix}-{op}", first if ref.startswith("head:") else commits.get(ref, first))
