"""GPTQ's CUDA sweep (csrc/fp4c_gptq.cu) against the reference sweep on the same GPU, byte for byte (needs
a CUDA GPU; skips without). docs/numerics.md "GPTQ": the lazy batch update and the factorization are
torch's on both sides, so on one device the whole result must be identical."""

from __future__ import annotations

import pytest
import torch

from fp4convert.numerics import gptq
from fp4convert.numerics.scheme import SCHEMES

try:
    from fp4convert.kernels.cuda import ops
    AVAILABLE = ops.available()
except Exception:  # noqa: BLE001 - no CUDA build of torch: the tests skip
    AVAILABLE = False

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not AVAILABLE, reason="needs a CUDA GPU (capability >= 8.9) and nvcc")]

CASES = [(s, r) for s in ("nvfp4", "mxfp4") for r in SCHEMES[s].scale_rules]


def hessian(k: int, seed: int, dead: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(4 * k, k // 2, generator=g)
    x = z @ torch.randn(k // 2, k, generator=g) + 0.1 * torch.randn(4 * k, k, generator=g)
    x[:, list(dead)] = 0.0
    return (x.double().T @ x.double()).cuda()


def both(w: torch.Tensor, h: torch.Tensor, scheme: str, rule: str, act_order: bool, block: int = gptq.BLOCK,
         amax=None):
    p = gptq.prepare(h, act_order=SCHEMES[scheme].block_size if act_order else None)
    a = gptq.quantize(w, p, scheme, rule, amax, block, gptq.sweep_batch)
    b = gptq.quantize(w, p, scheme, rule, amax, block, ops.gptq_sweep)
    return a, b


def same(a: gptq.Result, b: gptq.Result) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert torch.equal(a.dequantized.view(torch.int32), b.dequantized.view(torch.int32))
    assert (a.gs is None) == (b.gs is None) and (a.gs is None or torch.equal(a.gs, b.gs))


@pytest.mark.parametrize("scheme,rule", CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_cuda_sweep_equals_the_reference_on_fresh_random_matrices(scheme, rule, act_order):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run (the seed is in the id on failure)
    g = torch.Generator().manual_seed(seed)
    k = 384
    w = (torch.randn(200, k, generator=g) * torch.rand(1, k, generator=g) * 0.1).cuda()
    a, b = both(w, hessian(k, seed, dead=(5, 300)), scheme, rule, act_order)
    same(a, b)


@pytest.mark.parametrize("scheme,rule", CASES)
def test_cuda_sweep_golden_edges(scheme, rule):
    """Zeros, saturation (a fused amax far below the weights), subnormal weights, odd batch sizes."""
    k = 256
    h = hessian(k, 11)
    zeros = torch.zeros(8, k, device="cuda")
    same(*both(zeros, h, scheme, rule, False))
    big = torch.randn(64, k, device="cuda", generator=torch.Generator("cuda").manual_seed(12)) * 100
    same(*both(big, h, scheme, rule, False, amax=torch.tensor(1.0, device="cuda") if scheme == "nvfp4" else None))
    tiny = torch.randn(64, k, device="cuda", generator=torch.Generator("cuda").manual_seed(13)) * 1e-39
    same(*both(tiny, h, scheme, rule, False))
    for block in (32 if scheme == "mxfp4" else 16, 96, 256, 384):
        if block % SCHEMES[scheme].block_size == 0:
            same(*both(big / 100, h, scheme, rule, True, block=block))


def test_cuda_sweep_is_deterministic_run_to_run():
    h = hessian(512, 14)
    w = torch.randn(1000, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(15))
    p = gptq.prepare(h)
    a = gptq.quantize(w, p, "nvfp4", "4over6", sweep=ops.gptq_sweep)
    b = gptq.quantize(w, p, "nvfp4", "4over6", sweep=ops.gptq_sweep)
    same(a, b)
