"""GPTQ's in-batch sweep on the fastest path of a device, with the bytes of the reference's on that device.

The sweep (:func:`fp4convert.numerics.gptq.sweep_batch`, docs/numerics.md "GPTQ" step 3) walks a column
batch one column at a time; the reference does it as a Python loop of torch operations over the rows
(about twenty per column, a search rule's scale choice a few hundred per scale block), which on a CPU
is almost all of a block's GPTQ time (benchmarks/gptq_cpu_profile.md). The compiled kernels do the same
operations in the same order: ``csrc/fp4c_gptq.cu`` on a GPU, ``fp4c_cpu_gptq_sweep`` in
``csrc/fp4c_cpu.cpp`` on the CPU (tests/kernels/test_cpu_kernel_gptq.py compares it with the reference
byte for byte). :func:`sweep_for` picks one; every one has :data:`~fp4convert.numerics.gptq.Sweep`'s
signature.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp4convert.kernels import cpu_lib
from fp4convert.numerics import gptq
from fp4convert.numerics import reference as ref
from fp4convert.numerics.scheme import SCHEMES

if TYPE_CHECKING:
    import torch

CUDA_MAX_BLOCK = 384  # the CUDA sweep holds a batch's rows in 48 KB of shared memory


def cpu_sweep(w1: torch.Tensor, u1: torch.Tensor, scheme: str, rule: str, amax: torch.Tensor | None,
              iw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~fp4convert.numerics.gptq.sweep_batch` on the compiled CPU kernel: its signature and its
    bytes. The reference itself where the kernel does not apply (no kernel, another device or dtype, an
    NVFP4 batch without an amax) and where a block holds NaN/Inf when its scale is chosen (the
    reference's own error is then raised). ``w1`` is not changed."""
    import torch

    lib = cpu_lib.get()
    sch = SCHEMES[scheme]
    ok = (lib is not None and w1.device.type == "cpu" and u1.device.type == "cpu" and w1.dtype == torch.float32
          and u1.dtype == torch.float32 and w1.dim() == 2 and tuple(u1.shape) == (w1.shape[1], w1.shape[1])
          and w1.shape[1] % sch.block_size == 0 and (amax is not None or not sch.global_scale))
    if lib is None or not ok:
        return gptq.sweep_batch(w1, u1, scheme, rule, amax, iw)
    gs = None
    if sch.global_scale:
        assert amax is not None
        a = amax.to(torch.float32).reshape(())
        if not bool(torch.isfinite(a)):
            return gptq.sweep_batch(w1, u1, scheme, rule, amax, iw)  # (it raises the reference's error)
        gs = float(ref.global_scale(a))
    if iw is not None:
        ref.check_input_weight(iw, w1.shape[1], sch.block_size)  # the reference's refusal of a bad weight
    got = cpu_lib.gptq_sweep(lib, w1, u1, scheme, rule, gs, iw if sch.rule(rule).searches else None)
    if got is None:
        return gptq.sweep_batch(w1, u1, scheme, rule, amax, iw)  # (a non-finite block: it raises there)
    return got


def sweep_for(device: torch.device, block: int = gptq.BLOCK) -> gptq.Sweep:
    """The fastest sweep for GPTQ on ``device`` with column batches of ``block``: the CUDA kernel on a GPU
    (batches up to :data:`CUDA_MAX_BLOCK`), the compiled CPU kernel on the CPU when it builds, else the
    reference. All give the reference's bytes on that device."""
    if device.type == "cuda" and block <= CUDA_MAX_BLOCK:
        from fp4convert.kernels.cuda.ops import gptq_sweep

        return gptq_sweep
    if device.type == "cpu" and cpu_lib.get() is not None:
        return cpu_sweep
    return gptq.sweep_batch
