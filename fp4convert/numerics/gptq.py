"""GPTQ for NVFP4 / MXFP4: the executable form of docs/numerics.md "GPTQ" (pure PyTorch, any device).

GPTQ quantizes a linear's weight ``W [N, K]`` column by column and pushes each column's rounding error
onto the columns not yet quantized, through the inverse of the Hessian ``H = X^T X / n`` of the
linear's inputs, so the layer's output error on the calibration inputs (not the weight error) is
what is minimised. Here each FP4 block's scale is chosen by the scale rule from the block's weights
*as they are when the sweep reaches the block* (the first column of the block), and every element is
the same E2M1 rounding the data-free quantizer does (:mod:`fp4convert.numerics.reference`): the FP4
step is bit-exact everywhere; what is not is the float arithmetic of the Hessian's factorization and
of the lazy batch update (a matmul), which differ between devices and libraries. On one device the
run is deterministic, and the fast paths of the in-batch sweep (``csrc/fp4c_gptq.cu`` on a GPU,
``fp4c_cpu_gptq_sweep`` in ``csrc/fp4c_cpu.cpp`` on the CPU; :mod:`fp4convert.kernels.gptq` picks one)
give the bytes this module gives on that device. What each step costs: docs/numerics.md "GPTQ", "Cost".

The order of operations (docs/numerics.md "GPTQ"):

1. ``prepare``: dead columns (``H[j, j] == 0``: an input that was always 0) get ``H[j, j] = 1`` and
   their weights 0; ``H += damp * mean(diag(H)) * I`` (damp 0.01, tried x10 and x100 if the Cholesky
   fails); ``U = cholesky(cholesky_inverse(cholesky(H)), upper=True)``, in fp64, then fp32.
   With W4A4 (``cross`` given: ``H`` is then the engine-rounded inputs'), ``shift = C @ inverse(H)``
   and the sweep starts from :func:`target`'s ``W* = W + W @ shift``.
2. Optional group order (``act_order``): whole FP4 blocks of columns sorted by their summed ``diag(H)``,
   largest first (columns stay together, so a block's scale is still chosen once from its own columns).
3. The sweep, in column batches of ``block`` (128) columns: for each column ``c`` (batch-local ``i``):
   at a scale-block start, the scale of every row's block from the current values (the rule, the
   matrix's global scale, input weights = ``diag(H)`` for the search rules); the column's codes
   ``E2M1(w * r)`` and values ``q = value * d``; ``e = (w - q) / U[c, c]``; the batch's later columns
   ``w_k = w_k - e * U[c, k]`` (one fp32 multiply, one subtract); after the batch, the later columns
   ``W = W - E @ U[batch, later]`` (one fp32 matmul, TF32 off).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fp4convert.errors import NonFiniteError, QuantizationError
from fp4convert.numerics import reference as ref

DAMP = 0.01  # the dampening fraction of mean(diag(H)) (GPTQ's and llm-compressor's default)
BLOCK = 128  # columns per lazy batch update (a multiple of both schemes' block sizes)
DAMP_RETRIES = (1.0, 10.0, 100.0)  # damping multipliers tried until the Cholesky succeeds

_F32 = torch.float32


@dataclass
class Prepared:
    """A Hessian ready for the sweep: the upper Cholesky factor of its (dampened) inverse, fp32."""

    u: torch.Tensor  # [K, K] fp32, upper triangular
    dead: torch.Tensor  # [K] bool: inputs that were always 0 (in the sweep's column order)
    diag: torch.Tensor  # [K] fp32: diag(H) before dampening (the search rules' input weights; sweep order)
    damp: float  # the dampening fraction that factorized
    perm: torch.Tensor | None = None  # the sweep's column order (act_order), None: natural order
    shift: torch.Tensor | None = None  # [K, K] fp32 (natural order): W4A4's target move, W* = W + W @ shift


@dataclass
class Result:
    """One matrix quantized by GPTQ: the stored bytes (as the data-free quantizer returns them) and the
    dequantized weight the next blocks are calibrated on."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # NVFP4: float8_e4m3fn [N, K/16]; MXFP4: uint8 E8M0 [N, K/32] (linear layout)
    gs: torch.Tensor | None  # NVFP4: fp32 scalar, 2688 / amax; MXFP4: None
    dequantized: torch.Tensor  # fp32 [N, K] (in the quantized domain: rotated with --rotate)
    damp: float


