"""The CUDA kernels against the pure-PyTorch reference, bit for bit (needs a CUDA GPU; skips without).

Every case draws fresh random data (the seed is in each failure message), runs the reference on a
CPU copy, and compares raw bytes with ``torch.equal``. Output buffers are poisoned (0xFF, which is
NaN in every float dtype here) so an unwritten byte fails. Golden cases put exact E2M1 ties, -0,
zero blocks, subnormal E4M3 scales, saturation, tiny amax and exact ties between scale-rule
candidates into the data. Every scale rule x scheme x dtype x rotation x scale layout is covered.
"""

from __future__ import annotations

import os

import pytest
import torch

import fp4convert
from fp4convert import NonFiniteError
from fp4convert.numerics import reference as ref
from fp4convert.kernels.cuda import ops
from fp4convert.errors import CUDAKernelError
from fp4convert.numerics.scheme import get_scheme
from fp4convert.numerics.swizzle import swizzle_scales
from fp4convert.kernels.tensor import QuantizedTensor

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ops.available(), reason="needs a CUDA GPU (capability >= 8.9) and nvcc"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK = {"nvfp4": 16, "mxfp4": 32}
RULES = {s: get_scheme(s).scale_rules for s in ("nvfp4", "mxfp4")}  # every rule, in the kernels' code order
SCHEME_RULES = [(s, r) for s in ("nvfp4", "mxfp4") for r in RULES[s]]
# (B, M, K): a single row; M not a multiple of 128 with K % 64 != 0; a batch whose matrices start
# mid-16-byte (M * K % 32 == 16: tail groups); a regular batch; odd M with K % 64 == 32.
SHAPES = [(1, 1, 64), (1, 200, 96), (3, 129, 48), (2, 256, 512), (4, 33, 160)]
KINDS = ["randn", "scaled", "heavy", "golden", "ties46", "zeros", "tiny", "huge"]
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
EXACT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _golden(fmt: str, shape: tuple[int, int, int], dtype: torch.dtype, gen: torch.Generator,
            table: tuple[float, ...] = TIES + EXACT + (5.5, 0.1, 7.0, 2.25)) -> torch.Tensor:
    """Blocks whose scaled values land exactly on E2M1 ties and grid points.

    NVFP4: amax = 2688 / 16 makes gs = 16, and a block max of 6 * 2^p gives s = 2^(p+4) (E4M3
    subnormal for p < -10), so r = 2^-p and y = x * r is exact. MXFP4: the block max 6 * 2^p gives
    r = 2^-p. Some blocks are all zero, some elements -0.
    """
    b, m, k = shape
    bs = BLOCK[fmt]
    nblk = b * m * k // bs
    # fp16 MXFP4: p <= 11, so that Had16 of a block (|values| up to 4 * 7 * 2^p = 57344) stays finite in fp16
    # (p = 12 overflowed to Inf for some seeds: the "golden" rotated input was not finite).
    lo, hi = ((-13, 3) if fmt == "nvfp4" else ((-12, 11) if dtype == torch.float16 else (-40, 40)))
    p = torch.randint(lo, hi + 1, (nblk, 1), generator=gen).double()
    tab = torch.tensor(table, dtype=torch.float64)
    v = tab[torch.randint(0, len(tab), (nblk, bs), generator=gen)]
    v = torch.where(torch.rand(nblk, bs, generator=gen) < 0.5, -v, v)
    v[torch.arange(nblk), torch.randint(0, bs, (nblk,), generator=gen)] = 6.0  # the block max
    v = v * torch.exp2(p)
    v[torch.rand(nblk, generator=gen) < 0.05] = 0.0  # all-zero blocks
    v = v.reshape(b, m, k)
    v[torch.rand(b, m, k, generator=gen) < 0.02] = -0.0
    if fmt == "nvfp4":
        v.view(b, -1)[:, 0] = 168.0  # amax -> gs = 16
    return v.float()


