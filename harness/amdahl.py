"""Amdahl's law, the one place it is computed: the end-to-end ceiling of making one share of a step faster.

Used by the profile's ceilings (harness/profile.py) and by every claim's ceiling (agent/records.py).
Not here: where the share comes from (the profile) or what a ceiling is compared with (the agent).
"""
from __future__ import annotations

import math


def ceiling(f: float, s: float) -> float:
    """End-to-end speedup when a share f of the step gets s times faster: 1/(1-f+f/s); s may be inf."""
    rest = 1 - f + (0 if math.isinf(s) else f / s)
    return math.inf if rest <= 0 else 1 / rest