def prepare(h: torch.Tensor, damp: float = DAMP, act_order: int | None = None,
            cross: torch.Tensor | None = None) -> Prepared:
    """Steps 1-2 for ``H`` ([K, K], any float dtype, symmetric): see the module docstring.
    ``act_order``: the scale block size whose blocks are reordered (None: natural order). ``cross``
    (W4A4: ``H`` is then the rounded inputs' ``X~^T X~ / n``): ``(X - X~)^T X~ / n``, from which
    :attr:`Prepared.shift` ``= cross @ inverse(dampened H)`` is kept for :func:`target`. A Hessian
    that does not factorize even at ``damp * 100`` (NaN, or not positive semi-definite) raises
    QuantizationError."""
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise QuantizationError(f"a GPTQ Hessian must be square, got {tuple(h.shape)}")
    h = h.to(torch.float64).clone()
    if not bool(torch.isfinite(h).all()) or (cross is not None and not bool(torch.isfinite(cross).all())):
        raise QuantizationError("the Hessian of the calibration inputs holds NaN/Inf (the activations overflowed)")
    perm = None
    if act_order:
        perm = group_order(h.diagonal(), act_order)
        h = h[perm][:, perm]
    diag = h.diagonal()
    dead = diag == 0
    raw_diag = diag.to(_F32)
    diag[dead] = 1.0
    mean = diag.mean()
    for mult in DAMP_RETRIES:
        d = damp * mult
        hd = h.clone()
        hd.diagonal().add_(d * mean)
        lower, info = torch.linalg.cholesky_ex(hd)
        if int(info) != 0:
            continue
        inv = torch.cholesky_inverse(lower)
        u, info = torch.linalg.cholesky_ex(inv, upper=True)
        if int(info) != 0:
            continue
        shift = None
        if cross is not None:
            if perm is not None:
                back = torch.argsort(perm)
                inv = inv[back][:, back]
            shift = (cross.to(torch.float64) @ inv).to(_F32)
        return Prepared(u.to(_F32), dead, raw_diag, d, perm, shift)
    raise QuantizationError(f"the Hessian does not factorize even with dampening {damp * DAMP_RETRIES[-1]:g} "
                            "(too few calibration tokens for this layer's inputs?); give more calibration data "
                            "or a larger --gptq-damp")


