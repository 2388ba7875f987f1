"""Read-ahead: items arrive in order with the right bytes, each buffer set is refilled only after its
own item was released (in whatever order items are released), and reader errors reach the caller."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from fp4convert.errors import CheckpointFormatError
from fp4convert.quantizer.matrices import TensorBuffer, tensors
from fp4convert.run.readahead import ReadAhead
from fp4convert.storage.reads import read_header


def _plain(n: int) -> TensorBuffer:
    return TensorBuffer(n, pinned=False)


def test_units_arrive_in_order_with_their_values(tmp_path: Path) -> None:
    values = {f"t{i}": torch.randn(3, 8).to(torch.bfloat16) for i in range(7)}
    save_file(values, tmp_path / "a.safetensors")
    infos = {i.name: i for i in read_header(tmp_path / "a.safetensors")[0]}
    units = [[infos["t0"], infos["t1"]], [infos["t2"]], [infos["t3"], infos["t4"], infos["t5"]], [infos["t6"]]]
    ra = ReadAhead(units, lambda f: tmp_path / f, _plain)
    try:
        for unit in units:
            inputs, number = ra.next()
            got = tensors(inputs)
            assert [torch.equal(g, values[i.name]) for g, i in zip(got, unit)] == [True] * len(unit)
            ra.release(number)
    finally:
        ra.close()


def test_a_set_is_refilled_only_after_its_own_item_is_released(tmp_path: Path) -> None:
    """Items released out of order (a CPU pool may finish item 1 before item 0): the reader must not
    refill item 0's buffer set for item 2 until item 0 itself is released (it once refilled the set of
    the oldest item still in work, corrupting its inputs)."""
    import time

    values = {f"t{i}": torch.full((64, 16), float(i)).to(torch.bfloat16) for i in range(4)}
    save_file(values, tmp_path / "a.safetensors")
    infos = {i.name: i for i in read_header(tmp_path / "a.safetensors")[0]}
    units = [[infos[f"t{i}"]] for i in range(4)]
    ra = ReadAhead(units, lambda f: tmp_path / f, _plain)
    try:
        (in0, n0), (_, n1) = ra.next(), ra.next()
        ra.release(n1)  # item 1 first: its set may take item 3, but item 2 goes into item 0's set
        time.sleep(0.5)  # the reader had time to (wrongly) refill item 0's set
        assert torch.equal(tensors(in0)[0], values["t0"])
        ra.release(n0)
        (in2, n2) = ra.next()
        assert torch.equal(tensors(in2)[0], values["t2"])
        ra.release(n2)
        ra.release(n2)  # a second release of the same item changes nothing
        ra.release(n0)  # nor does a late one of an item whose set now holds another
        (in3, n3) = ra.next()
        assert torch.equal(tensors(in3)[0], values["t3"])
        ra.release(n3)
    finally:
        ra.close()


def test_reader_errors_are_raised_by_next(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(4, 4)}, tmp_path / "a.safetensors")
    (info,) = read_header(tmp_path / "a.safetensors")[0]
    with open(tmp_path / "a.safetensors", "r+b") as f:
        f.truncate(info.begin + 8)  # the data is cut short after planning
    ra = ReadAhead([[info]], lambda f: tmp_path / f, _plain)
    try:
        with pytest.raises(CheckpointFormatError, match="truncated"):
            ra.next()
    finally:
        ra.close()


class _FakeHost:
    """A host buffer like fp4convert.kernels.cuda.runtime.HostBuffer, on a bytearray (the torch-free reader path)."""

    def __init__(self, n: int) -> None:
        self.size = n
        self.data = bytearray(n)

    def view(self, offset: int = 0, n: int | None = None) -> memoryview:
        return memoryview(self.data)[offset : self.size if n is None else offset + n]


def test_host_buffer_path_lays_shape_groups_out_back_to_back(tmp_path: Path) -> None:
    """The torch-free path's reader: one buffer per set, sized once for the largest batch; each shape
    group's members back to back (one [B, M, K] launch) from a 256-byte aligned start; bytes exact;
    adjacent tensors (one scattered read) and tensors from two files in one batch."""
    seed = int(torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(seed)
    a = {f"a{i}": torch.randn(5, 24, generator=g).to(torch.bfloat16) for i in range(5)}
    b = {"b0": torch.randn(7, 16, generator=g), "b1": torch.randn(3, 16, generator=g).to(torch.float16)}
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    infos = {i.name: i for f in ("a", "b") for i in read_header(tmp_path / f"{f}.safetensors")[0]}
    units = [[infos["a0"], infos["a1"], infos["b0"], infos["a2"]], [infos["a3"], infos["a4"], infos["b1"]]]
    allocs: list[int] = []

    def host(n: int) -> _FakeHost:
        allocs.append(n)
        return _FakeHost(n)

    ra = ReadAhead(units, lambda f: tmp_path / f, host)
    try:
        for unit in units:
            (buf, items), number = ra.next()
            assert [i.name for _, i in items] == [i.name for i in unit]
            starts: dict[tuple, list[tuple[int, int]]] = {}
            for off, info in items:
                want = {**a, **b}[info.name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                assert bytes(buf.view(off, info.nbytes)) == want, (info.name, seed)
                starts.setdefault((info.dtype, info.shape), []).append((off, info.nbytes))
            for group in starts.values():
                assert group[0][0] % 256 == 0
                for (o0, n0), (o1, _) in zip(group, group[1:]):
                    assert o1 == o0 + n0  # back to back: the group is one contiguous [B, M, K] array
            ra.release(number)
    finally:
        ra.close()
    # a0..a2 (3 x 240 B) from 0, b0 (448 B) from 768: 1,216 B -> 1,280; the second batch is smaller.
    assert allocs == [1280, 1280]  # one buffer per set, for the largest batch


def test_read_many_scatters_adjacent_tensors_and_survives_short_reads(tmp_path: Path, monkeypatch) -> None:
    """Adjacent tensors are one preadv; a kernel that returns fewer bytes than asked (as it may) is
    read on from where it stopped, across buffer boundaries; a file cut short names the tensor cut."""
    import os

    from fp4convert.storage import reads as sio

    t = {f"t{i}": torch.arange(i * 50, i * 50 + 40 + i, dtype=torch.int32) for i in range(6)}
    save_file(t, tmp_path / "a.safetensors")
    infos = sorted(read_header(tmp_path / "a.safetensors")[0], key=lambda i: i.begin)
    real, calls = os.preadv, []

    def stingy(fd, views, offset):  # at most 37 bytes per call
        calls.append(len(views))
        first = views[0][: min(37, len(views[0]))]
        return real(fd, [first], offset)

    monkeypatch.setattr(os, "preadv", stingy)
    bufs = [bytearray(i.nbytes) for i in infos]
    sio.read_many([(tmp_path / "a.safetensors", i, memoryview(b)) for i, b in zip(infos, bufs)])
    for i, b in zip(infos, bufs):
        assert bytes(b) == t[i.name].numpy().tobytes()
    assert calls[0] == len(infos)  # all six in the first call: one run
    monkeypatch.setattr(os, "preadv", real)
    with open(tmp_path / "a.safetensors", "r+b") as f:
        f.truncate(infos[3].begin + 5)
    with pytest.raises(CheckpointFormatError, match=f"tensor '{infos[3].name}' is truncated"):
        sio.read_many([(tmp_path / "a.safetensors", i, memoryview(bytearray(i.nbytes))) for i in infos])


def test_parallel_read_splits_bytes_over_threads_exactly(tmp_path: Path, monkeypatch) -> None:
    """read_many(threads=N): tensors from two files, some cut across threads at page boundaries,
    land byte-exact whatever the order asked; a truncated file still names its tensor."""
    from fp4convert.storage import reads as sio

    monkeypatch.setattr(sio, "SPLIT_MIN", 4096)  # so these few hundred KB are split four ways
    seed = int(torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(seed)
    t = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([3, 40_000, 1, 25_000, 7_777, 0, 60_000])}
    u = {f"u{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate([50_001, 9, 30_000])}
    save_file(t, tmp_path / "a.safetensors")
    save_file(u, tmp_path / "b.safetensors")
    infos = [(tmp_path / f"{f}.safetensors", i) for f in ("a", "b") for i in read_header(tmp_path / f"{f}.safetensors")[0]]
    order = torch.randperm(len(infos), generator=g).tolist()
    pieces = sio._split([(p, i, i.begin, memoryview(bytearray(i.nbytes))) for p, i in infos if i.nbytes], 100_000)
    assert len(pieces) >= 4 and any(  # a tensor is cut between parts, at a page boundary of its file
        a[-1][1].name == b[0][1].name and b[0][2] % 4096 == 0 for a, b in zip(pieces, pieces[1:])), seed
    for threads in (1, 4):
        bufs = {i.name: bytearray(i.nbytes) for _, i in infos}
        sio.read_many([(infos[k][0], infos[k][1], memoryview(bufs[infos[k][1].name])) for k in order], threads)
        for name, want in {**t, **u}.items():
            assert bytes(bufs[name]) == want.view(torch.uint8).numpy().tobytes(), (name, threads, seed)
    with open(tmp_path / "b.safetensors", "r+b") as f:
        last = max((i for p, i in infos if p.name == "b.safetensors"), key=lambda i: i.begin)
        f.truncate(last.begin + 10)
    with pytest.raises(CheckpointFormatError, match=f"tensor '{last.name}' is truncated"):
        sio.read_many([(p, i, memoryview(bytearray(i.nbytes))) for p, i in infos], 4)
