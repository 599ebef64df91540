"""The verdict cache (harness/verdicts.py): keyed by everything a verdict depends on, so it misses when any
of it changes; a hit is the stored verdict marked as cached; a corrupt, foreign or inconsistent entry is a
miss, said so; a verdict the device or the host could have decided is never stored; and a source judged
again by `kevo-agent evaluate`'s slot is given its verdict from the cache."""
from __future__ import annotations

import json
import os

import pytest

from conftest import config_with
from harness.evaluate import evaluate_each
from harness.records import StageResult, Verdict
from harness.verdicts import UNCACHEABLE, VerdictCache, machine

SOURCE, HEAD = "def decode(): pass\n", "def decode(): return 1\n"
PARITY_FAIL = Verdict.of([StageResult.passed("compile", "built", load_s=0.5),
                          StageResult.failed("parity", "max abs error 3", max_abs=3.0)])
REPLAYED = Verdict.of([StageResult.passed(s) for s in ("compile", "dispatch", "parity", "microbench")]
                      + [StageResult.passed("replay", "accepted", accepted=1.0)])


@pytest.fixture(scope="module")
def harness_copies(tmp_path_factory):
    """Two harness folders differing in one byte of one file."""
    a, b = tmp_path_factory.mktemp("harness_a"), tmp_path_factory.mktemp("harness_b")
    for root, text in ((a, "X = 1\n"), (b, "X = 2\n")):
        (root / "stages").mkdir()
        (root / "stages" / "parity.py").write_text(text)
        (root / "evaluate.py").write_text("import os\n")
    return a, b


def cache_for(folder, harness, cfg=None, said=None, **machine_overrides) -> VerdictCache:
    base = VerdictCache.base_parts(cfg or config_with(), "attention", "cpu", harness=harness)
    return VerdictCache(folder, {**base, **machine_overrides}, say=(said.append if said is not None else lambda _: None))


def test_a_hit_is_the_stored_verdict_marked_with_where_and_when_it_was_first_reached(tmp_path, harness_copies):
    cache = cache_for(tmp_path, harness_copies[0])
    assert cache.lookup(SOURCE, "parity", 1.0, None) is None
    assert cache.store(SOURCE, "parity", 1.0, None, PARITY_FAIL, job="c007", where="host/cpu0")
    hit = cache.lookup(SOURCE, "parity", 1.0, None)
    assert hit.model_dump(exclude={"cached_from"}) == PARITY_FAIL.model_dump()
    assert hit.cached_from.job == "c007" and hit.cached_from.where == "host/cpu0" and hit.cached_from.reached
    assert (tmp_path / f"{hit.cached_from.key}.json").is_file()
    assert "cached_from" not in PARITY_FAIL.model_dump() and Verdict.model_validate_json(hit.model_dump_json()) == hit


def test_the_key_misses_when_the_source_until_or_beat_changes(tmp_path, harness_copies):
    cache = cache_for(tmp_path, harness_copies[0])
    cache.store(SOURCE, "parity", 1.2, None, PARITY_FAIL, job="c1", where="h")
    assert cache.lookup(SOURCE, "parity", 1.2, None) is not None
    assert cache.lookup(SOURCE + "\n", "parity", 1.2, None) is None
    assert cache.lookup(SOURCE, "microbench", 1.2, None) is None
    assert cache.lookup(SOURCE, None, 1.2, None) is None
    assert cache.lookup(SOURCE, "parity", 1.3, None) is None


def test_the_head_is_part_of_the_key_only_for_a_verdict_that_reached_the_replay(tmp_path, harness_copies):
    cache = cache_for(tmp_path, harness_copies[0])
    cache.store(SOURCE, "parity", 1.0, HEAD, PARITY_FAIL, job="c1", where="h")
    assert cache.lookup(SOURCE, "parity", 1.0, HEAD + "# another head\n") is not None     # stopped before the replay
    cache.store(SOURCE, None, 1.0, HEAD, REPLAYED, job="c2", where="h")
    assert cache.lookup(SOURCE, None, 1.0, HEAD).accepted
    assert cache.lookup(SOURCE, None, 1.0, HEAD + "# another head\n") is None
    assert cache.lookup(SOURCE, None, 1.0, None) is None                                   # torch as the head