def target(w: torch.Tensor, prepared: Prepared) -> torch.Tensor:
    """The weights GPTQ sweeps (W4A4 step 0): ``W* = W + W @ shift`` (one fp32 matmul, TF32 off), the
    least-squares weights that reproduce the unrounded outputs ``X W^T`` from the engine's rounded
    inputs ``X~`` (under the same dampening as the sweep), so the sweep's ``||(W* - Q) X~^T||``
    is the served layer's output error. ``w`` itself without a shift (fp32, a copy)."""
    w = w.to(_F32)
    if prepared.shift is None:
        return w.clone()
    with strict_fp32():
        return w + w @ prepared.shift.to(w.device)


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """fp32 matmuls without TF32 on CUDA (the lazy batch update is part of the numerics)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def group_order(diag: torch.Tensor, block: int) -> torch.Tensor:
    """Step 2: a permutation of the columns moving whole scale blocks, largest summed ``diag(H)`` first
    (a stable sort: equal sums keep their order)."""
    k = diag.shape[0]
    sums = diag.to(torch.float64).reshape(k // block, block).sum(1)
    order = torch.sort(-sums, stable=True).indices
    return (order[:, None] * block + torch.arange(block, device=diag.device)[None, :]).reshape(-1)


@dataclass
class Scales:
    """The scale of one column block of every row: encode multiplier r, decode step d, stored byte."""

    r: torch.Tensor  # fp32 [N]
    d: torch.Tensor  # fp32 [N]
    byte: torch.Tensor  # uint8 [N]


def choose_scales(scheme: str, cols: torch.Tensor, rule: str, amax: torch.Tensor | None,
                  iw: torch.Tensor | None) -> Scales:
    """The rule's scale of each row's block ``cols`` [N, bs] as the data-free quantizer picks it
    (reference.nvfp4_quantize / mxfp4_quantize on the block, with the matrix's amax)."""
    if scheme == "nvfp4":
        _, scale, gs = ref.nvfp4_quantize(cols, global_amax=amax, scale_rule=rule, input_weight=iw)
        byte = scale.view(torch.uint8)[:, 0]
        sf = ref.e4m3_decode(byte)
        gsb = gs.expand(sf.shape)
        r = torch.where(sf > 0, torch.clamp(gsb / sf, max=ref.FLT_MAX), torch.zeros_like(sf))
        return Scales(r, sf / gsb, byte)
    _, e = ref.mxfp4_quantize(cols, scale_rule=rule, input_weight=iw)
    ei = e[:, 0].to(torch.int32)
    return Scales(ref.pow2_f32(127 - ei), ref.pow2_f32(ei - 127), e[:, 0])


# The in-batch sweep: (w1 [N, B] fp32 (the caller's copy: a sweep may change it), u1 [B, B], scheme, rule,
# amax, input weights of the batch's columns or None) -> (codes uint8 [N, B], scale bytes [N, B/bs], values
# [N, B], errors [N, B]).
Sweep = Callable[[torch.Tensor, torch.Tensor, str, str, "torch.Tensor | None", "torch.Tensor | None"],
                 tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def sweep_batch(w1: torch.Tensor, u1: torch.Tensor, scheme: str, rule: str, amax: torch.Tensor | None,
                iw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3 inside one column batch (reference form: one column at a time, vectorized over rows). The
    batch is held transposed (a column is contiguous); every value is the one step 3 states."""
    n, b = w1.shape
    bs = ref.NVFP4_BLOCK if scheme == "nvfp4" else ref.MXFP4_BLOCK
    wt = w1.T.contiguous()  # [B, N]
    codes = torch.empty(b, n, dtype=torch.uint8, device=w1.device)
    values = torch.empty(b, n, dtype=_F32, device=w1.device)
    errors = torch.empty(b, n, dtype=_F32, device=w1.device)
    bytes_ = torch.empty(n, b // bs, dtype=torch.uint8, device=w1.device)
    s: Scales | None = None
    for i in range(b):
        if i % bs == 0:
            s = choose_scales(scheme, wt[i:i + bs].T, rule, amax, None if iw is None else iw[i:i + bs])
            bytes_[:, i // bs] = s.byte
        assert s is not None
        w = wt[i]
        c = ref.e2m1_encode(w * s.r)
        q = ref.e2m1_decode(c) * s.d
        e = (w - q) / u1[i, i]
        if i + 1 < b:
            wt[i + 1:] -= u1[i, i + 1:][:, None] * e[None, :]  # (one multiply, then one subtract)
        codes[i] = c
        values[i] = q
        errors[i] = e
    return codes.T, bytes_, values.T, errors.T


def quantize(w: torch.Tensor, prepared: Prepared, scheme: str, rule: str | None = None,
             global_amax: torch.Tensor | float | None = None, block: int = BLOCK,
             sweep: Sweep = sweep_batch) -> Result:
    """GPTQ of ``w`` [N, K] (already rotated when the checkpoint is) against ``prepared`` (its input's
    Hessian, rotated alike). ``global_amax`` (NVFP4): the fused group's amax of the weights before the
    sweep (default: this matrix's own); ``rule``: the scale rule (None: the scheme's default).
    ``sweep``: the in-batch step (this module's, or a kernel's, which gives the same bytes:
    :func:`fp4convert.kernels.gptq.sweep_for`)."""
    from fp4convert.numerics.scheme import SCHEMES

    sch = SCHEMES[scheme]
    rule = sch.check_rule(rule)
    bs = sch.block_size
    if w.dim() != 2:
        raise QuantizationError(f"GPTQ quantizes 2-D matrices, got {tuple(w.shape)}")
    n, k = w.shape
    ref.check_shape(w, bs)
    if prepared.u.shape != (k, k):
        raise QuantizationError(f"the Hessian is {tuple(prepared.u.shape)} but the matrix has K={k}")
    if block % bs:
        raise QuantizationError(f"the GPTQ block ({block}) must be a multiple of the {scheme} block ({bs})")
    w = w.to(_F32).clone()
    amax = None
    if sch.global_scale:
        own = w.abs().amax() if w.numel() else torch.zeros((), dtype=_F32, device=w.device)
        amax = own if global_amax is None else torch.as_tensor(global_amax, dtype=_F32, device=w.device)
    if not bool(torch.isfinite(w).all()) or (amax is not None and not bool(torch.isfinite(amax))):
        raise NonFiniteError("the tensor holds NaN or Inf; FP4 cannot represent it (fix or exclude the tensor)")
    perm = prepared.perm
    if perm is not None:
        chunks = perm.reshape(-1, bs)
        if bool((chunks[:, 0] % bs != 0).any()) or bool((chunks - chunks[:, :1] != torch.arange(bs, device=perm.device)).any()):
            raise QuantizationError(f"the Hessian's column order moves parts of {scheme} blocks; prepare it with "
                                    f"act_order={bs}")
        w = w[:, perm]
    w[:, prepared.dead] = 0.0
    u = prepared.u
    iw = prepared.diag if sch.rule(rule).searches else None
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    values = torch.empty(n, k, dtype=_F32, device=w.device)
    sbytes = torch.empty(n, k // bs, dtype=torch.uint8, device=w.device)
    with strict_fp32():
        for b0 in range(0, k, block):
            b1 = min(b0 + block, k)
            w1 = w[:, b0:b1].clone()
            c1, s1, v1, e1 = sweep(w1, u[b0:b1, b0:b1].contiguous(), scheme, rule, amax,
                                   None if iw is None else iw[b0:b1].contiguous())
            codes[:, b0:b1] = c1
            values[:, b0:b1] = v1
            sbytes[:, b0 // bs:b1 // bs] = s1
            if b1 < k:
                w[:, b1:] = w[:, b1:] - e1 @ u[b0:b1, b1:]
    if perm is not None:
        inv = torch.argsort(perm)
        codes, values = codes[:, inv], values[:, inv]
        ginv = inv.reshape(-1, bs)[:, 0] // bs
        sbytes = sbytes[:, ginv]
    if not bool(torch.isfinite(values).all()):
        raise NonFiniteError("GPTQ's error propagation overflowed (NaN/Inf); use --method rtn for this model")
    packed = ref.pack_nibbles(codes)
    if sch.global_scale:
        assert amax is not None
        return Result(packed, sbytes.view(torch.float8_e4m3fn), ref.global_scale(amax), values, prepared.damp)
    return Result(packed, sbytes, None, values, prepared.damp)
