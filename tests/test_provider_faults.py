"""A service that misbehaves costs a retry, never the run: through the real openai and anthropic SDKs
against the fake service on loopback, a 200 reply that is not the API's (a proxy's HTML page, invalid
JSON, a JSON string, garbage in the stream, a stream cut short) is retried with its content type and
first bytes named, then an outage; a hung call is cut at the idle timeout, a slow one at the whole-call
deadline, and any call at once when the run must stop, with a live line meanwhile; Retry-After and
retry-after-ms are honoured up to the cap and said; a reply over the size cap keeps its size and hash,
never its text; a call whose worst case passes the cost limit is not made; a service never reached
stops with one line naming it and its URL, one reached before is waited for with its clock from the
first failure."""
from __future__ import annotations

import hashlib
import re
import socket
import time

import pytest

from conftest import config_with
from fakes.flaky import FlakyLLM, down_for
from fakes.llm_server import FakeLLM, Step

from agent.llm.asking import ask, retold
from agent.llm.providers import PROVIDERS, Halted, Meter, ProviderDown, ProviderStop, check_keys
from agent.records import Message

KEY = "sk-test-faults-0001"
HI = [Message(role="user", content="hello")]
FAST = {"providers.retry.initial_s": 0.01, "providers.retry.max_s": 0.02, "providers.outage.give_up_s": 0,
        "providers.prices.m": {"input": 3.0, "output": 15.0}}
BOTH = pytest.mark.parametrize("name", ["openai", "anthropic"])


