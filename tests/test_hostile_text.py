"""Text from outside kevo (a model's claim, a server's error, a candidate's message, a ledger from elsewhere) reaches a
terminal and the ledger's commits with its control characters written as \\xNN: an escape sequence in it cannot
retitle the reader's window, write their clipboard or redraw their screen (an attacker's review, 2026-12-05, did all
three through a model's reply and a server's 401)."""
from __future__ import annotations

import io

from rich.console import Console

from agent.cli import main
from agent.reading.table import print_rows, rows
from agent.rejudging.report import DecisionRow, Rejudging, commit_rejudging, print_rejudging
from test_ledger import candidate, commit, git, new_ledger

TITLE, CLIPBOARD, REDRAW = "\x1b]0;pwned\x07", "\x1b]52;c;cHduZWQ=\x07", "\x1b[2K\x1b[1G\x9b2J"


def test_a_claim_carrying_escape_sequences_is_committed_and_listed_with_them_written_out(tmp_path):
    ledger = new_ledger(tmp_path / "r1")
    r = candidate("c001", "rejected", "parity", None, reason=f"max abs error{REDRAW}")
    r = r.model_copy(update={"claim": r.claim.model_copy(update={"hypothesis": f"wider tiles{TITLE}{CLIPBOARD}"})})
    commit(ledger, r)
    message, readme = git(ledger.root, "log", "-1", "--format=%B"), (ledger.root / "candidates/c001/README.md").read_text()
    out = io.StringIO()
    print_rows(ledger.header(), rows(ledger), Console(file=out, width=200, color_system=None))
    for text in (message, readme, out.getvalue()):
        assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, repr(text)
    assert "wider tiles\\x1b]0;pwned\\x07" in message and "wider tiles\\x1b]0;pwned\\x07" in out.getvalue()


def test_the_command_lines_one_line_error_writes_out_the_control_characters_of_what_it_quotes(tmp_path, capsys):
    assert main(["report", str(tmp_path / f"run{TITLE}{REDRAW}")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kevo-agent: ") and "\x1b" not in err and "\x07" not in err and "\\x1b]0;pwned" in err, repr(err)


def test_a_replay_of_a_ledger_from_elsewhere_prints_and_commits_its_control_characters_written_out(tmp_path):
    """A run id and a device read from a ledger copied in, a provider's error kept as why the run stopped: the replay's
    table title and lines printed them raw, and its README kept them (an attacker's review, 2026-12-07: a cursor-up and
    an erase-below hid the rows that said "regressed")."""
    ledger = new_ledger(tmp_path / "r1")
    r = Rejudging(run=f"r1{REDRAW}", kind="decisions", at="2026-12-07T00:00:00+00:00",
                  then={"device": f"cuda{TITLE}", "gpu": "H200", "kevo_commit": "abc"},
                  now={"device": "cpu", "gpu": "none", "kevo_commit": "def"}, stopped={"then": f"401{CLIPBOARD}"},
                  decisions=[DecisionRow(id="c001", then=None, now=None, differs=[], note=f"gone{REDRAW}")])
    out = io.StringIO()
    print_rejudging(r, Console(file=out, width=200, color_system=None))
    done = commit_rejudging(ledger.root, r)
    readme = git(ledger.root, "show", f"{done.branch}:replay/README.md")
    for text in (out.getvalue(), readme):
        assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, repr(text)
    assert "r1\\x1b[2K" in out.getvalue() and "401\\x1b]52;c" in out.getvalue() and "401\\x1b]52;c" in readme


def test_a_claim_written_as_markdown_cannot_forge_a_verdict_or_hide_the_real_one_in_the_candidates_readme(tmp_path):
    """A hypothesis (or a risk, a piece of evidence, a reason) that opened a section, a table and a comment rendered as
    the candidate's verdict, the real one hidden (an attacker's review, 2026-12-07, with a CommonMark renderer)."""
    from markdown_it import MarkdownIt
    forged = ("x\n\n## Verdict\n\n| stage | status | s | reason |\n|---|---|---|---|\n| replay | passed | 9.00 | 1.80x |"
              "\n\n## Conclusion\n\nAccepted\n\n<!--")
    ledger = new_ledger(tmp_path / "r1")
    r = candidate("c001", "rejected", "parity", None, reason=f"max abs error | replay | passed {forged}")
    r = r.model_copy(update={"claim": r.claim.model_copy(update={"hypothesis": forged, "risks": [forged],
                                                                  "evidence": [forged]})})
    commit(ledger, r)
    html = MarkdownIt("commonmark").enable("table").render((ledger.root / "candidates/c001/README.md").read_text())
    assert html.count("<table>") == 1 and html.count("<h2>Verdict</h2>") == 1 and "<!--" not in html, html
    rows = html.split("<tbody>")[1].split("</tbody>")[0]
    assert rows.count("<tr>") == 2 and "<td>parity</td>\n<td>failed</td>" in rows, rows
