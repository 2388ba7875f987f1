"""One launch per scale rule at 16384x16384 bf16, for Nsight Compute (instruction mix, stalls).

    ncu --kernel-name regex:quantize_kernel --launch-skip 6 --section SchedulerStats \\
        --section WarpStateStats --section InstructionStats python benchmarks/device/profile_rules.py
"""

from __future__ import annotations

import torch

from fp4convert.kernels.cuda import ops

x = torch.randn(1, 16384, 16384, device="cuda").to(torch.bfloat16)
amax = ops.amax(x, None)
for scheme, rules in (("nvfp4", ("max", "4over6", "mse")), ("mxfp4", ("floor", "mse"))):
    for rule in rules:  # twice: the first round is warm-up (skipped by --launch-skip)
        ops.quantize(x, scheme, amax if scheme == "nvfp4" else None, None, False, rule)
for scheme, rules in (("nvfp4", ("max", "4over6", "mse")), ("mxfp4", ("floor", "mse"))):
    for rule in rules:
        ops.quantize(x, scheme, amax if scheme == "nvfp4" else None, None, False, rule)
torch.cuda.synchronize()
