"""Progress of a calibration a person can plan with: per step (the blocks, sample generation), units done of the
total, the calibration tokens per second and the time left. A tqdm bar on a terminal; elsewhere a line every
``FP4CONVERT_PROGRESS_INTERVAL`` seconds, sent as a log record of this module's logger carrying the same figures
as data (``record.progress``: the CLI prints it as text, or as one JSON object a line under ``--json``)."""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger(__name__)  # its level decides: a bar or lines at INFO, nothing under --quiet

PROGRESS_ENV = "FP4CONVERT_PROGRESS_INTERVAL"  # the run's own progress setting (run/progress.py): seconds between lines


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "block", tokens_per_unit: int = 0):
    """The calibration's progress (``total`` units of ``unit``; ``tokens_per_unit`` calibration tokens each, for
    the rate): a tqdm bar on a terminal (hidden by ``--quiet``), a line every ``FP4CONVERT_PROGRESS_INTERVAL``
    seconds (10) on a log or a pipe where the run shows its status lines or its JSON (the CLI without
    ``--quiet``), a silent stand-in elsewhere. ``update(n)`` counts ``n`` units."""
    if enabled and sys.stderr.isatty() and log.isEnabledFor(logging.WARNING):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm comes with transformers
            pass
        else:
            return Bar(tqdm(total=total, desc=desc, unit=unit, unit_scale=unit != "block", leave=False,
                            file=sys.stderr), tokens_per_unit)
    if enabled and not sys.stderr.isatty() and log.isEnabledFor(logging.INFO):
        try:
            interval = max(float(os.environ.get(PROGRESS_ENV, "10")), 0.0)
        except ValueError:
            interval = 10.0
        return LineProgress(total, desc, unit, interval, tokens_per_unit)
    return LineProgress(total, desc, unit, None, tokens_per_unit)


class LineProgress:
    """Progress for logs and pipes: ``desc: done of total units (pct), elapsed, rate, tokens/s, time left``,
    logged on an update once ``interval`` seconds passed since the last line, and at the end (None: never);
    :meth:`figures` is the same as data."""

    def __init__(self, total: int, desc: str, unit: str, interval: float | None, tokens_per_unit: int = 0) -> None:
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.tokens_per_unit = tokens_per_unit
        self.n = self._shown = 0
        self._t0 = self._last = time.monotonic()

    def figures(self) -> dict:
        """Where the step stands: units done of the total, seconds spent, tokens per second, seconds left."""
        spent = time.monotonic() - self._t0
        rate = self.n / spent if spent > 0 else 0.0
        left = (self.total - self.n) / rate if rate > 0 and self.n < self.total else (0.0 if self.n >= self.total else None)
        return {"step": self.desc, "done": self.n, "total": self.total, "unit": self.unit, "elapsed_s": round(spent, 1),
                "tokens_per_s": round(rate * self.tokens_per_unit) if self.tokens_per_unit else None,
                "eta_s": None if left is None else round(left, 1)}

    def line(self) -> str:
        f = self.figures()
        spent = time.monotonic() - self._t0
        pct = 100 * self.n / self.total if self.total else 100.0
        rate = f"{self.n / spent:.3g} {self.unit}s/s" if spent > 0 else "-"
        tokens = f", {f['tokens_per_s']:,} tokens/s" if f["tokens_per_s"] and self.unit != "token" else ""
        left = f", about {_duration(f['eta_s'])} left" if f["eta_s"] is not None and self.n < self.total else ""
        return f"{self.desc}: {self.n} of {self.total} {self.unit}s ({pct:.0f}%), {_duration(f['elapsed_s'])}, {rate}{tokens}{left}"

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.interval is not None and now - self._last >= self.interval:
            self._last, self._shown = now, self.n
            self._emit()

    def close(self) -> None:
        """The last line (the total and the time it took) when lines are shown."""
        if self.interval is not None and self._shown != self.n:
            self._emit()
        self.interval = None

    def _emit(self) -> None:
        log.info(self.line(), extra={"progress": self.figures()})


class Bar:
    """A tqdm bar whose postfix carries the calibration tokens per second (tqdm shows the time left)."""

    def __init__(self, bar, tokens_per_unit: int) -> None:
        self.bar, self.tokens_per_unit = bar, tokens_per_unit
        self._t0 = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        spent = time.monotonic() - self._t0
        if self.tokens_per_unit and spent > 0:
            self.bar.set_postfix_str(f"{self.bar.n * self.tokens_per_unit / spent:,.0f} tokens/s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def elapsed(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f} s"
