"""Tuned rounding's arithmetic (fp4convert/numerics/tuned.py, docs "Tuned rounding"): the final bytes are the
contract's rounding of the tuned values, zero tuning is the data-free quantizer, the stand-in's values are the
final decode, and the tuning is deterministic."""

from __future__ import annotations

import math

import pytest
import torch

from fp4convert.errors import NonFiniteError, QuantizationError
from fp4convert.numerics import reference as ref
from fp4convert.numerics import tuned
from fp4convert.numerics.scheme import SCHEMES
from tests import oracle

RULES = [(s, r) for s in ("nvfp4", "mxfp4") for r in SCHEMES[s].scale_rules]


def reference_bytes(w, scheme, rule, amax=None, iw=None):
    """(packed, scale bytes, gs, decode) of the data-free quantizer."""
    if scheme == "nvfp4":
        p, s, gs = ref.nvfp4_quantize(w, amax, None, rule, iw)
        return p, s.view(torch.uint8), gs, ref.nvfp4_dequantize(p, s, gs)
    p, e = ref.mxfp4_quantize(w, None, rule, iw)
    return p, e, None, ref.mxfp4_dequantize(p, e)


def tuned_values(w, scheme, seed, with_ties=True):
    """Random offsets in [-0.5, 0.5] and scale moves in [-1, 1], with planted exact ties: offsets of exactly
    +-0.5 grid steps (a value on the grid moved onto a midpoint) and moves of exactly half a byte step."""
    g = torch.Generator().manual_seed(seed)
    bs = SCHEMES[scheme].block_size
    v = torch.rand(w.shape, generator=g) - 0.5
    t = torch.rand(*w.shape[:-1], w.shape[-1] // bs, generator=g) * 2 - 1
    if with_ties:
        v[..., 1::5] = 0.5
        v[..., 2::7] = -0.5
        v[..., 3::11] = 0.0
        t[..., ::3] = 0.5 / tuned.STEPS_PER_OCTAVE[scheme]
        t[..., 1::4] = 0.0
    return v, t


def planted_weight(rows, cols, seed):
    """oracle.random_weight, plus values on the E2M1 grid of their block (so +-0.5 steps land on midpoints),
    a -0.0 and a block whose largest value saturates."""
    w = oracle.random_weight(rows, cols, seed)
    w[1, :8] = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0]) * 2.0**-4
    w[2, 0] = -0.0
    return w


# ---------------------------------------------------------------------------------------------
# Zero tuning is the data-free quantizer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme,rule", RULES)
@pytest.mark.parametrize("zeros", [False, True])
def test_zero_offsets_and_the_rules_scales_are_the_data_free_quantizers_bytes(scheme, rule, zeros):
    """No tuning (None, or tensors of zeros as the tuning starts from) gives the reference's bytes exactly: same
    codes (a -0.0 weight keeps code 8), same scale bytes, same global scale, same decode."""
    w = planted_weight(6, 128, oracle.fresh_seed())
    s = tuned.start(w, scheme, rule)
    v = torch.zeros_like(w) if zeros else None
    t = torch.zeros(s.scale.shape) if zeros else None
    got = tuned.quantize(w, s, v, t)
    packed, scale, gs, deq = reference_bytes(w, scheme, rule)
    assert torch.equal(got.packed, packed)
    assert torch.equal(got.scale.view(torch.uint8), scale)
    if gs is not None:
        assert torch.equal(got.gs, gs)
    assert torch.equal(got.dequantized, deq)
    assert ref.unpack_nibbles(got.packed)[2, 0].item() == 8  # the -0.0 weight


