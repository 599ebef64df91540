"""What a kernel's verdict says about its speed, as every view of a run reports it: per served shape and
for the served mix, kevo over the cuDNN anchor first (the library a user already has), kevo over the
torch baseline second; and, where nothing was timed (a CPU, or microbench not reached), which stages
passed and that nothing was timed or accepted.

The figures are read from microbench's metrics through its own reader (harness/stages/microbench.py
`case_figures`: each case's `candidate_ms`, `baseline_ms`, `anchor_ms`, `weight`, ... under its shape's key)
and the shape labels from its reason, both of the one record. `vs_cudnn` is the one
place the ratio to the anchor is computed. Not here: timing (harness), which kernel is best (state),
how a view lays the words out (view, report, loop).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from harness.records import Verdict
from harness.stages.microbench import case_figures
from harness.targets import TARGETS

NO_ANCHOR = "no cuDNN anchor timed"
CORRECTNESS = ("compile", "dispatch", "parity")


def _over(cases: list[dict], reference: str) -> float | None:
    """kevo over `reference` (anchor or baseline) on `cases`: Σw·reference_ms / Σw·candidate_ms, the way
    microbench weighs its served mix; None when a case lacks the reference's figure."""
    if not cases or any(reference + "_ms" not in c for c in cases):
        return None
    den = sum(c.get("weight", 1.0) * c["candidate_ms"] for c in cases)
    return sum(c.get("weight", 1.0) * c[reference + "_ms"] for c in cases) / den if den > 0 else None


def vs_cudnn(cases: list[dict]) -> float | None:
    """kevo / cuDNN over `cases` (one case: that shape's ratio; all of an op's: the served mix): the anchor's
    weighted time over the candidate's. None when any case has no anchor figure (not timed, or the anchor
    off): a mix with a shape missing is not the served mix."""
    return _over(cases, "anchor")


def microbench_cases(metrics: dict[str, float], reason: str, op: str) -> list[dict]:
    """Per served shape of `op` that microbench timed, in its order: the figures, the shape's `key` (None in a
    record an older kevo keyed by position) and the label the same record's reason gives it (`<label>: 1.23x
    (...)`, or `<label>: 1.23x by the clock, 1.25x by the events (...)` where the two protocols told apart; in the
    same order), else the key, else `<op> case <i>`."""
    labels = re.findall(rf"(?:^|; )({re.escape(op)} [^;]*?): \d+\.\d+x(?: \(| by the clock, )", reason)
    cases = []
    for i, (key, figures) in enumerate(case_figures(metrics, op)):
        if "candidate_ms" in figures:
            cases.append({**figures, "key": key,
                          "label": labels[i] if i < len(labels) else key or f"{op} case {i}"})
    return cases


@dataclass(frozen=True)
class Speed:
    """One kernel's speed as a run reports it: the served mix and each served shape, over cuDNN and torch."""
    op: str
    timed: bool                     # microbench measured it (on this machine, this verdict)
    mix_vs_cudnn: float | None
    mix_vs_torch: float | None
    shapes: tuple[tuple[str, float | None, float], ...] = ()   # (label, kevo/cuDNN or None, kevo/torch)
    why: str = ""                   # why it was not timed, when it was not

    def words(self) -> str:
        """'0.970x cuDNN, 1.320x torch' (served mix), or what stands in for a figure."""
        return speed_words(self.record())

    def per_shape(self) -> str:
        """'per served shape 0.962x, 0.991x cuDNN', in the stage's order ('' when not timed or no anchor)."""
        if not self.timed or all(v is None for _, v, _ in self.shapes):
            return ""
        return "per served shape " + ", ".join("n/a" if v is None else f"{v:.3f}x" for _, v, _ in self.shapes) + " cuDNN"

    def trailer(self) -> str:
        """The ledger trailer `Vs-cuDNN`: the served mix, then each served shape in the stage's order."""
        if self.mix_vs_cudnn is None:
            return NO_ANCHOR if self.timed else f"{NO_ANCHOR} (nothing timed)"
        per = ", ".join("n/a" if v is None else f"{v:.4f}" for _, v, _ in self.shapes)
        return f"{self.mix_vs_cudnn:.4f} (per served shape: {per})"

    def record(self) -> dict:
        """For summary.json: kevo/cuDNN first, then kevo/torch, per served shape by its label."""
        untimed = f" (nothing timed: {self.why})" if self.why else " (nothing timed)"
        return {"vs_cudnn": self.mix_vs_cudnn, "vs_cudnn_note": "" if self.mix_vs_cudnn is not None else
                NO_ANCHOR + ("" if self.timed else untimed),
                "vs_torch": self.mix_vs_torch,
                "shapes": [{"shape": label, "vs_cudnn": lib, "vs_torch": torch_} for label, lib, torch_ in self.shapes]}


