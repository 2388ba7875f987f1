"""GPTQ's CPU sweep (csrc/fp4c_cpu.cpp ``fp4c_cpu_gptq_sweep``, fp4convert/kernels/gptq.py) against the
reference sweep (fp4convert/numerics/gptq.py ``sweep_batch``), byte for byte: every output of a column
batch (codes, scale bytes, values, errors) and whole matrices through ``gptq.quantize``, on fresh random
inputs and the edge cases (zero and dead columns, saturation, subnormal weights, ties, ragged row tiles,
every batch width, non-finite blocks), for every scale rule of both schemes, with and without input
weights, on 1, 2 and 5 threads and on every x86-64 level this CPU runs."""

from __future__ import annotations

import pytest
import torch

from fp4convert.errors import NonFiniteError, QuantizationError
from fp4convert.kernels import cpu_lib, jit
from fp4convert.kernels import gptq as kernel_gptq
from fp4convert.numerics import gptq
from fp4convert.numerics import reference as ref
from fp4convert.numerics.scheme import SCHEMES
from tests.kernels.test_cpu_kernel import x86_levels
from tests.oracle import fresh_seed, random_weight

CASES = [(s, r) for s in ("nvfp4", "mxfp4") for r in SCHEMES[s].scale_rules]


@pytest.fixture(scope="module")
def lib():
    if jit.cxx() is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here (the reference sweep is used)")
    return cpu_lib.load()


def hessian(k: int, seed: int, dead: tuple[int, ...] = ()) -> torch.Tensor:
    """A correlated inputs' X^T X (a random mix of fewer sources), ``dead`` inputs always 0."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(4 * k, k // 2, generator=g)
    x = z @ torch.randn(k // 2, k, generator=g) + 0.1 * torch.randn(4 * k, k, generator=g)
    x[:, list(dead)] = 0.0
    return x.double().T @ x.double()


def batch(n: int, b: int, seed: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1 [n, b], u1 [b, b], amax, iw [b]): one column batch as gptq.quantize hands it to the sweep."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(n, b, generator=g) * torch.rand(1, b, generator=g) * 0.1
    p = gptq.prepare(hessian(b, seed, dead=(1,)))
    amax = w1.abs().amax() * (0.5 + torch.rand((), generator=g))  # a fused group's amax, above or below
    return w1, p.u, amax, p.diag


def equal_outputs(a, b) -> None:
    """Codes, scale bytes, and the values and errors on their bits (a -0.0 or a NaN payload counts)."""
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert torch.equal(a[2].view(torch.int32), b[2].view(torch.int32))
    assert torch.equal(a[3].view(torch.int32), b[3].view(torch.int32))


def same(a: gptq.Result, b: gptq.Result) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
    assert torch.equal(a.dequantized.view(torch.int32), b.dequantized.view(torch.int32))
    assert (a.gs is None) == (b.gs is None) and (a.gs is None or torch.equal(a.gs, b.gs))


def both(w: torch.Tensor, h: torch.Tensor, scheme: str, rule: str, act_order: bool, block: int = gptq.BLOCK,
         amax=None) -> tuple[gptq.Result, gptq.Result]:
    p = gptq.prepare(h, act_order=SCHEMES[scheme].block_size if act_order else None)
    return (gptq.quantize(w, p, scheme, rule, amax, block, gptq.sweep_batch),
            gptq.quantize(w, p, scheme, rule, amax, block, kernel_gptq.cpu_sweep))


@pytest.mark.parametrize("scheme,rule", CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_one_batch_equals_the_reference_on_fresh_random_inputs(lib, scheme, rule, weighted):
    """Every output of the sweep, with and without input weights (a zero weight included), on 1, 2 and 5
    threads, for row counts that fill the 16-row tiles and ones that leave a ragged last tile."""
    seed = fresh_seed()
    bs = SCHEMES[scheme].block_size
    for n, b in ((48, 128), (37, 96 if bs == 16 else 64), (1, 2 * bs)):
        w1, u1, amax, iw = batch(n, b, seed, scheme)
        iw = iw if weighted else None
        a = amax if scheme == "nvfp4" else None
        want = gptq.sweep_batch(w1.clone(), u1, scheme, rule, a, iw)
        for threads in (1, 2, 5):
            gs = None if a is None else float(ref.global_scale(a))
            got = cpu_lib.gptq_sweep(lib, w1, u1, scheme, rule, gs,
                                     iw if SCHEMES[scheme].rule(rule).searches else None, threads)
            assert got is not None
            equal_outputs(want, got)
        equal_outputs(want, kernel_gptq.cpu_sweep(w1, u1, scheme, rule, a, iw))


@pytest.mark.parametrize("scheme,rule", CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_whole_matrices_equal_the_reference(lib, scheme, rule, act_order):
    """gptq.quantize with the CPU sweep: the stored bytes and the dequantized weights of the reference,
    dead inputs and several batches (the lazy update between them) included."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    k = 384
    w = torch.randn(70, k, generator=g) * torch.rand(1, k, generator=g) * 0.1
    same(*both(w, hessian(k, seed, dead=(5, 300)), scheme, rule, act_order))


