"""The registry of targets: name -> Target. A new target is a module beside attention.py and a line here.

`TARGETS` holds each target as its module defines it; `configured(name, cfg)` is the target as config.yaml
sets it up (its ops' baselines chosen by `targets.<name>`), what the harness judges and serves with."""
from harness.targets.attention import TARGET as ATTENTION
from harness.targets.base import Case, Cost, Inputs, Op, Target

TARGETS: dict[str, Target] = {ATTENTION.name: ATTENTION}


def configured(name: str, cfg) -> Target:
    """TARGETS[name] with the baselines config `targets.<name>` chooses (e.g. targets.attention.decode_baseline)."""
    return TARGETS[name].configured(getattr(cfg.targets, name).baselines())


__all__ = ["TARGETS", "Case", "Cost", "Inputs", "Op", "Target", "configured"]
