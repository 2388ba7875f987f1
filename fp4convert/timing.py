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
_counts: dict[str, float] = {}


def reset() -> None:
    """Start a new run's totals (one conversion at a time per process)."""
    with _lock:
        _totals.clear()
        _counts.clear()


def count(name: str, amount: float = 1) -> None:
    """A quantity that is not time (pinned megabytes allocated, launches): ``--json``'s ``counts``."""
    with _lock:
        _counts[name] = _counts.get(name, 0) + amount


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


def counts() -> dict[str, float]:
    with _lock:
        return {k: round(v, 3) for k, v in sorted(_counts.items())}


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), or None: what start-up cost before main."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        import os

        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
