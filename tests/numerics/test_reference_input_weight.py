"""Input-channel-weighted search rules (``input_weight``): golden cases, the definition, CPU bit for bit.

The weighted block error is ``err = err + (e * e) * c_i`` in element order (reference.block_error);
the search rules pick the candidate with the lowest weighted error, the plain rules ignore it.
"""

from __future__ import annotations

import pytest
import torch

from fp4convert.kernels import cpu
from fp4convert.numerics import reference as ref
from fp4convert.errors import QuantizationError

NV_SEARCH = ("4over6", "mse", "wmse")
MX_SEARCH = ("mse", "wmse")


def real_like(m: int, k: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows with a few large columns, like trained weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g)
    x[:, torch.randint(0, k, (k // 16,), generator=g)] *= 8.0
    return x


def channel_weights(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(2.0 * torch.randn(k, generator=g))  # spans ~e^-6 .. e^6, like squared norm gains
    w[:3] = 0.0  # a zero weight is allowed (the channel does not matter)
    return w


def test_a_heavier_channel_changes_the_nvfp4_4over6_choice() -> None:
    # Block 0 holds the amax that makes gs = 1; block 1 is 6, 5 and fourteen zeros.
    # /6 scale (sf = 1): 6 -> 6 exact, 5 -> 4 (the E2M1 tie rounds to even), error 1.
    # /4 scale (sf = 1.5): 6 -> 4 -> 6 exact, 5 -> 3.33 -> 3 -> 4.5, error 0.25: /4 wins.
    # With the 5's channel weighted 0 both candidates err 0 there: the tie keeps /6.
    row = torch.tensor([[2688.0] + [0.0] * 15 + [6.0, 5.0] + [0.0] * 14])
    _, s_plain, _ = ref.nvfp4_quantize(row, scale_rule="4over6")
    assert s_plain.view(torch.uint8)[0, 1].item() == 0x3C  # 1.5: the /4 scale
    w = torch.ones(32)
    w[17] = 0.0
    _, s_w, _ = ref.nvfp4_quantize(row, scale_rule="4over6", input_weight=w)
    assert s_w.view(torch.uint8)[0, 1].item() == 0x38  # 1.0: the /6 scale


def test_the_weighted_error_is_the_definition() -> None:
    x = real_like(8, 64, 1)
    c = channel_weights(64, 2)
    blocks = x.reshape(8, 4, 16)
    packed, scale, gs = ref.nvfp4_quantize(x, scale_rule="mse", input_weight=c)
    codes = ref.unpack_nibbles(packed).reshape(blocks.shape)
    d = ref.e4m3_decode(scale) / gs
    got = ref.block_error(blocks, codes, d, input_weight=c.reshape(4, 16))
    vals = ref.e2m1_decode(codes)
    want = torch.zeros(8, 4)
    for i in range(16):  # one fp32 op per step, in element order
        e = vals[..., i] * d - blocks[..., i]
        want = want + (e * e) * c.reshape(4, 16)[:, i]
    assert torch.equal(got, want)


@pytest.mark.parametrize("scheme,rule", [("nvfp4", r) for r in NV_SEARCH] + [("mxfp4", r) for r in MX_SEARCH])
def test_weighted_choice_never_loses_on_the_weighted_error(scheme: str, rule: str) -> None:
    x = real_like(64, 256, 3)
    c = channel_weights(256, 4)
    bs = 16 if scheme == "nvfp4" else 32
    blocks = x.reshape(64, -1, bs)
    cw = c.reshape(-1, bs)

    def err(packed, d):
        return ref.block_error(blocks, ref.unpack_nibbles(packed).reshape(blocks.shape), d, input_weight=cw)

    if scheme == "nvfp4":
        pw, sw, gs = ref.nvfp4_quantize(x, scale_rule=rule, input_weight=c)
        pu, su, _ = ref.nvfp4_quantize(x, scale_rule=rule)
        pm, sm, _ = ref.nvfp4_quantize(x, scale_rule="max")
        e_w, e_u, e_m = (err(p, ref.e4m3_decode(s) / gs) for p, s in ((pw, sw), (pu, su), (pm, sm)))
    else:
        pw, sw = ref.mxfp4_quantize(x, scale_rule=rule, input_weight=c)
        pu, su = ref.mxfp4_quantize(x, scale_rule=rule)
        pm, sm = ref.mxfp4_quantize(x, scale_rule="floor")
        e_w, e_u, e_m = (err(p, ref.e8m0_decode(s)) for p, s in ((pw, sw), (pu, su), (pm, sm)))
    if rule != "wmse":  # wmse minimises the x^2-weighted error, not this one
        assert bool((e_w <= e_u).all()) and bool((e_w <= e_m).all())
    assert not torch.equal(sw.view(torch.uint8), su.view(torch.uint8))  # the weights changed choices


@pytest.mark.parametrize("scheme,rule", [("nvfp4", r) for r in ("max",) + NV_SEARCH]
                         + [("mxfp4", r) for r in ("floor", "rceil") + MX_SEARCH])
def test_unit_weights_and_plain_rules_give_the_unweighted_bytes(scheme: str, rule: str) -> None:
    x = real_like(16, 128, 5)
    q = ref.nvfp4_quantize if scheme == "nvfp4" else ref.mxfp4_quantize
    kw = {"scale_rule": rule}
    plain = q(x, **kw)
    ones = q(x, input_weight=torch.ones(128), **kw)
    for a, b in zip(plain, ones):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    if rule in ("max", "floor", "rceil"):  # no search: any weight is ignored
        other = q(x, input_weight=channel_weights(128, 6), **kw)
        assert torch.equal(other[0], plain[0]) and torch.equal(other[1].view(torch.uint8), plain[1].view(torch.uint8))


@pytest.mark.parametrize("bad", [torch.ones(64), torch.ones(2, 128), torch.full((128,), float("nan")),
                                 -torch.ones(128), torch.ones(128, dtype=torch.int32)])
def test_bad_input_weights_are_refused(bad: torch.Tensor) -> None:
    x = real_like(4, 128, 7)
    with pytest.raises(QuantizationError, match="input_weight"):
        ref.nvfp4_quantize(x, scale_rule="4over6", input_weight=bad)
    with pytest.raises(QuantizationError, match="input_weight"):
        cpu.quantize_input_weighted(x[None], "mxfp4", None, None, False, "wmse", bad)


@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,rule", [("nvfp4", r) for r in ("max",) + NV_SEARCH]
                         + [("mxfp4", r) for r in ("floor", "rceil") + MX_SEARCH])
def test_cpu_path_equals_reference_bit_for_bit(scheme: str, rule: str, dtype: torch.dtype, rotate: str | None) -> None:
    x = torch.stack([real_like(96, 320, 8), real_like(96, 320, 9) * 1e-3]).to(dtype)
    c = channel_weights(320, 10)
    c[5] = 1e30  # huge and tiny weights: products overflow to inf / underflow, the same in both
    c[6] = 1e-40
    if scheme == "nvfp4":
        amax = ref.tensor_amax(x, rotate)
        gs = ref.global_scale(amax)
        packed, scale, _ = cpu.quantize_input_weighted(x, "nvfp4", gs, rotate, False, rule, c)
        for i in range(2):
            rp, rs, rgs = ref.nvfp4_quantize(x[i], None, rotate, rule, input_weight=c)
            assert torch.equal(rgs, gs[i])
            assert torch.equal(packed[i], rp) and torch.equal(scale[i].view(torch.uint8), rs.view(torch.uint8))
    else:
        packed, scale, _ = cpu.quantize_input_weighted(x, "mxfp4", None, rotate, False, rule, c)
        for i in range(2):
            rp, rs = ref.mxfp4_quantize(x[i], rotate, rule, input_weight=c)
            assert torch.equal(packed[i], rp) and torch.equal(scale[i], rs)


def test_cpu_swizzled_scales_are_the_linear_ones_swizzled() -> None:
    from fp4convert.numerics.swizzle import swizzle_scales

    x = real_like(130, 64, 11)[None]
    c = channel_weights(64, 12)
    gs = ref.global_scale(ref.tensor_amax(x))
    p1, s1, _ = cpu.quantize_input_weighted(x, "nvfp4", gs, None, False, "4over6", c)
    p2, s2, _ = cpu.quantize_input_weighted(x, "nvfp4", gs, None, True, "4over6", c)
    assert torch.equal(p1, p2) and torch.equal(swizzle_scales(s1).view(torch.uint8), s2.view(torch.uint8))
