"""W4A4 GPTQ's smoothing (``--smooth ALPHA``): SmoothQuant's per-channel migration of an input's range
into the weights that read it, folded into the norm that makes the input (docs/numerics.md "GPTQ").

An input ``x`` that is a norm's output and feeds only quantized linears is served as ``x / s`` with the
linears' columns multiplied by ``s``: the product is unchanged, but NVFP4's 16-value activation blocks
no longer share a scale with an outlier channel. ``s_j = amax(x_j)^a / amax(W_j)^(1-a)`` (over the
calibration tokens and every linear reading ``x``), normalised to a geometric mean of 1. The norm's
weight takes ``1 / s`` (``w / s``, or ``(1 + w) / s - 1`` for a norm that scales by ``1 + w``, found by
running it), rounded to the checkpoint's dtype; the columns take the factor that rounded weight
really gives, so the fold is exact up to float rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

RANGE = 2.0 ** 12  # s is clamped to [1/RANGE, RANGE] (a channel that never fires is not blown up)


def scales(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-channel factors (fp32); 1 where the input or every weight of a channel is 0."""
    import torch

    x, w = x_amax.float(), w_amax.float()
    live = (x > 0) & (w > 0)
    s = torch.ones_like(x)
    s[live] = x[live] ** alpha / w[live] ** (1.0 - alpha)
    if bool(live.any()):
        s[live] = s[live] / torch.exp(torch.log(s[live]).mean())
    return s.clamp(1.0 / RANGE, RANGE)


def fold(norm: torch.nn.Module, weight: torch.Tensor, s: torch.Tensor, dtype: torch.dtype
         ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The norm weight (fp32 values of ``dtype``) whose output is the norm's divided by ``s`` per
    channel, the factor each channel's output really shrinks by (``s`` up to the rounding to
    ``dtype``: :func:`factor` of the two weights) and whether the norm scales by ``1 + w``; None when
    the norm's output is not ``n(x) * w`` or ``n(x) * (1 + w)`` (a bias, another form), checked by
    running it."""
    import torch
    from torch.func import functional_call

    if any(n != "weight" for n, _ in norm.named_parameters()):
        return None
    k = weight.numel()
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(0)).to(weight.device) * 3
    w = weight.float()
    try:
        y = functional_call(norm, {"weight": w}, (x,)).float()
        zero = functional_call(norm, {"weight": torch.zeros_like(w)}, (x,)).float()
    except Exception:  # noqa: BLE001 - a norm that takes more than its input (a gated norm): not folded
        return None
    if y.shape != x.shape:
        return None
    offset = bool(zero.abs().max() > 0)
    base = 1.0 + w if offset else w
    new = (base / s - 1.0 if offset else base / s).to(dtype).float()
    eff = factor(w, new, offset)
    got = functional_call(norm, {"weight": new}, (x,)).float()
    if not torch.allclose(got * eff, y, rtol=1e-4, atol=1e-6 * float(y.abs().max())):
        return None
    return new, eff, offset


def factor(before: torch.Tensor, after: torch.Tensor, offset: bool) -> torch.Tensor:
    """The per-channel factor a norm's output shrank by when its weight went from ``before`` to ``after``
    (what the reading linears' columns carry; ``inspect --verify`` divides it out again)."""
    import torch

    base = 1.0 + before.float() if offset else before.float()
    new = 1.0 + after.float() if offset else after.float()
    return torch.where((base != 0) & (new != 0), base / new, torch.ones_like(base))
