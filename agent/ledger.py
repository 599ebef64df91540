"""The run's ledger: a git repository in runs/<run-id>/, written with gitpython.

First commit: run.json (the run's header), config.yaml (the config in force), environment.json,
profile.json (the baseline profile), replay.json (the baseline replay, or why there is none) and
heads/ (the kernels the run starts from, with their verdicts). Then one commit per candidate,
whatever became of it, under candidates/<id>/: record.json (claim, every round's source and
verdict with all stage metrics, conclusion, cost), candidate.py, README.md (for people) and
exchanges.jsonl (every LLM call: prompts, replies, tokens, cost). The subject reads
`<verdict> <candidate> at <stage>: <conclusion>`; trailers carry the fields for machines. Tags:
best-<op> (the best so far; the head until a candidate beats it) and head-<op>. summary.json is
rewritten in every commit. Every text is redacted of secret-looking environment values before it is
written. `history()` reads the candidates back, so a run can be resumed from its ledger alone.
Not here: deciding anything (loop).
"""
from __future__ import annotations

import json
from pathlib import Path

import git

from harness.sandbox import redact

from agent.records import CandidateRecord, Exchange, Kernel, Profile, RunHeader

AUTHOR = git.Actor("kevo", "kevo@localhost")


class LedgerError(Exception):
    """The ledger cannot be created or read; one line."""


def _trailers(fields: dict[str, object]) -> str:
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None else format(x, fmt)