@pytest.mark.parametrize("scheme,rule", [("nvfp4", "mse"), ("nvfp4", "4over6"), ("mxfp4", "wmse"), ("mxfp4", "mse")])
def test_the_start_takes_input_weights_leading_dims_and_a_group_amax(scheme, rule):
    """The start is the reference's choice under the same arguments: input-weighted search, stacked matrices
    ([E, N, K]: one global scale each), and NVFP4's fused-group amax."""
    seed = oracle.fresh_seed()
    w = torch.stack([planted_weight(4, 64, seed), planted_weight(4, 64, seed + 1)])
    iw = torch.rand(64, generator=torch.Generator().manual_seed(seed)) + 0.1
    amax = torch.tensor(3.0) if scheme == "nvfp4" else None
    s = tuned.start(w, scheme, rule, amax, iw)
    got = tuned.quantize(w, s, torch.zeros_like(w), torch.zeros(s.scale.shape))
    packed, scale, gs, deq = reference_bytes(w, scheme, rule, amax, iw)
    assert torch.equal(got.packed, packed) and torch.equal(got.scale.view(torch.uint8), scale)
    assert torch.equal(got.dequantized, deq)
    if gs is not None:
        assert gs.shape == (2,) and torch.equal(got.gs, gs)


# ---------------------------------------------------------------------------------------------
# The final bytes: the contract's rounding of the tuned values
# ---------------------------------------------------------------------------------------------

def oracle_tuned(w, s, v, t, unit):
    """docs/numerics.md "Tuned rounding", one element at a time in scalar fp32 (tests/oracle.py): the byte moved by
    round(t * steps) (half to even), clamped; r and d of that byte; y = x * r; o = v * step(y); y' = y + o
    where o != 0; the nearest E2M1 code of y'. Returns (codes, bytes) as nested lists."""
    steps = tuned.STEPS_PER_OCTAVE[s.scheme]
    top = 254 if s.scheme == "mxfp4" else 0x7E
    bs = SCHEMES[s.scheme].block_size
    gs = float(s.gs) if s.gs is not None else None
    codes, bytes_ = [], []
    for row, vrow, trow, brow in zip(w.tolist(), v.tolist(), t.tolist(), s.scale.tolist()):
        rc, rb = [], []
        for j, (tb, b0) in enumerate(zip(trow, brow)):
            b = min(max(b0 + round(oracle.f32(tb * steps)), 0), top)
            if s.scheme == "mxfp4":
                r = 2.0 ** (127 - b)
            else:
                sf = oracle.E4M3[b]
                r = min(oracle.f32(gs / sf), oracle.FLT_MAX) if sf > 0 else 0.0
            for x, vv in zip(row[j * bs:(j + 1) * bs], vrow[j * bs:(j + 1) * bs]):
                y = oracle.f32(x * r)
                step = 1.0 if unit == "absolute" else 0.5 if abs(y) < 2 else 1.0 if abs(y) < 4 else 2.0
                o = oracle.f32(vv * step)
                rc.append(oracle.e2m1(oracle.f32(y + o) if o != 0 else y))
            rb.append(b)
        codes.append(rc)
        bytes_.append(rb)
    return codes, bytes_


@pytest.mark.parametrize("scheme,rule", [("nvfp4", "4over6"), ("nvfp4", "max"), ("mxfp4", "wmse"), ("mxfp4", "floor")])
@pytest.mark.parametrize("unit", tuned.OFFSET_UNITS)
def test_the_final_bytes_are_the_oracles_rounding_of_the_tuned_values(scheme, rule, unit):
    """quantize() against an independent scalar reading of the section, on fresh random weights, offsets
    and moves with planted ties (offsets onto E2M1 midpoints, moves of exactly half a byte step), -0.0 and
    saturating values."""
    seed = oracle.fresh_seed()
    w = planted_weight(5, 64, seed)
    s = tuned.start(w, scheme, rule)
    v, t = tuned_values(w, scheme, seed)
    got = tuned.quantize(w, s, v, t, unit)
    codes, bytes_ = oracle_tuned(w, s, v, t, unit)
    assert ref.unpack_nibbles(got.packed).tolist() == codes
    assert got.scale.view(torch.uint8).tolist() == bytes_
    decode = (ref.nvfp4_dequantize(got.packed, got.scale, got.gs) if scheme == "nvfp4"
              else ref.mxfp4_dequantize(got.packed, got.scale))
    assert torch.equal(got.dequantized, decode)  # what a reader decodes from the bytes


