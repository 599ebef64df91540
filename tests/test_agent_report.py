"""Reading a run: `kevo-agent ledger` lists one row per candidate (claim, stage reached, verdict,
predicted against observed speedup, conclusion, cost) from the ledger's files, and `kevo-agent report`
writes one self-contained HTML page — plots, the best kernel with its figures, or on a CPU run the
stages that did not run — that a real headless browser renders. The ledgers are written through the
real Ledger API with real records, as a GPU run and a CPU run would leave them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import datetime, timedelta
from html.parser import HTMLParser

import matplotlib.image
import pytest
import yaml

from conftest import ROOT, config_with
from harness.records import StageResult, Verdict
from harness.stages.microbench import figure_metric
from harness.targets import Case

from agent.cli import main
from agent.roles.conclusion import conclude, outcome_of, speedup_of
from agent.ledger.repository import Ledger
from agent.run.ending import funnel
from agent.records import (CandidateRecord, Claim, Exchange, Kernel, KillTest, Message, OpEvidence, Profile, Round,
                           RunHeader)

T0 = datetime(2026, 11, 30, 9, 0, 0).astimezone()
def served(op: str, batch: int, lo: int, hi: int, weight: float) -> Case:
    """A served case as the attention target makes one (harness/targets/attention.py served_cases)."""
    return Case(op, f"{op} served: batch {batch}, lengths {lo}..{hi}, heads 32/8",
                {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 16, "batch": batch,
                 "length_range": (lo, hi), "size": batch * hi * 32}, weight=weight)


# Per op: each served case, with its torch baseline's and cuDNN anchor's times (ms).
SHAPES = {"decode": [(served("decode", 64, 1000, 32000, 0.7), 0.0310, 0.0260),
                     (served("decode", 8, 500, 4000, 0.3), 0.0122, 0.0101)],
          "prefill": [(served("prefill", 4, 512, 2048, 1.0), 0.210, 0.180)]}
CPU_SKIP = "skipped: needs CUDA; this machine has none, and no CPU figure stands in for a GPU speedup"


# -- ledgers as runs leave them ----------------------------------------------------------------------

def microbench(op: str, speedup: float) -> StageResult:
    """The microbench stage's result as harness/stages/microbench.py writes it: each case's figures under
    `figure_metric(case, figure)`, a line per case in its reason."""
    metrics, lines, num, den = {}, [], 0.0, 0.0
    for case, base_ms, anchor_ms in SHAPES[op]:
        cand_ms = base_ms / speedup
        row = {"candidate_ms": cand_ms, "baseline_ms": base_ms, "noise": 0.01, "speedup": speedup, "weight": case.weight,
               "anchor_ms": anchor_ms, "candidate_rate": 3.0 * speedup, "baseline_rate": 3.0, "anchor_rate": 3.5}
        metrics.update({figure_metric(case, k): v for k, v in row.items()})
        num, den = num + case.weight * base_ms, den + case.weight * cand_ms
        lines.append(f"{case.label}: {speedup:.2f}x ({cand_ms:.4f} vs {base_ms:.4f} ms; {3.0 * speedup:.2f} vs 3.00 TB/s, "
                     "cuDNN 3.50 TB/s)")
    metrics.update(speedup=num / den, noise=0.01, bar=1.03)
    summary = f"served mix {num / den:.2f}x (bar 1.03x); " + "; ".join(lines)
    if num / den <= 1.03:
        return StageResult(name="microbench", status="failed", seconds=21.0, metrics=metrics,
                           reason=f"not faster than the baseline beyond noise: {summary}")
    return StageResult(name="microbench", status="passed", seconds=20.0, metrics=metrics, reason=summary)


def verdict(op: str, fail: str | None = None, speedup: float | None = None, replay: str = "failed") -> Verdict:
    stages = []
    for name, secs in (("compile", 1.5), ("dispatch", 0.6), ("parity", 4.0)):
        stages.append(StageResult(name=name, status="failed" if name == fail else "passed", seconds=secs,
                                  reason=f"{name} rejected it: max abs error 0.37 at [0, 3]" if name == fail else "ok"))
        if name == fail:
            return Verdict.of(stages)
    if speedup is None:
        stages += [StageResult.skipped("microbench", CPU_SKIP), StageResult.skipped("replay", CPU_SKIP)]
        return Verdict.of(stages)
    stages.append(microbench(op, speedup))
    if stages[-1].status == "passed":
        stages.append(StageResult(name="replay", status=replay, seconds=90.0, reason=f"replay {replay}",
                                  metrics={"accepted": float(replay == "passed")}))
    return Verdict.of(stages)


def claim(op: str, s: float, kill: str = "microbench") -> Claim:
    return Claim(op=op, hypothesis=f"BLOCK_N 64 -> 128 in the {op} kernel: more bytes in flight per program",
                 evidence=[f"{op} share f = 0.35"], expected_speedup=s, risks=["register spills"],
                 kill_test=KillTest(stage=kill, observation="no gain over the parent"), op_share=0.35, share_source="stand-in")


def record(cid: str, op: str, minute: float, rounds: list[Verdict] = (), c: Claim | None = None, parent_speedup=None,
           cost: float = 0.0, outcome: str = "", stage: str = "", reason: str = "") -> CandidateRecord:
    rnds = [Round(source=f"# {cid} round {i}\ndef {op}(*args):\n    return None\n", verdict=v) for i, v in enumerate(rounds)]
    if rnds:
        outcome, stage = outcome_of(rnds[-1].verdict)
        reason = rnds[-1].verdict.reason
    speedup = speedup_of(rnds[-1].verdict) if rnds else None
    local = speedup / parent_speedup if speedup and parent_speedup else None
    return CandidateRecord(id=cid, op=op, parent=f"head:{op}", proposer="openai:gpt-test", outcome=outcome, stage=stage,
                           reason=reason, claim=c, rounds=rnds, speedup=speedup, local_speedup=local,
                           conclusion=conclude(c, outcome, stage, reason, rnds, f"head:{op}", local), cost_usd=cost,
                           input_tokens=int(cost * 1e5), output_tokens=int(cost * 2e4), seconds=60.0 if rnds else 0.0,
                           started=(T0 + timedelta(minutes=minute)).isoformat(timespec="seconds"))


def exchange(seconds: float, cost: float) -> Exchange:
    return Exchange(role="planner", purpose="claim", provider="openai", model="gpt-test", system="be brief",
                    messages=[Message(role="user", content="propose")], reply="a claim", input_tokens=900,
                    output_tokens=120, cost_usd=cost, seconds=seconds)


def write_ledger(root, device: str, records: list[CandidateRecord], heads: dict[str, Kernel]) -> Ledger:
    header = RunHeader(id=root.name, target="attention", provider="openai" if device == "cuda" else "offline",
                       planner_model="gpt-test" if device == "cuda" else "", coder_model="gpt-test" if device == "cuda" else "",
                       device=device, arch="sm90" if device == "cuda" else "cpu", ops=list(heads), budget_minutes=20,
                       max_candidates=None, max_cost_usd=1.0 if device == "cuda" else 0.0, started=T0.isoformat(timespec="seconds"),
                       kevo_commit="0123456789abcdef")
    profile = Profile(source="stand-in", note="stand-in", device=device, arch=header.arch,
                      ops={op: OpEvidence(share=0.35, lines=["f = 0.35"]) for op in heads})
    ledger = Ledger.create(root, header, "agent: {}\n", {"gpu": device}, profile, {"status": "not run", "note": "none"},
                           heads, {"candidates": 0})
    history, cost = [], 0.0
    for r in records:
        history.append(r)
        cost += r.cost_usd
        best = r.outcome in ("passed", "accepted") and r.speedup is not None and r.speedup > (heads[r.op].speedup or 0)
        summary = {"run": root.name, "candidates": len(history), "funnel": funnel(history), "cost_usd": round(cost, 6),
                   "input_tokens": sum(h.input_tokens for h in history), "output_tokens": sum(h.output_tokens for h in history),
                   "stopped": ""}
        ledger.commit_candidate(r, [exchange(12.0, r.cost_usd)] if r.cost_usd else [], summary, best)
        if r.outcome == "accepted":             # the loop moves the head (agent/run/loop.py Run.record)
            heads[r.op] = Kernel(ref=r.id, op=r.op, path=f"candidates/{r.id}/candidate.py", source=r.source,
                                 speedup=r.speedup, verdict=r.verdict)
            ledger.commit(f"head {r.op} <- {r.id}", [], {f"heads/{r.op}.json": heads[r.op].model_dump_json(
                indent=1, exclude={"source"})}, {"Head": f"{r.op}={r.id}"})
    ledger.commit(f"end {root.name}: time budget spent", [], {"summary.json": json.dumps({**summary, "stopped": "time budget spent"})},
                  {"Run": root.name})
    return ledger


def head(op: str, v: Verdict) -> Kernel:
    return Kernel(ref=f"head:{op}", op=op, path=f"heads/{op}.py", source=f"# the {op} reference kernel\n",
                  speedup=speedup_of(v), verdict=v)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """An LLM run on an H200: every way a candidate can end, LLM costs, microbench figures with the cuDNN anchor."""
    heads = {"decode": head("decode", verdict("decode", speedup=1.10, replay="failed")),
             "prefill": head("prefill", verdict("prefill", speedup=0.95))}
    records = [
        record("c001", "decode", 1, [verdict("decode", "compile"), verdict("decode", "compile")], claim("decode", 1.2), 1.10, 0.012),
        record("c002", "decode", 3, [verdict("decode", "dispatch")], claim("decode", 1.1), 1.10, 0.010),
        record("c003", "prefill", 4, [verdict("prefill", "parity")], claim("prefill", 1.3, "parity"), 0.95, 0.011),
        record("c004", "decode", 6, [verdict("decode", speedup=1.02)], claim("decode", 1.08), 1.10, 0.009),
        record("c005", "decode", 8, [verdict("decode", speedup=1.32, replay="passed")], claim("decode", 1.15), 1.10, 0.014),
        record("c006", "prefill", 10, [verdict("prefill", speedup=1.08)], claim("prefill", 1.1), 0.95, 0.013),
        record("c007", "decode", 11, c=None, cost=0.004, outcome="malformed", stage="planner",
               reason="the reply had no claim block after one repair round"),
        record("c008", "prefill", 12, c=claim("prefill", 1.01), outcome="not-worth-coding", stage="ceiling",
               reason="ceiling 1.0035 is under the minimum 1.005", cost=0.003),
        record("c009", "decode", 13, c=claim("decode", 1.05), outcome="unevaluated", stage="budget",
               reason="time budget of 20 min spent", cost=0.006),
    ]
    return write_ledger(tmp_path_factory.mktemp("runs") / "gpu", "cuda", records, heads), records


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The built-in proposer on a CPU: compile, dispatch and parity ran; microbench and replay were skipped."""
    heads = {"decode": head("decode", verdict("decode"))}
    records = [record("c001", "decode", 0.2, [verdict("decode")], claim("decode", 1.06)),
               record("c002", "decode", 0.5, [verdict("decode", "parity")], claim("decode", 1.05, "parity")),
               record("c003", "decode", 0.8, [verdict("decode")], claim("decode", 1.04))]
    return write_ledger(tmp_path_factory.mktemp("runs") / "cpu", "cpu", records, heads), records


