"""The CPU kernel's vector path for the scale rules (csrc/fp4c_cpu.cpp, "explicit vectors") at each width.

The library picks a vector width at load (16 lanes on x86-64-v4, 8 on v3, 4 otherwise); each width is
also built alone here (``-DFP4C_VEC_WIDTH``), beside the per-lane path it replaced (``-DFP4C_SCALAR_RULES``),
and all of them must write the reference's bytes for every scheme and rule on fresh random weights and on
the cases where a vector step could go wrong: E2M1 ties, subnormal and zero scales, zero and -0 blocks,
blocks that saturate (values at 6..8 times the step, a group amax below the matrix's own), tiny matrices
whose gs clamps to FLT_MAX, ragged tiles (fewer blocks than lanes) and both scale layouts.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from fp4convert.kernels import cpu_lib as cpu_kernel
from fp4convert.kernels import jit
from fp4convert.numerics import reference as ref
from fp4convert.numerics.swizzle import swizzle_scales

from tests.oracle import fresh_seed, random_weight
from tests.kernels.test_cpu import rule_weight
from tests.kernels.test_cpu_kernel import RULES, golden_batch, reference, x86_levels

VARIANTS = {"scalar": ("-DFP4C_SCALAR_RULES",), "w4": ("-DFP4C_VEC_WIDTH=4",), "w8": ("-DFP4C_VEC_WIDTH=8",),
            "w16": ("-DFP4C_VEC_WIDTH=16",)}


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    """The default library and each variant built alone (no clones: one width per library)."""
    if jit.cxx() is None:
        pytest.skip("no C++ compiler")
    base = cpu_kernel.spec()
    root = tmp_path_factory.mktemp("simd")
    out = {"default": cpu_kernel.load()}
    for name, flags in VARIANTS.items():
        one = jit.BuildSpec(**{**base.__dict__, "flags": (*base.flags, "-DFP4C_NO_CLONES", *flags), "tag": f"cpu-{name}",
                               "root": root})
        out[name] = cpu_kernel.open_library(one.build())
    return out


def width(lib: ctypes.CDLL) -> int:
    f = lib.fp4c_cpu_vector_width
    f.restype = ctypes.c_int
    return int(f())


def edge_batch(seed: int) -> torch.Tensor:
    """[6, 5, 96] fp32: golden_batch's ties, subnormals, zeros and saturation, rule_weight's subnormal-scale
    blocks, blocks whose values sit on and between 6..8 times a power of two (NVFP4 and MXFP4 saturation)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(6, 5, 96)
    gb = golden_batch()  # [4, 8, 64]
    x[:4, :, :64] = gb[:, :5]
    x[4] = rule_weight(seed)[:5]
    sat = torch.tensor([6.0, 6.5, 7.0, 7.5, 8.0, 5.5, 5.0, 4.5]).repeat(12)
    x[5, 0] = sat
    x[5, 1] = -sat * 2.0**-130  # subnormal inputs at the same ratios
    x[5, 2] = torch.randn(96, generator=g) * 2.0 ** torch.randint(-30, 30, (96,), generator=g).float()  # binades mixed
    x[5, 3, ::2] = 0.25 * torch.randint(0, 25, (48,), generator=g).float()  # E2M1 ties and grid values
    return x


def check(lib: ctypes.CDLL, x: torch.Tensor, scheme: str, rule: str, rotate: str | None, group_amax=None) -> None:
    rp, rs, rgs = reference(x, scheme, rule, rotate, group_amax)
    gs = None
    if scheme == "nvfp4":
        gs = ref.global_scale(ref.tensor_amax(x, rotate).reshape(-1) if group_amax is None else group_amax)
        assert torch.equal(gs, rgs)
    for swizzle in (False, True):
        out = cpu_kernel.quantize(lib, x, scheme, gs, rotate, swizzle, rule, 2)
        assert out is not None
        p, s, _ = out
        assert torch.equal(p, rp), (scheme, rule, rotate, x.dtype, tuple(x.shape), swizzle)
        assert torch.equal(s.view(torch.uint8), swizzle_scales(rs) if swizzle else rs), (scheme, rule, rotate, swizzle)


def test_the_library_picks_the_widest_width_this_cpu_runs(libs) -> None:
    levels = x86_levels()
    want = 16 if "x86-64-v4" in levels else 8 if "x86-64-v3" in levels else 4
    assert width(libs["default"]) == want
    assert [width(libs[n]) for n in VARIANTS] == [0, 4, 8, 16]


@pytest.mark.parametrize("scheme,rule", RULES)
@pytest.mark.parametrize("rotate", [None, "had16"])
def test_every_width_and_the_scalar_path_match_the_reference(libs, scheme: str, rule: str, rotate: str | None) -> None:
    seed = fresh_seed()
    edges = edge_batch(seed)
    rand = torch.stack([random_weight(21, 160, seed + i) for i in range(2)])  # 21 x 10 blocks: ragged tiles
    rand[1] *= 2.0**-40
    for name, lib in libs.items():
        for x in (edges, rand):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                xd = x.to(dtype) if dtype != torch.float16 else x.clamp(-6e4, 6e4).to(dtype)
                check(lib, xd, scheme, rule, rotate)
        if scheme == "nvfp4":  # a given group amax far below the matrix's own: blocks saturate at 448
            own = ref.tensor_amax(rand).reshape(-1)
            check(lib, rand.to(torch.bfloat16), scheme, rule, rotate, group_amax=(own * 0.05).to(torch.float32))
