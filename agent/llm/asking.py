"""One recorded exchange with an LLM, made through outages (`ask`), and what a repair round shows of it.

`ask` calls the run's provider (agent/llm/providers.py: one bounded call, retried); when its retries run out
it is down: the fallback provider is asked if one is configured (`providers.fallback`, with its own
models; it stays first while it answers), else the call waits (`providers.outage`: doubling waits,
capped, with a live count of the time down since the first failed call) and is made again, for up to
`give_up_s`, until the run must stop (`Meter.halt`: a signal, the time budget) or a service never
reached stops it. Each outage's calls and seconds are counted in `Meter.fared`; the failed calls and
their causes go into the exchange (`Exchange.faults`). An answered exchange is handed to `Meter.paid`
at once (the loop commits it); one an earlier session paid for is taken from `Meter.prepaid` instead of
asked again. `retold` is what a repair round sends back of a reply that could not be used;
`ask_until_usable` is the round itself, the planner's and the coder's alike.
Not here: one call (providers), what is asked or what a reply means (planner, coder).
"""
from __future__ import annotations

import time

from harness.config import ProvidersConfig

from agent.llm.meter import Meter
from agent.llm.prompts import render
from agent.llm.providers import LLM, Halted, ProviderDown, ProviderStop, pause
from agent.records import Exchange, Message


def _outlast(llm: LLM, meter: Meter, model: str, role: str, system: str, messages: list[Message]):
    """(reply, calls, the LLM that answered, its model, a note on the outage, the failed calls): `llm`, its
    fallback while it is down, waiting between rounds as `llm.outage` says. Raises ProviderStop when nothing
    can fix it, Halted when the run must stop."""
    outage, fallback = getattr(llm, "outage", None), getattr(llm, "fallback", None)
    chain = [(llm, model)] + ([(fallback, getattr(fallback.pcfg, f"{role}_model"))] if fallback is not None else [])
    if getattr(llm, "prefer_fallback", False):
        chain.reverse()
    calls, since, wait, waits, down, faults, last = 0, 0.0, outage.wait_s if outage else 0.0, 0, [], [], ""

    def lost() -> None:                  # the outage ends without an answer: its time counts all the same
        for name in down:
            meter.of(name).outage_s += time.monotonic() - since
    while True:
        for who, m in chain:
            try:
                reply, n = who.complete(m, system, messages, meter)
            except Halted as e:
                lost()
                raise Halted(e.why, calls + e.attempts, faults + e.faults) from None
            except ProviderDown as e:
                calls, last, since = calls + e.attempts, str(e), since or e.first or time.monotonic()
                faults += [f"{who.name} {f}" for f in e.faults]
                if who.name not in down:                    # one outage, however many rounds it lasts
                    meter.of(who.name).outages += 1
                    down.append(who.name)
                if outage is None or (outage.give_up_s == 0 and fallback is None):
                    lost()
                    raise ProviderStop(last) from None      # configured not to wait
                continue
            except ProviderStop:
                lost()
                raise
            if fallback is not None:
                llm.prefer_fallback = who is fallback      # the one that answered is asked first next time
            lost()
            note = "" if not down else (f"{' and '.join(down)} down for {time.monotonic() - since:.0f} s "
                                        f"({waits} wait(s)); answered by {who.name} {m}")
            return reply, calls + n, who, m, note, faults + [f"{who.name} {f}" for f in reply.faults]
        names, lasted = " and ".join(down), time.monotonic() - since
        if outage.give_up_s is not None and lasted + wait > outage.give_up_s:
            lost()
            raise ProviderStop(f"{names} down for {lasted / 60:.1f} min, past providers.outage.give_up_s "
                               f"({outage.give_up_s:g} s); last: {last}")
        for who, _ in chain:
            if stop := getattr(who, "_unreached", lambda f, s: "")(meter.of(who.name), wait):
                lost()
                raise ProviderStop(stop)
        faults.append(f"{names} down: waited {wait:.0f} s")

        def say(left: float) -> None:
            meter.notice(f"{names} down {time.monotonic() - since:.0f} s ({calls} calls, {waits} wait(s); last: "
                         f"{last[:120]}); asking again in {left:.0f} s")
        if why := pause(wait, meter.halt, say):
            lost()
            raise Halted(f"stopped waiting for {names}: {why}; last: {last}", calls, faults)
        waits, wait = waits + 1, min(wait * 2 if wait else 1.0, outage.max_wait_s)


