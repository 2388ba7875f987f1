"""The plan's shared types: what happens to one tensor (:class:`Decision`) and the matrices it is cut into.

Every stage after planning reads these (the backends, the writer, the manifest, calibration), so they live
apart from the planner and import nothing of fp4convert above the storage layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp4convert.formats.base import Decode
from fp4convert.storage.safetensors import OutEntry, TensorInfo

QUANTIZE, KEEP = "quantize", "keep"


@dataclass(frozen=True)
class Matrix:
    """One 2-D ``[N, K]`` weight to quantize, cut from a source tensor and written as ``module``.

    A plain linear weight is one matrix (the whole tensor). A 3-D stacked expert tensor gives one per
    expert (and per gate/up half): row slice ``rows`` of expert ``expert``, after a transpose when
    the checkpoint stores in-features first. Matrices with the same ``group`` share a global scale.
    """

    module: str
    shape: tuple[int, int]
    group: str | None = None
    expert: int | None = None
    rows: tuple[int, int, int] | None = None  # (start, stop, step) along N
    transpose: bool = False

    def to_json(self) -> dict:
        return {"module": self.module, "shape": list(self.shape), "group": self.group, "expert": self.expert,
                "rows": list(self.rows) if self.rows else None, "transpose": self.transpose}

    @classmethod
    def from_json(cls, d: dict) -> Matrix:
        return cls(d["module"], tuple(d["shape"]), d.get("group"), d.get("expert"),
                   tuple(d["rows"]) if d.get("rows") else None, bool(d.get("transpose")))

    def view(self, t):
        """This ``[N, K]`` matrix of its on-disk tensor ``t`` (a torch tensor), as a view (writes go into ``t``): expert
        :attr:`expert` of a 3-D stack, transposed where the checkpoint stores in-features first, rows :attr:`rows`."""
        v = t if self.expert is None else t[self.expert]
        if self.transpose:
            v = v.transpose(-1, -2)
        if self.rows is not None:
            v = v[self.rows[0]:self.rows[1]:self.rows[2]]
        return v


@dataclass(frozen=True)
class Decision:
    """What happens to one source tensor (or one decoded quantized input), and why."""

    name: str
    action: str  # QUANTIZE or KEEP
    reason: str
    info: TensorInfo  # the tensor as the planner sees it (decoded inputs: their logical dtype and shape)
    group: str | None = None  # fused group id (tensor level: q/k/v, gate/up, per expert)
    outputs: tuple[OutEntry, ...] = ()
    matrices: tuple[Matrix, ...] = ()  # what is quantized (QUANTIZE only)
    decode: Decode | None = None  # how to turn the on-disk tensors into the fp32 weight

    @property
    def module(self) -> str:
        return self.name[: -len(".weight")] if self.name.endswith(".weight") else self.name

    @property
    def reads(self) -> tuple[TensorInfo, ...]:
        """Every on-disk tensor this decision reads."""
        return self.decode.inputs if self.decode else (self.info,)

    @property
    def read_bytes(self) -> int:
        return sum(t.nbytes for t in self.reads)
