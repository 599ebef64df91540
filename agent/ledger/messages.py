"""What a run's commits say: subjects, bodies and trailers, and a candidate's README.md for people.

A subject says what was tried and what became of it in at most SUBJECT_CHARS (72) characters,
`c007 decode BLOCK_N 64 -> 128: rejected at parity` (`subject()`), so `git log --oneline` reads as the run's
history; a proposal's is `propose <id> [<op>]: <change>`. The body holds the claim, the verdict and the
conclusion; the trailers carry the fields for machines, and readers use those, never the subject.

Not here: writing or reading the repository (agent/ledger/repository.py: files, commits, tags, redaction,
read-back), what the files under candidates/<id>/ hold (agent/records.py).
"""
from __future__ import annotations

import math
import re

from agent.records import CandidateRecord, Claim, Kernel, Profile, Proposal, RunHeader

SUBJECT_CHARS = 72                     # git's convention: a subject that `git log --oneline` shows whole


def fit(text: str, n: int) -> str:
    """`text` on one line, cut to `n` characters with an ellipsis when longer."""
    line = " ".join(text.split())
    return line if len(line) <= n else line[: max(n - 1, 0)].rstrip() + "…"


def fit_subject(text: str) -> str:
    """Any commit subject of a run, on one line in SUBJECT_CHARS at most (the candidates' are built to fit)."""
    return fit(text, SUBJECT_CHARS)


def change_of(claim: Claim | None, op: str) -> str:
    """What a candidate tried, in a few words: its hypothesis up to the first ': ' or '; ' (the why follows
    there), without what the subject says already ('in the decode kernel', '(from c003)')."""
    if claim is None:
        return "(no claim)"
    text = " ".join(claim.hypothesis.split())
    for stop in (": ", "; ", " - ", " — "):
        text = text.split(stop)[0]
    text = re.sub(rf"\s+in the {re.escape(op)} kernel\b", "", text)
    return re.sub(r"\s*\(from [^)]*\)", "", text).strip() or "(no claim)"


def subject(record: CandidateRecord) -> str:
    """A verdict commit's subject: id, op and the change first, the verdict last, in SUBJECT_CHARS at most —
    `c007 decode BLOCK_N 64 -> 128: rejected at parity`."""
    head, verdict = f"{record.id} {record.op} ", f": {record.outcome} at {record.stage}"
    room = SUBJECT_CHARS - len(head) - len(verdict)
    if room < 8:                                          # an id, op or stage so long the change cannot show
        return fit(f"{record.id} {record.op}{verdict}", SUBJECT_CHARS)
    return head + fit(change_of(record.claim, record.op), room) + verdict


def trailers(fields: dict[str, object]) -> str:
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


def num(x: float | None, fmt: str = ".4f") -> str:
    """A trailer's number; `n/a` for none or one that is not finite."""
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def start_body(header: RunHeader, profile: Profile, replay: dict, heads: dict[str, Kernel]) -> list[str]:
    """The first commit's body: the run's settings, the profile's note, the baseline replay, each head's verdict."""
    return [f"target {header.target}, ops {', '.join(header.ops)}, proposer {header.provider}, on {header.device} "
            f"({header.arch}); budget {header.budget_minutes:g} min", profile.note,
            f"baseline replay: {replay['note']}",
            *[f"{op} head: {k.verdict.reason if k.verdict else 'not evaluated'}" for op, k in heads.items()]]


def proposal_subject(proposal: Proposal) -> str:
    head = f"propose {proposal.id} [{proposal.op}]: "
    change = change_of(proposal.claim, proposal.op) if proposal.claim else proposal.outcome
    return head + fit(change, max(SUBJECT_CHARS - len(head), 8))


def proposal_body(proposal: Proposal) -> list[str]:
    c = proposal.claim
    return [f"claim: {c.hypothesis}\npredicted s {c.expected_speedup:.3f}, ceiling {c.ceiling:.4f}" if c else "",
            "evaluated next; a run stopped before its verdict evaluates it when resumed" if proposal.outcome == "ready"
            else f"not to be evaluated ({proposal.outcome} at {proposal.stage}); its verdict commit follows"]


