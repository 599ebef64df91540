"""The evaluator's records (harness/records.py): how a stage failed is a typed field, written to the ledger
as such, and a ledger an older kevo wrote with the kind as a float metric still reads, with the same meaning."""
from __future__ import annotations

import json
from typing import get_args

import pytest
from pydantic import ValidationError

from test_ledger import candidate, commit, new_ledger

from harness.records import FAILURE_KINDS, FailureKind, StageResult, Verdict
from harness.verdicts import cacheable

from agent.ledger.repository import Ledger


def test_every_failure_kind_is_described_in_words():
    assert set(FAILURE_KINDS) == set(get_args(FailureKind))


def test_a_failure_kind_no_reader_knows_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="failure"):
        StageResult.failed("parity", "the worker went away", "exploded")


def test_a_failure_kind_is_committed_typed_and_read_back_and_a_stage_without_one_is_written_as_before(tmp_path):
    ledger = new_ledger(tmp_path / "run")
    r = candidate("c001", "rejected", "parity", None, "no reply within 30 s")
    r.rounds[0].verdict.stages[-1].failure = "timeout"
    commit(ledger, r)
    stages = json.loads(ledger.committed("candidates/c001/record.json"))["rounds"][0]["verdict"]["stages"]
    assert [s.get("failure") for s in stages] == [None, "timeout"]
    assert "failure" not in stages[0] and "timeout" not in stages[1]["metrics"]
    assert "| parity | failed (timeout) |" in ledger.committed("candidates/c001/README.md")    # for people too
    verdict = Ledger(tmp_path / "run").history()[0].rounds[0].verdict
    assert verdict.stages[-1].failure == "timeout" and verdict.stages[-1].worker_lost == "hung" and not cacheable(verdict)


def test_a_ledger_of_an_older_kevo_holding_the_kind_as_a_metric_reads_with_the_typed_failure(tmp_path):
    ledger = new_ledger(tmp_path / "run")
    data = json.loads(candidate("c001", "rejected", "parity", None, "the worker died (SIGSEGV)").model_dump_json())
    data["rounds"][0]["verdict"]["stages"][-1]["metrics"] = {"crashed": 1.0, "worker_s": 0.5}   # as it was written then
    ledger.commit("c001 decode: rejected at parity", [], {"candidates/c001/record.json": json.dumps(data)}, {})
    stage = Ledger(tmp_path / "run").history()[0].rounds[0].verdict.stages[-1]
    assert stage.failure == "crashed" and stage.metrics == {"worker_s": 0.5}
    assert stage.worker_lost == "crashed"                   # so a resumed run still checks the device after it
    assert json.loads(stage.model_dump_json())["failure"] == "crashed"


def test_a_metric_of_zero_under_a_kind_s_name_is_no_failure():
    stage = StageResult.model_validate({"name": "parity", "status": "passed", "metrics": {"timeout": 0.0, "checks": 8}})
    assert stage.failure is None and stage.worker_lost == "" and Verdict.of([stage]).stages[0].metrics["timeout"] == 0.0