@pytest.fixture
def service(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    started: list[FakeLLM] = []

    def start(name, scripts, fake_type=FakeLLM, **more):
        fake = fake_type(scripts, **more.pop("fake", {})).__enter__()
        started.append(fake)
        cfg = config_with(**{"providers.openai.base_url": fake.openai_url, "providers.anthropic.base_url": fake.anthropic_url,
                             **FAST, **more})
        meter = Meter(cfg.providers)
        notices: list[str] = []
        meter.notice = notices.append
        return fake, PROVIDERS[name](getattr(cfg.providers, name), cfg.providers), meter, notices
    yield start
    for fake in started:
        fake.__exit__(None, None, None)


@BOTH
def test_a_reply_that_is_not_the_apis_is_retried_naming_its_content_type_and_first_bytes(service, name):
    steps = [Step.odd("html"), Step.odd("bad-json"), Step.odd("json-string"), Step.odd("garbage"), Step.odd("short"),
             "fine"]
    fake, llm, meter, _ = service(name, {"m": steps}, **{"providers.retry.attempts": 6})
    ex = ask(llm, meter, "m", "planner", "claim", "system", HI)
    assert ex.reply == "fine" and ex.attempts == 6 and len(fake.seen) == 6
    html, bad, string, garbage, short = ex.faults
    assert "malformed: Malformed: text/html; charset=utf-8, not the API's reply: '<!DOCTYPE html><html><head><title>502" in html
    assert "application/json, invalid JSON: '{\"id\": \"chatcmpl-fake\"" in bad
    assert "application/json, a JSON str, not an object: '\"upstream says" in string
    assert "text/event-stream, an event that is not JSON: '{\"choices\": [{\"delta\": <<garbage>>'" in garbage
    assert "ended before" in short
    assert meter.of(name).faults["malformed"] == 5 and meter.of(name).answered == 1


@BOTH
def test_a_service_that_keeps_sending_pages_is_down_after_its_retries_not_a_traceback(service, name):
    fake, llm, meter, _ = service(name, {"m": [Step.odd("html")] * 3}, **{"providers.retry.attempts": 3})
    with pytest.raises(ProviderStop) as stop:
        ask(llm, meter, "m", "planner", "claim", "system", HI)
    assert str(stop.value).startswith(f"{name}: gave up after 3 attempts; last: Malformed: text/html")
    assert len(fake.seen) == 3 and meter.cost_usd == 0


@BOTH
def test_a_hung_call_is_cut_at_the_idle_timeout_and_retried_with_a_live_line_meanwhile(service, name):
    fake, llm, meter, notices = service(name, {"m": [Step.odd("hang", 60), Step.odd("stall", 60, text="x" * 40), "fine"]},
                                        **{"providers.idle_timeout_s": 1.0, "providers.retry.attempts": 3})
    t0 = time.monotonic()
    ex = ask(llm, meter, "m", "planner", "claim", "system", HI)
    took = time.monotonic() - t0
    assert ex.reply == "fine" and 2.0 <= took < 8.0, took          # two idle timeouts, not a minute each
    assert [f.split(": ", 1)[1] for f in ex.faults] == ["timeout: silent for 1 s (providers.idle_timeout_s)"] * 2
    assert "waiting for m 0 s (call 1/3)" in notices and meter.of(name).faults["timeout"] == 2


@BOTH
def test_a_call_is_cut_at_its_whole_deadline_even_while_bytes_trickle(service, name):
    fake, llm, meter, _ = service(name, {"m": [Step.odd("stall", 3, text="x" * 40), "fine"]},
                                  **{"providers.timeout_s": 1.0, "providers.idle_timeout_s": 10.0})
    t0 = time.monotonic()
    ex = ask(llm, meter, "m", "planner", "claim", "system", HI)
    assert ex.reply == "fine" and time.monotonic() - t0 < 3.0
    assert ex.faults == [f"{name} call 1: timeout: CallTimeout: no whole reply in 1 s (providers.timeout_s)"]


@BOTH
def test_a_call_in_flight_ends_at_once_when_the_run_must_stop_and_nothing_is_bought_after(service, name):
    fake, llm, meter, _ = service(name, {"m": [Step.odd("hang", 60), "never"]}, **{"providers.idle_timeout_s": 120.0})
    stop_at = time.monotonic() + 0.5
    meter.halt = lambda: "time budget of 1 min spent" if time.monotonic() > stop_at else ""
    with pytest.raises(Halted) as halted:
        ask(llm, meter, "m", "planner", "claim", "system", HI)
    assert time.monotonic() - stop_at < 1.0 and halted.value.why == "time budget of 1 min spent"
    assert len(fake.seen) == 1 and meter.of(name).cut == 1
    with pytest.raises(Halted):                                     # spent: the next call is not made
        ask(llm, meter, "m", "planner", "claim", "system", HI)
    assert len(fake.seen) == 1


@BOTH
@pytest.mark.parametrize("header, value, waited", [("retry-after", "2", 2.0), ("retry-after-ms", "1500", 1.5),
                                                   ("retry-after", "300", 1.0)])
def test_retry_after_is_honoured_up_to_the_cap_and_said(service, name, header, value, waited):
    fake, llm, meter, notices = service(name, {"m": [Step.error(429, "slow down", {header: value}), "fine"]},
                                        **{"providers.retry.max_retry_after_s": 1.0 if value == "300" else 60.0})
    ex = ask(llm, meter, "m", "planner", "claim", "system", HI)
    gap = fake.seen[1].at - fake.seen[0].at
    assert ex.reply == "fine" and waited <= gap < waited + 1.0, gap
    asked = float(value) / (1000 if header.endswith("ms") else 1)
    assert f"(Retry-After {asked:g} s" in ex.faults[0] and any(f"(Retry-After {asked:g} s" in n for n in notices)
    assert ("capped at providers.retry.max_retry_after_s" in ex.faults[0]) == (value == "300")


@BOTH
def test_a_reply_over_the_size_cap_keeps_its_size_and_hash_never_its_text(service, name):
    huge = "y" * 300_000
    fake, llm, meter, _ = service(name, {"m": [huge]}, **{"providers.max_reply_chars": 1000})
    ex = ask(llm, meter, "m", "coder", "code", "system", HI)
    assert ex.reply == "" and ex.reply_chars == 300_000
    assert ex.reply_sha256 == hashlib.sha256(huge.encode()).hexdigest() and ex.output_tokens == 75_000
    assert f"over providers.max_reply_chars (1000): its text is not kept (sha256 {ex.reply_sha256})" in ex.note
    said, notice = retold(ex, llm.common)
    assert len(said) < 200 and "300000 characters" in said and "over the 1000 characters" in notice
    assert len(ex.model_dump_json()) < 2000


@BOTH
def test_a_call_whose_worst_case_passes_the_cost_limit_is_not_made(service, name):
    fake, llm, meter, _ = service(name, {"m": ["fine", "never"]})
    meter.limit_usd = 0.5                  # 16000 output tokens at $15/M: $0.24 a call at worst
    ask(llm, meter, "m", "planner", "claim", "system", HI)
    meter.cost_usd = 0.3
    with pytest.raises(Halted) as halted:
        ask(llm, meter, "m", "planner", "claim", "system", HI)
    assert len(fake.seen) == 1
    assert halted.value.why.startswith("cost limit of $0.5 reached: the next call (m) could cost up to $0.24")


@BOTH
def test_a_service_never_reached_stops_with_one_line_naming_it_and_its_url(service, name):
    with socket.socket() as s:                  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}" + ("/v1" if name == "openai" else "")
    cfg = config_with(**{f"providers.{name}.base_url": url, **FAST, "providers.outage.give_up_s": 3600,
                         "providers.outage.wait_s": 0.2, "providers.outage.unreached_s": 1.0})
    llm, meter = PROVIDERS[name](getattr(cfg.providers, name), cfg.providers), Meter(cfg.providers)
    t0 = time.monotonic()
    with pytest.raises(ProviderStop) as stop:
        ask(llm, meter, "m", "planner", "claim", "system", HI)
    line = str(stop.value)
    assert not isinstance(stop.value, ProviderDown) and "\n" not in line and time.monotonic() - t0 < 5
    assert line.startswith(f"{name}: {url} never answered since the run started (")
    assert line.endswith(f"check providers.{name}.base_url and that the service is up, or set "
                         "providers.outage.unreached_s: null to wait for it")
    with pytest.raises(ProviderStop, match=f"^{name}: {url} never answered"):
        check_keys(cfg.providers, name)