class Ledger:
    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            self.repo = git.Repo(root)
        except (git.exc.InvalidGitRepositoryError, git.exc.NoSuchPathError):
            raise LedgerError(f"{root} is not a run ledger (no git repository)") from None
        stale = root / ".git" / "index.lock"      # left by a run killed mid-commit; kevo is the only writer
        if stale.exists():
            stale.unlink()

    # -- writing ----------------------------------------------------------------------------------

    @classmethod
    def create(cls, root: Path, header: RunHeader, config_yaml: str, environment: dict, profile: Profile,
               replay: dict, heads: dict[str, Kernel], summary: dict) -> "Ledger":
        if root.exists() and any(root.iterdir()):
            raise LedgerError(f"{root} already exists; give another --run-id (the same one resumes a kevo run)")
        root.mkdir(parents=True, exist_ok=True)
        git.Repo.init(root)
        ledger = cls(root)
        files = {"run.json": header.model_dump_json(indent=1), "config.yaml": config_yaml,
                 "environment.json": json.dumps(environment, indent=1), "profile.json": profile.model_dump_json(indent=1),
                 "replay.json": json.dumps(replay, indent=1), "summary.json": json.dumps(summary, indent=1),
                 "README.md": f"# kevo run {header.id}\n\n`git log` is this run's history: one commit per candidate, "
                              "rejections included. See candidates/<id>/README.md for each.\n"}
        for op, k in heads.items():
            files[f"heads/{op}.py"] = k.source
            files[f"heads/{op}.json"] = k.model_dump_json(indent=1, exclude={"source"})
        body = [f"target {header.target}, ops {', '.join(header.ops)}, proposer {header.provider}, on {header.device} "
                f"({header.arch}); budget {header.budget_minutes:g} min", profile.note,
                f"baseline replay: {replay['note']}"]
        body += [f"{op} head: {k.verdict.reason if k.verdict else 'not evaluated'}" for op, k in heads.items()]
        sha = ledger.commit(f"start {header.id}: heads evaluated, baseline profile recorded", body, files,
                            {"Run": header.id, "Target": header.target, "Proposer": header.provider})
        for op in heads:
            ledger.tag(f"head-{op}", sha)
            ledger.tag(f"best-{op}", sha)
        return ledger

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(redact(text))

    def commit(self, subject: str, body: list[str], files: dict[str, str], trailers: dict[str, object]) -> str:
        for rel, text in files.items():
            self.write(rel, text)
        self.repo.index.add(list(files))
        message = redact(subject + "\n\n" + "\n\n".join(b for b in body if b) + "\n\n" + _trailers(trailers) + "\n")
        return self.repo.index.commit(message, author=AUTHOR, committer=AUTHOR).hexsha

    def tag(self, name: str, sha: str) -> None:
        self.repo.create_tag(name, ref=sha, force=True)

    def commit_candidate(self, record: CandidateRecord, exchanges: list[Exchange], subject: str, summary: dict,
                         new_best: bool) -> str:
        d = f"candidates/{record.id}"
        files = {f"{d}/record.json": record.model_dump_json(indent=1), f"{d}/README.md": self._readme(record),
                 "summary.json": json.dumps(summary, indent=1)}
        if exchanges:
            files[f"{d}/exchanges.jsonl"] = "".join(e.model_dump_json() + "\n" for e in exchanges)
        for i, rnd in enumerate(record.rounds):
            files[f"{d}/candidate.py" if i == len(record.rounds) - 1 else f"{d}/round{i}.py"] = rnd.source
        if new_best:
            files[f"best/{record.op}.py"] = record.source or ""
        c = record.claim
        body = [f"claim: {c.hypothesis}\npredicted s {c.expected_speedup:.3f} on f {c.op_share:.2f} "
                f"({c.share_source}) -> ceiling {c.ceiling:.4f}; kill test at {c.kill_test.stage}: "
                f"{c.kill_test.observation}" if c else "",
                f"{'verdict' if record.rounds else 'not evaluated'}: {record.reason[:1200]}",
                f"conclusion: {record.conclusion.learned}"]
        sha = self.commit(subject, body, files, {
            "Candidate": record.id, "Parent": record.parent or "n/a", "Op": record.op, "Stage": record.stage,
            "Verdict": record.outcome, "Speedup": _num(record.speedup), "Local-Speedup": _num(record.local_speedup),
            "Predicted": _num(c.expected_speedup if c else None), "Ceiling": _num(c.ceiling if c else None),
            "Rounds": len(record.rounds), "Cost": f"{record.cost_usd:.6f}"})
        if new_best:
            self.tag(f"best-{record.op}", sha)
        if record.outcome == "accepted":
            self.tag(f"head-{record.op}", sha)
        return sha

    @staticmethod
    def _readme(r: CandidateRecord) -> str:
        lines = [f"# {r.id}: {r.outcome} at {r.stage}", "", f"op {r.op}, parent {r.parent or 'n/a'}, proposer {r.proposer}", ""]
        if r.claim:
            c = r.claim
            lines += ["## Claim", "", c.hypothesis, "", "Evidence:", *[f"- {e}" for e in c.evidence], "",
                      f"Expected local speedup s = {c.expected_speedup:.3f}; op share f = {c.op_share:.2f} "
                      f"({c.share_source}); ceiling 1/(1-f+f/s) = {c.ceiling:.4f} (computed by kevo).", "",
                      "Risks:", *[f"- {x}" for x in c.risks], "",
                      f"Kill test ({c.kill_test.stage}): {c.kill_test.observation}", ""]
        for i, rnd in enumerate(r.rounds):
            lines += [f"## Verdict{f' (round {i})' if len(r.rounds) > 1 else ''}", "", "| stage | status | s | reason |",
                      "|---|---|---|---|"]
            lines += [f"| {s.name} | {s.status} | {s.seconds:.2f} | {' '.join(s.reason.split())[:300]} |"
                      for s in rnd.verdict.stages] + [""]
        if not r.rounds:
            lines += ["## Not evaluated", "", r.reason, ""]
        lines += ["## Conclusion", "", r.conclusion.learned, "",
                  f"Cost: ${r.cost_usd:.4f} ({r.input_tokens} input, {r.output_tokens} output tokens)."]
        return "\n".join(lines) + "\n"

    # -- reading ----------------------------------------------------------------------------------

    def header(self) -> RunHeader:
        try:
            return RunHeader.model_validate_json((self.root / "run.json").read_text())
        except FileNotFoundError:
            raise LedgerError(f"{self.root}: no run.json; not a kevo run ledger") from None

    def profile(self) -> Profile:
        return Profile.model_validate_json((self.root / "profile.json").read_text())

    def summary(self) -> dict:
        return json.loads((self.root / "summary.json").read_text())

    def heads(self) -> dict[str, Kernel]:
        heads = {}
        for meta in sorted((self.root / "heads").glob("*.json")):
            data = json.loads(meta.read_text())
            heads[meta.stem] = Kernel(**data, source=(self.root / data["path"]).read_text())
        return heads

    def history(self) -> list[CandidateRecord]:
        return [CandidateRecord.model_validate_json(p.read_text())
                for p in sorted((self.root / "candidates").glob("*/record.json"))]
