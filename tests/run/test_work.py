"""The run loop tells the reader when an item's buffer may be refilled; backends only return data saying when.

A backend copying its inputs to the device says so at staging (``Staged.inputs_free``: the reader is
told before the passes, which may wait for the GPU); one reading the buffer in place says IN_USE, and
its Pending says when (now, or an event) once quantize() returns. Either way the reader hears once.
"""

from __future__ import annotations

import pytest

import fp4convert.run.work as work
from fp4convert.quantizer.backend import IN_USE, Pending, Result, Staged


class _Reader:
    def __init__(self, log: list) -> None:
        self.log = log

    def release(self, number: int, after: object | None = None) -> None:
        self.log.append(("release", number, after))


class _Backend:
    """Stages with ``staged_free``, and its quantize returns a Pending whose inputs are free at ``pending_free``."""

    def __init__(self, log: list, staged_free, pending_free, fail: bool = False) -> None:
        self.log, self.staged_free, self.pending_free, self.fail = log, staged_free, pending_free, fail

    def stage(self, item, inputs) -> Staged:
        self.log.append("stage")
        return Staged(item, inputs, self.staged_free)

    def quantize(self, staged: Staged) -> Pending:
        self.log.append("passes")
        if self.fail:
            raise RuntimeError("a launch failed")
        return Pending(Result([], []), inputs_free=self.pending_free)


COPIED, DONE = object(), object()  # a staging copy's event, pass 2's


@pytest.mark.parametrize("staged_free,pending_free,want", [
    (COPIED, None, ["stage", ("release", 7, COPIED), "passes"]),  # a GPU copy: told before the passes
    (None, None, ["stage", ("release", 7, None), "passes"]),  # copied synchronously: free now
    (IN_USE, None, ["stage", "passes", ("release", 7, None)]),  # read in place, done when quantize() returns
    (IN_USE, DONE, ["stage", "passes", ("release", 7, DONE)]),  # read in place until pass 2's event
])
def test_the_reader_is_told_once_when_the_backend_says(staged_free, pending_free, want) -> None:
    log: list = []
    pending = work.quantize(object(), ("buffer", []), _Backend(log, staged_free, pending_free), _Reader(log), 7)
    assert log == want and isinstance(pending, Pending)


def test_a_failing_backend_still_frees_the_inputs(monkeypatch) -> None:
    """QuantizeWork.unit releases the item whatever happened (a second release of it is the reader's no-op)."""
    log: list = []
    reader = _Reader(log)
    w = work.QuantizeWork.__new__(work.QuantizeWork)
    w.backend = _Backend(log, IN_USE, None, fail=True)
    w.reader = reader  # type: ignore[assignment]
    unit = [object()]
    w.item_of = {id(unit): object()}  # type: ignore[dict-item]
    w.stored = set()  # no unit quantized while calibrating
    monkeypatch.setattr(work, "is_kept_copy", lambda u: False)
    reader.next = lambda: (("buffer", []), 3)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="a launch failed"):
        w.unit(unit)  # type: ignore[arg-type]
    assert log == ["stage", "passes", ("release", 3, None)]