def kevo(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


class Page(HTMLParser):
    """What a page holds: sections by id (their tags and text), and every address it would load."""
    def __init__(self, text: str) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.open: list[str] = []
        self.addresses: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.addresses += [v for k, v in attrs.items() if k in ("src", "href", "xlink:href", "srcset", "poster") and v]
        if tag == "section":
            self.open.append(attrs.get("id", ""))
            self.sections[self.open[-1]] = {"tags": [], "text": ""}
        for sid in self.open:
            self.sections[sid]["tags"].append(tag)

    def handle_endtag(self, tag):
        if tag == "section" and self.open:
            self.open.pop()

    def handle_data(self, data):
        for sid in self.open:
            self.sections[sid]["text"] += data


PLOTS = ("best-so-far", "funnel", "stage-time", "predicted-observed", "cost")


# -- the ledger's rows --------------------------------------------------------------------------------

def test_ledger_lists_one_row_per_candidate_with_claim_stage_verdict_speedups_and_cost(gpu_run, capsys):
    ledger, records = gpu_run
    code, out, _ = kevo(capsys, "ledger", str(ledger.root), "--json")
    assert code == 0
    rows = {r["id"]: r for r in json.loads(out)}
    assert list(rows) == [r.id for r in records]
    for r in records:
        got = rows[r.id]
        assert (got["stage"], got["verdict"], got["cost_usd"]) == (r.stage, r.outcome, r.cost_usd)
        assert got["predicted"] == (r.claim.expected_speedup if r.claim else None)
        assert got["observed"] == r.local_speedup and got["speedup"] == r.speedup
        assert got["conclusion"] == r.conclusion.learned and got["rounds"] == len(r.rounds)
        assert got["claim"] == (r.claim.hypothesis if r.claim else f"(no claim) {r.reason}")
    assert rows["c004"]["observed"] == pytest.approx(1.02 / 1.10) and rows["c004"]["stage"] == "microbench"
    assert rows["c006"]["stage"] == "replay" and rows["c006"]["verdict"] == "rejected"
    assert rows["c001"]["stage"] == "compile" and rows["c001"]["rounds"] == 2
    shapes = SHAPES["decode"]                          # c005 at 1.32x torch: against cuDNN from the anchor's times
    mix = sum(c.weight * a for c, _, a in shapes) / sum(c.weight * b / 1.32 for c, b, _ in shapes)
    assert rows["c005"]["vs_cudnn"] == pytest.approx(mix) and rows["c001"]["vs_cudnn"] is None

    code, out, _ = kevo(capsys, "ledger", str(ledger.root))
    assert code == 0
    text = " ".join(out.split())
    assert all(r.id in text for r in records) and "rejected" in text and "not-worth-coding" in text
    assert "0.927x" in text and "$0.0140" in text                # c004's observed local speedup; c005's cost
    assert "pred s obs s cuDNN torch cost" in text and f"{mix:.3f}x 1.320x" in text   # the library first, then torch


def test_ledger_piped_keeps_every_claim_and_conclusion_whole_on_its_line(gpu_run, capsys, monkeypatch):
    ledger, records = gpu_run
    monkeypatch.delenv("COLUMNS", raising=False)                # capsys's stdout is not a terminal: as when piped
    code, out, _ = kevo(capsys, "ledger", str(ledger.root))
    assert code == 0
    lines = out.splitlines()
    long = [r for r in records if len(r.conclusion.learned) > 80]
    assert long, "the fixture has conclusions longer than 80 columns"
    for r in records:
        assert any(line.endswith(f"» {r.conclusion.learned}") for line in lines), r.id
    assert all(line == line.rstrip() for line in lines)


@pytest.mark.parametrize("columns", [None, "100"])
def test_ledger_whose_reader_has_gone_exits_0_without_a_word(gpu_run, columns):
    ledger, _ = gpu_run
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    read, write = os.pipe()
    os.close(read)                                              # `| head` that has read its lines and left
    try:
        done = subprocess.run([sys.executable, "-m", "agent.cli", "ledger", str(ledger.root)], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


def test_a_bare_run_id_is_found_under_the_configured_runs_dir(cpu_run, tmp_path, capsys):
    ledger, records = cpu_run
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(config_with(**{"agent.runs_dir": str(ledger.root.parent)}).model_dump(mode="json")))
    code, out, _ = kevo(capsys, "--config", str(cfg), "ledger", ledger.root.name, "--json")
    assert code == 0 and [r["id"] for r in json.loads(out)] == [r.id for r in records]
    code, out, _ = kevo(capsys, "--config", str(cfg), "ledger", ledger.root.name)
    assert "no candidate was timed on cpu" in " ".join(out.split())


def test_what_is_not_a_run_is_one_line_and_exit_2(cpu_run, tmp_path, capsys):
    ledger, _ = cpu_run
    (tmp_path / "plain").mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    cases = {("ledger", str(tmp_path / "missing")): "no run ledger at",
             ("report", str(tmp_path / "plain")): "is not a run ledger (no git repository)",
             ("ledger", str(tmp_path / "repo")): "no run.json; not a kevo run ledger",
             ("report", str(ledger.root), "--out", str(tmp_path / "nowhere" / "r.html")): "no such folder"}
    for args, words in cases.items():
        code, out, err = kevo(capsys, *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, (args, err)


# -- the report ---------------------------------------------------------------------------------------

def test_report_is_one_self_contained_page_with_every_plot_and_the_best_kernel_and_is_not_committed(gpu_run, capsys):
    ledger, records = gpu_run
    before = ledger.repo.head.commit.hexsha
    code, out, _ = kevo(capsys, "report", str(ledger.root))
    path = ledger.root / "report.html"
    assert code == 0 and str(path) in out
    text = path.read_text()
    page = Page(text)
    assert not [a for a in page.addresses if not a.startswith(("#", "data:"))], page.addresses
    assert "<link" not in text and "<script" not in text and "url(http" not in text and "@import" not in text
    for pid in PLOTS:
        assert "svg" in page.sections[pid]["tags"], pid
    assert "c005" in page.sections["predicted-observed"]["text"]           # the timed candidates are labelled
    assert f"${sum(r.cost_usd for r in records):.4f} spent of the $1 limit" in page.sections["cost"]["text"]
    assert "did not run on this machine" not in text                       # a GPU run ran every stage
    best = page.sections["best-decode"]
    assert "c005" in best["text"] and "accepted by the full scored replay" in best["text"]
    assert records[4].source in best["text"]
    for case, base_ms, anchor_ms in SHAPES["decode"]:
        assert case.label in best["text"] and f"{base_ms:.4f}" in best["text"] and f"{anchor_ms:.4f}" in best["text"]
    assert "cuDNN" in best["text"] and "svg" in best["tags"]
    shapes = SHAPES["decode"]                          # c005: 1.32x torch; kevo/cuDNN from the anchor's times
    mix = sum(c.weight * a for c, _, a in shapes) / sum(c.weight * b / 1.32 for c, b, _ in shapes)
    assert f"served mix {mix:.3f}x cuDNN, 1.320x torch" in best["text"]     # the library first, torch second
    for _, base_ms, anchor_ms in shapes:
        assert f"{anchor_ms / (base_ms / 1.32):.3f}x" in best["text"]
    rows = text[text.index("<table class='rows'>"):]
    assert "<th>vs cuDNN</th><th>vs torch</th>" in rows and f"<td class='num'>{mix:.3f}x</td>" in rows
    assert "head:prefill" in page.sections["best-prefill"]["text"]          # nothing beat the prefill head
    pace = " ".join(page.sections["stage-time"]["text"].split())           # no run time in this ledger: no rate
    assert "Pace: 6 candidates; the stages ran " in pace and " an hour" not in pace
    assert ledger.repo.head.commit.hexsha == before and not ledger.repo.is_dirty(untracked_files=True)


def test_cpu_report_says_which_stages_did_not_run_and_that_no_speed_figure_exists(cpu_run, tmp_path, capsys):
    ledger, _ = cpu_run
    out = tmp_path / "cpu.html"
    assert kevo(capsys, "report", str(ledger.root), "--out", str(out))[0] == 0
    assert not (ledger.root / "report.html").exists()
    page = Page(out.read_text())
    text = " ".join(out.read_text().split())
    assert "Stages that did not run on this machine" in text and "No speed figure exists for this run" in text
    assert f"microbench</b>: {CPU_SKIP}" in text and "replay</b>:" in text
    for pid in ("best-so-far", "predicted-observed"):
        section = page.sections[pid]
        assert "svg" not in section["tags"] and "microbench stage did not run on this cpu machine" in section["text"]
    for pid in ("funnel", "stage-time"):
        assert "svg" in page.sections[pid]["tags"]
    assert "No speed figure exists for this kernel" in page.sections["best-decode"]["text"]
    passed = sum(r.outcome == "passed" for r in cpu_run[1])
    assert (f"{passed} candidate(s) passed the correctness stages only: nothing was timed or accepted here") in text


# -- in a real browser ----------------------------------------------------------------------------------

def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("KEVO_REQUIRE_BROWSER") == "1":
            pytest.fail("KEVO_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install chromium)")
        pytest.skip("no chromium on PATH: the headless-browser check needs Debian's chromium (apt-get install chromium)")
    return found


def test_report_renders_in_headless_chromium_with_its_plots_and_best_kernel(gpu_run, tmp_path, capsys):
    browser = chromium()
    ledger, _ = gpu_run
    page_path = tmp_path / "report.html"
    assert kevo(capsys, "report", str(ledger.root), "--out", str(page_path))[0] == 0
    shot = tmp_path / "report.png"
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,5200"]
    dom = subprocess.run(base + ["--dump-dom", page_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = Page(dom.stdout)
    for pid in PLOTS:
        assert "svg" in page.sections[pid]["tags"], pid
    assert "c005" in page.sections["best-decode"]["text"] and "pre" in page.sections["best-decode"]["tags"]
    done = subprocess.run(base + [f"--screenshot={shot}", page_path.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (5200, 1280) and pixels[..., :3].std() > 0.05     # drawn, not a blank page
    print(f"screenshot: {shot}")


# -- the live view ------------------------------------------------------------------------------------

def test_the_live_view_reports_each_candidate_and_the_best_over_cudnn_first_and_a_cpu_pass_as_untimed(gpu_run, cpu_run):
    import io

    from rich.console import Console

    from agent.reading.figures import speed
    from agent.reading.view import RunView
    c005, shapes = gpu_run[1][4], SHAPES["decode"]
    mix = sum(c.weight * a for c, _, a in shapes) / sum(c.weight * b / 1.32 for c, b, _ in shapes)
    out = io.StringIO()
    view = RunView(console=Console(file=out, width=300))
    summary = {"funnel": {"accepted": 1}, "cost_usd": 0.0, "candidates": 5, "untimed": "",
               "best": {"decode": {"ref": "c005", **speed(c005.verdict, "decode").record()}}}
    view.record(c005, summary)
    per = ", ".join(f"{a / (b / 1.32):.3f}x" for _, b, a in shapes)
    assert f"c005 [decode] accepted at replay, {mix:.3f}x cuDNN, 1.320x torch (per served shape {per} cuDNN)" in out.getvalue()
    board = io.StringIO()
    Console(file=board, width=300).print(view)
    assert f"decode: c005 {mix:.3f}x cuDNN, 1.320x torch" in board.getvalue()

    cpu = cpu_run[1][0]
    view.record(cpu, {**summary, "untimed": "1 candidate(s) passed the correctness stages", "best": {
        "decode": {"ref": "head:decode", **speed(cpu.verdict, "decode").record()}}})
    assert ("c001 [decode] passed the correctness stages (compile, dispatch, parity); not timed, not accepted "
            "(microbench, replay skipped)") in " ".join(out.getvalue().split())
    board = io.StringIO()
    Console(file=board, width=300).print(view)
    assert "decode: head:decode no cuDNN anchor timed (nothing timed: needs CUDA)" in board.getvalue()


# -- the pace ---------------------------------------------------------------------------------------

def waited(v: Verdict, wait_s: float, alone_s: float) -> Verdict:
    """`v` with the lease figures harness/evaluate.py gives each stage that ran on a GPU shared by slots: each
    stage waited `wait_s` for its grant; microbench and the replay held the GPU alone `alone_s`."""
    return Verdict.of([StageResult(**{**s.model_dump(), "metrics": {
        **s.metrics, "lease_wait_s": wait_s, **({"alone_s": alone_s} if s.name in ("microbench", "replay") else {})}})
        for s in v.stages])


def test_the_pace_counts_each_candidate_judged_and_adds_the_stage_time_of_every_verdict_the_stages_reached():
    from harness.records import CachedFrom

    from agent.reading.pace import pace
    cached = verdict("decode", speedup=1.02).model_copy(update={"cached_from": CachedFrom(
        key="k", job="c001", where="host/gpu0", reached="2026-12-04T00:00:00Z")})
    heads = {"decode": head("decode", verdict("decode", speedup=1.10))}   # 1.5, 0.6, 4 s; microbench 20, replay 90
    history = [record("c001", "decode", 1, [verdict("decode", "compile"), verdict("decode", "dispatch")]),   # two rounds
               record("c002", "decode", 2, [cached]),                   # its stages ran in an earlier evaluation
               record("c003", "decode", 3, c=claim("decode", 1.05), outcome="unevaluated", stage="budget")]
    p = pace(heads, history, elapsed_s=600.0)
    assert (p.candidates, p.from_cache, p.per_hour) == (2, 1, 12.0)
    assert p.stage_s == {"compile": 1.5 + 1.5 + 1.5, "dispatch": 0.6 + 0.6, "parity": 4.0, "microbench": 20.0, "replay": 90.0}
    assert (p.lease_wait_s, p.alone_s) == (0.0, 0.0)
    moved = {"decode": Kernel(**{**heads["decode"].model_dump(), "ref": "c009"})}   # an accepted candidate's: in history
    assert pace(moved, history, 600.0).stage_s == {"compile": 1.5 + 1.5, "dispatch": 0.6}


def test_the_pace_says_how_long_the_stages_waited_for_their_gpu_and_held_it_alone():
    from agent.reading.pace import pace, pace_words
    history = [record("c001", "decode", 1, [waited(verdict("decode", speedup=1.32, replay="failed"), 2.0, 3.0)]),
               record("c002", "decode", 2, [waited(verdict("decode", "parity"), 1.0, 0.0)])]
    p = pace({}, history, elapsed_s=120.0)
    assert (p.lease_wait_s, p.alone_s) == (5 * 2.0 + 3 * 1.0, 3.0 + 3.0)
    words = pace_words(p.record())
    stages = 2 * (1.5 + 0.6 + 4.0) + 20.0 + 90.0
    assert words.startswith(f"2 candidates in 2.0 min (60 an hour); the stages ran {stages:.1f} s: compile 2%, dispatch 1%, ")
    assert f"they waited 13.0 s more for their turn on the device ({13.0 / (stages + 13.0):.0%} of their time)" in words
    assert "a GPU was held alone 6.0 s (5% of the run's time)" in words
    bare = pace_words(pace({}, [history[1]], 60.0).record())
    assert "held alone" not in bare and "waited 3.0 s" in bare


def test_the_end_and_the_report_name_each_head_a_later_replay_found_wrong_where_served(tmp_path):
    """2026-12-06, H100: s50's c022, accepted as a prefill head, failed a spot check in a later replay. A replay reads
    the head's own spot checks beside the candidate's (`head_spot_failed_ops`); the end commit's summary and the
    report name the head and the candidate whose replay found it (it gave its place back: test_agent_offline.py),
    and a run without one says nothing of it."""
    from agent.reading.pace import pace
    from agent.reading.report import render
    from agent.run.ending import end_text, heads_found_wrong
    stages = verdict("prefill", speedup=1.2, replay="passed").stages
    stages[-1] = stages[-1].model_copy(update={"metrics": {**stages[-1].metrics, "head_spot_failed_ops": 1.0}})
    found = record("c031", "prefill", 3.0, [Verdict.of(stages)])
    found = found.model_copy(update={"rounds": [found.rounds[0].model_copy(update={"against": "c022"})]})
    clean = record("c030", "prefill", 2.0, [verdict("prefill", speedup=1.2, replay="passed")])
    assert heads_found_wrong([clean, found]) == [
        "c022, the prefill head, failed its own spot checks in c031's replay (that verdict's reason says how): neither "
        "the head nor built on from then"]
    assert heads_found_wrong([clean]) == []
    summary = {"best": {}, "pace": pace({}, [clean, found], 120.0).record(), "untimed": "",
               "heads_found_wrong": heads_found_wrong([clean, found])}
    text = end_text("r1", "2 candidates reached", summary, [], [], [])
    assert ("Heads found wrong where served (each gave its place back to the head before it):\n- c022, the prefill "
            "head, failed its own spot checks in c031's replay") in text, text
    assert "found wrong" not in end_text("r1", "2 candidates reached", {**summary, "heads_found_wrong": []}, [], [], [])
    def heads():                                    # (write_ledger moves a head on an accepted record)
        return {"prefill": head("prefill", verdict("prefill", speedup=1.0))}
    text = render(write_ledger(tmp_path / "found", "cuda", [clean, found], heads()))
    assert ("id='heads-found-wrong'><b>Heads found wrong where served</b>" in text
            and "<li>c022, the prefill head, failed its own spot checks in c031&#x27;s replay" in text), text[:2000]
    assert "heads-found-wrong" not in render(write_ledger(tmp_path / "clean", "cuda", [clean], heads()))
