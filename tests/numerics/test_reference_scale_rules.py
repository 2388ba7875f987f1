"""The scale rules of docs/numerics.md "Scale rules" in the reference: golden bytes, the brute-force oracle, properties.

Golden rows are built in scaled units: an element of 2688 * 2^-k elsewhere in the row makes
gs = 2^k exactly, so every expected byte and code below can be checked by hand (comments).
"""

from __future__ import annotations

import pytest
import torch

from fp4convert.numerics import reference as ref
from fp4convert.errors import NonFiniteError, QuantizationError

from tests import oracle

NV_RULES = ("max", "4over6", "mse", "wmse")
MX_RULES = ("floor", "rceil", "mse", "wmse")


def nv_row(gs_log2: int, blocks: list[list[float]]) -> torch.Tensor:
    """One row: a block holding the amax that makes gs = 2^gs_log2, then the given blocks (in y = gs * x units)."""
    unit = 2.0**-gs_log2
    row = [2688.0 * unit] + [0.0] * 15
    for b in blocks:
        row += [v * unit for v in b] + [0.0] * (16 - len(b))
    return torch.tensor([row])


def codes_of(packed: torch.Tensor) -> list[int]:
    return ref.unpack_nibbles(packed).reshape(-1).tolist()


def scale_bytes(scale: torch.Tensor) -> list[int]:
    return scale.view(torch.uint8).reshape(-1).tolist()


def check_oracle_nv(x: torch.Tensor, rule: str, rotate: bool = False, amax: float | None = None) -> None:
    packed, scale, gs = ref.nvfp4_quantize(x, amax, "had16" if rotate else None, rule)
    codes, scales, ogs = oracle.nvfp4_row_codes(x.float().tolist(), rotate, rule, amax)
    assert gs.item() == ogs
    assert scale.view(torch.uint8).tolist() == scales
    assert ref.unpack_nibbles(packed).tolist() == codes


def check_oracle_mx(x: torch.Tensor, rule: str, rotate: bool = False) -> None:
    packed, scale = ref.mxfp4_quantize(x, "had16" if rotate else None, rule)
    codes, scales = oracle.mxfp4_row_codes(x.float().tolist(), rule, rotate)
    assert scale.tolist() == scales
    assert ref.unpack_nibbles(packed).tolist() == codes


# ---------------------------------------------------------------------------------------------
# Valid rules
# ---------------------------------------------------------------------------------------------

def test_scale_rules_per_scheme_and_defaults() -> None:
    assert ref.SCALE_RULES == {"nvfp4": ("max", "4over6", "mse", "wmse"), "mxfp4": ("floor", "rceil", "mse", "wmse")}
    # the defaults are the rules measured best on real language models (BENCHMARKS.md)
    assert ref.check_scale_rule("nvfp4", None) == "4over6" and ref.check_scale_rule("mxfp4", None) == "wmse"
    from fp4convert.numerics.scheme import SCHEMES

    # the kernels' rule codes (csrc: fp4c_cpu.cpp NVFP4_RULES / MXFP4_RULES, the CUDA launchers) and which
    # rules search (input weights change only those): one ScaleRule list, which the reference reads too
    assert {n: [(r.name, r.code, r.searches) for r in s.rules] for n, s in SCHEMES.items()} == {
        "nvfp4": [("max", 0, False), ("4over6", 1, True), ("mse", 2, True), ("wmse", 3, True)],
        "mxfp4": [("floor", 0, False), ("rceil", 1, False), ("mse", 2, True), ("wmse", 3, True)]}
    for name, scheme in SCHEMES.items():
        assert scheme.scale_rules == ref.SCALE_RULES[name] and scheme.default_rule == ref.DEFAULT_SCALE_RULE[name]
        assert scheme.rule(None).name == scheme.default_rule
    assert ref.check_scale_rule("mxfp4", "mse") == "mse"


