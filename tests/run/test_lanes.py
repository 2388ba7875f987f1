"""Lanes (output shards written side by side in one process) on the CPU: the bytes of one lane, progress
counted once, a failing lane fails the run cleanly, and --resume with another lane count finishes it.
(The GPU tests run the torch-free path with lanes: tests/quantizer/test_backend_cuda.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import fp4convert.run.work as work
from fp4convert.quantizer.backends.cuda import CudaBackend
from fp4convert.cli.main import main
from fp4convert.config import ConvertConfig
from fp4convert.quantizer.choice import lane_count
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.run.distributed import World
from fp4convert.errors import ConfigError
from fp4convert.storage.names import LOCK_NAME
from fp4convert.run.runner import parts_of

AUTO_LANES = CudaBackend.auto_lanes

from tests import checkpoints as ck

SHARD = 6000  # small output shards: many for the 3-layer Llama, so every lane has several


def cfg(**kw) -> ConvertConfig:
    return ConvertConfig(device="cpu", max_shard_size=SHARD, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("lanes") / "llama"
    ck.llama(src, layers=3, zoo=True)
    return src


@pytest.fixture(scope="module")
def one_lane(llama, tmp_path_factory) -> tuple[dict[str, bytes], list[int]]:
    dst = tmp_path_factory.mktemp("one") / "q"
    with pytest.MonkeyPatch.context() as mp:
        seen = ck.progress_seen(mp)
        res = convert(llama, dst, cfg(lanes=1))
    assert res.counts["lanes"] == 1
    return ck.all_files(dst), seen


@pytest.mark.parametrize("lanes,scheme", [(2, "nvfp4"), (3, "mxfp4"), (7, "nvfp4")])
def test_lanes_write_the_bytes_of_one_lane(llama, one_lane, tmp_path, lanes, scheme) -> None:
    ref = one_lane[0] if scheme == "nvfp4" else None
    if ref is None:
        convert(llama, tmp_path / "one", cfg(lanes=1, scheme=scheme))
        ref = ck.all_files(tmp_path / "one")
    res = convert(llama, tmp_path / "many", cfg(lanes=lanes, scheme=scheme))
    assert res.counts["lanes"] == lanes
    files = ck.all_files(tmp_path / "many")
    assert len([f for f in files if f.endswith(".safetensors")]) > lanes  # every lane wrote shards
    assert files == ref  # shards, index, manifest and the merged progress record: no lane's record left


def test_progress_tells_every_unit_once(llama, one_lane, tmp_path, monkeypatch) -> None:
    seen = ck.progress_seen(monkeypatch)
    convert(llama, tmp_path / "q", cfg(lanes=3))
    assert sorted(seen) == sorted(one_lane[1])  # one call per unit, whichever lane wrote it


def test_lane_shards_partition_the_output(llama) -> None:
    _, plan, _ = plan_conversion(str(llama), cfg())
    shards = {f for f, _ in plan.shards}
    for n in (2, 3, len(shards)):
        parts = [set(p.shards) for p in parts_of(plan, World(), n)]
        assert set().union(*parts) == shards and sum(map(len, parts)) == len(shards)
        assert all(parts)
    # torchrun ranks x lanes: every rank's lanes together, over the ranks, are every shard once
    ranks = [parts_of(plan, World(r, 2, r, 2), 2) for r in range(2)]
    every = [set(p.shards) for rank in ranks for p in rank]
    assert set().union(*every) == shards and sum(map(len, every)) == len(shards)
    assert sorted(p.index for rank in ranks for p in rank) == [0, 1, 2, 3]


def test_lane_count(llama) -> None:
    source, plan, _ = plan_conversion(str(llama), cfg())
    assert lane_count(cfg(), World(), plan, source, auto=1) == 1  # the CPU: one unless asked
    assert lane_count(cfg(), World(), plan, source, auto=AUTO_LANES) == AUTO_LANES
    assert lane_count(cfg(lanes=4), World(), plan, source, auto=1) == 4
    assert lane_count(cfg(lanes=10**6), World(), plan, source, auto=AUTO_LANES) == len(plan.shards)
    assert lane_count(cfg(lanes=4), World(0, 2, 0, 2), plan, source, auto=AUTO_LANES) == 1  # torchrun: ranks instead


def test_bad_lane_counts_refused(llama, tmp_path) -> None:
    with pytest.raises(ConfigError, match="--lanes"):
        ConvertConfig(lanes=-1)
    r = CliRunner().invoke(main, ["quantize", str(llama), str(tmp_path / "q"), "--lanes", "-1"])
    assert r.exit_code == 2 and "--lanes" in r.output
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("resume_lanes", [1, 2])
def test_a_failing_lane_fails_the_run_and_resume_finishes_it(llama, one_lane, tmp_path, monkeypatch,
                                                              resume_lanes) -> None:
    """One lane fails after another finished a shard: the run raises that lane's error, leaves no
    manifest, no .partial and no lock; --resume (one lane, or another lane count) reuses the finished
    shards and writes the bytes of an uninterrupted one-lane run, no lane's progress record left."""
    dst = tmp_path / "q"
    bad = "model.layers.2.mlp.down_proj.weight"
    real = work.quantize

    def flaky(item, *a, **kw):
        if any(d.name == bad for d in item.members):
            deadline = time.monotonic() + 30
            while not list(dst.glob("*.safetensors")) and time.monotonic() < deadline:
                time.sleep(0.01)  # another lane finishes a shard first
            raise RuntimeError("simulated failure in one lane")
        return real(item, *a, **kw)

    monkeypatch.setattr(work, "quantize", flaky)
    with pytest.raises(RuntimeError, match="simulated failure in one lane"):
        convert(llama, dst, cfg(lanes=3))
    left = {p.name for p in dst.iterdir()}
    assert any(n.endswith(".safetensors") for n in left)  # finished shards stay for --resume
    assert not any(n.endswith(".partial") or n == LOCK_NAME for n in left), left
    assert "fp4convert.json" not in left and "model.safetensors.index.json" not in left
    monkeypatch.setattr(work, "quantize", real)
    assert any(".rank" in n for n in left)  # the lanes' own progress records, for --resume
    res = convert(llama, dst, cfg(lanes=resume_lanes, resume=True))
    assert res.reused_files
    assert ck.all_files(dst) == one_lane[0]  # every file, hidden ones included


def test_plan_warnings_are_logged_once(llama, tmp_path, caplog) -> None:
    with caplog.at_level("WARNING"):
        convert(llama, tmp_path / "q", cfg(lanes=3, ignore=("nomatch*",)))
    assert sum("nomatch*" in r.getMessage() for r in caplog.records) == 1


def test_kept_nan_warned_once_with_lanes(tmp_path) -> None:
    src = tmp_path / "nan"
    bad = ck.nan_checkpoint(src)
    runs = [convert(src, tmp_path / f"q{n}", cfg(lanes=n, ignore=("*.down_proj",))) for n in (1, 2)]
    for res in runs:
        assert [w for w in res.to_json()["warnings"] if "NaN" in w and bad in w] == [
            f"{bad} (kept unquantized, in model.safetensors) holds NaN or Inf values; they were copied unchanged"]
    assert ck.all_files(tmp_path / "q1") == ck.all_files(tmp_path / "q2")
