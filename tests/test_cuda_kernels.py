"""The CUDA kernels against the pure-PyTorch reference, bit for bit (needs a CUDA GPU; skips without).

Every case draws fresh random data (the seed is in each failure message), runs the reference on a
CPU copy, and compares raw bytes with ``torch.equal``. Output buffers are poisoned (0xFF, which is
NaN in every float dtype here) so an unwritten byte fails. Golden cases put exact E2M1 ties, -0,
zero blocks, subnormal E4M3 scales, saturation and tiny amax into the data.
"""

from __future__ import annotations

import os

import pytest
import torch

import fp4convert
from fp4convert import NonFiniteError, reference as ref
from fp4convert.cuda import ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ops.available(), reason="needs a CUDA GPU (capability >= 8.9) and nvcc"),
]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK = {"nvfp4": 16, "mxfp4": 32}
# (B, M, K): a single row; M not a multiple of 128 with K % 64 != 0; a batch whose matrices start
# mid-16-byte (M * K % 32 == 16: tail groups); a regular batch; odd M with K % 64 == 32.
SHAPES = [(1, 1, 64), (1, 200, 96), (3, 129, 48), (2, 256, 512), (4, 33, 160)]
KINDS = ["randn", "scaled", "heavy", "golden", "zeros", "tiny", "huge"]
TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
EXACT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _golden(fmt: str, shape: tuple[int, int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Blocks whose scaled values land exactly on E2M1 ties and grid points.

    NVFP4: amax = 2688 / 16 makes gs = 16, and a block max of 6 * 2^p gives s = 2^(p+4) (E4M3
    subnormal for p < -10), so r = 2^-p and y = x * r is exact. MXFP4: the block max 6 * 2^p gives
    r = 2^-p. Some blocks are all zero, some elements -0.
    """
    b, m, k = shape
    bs = BLOCK[fmt]
    nblk = b * m * k // bs
    lo, hi = ((-13, 3) if fmt == "nvfp4" else ((-12, 12) if dtype == torch.float16 else (-40, 40)))
    p = torch.randint(lo, hi + 1, (nblk, 1), generator=gen).double()
    table = torch.tensor(TIES + EXACT + (5.5, 0.1, 7.0, 2.25), dtype=torch.float64)
    v = table[torch.randint(0, len(table), (nblk, bs), generator=gen)]
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
    elif kind == "golden":
        v = _golden(fmt, shape, dtype, gen)
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
    elif kind == "huge":  # amax near the top of the range: sf / gs >= 2^120 (dequantize's slow path)
        scale = 1e37 if dtype != torch.float16 else 1e4
        x = torch.randn(shape, generator=gen).clamp(-30, 30) * scale
    else:
        raise AssertionError(kind)
    return x.to(dtype)


def _poisoned(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xFF)
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so -0 vs +0 and NaN payloads count."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ref_quantize(x: torch.Tensor, fmt: str, rotate, layout: str, global_amax=None):
    return fp4convert.quantize(x, fmt, rotate=rotate, scale_layout=layout, global_amax=global_amax,
                               backend="reference")


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return torch.device("cuda")


def test_e2m1_exhaustive(dev) -> None:
    """The compiled E2M1 path (software on sm_90, cvt on sm_100a/120a) = SPEC.md's predicate sum on
    all 2^32 fp32 inputs (NaN skipped)."""
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_quantize_dequantize_bit_exact(dtype, fmt, rotate, layout, shape, dev) -> None:
    b, m, k = shape
    if k % BLOCK[fmt]:
        pytest.skip("K is not a multiple of the block size")
    nb = k // BLOCK[fmt]
    swz = layout == "swizzled"
    rows, cols = ops.padded(m, nb) if swz else (m, nb)
    for kind in KINDS:
        seed = _seed()
        ctx = f"kind={kind} seed={seed}"
        x = make_input(kind, fmt, shape, dtype, rotate, seed)
        want = _ref_quantize(x, fmt, rotate, layout)
        xg = x.to(dev)
        gs = want.global_scale.reshape(b).to(dev) if fmt == "nvfp4" else None
        # 1. The kernel entry point, into poisoned buffers.
        packed = _poisoned((b, m, k // 2), torch.uint8, dev)
        scale = _poisoned((b, rows, cols), torch.uint8, dev)
        p, s, flag = ops.quantize(xg, fmt, gs, rotate, swz, out=(packed, scale))
        assert int(flag) == 0, ctx
        assert torch.equal(p.cpu(), want.packed.reshape(b, m, k // 2)), ctx
        assert torch.equal(_bits(s.cpu()), _bits(want.scale)), ctx
        # 2. The public API on the CUDA backend (amax, gs, dispatch, shapes).
        got = fp4convert.quantize(xg.reshape(shape if b > 1 else shape[1:]), fmt, rotate=rotate,
                                  scale_layout=layout, backend="cuda")
        assert torch.equal(got.packed.cpu().reshape(b, m, k // 2), want.packed.reshape(b, m, k // 2)), ctx
        assert torch.equal(_bits(got.scale.cpu()).reshape(-1), _bits(want.scale).reshape(-1)), ctx
        if fmt == "nvfp4":
            assert torch.equal(_bits(got.global_scale.cpu()).reshape(-1), _bits(want.global_scale).reshape(-1)), ctx
        # 3. Dequantize the reference's bytes on the GPU, into a poisoned buffer.
        for odt in DTYPES:
            w_ref = fp4convert.dequantize(want, odt, backend="reference")
            out = _poisoned((b, m, k), odt, dev)
            w = ops.dequantize(want.packed.reshape(b, m, k // 2).to(dev),
                               want.scale.reshape(b, rows, cols).to(dev), gs, fmt, rotate, swz, odt, out=out)
            assert torch.equal(_bits(w.cpu()), _bits(w_ref)), f"{ctx} out={odt}"
            w2 = fp4convert.dequantize(got, odt, backend="cuda")
            assert torch.equal(_bits(w2.cpu()), _bits(w_ref)), f"{ctx} out={odt} (public API)"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_global_amax_given(fmt, dev) -> None:
    """A fused group's amax (larger than the tensor's own) is honoured exactly."""
    if fmt == "mxfp4":
        pytest.skip("MXFP4 has no global scale")
    seed = _seed()
    x = make_input("scaled", fmt, (2, 64, 256), torch.bfloat16, None, seed)
    group = float(ref.tensor_amax(x).max()) * 3.7
    want = _ref_quantize(x, fmt, None, "linear", global_amax=group)
    got = fp4convert.quantize(x.to(dev), fmt, global_amax=group, backend="cuda")
    assert torch.equal(got.packed.cpu(), want.packed), seed
    assert torch.equal(_bits(got.scale.cpu()), _bits(want.scale)), seed
    assert torch.equal(got.global_scale.cpu(), want.global_scale), seed


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("rotate", [None, "had16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_refused(dtype, fmt, rotate, bad, dev) -> None:
    x = torch.randn(3, 40, 64).to(dtype)
    x[1, 17, 33] = bad
    xg = x.to(dev)
    am = ops.amax(xg, rotate).cpu()
    assert torch.isfinite(am[[0, 2]]).all() and not torch.isfinite(am[1])
    with pytest.raises(NonFiniteError):
        fp4convert.quantize(xg, fmt, rotate=rotate, backend="cuda")
    # The kernel's own flag, with a finite global scale handed in (the fused-group path).
    gs = torch.ones(3, device=dev) if fmt == "nvfp4" else None
    _, _, flag = ops.quantize(xg, fmt, gs, rotate, False)
    assert int(flag) != 0


def _chunks(m: int, rows: int):
    for r0 in range(0, m, rows):
        yield r0, min(m, r0 + rows)


@pytest.mark.parametrize(
    "dtype,fmt,rotate,layout",
    [(torch.bfloat16, "nvfp4", None, "linear"), (torch.float32, "mxfp4", "had16", "swizzled")],
    ids=["bf16-nvfp4-1.1GB", "fp32-mxfp4-had16-swizzled-2.1GB"],
)
def test_large_tensor(dtype, fmt, rotate, layout, dev) -> None:
    """> 1 GiB (the fp32 case > 2^31 bytes): 64-bit offsets everywhere. The reference runs by
    row chunks with the whole tensor's amax handed in, which is the same arithmetic."""
    m, k = 32832, 16384  # M % 128 == 64
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * torch.exp(torch.empty(m, 1).uniform_(-4, 4, generator=gen))).to(dtype)
    xg = x.to(dev)
    got = fp4convert.quantize(xg, fmt, rotate=rotate, scale_layout=layout, backend="cuda")
    amax = ops.amax(xg.reshape(1, m, k), rotate).cpu()
    packed = got.packed.cpu()
    scale = got.linear_scale().cpu().view(torch.uint8)
    del got, xg
    torch.cuda.empty_cache()
    chunk_amax = torch.zeros((), dtype=torch.float32)
    for r0, r1 in _chunks(m, 4096):
        xc = x[r0:r1]
        chunk_amax = torch.maximum(chunk_amax, ref.tensor_amax(xc, rotate))
        want = _ref_quantize(xc, fmt, rotate, "linear", global_amax=amax[0] if fmt == "nvfp4" else None)
        assert torch.equal(packed[r0:r1], want.packed), f"rows {r0}:{r1} seed={seed}"
        assert torch.equal(scale[r0:r1], want.scale.view(torch.uint8)), f"rows {r0}:{r1} seed={seed}"
    assert torch.equal(_bits(chunk_amax), _bits(amax[0])), seed