def ask(llm: LLM, meter: Meter, model: str, role: str, purpose: str, system: str,
        messages: list[Message]) -> Exchange:
    """One recorded exchange, made through outages, handed to `meter.paid` as soon as it is answered; one
    an earlier session paid for is taken from `meter.prepaid` instead. Raises ProviderStop (Halted when the
    run must stop); a reply cut short or over the size cap is returned, marked in `note`."""
    if (ex := meter.take_prepaid(role, purpose)) is not None:
        return ex.model_copy(update={"note": "; ".join(n for n in (ex.note, "paid for in an earlier session: not asked again") if n)})
    t0 = time.monotonic()
    try:
        reply, attempts, who, used, outage_note, faults = _outlast(llm, meter, model, role, system, messages)
    finally:
        meter.notice("")
    cost = meter.charge(used, reply.input_tokens, reply.output_tokens)
    cap = getattr(getattr(who, "common", None), "max_reply_chars", 0)
    notes = [outage_note, "the reply was cut at the output-token limit" if reply.cut else "",
             f"the reply was {reply.chars} characters, over providers.max_reply_chars ({cap}): its text is not kept "
             f"(sha256 {reply.sha256})" if reply.over else "",
             "the service reported no token usage: tokens estimated at 4 characters each" if reply.estimated else ""]
    ex = Exchange(role=role, purpose=purpose, provider=who.name, model=used, system=system, messages=messages,
                  reply=reply.text, input_tokens=reply.input_tokens, output_tokens=reply.output_tokens,
                  cost_usd=round(cost, 6), attempts=attempts, seconds=round(time.monotonic() - t0, 3),
                  note="; ".join(n for n in notes if n), finish=reply.finish, faults=faults,
                  reply_chars=reply.chars if reply.over else 0, reply_sha256=reply.sha256)
    meter.paid(ex)
    return ex


def retold(ex: Exchange, common: ProvidersConfig) -> tuple[str, str]:
    """What a repair round shows of a reply that could not be used: (the assistant's turn as sent back, a notice
    for the repair prompt). A reply over the size cap is never sent back; one cut at the output-token limit is
    said to have been cut."""
    if ex.reply_sha256:
        return (render("reply_withheld", chars=str(ex.reply_chars)),
                render("reply_over", chars=str(ex.reply_chars), cap=str(common.max_reply_chars)))
    cut = ex.finish in ("length", "max_tokens") or "cut at the output-token limit" in ex.note
    return ex.reply or "(empty)", render("reply_cut", limit=str(common.max_output_tokens)) if cut else ""


def ask_until_usable(llm: LLM, meter: Meter, model: str, role: str, purposes: tuple[str, ...], system: str,
                     prompt: str, read, repair: str, common: ProvidersConfig) -> tuple[object, list[Exchange], str]:
    """Ask once per purpose until `read(exchange)` -> (value or None, what was wrong, a note for the exchange)
    gives a value; after a reply it cannot use, the next ask carries that reply (`retold`) and the role's
    repair prompt (`repair`, a prompt file with `notice` and `error`). Returns (the value or None, the
    exchanges, the last error)."""
    messages = [Message(role="user", content=prompt)]
    exchanges: list[Exchange] = []
    error = ""
    for purpose in purposes:
        ex = ask(llm, meter, model, role, purpose, system, messages)
        value, error, note = read(ex)
        exchanges.append(ex.model_copy(update={"note": "; ".join(n for n in (ex.note, note) if n)}) if note else ex)
        if value is not None:
            return value, exchanges, ""
        said, notice = retold(ex, common)
        messages = messages + [Message(role="assistant", content=said),
                               Message(role="user", content=render(repair, notice=notice and notice + "\n", error=error))]
    return None, exchanges, error
