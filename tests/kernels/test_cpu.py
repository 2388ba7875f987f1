"""The CPU fast path against the reference: the same bytes on random data, edge cases and chunk seams.

Every test runs on both CPU paths (the ``path`` fixture, autouse): the compiled kernel (skipped where no
C++ compiler exists; tests/kernels/test_cpu_kernel.py covers it in depth) and the torch path
(``FP4CONVERT_CPU_KERNEL=0``), which is also what runs wherever the kernel cannot be built.
"""

from __future__ import annotations

import pytest
import torch

import fp4convert
from fp4convert.kernels import cpu, cpu_lib as cpu_kernel, jit
from fp4convert.numerics import reference as ref
from fp4convert.numerics.swizzle import swizzle_scales

from tests.oracle import fresh_seed, random_weight


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, monkeypatch) -> str:
    """Which CPU path the test runs: the compiled kernel or the torch path."""
    if request.param == "torch":
        monkeypatch.setenv("FP4CONVERT_CPU_KERNEL", "0")
    else:
        monkeypatch.delenv("FP4CONVERT_CPU_KERNEL", raising=False)
        if jit.cxx() is None:
            pytest.skip("no C++ compiler: the kernel cannot be built here")
        assert cpu_kernel.get() is not None, "a compiler is there but the kernel did not build (see the warning)"
    return request.param


def same(a: fp4convert.QuantizedTensor, b: fp4convert.QuantizedTensor) -> bool:
    gs = (a.global_scale is None and b.global_scale is None) or torch.equal(a.global_scale, b.global_scale)
    return gs and torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference(fmt: str, rotate: str | None, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(cpu, "CHUNK_ELEMS", 3 * 96)  # several chunks, the last one ragged
    x = random_weight(37, 96, fresh_seed()).to(dtype)
    for layout in ("linear", "swizzled"):
        fast = fp4convert.quantize(x, fmt, rotate=rotate, scale_layout=layout, backend="cpu")
        slow = fp4convert.quantize(x, fmt, rotate=rotate, scale_layout=layout, backend="reference")
        assert same(fast, slow)
    assert torch.equal(fp4convert.amax(x, rotate=rotate, backend="cpu"), fp4convert.amax(x, rotate=rotate, backend="reference"))


def test_batched_and_group_amax_match_reference(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "CHUNK_ELEMS", 200)
    x = torch.randn(3, 20, 64) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    assert same(fp4convert.quantize(x, backend="cpu"), fp4convert.quantize(x, backend="reference"))
    g = torch.tensor(7.5)
    assert same(fp4convert.quantize(x, global_amax=g, backend="cpu"), fp4convert.quantize(x, global_amax=g, backend="reference"))


def test_auto_uses_the_fast_path_on_cpu(monkeypatch) -> None:
    calls = []
    real = cpu.quantize
    monkeypatch.setattr(cpu, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    fp4convert.quantize(torch.randn(4, 32))
    assert calls


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_refused(bad: float) -> None:
    x = torch.randn(8, 64)
    x[5, 17] = bad
    with pytest.raises(fp4convert.NonFiniteError):
        fp4convert.quantize(x, "mxfp4", backend="cpu")
    with pytest.raises(fp4convert.NonFiniteError):
        fp4convert.quantize(x, global_amax=1.0, backend="cpu")


def test_tiny_amax_and_zero_blocks_match_reference() -> None:
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1], x[1, 40] = 1e-37, -1e-38, 1e-45
    assert same(fp4convert.quantize(x, backend="cpu"), fp4convert.quantize(x, backend="reference"))
    z = torch.zeros(3, 32)
    assert same(fp4convert.quantize(z, backend="cpu"), fp4convert.quantize(z, backend="reference"))


# ---------------------------------------------------------------------------------------------
# Scale rules: cpu.quantize against the reference, bit for bit
# ---------------------------------------------------------------------------------------------

RULES = [("nvfp4", r) for r in ref.SCALE_RULES["nvfp4"]] + [("mxfp4", r) for r in ref.SCALE_RULES["mxfp4"]]


def rule_weight(seed: int) -> torch.Tensor:
    """random_weight with blocks far below the amax (subnormal scales), tiny blocks and exact grid values."""
    x = random_weight(37, 96, seed)
    x[1, 16:48] *= 2.0**-22
    x[2] *= 1e-36
    x[4, :32] = torch.tensor([6.0, 3.0, 4.5, 7.0, 6.5, 0.5, -0.0] + [0.0] * 25) * 2.0 ** torch.randint(-3, 3, ()).item()
    x[5::6] = torch.round(x[5::6] * 8) / 8
    return x


@pytest.mark.parametrize("scheme,rule", RULES)
@pytest.mark.parametrize("rotate", [None, "had16"])
def test_every_rule_matches_reference(scheme: str, rule: str, rotate: str | None, monkeypatch) -> None:
    monkeypatch.setattr(cpu, "CHUNK_ELEMS", 3 * 96)  # several chunks, the last one ragged
    x = rule_weight(fresh_seed())
    for dtype, global_amax in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, 3.0)):
        if scheme == "mxfp4" and global_amax is not None:
            continue
        xd = x.to(dtype)
        gs = None
        if scheme == "nvfp4":
            amax = torch.tensor([global_amax]) if global_amax else ref.tensor_amax(xd, rotate).reshape(1)
            gs = ref.global_scale(amax)
            rp, rs, _ = ref.nvfp4_quantize(xd, global_amax, rotate, rule)
        else:
            rp, rs = ref.mxfp4_quantize(xd, rotate, rule)
        packed, scale, nonfinite = cpu.quantize(xd[None], scheme, gs, rotate, False, rule)
        assert not nonfinite
        assert torch.equal(packed[0], rp) and torch.equal(scale[0].view(torch.uint8), rs.view(torch.uint8))
        _, swz, _ = cpu.quantize(xd[None], scheme, gs, rotate, True, rule)
        assert torch.equal(swz.view(torch.uint8), swizzle_scales(scale).view(torch.uint8))


