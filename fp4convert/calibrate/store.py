"""Quantized matrices made while calibrating (GPTQ), kept on disk until the quantize stage writes them.

One safetensors file per block (``block-00012.safetensors``): for each matrix ``M`` (the plan's module
name), ``M.packed`` (uint8 E2M1 codes [N, K/2]), ``M.scale`` (uint8 block scales [N, K/bs], linear
layout: E4M3 or E8M0 bytes) and, for NVFP4, ``M.amax`` (fp32 [1], the fused group's amax its global
scale 2688 / amax comes from). ``index.json`` lists every matrix's file once the pass is complete: a
store without it is an interrupted one, never read.

Blocks stay in memory while they fit a budget (:func:`memory_budget`: a quarter of the free memory, at
most MEMORY_MAX), and go to disk past it: a large model's codes would otherwise stay resident until
written (4.5 GB for 8B parameters), while writing and reading back a small one costs more than the GPTQ
pass itself where files are slow (on the H200 host, 1 GB of block files held a pass of 8 Llama-3-8B
layers up by 5.4 s). A conversion interrupted after the pass (Ctrl-C, an error while writing) writes
the blocks held in memory to disk (:meth:`Store.persist`), so ``--resume`` does not run GPTQ again; a
killed process loses them, and ``--resume`` then runs the pass again.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.quantizer.backend import MatrixOut, Pending, Result

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import torch

INDEX = "index.json"
PARTIAL = "partial.json"  # the blocks an interrupted pass finished (its checkpoint's)
MEMORY_MAX = 16 << 30  # block files held in memory at most (bytes)
MEMORY_SHARE = 0.25  # ... and at most this share of the host's free memory


def memory_budget() -> int:
    """Bytes of quantized blocks a store holds in memory before it writes them to disk."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0
    return int(min(MEMORY_MAX, free * MEMORY_SHARE))


