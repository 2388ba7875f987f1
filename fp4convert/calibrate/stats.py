"""Accumulators of what a linear's input looks like on the calibration tokens.

One :class:`Observer` per observed input (a linear's, an expert slot's). Everything stays on the
device the block runs on (no host sync per micro-batch): the amax is an fp32 running max (order-free,
so it equals a whole-model forward's bit for bit), the per-channel sum of squares and, when asked, the
``X^T X`` sum that GPTQ-style methods need are fp64 (so the order the micro-batches arrive in moves
only the last bits, which the bf16 rounding of the mean squares absorbs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from fp4convert.quantizer.backend import InputWeight


@dataclass
class Observer:
    """Running statistics of one input: amax, per-channel sum of squares, token count, optional Hessian.

    ``rotate`` ("had16"): the squares (and Hessian) are those of the rotated input ``x H`` (the weights
    are quantized as ``W H``); the amax stays that of the plain input, which is what the engine's
    activation quantizer sees.
    """

    squares: bool = False
    hessian: bool = False
    rotate: str | None = None
    amax: torch.Tensor | None = None
    sum_sq: torch.Tensor | None = None
    xtx: torch.Tensor | None = None
    count: int = 0
    shapes: set = field(default_factory=set)

    def add(self, x: torch.Tensor) -> None:
        """Take one batch of inputs ``[..., K]`` (any leading shape; rows are tokens)."""
        import torch

        x = x.detach()
        if x.numel() == 0:
            return  # no token reached this input in this call
        a = x.abs().amax().float()
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        self.shapes.add(int(x.shape[-1]))
        if not (self.squares or self.hessian):
            return
        if self.rotate == "had16":
            from fp4convert.numerics.reference import had16

            x = had16(x)
        x2 = x.reshape(-1, x.shape[-1]).double()
        if self.squares:
            sq = (x2 * x2).sum(0)
            self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
        if self.hessian:
            h = x2.T @ x2
            self.xtx = h if self.xtx is None else self.xtx + h
        self.count += x2.shape[0]

    def mean_square(self) -> torch.Tensor | None:
        """E[x_j^2] per channel, rounded to bf16 (returned as fp32 on the CPU), or None if not kept."""
        import torch

        if self.sum_sq is None or self.count == 0:
            return None
        return (self.sum_sq / self.count).to(torch.bfloat16).float().cpu()

    def hessian_matrix(self) -> torch.Tensor | None:
        """``(1/n) X^T X`` (fp64, on the device it was accumulated on), or None if not kept."""
        if self.xtx is None or self.count == 0:
            return None
        return self.xtx / self.count


class Observers(dict):
    """name -> :class:`Observer`, made on first use with the same settings."""

    def __init__(self, squares: bool = False, hessian: bool = False, rotate: str | None = None) -> None:
        super().__init__()
        self.squares, self.hessian, self.rotate = squares, hessian, rotate
        self.enabled = True

    def add(self, name: str, x: torch.Tensor) -> None:
        if not self.enabled:
            return
        obs = self.get(name)
        if obs is None:
            obs = self[name] = Observer(self.squares, self.hessian, self.rotate)
        obs.add(x)

    def amax(self) -> dict[str, torch.Tensor]:
        """name -> fp32 amax on the CPU (one sync at the end)."""
        return {n: o.amax.cpu() for n, o in self.items() if o.amax is not None}

    def mean_squares(self) -> dict[str, torch.Tensor]:
        out = {}
        for n, o in self.items():
            ms = o.mean_square()
            if ms is not None:
                out[n] = ms
        return out


@dataclass
class Statistics:
    """What the layer-by-layer stage measured, for the conversion that follows.

    ``amax`` / ``calibration``: W4A4 NVFP4's activation amax per quantized module (fused and expert
    groups at their max) and its manifest record; ``input_weights``: each quantized matrix's input
    weight (module -> :class:`~fp4convert.backend.InputWeight`; fused members share one object) and
    ``input_weight_record``, the identity entry that describes them (source, tokens, seed, digest).
    """

    amax: dict[str, float] | None = None
    calibration: dict | None = None
    input_weights: dict[str, InputWeight] | None = None
    input_weight_record: dict | None = None
