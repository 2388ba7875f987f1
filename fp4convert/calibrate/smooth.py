"""Smoothing for W4A4 (GPTQ's ``--smooth ALPHA``): SmoothQuant's per-channel migration of an input's range
into the weights that read it, folded into the norm that makes the input (docs/numerics.md "GPTQ"); a
calibrated method applies it to each visited block with :func:`smooth_block`.

An input ``x`` that is a norm's output and feeds only quantized linears is served as ``x / s`` with the
linears' columns multiplied by ``s``: the product is unchanged, but NVFP4's 16-value activation blocks
no longer share a scale with an outlier channel. ``s_j = amax(x_j)^a / amax(W_j)^(1-a)`` (over the
calibration tokens and every linear reading ``x``), normalised to a geometric mean of 1. The norm's
weight takes ``1 / s`` (``w / s``, or ``(1 + w) / s - 1`` for a norm that scales by ``1 + w``, found by
running it), rounded to the checkpoint's dtype; the columns take the factor that rounded weight
really gives, so the fold is exact up to float rounding.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.layerwise import LayerwiseModel, Visit
    from fp4convert.calibrate.stats import Observers
    from fp4convert.plan.types import Decision, Matrix

log = logging.getLogger(__name__)

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


TOLERANCE = 1e-3  # the block's outputs may move by this much of their largest before the smoothing is refused


def smooth_block(lm: LayerwiseModel, visit: Visit, decisions: list[Decision], observers: Observers,
                 inputs: dict[str, str], alpha: float, group=None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Smooth the visited block's norm-fed inputs: the norm weights and the reading linears' columns changed
    in :attr:`Visit.reads` (what the method quantizes and the block reloads), the held input tokens divided by
    the factors (their amax with them). Kept only if the block, run again, gives the same outputs (within
    TOLERANCE of their largest): a norm output read by anything else (a residual, an expert stack) would
    change them, and the block is then loaded back as it was. Returns (the changed norm weights, checkpoint
    name -> tensor in its dtype on the CPU, for the output; checkpoint name -> its readers and form, for
    the record); ({}, {}) when nothing was smoothed. ``group``: this process's place in a torchrun job (the
    inputs' per-channel amax and the outputs' change are every rank's)."""
    import torch

    from fp4convert.storage.safetensors import torch_dtypes

    reads = visit.reads
    modules = dict(lm.layers[visit.index].named_modules())
    readers: dict[str, list[tuple[Decision, Matrix]]] = {}
    for d in decisions:
        for m in d.matrices:
            readers.setdefault(inputs.get(m.module, ""), []).append((d, m))
    by_norm: dict[str, list[str]] = {}
    for name, norm in visit.fed.items():
        by_norm.setdefault(norm, []).append(name)
    changed: dict[str, torch.Tensor] = {}  # checkpoint name -> fp32 tensor the block loads
    out: dict[str, torch.Tensor] = {}  # the norm weights in their dtype
    held: list[tuple] = []
    record: dict[str, dict] = {}
    for norm, names in sorted(by_norm.items()):
        key = lm.disk_of.get(norm + ".weight")
        obs = {id(o): o for n in names if (o := observers.get(n)) is not None}
        if key is None or key not in reads or any(n not in readers for n in names) or len(obs) != 1:
            continue  # (a reader not quantized here, or inputs observed apart: left as it is)
        o = next(iter(obs.values()))
        if not o.tokens:
            continue
        mats = [dm for n in names for dm in readers[n]]
        x_amax = _everyone_max(torch.stack([t.abs().amax(0) for _, t in o.tokens]).amax(0), group)
        w_amax = torch.stack([m.view(reads[d.info.name]).abs().amax(0) for d, m in mats]).amax(0)
        dtype = torch_dtypes()[lm.infos[key].dtype]
        got = fold(modules[norm[len(visit.prefix):]], reads[key], scales(x_amax, w_amax, alpha), dtype)
        if got is None:
            continue
        new, eff, offset = got
        record[key] = {"readers": sorted({m.module for _, m in mats}), "offset": offset}
        changed[key] = new
        out[key] = new.to(dtype).cpu()
        for d, m in mats:
            t = changed.setdefault(d.info.name, reads[d.info.name].clone())
            m.view(t).mul_(eff.to(t.device))
        held.append((o, eff))
    if not changed:
        return {}, {}
    assert visit.again is not None  # (every block visit has it)
    before = visit.outputs  # (the block's first run, the weights as read)
    lm.reload_block(visit, {**reads, **changed})
    after = visit.again([])
    worst = max((float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(after, before)), default=0.0)
    worst = max(group.gather(worst)) if group is not None and group.distributed else worst
    if worst > TOLERANCE:
        log.warning("%s: smoothing changes the block's outputs by %.2g of their largest (a norm's output is read by "
                    "more than the quantized linears); not smoothed", visit.prefix[:-1], worst)
        lm.reload_block(visit, dict(reads))
        return {}, {}
    reads.update(changed)
    for o, eff in held:
        o.tokens = [(c, t / eff.to(t.device, t.dtype)) for c, t in o.tokens]
        o.amax = _everyone_max(torch.stack([t.abs().amax() for _, t in o.tokens]).amax().float(), group)
    return out, record


def _everyone_max(t: torch.Tensor, group) -> torch.Tensor:
    """``t``'s elementwise maximum over the ranks of a torchrun job (``group``; one process: ``t``)."""
    import torch

    if group is None or not group.distributed:
        return t
    return torch.stack([x.to(t.device) for x in group.gather(t.cpu())]).amax(0)