def test_a_service_lost_after_it_answered_is_waited_for_with_the_clock_from_its_first_failure(service):
    fake, llm, meter, notices = service("openai", {"m": ["first", "back"]}, fake_type=FlakyLLM,
                                        **{"providers.retry.attempts": 2, "providers.retry.initial_s": 0.3,
                                           "providers.retry.max_s": 0.3, "providers.outage.wait_s": 0.2,
                                           "providers.outage.max_wait_s": 0.2, "providers.outage.give_up_s": 60,
                                           "providers.outage.unreached_s": 0.1})
    ask(llm, meter, "m", "planner", "claim", "system", HI)
    fake.down = down_for(2.5)                    # reached once: never "unreached", however long it is down
    ex = ask(llm, meter, "m", "planner", "claim", "system", HI)
    failed = [s.at for s in fake.seen[1:-1]]
    waits = int(re.search(r"\((\d+) wait\(s\)\)", ex.note).group(1))
    assert ex.reply == "back" and waits >= 1 and meter.of("openai").outages == 1    # one outage, however many rounds
    assert meter.of("openai").outage_s == pytest.approx(fake.seen[-1].at - failed[0], abs=0.3)
    counts = [n for n in notices if " down " in n]
    assert len({n.split(" (")[0] for n in counts}) > 1              # the clock on screen moves


@pytest.mark.parametrize("key, value, words", [
    ("providers.idle_timeout_s", 0, "greater than 0"), ("providers.max_reply_chars", 10, "greater than or equal to 1000"),
    ("providers.retry.max_retry_after_s", -1, "greater than or equal to 0"),
    ("providers.outage.unreached_s", "soon", "valid number"), ("providers.retry.retry_after_cap", 5, "Extra inputs")])
def test_the_call_settings_are_checked_when_the_config_loads(key, value, words):
    with pytest.raises(Exception, match=words):
        config_with(**{key: value})