@pytest.mark.parametrize("scheme,rule", CASES)
def test_golden_edges(lib, scheme, rule):
    """Zeros, saturation (a fused amax far below the weights), subnormal and huge weights, E2M1 ties and
    binades (a diagonal Hessian keeps them as planted), every batch width from one scale block to 512."""
    k = 256
    h = hessian(k, 11)
    same(*both(torch.zeros(8, k), h, scheme, rule, False))
    big = torch.randn(64, k, generator=torch.Generator().manual_seed(12)) * 100
    same(*both(big, h, scheme, rule, False, amax=torch.tensor(1.0) if scheme == "nvfp4" else None))
    same(*both(big * 1e20, h, scheme, rule, False))
    tiny = torch.randn(64, k, generator=torch.Generator().manual_seed(13)) * 1e-39
    same(*both(tiny, h, scheme, rule, False))
    planted = random_weight(40, k, 14)
    same(*both(planted, torch.diag(torch.rand(k, dtype=torch.float64) + 0.5), scheme, rule, False))
    wide = torch.cat([big / 100, big / 300], dim=1)  # K = 512
    h2 = hessian(2 * k, 15)
    for block in (SCHEMES[scheme].block_size, 96, 256, 512):
        if block % SCHEMES[scheme].block_size == 0:
            same(*both(wide, h2, scheme, rule, True, block=block))


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_an_overflow_is_the_reference_s_outcome(lib, scheme):
    """Errors that overflow inside a batch (a factor with a tiny diagonal): where a block holds Inf/NaN
    when its scale is chosen, both raise the reference's NonFiniteError; inside the last block (no
    scale chosen after it), both return the same bytes."""
    bs = SCHEMES[scheme].block_size
    b = 2 * bs
    w1 = torch.randn(20, b, generator=torch.Generator().manual_seed(16))
    u1 = torch.eye(b)
    u1[0, 0] = 1e-45  # column 0's errors overflow into the next block ...
    u1[0, 1:] = 1.0
    amax = w1.abs().amax() if scheme == "nvfp4" else None
    with pytest.raises(NonFiniteError) as want:
        gptq.sweep_batch(w1.clone(), u1, scheme, "max" if scheme == "nvfp4" else "floor", amax, None)
    with pytest.raises(NonFiniteError) as got:
        kernel_gptq.cpu_sweep(w1, u1, scheme, "max" if scheme == "nvfp4" else "floor", amax, None)
    assert str(got.value) == str(want.value)
    u2 = torch.eye(b)
    u2[bs, bs] = 1e-45  # ... or only into the last block's later columns: no scale is chosen after it
    u2[bs, bs + 1:] = torch.linspace(-1.0, 1.0, bs - 1)
    u2[bs, bs + 3] = 0.0  # 0 * Inf: a NaN
    for rule in SCHEMES[scheme].scale_rules:
        want_out = gptq.sweep_batch(w1.clone(), u2, scheme, rule, amax, None)
        assert not bool(torch.isfinite(want_out[3]).all())  # (the case does overflow)
        got_out = kernel_gptq.cpu_sweep(w1, u2, scheme, rule, amax, None)
        assert torch.equal(want_out[0], got_out[0]) and torch.equal(want_out[1], got_out[1])
        assert torch.equal(want_out[2].view(torch.int32), got_out[2].view(torch.int32))
        assert torch.equal(want_out[3].isnan(), got_out[3].isnan())
        finite = ~want_out[3].isnan()
        assert torch.equal(want_out[3][finite].view(torch.int32), got_out[3][finite].view(torch.int32))


