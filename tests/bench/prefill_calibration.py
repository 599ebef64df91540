"""Benchmark (not a test): torch's per-sequence prefill with SDPA as it chooses (cuDNN on the H200) and without
its cuDNN kernel, on fresh lengths: seconds and error against the float64 reference.

    python tests/bench/prefill_calibration.py

Parity's tolerance is a torch way's own error against float64 on each check's inputs, and a check's lengths are
fresh; cuDNN builds an execution plan for each shape it has not met. Four length mixes (129 prompts of about
127 tokens, as the served-limit step; nearly the same 129 again, so lengths met before; 10 mixed boundary lengths;
4 long ones), each twice, the second time with every length moved again by up to 3 tokens (some new, some met),
bf16, 16 q / 8 kv heads, d 128: `prefill_baseline` as it is and
inside `sdpa_kernel([FLASH, EFFICIENT, MATH])` (what `prefill_calibration` runs), one synchronized call each, and
both errors. Prints numbers only; CUDA.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.stages.common import diff  # noqa: E402
from harness.targets.attention import prefill_reference  # noqa: E402
from harness.targets.attention_baselines import prefill_baseline  # noqa: E402

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    mixes = ([127] * 129, [16384 // 129] * 128 + [16384 - 128 * (16384 // 129)],
             [1, 15, 16, 17, 63, 64, 65, 127, 128, 129], [512, 1024, 2048, 777])
    for lens in mixes:
        for trial in range(2):
            g = torch.Generator(device="cpu").manual_seed(trial)
            lens = [max(1, n + int(torch.randint(-3, 4, (1,), generator=g))) for n in lens]
            total = sum(lens)
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
            q = torch.randn(total, 16, 128, device=dev).bfloat16()
            k = torch.randn(total, 8, 128, device=dev).bfloat16()
            v = torch.randn_like(k)
            ref = prefill_reference(q, k, v, cu, max(lens), 0.088)
            for name, backends in (("default", None), ("no-cudnn", NO_CUDNN)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if backends is None:
                    out = prefill_baseline(q, k, v, cu, max(lens), 0.088)
                else:
                    with sdpa_kernel(backends):
                        out = prefill_baseline(q, k, v, cu, max(lens), 0.088)
                torch.cuda.synchronize()
                t = time.perf_counter() - t0
                d = diff(out, ref)
                print(f"{len(lens)} seqs T={total} trial {trial} {name:9s} {t * 1e3:8.1f} ms  "
                      f"max_abs {d.max_abs:.3e} rel_l2 {d.rel_l2:.3e}", flush=True)


if __name__ == "__main__":
    main()
