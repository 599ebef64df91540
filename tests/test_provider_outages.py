"""A provider that is down — every call failing for longer than its retries last — is waited for, not
given up on: the call is made again after a wait, a configured fallback provider answers meanwhile and
stays first while it does, the wait ends at once when the run must stop, and an outage longer than the
configured limit stops the run with one line. Against a fake service on loopback, real SDKs, real HTTP."""
from __future__ import annotations

import re
import time

import pytest

from conftest import config_with
from fakes.flaky import FlakyLLM, down_for
from fakes.llm_server import FakeLLM

from agent.llm.asking import ask
from agent.llm.providers import PROVIDERS, Meter, ProviderDown, ProviderStop
from agent.records import Message

KEY = "sk-test-outage-0001"
HI = [Message(role="user", content="hello")]
FAST = {"providers.retry.attempts": 2, "providers.retry.initial_s": 0.01, "providers.retry.max_s": 0.02,
        "providers.outage.wait_s": 0.05, "providers.outage.max_wait_s": 0.2, "providers.outage.give_up_s": 30}


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)


def setup(fake: FakeLLM, **more):
    cfg = config_with(**{"providers.openai.base_url": fake.openai_url, "providers.anthropic.base_url": fake.anthropic_url,
                         "providers.prices.m": {"input": 3.0, "output": 15.0}, **FAST, **more})
    return PROVIDERS["openai"](cfg.providers.openai, cfg.providers), Meter(cfg.providers)


def test_a_provider_down_longer_than_its_retries_is_asked_again_after_waits_and_the_exchange_says_so(keys):
    with FlakyLLM({"m": ["fine"]}, down=down_for(1.0)) as fake:
        llm, meter = setup(fake)
        notices: list[str] = []
        meter.notice = notices.append
        ex = ask(llm, meter, "m", "planner", "claim", "system", HI)
        calls = len(fake.seen)
    assert ex.reply == "fine" and ex.provider == "openai" and ex.model == "m"
    assert ex.attempts == calls > 2 * FAST["providers.retry.attempts"]        # more than two rounds of retries
    assert ex.note.startswith("openai down for ") and "answered by openai m" in ex.note
    waits = [n for n in notices if " down " in n]
    assert waits and all(re.fullmatch(r"openai down \d+ s \(\d+ calls, \d+ wait\(s\); last: openai: gave up after 2 "
                                      r"attempts; last: 503 fake outage\); asking again in \d+ s", n) for n in waits)
    assert "" in notices                                                     # the live line is cleared after
    assert meter.cost_usd == pytest.approx(ex.cost_usd) and ex.cost_usd > 0  # only the answer costs


def test_a_fallback_provider_takes_over_after_one_round_and_stays_first_while_the_provider_is_down(keys):
    with FlakyLLM({"fb-planner": ["a claim"], "fb-coder": ["some code"]}, down=lambda api: api == "openai") as fake:
        llm, meter = setup(fake, **{"providers.fallback": "anthropic", "providers.anthropic.planner_model": "fb-planner",
                                    "providers.anthropic.coder_model": "fb-coder",
                                    "providers.prices.fb-planner": {"input": 1.0, "output": 2.0},
                                    "providers.prices.fb-coder": {"input": 5.0, "output": 7.0}})
        plan = ask(llm, meter, "m", "planner", "claim", "system", HI)
        code = ask(llm, meter, "m", "coder", "code", "system", HI)
        asked = [s.api for s in fake.seen]
    assert (plan.provider, plan.model, plan.reply) == ("anthropic", "fb-planner", "a claim")
    assert (code.provider, code.model, code.reply) == ("anthropic", "fb-coder", "some code")
    assert asked == ["openai", "openai", "anthropic", "anthropic"]     # one round of retries, then the fallback first
    assert plan.attempts == 3 and code.attempts == 1
    assert plan.note.startswith("openai down for ") and plan.note.endswith("answered by anthropic fb-planner")
    assert code.note == ""                                              # asked first, it answered
    assert code.cost_usd == pytest.approx((code.input_tokens * 5.0 + code.output_tokens * 7.0) / 1e6, abs=1e-6)


def test_an_outage_longer_than_give_up_s_stops_with_one_line_naming_the_last_error(keys):
    with FlakyLLM({"m": ["never"]}, down=lambda api: True) as fake:
        llm, meter = setup(fake, **{"providers.outage.give_up_s": 0.3})
        with pytest.raises(ProviderStop) as stop:
            ask(llm, meter, "m", "planner", "claim", "system", HI)
    line = str(stop.value)
    assert not isinstance(stop.value, ProviderDown) and "\n" not in line
    assert line.startswith("openai down for ") and line.endswith(
        "past providers.outage.give_up_s (0.3 s); last: openai: gave up after 2 attempts; last: 503 fake outage")


def test_a_run_that_must_stop_ends_its_wait_for_a_provider_at_once(keys):
    with FlakyLLM({"m": ["never"]}, down=lambda api: True) as fake:
        llm, meter = setup(fake, **{"providers.outage.wait_s": 3600, "providers.outage.give_up_s": None})
        stop_at = time.monotonic() + 0.5
        meter.halt = lambda: "interrupted (SIGTERM)" if time.monotonic() > stop_at else ""
        with pytest.raises(ProviderDown) as down:
            ask(llm, meter, "m", "planner", "claim", "system", HI)
        assert time.monotonic() - stop_at < 1.0          # not the hour-long wait it was in
    assert str(down.value) == ("stopped waiting for openai: interrupted (SIGTERM); "
                               "last: openai: gave up after 2 attempts; last: 503 fake outage")
