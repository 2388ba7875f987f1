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


DEFER_BYTES = 256 << 20  # CPU batches held per input before their X^T X is summed (Observer.pending)

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

    ``keep_tokens`` (GPTQ with W4A4): the inputs themselves are held in :attr:`tokens` (the Hessian is not
    summed yet): the engine's rounding of an input needs the amax of every token first, so :meth:`asymmetric`
    takes the Hessian of the rounded inputs and their cross term once the block has run.

    On the CPU each batch's ``X^T X`` is taken when the Hessian is first read (:meth:`flush`), not when the
    batch arrives: the batches wait in :attr:`pending` (up to :data:`DEFER_BYTES` per input, then they are
    summed), and are summed then in the order they came, each into its chunk's sum, so the sums are the same
    bits. An input whose Hessian nobody reads costs no matmul: GPTQ's true-sequential pass drops the Hessians
    its block's first run took of the later steps' inputs, observed again before their step (on SmolLM2-135M
    12 of a block's 26 G fp64 multiply-adds, docs/numerics.md "Cost"), and a linear GPTQ does not quantize is
    observed too.
    """

    squares: bool = False
    hessian: bool = False
    rotate: str | None = None
    rotated_amax: bool = False
    keep_tokens: bool = False
    amax: torch.Tensor | None = None
    # the sums, per chunk of calibration samples (CHUNK micro-batches: the unit a torchrun rank owns); each chunk's
    # sum runs over its micro-batches in order, and the chunks are added in their order (:meth:`total`), so the
    # result is the same however the chunks are spread over ranks (one chunk: exactly the running sum)
    parts: dict = field(default_factory=dict)  # "xtx" | "sq" | "cross" -> {chunk: fp64 sum}
    tokens: list = field(default_factory=list)  # (chunk, the inputs held [n, K]) when keep_tokens
    pending: list = field(default_factory=list)  # CPU: (chunk, batch [n, K]) whose X^T X is not in parts yet
    count: int = 0
    shapes: set = field(default_factory=set)
    merged: bool = False  # the ranks' sums gathered (gather adds them once)

    def _add(self, kind: str, chunk: int, t: torch.Tensor) -> None:
        got = self.parts.setdefault(kind, {})
        got[chunk] = t if chunk not in got else got[chunk].add_(t)

    def flush(self) -> None:
        """Sum the pending batches' ``X^T X`` into their chunks' sums, in the order the batches came."""
        for chunk, x in self.pending:
            self._add("xtx", chunk, _gram(x, x))
        self.pending = []

    def total(self, kind: str) -> torch.Tensor | None:
        """The sum of ``kind`` over every chunk, the chunks added in their order (None: nothing)."""
        if kind == "xtx":
            self.flush()
        got = self.parts.get(kind)
        if not got:
            return None
        chunks = sorted(got)
        out = got[chunks[0]]
        for c in chunks[1:]:
            out = out + got[c]
        return out

    @property
    def xtx(self) -> torch.Tensor | None:
        return self.total("xtx")

    @property
    def sum_sq(self) -> torch.Tensor | None:
        return self.total("sq")

    @property
    def cross(self) -> torch.Tensor | None:
        return self.total("cross")

    def add(self, x: torch.Tensor, chunk: int = 0) -> None:
        """Take one batch of inputs ``[..., K]`` (any leading shape; rows are tokens) of chunk ``chunk``."""
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
            self._add("sq", chunk, (x2 * x2).sum(0))
        if self.hessian and self.keep_tokens:
            self.tokens.append((chunk, flat.clone()))
        elif self.hessian and not flat.is_cuda:
            self.pending.append((chunk, flat.clone()))  # (its own copy: the model may reuse the input's memory)
            if sum(t.numel() * t.element_size() for _, t in self.pending) > DEFER_BYTES:
                self.flush()  # (memory stays bounded)
        elif self.hessian:
            self._add("xtx", chunk, _gram(flat, flat))
        self.count += flat.shape[0]

    def asymmetric(self, rounded) -> None:
        """From the held inputs ``X`` and ``X~ = rounded(X)`` (the engine's activation rounding, in the
        domain the weights are quantized in; ``rounded`` None: nothing rounded): the Hessian becomes
        ``X~^T X~`` and :attr:`cross` holds ``(X - X~)^T X~``, the term that moves GPTQ's target to the
        weights that best reproduce the unrounded outputs ``X W^T`` from ``X~`` (docs/numerics.md
        "GPTQ", W4A4)."""
        import torch

        for chunk, x in self.tokens:
            xq = rounded(x) if rounded is not None else x
            self._add("xtx", chunk, _gram(xq, xq))
            if xq is x:
                continue  # (no cross term: the plain Hessian)
            wide = torch.float32 if x.is_cuda else torch.float64  # (the precision _gram multiplies in)
            self._add("cross", chunk, _gram(x.to(wide) - xq.to(wide), xq))
        self.tokens = []

    def mean_square(self) -> torch.Tensor | None:
        """E[x_j^2] per channel, rounded to bf16 (returned as fp32 on the CPU), or None if not kept."""
        import torch

        sq = self.sum_sq
        if sq is None or self.count == 0:
            return None
        return (sq / self.count).to(torch.bfloat16).float().cpu()

    def hessian_matrix(self) -> torch.Tensor | None:
        """``(1/n) X^T X`` (fp64, on the device it was accumulated on), or None if not kept."""
        xtx = self.xtx
        if xtx is None or self.count == 0:
            return None
        return xtx / self.count

    def cross_matrix(self) -> torch.Tensor | None:
        """``(1/n) (X - X~)^T X~`` (fp64) after :meth:`asymmetric`, else None."""
        cross = self.cross
        if cross is None or self.count == 0:
            return None
        return cross / self.count

    def release(self) -> None:
        """Forget the Hessian-sized statistics (the amax stays: W4A4 records it)."""
        self.parts.pop("xtx", None)
        self.parts.pop("cross", None)
        self.tokens = []
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
        self.chunk = 0  # the chunk of calibration samples the inputs being added belong to (Observer.parts)
        self.only: set[str] | None = None  # observe these inputs only (a block run again for some of them)
        self.keep_tokens: set[str] = set()  # inputs whose tokens are held (Observer.keep_tokens)
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
                                        keep_tokens=name in self.keep_tokens)
        obs.add(x, self.chunk)
        self._last = (name, x)

    def note(self, name: str, x: torch.Tensor) -> None:
        """Take the amax of ``x`` under ``name`` (an Observer of the amax alone, made on first use): what a
        method observes itself, outside the hooks (a streamed expert stack's inputs, for W4A4's scales)."""
        obs = self.get(name)
        if obs is None:
            obs = self[name] = Observer(rotate=self.rotate, rotated_amax=self.rotated_amax)
        obs.add(x)

    def drop(self, names) -> None:
        """Forget these inputs' statistics (a block's Hessians, once its weights are quantized)."""
        for n in names:
            self.pop(n, None)
            self._alias.pop(n, None)
        self._last = None

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """What these observers hold between blocks (amax, mean-square sums, counts; never a Hessian: a pass drops
        a block's once it is quantized), as (JSON-able record, tensors by key), for a pass's checkpoint."""
        record: dict = {"alias": dict(self._alias), "observers": {}}
        tensors: dict[str, torch.Tensor] = {}
        for n, o in self.items():
            if n in self._alias:
                continue
            record["observers"][n] = {"count": o.count, "shapes": sorted(o.shapes), "merged": o.merged}
            if o.amax is not None:
                tensors[f"{n}:amax"] = o.amax.detach().cpu()
            for c, t in o.parts.get("sq", {}).items():
                tensors[f"{n}:sq:{c}"] = t.detach().cpu()
        return record, tensors

    def restore(self, record: dict, tensors: dict[str, torch.Tensor], device) -> None:
        """Take back :meth:`state`'s statistics (on ``device``)."""
        for n, rec in record["observers"].items():
            o = self[n] = Observer(self.squares, self.hessian, self.rotate, self.rotated_amax, keep_tokens=n in self.keep_tokens)
            o.count, o.shapes, o.merged = int(rec["count"]), set(rec["shapes"]), bool(rec.get("merged"))
            if f"{n}:amax" in tensors:
                o.amax = tensors[f"{n}:amax"].to(device)
            prefix = f"{n}:sq:"
            for key, t in tensors.items():
                if key.startswith(prefix):
                    o.parts.setdefault("sq", {})[int(key[len(prefix):])] = t.to(device)
        for n, target in record["alias"].items():
            self._alias[n] = target
            self[n] = self[target]

    def gather(self, group, names=None, sums: bool = True) -> None:
        """Make these observers (``names``: those named; None: all) hold every rank's statistics: the amax at its
        maximum over the ranks and, with ``sums``, the chunks' sums of every rank and the total count (once: an
        observer merged already keeps its sums). ``group``: this process's place in a torchrun job (its
        ``gather(obj)`` returns every rank's ``obj``); one process: nothing to do."""
        import torch

        if group is None or not group.distributed:
            return
        wanted = [n for n in (self if names is None else names) if n in self and n not in self._alias]
        mine = {}
        for n in sorted(set(names or []) | set(wanted)):
            o = self.get(n) if n not in self._alias else None
            if o is None:
                continue
            send_sums = sums and not o.merged
            if send_sums:
                o.flush()
            mine[n] = {"amax": None if o.amax is None else o.amax.cpu(),
                       "count": o.count if send_sums else None, "shapes": sorted(o.shapes),
                       "parts": {k: {c: t.cpu() for c, t in v.items()} for k, v in o.parts.items()} if send_sums else None}
        everyone = group.gather({"observers": mine, "alias": {n: a for n, a in self._alias.items()
                                                             if names is None or n in names}})
        device = next((o.amax.device for o in self.values() if o.amax is not None), torch.device("cpu"))
        for got in everyone:
            for n, a in got["alias"].items():
                self._alias.setdefault(n, a)
        for n in sorted({n for got in everyone for n in got["observers"]}):
            theirs = [got["observers"][n] for got in everyone if n in got["observers"]]
            o = self.get(n)
            if o is None:
                o = self[n] = Observer(self.squares, self.hessian, self.rotate, self.rotated_amax,
                                       keep_tokens=n in self.keep_tokens)
            amaxes = [t["amax"] for t in theirs if t["amax"] is not None]
            if amaxes:
                o.amax = torch.stack(amaxes).amax().to(device)
            for t in theirs:
                o.shapes |= set(t["shapes"])
            if sums and not o.merged and all(t["count"] is not None for t in theirs):
                o.count = sum(t["count"] for t in theirs)
                parts: dict = {}
                for t in theirs:
                    for kind, chunks in t["parts"].items():
                        parts.setdefault(kind, {}).update({c: v.to(device) for c, v in chunks.items()})
                o.parts, o.merged = parts, True
        for n, a in self._alias.items():
            if a in self:
                self[n] = self[a]

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
    ``store``: the matrices a calibrated method quantized (``--method``) and ``method_record``, what the
    manifest says of its pass.
    """

    amax: dict[str, float] | None = None
    calibration: dict | None = None
    input_weights: dict[str, InputWeight] | None = None
    input_weight_record: dict | None = None
    store: Store | None = None
    method_record: dict | None = None