@pytest.mark.parametrize("scheme,rule", [("nvfp4", "floor"), ("nvfp4", "rceil"), ("mxfp4", "max"), ("mxfp4", "4over6"), ("nvfp4", "MSE"), ("mxfp4", "")])
def test_invalid_combinations_are_refused_before_any_work(scheme: str, rule: str) -> None:
    with pytest.raises(QuantizationError, match=f"scale rule '{rule}' does not apply to {scheme}"):
        ref.check_scale_rule(scheme, rule)
    bad = torch.full((2, 32), float("nan"))  # would raise NonFiniteError if any work were done
    fn = ref.nvfp4_quantize if scheme == "nvfp4" else ref.mxfp4_quantize
    with pytest.raises(QuantizationError) as info:
        fn(bad, scale_rule=rule)
    assert not isinstance(info.value, NonFiniteError)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(QuantizationError, match="unknown scheme"):
        ref.check_scale_rule("int4", "max")


# ---------------------------------------------------------------------------------------------
# NVFP4 golden cases (gs = 1: y = x)
# ---------------------------------------------------------------------------------------------

NV_GOLDEN_BLOCKS = [
    [4.0],  # b6 = E4M3(0.667) = 0.6875 (0x33): 4/0.6875 -> 6, err 0.125^2; b4 = 1.0 (0x38) exact
    [6.0, 3.0],  # b6 = 1.0 (0x38) and b4 = 1.5 (0x3C) both exact: 4over6 ties to b6, mse to the larger byte
    [-7.75, 8.75, -3.5],  # b6 = 1.5 (0x3C), b4 = 2.25 (0x41); mse: b6 - 1 = 1.375 (err 0.890625), 8.75 saturates at 6
    [4.75, 8.5, 6.25],  # b6 = 1.375 (0x3B), b4 = 2.0 (0x40, tie 2.125 to even); mse: b4 (b6 - 1 = 1.25 errs 2.625)
    [4.75, 8.25, 4.75],  # b6 = 1.375 exactly; b6 - 1 = 1.25 (0x3A) errs 0.6875, the lowest: mse takes it;
    # wmse keeps b6, which holds the 8.25 exactly: weighted errors 2 * (0.625 * 4.75)^2 = 17.6 for b6
    # against 2 * (0.25 * 4.75)^2 + (0.75 * 8.25)^2 = 41.1 for b6 - 1
    [-0.0, 0.0, -0.0],  # all zero: b6 = b4 = 0 and b6 - 1 of byte 0 stays 0 (codes stay 0 / 8)
]
NV_GOLDEN_BYTES = {
    "max": [0x7E, 0x33, 0x38, 0x3C, 0x3B, 0x3B, 0x00],
    "4over6": [0x7E, 0x38, 0x38, 0x41, 0x40, 0x3B, 0x00],  # block 4: err(b4) 0.875 < err(b6) 1.015625
    "mse": [0x7E, 0x38, 0x3C, 0x3B, 0x40, 0x3A, 0x00],
    "wmse": [0x7E, 0x38, 0x3C, 0x3B, 0x40, 0x3B, 0x00],
}
NV_GOLDEN_CODES = {  # the first three codes of blocks 1.. in the chosen scale
    "max": [[7, 0, 0], [7, 5, 0], [0xF, 7, 0xC], [5, 7, 6], [5, 7, 5], [8, 0, 8]],
    "4over6": [[6, 0, 0], [7, 5, 0], [0xD, 6, 0xB], [4, 6, 5], [5, 7, 5], [8, 0, 8]],
    "mse": [[6, 0, 0], [6, 4, 0], [0xF, 7, 0xD], [4, 6, 5], [6, 7, 6], [8, 0, 8]],
    "wmse": [[6, 0, 0], [6, 4, 0], [0xF, 7, 0xD], [4, 6, 5], [5, 7, 5], [8, 0, 8]],
}


@pytest.mark.parametrize("rule", NV_RULES)
def test_nvfp4_golden_candidates_and_ties(rule: str) -> None:
    x = nv_row(0, NV_GOLDEN_BLOCKS)
    packed, scale, gs = ref.nvfp4_quantize(x, scale_rule=rule)
    assert gs.item() == 1.0
    assert scale_bytes(scale) == NV_GOLDEN_BYTES[rule]
    codes = codes_of(packed)
    assert codes[0] == 7  # the amax block: 2688 / 448 = 6
    assert [codes[16 * (b + 1) : 16 * (b + 1) + 3] for b in range(len(NV_GOLDEN_BLOCKS))] == NV_GOLDEN_CODES[rule]
    check_oracle_nv(x, rule)


