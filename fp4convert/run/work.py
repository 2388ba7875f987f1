"""A part's work: its pending units become items, read ahead, quantized by a backend, written by one job.

:class:`QuantizeWork` is what the run loop (:mod:`fp4convert.run.runner`) asks, unit by unit in plan
order, for the unit's records and the jobs that write it, as data the runner hands back to
:meth:`Work.write` on a writer thread: a kept tensor is copied (unchanged, or its F32/F64 as BF16 with
--kept-dtype bf16) in pieces (:class:`CopyPiece`) that the part's writer threads copy side by side; the
first unit of an item takes the item's inputs from the reader (:mod:`fp4convert.run.readahead`), starts
the backend on them (:func:`quantize`), tells the reader when their buffer may be refilled (the
backend's :class:`~fp4convert.quantizer.backend.Staged` and :class:`~fp4convert.quantizer.backend.Pending`
say when: the backend never calls up) and returns a :class:`WriteItem`, which :func:`write_result`, the
one write every backend's :class:`~fp4convert.quantizer.backend.Result` goes through, writes; the item's
other units have nothing left to do. Export (:mod:`fp4convert.checkpoint.export`) brings a work of its
own with the same interface (:class:`Work`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from fp4convert import timing
from fp4convert.plan.types import QUANTIZE
from fp4convert.quantizer.backend import IN_USE, attach_input_weights, refuse_nonfinite
from fp4convert.quantizer.items import Complex, is_kept_copy, make_items
from fp4convert.run.readahead import ReadAhead

if TYPE_CHECKING:
    from pathlib import Path

    from fp4convert.calibrate.store import Store
    from fp4convert.formats.base import OutputFormat
    from fp4convert.output.shards import ShardSet
    from fp4convert.plan.types import Decision
    from fp4convert.quantizer.backend import Backend, Inputs, InputWeight, Pending, Result, Settings
    from fp4convert.quantizer.items import Item
    from fp4convert.source.source import Source


class WriteJob:
    """One write of a unit, as data: the runner submits it to a writer thread, which hands it to the
    work's :meth:`Work.write`. ``held``: it holds memory (an item's results) until it has run, so the
    writer threads bound how many wait; False: it holds nothing until it runs (a kept copy's piece)."""

    held: ClassVar[bool] = True


@dataclass
class WriteItem(WriteJob):
    """An item's outputs: the backend's Pending (its Result, waited for on the writer thread) and the
    records of its units, filled in before any byte is written."""

    item: Item
    pending: Pending
    records: dict[str, dict]


@dataclass
class CopyPiece(WriteJob):
    """``n`` bytes at offset ``at`` of kept tensor ``decision``'s data in ``path``: read, NaN/Inf scan, written."""

    held: ClassVar[bool] = False
    decision: Decision
    path: Path
    at: int
    n: int


@dataclass
class KeptBytes(WriteJob):
    """A kept tensor the calibration pass changed (GPTQ's smoothing folded into a norm's weight): its
    bytes from the store instead of the source's."""

    decision: Decision
    store: Store


class Work(Protocol):
    """What the run loop asks of a part's work (a conversion's, an export's)."""

    @property
    def read_wait_s(self) -> float:
        """Seconds the work waited for its inputs (0: reading fully hidden)."""
        ...

    def start(self, pending: list[list[Decision]]) -> None:
        """The units this part will process (those a resume does not skip), in plan order."""
        ...

    def unit(self, unit: list[Decision]) -> tuple[dict[str, dict], list[WriteJob]]:
        """A unit's tensor records (filled in by its write jobs) and the jobs that write it (none:
        written with an earlier unit of its item; several: independent pieces, e.g. a kept tensor's
        copy), to be handed to :meth:`write` on the part's writer threads."""
        ...

    def write(self, job: WriteJob, shards: ShardSet) -> None:
        """Run one of :meth:`unit`'s write jobs against the part's shards (on a writer thread)."""
        ...

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        """The NaN/Inf scan of kept floats."""
        ...

    def thread_init(self) -> None:
        """Run first in the part's threads."""
        ...

    def close(self) -> None: ...


def quantize(item: Item, inputs: Inputs, backend: Backend, reader: ReadAhead, number: int) -> Pending:
    """Both passes of one item, started on ``backend`` (the tests interrupt runs here); the reader is told
    when item ``number``'s buffer may be refilled: at staging when the backend copied the inputs (a GPU's
    copy event), else once quantize() returns (the passes' Pending says when: now, or an event)."""
    with timing.timed("quantize"):
        staged = backend.stage(item, inputs)
        if staged.inputs_free is not IN_USE:
            reader.release(number, staged.inputs_free)
        pending = backend.quantize(staged)
        if staged.inputs_free is IN_USE:
            reader.release(number, pending.inputs_free)
        return pending


def write_result(item: Item, result: Result, fmt: OutputFormat, settings: Settings, shards: ShardSet,
                 records: dict[str, dict], activation_amax: dict[str, float] | None = None) -> None:
    """The one write job: refuse NaN/Inf, fill the units' records (before any byte: a shard finished by
    these writes is saved with complete records), then every matrix's bytes in the format's names
    (W4A4 NVFP4: with its module's calibrated input amax, ``activation_amax``)."""
    refuse_nonfinite(item, result.refused, settings.rotate)
    per: dict[str, dict[str, dict]] = {}
    for (d, m), out in zip(item.matrices, result.matrices):
        if out is not None and out.gs is not None:
            per.setdefault(d.name, {})[m.module] = {"global_scale": out.gs, "amax": out.amax}
    for d in item.members:
        got = per.get(d.name)
        if got:
            records[d.name].update(next(iter(got.values())) if len(d.matrices) == 1 else {"matrices": got})
    scheme = settings.scheme.name
    for (d, m), out in zip(item.matrices, result.matrices):
        assert out is not None  # refused ones raised above
        input_amax = activation_amax.get(m.module) if activation_amax is not None else None
        for name, data in fmt.outputs(m.module, out.packed, out.scale, out.gs, scheme, settings.rotate, input_amax):
            shards.write(name, data, owner=result.keep)
    for name, data in result.tensors:
        shards.write(name, data, owner=result.keep)


class QuantizeWork:
    """A conversion part's work on one backend (one lane's: its own reader and stream)."""

    def __init__(self, source: Source, fmt: OutputFormat, settings: Settings, backend: Backend,
                 input_weights: dict[str, InputWeight] | None = None,
                 activation_amax: dict[str, float] | None = None, store: Store | None = None) -> None:
        self.source, self.fmt, self.settings, self.backend = source, fmt, settings, backend
        self.input_weights = input_weights  # module -> its input weight (fp4convert.calibrate.statistics)
        self.activation_amax = activation_amax  # W4A4 NVFP4: module -> its calibrated input amax
        self.store = store  # a calibrated method: matrices quantized while calibrating, written as they are
        self.reader: ReadAhead | None = None
        self.item_of: dict[int, Item] = {}  # id(first unit) -> its item
        self.stored: set[int] = set()  # id(unit) of the units the store holds whole

    @property
    def read_wait_s(self) -> float:
        return self.reader.wait_s if self.reader is not None else 0.0

    def start(self, pending: list[list[Decision]]) -> None:
        """Batch the units this part will process and start reading them."""
        b = self.backend
        q = self.store
        if q is not None:  # units quantized while calibrating: nothing to read or quantize
            whole = [u for u in pending if u[0].action == QUANTIZE and all(m.module in q for d in u for m in d.matrices)]
            self.stored = {id(u) for u in whole}
            pending = [u for u in pending if id(u) not in self.stored]
        items = make_items(pending, b.batch_units, b.batch_bytes)
        attach_input_weights(items, self.input_weights)
        self.item_of = {id(it.units[0]): it for it in items}
        self.source.prefetch(pending)  # a Hub source fetches its shards ahead, in this order
        self.reader = ReadAhead([it.reads() for it in items], self.source.local_path, b.host_buffer, b.thread_init)

    def unit(self, unit: list[Decision]) -> tuple[dict[str, dict], list[WriteJob]]:
        d = unit[0]
        if is_kept_copy(unit) and self.store is not None and d.name in self.store.changed:
            return {d.name: {"changed_by": self.store.changed_by[d.name]}}, [KeptBytes(d, self.store)]
        if is_kept_copy(unit):
            path = self.source.local_path(d.info.file)
            return {d.name: {}}, _copy_jobs(d, path)
        if id(unit) in self.stored:
            from fp4convert.calibrate.store import Stored

            assert self.store is not None
            whole = Complex(unit)
            records: dict[str, dict] = {m.name: {} for m in whole.members}
            s = self.settings
            return records, [WriteItem(whole, Stored(whole, self.store, s.swizzle, s.scheme.name), records)]
        item = self.item_of.get(id(unit))
        if item is None:
            return {}, []  # a later unit of a batch: quantized and queued with its first unit
        assert self.reader is not None
        inputs, number = self.reader.next()
        try:
            pending = quantize(item, inputs, self.backend, self.reader, number)
        except BaseException:
            self.reader.release(number)  # only the first release counts
            raise
        recs: dict[str, dict] = {m.name: {} for m in item.members}  # the write job fills them in
        return recs, [WriteItem(item, pending, recs)]

    def write(self, job: WriteJob, shards: ShardSet) -> None:
        if isinstance(job, CopyPiece):
            shards.copy_piece(job.decision.name, job.path, job.decision.info, job.at, job.n)
        elif isinstance(job, KeptBytes):
            from fp4convert.kernels.tensor import as_bytes

            t = job.store.changed_tensor(job.decision.name)
            shards.write(job.decision.name, as_bytes(t), owner=t)
        else:
            assert isinstance(job, WriteItem)
            write_result(job.item, job.pending.result(), self.fmt, self.settings, shards, job.records,
                         self.activation_amax)

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        return self.backend.nonfinite(dtype, data)

    def thread_init(self) -> None:
        self.backend.thread_init()

    def close(self) -> None:
        self.source.stop_prefetch()  # first: a reader waiting for a shard then ends
        if self.reader is not None:
            self.reader.close()


def _copy_jobs(d: Decision, path: Path) -> list[WriteJob]:
    """A kept tensor's copy, as independent pieces (read, NaN/Inf scan, write at their offsets)."""
    from fp4convert.output.shards import pieces

    return [CopyPiece(d, path, at, n) for at, n in pieces(d.info.nbytes)]
