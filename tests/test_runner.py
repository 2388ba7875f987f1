"""The run loop (fp4convert.runner): parts partition the shards, every unit is told once, the source
folder is walked once per run."""

from __future__ import annotations

from fp4convert.config import ConvertConfig
from fp4convert.convert import convert, plan_conversion
from fp4convert.distributed import World
from fp4convert.runner import parts_of, teller

from . import checkpoints as ck


def test_one_process_is_one_part_with_the_run_record(tmp_path) -> None:
    ck.llama(tmp_path / "src")
    _, plan, _ = plan_conversion(str(tmp_path / "src"), ConvertConfig(max_shard_size=6000))
    (part,) = parts_of(plan, World(), 1)
    assert part.record == ".fp4convert-progress.json" and part.shards == {f for f, _ in plan.shards}
    parts = parts_of(plan, World(), 3)
    tells = teller(plan, parts)
    told = [tells(u) for u in plan.units()]
    shard_of = plan.shard_of()
    for unit, k in zip(plan.units(), told):  # the owner of its first output's shard tells it
        first = next((e.name for d in unit for e in d.outputs), None)
        assert first is None or shard_of[first] in parts[k].shards


def test_the_source_folder_is_walked_once_per_run(tmp_path, monkeypatch) -> None:
    from fp4convert.source import Source

    ck.llama(tmp_path / "src")
    walks = []
    real = Source.file_plan

    def counted(self, *a, **k):
        walks.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(Source, "file_plan", counted)
    convert(tmp_path / "src", tmp_path / "q", ConvertConfig(device="cpu", max_shard_size=6000))
    assert len(walks) == 1  # was three: the destination check, the space check and the finish


def test_shard_bytes_are_handed_to_the_disk_while_the_run_goes_on(tmp_path, monkeypatch) -> None:
    """Every shard's bytes are handed to the disk (sync_file_range) in contiguous ranges while it is
    written, so its fsync finds little left; the output bytes are unchanged."""
    import os

    from fp4convert.writer import shards

    if shards._sync_file_range() is None:
        import pytest

        pytest.skip("no sync_file_range here")
    ck.llama(tmp_path / "src", layers=3)
    convert(tmp_path / "src", tmp_path / "ref", ConvertConfig(device="cpu", max_shard_size=60000))
    seen: dict[int, list[tuple[int, int]]] = {}
    real = shards.start_writeback

    def record(fd: int, offset: int, n: int) -> None:
        st = os.fstat(fd)
        seen.setdefault(st.st_ino, []).append((offset, n))
        real(fd, offset, n)

    monkeypatch.setattr(shards, "WRITEBACK", 4096)
    monkeypatch.setattr(shards, "start_writeback", record)
    convert(tmp_path / "src", tmp_path / "q", ConvertConfig(device="cpu", max_shard_size=60000))
    assert ck.all_files(tmp_path / "q") == ck.all_files(tmp_path / "ref")
    by_file = {(tmp_path / "q" / f).stat().st_ino: (tmp_path / "q" / f).stat().st_size
               for f in os.listdir(tmp_path / "q") if f.endswith(".safetensors")}
    assert len(by_file) > 1 and set(seen) <= set(by_file)
    for ino, ranges in seen.items():
        assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # contiguous
        assert ranges[-1][0] + ranges[-1][1] <= by_file[ino]
    assert seen  # with 4 KB ranges every multi-KB shard is handed over while written