def test_nvfp4_golden_block_errors() -> None:
    x = nv_row(0, NV_GOLDEN_BLOCKS)
    errs = {r: ref.nvfp4_block_errors(x, *ref.nvfp4_quantize(x, scale_rule=r)).reshape(-1).tolist() for r in NV_RULES}
    assert errs["max"][1:] == [0.015625, 0.0, 1.875, 1.015625, 0.78125, 0.0]
    assert errs["4over6"][1:] == [0.0, 0.0, 1.078125, 0.875, 0.78125, 0.0]
    assert errs["mse"][1:] == [0.0, 0.0, 0.890625, 0.875, 0.6875, 0.0]
    assert errs["wmse"][1:] == [0.0, 0.0, 0.890625, 0.875, 0.78125, 0.0]  # more squared error, exact block max


# Subnormal E4M3 scales: gs = 2^20, so y = 2^20 x and the byte is E4M3(y / 6) in units of 2^-9.
NV_SUB_BLOCKS = [
    [0.05322265625, 0.009033203125],  # b6 = 5 (s = 4.54 * 2^-9), b4 = 7: both search rules take 7 (0x07)
    [0.00537109375],  # s6 = 0.46 * 2^-9 rounds to 0, s4 = 0.69 * 2^-9 to 1: a zero scale only for max
    [-0.001220703125],  # b6 = b4 = 0 (and b6 - 1 stays 0): every rule writes a zero scale, the code a signed zero
    [2.0**-12],  # likewise, with a positive zero
]
NV_SUB_BYTES = {"max": [0x7E, 5, 0, 0, 0], "4over6": [0x7E, 7, 1, 0, 0], "mse": [0x7E, 7, 1, 0, 0], "wmse": [0x7E, 7, 1, 0, 0]}


@pytest.mark.parametrize("rule", NV_RULES)
def test_nvfp4_subnormal_and_zero_scales_clamp_at_zero(rule: str) -> None:
    x = nv_row(20, NV_SUB_BLOCKS)
    packed, scale, gs = ref.nvfp4_quantize(x, scale_rule=rule)
    assert gs.item() == 2.0**20
    assert scale_bytes(scale) == NV_SUB_BYTES[rule]
    codes = codes_of(packed)
    assert codes[48] == 0x8  # -0.0012 under a zero scale: a signed zero
    assert codes[64] == 0
    check_oracle_nv(x, rule)


@pytest.mark.parametrize("rule", NV_RULES)
def test_nvfp4_saturation_at_448_never_writes_nan(rule: str) -> None:
    # A fused-group amax of 100 below the row's own 2688: gs = 26.88 and gs * 2688 / 6 saturates: b6 and
    # b4 are 0x7E (never 0x7F, which is NaN) and the codes saturate at 6.
    x = nv_row(0, [[-2000.0, 900.0], [6.0]])
    packed, scale, gs = ref.nvfp4_quantize(x, global_amax=100.0, scale_rule=rule)
    b = scale_bytes(scale)
    assert b[0] == 0x7E and b[1] == 0x7E and 0x7F not in b
    codes = codes_of(packed)
    assert codes[0] == 7 and codes[16] == 0xF and codes[17] == 7
    check_oracle_nv(x, rule, amax=100.0)


def test_nvfp4_wmse_weighted_errors_that_underflow_tie_to_the_larger_byte() -> None:
    # gs = 2^66: (e * x)^2 ~ 2^-260 is below fp32's smallest subnormal in IEEE arithmetic (not a
    # flush): every candidate's weighted error is 0, and the tie goes to the larger byte, b4.
    x = nv_row(66, NV_GOLDEN_BLOCKS[2:5])
    assert scale_bytes(ref.nvfp4_quantize(x, scale_rule="wmse")[1])[1:] == [0x41, 0x40, 0x40]
    check_oracle_nv(x, "wmse")