def speed_words(best: dict) -> str:
    """Speed.words() of a kernel as summary.json holds it (`Speed.record()`): kevo/cuDNN, then kevo/torch."""
    lib = f"{best['vs_cudnn']:.3f}x cuDNN" if best.get("vs_cudnn") is not None else (best.get("vs_cudnn_note") or NO_ANCHOR)
    return f"{lib}, {best['vs_torch']:.3f}x torch" if best.get("vs_torch") is not None else lib


def speed(verdict: Verdict | None, op: str) -> Speed:
    """The speed a verdict measured for `op`'s kernel; `timed` False (with the skip's reason) where none."""
    bench = next((s for s in verdict.stages if s.name == "microbench"), None) if verdict else None
    cases = microbench_cases(bench.metrics, bench.reason, op) if bench is not None else []
    if not cases:
        why = (" ".join(bench.reason.removeprefix("skipped:").split()).split(";")[0] if bench is not None
               else "microbench not reached" if verdict else "not evaluated")
        return Speed(op=op, timed=False, mix_vs_cudnn=None, mix_vs_torch=None, why=why[:80])
    shapes = tuple((c["label"], vs_cudnn([c]), _over([c], "baseline")) for c in cases)
    return Speed(op=op, timed=True, mix_vs_cudnn=vs_cudnn(cases), mix_vs_torch=_over(cases, "baseline"),
                 shapes=shapes)


def _timed(stage) -> bool:
    """A stage that timed something: microbench or the replay, run, and not the replay's gates alone (a CPU)."""
    return stage.status != "skipped" and stage.metrics.get("timed", 1.0) != 0.0


def untimed_pass(verdict: Verdict | None) -> bool:
    """Passed every stage that ran, and none of those that time (microbench, replay) timed: correct, not fast."""
    if verdict is None or not verdict.ok:
        return False
    return not any(_timed(s) for s in verdict.stages if s.name not in CORRECTNESS)


def nothing_timed(verdicts: list[Verdict | None]) -> bool:
    """No stage that times (microbench, replay) timed anything in any of these verdicts (a CPU run), and some exist."""
    stages = [s for v in verdicts if v is not None for s in v.stages if s.name not in CORRECTNESS]
    return any(s.name == "microbench" for s in stages) and not any(_timed(s) for s in stages)


def untimed_words(passed: int) -> str:
    """What 'passed N' means on a machine that timed nothing."""
    return (f"{passed} candidate(s) passed the correctness stages only: nothing was timed or accepted here "
            "(microbench and the replay's timing need CUDA)")


def outcome_words(outcome: str, stage: str, verdict: Verdict | None) -> str:
    """'passed at replay' as a person should read it: on a machine that timed nothing, a pass is a pass of
    the correctness stages only."""
    if outcome == "passed" and untimed_pass(verdict):
        ran = [s.name if _timed(s) or s.name in CORRECTNESS else f"the {s.name}'s gates" for s in verdict.stages
               if s.status == "passed"]
        skipped = [s.name for s in verdict.stages if s.status == "skipped"]
        return (f"passed the correctness stages ({', '.join(ran)}); not timed, not accepted"
                + (f" ({', '.join(skipped)} skipped)" if skipped else ""))
    return f"{outcome} at {stage}"


def anchors_text(heads: dict, target: str, ops: list[str]) -> str:
    """The library to beat, per served shape, as the heads' microbench measured it: the cuDNN anchor's
    rate and the head's, with kevo/cuDNN. Lines for a prompt; where none was timed, it says so."""
    lines = []
    for op in ops:
        k = heads.get(op)
        bench = next((s for s in k.verdict.stages if s.name == "microbench"), None) if k is not None and k.verdict else None
        unit = TARGETS[target].ops[op].unit
        cases = microbench_cases(bench.metrics, bench.reason, op) if bench is not None and bench.metrics else []
        if not cases:
            lines.append(f"- {op}: {NO_ANCHOR} ({speed(k.verdict if k else None, op).why or 'no figures'})")
            continue
        for c in cases:
            lib = vs_cudnn([c])
            lines.append(f"- {c['label']} (weight {c.get('weight', float('nan')):.2f}): " + (
                f"cuDNN {c['anchor_rate']:.2f} {unit}, {k.ref} {c['candidate_rate']:.2f} {unit} = {lib:.3f}x cuDNN"
                if lib is not None and "anchor_rate" in c else f"{NO_ANCHOR}; {k.ref} {c['candidate_rate']:.2f} {unit}")
                + f", torch {c['baseline_rate']:.2f} {unit}")
    return "\n".join(lines)