def test_an_offset_of_half_a_step_reaches_each_neighbour_and_ties_go_to_even():
    """In grid steps, +-0.5 puts a value on the grid exactly on the midpoint to its neighbour, and the midpoint
    goes to the even code (the contract's E2M1): from 1.0 (code 2), +0.5 step is 1.25 -> 1.0 (code 2, even) and
    -0.5 step is 0.75 -> 1.0; from 1.5 (code 3), +-0.5 step reach 1.75 -> 2.0 and 1.25 -> 1.0. Just beyond
    half a step (0.5001) the odd neighbours are reached too."""
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([1.0, 1.0, 1.5, 1.5])
    w[0, 4:8] = torch.tensor([1.0, 1.0, 3.0, 3.0])
    w[0, 31] = 4.0  # the block's largest: exponent 127 under floor (multiplier 1)
    s = tuned.start(w, "mxfp4", "floor")
    assert s.scale.tolist() == [[127]]
    v = torch.zeros_like(w)
    v[0, :8] = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.5001, -0.5001, 0.5001, -0.5001])
    got = ref.unpack_nibbles(tuned.quantize(w, s, v).packed)[0, :8].tolist()
    assert got == [2, 2, 4, 2, 3, 1, 6, 4]  # 1.0, 1.0, 2.0, 1.0, 1.5, 0.5, 4.0, 2.0
    assert ref.unpack_nibbles(tuned.quantize(w, s, v, unit="absolute").packed)[0, :8].tolist() == \
        [3, 1, 4, 2, 3, 1, 6, 4]  # absolute: +-0.5 is a whole step below 2 and half of one in [2, 4)


def test_scale_moves_are_byte_steps_rounded_half_to_even_and_clamped():
    """E8M0: one exponent per octave, a move of exactly 0.5 stays (half to even), 0.51 moves; E4M3: eight byte
    steps per octave; both clamped to the largest finite byte and to 0."""
    w = oracle.random_weight(2, 64, 3)
    mx = tuned.Start("mxfp4", torch.tensor([[120, 253], [0, 1]], dtype=torch.uint8), None)
    t = torch.tensor([[0.5, 1.0], [-1.0, -0.51]])
    assert tuned.scale_bytes(mx, t).tolist() == [[120, 254], [0, 0]]
    assert tuned.scale_bytes(mx, torch.tensor([[1.5, 0.51], [0.49, -0.49]])).tolist() == [[122, 254], [0, 1]]
    nv = tuned.start(w, "nvfp4", "max")
    b0 = nv.scale.to(torch.int32)
    moved = tuned.scale_bytes(nv, torch.full(nv.scale.shape, 0.125)).to(torch.int32)
    assert torch.equal(moved, (b0 + 1).clamp(max=0x7E))
    assert bool((tuned.scale_bytes(nv, torch.ones(nv.scale.shape)).to(torch.int32) == (b0 + 8).clamp(max=0x7E)).all())
    assert int(tuned.scale_bytes(nv, torch.full(nv.scale.shape, -1.0)).min()) >= 0


# ---------------------------------------------------------------------------------------------
# The differentiable stand-in
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme,rule", [("nvfp4", "4over6"), ("mxfp4", "wmse")])
@pytest.mark.parametrize("unit", tuned.OFFSET_UNITS)
def test_the_stand_ins_values_are_exactly_the_final_decode(scheme, rule, unit):
    """While tuning, the block computes with exactly the weights the checkpoint will hold (bit for bit,
    -0.0 included), at zero tuning and at any tuned point."""
    seed = oracle.fresh_seed()
    w = planted_weight(6, 128, seed)
    s = tuned.start(w, scheme, rule)
    for v, t in ((torch.zeros_like(w), torch.zeros(s.scale.shape)), tuned_values(w, scheme, seed)):
        v.requires_grad_(True)
        t.requires_grad_(True)
        fq = tuned.fake_quantize(w, s, v, t, unit)
        final = tuned.quantize(w, s, v, t, unit).dequantized
        assert torch.equal(fq.detach(), final)
        assert torch.equal(torch.signbit(fq.detach()), torch.signbit(final))


