"""Output file names (fp4convert.storage.names): shards, part records and their patterns agree."""

from __future__ import annotations

from fp4convert.storage import names


def test_shard_names_match_the_pattern() -> None:
    assert names.shard_names(1) == ["model.safetensors"]
    many = names.shard_names(3)
    assert many == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert all(names.SHARD_PATTERN.match(n) for n in many + names.shard_names(1))
    assert not names.SHARD_PATTERN.match("model-1-of-3.safetensors")


def test_part_records_are_recognised_and_distinct_from_the_run_record() -> None:
    recs = [names.part_record(k) for k in range(3)]
    assert len(set(recs)) == 3 and names.PROGRESS_NAME not in recs
    assert all(names.PART_RECORD.match(r) for r in recs) and not names.PART_RECORD.match(names.PROGRESS_NAME)
