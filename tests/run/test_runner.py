"""The run loop (fp4convert.run.runner): parts partition the shards, every unit is told once, the source
folder is walked once per run."""

from __future__ import annotations

from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.run.distributed import World
from fp4convert.run.runner import parts_of, teller

from tests import checkpoints as ck


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
    from fp4convert.source.source import Source

    ck.llama(tmp_path / "src")
    walks = []
    real = Source.file_plan

    def counted(self, *a, **k):
        walks.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(Source, "file_plan", counted)
    convert(tmp_path / "src", tmp_path / "q", ConvertConfig(device="cpu", max_shard_size=6000))
    assert len(walks) == 1  # was three: the destination check, the space check and the finish


def test_shard_chunks_are_handed_to_the_disk_and_hashed_while_the_run_goes_on(tmp_path, monkeypatch) -> None:
    """Every complete 16 MiB chunk of a shard is handed to the disk (sync_file_range) and hashed while
    the run goes on, each chunk once, together the whole file, before the shard's rename; the output
    bytes are unchanged."""
    import os

    import pytest

    from fp4convert.storage import checksum
    from fp4convert.output import shards

    if shards._sync_file_range() is None:
        pytest.skip("no sync_file_range here")
    ck.wide_vocab(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "ref", ConvertConfig(device="cpu"))
    handed: list[tuple[int, int]] = []
    hashed: list[int] = []
    real_wb, real_digest = shards.start_writeback, checksum.chunk_digest

    def writeback(fd: int, offset: int, n: int) -> None:
        assert os.fstat(fd).st_nlink == 1 and (tmp_path / "q" / "model.safetensors.partial").exists()  # not renamed
        handed.append((offset, n))
        real_wb(fd, offset, n)

    def digest(fd: int, i: int, size: int) -> bytes:
        hashed.append(i)
        return real_digest(fd, i, size)

    monkeypatch.setattr(shards, "start_writeback", writeback)
    monkeypatch.setattr(checksum, "chunk_digest", digest)
    convert(tmp_path / "src", tmp_path / "q", ConvertConfig(device="cpu"))
    assert ck.all_files(tmp_path / "q") == ck.all_files(tmp_path / "ref")
    size = (tmp_path / "q" / "model.safetensors").stat().st_size
    n = checksum.chunk_count(size)
    assert n >= 3
    assert sorted(handed) == [checksum.chunk_span(i, size) for i in range(n)]  # each chunk once, all of the file
    assert sorted(hashed) == list(range(n))