def test_the_stand_ins_e2m1_rounding_is_the_encoders_on_every_kind_of_value():
    """e2m1_round (the stand-in's rounding) against the reference's encode + decode, bit for bit: fresh random fp32
    bit patterns over every binade (subnormals, huge values), every E2M1 midpoint and grid value with its
    neighbouring fp32 values on both sides, and both zeros."""
    g = torch.Generator().manual_seed(oracle.fresh_seed())
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    y = bits.view(torch.float32)
    y = y[torch.isfinite(y)]
    marks = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    near = torch.cat([torch.nextafter(marks, torch.full_like(marks, -1.0)), marks, torch.nextafter(marks, torch.full_like(marks, 9.0))])
    y = torch.cat([y, near, -near, torch.tensor([0.0, -0.0])])
    want = ref.e2m1_decode(ref.e2m1_encode(y))
    got = tuned.e2m1_round(y)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_the_gradients_are_the_straight_through_estimators():
    """d w_hat / d v = d * step inside [-6, 6] and 0 where the offset value saturates; d w_hat / d t summed over
    a block = ln 2 * sum(c * (w_hat - x)) for a loss sum(c * w_hat) (the decode step's and the encode
    multiplier's gradients together: LSQ's rounding residual), here checked on an MXFP4 block."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 32, generator=g) * 0.1
    w[0, 0] = 1.9  # saturates under the floor rule's exponent for this row (1.9 * 2^(127 - 125) = 7.6 > 6)
    s = tuned.start(w, "mxfp4", "floor")
    v = torch.zeros_like(w, requires_grad=True)
    t = torch.zeros(s.scale.shape, requires_grad=True)
    c = torch.randn(w.shape, generator=g)
    fq = tuned.fake_quantize(w, s, v, t)
    (c * fq).sum().backward()
    r, d = tuned.multipliers(s, s.scale)
    y = (w.reshape(3, 1, 32) * r[..., None]).reshape(w.shape)
    expect_v = torch.where(y.abs() <= 6, c * d.repeat_interleave(32, -1) * tuned.grid_step(y), torch.zeros_like(c))
    assert torch.allclose(v.grad, expect_v, rtol=1e-6, atol=0)
    assert v.grad[0, 0].item() == 0.0
    inside = (y.abs() <= 6).float()
    # w_hat = q(x r) d: dq/dt = -x r ln2 inside (through r), 0 outside; dd/dt = d ln2  ->  ln2 (q d - x r d inside)
    expect_t = (math.log(2) * c * (fq.detach() - w * inside)).reshape(3, 1, 32).sum(-1)
    assert torch.allclose(t.grad, expect_t, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Tuning: it does what it is for, deterministically
# ---------------------------------------------------------------------------------------------

def tune_layer(scheme, rule, steps=60, lr=None, seed=0, scales=True):
    """A linear layer's weights tuned to reproduce its outputs on correlated inputs: signed steps on the
    offsets (and scale moves) with a linear rate, the iteration with the lowest loss kept (the method's loop,
    reduced to one layer and one batch)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 32, generator=g) @ torch.randn(32, 128, generator=g) / 32**0.5 \
        + 0.05 * torch.randn(512, 128, generator=g)
    w = torch.randn(48, 128, generator=g) * 0.05
    s = tuned.start(w, scheme, rule)
    v = torch.zeros_like(w, requires_grad=True)
    t = torch.zeros(s.scale.shape, requires_grad=True)
    lr = lr if lr is not None else 1.0 / steps
    target = x @ w.T
    best = (float("inf"), v.detach().clone(), t.detach().clone())
    for i in range(steps):
        loss = ((x @ tuned.fake_quantize(w, s, v, t if scales else None).T - target) ** 2).mean()
        if loss.item() < best[0]:
            best = (loss.item(), v.detach().clone(), t.detach().clone())
        v.grad = t.grad = None
        loss.backward()
        rate = tuned.learning_rate(lr, i, steps)
        tuned.signed_step(v, v.grad, rate, tuned.OFFSET_LIMIT)
        tuned.signed_step(t, t.grad, rate, tuned.SCALE_LIMIT)
    final = tuned.quantize(w, s, best[1], best[2] if scales else None)
    start_err = ((x @ (tuned.quantize(w, s).dequantized - w).T) ** 2).mean()
    return final, float(((x @ (final.dequantized - w).T) ** 2).mean()), float(start_err), best[1], best[2]


