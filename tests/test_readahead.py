"""Read-ahead: tensors arrive in unit order with the right values, and reader errors reach the caller."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp4convert.readahead import ReadAhead
from fp4convert.errors import CheckpointFormatError
from fp4convert.safetensors_io import read_header


def test_units_arrive_in_order_with_their_values(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.randn(3, 8).to(torch.bfloat16) for i in range(7)}
    save_file(tensors, tmp_path / "a.safetensors")
    infos = {i.name: i for i in read_header(tmp_path / "a.safetensors")[0]}
    units = [[infos["t0"], infos["t1"]], [infos["t2"]], [infos["t3"], infos["t4"], infos["t5"]], [infos["t6"]]]
    ra = ReadAhead(units, lambda f: tmp_path / f, pinned=False)
    try:
        for unit in units:
            got = ra.next()
            assert [torch.equal(g, tensors[i.name]) for g, i in zip(got, unit)] == [True] * len(unit)
            ra.release()
    finally:
        ra.close()


def test_reader_errors_are_raised_by_next(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4, 4)}, tmp_path / "a.safetensors")
    (info,) = read_header(tmp_path / "a.safetensors")[0]
    with open(tmp_path / "a.safetensors", "r+b") as f:
        f.truncate(info.begin + 8)  # the data is cut short after planning
    ra = ReadAhead([[info]], lambda f: tmp_path / f, pinned=False)
    try:
        with pytest.raises(CheckpointFormatError, match="truncated"):
            ra.next()
    finally:
        ra.close()