def test_the_other_ops_heads_both_arms_served_are_part_of_the_key_of_a_verdict_that_reached_the_replay(tmp_path, harness_copies):
    cache = cache_for(tmp_path, harness_copies[0])
    prefill = {"prefill": "def prefill(): pass\n"}
    cache.store(SOURCE, "parity", 1.0, HEAD, PARITY_FAIL, job="c1", where="h", other_heads=prefill)
    assert cache.lookup(SOURCE, "parity", 1.0, HEAD) is not None                           # stopped before the replay
    cache.store(SOURCE, None, 1.0, HEAD, REPLAYED, job="c2", where="h", other_heads=prefill)
    assert cache.lookup(SOURCE, None, 1.0, HEAD, dict(prefill)).accepted
    assert cache.lookup(SOURCE, None, 1.0, HEAD, {"prefill": "def prefill(): return 2\n"}) is None   # a new prefill head
    assert cache.lookup(SOURCE, None, 1.0, HEAD) is None                                   # served with torch's prefill
    cache.store(SOURCE, None, 1.0, HEAD, REPLAYED, job="c3", where="h")                     # a replay with none beside
    assert cache.lookup(SOURCE, None, 1.0, HEAD, {}).cached_from.job == "c3"


def test_the_key_misses_when_the_harness_changes(tmp_path, harness_copies):
    cache_for(tmp_path, harness_copies[0]).store(SOURCE, "parity", 1.0, None, PARITY_FAIL, job="c1", where="h")
    assert cache_for(tmp_path, harness_copies[0]).lookup(SOURCE, "parity", 1.0, None) is not None
    assert cache_for(tmp_path, harness_copies[1]).lookup(SOURCE, "parity", 1.0, None) is None


@pytest.mark.parametrize("override", [
    {"stages.parity.tolerance_factor": 7.0}, {"stages.replay.min_margin": 0.5}, {"targets.attention.cpu.block_size": 8},
    {"served.request_timeout_s": 77.0}, {"served.cpu.window_s": 4.0}, {"worker.log_tail_chars": 999}])
def test_the_key_misses_when_a_config_section_the_stages_read_changes(tmp_path, harness_copies, override):
    cache_for(tmp_path, harness_copies[0]).store(SOURCE, "parity", 1.0, None, PARITY_FAIL, job="c1", where="h")
    assert cache_for(tmp_path, harness_copies[0], config_with(**override)).lookup(SOURCE, "parity", 1.0, None) is None


def test_config_the_stages_do_not_read_keeps_the_key(tmp_path, harness_copies):
    """A run with another budget, provider or executor still reuses the verdicts of the last one."""
    cache_for(tmp_path, harness_copies[0]).store(SOURCE, "parity", 1.0, None, PARITY_FAIL, job="c1", where="h")
    other = config_with(**{"agent.budget_minutes": {"cuda": 5, "cpu": 1}, "agent.provider": "openai",
                           "executor.cpu_slots": 2, "targets.attention.cuda.block_size": 32})
    assert cache_for(tmp_path, harness_copies[0], other).lookup(SOURCE, "parity", 1.0, None) is not None


@pytest.mark.parametrize("part", ["device", "driver", "torch", "triton", "python"])
def test_the_key_misses_when_the_device_driver_torch_or_triton_changes(tmp_path, harness_copies, part):
    assert VerdictCache.base_parts(config_with(), "attention", "cpu", harness_copies[0])[part] == machine("cpu")[part]
    cache_for(tmp_path, harness_copies[0]).store(SOURCE, "parity", 1.0, None, PARITY_FAIL, job="c1", where="h")
    assert cache_for(tmp_path, harness_copies[0], **{part: machine("cpu")[part] + " (another)"}).lookup(
        SOURCE, "parity", 1.0, None) is None