def proposal_trailers(proposal: Proposal) -> dict[str, object]:
    return {"Proposal": proposal.id, "Op": proposal.op, "Parent": proposal.parent or "n/a",
            "Cost": f"{sum(e.cost_usd for e in proposal.exchanges):.6f}"}


def candidate_body(record: CandidateRecord) -> list[str]:
    c = record.claim
    return [f"claim: {c.hypothesis}\npredicted s {c.expected_speedup:.3f} on f {c.op_share:.2f} "
            f"({c.share_source}) -> ceiling {c.ceiling:.4f}; kill test at {c.kill_test.stage}: "
            f"{c.kill_test.observation}" if c else "",
            f"{'verdict' if record.rounds else 'not evaluated'}: {record.reason[:1200]}",
            f"conclusion: {record.conclusion.learned}"]


def candidate_trailers(record: CandidateRecord, extra: dict[str, object] | None = None) -> dict[str, object]:
    """The verdict's trailers, the speed against the library (`Vs-cuDNN`, in `extra` when timed) first among
    the figures, before the speed over torch; the rest of `extra` after them."""
    c = record.claim
    extra = dict(extra or {})
    library = {"Vs-cuDNN": extra.pop("Vs-cuDNN")} if "Vs-cuDNN" in extra else {}
    return {"Candidate": record.id, "Parent": record.parent or "n/a", "Op": record.op, "Stage": record.stage,
            "Verdict": record.outcome, **library, "Speedup": num(record.speedup), "Local-Speedup": num(record.local_speedup),
            "Predicted": num(c.expected_speedup if c else None), "Ceiling": num(c.ceiling if c else None),
            "Rounds": len(record.rounds), "Cost": f"{record.cost_usd:.6f}", **extra}


def _inline(text: str) -> str:
    """Text from outside kevo (a model's claim, a candidate's error) as markdown that starts no block of its own and
    ends no table cell: one line, `<` and `&` as entities (no HTML, no comment hiding what follows), `|` escaped, a
    leading block marker escaped."""
    line = " ".join(text.split()).replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")
    return "\\" + line if line[:1] and line[0] in "#>-+*=_`~" else line


def readme(r: CandidateRecord) -> str:
    """candidates/<id>/README.md: the claim, each round's verdict as a table (a failure's kind beside its status),
    the conclusion and the cost. What a model or a candidate wrote is inline text (`_inline`): it cannot forge a
    section, a table row or a comment that hides the verdict."""
    lines = [f"# {r.id}: {r.outcome} at {r.stage}", "", f"op {r.op}, parent {r.parent or 'n/a'}, proposer {r.proposer}", ""]
    if r.claim:
        c = r.claim
        lines += ["## Claim", "", _inline(c.hypothesis), "", "Evidence:", *[f"- {_inline(e)}" for e in c.evidence], "",
                  f"Expected local speedup s = {c.expected_speedup:.3f}; op share f = {c.op_share:.2f} "
                  f"({_inline(c.share_source)}); ceiling 1/(1-f+f/s) = {c.ceiling:.4f} (computed by kevo).", "",
                  "Risks:", *[f"- {_inline(x)}" for x in c.risks], "",
                  f"Kill test ({c.kill_test.stage}): {_inline(c.kill_test.observation)}", ""]
    for i, rnd in enumerate(r.rounds):
        about = ", ".join([f"round {i}"] * (len(r.rounds) > 1) + [f"against {rnd.against}"] * bool(rnd.against))
        lines += [f"## Verdict{f' ({about})' if about else ''}", "",
                  *([f"Judged again: {_inline(rnd.again)}.", ""] if rnd.again else []), "| stage | status | s | reason |",
                  "|---|---|---|---|"]
        lines += [f"| {s.name} | {s.status}{f' ({s.failure})' if s.failure else ''} | {s.seconds:.2f} | "
                  f"{_inline(s.reason[:300])} |"
                  for s in rnd.verdict.stages] + [""]
    if not r.rounds:
        lines += ["## Not evaluated", "", _inline(r.reason), ""]
    lines += ["## Conclusion", "", _inline(r.conclusion.learned), "",
              f"Cost: ${r.cost_usd:.4f} ({r.input_tokens} input, {r.output_tokens} output tokens)."]
    return "\n".join(lines) + "\n"