@pytest.mark.parametrize("rule", [r for r in NV_RULES if r != "wmse"])
def test_nvfp4_subnormal_block_errors_are_not_flushed(rule: str) -> None:
    # gs = 2^66: the golden blocks' squared errors become subnormal (~2^-134). Flushing them to zero
    # would make every candidate tie and mse pick the largest byte.
    blocks = NV_GOLDEN_BLOCKS[2:5]
    x = nv_row(66, blocks)
    packed, scale, gs = ref.nvfp4_quantize(x, scale_rule=rule)
    assert scale_bytes(scale)[1:] == NV_GOLDEN_BYTES[rule][3:6]
    errs = ref.nvfp4_block_errors(x, packed, scale, gs).reshape(-1)[1:]
    assert bool(((errs > 0) & (errs < torch.finfo(torch.float32).tiny)).all())
    check_oracle_nv(x, rule)


# ---------------------------------------------------------------------------------------------
# MXFP4 golden cases (block max around 6: e = 127, scale 1)
# ---------------------------------------------------------------------------------------------

MX_GOLDEN_BLOCKS = [
    [7.0],  # floor: 7 -> 6 (err 1); e + 1: 3.5 -> 4 (= 8, err 1): a tie, mse keeps e
    [6.5],  # floor err 0.25; e + 1: 3.25 -> 3 (= 6), err 0.25: tie
    [7.5],  # floor err 2.25; e + 1: 3.75 -> 4 (= 8), err 0.25: mse goes up
    [6.5, 0.5],  # e + 1 also loses the 0.5 (0.25 -> 0): floor 0.25 < 0.5; rceil goes up anyway (and loses)
    [6.0, -0.0],  # 6 * 2^0 = 6 does not saturate: rceil keeps e; mse ties (both exact) -> e
    [-0.0, 0.0, -0.0],  # bmax = 0: e = 0 for every rule (mse ties at err 0 -> e)
    [1.875 * 2.0**-125],  # e clamps to 0, rceil takes 1; both squared errors underflow to 0: mse ties -> 0
    [7.5 * 2.0**-70],  # e = 57; squared errors 2.25 * 2^-140 and 2^-142 are subnormal, not zero: mse -> 58
    # (wmse's weighted errors, ~2^-280, underflow to 0: a tie, which keeps 57)
]
MX_GOLDEN_BYTES = {
    "floor": [127, 127, 127, 127, 127, 0, 0, 57],
    "rceil": [128, 128, 128, 128, 127, 0, 1, 58],
    "mse": [127, 127, 128, 127, 127, 0, 0, 58],
    "wmse": [127, 127, 128, 127, 127, 0, 0, 57],
}
MX_GOLDEN_FIRST_CODES = {
    "floor": [7, 7, 7, 7, 7, 8, 7, 7],
    "rceil": [6, 5, 6, 5, 7, 8, 6, 6],
    "mse": [7, 7, 6, 7, 7, 8, 7, 6],
    "wmse": [7, 7, 6, 7, 7, 8, 7, 7],
}


@pytest.mark.parametrize("rule", MX_RULES)
def test_mxfp4_golden_candidates_and_ties(rule: str) -> None:
    row = []
    for b in MX_GOLDEN_BLOCKS:
        row += b + [0.0] * (32 - len(b))
    x = torch.tensor([row])
    packed, scale = ref.mxfp4_quantize(x, scale_rule=rule)
    assert scale.reshape(-1).tolist() == MX_GOLDEN_BYTES[rule]
    codes = codes_of(packed)
    assert [codes[32 * i] for i in range(len(MX_GOLDEN_BLOCKS))] == MX_GOLDEN_FIRST_CODES[rule]
    assert codes[32 * 3 + 1] == (0 if rule == "rceil" else 1)  # the 0.5 lost one exponent up
    assert codes[32 * 5 : 32 * 5 + 3] == [8, 0, 8]
    check_oracle_mx(x, rule)


