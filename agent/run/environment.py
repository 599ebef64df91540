"""Where a run ran: GPU, driver, torch / triton / Python versions, and the kevo commit. For the
ledger's first commit; nothing secret (no environment variables, no host name)."""
from __future__ import annotations

import platform
import subprocess

import git
import torch

from harness.config import PROJECT_ROOT


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def _kevo_commit() -> str:
    try:
        repo = git.Repo(PROJECT_ROOT)
        return repo.head.commit.hexsha + (" (with uncommitted changes)" if repo.is_dirty() else "")
    except (git.exc.InvalidGitRepositoryError, git.exc.NoSuchPathError, git.exc.GitCommandError, ValueError) as e:
        return f"unknown ({type(e).__name__})"     # not a checkout, or no commit yet: say so


def describe(device: torch.device) -> dict:
    import triton       # here, not at import: importing triton fixes its interpreter mode for the process
    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": str(torch.__version__),
           "triton": triton.__version__, "cuda_runtime": torch.version.cuda or "none", "device": device.type,
           "kevo_commit": _kevo_commit()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1), driver=_driver())
    else:
        env.update(gpu="none", driver="none", note="CPU only: Triton's interpreter, float32; no timing")
    return env


_WHERE = ("device", "gpu", "kevo_commit")


def where(env: dict) -> dict[str, str]:
    """Where a run ran, of an environment (`describe`'s, or a run's environment.json): device, GPU, kevo commit."""
    return {k: str(env.get(k, "unknown")) for k in _WHERE}
