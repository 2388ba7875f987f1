"""Where a run's time goes: the seconds each stage of the pipeline was busy.

The pipeline's stages run in their own threads (reader, quantize loop, writer, hash helper), so
the wall time alone cannot say which one limits a run; these totals can (``--json`` reports them
as ``stages_s``). A stage's figure sums its threads' busy time: stages overlap, so the figures add
up to more than the wall time when the pipeline works as meant. Imports nothing heavy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_totals: dict[str, float] = {}


def reset() -> None:
    """Start a new run's totals (one conversion at a time per process)."""
    with _lock:
        _totals.clear()


def add(stage: str, seconds: float) -> None:
    with _lock:
        _totals[stage] = _totals.get(stage, 0.0) + seconds


@contextmanager
def timed(stage: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(stage, time.perf_counter() - t0)


def snapshot() -> dict[str, float]:
    """The totals so far, rounded to milliseconds, in a stable order."""
    with _lock:
        return {k: round(v, 3) for k, v in sorted(_totals.items())}