@pytest.mark.parametrize("kind", UNCACHEABLE)
def test_a_verdict_whose_worker_was_lost_or_that_timed_out_is_never_stored(tmp_path, harness_copies, kind):
    said: list[str] = []
    cache = cache_for(tmp_path, harness_copies[0], said=said)
    lost = Verdict.of([StageResult.passed("compile"), StageResult.failed("parity", "the worker went away", kind)])
    assert not cache.store(SOURCE, "parity", 1.0, None, lost, job="c1", where="h")
    assert list(tmp_path.iterdir()) == []
    cache.store(SOURCE, "parity", 1.0, None, PARITY_FAIL, job="c1", where="h")     # an entry edited to hold one
    path = next(tmp_path.glob("*.json"))
    entry = json.loads(path.read_text())
    entry["verdict"] = json.loads(lost.model_dump_json())
    path.write_text(json.dumps(entry))
    assert cache.lookup(SOURCE, "parity", 1.0, None) is None and "never cached" in said[-1]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "nan", "foreign", "symlink", "no_head_mark"])
def test_a_corrupt_or_foreign_entry_is_a_miss_said_so(tmp_path, harness_copies, damage):
    said: list[str] = []
    cache = cache_for(tmp_path / "v", harness_copies[0], said=said)
    cache.store(SOURCE, "parity", 1.0, None, PARITY_FAIL, job="c1", where="h")
    path = next((tmp_path / "v").glob("*.json"))
    text = path.read_text()
    if damage == "garbage":
        path.write_bytes(b"\xff\x00 not json")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "nan":
        path.write_text(text.replace('"max_abs":3.0', '"max_abs":NaN'))
    elif damage == "foreign":                    # another key's entry under this key's name
        cache.store(SOURCE + "#2", "parity", 1.0, None, PARITY_FAIL, job="c2", where="h")
        other = next(p for p in (tmp_path / "v").glob("*.json") if p != path)
        path.write_text(other.read_text())
    elif damage == "symlink":
        (tmp_path / "elsewhere.json").write_text(text)
        path.unlink()
        os.symlink(tmp_path / "elsewhere.json", path)
    elif damage == "no_head_mark":               # a verdict that reached the replay, stored as if the head did not matter
        entry = json.loads(text)
        entry["verdict"] = json.loads(REPLAYED.model_dump_json())
        path.write_text(json.dumps(entry))
    assert cache.lookup(SOURCE, "parity", 1.0, None) is None
    assert len(said) == 1 and str(path) in said[0] and "judging afresh" in said[0]


def test_the_cache_is_off_when_config_says_so_or_workers_may_run_unsandboxed():
    assert VerdictCache.for_run(config_with(**{"executor.verdict_cache": True}), "attention", "cpu") is not None
    assert VerdictCache.for_run(config_with(), "attention", "cpu") is None          # conftest turns it off
    assert VerdictCache.for_run(config_with(**{"executor.verdict_cache": True, "worker.sandbox": "best_effort"}),
                                "attention", "cpu") is None


def test_a_source_judged_again_in_one_evaluate_is_given_its_verdict_from_the_cache(tmp_path):
    """`kevo-agent evaluate` judges through a slot: the second copy of a file gets the first copy's verdict,
    marked; another file is judged by the stages."""
    cfg = config_with(**{"executor.verdict_cache": True, "agent.runs_dir": str(tmp_path)})
    one, two = "import torch\n", "import torch\nimport triton\n"          # rejected at compile, before any worker
    first, again, other = [done.verdict for done in evaluate_each([one, one, two], "attention", cfg, until="compile")]
    assert first.cached_from is None and other.cached_from is None
    assert again.cached_from.job == "file1" and again.cached_from.where.endswith("/cpu")
    assert again.model_dump(exclude={"cached_from"}) == first.model_dump()
    assert len(list((tmp_path / ".verdicts").glob("*.json"))) == 2                 # one entry per source


def test_a_cached_verdict_costs_no_device_time():
    from agent.roles.evaluator import device_seconds
    from agent.records import CandidateRecord, Round
    from harness.records import CachedFrom
    timed = Verdict.of([StageResult(name="compile", status="passed", seconds=2.0)])
    cached = timed.model_copy(update={"cached_from": CachedFrom(key="k", job="c1", where="h", reached="t")})
    rec = lambda v: CandidateRecord.model_construct(rounds=[Round(source="", verdict=v)])
    assert device_seconds({}, [rec(timed), rec(cached)]) == 2.0