def test_default_rule_is_the_measured_one_and_positional_callers_keep_working() -> None:
    x = random_weight(8, 64, fresh_seed())[None]
    gs = ref.global_scale(ref.tensor_amax(x[0]).reshape(1))
    for scheme, g, default in (("nvfp4", gs, "4over6"), ("mxfp4", None, "wmse")):
        assert ref.DEFAULT_SCALE_RULE[scheme] == default
        a = cpu.quantize(x, scheme, g, None, False)
        b = cpu.quantize(x, scheme, g, None, False, default)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


@pytest.mark.parametrize("scheme,rule", [("nvfp4", "floor"), ("mxfp4", "max"), ("mxfp4", "4over6"), ("nvfp4", "rceil")])
def test_invalid_rule_refused(scheme: str, rule: str) -> None:
    with pytest.raises(fp4convert.QuantizationError, match="does not apply"):
        cpu.quantize(torch.zeros(1, 4, 32), scheme, torch.ones(1), None, False, rule)


@pytest.mark.parametrize("scheme,rule", RULES)
def test_non_finite_flagged_under_every_rule(scheme: str, rule: str) -> None:
    x = torch.randn(1, 8, 64)
    x[0, 5, 17] = float("nan")
    x[0, 2, 40] = float("inf")
    gs = torch.ones(1) if scheme == "nvfp4" else None
    assert cpu.quantize(x, scheme, gs, None, False, rule)[2]


def test_magnitude_rounding_equals_the_encoder_on_every_tie_and_range() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    grid = torch.tensor(ref.E2M1_VALUES)
    pts = torch.cat([ties, grid, torch.tensor([6.5, 7.0, 1e30, ref.FLT_MAX, float("inf"), 1e-45, 1e-39, 2.0**-126])])
    around = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, 100.0)), torch.nextafter(pts, torch.zeros_like(pts))])
    g = torch.Generator().manual_seed(fresh_seed())
    rand = torch.rand(20000, generator=g) * torch.exp2(torch.randint(-40, 8, (20000,), generator=g).float())
    a = torch.cat([around, rand, torch.zeros(1)])
    expected = ref.e2m1_decode(ref.e2m1_encode(a))
    got = cpu._e2m1_magnitude_(a.clone())
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_wmse_golden_edge_cases_match_reference() -> None:
    """The wmse golden rows (an exact block max kept, weighted errors that underflow to a tie, a
    clipped MXFP4 max that wmse keeps and mse does not) through the CPU path, byte for byte."""
    from tests.numerics.test_reference_scale_rules import NV_GOLDEN_BLOCKS, nv_row

    rows = [nv_row(0, NV_GOLDEN_BLOCKS), nv_row(66, NV_GOLDEN_BLOCKS[2:5]) * 1.0]
    for x in rows:
        gs = ref.global_scale(ref.tensor_amax(x).reshape(1))
        rp, rs, _ = ref.nvfp4_quantize(x, None, None, "wmse")
        p, s, _ = cpu.quantize(x[None], "nvfp4", gs, None, False, "wmse")
        assert torch.equal(p[0], rp) and torch.equal(s[0].view(torch.uint8), rs.view(torch.uint8))
    x = torch.tensor([[7.5] + [1.5] * 10 + [0.0] * 21, [7.5 * 2.0**-70] + [0.0] * 31])
    rp, rs = ref.mxfp4_quantize(x, None, "wmse")
    p, s, _ = cpu.quantize(x[None], "mxfp4", None, None, False, "wmse")
    assert torch.equal(p[0], rp) and torch.equal(s[0], rs) and s[0].reshape(-1).tolist() == [128, 57]
