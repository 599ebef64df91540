"""The providers, through the real openai and anthropic SDKs against a fake service on loopback:
what is retried (rate limits, server errors, overload), what stops a run at once with one line
(authentication, an unknown model, a request too long), what a call costs, where the key goes."""
from __future__ import annotations

import pytest

from conftest import config_with
from fakes.llm_server import FakeLLM, Step
from harness.config import ConfigError

from agent.llm.asking import ask
from agent.llm.providers import PROVIDERS, Meter, ProviderStop, check_keys
from agent.records import Message

KEY = "sk-test-provider-0001"
HI = [Message(role="user", content="hello")]


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)

    def start(scripts, keys=None, **more):
        fake = FakeLLM(scripts, keys=keys).__enter__()
        cfg = config_with(**{"providers.openai.base_url": fake.openai_url, "providers.anthropic.base_url": fake.anthropic_url,
                             "providers.retry.initial_s": 0.01, "providers.retry.max_s": 0.02,
                             "providers.prices.m": {"input": 3.0, "output": 15.0}, **more})
        started.append(fake)
        return fake, cfg, Meter(cfg.providers)
    started: list[FakeLLM] = []
    yield start
    for fake in started:
        fake.__exit__(None, None, None)


def llm(cfg, name):
    return PROVIDERS[name](getattr(cfg.providers, name), cfg.providers)


@pytest.mark.parametrize("name", ["openai", "anthropic"])
def test_rate_limits_and_server_errors_are_retried_until_a_reply_comes(service, name):
    fake, cfg, meter = service({"m": [Step.error(429), Step.error(500), Step.error(503), "fine"]})
    ex = ask(llm(cfg, name), meter, "m", "planner", "claim", "system", HI)
    assert ex.reply == "fine" and ex.attempts == 4 and len(fake.seen) == 4


def test_anthropic_overload_529_is_retried(service):
    fake, cfg, meter = service({"m": [Step.error(529), "fine"]})
    assert ask(llm(cfg, "anthropic"), meter, "m", "coder", "code", "system", HI).attempts == 2


@pytest.mark.parametrize("name", ["openai", "anthropic"])
@pytest.mark.parametrize("status, words", [
    (401, "authentication failed (401 bad key); check {env}"),
    (404, "unknown model or endpoint (404 no such model)"),
    (400, "request refused, not retried (400 prompt is too long: 250000 tokens > 200000 maximum)"),
])
def test_errors_retrying_cannot_fix_stop_at_once_with_one_line(service, name, status, words):
    message = {401: "bad key", 404: "no such model", 400: "prompt is too long: 250000 tokens > 200000 maximum"}[status]
    fake, cfg, meter = service({"m": [Step.error(status, message), "never sent"]})
    with pytest.raises(ProviderStop) as stop:
        ask(llm(cfg, name), meter, "m", "planner", "claim", "system", HI)
    line = str(stop.value)
    assert line == f"{name}: " + words.format(env=f"{name.upper()}_API_KEY") and "\n" not in line
    assert len(fake.seen) == 1 and meter.cost_usd == 0


def test_retries_that_run_out_stop_the_run_naming_the_last_error(service):
    fake, cfg, meter = service({"m": [Step.error(500, "upstream down")] * 3},
                               **{"providers.retry.attempts": 3, "providers.outage.give_up_s": 0})   # no waiting
    with pytest.raises(ProviderStop, match=r"^openai: gave up after 3 attempts; last: 500 upstream down$"):
        ask(llm(cfg, "openai"), meter, "m", "planner", "claim", "system", HI)
    assert len(fake.seen) == 3


def test_cost_of_each_call_and_the_totals_come_from_the_price_table(service):
    fake, cfg, meter = service({"m": ["a" * 400, "b" * 800]})
    first = ask(llm(cfg, "openai"), meter, "m", "planner", "claim", "system", HI)
    second = ask(llm(cfg, "anthropic"), meter, "m", "coder", "code", "system", HI)
    for ex in (first, second):                     # the fake counts a token per 4 characters
        assert ex.output_tokens == len(ex.reply) // 4 and ex.input_tokens > 0
        assert ex.cost_usd == pytest.approx((ex.input_tokens * 3.0 + ex.output_tokens * 15.0) / 1e6, abs=1e-6)
    assert meter.cost_usd == pytest.approx(first.cost_usd + second.cost_usd, abs=1e-6)
    assert (meter.input_tokens, meter.output_tokens) == (first.input_tokens + second.input_tokens, 300)


def test_the_key_travels_only_in_the_auth_header_and_never_into_the_exchange(service):
    fake, cfg, meter = service({"m": ["fine", "fine"]})
    exchanges = [ask(llm(cfg, name), meter, "m", "planner", "claim", "system", HI) for name in ("openai", "anthropic")]
    for seen in fake.seen:
        assert KEY not in str(seen.body)
        assert any(KEY in v for k, v in seen.headers.items() if k.lower() in ("authorization", "x-api-key"))
    assert all(KEY not in ex.model_dump_json() for ex in exchanges)


def test_a_needed_key_that_is_unset_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = config_with()
    with pytest.raises(ConfigError, match="^OPENAI_API_KEY is not set; providers.openai needs it"):
        llm(cfg, "openai")
    keyless = config_with(**{"providers.openai.api_key_env": None, "providers.openai.base_url": "http://127.0.0.1:9/v1"})
    assert llm(keyless, "openai").key == "unused"           # a local server without keys


def test_a_model_without_a_price_is_a_config_error():
    with pytest.raises(Exception, match="prices has no entry for 'gpt-unpriced'"):
        config_with(**{"providers.openai.coder_model": "gpt-unpriced"})


@pytest.mark.parametrize("name", ["openai", "anthropic"])
def test_a_refused_key_stops_at_the_check_before_any_tokens_are_spent(service, name):
    fake, cfg, _ = service({"m": ["never sent"]}, keys={"sk-the-right-one"})
    with pytest.raises(ProviderStop) as stop:
        check_keys(cfg.providers, name)
    assert str(stop.value) == (f"{name}: authentication failed (401 fake: incorrect API key provided); "
                               f"check {name.upper()}_API_KEY")
    assert len(fake.listed) == 1 and fake.seen == []


def test_the_check_passes_a_taken_key_and_tries_the_fallbacks_too(service):
    fake, cfg, _ = service({"m": ["never sent"]}, keys={KEY}, **{"providers.fallback": "anthropic"})
    check_keys(cfg.providers, "openai")
    assert [s.api for s in fake.listed] == ["openai", "anthropic"] and fake.seen == []


def test_a_refused_fallback_key_stops_the_check_as_well(service, monkeypatch):
    fake, cfg, _ = service({"m": ["never sent"]}, keys={KEY}, **{"providers.fallback": "anthropic"})
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-wrong")
    with pytest.raises(ProviderStop, match="^anthropic: authentication failed .*; check ANTHROPIC_API_KEY$"):
        check_keys(cfg.providers, "openai")


def test_a_compatible_server_without_a_models_endpoint_leaves_the_run_to_its_own_retries(monkeypatch):
    """A compatible server without a models endpoint is no verdict on the key: the check lets the run start."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeLLM({"m": ["never sent"]}, keys={"sk-other"}, lists_models=False) as fake:
        check_keys(config_with(**{"providers.openai.base_url": fake.openai_url}).providers, "openai")
    assert len(fake.listed) == 1 and fake.seen == []