def test_bad_input_weights_are_refused_as_the_reference_refuses_them(lib):
    w1, u1, amax, iw = batch(16, 64, 17, "nvfp4")
    bad = iw.clone()
    bad[3] = -1.0
    with pytest.raises(QuantizationError, match="finite and >= 0"):
        gptq.sweep_batch(w1.clone(), u1, "nvfp4", "mse", amax, bad)
    with pytest.raises(QuantizationError, match="finite and >= 0"):
        kernel_gptq.cpu_sweep(w1, u1, "nvfp4", "mse", amax, bad)


def test_an_empty_batch_and_the_inputs_are_left_alone(lib):
    _, u1, amax, iw = batch(4, 64, 18, "nvfp4")
    got = kernel_gptq.cpu_sweep(torch.zeros(0, 64), u1, "nvfp4", "mse", amax, iw)
    assert [tuple(t.shape) for t in got] == [(0, 64), (0, 4), (0, 64), (0, 64)]
    w1, u1, amax, iw = batch(20, 64, 19, "nvfp4")
    before = w1.clone()
    kernel_gptq.cpu_sweep(w1, u1, "nvfp4", "mse", amax, iw)
    assert torch.equal(w1, before)


def test_sweep_for_picks_the_kernel_on_the_cpu_and_the_switch_turns_it_off(lib, monkeypatch):
    assert kernel_gptq.sweep_for(torch.device("cpu")) is kernel_gptq.cpu_sweep
    assert kernel_gptq.sweep_for(torch.device("cuda"), kernel_gptq.CUDA_MAX_BLOCK + 128) is gptq.sweep_batch
    monkeypatch.setenv("FP4CONVERT_CPU_KERNEL", "0")
    assert kernel_gptq.sweep_for(torch.device("cpu")) is gptq.sweep_batch
    w1, u1, amax, iw = batch(20, 64, 20, "mxfp4")
    equal_outputs(gptq.sweep_batch(w1.clone(), u1, "mxfp4", "wmse", None, iw),
                  kernel_gptq.cpu_sweep(w1, u1, "mxfp4", "wmse", None, iw))  # (the reference itself, then)


@pytest.mark.slow
def test_every_x86_level_gives_the_reference_s_sweep(lib, tmp_path):
    """Each x86-64 level this CPU runs, built alone (no clones): the sweep's bytes are the reference's."""
    levels = x86_levels()
    if not levels:
        pytest.skip("not an x86-64 Linux machine")
    base = cpu_lib.spec()
    seed = fresh_seed()
    for level in levels:
        one = jit.BuildSpec(**{**base.__dict__, "flags": (*base.flags, "-DFP4C_NO_CLONES", f"-march={level}"),
                               "tag": f"cpu-{level}", "root": tmp_path})
        one_lib = cpu_lib.open_library(one.build())
        for scheme, rule in CASES:
            w1, u1, amax, iw = batch(37, 128, seed, scheme)
            a = amax if scheme == "nvfp4" else None
            want = gptq.sweep_batch(w1.clone(), u1, scheme, rule, a, iw)
            gs = None if a is None else float(ref.global_scale(a))
            got = cpu_lib.gptq_sweep(one_lib, w1, u1, scheme, rule, gs,
                                     iw if SCHEMES[scheme].rule(rule).searches else None, 2)
            assert got is not None
            equal_outputs(want, got)
