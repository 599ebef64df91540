"""A run's settings: target, proposer and models, budgets, where its ledger is — from the config and the
command line for a new run, and from the ledger itself for a resumed one.

A resumed run (`--resume runs/<id>`, or `--run-id` of an existing run) keeps the settings in force when it
last ran (settings.json in its last commit; run.json for ledgers older than that) unless the command line
gives others. The target cannot change (the heads and the history belong to it); the proposer and its
models can. Budgets are the run's totals over all its sessions: candidates, cost and device time as
recorded in the ledger, wall time as the sum of each session's running time up to its last commit. So
`--budget-minutes 60` on a resumed run means an hour in all, not another hour.
Not here: running (loop), the ledger's files (ledger).
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from harness.config import PROJECT_ROOT, Config

from agent.ledger.repository import Ledger
from agent.ledger.store import folder_state
from agent.records import Record
from agent.run.session import RunBusy, check_free


class RunError(Exception):
    """The run cannot start as asked; one line."""


class RunSettings(Record):
    target: str
    provider: str
    planner_model: str
    coder_model: str
    budget_minutes: float               # wall time, all sessions together
    max_candidates: int | None
    max_cost_usd: float
    max_device_minutes: float | None = None   # the evaluator's stage time, all sessions together
    run_id: str
    root: str = ""                      # the ledger's folder; "" means agent.runs_dir/run_id


def runs_dir(cfg: Config) -> Path:
    runs = Path(cfg.agent.runs_dir)
    return runs if runs.is_absolute() else PROJECT_ROOT / runs


def _free(root: Path) -> None:
    try:
        check_free(root)
    except RunBusy as e:
        raise RunError(str(e)) from None


def run_folder(cfg: Config, run_id: str | None = None, resume: str | None = None) -> Path | None:
    """The ledger folder named by --resume (a path, or a run id under agent.runs_dir) or --run-id.
    RunBusy if a run holds it (before anything else: a run just started has no commit yet)."""
    if resume is not None:
        given = Path(resume)
        root = given if given.is_dir() else runs_dir(cfg) / resume
        _free(root)
        if folder_state(root) not in ("started", "unstarted"):
            raise RunError(f"--resume {resume}: no kevo run there (nor under {runs_dir(cfg)})")
        return root.resolve()
    if run_id is None:
        return None
    _free(runs_dir(cfg) / run_id)
    return runs_dir(cfg) / run_id


def stored(root: Path) -> dict | None:
    """The settings a started run last ran with, read from its last commit; None for a run not started."""
    if folder_state(root) != "started":
        return None
    ledger = Ledger(root)
    text = ledger.committed("settings.json")
    if text is not None:
        return json.loads(text)
    header = json.loads(ledger.committed("run.json") or "{}")     # a ledger from before settings.json
    keys = ("target", "provider", "planner_model", "coder_model", "budget_minutes", "max_candidates", "max_cost_usd")
    return {k: header[k] for k in keys if k in header} | {"run_id": header.get("id", root.name)}


def settings_from(cfg: Config, device_type: str, target: str | None = None, provider: str | None = None,
                  model: str | None = None, budget_minutes: float | None = None, max_candidates: int | None = None,
                  max_cost_usd: float | None = None, run_id: str | None = None, max_device_minutes: float | None = None,
                  resume: str | None = None) -> RunSettings:
    root = run_folder(cfg, run_id, resume)
    before = stored(root) if root is not None else None
    if before is None:                                  # a new run (or one stopped before its first commit)
        provider = provider or cfg.agent.provider
        pcfg = getattr(cfg.providers, provider, None)
        return RunSettings(
            target=target or "attention", provider=provider,
            planner_model=model or (pcfg.planner_model if pcfg else ""),
            coder_model=model or (pcfg.coder_model if pcfg else ""),
            budget_minutes=budget_minutes or getattr(cfg.agent.budget_minutes, device_type),
            max_candidates=max_candidates or cfg.agent.max_candidates,
            max_cost_usd=cfg.agent.max_cost_usd if max_cost_usd is None else max_cost_usd,
            max_device_minutes=max_device_minutes or cfg.agent.max_device_minutes,
            run_id=root.name if root is not None else datetime.now().strftime("%Y%m%d-%H%M%S-") + provider,
            root=str(root) if root is not None else "")
    if target is not None and target != before["target"]:
        raise RunError(f"{root} is a run of {before['target']}; it cannot be resumed as {target}")
    provider = provider or before["provider"]
    pcfg = getattr(cfg.providers, provider, None)
    same = provider == before["provider"]
    return RunSettings(
        target=before["target"], provider=provider,
        planner_model=model or (before.get("planner_model", "") if same else pcfg.planner_model if pcfg else ""),
        coder_model=model or (before.get("coder_model", "") if same else pcfg.coder_model if pcfg else ""),
        budget_minutes=budget_minutes or before["budget_minutes"],
        max_candidates=max_candidates or before.get("max_candidates"),
        max_cost_usd=before["max_cost_usd"] if max_cost_usd is None else max_cost_usd,
        max_device_minutes=max_device_minutes or before.get("max_device_minutes"),
        run_id=before.get("run_id", root.name), root=str(root))