class Store:
    """A folder of quantized matrices, by module name."""

    def __init__(self, root: Path, index: dict[str, str] | None = None, memory: int = 0,
                 changed: dict[str, str] | None = None, changed_by: dict[str, str] | None = None) -> None:
        self.root = Path(root)
        self.index: dict[str, str] = dict(index or {})  # module -> file name
        self.changed: dict[str, str] = dict(changed or {})  # unquantized tensor the pass changed (smoothing) -> file
        self.changed_by: dict[str, str] = dict(changed_by or {})  # ... -> what changed it (the manifest's words)
        self.memory = memory  # bytes of blocks held in memory at most (the rest is written to disk)
        self._held: dict[str, dict[str, torch.Tensor]] = {}  # file name -> the tensors of a block not on disk
        self._held_bytes = 0
        self._open: dict[str, object] = {}
        self._lock = threading.Lock()
        self._writer: ThreadPoolExecutor | None = None  # writes block files while the next block runs
        self._writing: list = []

    @classmethod
    def create(cls, root: Path, memory: int = 0) -> Store:
        """An empty store in ``root`` holding up to ``memory`` bytes of blocks in memory (whatever an
        interrupted pass left there is removed)."""
        root = Path(root)
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        return cls(root, memory=memory)

    @classmethod
    def resume(cls, root: Path, memory: int = 0) -> Store:
        """The store an interrupted pass left in ``root`` (the blocks its last checkpoint flushed,
        :meth:`persist_partial`), to add the rest to; an empty one when there is none."""
        root = Path(root)
        try:
            record = json.loads((root / PARTIAL).read_text())
            index, changed, by = record["matrices"], record.get("changed", {}), record.get("changed_by", {})
            if all((root / f).is_file() for f in {*index.values(), *changed.values()}):
                return cls(root, index, memory=memory, changed=changed, changed_by=by)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return cls.create(root, memory=memory)

    def persist_partial(self) -> None:
        """Every block added so far on disk, and listed (``partial.json``): what :meth:`resume` continues from
        after an interruption."""
        self.wait()
        for name, tensors in list(self._held.items()):
            self._save(name, tensors)
            del self._held[name]
        self._held_bytes = 0
        tmp = self.root / (PARTIAL + ".partial")
        tmp.write_text(json.dumps({"matrices": self.index, "changed": self.changed, "changed_by": self.changed_by},
                                  sort_keys=True))
        os.replace(tmp, self.root / PARTIAL)

    @classmethod
    def load(cls, root: Path) -> Store | None:
        """The complete store in ``root``, or None (missing, or interrupted before its index)."""
        try:
            record = json.loads((Path(root) / INDEX).read_text())
            index, changed, by = record["matrices"], record.get("changed", {}), record.get("changed_by", {})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if not isinstance(index, dict) or not isinstance(changed, dict) or not isinstance(by, dict) or \
                not all((Path(root) / f).is_file() for f in {*index.values(), *changed.values()}):
            return None
        return cls(Path(root), index, changed=changed, changed_by=by)

    def add_block(self, index: int, matrices: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                            torch.Tensor | None]],
                  changed: dict[str, torch.Tensor] | None = None, why: str = "", part: int = 0) -> None:
        """Keep one block's matrices: (module, packed, scale, gs or None, amax or None) each, and the
        unquantized tensors the pass changed (checkpoint name -> the tensor to write, in its output dtype; ``why``:
        what changed them, in the manifest's words). The bytes
        come to the host now; they stay in memory while the budget allows, else the file is written on a
        thread while the next block runs (:meth:`finish` waits for it, and raises its error)."""
        import torch

        if not matrices and not changed:
            return
        name = f"block-{index:05d}{f'-{part:04d}' if part else ''}.safetensors"  # (part: a block's expert group)
        tensors: dict[str, torch.Tensor] = {}
        for key, t in (changed or {}).items():
            tensors[f"{key}.changed"] = t.contiguous().cpu()
            self.changed[key] = name
            self.changed_by[key] = why
        for module, packed, scale, _gs, amax in matrices:
            tensors[f"{module}.packed"] = packed.contiguous().cpu()
            tensors[f"{module}.scale"] = scale.contiguous().view(torch.uint8).cpu()
            if amax is not None:
                tensors[f"{module}.amax"] = amax.reshape(1).float().cpu().clone()
        for module, *_ in matrices:
            self.index[module] = name
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._held_bytes + size <= self.memory:
            self._held[name] = tensors
            self._held_bytes += size
            return
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(1, thread_name_prefix="fp4convert-gptq-store")
        self._writing.append(self._writer.submit(self._save, name, tensors))

    def _save(self, name: str, tensors: dict) -> None:
        from safetensors.torch import save_file

        tmp = self.root / (name + ".partial")
        save_file(tensors, str(tmp))
        os.replace(tmp, self.root / name)

    def wait(self) -> None:
        """Every block file written (the first write error raised)."""
        pending, self._writing = self._writing, []
        try:
            for f in pending:
                f.result()
        finally:
            if self._writer is not None and not self._writing:
                self._writer.shutdown(wait=True)
                self._writer = None

    def finish(self) -> None:
        """Mark the pass complete (the index is what :meth:`load` reads), once every block file is written
        (a store still holding blocks in memory is not complete on disk: :meth:`persist` makes it so)."""
        self.wait()
        if self._held:
            return
        tmp = self.root / (INDEX + ".partial")
        tmp.write_text(json.dumps({"matrices": self.index, "changed": self.changed, "changed_by": self.changed_by},
                                  sort_keys=True))
        os.replace(tmp, self.root / INDEX)

    @property
    def held(self) -> int:
        """Blocks held in memory (not on disk)."""
        return len(self._held)

    def persist(self) -> None:
        """Write the blocks held in memory to disk and mark the store complete, so ``--resume`` after an
        interrupted conversion reads it instead of running the pass again."""
        self.wait()
        for name, tensors in list(self._held.items()):
            self._save(name, tensors)
            del self._held[name]
        self._held_bytes = 0
        self.finish()

    def __contains__(self, module: object) -> bool:
        return module in self.index

    def get(self, module: str) -> tuple[torch.Tensor, torch.Tensor, float | None]:
        """(packed uint8 [N, K/2], scale uint8 [N, K/bs] linear, amax or None) of ``module``."""
        from safetensors import safe_open

        name = self.index[module]
        held = self._held.get(name)
        if held is not None:
            amax_t = held.get(f"{module}.amax")
            return held[f"{module}.packed"], held[f"{module}.scale"], None if amax_t is None else float(amax_t[0])
        with self._lock:
            f = self._open.get(name)
            if f is None:
                f = self._open[name] = safe_open(str(self.root / name), framework="pt")
            keys = set(f.keys())  # type: ignore[attr-defined]
            packed = f.get_tensor(f"{module}.packed")  # type: ignore[attr-defined]
            scale = f.get_tensor(f"{module}.scale")  # type: ignore[attr-defined]
            amax = float(f.get_tensor(f"{module}.amax")[0]) if f"{module}.amax" in keys else None  # type: ignore[attr-defined]
        return packed, scale, amax

    def changed_tensor(self, key: str) -> torch.Tensor:
        """The tensor the pass wrote in place of unquantized tensor ``key`` (:attr:`changed`)."""
        from safetensors import safe_open

        name = self.changed[key]
        held = self._held.get(name)
        if held is not None:
            return held[f"{key}.changed"]
        with self._lock:
            f = self._open.get(name)
            if f is None:
                f = self._open[name] = safe_open(str(self.root / name), framework="pt")
            return f.get_tensor(f"{key}.changed")  # type: ignore[attr-defined]

    def close(self) -> None:
        with self._lock:
            self._open.clear()

    def remove(self) -> None:
        """Delete the folder (once the conversion has written every matrix, or when the pass failed)."""
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - removing anyway
            pass
        self.close()
        self._held.clear()
        self._held_bytes = 0
        shutil.rmtree(self.root, ignore_errors=True)


class Stored(Pending):
    """An item's matrices read from a :class:`Store` (on the writer thread that waits for them): the bytes a
    backend returns, scales in the format's layout. Every matrix of the item must be in the store; its
    inputs are never read, so they are free at once."""

    def __init__(self, item, store: Store, swizzle: bool, scheme: str) -> None:
        super().__init__(inputs_free=None)
        self.item, self.store, self.swizzle, self.scheme = item, store, swizzle, scheme

    def result(self) -> Result:
        import torch

        from fp4convert.kernels.tensor import as_bytes
        from fp4convert.numerics.reference import global_scale
        from fp4convert.numerics.swizzle import swizzle_scales

        outs: list[MatrixOut | None] = []
        keep = []
        for _, m in self.item.matrices:
            packed, scale, amax = self.store.get(m.module)
            if self.swizzle:
                s = scale.view(torch.float8_e4m3fn) if self.scheme == "nvfp4" else scale
                scale = swizzle_scales(s.unsqueeze(0))[0].view(torch.uint8)
            gs = None if amax is None else float(global_scale(torch.tensor(amax, dtype=torch.float32)))
            keep += [packed, scale]
            outs.append(MatrixOut(as_bytes(packed), as_bytes(scale), gs, amax))
        return Result(outs, [False] * len(outs), keep=keep)
