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

    from fp4convert.calibrate.store import Store
    from fp4convert.quantizer.backend import InputWeight


DEFER_BYTES = 256 << 20  # CPU batches kept per input before their X^T X is summed (Observer.pending)


def bf16_ceil(x: float) -> float:
    """The smallest bf16 value >= x (x finite, >= 0)."""
    import struct

    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if bits & 0xFFFF:
        bits = (bits & 0xFFFF0000) + 0x10000
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


@dataclass
class Observer:
    """Running statistics of one input: amax, per-channel sum of squares, token count, optional Hessian.

    ``rotate`` ("had16"): the squares (and Hessian) are those of the rotated input ``x H`` (the weights
    are quantized as ``W H``); the amax stays that of the plain input, unless ``rotated_amax``: W4A4
    with a rotation, whose engine rotates the input before quantizing it.

    The Hessian sum: each batch's ``X^T X`` is one fp64 matmul on the CPU; on a GPU one fp32 matmul
    with TF32 allowed (an order of magnitude faster there than fp64 or strict fp32, and its rounding
    is far below the 1% dampening GPTQ adds), summed in fp64. Its last bits depend on the device and
    the GEMM library (docs/numerics.md "GPTQ").

    ``keep`` (GPTQ with W4A4): the inputs themselves are kept (the Hessian is not summed yet): the
    engine's rounding of an input needs the amax of every token first, so :meth:`asymmetric` takes the
    Hessian of the rounded inputs and their cross term once the block has run.

    On the CPU each batch's ``X^T X`` is taken when the Hessian is first read (:attr:`xtx`), not when the
    batch arrives: the batches wait in :attr:`pending` (up to :data:`DEFER_BYTES` per input, then they are
    summed), and are summed then in the order they came, so the sum is the same bits. An input whose
    Hessian nobody reads costs no matmul: GPTQ's true-sequential pass drops the Hessians its block's first
    run took of the later steps' inputs, observed again before their step (on SmolLM2-135M 12 of a block's
    26 G fp64 multiply-adds, benchmarks/gptq_cpu_profile.md), and a linear GPTQ does not quantize is observed
    too.
    """

    squares: bool = False
    hessian: bool = False
    rotate: str | None = None
    rotated_amax: bool = False
    keep: bool = False
    amax: torch.Tensor | None = None
    sum_sq: torch.Tensor | None = None
    _xtx: torch.Tensor | None = None  # the X^T X summed so far (read it as xtx: that sums the pending ones first)
    cross: torch.Tensor | None = None
    kept: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # CPU: batches [n, K] whose X^T X is not in xtx yet
    count: int = 0
    shapes: set = field(default_factory=set)

    @property
    def xtx(self) -> torch.Tensor | None:
        """The ``X^T X`` sum (fp64), the pending batches summed into it first, in the order they came."""
        for x in self.pending:
            h = _gram(x, x)
            self._xtx = h if self._xtx is None else self._xtx.add_(h)
        self.pending = []
        return self._xtx

    @xtx.setter
    def xtx(self, value: torch.Tensor | None) -> None:
        self._xtx = value

    def add(self, x: torch.Tensor) -> None:
        """Take one batch of inputs ``[..., K]`` (any leading shape; rows are tokens)."""
        import torch

        x = x.detach()
        if x.numel() == 0:
            return  # no token reached this input in this call
        self.shapes.add(int(x.shape[-1]))
        rotated = None
        if self.rotate == "had16" and (self.squares or self.hessian or self.rotated_amax):
            from fp4convert.numerics.reference import had16

            rotated = had16(x)
        a = (rotated if self.rotated_amax and rotated is not None else x).abs().amax().float()
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        if not (self.squares or self.hessian):
            return
        if rotated is not None:
            x = rotated
        flat = x.reshape(-1, x.shape[-1])
        if self.squares:
            x2 = flat.double()
            sq = (x2 * x2).sum(0)
            self.sum_sq = sq if self.sum_sq is None else self.sum_sq + sq
        if self.hessian and self.keep:
            self.kept.append(flat.clone())
        elif self.hessian and not flat.is_cuda:
            self.pending.append(flat.clone())  # (its own copy: the model may reuse the input's memory)
            if sum(t.numel() * t.element_size() for t in self.pending) > DEFER_BYTES:
                _ = self.xtx  # (summed now: memory stays bounded)
        elif self.hessian:
            h = _gram(flat, flat)
            self.xtx = h if self.xtx is None else self.xtx.add_(h)
        self.count += flat.shape[0]

    def asymmetric(self, rounded) -> None:
        """From the kept inputs ``X`` and ``X~ = rounded(X)`` (the engine's activation rounding, in the
        domain the weights are quantized in; ``rounded`` None: nothing rounded): the Hessian becomes
        ``X~^T X~`` and :attr:`cross` holds ``(X - X~)^T X~``, the term that moves GPTQ's target to the
        weights that best reproduce the unrounded outputs ``X W^T`` from ``X~`` (docs/numerics.md
        "GPTQ", W4A4)."""
        import torch

        for x in self.kept:
            xq = rounded(x) if rounded is not None else x
            h = _gram(xq, xq)
            self.xtx = h if self.xtx is None else self.xtx.add_(h)
            if xq is x:
                continue  # (no cross term: the plain Hessian)
            wide = torch.float32 if x.is_cuda else torch.float64  # (the precision _gram multiplies in)
            c = _gram(x.to(wide) - xq.to(wide), xq)
            self.cross = c if self.cross is None else self.cross.add_(c)
        self.kept = []

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

    def cross_matrix(self) -> torch.Tensor | None:
        """``(1/n) (X - X~)^T X~`` (fp64) after :meth:`asymmetric`, else None."""
        if self.cross is None or self.count == 0:
            return None
        return self.cross / self.count

    def release(self) -> None:
        """Forget the Hessian-sized statistics (the amax stays: W4A4 records it)."""
        self.xtx = self.cross = None
        self.kept = []
        self.pending = []