@pytest.mark.parametrize("scheme,rule", [("nvfp4", "4over6"), ("mxfp4", "wmse")])
def test_tuning_lowers_the_layer_output_error_below_the_data_free_start(scheme, rule):
    """What the method is for: the layer's output error on its inputs drops well below round-to-nearest's
    (offsets and scale moves tuned, at a rate that moves an offset 0.15 grid steps in all)."""
    _, err, start_err, v, _ = tune_layer(scheme, rule, steps=60, lr=0.005)
    assert err < 0.8 * start_err
    assert float(v.detach().abs().max()) <= tuned.OFFSET_LIMIT


def test_tuning_is_deterministic_on_one_device():
    """The same inputs, seed and settings give the same offsets, moves and bytes (CPU, twice)."""
    a, b = tune_layer("mxfp4", "wmse", steps=20), tune_layer("mxfp4", "wmse", steps=20)
    assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
    assert torch.equal(a[0].packed, b[0].packed) and torch.equal(a[0].scale, b[0].scale)


def test_signed_steps_and_the_learning_rate():
    p = torch.tensor([0.0, 0.49, -0.49, 0.2])
    tuned.signed_step(p, torch.tensor([-1.0, -3.0, 2.0, 0.0]), 0.1, 0.5)
    assert torch.equal(p, torch.tensor([0.1, 0.5, -0.5, 0.2]))  # clamped at the limit; a zero gradient stays
    assert [tuned.learning_rate(0.01, i, 4) for i in range(4)] == [0.01, 0.0075, 0.005, 0.0025]


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------

def test_what_is_refused():
    w = oracle.random_weight(2, 64, 1)
    s = tuned.start(w, "mxfp4", "floor")
    bad = w.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        tuned.quantize(bad, s)
    nan_v = torch.zeros_like(w)
    nan_v[0, 0] = float("inf")
    with pytest.raises(NonFiniteError):
        tuned.quantize(w, s, nan_v)
    with pytest.raises(NonFiniteError):
        tuned.quantize(w, s, None, torch.full(s.scale.shape, float("nan")))
    with pytest.raises(QuantizationError, match="offsets of shape"):
        tuned.quantize(w, s, torch.zeros(2, 32))
    with pytest.raises(QuantizationError, match="scale moves of shape"):
        tuned.quantize(w, s, None, torch.zeros(2, 1))
    with pytest.raises(QuantizationError, match="offset unit"):
        tuned.quantize(w, s, torch.zeros_like(w), unit="bits")
    with pytest.raises(QuantizationError, match="block scales"):
        tuned.quantize(oracle.random_weight(2, 96, 1), s)
    with pytest.raises(QuantizationError, match="global scale"):
        tuned.start(w, "mxfp4", "floor", global_amax=1.0)
    with pytest.raises(QuantizationError, match="scale rule"):
        tuned.start(w, "mxfp4", "4over6")
