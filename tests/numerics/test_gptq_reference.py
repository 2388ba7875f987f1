"""The reference GPTQ (fp4convert/numerics/gptq.py, docs/numerics.md "GPTQ"): what it must do, on the CPU."""

from __future__ import annotations

import pytest
import torch

from fp4convert.errors import NonFiniteError, QuantizationError
from fp4convert.numerics import gptq
from fp4convert.numerics import reference as ref
from fp4convert.numerics.scheme import SCHEMES

CASES = [(s, r) for s in ("nvfp4", "mxfp4") for r in SCHEMES[s].scale_rules]


def rtn(w: torch.Tensor, scheme: str, rule: str, iw: torch.Tensor | None = None):
    if scheme == "nvfp4":
        p, s, gs = ref.nvfp4_quantize(w, scale_rule=rule, input_weight=iw)
        return p, s.view(torch.uint8), gs, ref.nvfp4_dequantize(p, s, gs)
    p, s = ref.mxfp4_quantize(w, scale_rule=rule, input_weight=iw)
    return p, s, None, ref.mxfp4_dequantize(p, s)


def correlated_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    """Inputs whose channels are correlated (a random mix of fewer sources), as a layer's are."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, k // 2, generator=g)
    mix = torch.randn(k // 2, k, generator=g) / (k // 2) ** 0.5
    return z @ mix + 0.1 * torch.randn(tokens, k, generator=g)


@pytest.mark.parametrize("scheme,rule", CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_a_diagonal_hessian_propagates_nothing_so_gptq_is_round_to_nearest(scheme, rule, act_order):
    """With H diagonal, U is diagonal: no column's error reaches another, so every block's scale and
    code are the data-free quantizer's on the same weights (input-weighted by diag(H) for the search
    rules): the FP4 step inside the sweep is the same bit-exact quantizer. With act_order the blocks run
    in another order and must come back in place."""
    g = torch.Generator().manual_seed(1)
    k = 256
    w = torch.randn(48, k, generator=g) * 0.05
    diag = torch.rand(k, generator=g) + 0.5
    searches = SCHEMES[scheme].rule(rule).searches
    p = gptq.prepare(torch.diag(diag.double()), act_order=SCHEMES[scheme].block_size if act_order else None)
    if act_order:
        assert not torch.equal(p.perm, torch.arange(k))  # the order did change
    got = gptq.quantize(w, p, scheme, rule)
    packed, scale, gs, deq = rtn(w, scheme, rule, diag if searches else None)
    assert torch.equal(got.packed, packed)
    assert torch.equal(got.scale.view(torch.uint8), scale)
    if gs is not None:
        assert torch.equal(got.gs, gs)
    assert torch.equal(got.dequantized, deq)


@pytest.mark.parametrize("scheme,rule", [("nvfp4", "max"), ("nvfp4", "4over6"), ("nvfp4", "mse"), ("mxfp4", "floor"),
                                         ("mxfp4", "wmse")])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_layer_output_error_below_round_to_nearest(scheme, rule, act_order):
    """What GPTQ is for: on correlated inputs, the error of the layer's outputs X W^T (not of the
    weights) is lower than the data-free quantizer's, by a clear margin."""
    k = 256
    x = correlated_inputs(2048, k, seed=2)
    w = torch.randn(64, k, generator=torch.Generator().manual_seed(3)) * 0.05
    h = (x.double().T @ x.double()) / x.shape[0]
    got = gptq.quantize(w, gptq.prepare(h, act_order=SCHEMES[scheme].block_size if act_order else None), scheme, rule)
    deq_rtn = rtn(w, scheme, rule)[3]
    err_gptq = ((x @ (w - got.dequantized).T) ** 2).mean()
    err_rtn = ((x @ (w - deq_rtn).T) ** 2).mean()
    assert err_gptq < 0.8 * err_rtn


def test_the_stored_bytes_decode_to_the_weights_the_next_blocks_are_calibrated_on():
    x = correlated_inputs(512, 128, seed=4)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    p = gptq.prepare(x.double().T @ x.double())
    for scheme in ("nvfp4", "mxfp4"):
        r = gptq.quantize(w, p, scheme)
        deq = (ref.nvfp4_dequantize(r.packed, r.scale, r.gs) if scheme == "nvfp4"
               else ref.mxfp4_dequantize(r.packed, r.scale))
        assert torch.equal(deq, r.dequantized)


def test_a_dead_input_gets_zero_weights_and_a_fused_amax_sets_the_global_scale():
    """An input that was always 0 (H[j, j] == 0) cannot tell GPTQ anything: its weights become 0 (GPTQ's
    rule). The global scale comes from the amax given (a fused group's), not from the matrix."""
    x = correlated_inputs(512, 64, seed=6)
    x[:, 7] = 0.0
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(7))
    p = gptq.prepare(x.double().T @ x.double())
    assert bool(p.dead[7]) and int(p.dead.sum()) == 1
    r = gptq.quantize(w, p, "nvfp4", "max", global_amax=torch.tensor(10.0))
    assert torch.equal(r.gs, ref.global_scale(torch.tensor(10.0)))
    assert torch.all(r.dequantized[:, 7] == 0)
    assert torch.isfinite(r.dequantized).all()