def test_mxfp4_golden_block_errors() -> None:
    row = []
    for b in MX_GOLDEN_BLOCKS[:4]:
        row += b + [0.0] * (32 - len(b))
    x = torch.tensor([row])
    errs = {r: ref.mxfp4_block_errors(x, *ref.mxfp4_quantize(x, scale_rule=r)).reshape(-1).tolist() for r in MX_RULES}
    assert errs == {"floor": [1.0, 0.25, 2.25, 0.25], "rceil": [1.0, 0.25, 0.25, 0.5], "mse": [1.0, 0.25, 0.25, 0.25],
                    "wmse": [1.0, 0.25, 0.25, 0.25]}


def test_mxfp4_wmse_goes_up_for_a_block_max_that_mse_would_clip() -> None:
    # bmax 7.5 (floor clips it to 6, error 1.5) beside ten 1.5s (exact under floor): one exponent up
    # rounds 7.5 to 8 (error 0.5) but each 1.5 to 2 (0.75 -> 1 at step 2, error 0.5). Plain squared
    # error: floor 2.25 < up 0.25 + 10 * 0.25 = 2.75, so mse clips the max; weighted by x^2: floor
    # 2.25 * 56.25 = 126.6 > up 0.25 * 56.25 + 10 * 0.25 * 2.25 = 19.7, so wmse keeps it.
    x = torch.tensor([[7.5] + [1.5] * 10 + [0.0] * 21])
    assert ref.mxfp4_quantize(x, scale_rule="mse")[1].tolist() == [[127]]
    assert ref.mxfp4_quantize(x, scale_rule="wmse")[1].tolist() == [[128]]
    check_oracle_mx(x, "wmse")


# ---------------------------------------------------------------------------------------------
# Against the brute-force oracle: random weights, Had16, fused groups
# ---------------------------------------------------------------------------------------------

def oracle_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """random_weight plus a block far below the amax (subnormal scales) and one on exact E4M3 grid points."""
    x = oracle.random_weight(rows, cols, seed)
    x[1, 16:32] *= 2.0**-22
    x[2, :16] = torch.tensor([6.0, 3.0, 4.5, -1.5, 0.75, 2.0, 1.0, -6.0, 0.5, 0, 0, 0, 0, 0, 0, 1.5]) * x[2].abs().max()
    return x


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("rule", NV_RULES)
def test_nvfp4_rules_match_oracle(rule: str, rotate: bool) -> None:
    check_oracle_nv(oracle_weight(5, 64, oracle.fresh_seed()), rule, rotate)


@pytest.mark.parametrize("rule", NV_RULES)
def test_nvfp4_rules_with_a_fused_group_amax_match_oracle(rule: str) -> None:
    x = oracle_weight(4, 64, oracle.fresh_seed())
    group_amax = float(torch.tensor(x.abs().max().item() * 3.7))  # an fp32 value, as a group's amax is
    check_oracle_nv(x, rule, amax=group_amax)
    check_oracle_nv(x, rule, rotate=True, amax=group_amax)
    # The global scale is the group's for every rule: only block scales move.
    assert ref.nvfp4_quantize(x, group_amax, scale_rule=rule)[2].item() == ref.global_scale(torch.tensor(group_amax)).item()


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("rule", MX_RULES)
def test_mxfp4_rules_match_oracle(rule: str, rotate: bool) -> None:
    x = oracle_weight(4, 96, oracle.fresh_seed())
    x[3, 32:64] *= 1e-39  # subnormal block maximum
    check_oracle_mx(x, rule, rotate)


@pytest.mark.parametrize("rule", MX_RULES)
def test_mxfp4_bf16_input_matches_oracle(rule: str) -> None:
    x = oracle_weight(3, 64, oracle.fresh_seed()).bfloat16()
    check_oracle_mx(x, rule)


