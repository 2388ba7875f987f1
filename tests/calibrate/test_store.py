"""The GPTQ pass's store of quantized matrices (fp4convert.calibrate.store): blocks held in memory within
its budget, written to disk past it, and written on :meth:`Store.persist` so ``--resume`` can read them."""

from __future__ import annotations

import torch

from fp4convert.calibrate.store import Store


def _block(i: int, n: int = 2):
    g = torch.Generator().manual_seed(i)
    return [(f"layers.{i}.m{j}", torch.randint(0, 256, (8, 16), dtype=torch.uint8, generator=g),
             torch.randint(0, 256, (8, 2), dtype=torch.uint8, generator=g), None, torch.rand(1, generator=g))
            for j in range(n)]


def _same(store: Store, blocks) -> None:
    for block in blocks:
        for module, packed, scale, _gs, amax in block:
            p, s, a = store.get(module)
            assert torch.equal(p, packed) and torch.equal(s, scale) and a == float(amax[0])


def test_blocks_past_the_memory_budget_go_to_disk_and_all_read_back(tmp_path):
    blocks = [_block(i) for i in range(3)]
    size = sum(p.numel() + s.numel() + 4 for _, p, s, _, _ in blocks[0])
    store = Store.create(tmp_path / "s", memory=size)  # room for one block
    for i, b in enumerate(blocks):
        store.add_block(i, b)
    store.wait()
    assert store.held == 1
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["block-00001.safetensors", "block-00002.safetensors"]
    _same(store, blocks)
    store.finish()
    assert Store.load(tmp_path / "s") is None  # a block only in memory: not complete on disk


def test_persist_writes_the_held_blocks_and_load_reads_them(tmp_path):
    blocks = [_block(i) for i in range(2)]
    store = Store.create(tmp_path / "s", memory=1 << 20)
    for i, b in enumerate(blocks):
        store.add_block(i, b)
    store.finish()
    assert store.held == 2 and not any((tmp_path / "s").iterdir())
    store.persist()
    assert store.held == 0
    again = Store.load(tmp_path / "s")
    assert again is not None and again.index == store.index
    _same(again, blocks)
    store.remove()
    assert not (tmp_path / "s").exists()


def test_without_memory_every_block_is_a_file_and_the_store_is_complete(tmp_path):
    blocks = [_block(i) for i in range(2)]
    store = Store.create(tmp_path / "s")
    for i, b in enumerate(blocks):
        store.add_block(i, b)
    store.finish()
    loaded = Store.load(tmp_path / "s")
    assert store.held == 0 and loaded is not None
    _same(loaded, blocks)