def _gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T b`` summed in fp64: on the CPU one fp64 matmul; on a GPU one fp32 matmul with TF32
    allowed (see :class:`Observer`)."""
    import torch

    if a.is_cuda:
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return (a.float().T @ b.float()).double()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    return a.double().T @ b.double()


class Observers(dict):
    """name -> :class:`Observer`, made on first use with the same settings.

    Inputs that are one tensor (q/k/v's, gate/up's: the pre-hooks receive the very same object) share
    one Observer: its statistics are computed once (a Hessian is the costliest part of a block), and
    both names map to it.
    """

    def __init__(self, squares: bool = False, hessian: bool = False, rotate: str | None = None,
                 rotated_amax: bool = False) -> None:
        super().__init__()
        self.squares, self.hessian, self.rotate, self.rotated_amax = squares, hessian, rotate, rotated_amax
        self.enabled = True
        self.only: set[str] | None = None  # observe these inputs only (a block run again for some of them)
        self.keep: set[str] = set()  # inputs whose tokens are kept (Observer.keep)
        self._last: tuple[str, object] | None = None  # (name, tensor) of the latest add
        self._alias: dict[str, str] = {}  # name -> the name whose Observer it shares

    def add(self, name: str, x: torch.Tensor) -> None:
        if not self.enabled or (self.only is not None and name not in self.only):
            return
        last = self._last
        if name in self._alias:
            if last is not None and last[1] is x and last[0] == self._alias[name]:
                return  # the shared input, already added under its first name
            raise RuntimeError(f"{name}: its input was shared with {self._alias[name]} and no longer is")
        obs = self.get(name)
        if obs is None:
            if last is not None and last[1] is x and last[0] in self:
                self._alias[name] = last[0]
                self[name] = self[last[0]]
                return
            obs = self[name] = Observer(self.squares, self.hessian, self.rotate, self.rotated_amax,
                                        keep=name in self.keep)
        obs.add(x)
        self._last = (name, x)

    def drop(self, names) -> None:
        """Forget these inputs' statistics (a block's Hessians, once its weights are quantized)."""
        for n in names:
            self.pop(n, None)
            self._alias.pop(n, None)
        self._last = None

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
    ``input_weight_record``, the identity entry that describes them (source, tokens, seed, digest);
    ``gptq``: the matrices GPTQ quantized (``--method gptq``) and ``gptq_record``, what the manifest says
    of the pass.
    """

    amax: dict[str, float] | None = None
    calibration: dict | None = None
    input_weights: dict[str, InputWeight] | None = None
    input_weight_record: dict | None = None
    gptq: Store | None = None
    gptq_record: dict | None = None
