"""Progress of a calibration (blocks done, tokens generated, time left): a tqdm bar on a terminal, a line
every ``FP4CONVERT_PROGRESS_INTERVAL`` seconds on a log."""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger(__name__)  # its level decides: a bar or lines at INFO, nothing under --quiet

PROGRESS_ENV = "FP4CONVERT_PROGRESS_INTERVAL"  # the run's own progress setting (run/progress.py): seconds between lines


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "block"):
    """The calibration's progress (blocks done, tokens generated; the time left): a tqdm bar on a
    terminal (hidden by ``--quiet``), a line every ``FP4CONVERT_PROGRESS_INTERVAL`` seconds (10) on a log
    or a pipe where the run shows its status lines (the CLI without ``--quiet``/``--json``), a silent
    stand-in elsewhere. ``update(n)`` counts ``n`` units."""
    import sys

    if enabled and sys.stderr.isatty() and log.isEnabledFor(logging.WARNING):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm comes with transformers
            pass
        else:
            return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit != "block", leave=False, file=sys.stderr)
    if enabled and not sys.stderr.isatty() and log.isEnabledFor(logging.INFO):
        try:
            interval = max(float(os.environ.get(PROGRESS_ENV, "10")), 0.0)
        except ValueError:
            interval = 10.0
        return LineProgress(total, desc, unit, interval)
    return LineProgress(total, desc, unit, None)


class LineProgress:
    """Progress for logs and pipes: ``desc: done of total unit (pct), elapsed, rate, time left``, printed
    on an update once ``interval`` seconds passed since the last line, and at the end (None: never)."""

    def __init__(self, total: int, desc: str, unit: str, interval: float | None) -> None:
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.n = self._shown = 0
        self._t0 = self._last = time.monotonic()

    def line(self) -> str:
        spent = time.monotonic() - self._t0
        rate = self.n / spent if spent > 0 else 0.0
        left = f", about {(self.total - self.n) / rate:.0f} s left" if rate > 0 and self.n < self.total else ""
        pct = 100 * self.n / self.total if self.total else 100.0
        return (f"{self.desc}: {self.n} of {self.total} {self.unit}s ({pct:.0f}%), {spent:.0f} s, "
                f"{rate:.3g} {self.unit}s/s{left}")

    def update(self, n: int = 1) -> None:

        self.n += n
        now = time.monotonic()
        if self.interval is not None and now - self._last >= self.interval:
            self._last, self._shown = now, self.n
            print(self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        """The last line (the total and the time it took) when lines are shown."""

        if self.interval is not None and self._shown != self.n:
            print(self.line(), file=sys.stderr, flush=True)
        self.interval = None


def elapsed(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f} s"
