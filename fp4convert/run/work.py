"""A part's work: its pending units become items, read ahead, quantized by a backend, written by one job.

:class:`QuantizeWork` is what the run loop (:mod:`fp4convert.run.runner`) asks, unit by unit in plan
order, for the unit's records and the job that writes it: a kept tensor is copied (unchanged, or its
F32/F64 as BF16 with --kept-dtype bf16) in pieces that the part's writer threads copy side by side; the
first unit of an item takes the item's inputs from the reader (:mod:`fp4convert.run.readahead`), starts
the backend on them (:func:`quantize`) and returns :func:`write_result`, the one write job every
backend's :class:`~fp4convert.quantizer.backend.Result` goes through; the item's other units have nothing left
to do. Export (:mod:`fp4convert.checkpoint.export`) brings a work of its own with the same interface (:class:`Work`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from fp4convert import stages
from fp4convert.quantizer.backend import attach_input_weights, refuse_nonfinite
from fp4convert.quantizer.items import is_kept_copy, make_items
from fp4convert.run.readahead import ReadAhead

if TYPE_CHECKING:
    from pathlib import Path

    from fp4convert.formats.base import OutputFormat
    from fp4convert.output.shards import ShardSet
    from fp4convert.plan.types import Decision
    from fp4convert.quantizer.backend import Backend, Inputs, InputWeight, Result, Settings
    from fp4convert.quantizer.items import Item
    from fp4convert.source.source import Source

WriteJob = Callable[["ShardSet"], None]  # runs on one of the part's writer threads


class Work(Protocol):
    """What the run loop asks of a part's work (a conversion's, an export's)."""

    @property
    def read_wait_s(self) -> float:
        """Seconds the work waited for its inputs (0: reading fully hidden)."""
        ...

    def start(self, pending: list[list[Decision]]) -> None:
        """The units this part will process (those a resume does not skip), in plan order."""
        ...

    def unit(self, unit: list[Decision]) -> tuple[dict[str, dict], WriteJob | list[WriteJob] | None]:
        """A unit's tensor records (filled in by its write job) and the job that writes it (None:
        written with an earlier unit of its item; a list: independent pieces that hold no memory
        until they run, e.g. a kept tensor's copy)."""
        ...

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        """The NaN/Inf scan of kept floats."""
        ...

    def thread_init(self) -> None:
        """Run first in the part's threads."""
        ...

    def close(self) -> None: ...


def quantize(item: Item, inputs: Inputs, backend: Backend, release: Callable) -> Callable[[], Result]:
    """Both passes of one item, started on ``backend`` (the tests interrupt runs here)."""
    with stages.timed("quantize"):
        return backend.quantize(item, inputs, release)


def write_result(item: Item, result: Result, fmt: OutputFormat, settings: Settings, shards: ShardSet,
                 records: dict[str, dict]) -> None:
    """The one write job: refuse NaN/Inf, fill the units' records (before any byte: a shard finished by
    these writes is saved with complete records), then every matrix's bytes in the format's names."""
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
        for name, data in fmt.outputs(m.module, out.packed, out.scale, out.gs, scheme, settings.rotate):
            shards.write(name, data, owner=result.keep)
    for name, data in result.tensors:
        shards.write(name, data, owner=result.keep)


class QuantizeWork:
    """A conversion part's work on one backend (one lane's: its own reader and stream)."""

    def __init__(self, source: Source, fmt: OutputFormat, settings: Settings, backend: Backend,
                 input_weights: dict[str, InputWeight] | None = None) -> None:
        self.source, self.fmt, self.settings, self.backend = source, fmt, settings, backend
        self.input_weights = input_weights  # module -> its input weight (fp4convert.calibrate.statistics)
        self.reader: ReadAhead | None = None
        self.item_of: dict[int, Item] = {}  # id(first unit) -> its item

    @property
    def read_wait_s(self) -> float:
        return self.reader.wait_s if self.reader is not None else 0.0

    def start(self, pending: list[list[Decision]]) -> None:
        """Batch the units this part will process and start reading them."""
        b = self.backend
        items = make_items(pending, b.batch_units, b.batch_bytes)
        attach_input_weights(items, self.input_weights)
        self.item_of = {id(it.units[0]): it for it in items}
        self.source.prefetch(pending)  # a Hub source fetches its shards ahead, in this order
        self.reader = ReadAhead([it.reads() for it in items], self.source.local_path, b.host_buffer, b.thread_init)

    def unit(self, unit: list[Decision]) -> tuple[dict[str, dict], WriteJob | list[WriteJob] | None]:
        d = unit[0]
        if is_kept_copy(unit):
            path = self.source.local_path(d.info.file)
            return {d.name: {}}, _copy_jobs(d, path)
        item = self.item_of.get(id(unit))
        if item is None:
            return {}, None  # a later unit of a batch: quantized and queued with its first unit
        assert self.reader is not None
        inputs, release = self.reader.next()  # the reader refills the buffer after the first release(event)
        try:
            result = quantize(item, inputs, self.backend, release)
        except BaseException:
            release(None)
            raise
        records: dict[str, dict] = {m.name: {} for m in item.members}
        fmt, settings = self.fmt, self.settings

        def job(shards: ShardSet) -> None:
            write_result(item, result(), fmt, settings, shards, records)

        return records, job

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

    def piece(at: int, n: int, shards: ShardSet) -> None:
        shards.copy_piece(d.name, path, d.info, at, n)

    return [functools.partial(piece, at, n) for at, n in pieces(d.info.nbytes)]