def test_runs_are_deterministic():
    x = correlated_inputs(512, 128, seed=8)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(9))
    h = x.double().T @ x.double()
    a = gptq.quantize(w, gptq.prepare(h, act_order=16), "nvfp4", "mse")
    b = gptq.quantize(w, gptq.prepare(h, act_order=16), "nvfp4", "mse")
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


def test_bad_hessians_and_weights_are_refused():
    with pytest.raises(QuantizationError, match="NaN"):
        gptq.prepare(torch.full((32, 32), float("nan"), dtype=torch.float64))
    with pytest.raises(QuantizationError, match="does not factorize"):
        gptq.prepare(-torch.eye(32, dtype=torch.float64))  # negative definite: no dampening helps
    with pytest.raises(QuantizationError, match="square"):
        gptq.prepare(torch.eye(32, 16, dtype=torch.float64))
    p = gptq.prepare(torch.eye(32, dtype=torch.float64))
    w = torch.zeros(4, 32)
    w[1, 3] = float("inf")
    with pytest.raises(NonFiniteError):
        gptq.quantize(w, p, "nvfp4")
    with pytest.raises(QuantizationError, match="K=64"):
        gptq.quantize(torch.zeros(4, 64), p, "nvfp4")
    with pytest.raises(QuantizationError, match="multiple"):
        gptq.quantize(torch.zeros(4, 32), p, "mxfp4", block=48)


def test_a_hessian_the_asked_dampening_cannot_factorize_gets_more_and_says_so():
    """A Hessian with a slightly negative direction (float error in a real sum can make one): damp 0.01
    of its mean diagonal does not make it definite, 10x that does; ``Prepared.damp`` says what was used
    (the manifest lists such matrices)."""
    h = torch.diag(torch.tensor([1.0] * 63 + [-0.05], dtype=torch.float64))
    p = gptq.prepare(h, damp=0.01)
    assert p.damp == pytest.approx(0.1)


def _engine_rounding(x: torch.Tensor) -> torch.Tensor:
    """W4A4 NVFP4 activations as an engine rounds them (rule max, the inputs' own amax)."""
    p, s, g = ref.nvfp4_quantize(x, float(x.abs().amax()), None, "max")
    return ref.nvfp4_dequantize(p, s, g, None)


def test_without_a_cross_term_the_target_is_the_weights_themselves():
    """A zero cross term (inputs the engine does not round) moves nothing: the swept weights and the
    bytes are plain GPTQ's."""
    x = correlated_inputs(512, 64, 5).double()
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    h = x.T @ x / 512
    plain = gptq.prepare(h, act_order=16)
    zero = gptq.prepare(h, act_order=16, cross=torch.zeros_like(h))
    assert plain.shift is None and zero.shift is not None and not bool(zero.shift.any())
    assert torch.equal(gptq.target(w, zero), w) and torch.equal(gptq.target(w, plain), w)
    a, b = gptq.quantize(w, plain, "nvfp4"), gptq.quantize(gptq.target(w, zero), zero, "nvfp4")
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))


@pytest.mark.parametrize("act_order", [False, True])
def test_the_w4a4_target_reproduces_the_unrounded_outputs_from_rounded_inputs(act_order):
    """``W* = W + W @ shift`` is the least-squares weight for rounded inputs ``X~`` and unrounded
    outputs ``X W^T`` (up to the dampening): its output error on ``X~`` is below ``W``'s own, and
    GPTQ of ``W*`` under ``X~``'s Hessian serves (``X~ Q^T``) closer to ``X W^T`` than GPTQ of ``W``
    under ``X``'s Hessian, the symmetric objective that ignores the rounding. The permutation of
    act-order leaves the target in natural column order."""
    x = correlated_inputs(2048, 128, 7).double()
    xq = _engine_rounding(x.float()).double()
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(8))
    n = x.shape[0]
    order = 16 if act_order else None
    asym = gptq.prepare(xq.T @ xq / n, act_order=order, cross=(x - xq).T @ xq / n)
    wt = gptq.target(w, asym)
    want = x @ w.double().T

    def err(served: torch.Tensor) -> float:
        return float(((want - served) ** 2).mean())

    assert err(xq @ wt.double().T) < 0.9 * err(xq @ w.double().T)
    sym = gptq.quantize(w, gptq.prepare(x.T @ x / n, act_order=order), "nvfp4")
    got = gptq.quantize(wt, asym, "nvfp4")
    assert err(xq @ got.dequantized.double().T) < 0.9 * err(xq @ sym.dequantized.double().T)


def test_a_non_finite_cross_term_is_refused():
    h = torch.eye(32, dtype=torch.float64)
    c = torch.zeros_like(h)
    c[3, 4] = float("nan")
    with pytest.raises(QuantizationError, match="NaN"):
        gptq.prepare(h, cross=c)