def make_input(kind: str, fmt: str, shape, dtype: torch.dtype, rotate: str | None, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    b, m, k = shape
    if kind == "randn":
        x = torch.randn(shape, generator=gen)
    elif kind == "scaled":  # rows spanning 8 decades, like real weights with outlier channels
        x = torch.randn(shape, generator=gen) * torch.exp(torch.empty(b, m, 1).uniform_(-9, 9, generator=gen))
    elif kind == "heavy":
        x = torch.randn(shape, generator=gen) ** 3 * 50
    elif kind in ("golden", "ties46"):
        # ties46: values in {0, 1.5, 3, 6} * 2^p only, exact on both the /6 and the /4 grid (NVFP4:
        # s4 = 1.5 s6), so b4 and b6 tie at error 0: 4over6 keeps b6, mse takes the larger byte b4.
        table = (0.0, 1.5, 3.0, 6.0) if kind == "ties46" else TIES + EXACT + (5.5, 0.1, 7.0, 2.25)
        v = _golden(fmt, shape, dtype, gen, table)
        x = ref.had16(v) if rotate else v  # Had16 is its own inverse: the rotated values are v
    elif kind == "zeros":
        x = torch.randn(shape, generator=gen)
        x[torch.rand(shape, generator=gen) < 0.5] = 0.0
        x[torch.rand(shape, generator=gen) < 0.2] = -0.0
        x.view(-1, 16)[torch.rand(x.numel() // 16, generator=gen) < 0.3] = 0.0
        x.view(-1, 16)[torch.rand(x.numel() // 16, generator=gen) < 0.1] = -0.0
    elif kind == "tiny":  # amax < 4e-33: gs and r hit the FLT_MAX clamps; subnormal inputs
        scale = 1e-36 if dtype != torch.float16 else 1e-6
        x = torch.randn(shape, generator=gen) * scale
        x.view(-1)[:: 7] *= 1e-3
    elif kind == "huge":  # amax near the top of the range: sf / gs >= 2^120; squared errors overflow
        scale = 1e37 if dtype != torch.float16 else 1e4
        x = torch.randn(shape, generator=gen).clamp(-30, 30) * scale
    else:
        raise AssertionError(kind)
    x = x.to(dtype)
    assert bool(torch.isfinite(x).all()), f"make_input({kind!r}, {dtype}, seed={seed}) is not finite"
    return x


def _poisoned(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xFF)
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so -0 vs +0 and NaN payloads count."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ref(x: torch.Tensor, fmt: str, rotate, rule: str, swizzled: bool, global_amax=None):
    """(packed, scale bytes in the layout, gs or None) from the reference, batch by batch."""
    if fmt == "nvfp4":
        packed, scale, gs = ref.nvfp4_quantize(x, global_amax, rotate, scale_rule=rule)
    else:
        (packed, scale), gs = ref.mxfp4_quantize(x, rotate, scale_rule=rule), None
    if swizzled:
        scale = swizzle_scales(scale)
    return packed, scale.view(torch.uint8), gs


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return torch.device("cuda")


def test_e2m1_exhaustive(dev) -> None:
    """The compiled E2M1 path (software on sm_90, cvt on sm_100a/120a) = the predicate sum of docs/numerics.md ("E2M1 elements") on
    all 2^32 fp32 inputs (NaN skipped): the plain encoder's codes, and the search rules' codes and
    decoded values (through the block error)."""
    assert ops.e2m1_selftest(dev) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_amax_equals_reference(dtype, rotate, shape, dev) -> None:
    for kind in KINDS:
        seed = _seed()
        x = make_input(kind, "nvfp4", shape, dtype, rotate, seed)
        got = ops.amax(x.to(dev), rotate).cpu()
        want = ref.tensor_amax(x, rotate)
        assert torch.equal(_bits(got), _bits(want)), f"kind={kind} seed={seed}: {got} != {want}"


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,rule", SCHEME_RULES, ids=[f"{s}-{r}" for s, r in SCHEME_RULES])
def test_quantize_bit_exact(fmt, rule, dtype, rotate, layout, dev) -> None:
    """ops.quantize (every rule) = the reference, into poisoned buffers; NVFP4 with the amax given
    (one launch, gs computed in the kernel) and with the kernel's own amax pass."""
    swz = layout == "swizzled"
    code = RULES[fmt].index(rule)
    for shape in SHAPES:
        b, m, k = shape
        if k % BLOCK[fmt]:
            continue
        nb = k // BLOCK[fmt]
        rows, cols = ops.padded(m, nb) if swz else (m, nb)
        for kind in KINDS:
            seed = _seed()
            ctx = f"shape={shape} kind={kind} seed={seed}"
            x = make_input(kind, fmt, shape, dtype, rotate, seed)
            want_p, want_s, want_gs = _ref(x, fmt, rotate, rule, swz)
            xg = x.to(dev)
            amaxes = [None]
            if fmt == "nvfp4":
                amaxes.append(ref.tensor_amax(x, rotate).to(dev))
            for amax in amaxes:
                packed = _poisoned((b, m, k // 2), torch.uint8, dev)
                scale = _poisoned((b, rows, cols), torch.uint8, dev)
                p, s, gs, flag = ops.quantize(xg, fmt, amax, rotate, swz, code, out=(packed, scale))
                c = f"{ctx} amax={'given' if amax is not None else 'kernel'}"
                assert flag.tolist() == [0] * b, c
                assert torch.equal(p.cpu(), want_p), c
                assert torch.equal(_bits(s.cpu()), _bits(want_s)), c
                if fmt == "nvfp4":
                    assert torch.equal(_bits(gs.cpu()), _bits(want_gs)), c
                else:
                    assert gs is None


def _contract_nvfp4_bytes(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The NVFP4 rules of docs/numerics.md ("Scale rules") written out independently (fp32 x [B, M, K], no rotation): the
    chosen scale bytes [B, M*K/16], a mask of the blocks where b4 != b6 tie exactly, and b6's error."""
    b = x.shape[0]
    gs = ref.global_scale(ref.tensor_amax(x)).reshape(b, 1)
    blk = x.float().reshape(b, -1, 16)
    p = gs * blk.abs().amax(-1)
    b6 = ref.e4m3_encode(p / 6.0).long()
    b4 = ref.e4m3_encode(p / 4.0).long()

    def err(c: torch.Tensor) -> torch.Tensor:
        sf = ref.e4m3_decode(c.to(torch.uint8))
        r = torch.where(sf > 0, torch.clamp(gs / sf, max=ref.FLT_MAX), torch.zeros_like(sf))
        d = sf / gs
        e = ref.e2m1_decode(ref.e2m1_encode(blk * r[..., None])) * d[..., None] - blk
        if rule == "wmse":  # the x^2-weighted error: e * x, then squared
            e = e * blk
        acc = torch.zeros_like(sf)
        for i in range(16):  # element order, one fp32 op at a time
            acc = acc + e[..., i] * e[..., i]
        return acc

    e6, e4 = err(b6), err(b4)
    ties = (e6 == e4) & (b4 != b6)
    if rule == "max":
        return b6, ties, e6
    if rule == "4over6":
        return torch.where(e4 < e6, b4, b6), ties, e6
    best, best_err = b6, e6
    for c in (b4, (b6 - 1).clamp(min=0)):
        ec = err(c)
        take = (ec < best_err) | ((ec == best_err) & (c > best))
        best, best_err = torch.where(take, c, best), torch.where(take, ec, best_err)
    return best, ties, e6


@pytest.mark.parametrize("rule", RULES["nvfp4"])
def test_nvfp4_rule_ties_golden(rule, dev) -> None:
    """Blocks on the grid of both b6 and b4 = 1.5 b6 tie at error 0: 4over6 keeps b6, mse takes the
    larger byte. The kernel (and the reference) = the contract written out here."""
    tied = 0
    for shape in SHAPES:
        b, m, k = shape
        seed = _seed()
        x = make_input("ties46", "nvfp4", shape, torch.float32, None, seed)
        want, ties, e6 = _contract_nvfp4_bytes(x, rule)
        tied += int(ties.sum())
        b6 = _contract_nvfp4_bytes(x, "max")[0]
        if rule == "4over6":
            assert bool((want[ties] == b6[ties]).all())
        if rule in ("mse", "wmse"):  # an exact b6/b4 tie at error 0: the largest zero-error byte, above b6
            zero = ties & (e6 == 0)
            assert bool((want[zero] > b6[zero]).all())
        _, s, _, flag = ops.quantize(x.to(dev), "nvfp4", None, None, False, rule)
        assert flag.tolist() == [0] * b
        got = s.view(torch.uint8).cpu().reshape(b, -1).long()
        assert torch.equal(got, want), f"shape={shape} seed={seed}"
        assert torch.equal(_ref(x, "nvfp4", None, rule, False)[1].reshape(b, -1).long(), want), f"reference, seed={seed}"
    assert tied > 100, "the golden data must hold exact b4/b6 ties"


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("rule", RULES["nvfp4"])
def test_given_amax_saturation_and_groups(rule, rotate, layout, dev) -> None:
    """A fused group's amax larger than the tensor's own, and one smaller (block scales saturate at
    448 = byte 0x7E, where b6 and b4 coincide), are honoured exactly, per matrix of a batch."""
    swz = layout == "swizzled"
    seed = _seed()
    x = make_input("scaled", "nvfp4", (3, 64, 256), torch.bfloat16, rotate, seed)
    own = ref.tensor_amax(x, rotate)
    for factor in (3.7, 0.25):
        group = own * torch.tensor([factor, 1.0, factor])
        want_p, want_s, want_gs = _ref(x, "nvfp4", rotate, rule, swz, global_amax=group)
        if factor < 1:
            assert bool((want_s == 0x7E).any()), "the case must saturate"
        p, s, gs, flag = ops.quantize(x.to(dev), "nvfp4", group.to(dev), rotate, swz, rule)
        ctx = f"factor={factor} seed={seed}"
        assert flag.tolist() == [0, 0, 0], ctx
        assert torch.equal(p.cpu(), want_p), ctx
        assert torch.equal(_bits(s.cpu()), _bits(want_s)), ctx
        assert torch.equal(_bits(gs.cpu()), _bits(want_gs)), ctx


# The four y in [0, 7) where the sm_90 kernels' unmasked E2M1 chain would round wrongly
# (csrc/fp4c_numerics.cuh, E2M1_UNMASKED_BAD): 2 - 3 * 2^-23, 2 - 2^-23, 4 - 3 * 2^-22, 4 - 2^-22.
UNMASKED_BAD = (2 - 3 * 2**-23, 2 - 2**-23, 4 - 3 * 2**-22, 4 - 2**-22)


def _unsafe_bytes(amax: float, dtype: torch.dtype) -> list[int]:
    """E4M3 bytes b of the table for global amax `amax` where some `dtype` input x gives RN(x * r_b) = one
    of UNMASKED_BAD: written out from docs/numerics.md's (r, d) in fp32, not from the kernel."""
    gs = ref.global_scale(torch.tensor([amax], dtype=torch.float32))
    sf = ref.e4m3_decode(torch.arange(1, 127, dtype=torch.uint8))
    r, d = torch.clamp(gs / sf, max=ref.FLT_MAX), sf / gs
    bad = torch.zeros_like(sf, dtype=torch.bool)
    for y in UNMASKED_BAD:
        yt = torch.tensor(y, dtype=torch.float32)
        x = (yt * d).to(dtype).float()  # the one input of `dtype` that can round to y (RN of y * d)
        bad |= (x * r) == yt
    return [int(b) + 1 for b in torch.nonzero(bad).flatten()]


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rule", [r for r in RULES["nvfp4"] if r != "max"])
def test_nvfp4_search_global_scales_with_unsafe_bytes(rule, dtype, layout, dev) -> None:
    """One launch over matrices whose global scales give byte tables with and without an unsafe class
    (bytes where the kernels' faster E2M1 chain could round one input wrongly: the kernel then scores
    that whole matrix on the exact chain) gives the reference's bytes for every matrix."""
    unsafe, safe = [], []
    for k in range(256):  # global amax values 4 + k/64: the bf16 / fp16 grid of [4, 8)
        a = 4.0 + k / 64
        (unsafe if _unsafe_bytes(a, dtype) else safe).append(a)
    assert len(unsafe) >= 2 and safe, f"{dtype}: unsafe {unsafe[:4]}, safe {safe[:4]}"
    amax = torch.tensor([unsafe[0], safe[0], unsafe[-1], safe[-1]], dtype=torch.float32)
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 96, 512, generator=gen) * (amax / 5.0).reshape(4, 1, 1)).to(dtype)
    swz = layout == "swizzled"
    want_p, want_s, want_gs = _ref(x, "nvfp4", None, rule, swz, global_amax=amax)
    p, s, gs, flag = ops.quantize(x.to(dev), "nvfp4", amax.to(dev), None, swz, rule)
    ctx = f"amax={amax.tolist()} seed={seed}"
    assert flag.tolist() == [0] * 4, ctx
    assert torch.equal(p.cpu(), want_p), ctx
    assert torch.equal(_bits(s.cpu()), _bits(want_s)), ctx
    assert torch.equal(_bits(gs.cpu()), _bits(want_gs)), ctx


@pytest.mark.parametrize("fmt,rule", SCHEME_RULES, ids=[f"{s}-{r}" for s, r in SCHEME_RULES])
def test_public_api_matches_reference(fmt, rule, dev) -> None:
    """fp4convert.quantize / dequantize on the CUDA backend (amax, gs, dispatch, shapes) = reference."""
    for shape in SHAPES:
        b, m, k = shape
        if k % BLOCK[fmt]:
            continue
        for rotate in (None, "had16"):
            for layout in ("linear", "swizzled"):
                seed = _seed()
                ctx = f"shape={shape} rotate={rotate} layout={layout} seed={seed}"
                x = make_input("scaled", fmt, shape, torch.bfloat16, rotate, seed)
                xs = x if b > 1 else x[0]
                kw = dict(rotate=rotate, scale_layout=layout, scale_rule=rule)
                want = fp4convert.quantize(xs, fmt, backend="reference", **kw)
                got = fp4convert.quantize(xs.to(dev), fmt, backend="cuda", **kw)
                assert torch.equal(got.packed.cpu(), want.packed), ctx
                assert torch.equal(_bits(got.scale.cpu()), _bits(want.scale)), ctx
                if fmt == "nvfp4":
                    assert torch.equal(_bits(got.global_scale.cpu()), _bits(want.global_scale)), ctx
                for odt in DTYPES:
                    w_ref = fp4convert.dequantize(want, odt, backend="reference")
                    w = fp4convert.dequantize(got, odt, backend="cuda")
                    assert torch.equal(_bits(w.cpu()), _bits(w_ref)), f"{ctx} out={odt}"


def test_public_api_given_amax_any_leading_dims(dev) -> None:
    """The lean CUDA path (no reshape, mapped flags): a group's amax as a float, a device scalar or one
    per matrix, on a 2-D, 3-D and 4-D weight, = the reference with the same amax; shapes kept."""
    seed = _seed()
    x4 = make_input("scaled", "nvfp4", (6, 64, 128), torch.bfloat16, None, seed).reshape(2, 3, 64, 128)
    own = ref.tensor_amax(x4.reshape(6, 64, 128)).reshape(2, 3)
    for x, amaxes in ((x4[1, 2], (3.5, own[1, 2] * 2)), (x4[0], (own[0].max(), own[0] * 0.5)),
                      (x4, (own.max(), own))):
        for a in amaxes:
            for layout in ("linear", "swizzled"):
                ctx = f"shape={tuple(x.shape)} amax={a} layout={layout} seed={seed}"
                want = fp4convert.quantize(x, "nvfp4", global_amax=a, scale_layout=layout, backend="reference")
                ad = a.to(dev) if isinstance(a, torch.Tensor) else a
                got = fp4convert.quantize(x.to(dev), "nvfp4", global_amax=ad, scale_layout=layout, backend="cuda")
                assert got.packed.shape == want.packed.shape and got.scale.shape == want.scale.shape, ctx
                assert got.global_scale.shape == x.shape[:-2], ctx
                assert torch.equal(got.packed.cpu(), want.packed), ctx
                assert torch.equal(_bits(got.scale.cpu()), _bits(want.scale)), ctx
                assert torch.equal(_bits(got.global_scale.cpu()), _bits(want.global_scale.reshape(x.shape[:-2]))), ctx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dequantize_bit_exact(dtype, fmt, rotate, layout, shape, dev) -> None:
    """ops.dequantize of the reference's bytes (every rule's scales decode alike) into poisoned buffers."""
    b, m, k = shape
    if k % BLOCK[fmt]:
        pytest.skip("K is not a multiple of the block size")
    swz = layout == "swizzled"
    for kind in KINDS:
        seed = _seed()
        ctx = f"kind={kind} seed={seed}"
        x = make_input(kind, fmt, shape, dtype, rotate, seed)
        rule = RULES[fmt][2]
        want_p, want_s, gs = _ref(x, fmt, rotate, rule, swz)
        q = QuantizedTensor(
            want_p, want_s.view(torch.float8_e4m3fn) if fmt == "nvfp4" else want_s, gs, fmt, rotate, layout)
        for odt in DTYPES:
            w_ref = fp4convert.dequantize(q, odt, backend="reference")
            out = _poisoned((b, m, k), odt, dev)
            w = ops.dequantize(want_p.to(dev), want_s.to(dev), None if gs is None else gs.to(dev), fmt, rotate, swz,
                               odt, out=out)
            assert torch.equal(_bits(w.cpu()), _bits(w_ref)), f"{ctx} out={odt}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,rule", SCHEME_RULES, ids=[f"{s}-{r}" for s, r in SCHEME_RULES])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_refused(dtype, fmt, rule, rotate, bad, dev) -> None:
    x = torch.randn(3, 40, 64).to(dtype)
    x[1, 17, 33] = bad
    xg = x.to(dev)
    am = ops.amax(xg, rotate).cpu()
    assert torch.isfinite(am[[0, 2]]).all() and not torch.isfinite(am[1])
    with pytest.raises(NonFiniteError):
        fp4convert.quantize(xg, fmt, rotate=rotate, backend="cuda")
    # The kernel's own flag, with a finite amax handed in (the fused-group path) and without one.
    amaxes = [torch.ones(3, device=dev), None] if fmt == "nvfp4" else [None]
    for amax in amaxes:
        for swz in (False, True):
            *_, flag = ops.quantize(xg, fmt, amax, rotate, swz, RULES[fmt].index(rule))
            assert flag.tolist() == [0, 1, 0]  # per matrix: the converter names the tensor from it
            *_, flagged = ops.quantize(xg, fmt, amax, rotate, swz, RULES[fmt].index(rule), host_flag=True)
            assert flagged() is True
            *_, flagged = ops.quantize(xg[::2].contiguous(), fmt, None if amax is None else amax[:2], rotate, swz,
                                       RULES[fmt].index(rule), host_flag=True)
            assert flagged() is False  # the thread's flags were zeroed for this call
    with pytest.raises(NonFiniteError):
        fp4convert.quantize(xg[1], fmt, rotate=rotate, backend="cuda")  # one 2-D matrix
    if fmt == "nvfp4":  # the lean path: a finite amax given, NaN/Inf in the data of matrix 1
        with pytest.raises(NonFiniteError):
            fp4convert.quantize(xg, fmt, rotate=rotate, global_amax=torch.ones(3, device=dev), backend="cuda")
        fp4convert.quantize(xg[0], fmt, rotate=rotate, global_amax=torch.ones((), device=dev), backend="cuda")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("swizzle", [False, True])
def test_nonfinite_given_amax_flagged(bad, swizzle, dev) -> None:
    """A NaN/Inf group amax with finite data raises the flag (fminf alone would hide a NaN)."""
    x = torch.randn(2, 32, 64, device=dev).to(torch.bfloat16)
    for rule in range(3):
        amax = torch.tensor([1.0, bad], device=dev)
        *_, flag = ops.quantize(x, "nvfp4", amax, None, swizzle, rule)
        assert flag.tolist() == [0, 1]
        *_, flag = ops.quantize(x, "nvfp4", ops.amax(x, None), None, swizzle, rule)
        assert flag.tolist() == [0, 0]


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_wmse_golden_edge_cases(layout, dev) -> None:
    """The reference's wmse golden rows on the device, byte for byte: an exact NVFP4 block max kept
    where mse takes b6 - 1, weighted errors that underflow to a tie (larger byte), an MXFP4 block max
    that mse clips and wmse keeps, and one whose weighted errors underflow (floor kept)."""
    from tests.numerics.test_reference_scale_rules import NV_GOLDEN_BLOCKS, nv_row

    swz = layout == "swizzled"
    for x in (nv_row(0, NV_GOLDEN_BLOCKS), nv_row(66, NV_GOLDEN_BLOCKS[2:5])):
        want_p, want_s, want_gs = _ref(x[None], "nvfp4", None, "wmse", swz)
        p, s, gs, flag = ops.quantize(x[None].to(dev), "nvfp4", None, None, swz, "wmse")
        assert flag.tolist() == [0]
        assert torch.equal(p.cpu(), want_p) and torch.equal(_bits(s.cpu()), _bits(want_s))
        assert torch.equal(_bits(gs.cpu()), _bits(want_gs))
    x = torch.tensor([[7.5] + [1.5] * 10 + [0.0] * 21, [7.5 * 2.0**-70] + [0.0] * 31])
    want_p, want_s, _ = _ref(x[None], "mxfp4", None, "wmse", swz)
    p, s, _, flag = ops.quantize(x[None].to(dev), "mxfp4", None, None, swz, "wmse")
    assert torch.equal(p.cpu(), want_p) and torch.equal(_bits(s.cpu()), _bits(want_s))
    assert ref.mxfp4_quantize(x, None, "wmse")[1].reshape(-1).tolist() == [128, 57]


def test_quantize_argument_errors(dev) -> None:
    x = torch.randn(1, 16, 64, device=dev)
    with pytest.raises(CUDAKernelError, match="does not apply"):
        ops.quantize(x, "nvfp4", None, None, False, "rceil")
    with pytest.raises(CUDAKernelError, match="does not apply"):
        ops.quantize(x, "mxfp4", None, None, False, "4over6")
    codes = ", ".join(str(i) for i in range(len(get_scheme("nvfp4").scale_rules)))  # the rule codes, from scheme.py
    with pytest.raises(CUDAKernelError, match=f"scale rule 4 is not one of {codes}$"):
        ops.quantize(x, "nvfp4", None, None, False, 4)
    with pytest.raises(CUDAKernelError, match="amax must be None"):
        ops.quantize(x, "mxfp4", torch.ones(1, device=dev), None, False)
    with pytest.raises(CUDAKernelError, match="amax per matrix"):
        ops.quantize(x, "nvfp4", torch.ones(2, device=dev), None, False)


def _chunks(m: int, rows: int):
    for r0 in range(0, m, rows):
        yield r0, min(m, r0 + rows)


@pytest.mark.parametrize(
    "dtype,fmt,rotate,layout,rule",
    [(torch.bfloat16, "nvfp4", None, "linear", "max"), (torch.float32, "mxfp4", "had16", "swizzled", "floor")],
    ids=["bf16-nvfp4-1.1GB", "fp32-mxfp4-had16-swizzled-2.1GB"],
)
def test_large_tensor(dtype, fmt, rotate, layout, rule, dev) -> None:
    """> 1 GiB (the fp32 case > 2^31 bytes): 64-bit offsets everywhere. The reference runs by
    row chunks with the whole tensor's amax handed in, which is the same arithmetic."""
    m, k = 32832, 16384  # M % 128 == 64
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * torch.exp(torch.empty(m, 1).uniform_(-4, 4, generator=gen))).to(dtype)
    xg = x.to(dev).reshape(1, m, k)
    p, s, _, flag = ops.quantize(xg, fmt, None, rotate, layout == "swizzled", RULES[fmt].index(rule))
    assert flag.tolist() == [0]
    amax = ops.amax(xg, rotate).cpu()
    packed = p[0].cpu()
    nb = k // BLOCK[fmt]
    scale = s.view(torch.uint8)[0].cpu()
    if layout == "swizzled":
        from fp4convert.numerics.swizzle import unswizzle_scales

        scale = unswizzle_scales(scale, m, nb)
    del p, s, xg
    torch.cuda.empty_cache()
    chunk_amax = torch.zeros((), dtype=torch.float32)
    for r0, r1 in _chunks(m, 4096):
        xc = x[r0:r1]
        chunk_amax = torch.maximum(chunk_amax, ref.tensor_amax(xc, rotate))
        want_p, want_s, _ = _ref(xc, fmt, rotate, rule, False, global_amax=amax[0] if fmt == "nvfp4" else None)
        assert torch.equal(packed[r0:r1], want_p), f"rows {r0}:{r1} seed={seed}"
        assert torch.equal(scale[r0:r1], want_s), f"rows {r0}:{r1} seed={seed}"
    assert torch.equal(_bits(chunk_amax), _bits(amax[0])), seed


# ------------------------------------------------------------------------------------------------
# Input decoding
# ------------------------------------------------------------------------------------------------

def _e4m3_bytes(shape, gen: torch.Generator) -> torch.Tensor:
    """Random E4M3 bytes, every finite code (incl. -0 and subnormals), no NaN (0x7F / 0xFF)."""
    w = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0x80
    return w.view(torch.float8_e4m3fn)


def _scales(shape, gen: torch.Generator) -> torch.Tensor:
    """Positive fp32 scales over a wide range, with tiny and huge ones (products under/overflow)."""
    s = torch.exp2(torch.empty(shape).uniform_(-20, 20, generator=gen)) * torch.rand(shape, generator=gen).add(0.5)
    flat = s.view(-1)
    if flat.numel() > 2:
        flat[0], flat[-1] = 1e-38, 1e36
    return s.float()


def _same(got: torch.Tensor, want: torch.Tensor, ctx: str) -> None:
    """Bytes equal, except that NaN payloads may differ (NaN inputs are refused downstream anyway)."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32, ctx
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), ctx
    assert torch.equal(_bits(got.masked_fill(gn, 0)), _bits(want.masked_fill(wn, 0))), ctx


@pytest.mark.parametrize(
    "shape,block",
    [((1, 300, 260), (128, 128)), ((3, 7, 10), (2, 3)), ((2, 129, 64), (1, 64)), ((4, 5, 12), (5, 12)),
     ((2, 33, 44), (16, 7))],
    ids=["1x300x260-128", "3x7x10-2x3-scalar", "2x129x64-1x64", "4x5x12-one-block", "2x33x44-16x7"],
)
@pytest.mark.parametrize("broadcast", [False, True])
def test_decode_fp8_block(shape, block, broadcast, dev) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    b, m, n = shape
    bm, bn = block
    grid = (-(-m // bm), -(-n // bn))
    w = _e4m3_bytes(shape, gen)
    s = _scales(grid if broadcast else (b, *grid), gen)
    want = torch.stack([ref.fp8_block_dequantize(w[i], s if broadcast else s[i], block) for i in range(b)])
    got = ops.decode_fp8_block(w.to(dev), s.to(dev), block).cpu()
    _same(got, want, f"seed={seed}")
    got2 = ops.decode_fp8_block(w[0].to(dev), (s if broadcast else s[0]).to(dev), block).cpu()  # a plain matrix
    _same(got2, want[0], f"seed={seed} (2-D)")


@pytest.mark.parametrize("kind", ["scalar", "one", "rows", "rows1", "rows-bf16", "batched-rows", "batched-tensor"])
def test_decode_fp8_scaled(kind, dev) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    b, m, n = 3, 67, 36
    w = _e4m3_bytes((b, m, n), gen)
    shape = {"scalar": (), "one": (1,), "rows": (m,), "rows1": (m, 1), "rows-bf16": (m,),
             "batched-rows": (b, m, 1), "batched-tensor": (b, 1, 1)}[kind]
    s = _scales(shape, gen)
    if kind == "rows-bf16":
        s = s.to(torch.bfloat16)
    if kind.startswith("batched"):
        want = torch.stack([ref.fp8_scaled_dequantize(w[i], s[i].reshape(-1) if kind == "batched-rows" else s[i].reshape(()))
                            for i in range(b)])
    else:
        want = torch.stack([ref.fp8_scaled_dequantize(w[i], s) for i in range(b)])
    got = ops.decode_fp8_scaled(w.to(dev), s.to(dev)).cpu()
    _same(got, want, f"kind={kind} seed={seed}")


@pytest.mark.parametrize("shape", [(1, 16), (5, 16), (2, 3, 7, 16), (24, 90, 16)], ids=str)
def test_decode_mxfp4_blocks(shape, dev) -> None:
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(0, 256, shape[:-1], generator=gen, dtype=torch.int32).to(torch.uint8)
    scales.view(-1)[0] = 0  # 2^-127: subnormal results
    if scales.numel() > 2:
        scales.view(-1)[1] = 254  # 6 * 2^127 overflows to inf
        scales.view(-1)[2] = 255  # NaN
    want = ref.mxfp4_blocks_dequantize(blocks, scales)
    got = ops.decode_mxfp4_blocks(blocks.to(dev), scales.to(dev)).cpu()
    assert got.shape == (*shape[:-2], shape[-2] * 32)
    _same(got, want, f"seed={seed}")


def test_decode_argument_errors(dev) -> None:
    w = torch.zeros(4, 8, dtype=torch.float8_e4m3fn, device=dev)
    with pytest.raises(CUDAKernelError, match="scale_inv shape"):
        ops.decode_fp8_block(w, torch.ones(2, 2, device=dev), (2, 2))
    with pytest.raises(CUDAKernelError, match="float8_e4m3fn"):
        ops.decode_fp8_block(w.float(), torch.ones(2, 4, device=dev), (2, 2))
    with pytest.raises(CUDAKernelError, match="positive"):
        ops.decode_fp8_block(w, torch.ones(2, 4, device=dev), (0, 2))
    with pytest.raises(CUDAKernelError, match="per output channel"):
        ops.decode_fp8_scaled(w, torch.ones(8, device=dev))
    with pytest.raises(CUDAKernelError, match="fp32, fp16 or bf16"):
        ops.decode_fp8_scaled(w, torch.ones(4, dtype=torch.int32, device=dev))
    with pytest.raises(CUDAKernelError, match=r"\[\.\.\., G, 16\]"):
        ops.decode_mxfp4_blocks(torch.zeros(3, 8, dtype=torch.uint8, device=dev),
                                torch.zeros(3, dtype=torch.uint8, device=dev))
    with pytest.raises(CUDAKernelError, match="uint8"):
        ops.decode_mxfp4_blocks(torch.zeros(3, 16, device=dev), torch.zeros(3, dtype=torch.uint8, device=dev))


@pytest.mark.parametrize("path", ["glue", "python"])
def test_public_api_glue_and_python_paths_agree_with_reference(path, dev, monkeypatch) -> None:
    """The public API's two lean paths (outputs and launch in the C++ glue, or in Python) give the
    reference's bytes and refuse NaN; the glue is built here (waited for) when a compiler is there."""
    from fp4convert.kernels.cuda import api_ext

    if path == "glue":
        if api_ext.wait() is None:
            pytest.skip("the API glue could not be built here (no C++ compiler or Python headers)")
    else:
        monkeypatch.setitem(api_ext._state, "module", None)
    seed = _seed()
    for fmt, shape, rotate, layout in (("nvfp4", (96, 256), None, "linear"), ("nvfp4", (2, 3, 64, 128), "had16", "swizzled"),
                                       ("mxfp4", (160, 64), None, "swizzled"), ("mxfp4", (3, 32, 96), "had16", "linear")):
        b = 1
        for d in shape[:-2]:
            b *= d
        x = make_input("scaled", fmt, (b, *shape[-2:]), torch.bfloat16, rotate, seed).reshape(shape)
        kw = dict(rotate=rotate, scale_layout=layout)
        a = ref.tensor_amax(x.reshape(-1, *shape[-2:]), rotate).reshape(shape[:-2]) * 1.5 if fmt == "nvfp4" else None
        want = fp4convert.quantize(x, fmt, global_amax=a, backend="reference", **kw)
        got = fp4convert.quantize(x.to(dev), fmt, global_amax=None if a is None else a.to(dev), backend="cuda", **kw)
        ctx = f"{path} {fmt} {shape} {rotate} {layout} seed={seed}"
        assert torch.equal(got.packed.cpu(), want.packed), ctx
        assert got.scale.dtype == want.scale.dtype and torch.equal(_bits(got.scale.cpu()), _bits(want.scale)), ctx
        if fmt == "nvfp4":
            assert torch.equal(_bits(got.global_scale.cpu()), _bits(want.global_scale.reshape(shape[:-2]))), ctx
        bad = x.clone()
        bad.view(-1)[bad.numel() // 2] = float("nan")
        with pytest.raises(NonFiniteError):
            fp4convert.quantize(bad.to(dev), fmt, global_amax=None if a is None else a.to(dev), backend="cuda", **kw)


# ---------------------------------------------------------------------------------------------
# Input-channel-weighted search rules (fp4c_quantize_iw; reference input_weight)
# ---------------------------------------------------------------------------------------------

def _quantize_iw(x: torch.Tensor, fmt: str, rotate, swizzle: bool, rule: str, iw: torch.Tensor | None):
    """fp4c_quantize_iw called directly (the Python ops layer does not pass input_weight yet)."""
    import ctypes

    lib = ops._lib(x.device)
    c_i64, c_int, c_ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.fp4c_quantize_iw.restype = c_int
    lib.fp4c_quantize_iw.argtypes = [c_ptr, c_int, c_int, c_int, c_int, c_int, c_i64, c_i64, c_i64, c_ptr, c_ptr,
                                     c_ptr, c_ptr, c_ptr, c_ptr, c_ptr]
    b, m, k = x.shape
    nb = k // BLOCK[fmt]
    rows, cols = ops.padded(m, nb) if swizzle else (m, nb)
    packed = _poisoned((b, m, k // 2), torch.uint8, x.device)
    scale = _poisoned((b, rows, cols), torch.uint8, x.device)
    flag = torch.zeros(b, dtype=torch.int32, device=x.device)
    amax = gs = None
    if fmt == "nvfp4":
        amax = ref.tensor_amax(x.cpu(), rotate).to(x.device)
        gs = torch.empty(b, dtype=torch.float32, device=x.device)
    code = lib.fp4c_quantize_iw(x.data_ptr(), ops._DTYPES[x.dtype], ops._FMTS[fmt], int(rotate == "had16"),
                                int(swizzle), RULES[fmt].index(rule), b, m, k, ops._ptr(amax), ops._ptr(gs),
                                packed.data_ptr(), scale.data_ptr(), flag.data_ptr(), ops._ptr(iw),
                                ops._stream(x.device))
    assert code == 0, lib.fp4c_error_string(code).decode()
    torch.cuda.synchronize()
    return packed.cpu(), scale.cpu(), None if gs is None else gs.cpu(), flag.cpu()


def _input_weight(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(2.0 * torch.randn(k, generator=g))
    w[: min(3, k)] = 0.0
    w[k // 2] = 1e30  # overflowing products: inf, the same everywhere
    return w


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,rule", SCHEME_RULES, ids=[f"{s}-{r}" for s, r in SCHEME_RULES])
def test_quantize_input_weighted_bit_exact(fmt, rule, dtype, rotate, layout, dev) -> None:
    """fp4c_quantize_iw = reference.*_quantize(input_weight=...) for every rule, shape (rows that
    straddle a 32-group when K % 32 == 16), input kind and layout; a null weight = fp4c_quantize."""
    swz = layout == "swizzled"
    for shape in SHAPES:
        b, m, k = shape
        if k % BLOCK[fmt]:
            continue
        for kind in KINDS:
            seed = _seed()
            ctx = f"shape={shape} kind={kind} seed={seed}"
            x = make_input(kind, fmt, shape, dtype, rotate, seed)
            iw = _input_weight(k, seed)
            if fmt == "nvfp4":
                want_p, want_s, want_gs = ref.nvfp4_quantize(x, None, rotate, rule, input_weight=iw)
            else:
                (want_p, want_s), want_gs = ref.mxfp4_quantize(x, rotate, rule, input_weight=iw), None
            if swz:
                want_s = swizzle_scales(want_s)
            p, s, gs, flag = _quantize_iw(x.to(dev), fmt, rotate, swz, rule, iw.to(dev))
            assert flag.tolist() == [0] * b, ctx
            assert torch.equal(p, want_p), ctx
            assert torch.equal(_bits(s), _bits(want_s)), ctx
            if fmt == "nvfp4":
                assert torch.equal(_bits(gs), _bits(want_gs)), ctx
            # null input_weight: the unweighted bytes
            p0, s0, _, _ = _quantize_iw(x.to(dev), fmt, rotate, swz, rule, None)
            want0 = _ref(x, fmt, rotate, rule, swz)
            assert torch.equal(p0, want0[0]) and torch.equal(_bits(s0), _bits(want0[1])), ctx


def test_input_weight_golden_choice(dev) -> None:
    """The 4over6 golden case of tests/numerics/test_reference_input_weight.py on the device: a zero weight on
    the 5's channel turns the /4 choice (0x3C) into /6 (0x38)."""
    row = torch.tensor([[[2688.0] + [0.0] * 15 + [6.0, 5.0] + [0.0] * 14]], device=dev)
    w = torch.ones(32)
    _, s1, _, _ = _quantize_iw(row, "nvfp4", None, False, "4over6", w.to(dev))
    w[17] = 0.0
    _, s0, _, _ = _quantize_iw(row, "nvfp4", None, False, "4over6", w.to(dev))
    assert s1.view(torch.uint8)[0, 0, 1].item() == 0x3C and s0.view(torch.uint8)[0, 0, 1].item() == 0x38


@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("fmt,rule", SCHEME_RULES, ids=[f"{s}-{r}" for s, r in SCHEME_RULES])
def test_public_quantize_input_weight_on_cuda_equals_reference(fmt, rule, rotate, dev) -> None:
    """fp4convert.quantize(input_weight=) on a CUDA tensor (tensor._quantize_cuda -> ops.quantize_checked
    -> ops.quantize -> fp4c_quantize_iw): the reference's bytes, with and without a given group amax,
    in both scale layouts, for a batch of matrices sharing one weight."""
    for shape in ((3, 129, 96), (1, 200, 64)):
        b, m, k = shape
        for layout in ("linear", "swizzled"):
            seed = _seed()
            ctx = f"shape={shape} layout={layout} seed={seed}"
            x = make_input("heavy", fmt, shape, torch.bfloat16, rotate, seed)
            iw = _input_weight(k, seed)
            iw[k // 2] = 7.0  # the public API refuses non-finite weights; overflow is the kernels' test above
            amax = ref.tensor_amax(x, rotate).amax() * 1.5 if fmt == "nvfp4" else None
            for ga in ((None, amax) if fmt == "nvfp4" else (None,)):
                q = fp4convert.quantize(x.to(dev), fmt, rotate=rotate, global_amax=None if ga is None else ga.to(dev),
                                        scale_layout=layout, scale_rule=rule, input_weight=iw.to(dev))
                want = fp4convert.quantize(x, fmt, rotate=rotate, global_amax=ga, scale_layout=layout, scale_rule=rule,
                                           input_weight=iw, backend="reference")
                assert torch.equal(q.packed.cpu(), want.packed), ctx
                assert torch.equal(_bits(q.scale.cpu()), _bits(want.scale)), ctx
                if fmt == "nvfp4":
                    assert torch.equal(_bits(q.global_scale.cpu()), _bits(want.global_scale)), ctx


@pytest.mark.parametrize("backend", ["cuda", "stacked"])
@pytest.mark.parametrize("scheme,rotate", [("nvfp4", None), ("mxfp4", None), ("nvfp4", "had16")])
def test_converter_input_weight_on_the_gpu_backends_writes_the_cpu_bytes(tmp_path, monkeypatch, backend, scheme,
                                                                          rotate) -> None:
    """``--input-weights random`` through the GPU backends (the cuda backend's per-run fp4c_quantize_iw
    launches over shape groups, the stacked backend's torch ops): the cpu backend's bytes, given the same
    input weights (the statistics pass runs on the CPU for both, so only the backends differ)."""
    from fp4convert import calibrate
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert
    from tests import checkpoints as ck
    from tests.e2e.test_input_weights import SHAPE, gains_llama

    src = gains_llama(tmp_path / "src")
    real = calibrate.statistics
    monkeypatch.setattr(calibrate, "statistics", lambda source, plan, config, device: real(source, plan, config, "cpu"))
    common = dict(scheme=scheme, rotate=rotate, input_weights="random", format="compressed-tensors", **SHAPE)
    convert(src, tmp_path / "cpu", ConvertConfig(device="cpu", backend="cpu", **common))
    convert(src, tmp_path / "gpu", ConvertConfig(device="cuda", backend=backend, **common))
    want, got = ck.all_files(tmp_path / "cpu"), ck.all_files(tmp_path / "gpu")
    assert got.keys() == want.keys()
    for f in want:
        if f.endswith(".safetensors"):
            assert got[f] == want[f], f
    # the same record (digest of the weights) in both manifests
    import json

    ids = [json.loads(got_or_want["fp4convert.json"])["identity"]["input_weights"] for got_or_want in (want, got)]
    assert ids[0] == ids[1] and ids[0]["weighted"] == 14
