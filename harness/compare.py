"""How a candidate's output is compared with the float64 reference: the difference (`diff`) and what a check
admits (`Tolerance`). One place for parity (harness/stages) and the served process's spot checks
(harness/served/spot.py); what sets a check's tolerance is each caller's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Diff:
    max_abs: float
    rel_l2: float
    nonfinite: int
    first_bad: list[str]

    def describe(self) -> str:
        bad = f"; first mismatches {', '.join(self.first_bad)}" if self.first_bad else ""
        nf = f"{self.nonfinite} NaN/Inf values; " if self.nonfinite else ""
        return f"{nf}max abs error {self.max_abs:.3g}, relative L2 error {self.rel_l2:.3g}{bad}"


@dataclass(frozen=True)
class Tolerance:
    max_abs: float
    rel_l2: float

    def admits(self, d: Diff) -> bool:
        return d.nonfinite == 0 and d.max_abs <= self.max_abs and d.rel_l2 <= self.rel_l2

    @classmethod
    def beside(cls, torch_error: Diff, factor: float, floor_abs: float, floor_rel: float) -> "Tolerance":
        """Parity's rule: `factor` times torch's own error on the same inputs, never under the dtype's floors."""
        return cls(max(factor * torch_error.max_abs, floor_abs), max(factor * torch_error.rel_l2, floor_rel))


def diff(out: torch.Tensor, ref: torch.Tensor, atol: float | None = None) -> Diff:
    out64, ref64 = out.double(), ref.double()
    err = (out64 - ref64).abs()
    nonfinite = int((~torch.isfinite(out64)).sum())
    err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
    max_abs = float(err.max()) if err.numel() else 0.0
    rel = float(torch.linalg.vector_norm(torch.nan_to_num(out64 - ref64, nan=1e30)) /
                torch.linalg.vector_norm(ref64).clamp_min(1e-30)) if err.numel() else 0.0
    first = []
    if atol is not None:
        bad = (err > atol).flatten().nonzero()[:3, 0].tolist()
        for flat in bad:
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), out.shape))
            first.append(f"{list(idx)}: got {float(out64.flatten()[flat]):.4g}, expected {float(ref64.flatten()[flat]):.4g}")
    return Diff(max_abs, min(rel, 1e30), nonfinite, first)
