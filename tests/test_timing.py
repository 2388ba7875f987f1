"""Stage timing: totals per stage, summed over threads, reset per run; every run's --json reports them."""

from __future__ import annotations

import json
import threading
import time

from click.testing import CliRunner

from fp4convert import timing
from fp4convert.cli.main import main

from . import checkpoints as ck


def test_totals_sum_over_threads_and_reset() -> None:
    timing.reset()

    def work() -> None:
        with timing.timed("x"):
            time.sleep(0.05)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    timing.add("y", 0.25)
    snap = timing.snapshot()
    assert list(snap) == ["x", "y"] and snap["y"] == 0.25
    assert 0.2 <= snap["x"] < 1.0  # four threads' 50 ms each, not the 50 ms of wall time
    timing.reset()
    assert timing.snapshot() == {}


def test_json_summary_says_where_the_time_went(tmp_path) -> None:
    src = tmp_path / "src"
    ck.llama(src, zoo=True)
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q"), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["stages_s"]
    for stage in ("startup", "read", "quantize", "writer_busy", "write", "hash", "fsync", "copy_kept", "finish"):
        assert stage in s and s[stage] >= 0, (stage, s)
    assert s["writer_busy"] >= s["copy_kept"]  # kept copies run inside the writer thread's jobs


def test_counts_and_process_age() -> None:
    timing.reset()
    timing.count("pinned_MB", 64)
    timing.count("pinned_MB", 0.0625)
    assert timing.counts() == {"pinned_MB": 64.062} and timing.snapshot() == {}
    timing.reset()
    assert timing.counts() == {}
    age = timing.process_age()
    assert age is None or 0 < age < time.monotonic() + 1  # /proc where there is one


def test_json_says_what_ran_outside_convert(tmp_path) -> None:
    """A real process (the ages come from /proc): CLI start <= convert start <= summary."""
    import subprocess
    import sys

    src = tmp_path / "src"
    ck.llama(src, zoo=True)
    r = subprocess.run([sys.executable, "-m", "fp4convert", "quantize", str(src), str(tmp_path / "q"), "--device",
                        "cpu", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    ages = s["process_s"]
    assert 0 <= ages["cli_start"] <= ages["convert_start"] <= ages["summary"]
    assert ages["summary"] - ages["convert_start"] >= s["wall_s"] - 0.02  # /proc ticks: 10 ms
    assert "counts" in s
