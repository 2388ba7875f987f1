"""kill -9 at random moments, then --resume: the output is byte-identical to an uninterrupted run.

Runs are real processes (forked from one that imported fp4convert, see conftest.cli_procs), slowed
down by FP4CONVERT_TEST_DELAY so that a kill lands anywhere: while a shard is written, between a
shard's progress record and its rename, while the other files, the index or the manifest are written.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests import checkpoints as ck

SEED = int(os.environ.get("FP4CONVERT_CRASH_SEED", "1212"))  # other seeds: other kill moments (repeated runs)
KILLS = 12
DELAY = "0.01"
# The torch `cpu` backend quantizes these small models unit by unit, so a kill lands between many steps
# (records, renames); the default `cpu-native` takes a small model in one 64 MB batch, one step.
ARGS = ("--device", "cpu", "--backend", "cpu", "--max-shard-size", "6KB", "-q")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("src")
    ck.llama(p, zoo=True)
    return p


@pytest.fixture(scope="module")
def reference(src, cli_procs, tmp_path_factory) -> tuple[Path, float]:
    """An uninterrupted run (and how long a slowed-down run takes, to spread the kills over it)."""
    dst = tmp_path_factory.mktemp("ref") / "q"
    code, log = cli_procs.run("quantize", src, dst, *ARGS)
    assert code == 0, log
    t0 = time.monotonic()
    slow = tmp_path_factory.mktemp("slow") / "q"
    code, log = cli_procs.run("quantize", src, slow, *ARGS, env={"FP4CONVERT_TEST_DELAY": DELAY})
    assert code == 0, log
    return dst, time.monotonic() - t0


def test_kill_at_random_points_then_resume(src, reference, cli_procs, tmp_path) -> None:
    ref, slow_s = reference
    rng = random.Random(SEED)
    t_start = time.monotonic()
    before = ck.tree(src)
    moments = []
    for i in range(KILLS):
        dst = tmp_path / f"q{i}"
        at = rng.uniform(0, slow_s)
        pid, log = cli_procs.start("quantize", src, dst, "--resume", *ARGS, env={"FP4CONVERT_TEST_DELAY": DELAY})
        time.sleep(at)
        os.kill(pid, signal.SIGKILL)
        code = cli_procs.wait(pid)
        moments.append((round(at, 3), code))
        # A second kill in the resumed run, then a clean --resume must finish it.
        pid, log = cli_procs.start("quantize", src, dst, "--resume", *ARGS, env={"FP4CONVERT_TEST_DELAY": DELAY})
        time.sleep(rng.uniform(0, slow_s / 2))
        os.kill(pid, signal.SIGKILL)
        cli_procs.wait(pid)
        code, out = cli_procs.run("quantize", src, dst, "--resume", *ARGS)
        assert code == 0, (i, at, out)
        assert ck.all_files(dst) == ck.all_files(ref), (i, at)  # manifest included, no lock or .partial left
    assert ck.tree(src) == before
    print(f"seed {SEED}: killed at {moments} (seconds into a {slow_s:.2f} s run); {time.monotonic() - t_start:.1f} s")
    assert [c for _, c in moments].count(-9) >= KILLS // 2  # most kills landed mid-run


def test_overwrite_after_kill(src, reference, cli_procs, tmp_path) -> None:
    """A killed run's DST is ours: --overwrite replaces it (nothing refused, nothing foreign kept)."""
    ref, slow_s = reference
    dst = tmp_path / "q"
    pid, _ = cli_procs.start("quantize", src, dst, *ARGS, env={"FP4CONVERT_TEST_DELAY": DELAY})
    time.sleep(slow_s / 2)
    os.kill(pid, signal.SIGKILL)
    assert cli_procs.wait(pid) == -9
    assert (dst / ".fp4convert-progress.json").exists()
    code, out = cli_procs.run("quantize", src, dst, "--overwrite", *ARGS)
    assert code == 0, out
    assert ck.all_files(dst) == ck.all_files(ref)


def test_kill_at_every_step_then_resume(cli_procs, tmp_path) -> None:
    """SIGKILL at each step in turn (after every unit, between every shard's record and its rename, between
    the finishing writes): --resume always finishes, byte-identical."""
    src = tmp_path / "src"
    ck.llama(src, layers=1)
    args = ("--device", "cpu", "--max-shard-size", "4KB", "-q")
    ref = tmp_path / "ref"
    code, log = cli_procs.run("quantize", src, ref, *args)
    assert code == 0, log
    expected = ck.all_files(ref)
    step, killed = 0, 0
    while True:
        step += 1
        dst = tmp_path / f"q{step}"
        code, log = cli_procs.run("quantize", src, dst, *args, env={"FP4CONVERT_TEST_KILL_AT": str(step)})
        if code == 0:
            break  # the run has fewer steps than this: every step was covered
        assert code == -9, (step, log)
        killed += 1
        code, log = cli_procs.run("quantize", src, dst, "--resume", *args)
        assert code == 0, (step, log)
        assert ck.all_files(dst) == expected, step
    assert killed >= 20
    # A resume killed in its turn, at each of its first steps, after the first run was killed at one of its
    # last steps (finish: the copied files, the card, the manifest): a third run still finishes. A resumed
    # finish copies the source's README.md/config.json before rewriting them; a run killed between the two
    # left files the manifest's checksums disown, and both --resume and --overwrite refused the folder.
    for first in range(killed - 3, killed + 1):
        for second in range(1, 7):
            dst = tmp_path / f"r{first}-{second}"
            code, log = cli_procs.run("quantize", src, dst, *args, env={"FP4CONVERT_TEST_KILL_AT": str(first)})
            assert code == -9, (first, log)
            code, log = cli_procs.run("quantize", src, dst, "--resume", *args,
                                      env={"FP4CONVERT_TEST_KILL_AT": str(second)})
            assert code in (0, -9), (first, second, log)
            flag = "--resume" if second % 2 else "--overwrite"
            code, log = cli_procs.run("quantize", src, dst, flag, *args)
            assert code == 0, (first, second, flag, log)
            assert ck.all_files(dst) == expected, (first, second, flag)
    print(f"killed at each of {killed} steps, each resumed byte-identically")