def test_batched_leading_dims_are_independent_for_every_rule() -> None:
    x = torch.randn(3, 4, 64) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    for rule in NV_RULES:
        packed, scale, gs = ref.nvfp4_quantize(x, scale_rule=rule)
        for i in range(3):
            p, s, g = ref.nvfp4_quantize(x[i], scale_rule=rule)
            assert torch.equal(packed[i], p) and torch.equal(scale[i].view(torch.uint8), s.view(torch.uint8)) and torch.equal(gs[i], g)
    for rule in MX_RULES:
        packed, scale = ref.mxfp4_quantize(x, scale_rule=rule)
        for i in range(3):
            p, s = ref.mxfp4_quantize(x[i], scale_rule=rule)
            assert torch.equal(packed[i], p) and torch.equal(scale[i], s)


# ---------------------------------------------------------------------------------------------
# Properties: a search rule never loses to the plain rule on any block
# ---------------------------------------------------------------------------------------------

def property_weight(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=g).float())
    x[::7] = torch.round(x[::7] * 4) / 4  # many exact grid values: many ties
    x[3] = 0.0
    return x


@pytest.mark.parametrize("rotate", [None, "had16"])
def test_nvfp4_search_rules_never_lose_on_any_block(rotate: str | None) -> None:
    x = property_weight(oracle.fresh_seed())
    group = float(x.abs().max()) * 2  # with a fused-group amax too
    for amax in (None, group):
        err = {r: ref.nvfp4_block_errors(x, *ref.nvfp4_quantize(x, amax, rotate, r), rotate=rotate) for r in NV_RULES}
        assert bool((err["4over6"] <= err["max"]).all())
        assert bool((err["mse"] <= err["4over6"]).all())  # mse's candidates include 4over6's
        assert bool((err["mse"] < err["max"]).any())  # and the search does find something
        werr = {r: weighted_errors(x, amax, rotate, r) for r in NV_RULES}
        assert bool((werr["wmse"] <= werr["max"]).all()) and bool((werr["wmse"] <= werr["mse"]).all())
        assert bool((werr["wmse"] < werr["mse"]).any())  # the two measures do choose differently


@pytest.mark.parametrize("rotate", [None, "had16"])
def test_mxfp4_search_rule_never_loses_on_any_block(rotate: str | None) -> None:
    x = property_weight(oracle.fresh_seed())
    err = {r: ref.mxfp4_block_errors(x, *ref.mxfp4_quantize(x, rotate, r), rotate=rotate) for r in MX_RULES}
    assert bool((err["mse"] <= err["floor"]).all())
    assert bool((err["mse"] <= err["rceil"]).all())
    assert bool((err["rceil"] > err["floor"]).any())  # rceil can lose, which is why mse exists
    werr = {r: weighted_errors(x, None, rotate, r, "mxfp4") for r in MX_RULES}
    assert all(bool((werr["wmse"] <= werr[r]).all()) for r in MX_RULES)
    assert bool((werr["wmse"] < werr["mse"]).any())


def weighted_errors(x: torch.Tensor, amax, rotate, rule: str, scheme: str = "nvfp4") -> torch.Tensor:
    """The x^2-weighted block error (what wmse minimises) of x quantized under ``rule``."""
    v = ref.had16(x) if rotate else x.float()
    if scheme == "nvfp4":
        packed, scale, gs = ref.nvfp4_quantize(x, amax, rotate, rule)
        blocks, d = v.reshape(*v.shape[:-1], -1, 16), ref.e4m3_decode(scale) / gs
    else:
        packed, scale = ref.mxfp4_quantize(x, rotate, rule)
        blocks, d = v.reshape(*v.shape[:-1], -1, 32), ref.e8m0_decode(scale)
    return ref.block_error(blocks, ref.unpack_nibbles(packed).reshape(blocks.shape), d, weighted=True)


def test_block_errors_are_measured_in_element_order() -> None:
    # 2^24 + 1 + 1 in fp32: left to right both 1s are lost (ties to even), summed pairwise one is kept.
    blocks = torch.tensor([[2.0**12, 1.0, 1.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    codes = torch.zeros(1, 16, dtype=torch.uint8)  # every value decodes to 0: e = -x
    assert ref.block_error(blocks, codes, torch.ones(1)).item() == 2.0**24
    reordered = torch.tensor([[1.0, 1.0, 2.0**12] + [0.0] * 13])
    assert ref.block_error(reordered, codes, torch.ones(1)).item() == 2.0**24 + 2
