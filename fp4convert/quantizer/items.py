"""Scheduling, torch-free: a part's work units as the items a backend quantizes, and the writer thread.

A work unit is one tensor or one fused group (:meth:`fp4convert.plan.planner.Plan.units`). Consecutive plain
units (every member one whole 2-D matrix) are batched up to the backend's limits (:class:`Batch`: a
GPU launches all experts of a layer at once); any other quantized unit is an item of its own
(:class:`Complex`: 3-D stacked experts, gate/up halves, FP8 / MXFP4 inputs decoded first); a kept
tensor ends a batch and is copied by the writer, in pieces. Each item's writes are one job (a kept
copy's pieces one job each) for the part's :class:`WriteBehind` threads, which start them in plan
order and run them side by side.
"""

from __future__ import annotations

from fp4convert.plan.types import QUANTIZE, Decision, Matrix


def is_plain(unit: list[Decision]) -> bool:
    """Every member quantizes its whole 2-D tensor as one matrix (what a :class:`Batch` holds)."""
    for d in unit:
        if d.action != QUANTIZE or d.decode is not None or len(d.matrices) != 1 or len(d.info.shape) != 2:
            return False
        m = d.matrices[0]
        if (m.expert is not None or m.rows is not None or m.transpose or m.module != d.module
                or (m.group or d.group) != d.group or tuple(m.shape) != tuple(d.info.shape)):
            return False
    return True


def is_kept_copy(unit: list[Decision]) -> bool:
    """A kept tensor copied unchanged (a kept quantized input is decoded instead: a :class:`Complex`)."""
    return unit[0].action != QUANTIZE and unit[0].decode is None


class Batch:
    """Consecutive plain units: their members in plan order, and their shape groups (one launch each)."""

    def __init__(self, units: list[list[Decision]]) -> None:
        self.units = units
        self.members = [d for u in units for d in u]
        self.unit_of = [i for i, u in enumerate(units) for _ in u]
        self.groups = shape_groups([d.info for d in self.members])
        self.matrices: list[tuple[Decision, Matrix]] = [(d, d.matrices[0]) for d in self.members]
        self.keys: list[int | str | None] = list(self.unit_of)  # a unit (a fused group) shares one amax
        self.input_weights: list | None = None  # per matrix, backend.InputWeight or None (backend.attach_input_weights)

    def reads(self) -> list:
        """The tensors to read for this batch, in member order."""
        return [d.info for d in self.members]


class Complex:
    """One quantized unit whose tensors are not one whole matrix each (stacked experts, gate/up halves,
    FP8 / MXFP4 inputs), or a kept quantized input (written as the fp32 weight it encodes)."""

    def __init__(self, unit: list[Decision]) -> None:
        self.units = [unit]
        self.members = list(unit)
        self.kept = unit[0].action != QUANTIZE
        self.matrices = [] if self.kept else [(d, m) for d in unit for m in d.matrices]
        # matrices with the same group share one global scale; ungrouped ones have their own
        self.keys: list[int | str | None] = [m.group or d.group for d, m in self.matrices]
        self.input_weights: list | None = None  # per matrix, backend.InputWeight or None (backend.attach_input_weights)

    def reads(self) -> list:
        """Every on-disk tensor of the unit, member by member (a decoded input reads several)."""
        return [t for d in self.members for t in d.reads]


Item = Batch | Complex


def make_items(pending: list[list[Decision]], max_units: int, max_bytes: int) -> list[Item]:
    """The items of a part's pending units, in plan order: plain units batched, other quantized units
    (and kept quantized inputs, which are decoded) one each; kept copies are no item."""
    items: list[Item] = []
    run: list[list[Decision]] = []

    def flush() -> None:
        items.extend(Batch(b) for b in make_batches(run, max_units, max_bytes))
        run.clear()

    for u in pending:
        if is_kept_copy(u):
            flush()
        elif is_plain(u):
            run.append(u)
        else:
            flush()
            items.append(Complex(u))
    flush()
    return items


def make_batches(pending: list[list[Decision]], max_units: int, max_bytes: int) -> list[list[list[Decision]]]:
    """Consecutive pending quantize units, batched (each unit whole); a kept unit ends a batch."""
    out: list[list[list[Decision]]] = []
    cur: list[list[Decision]] = []
    size = 0
    for unit in pending:
        if unit[0].action != QUANTIZE:
            if cur:
                out.append(cur)
            cur, size = [], 0
            continue
        nbytes = sum(d.info.nbytes for d in unit)
        if cur and (len(cur) >= max_units or size + nbytes > max_bytes):
            out.append(cur)
            cur, size = [], 0
        cur.append(unit)
        size += nbytes
    if cur:
        out.append(cur)
    return out


def shape_groups(infos: list) -> list[list[int]]:
    """Member indices grouped by (dtype, shape), groups in order of first appearance (a launch each)."""
    groups: dict[tuple, list[int]] = {}
    for i, info in enumerate(infos):
        groups.setdefault((info.dtype, tuple(info.shape)), []).append(i)
    return list(groups.values())


def grouped_offsets(infos: list, align: int = 256) -> tuple[list[int], int]:
    """Where each tensor of a batch goes in its host buffer, and the buffer's size: the members of
    a shape group back to back (one [B, M, K] array, so a group is one launch straight from the
    buffer), each group at an ``align``-byte boundary. Reads still go in file order (scattered)."""
    offsets = [0] * len(infos)
    total = 0
    for g in shape_groups(infos):
        total = -(-total // align) * align
        for i in g:
            offsets[i] = total
            total += infos[i].nbytes
    return offsets, -(-total // align) * align


