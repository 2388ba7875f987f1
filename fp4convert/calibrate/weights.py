"""The meta model's weights, read from the checkpoint one block at a time (the block runner's memory bound).

Checkpoint names map to parameters with transformers' own key conversion (the renames and per-expert
merges its loader applies, as :mod:`fp4convert.plan.model_build` does for the plan): plain renames are read
directly, merged ones through a fresh copy of transformers' converter. Reads are plain reads at the
header offsets (no mmap: pages of blocks already done are not kept mapped), the next block's read ahead
on a thread; a freed block's parameters go back to ``meta`` and the heap is trimmed, so resident memory
stays one block's. A block can be loaded again with some tensors replaced (GPTQ's quantized weights).
"""

from __future__ import annotations

import logging
from copy import deepcopy
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4convert.calibrate.diagnose import WAYS_OUT
from fp4convert.calibrate.model import build_meta, find_blocks, is_tower, structure_problem
from fp4convert.errors import PlanError

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from fp4convert.calibrate.experts import ExpertStack
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)

_FLOAT = ("F32", "F16", "BF16")  # weights the run widens to fp32
_INTEGER = ("I64", "I32", "I16", "I8", "U8", "BOOL")  # buffers it loads as they are
READ_THREADS = 4  # threads per block read (page-cache copies: 5.0 GB/s on one thread, 17.8 on four, H100 host)
PINNED_MAX = 4 << 30  # a GPU run reads blocks up to this size into reused pinned buffers (two: 8 GiB at most)


class BlockWeights:
    """A model built on ``meta``; weights materialized from the source one block at a time."""

    def __init__(self, source: Source, device: torch.device, other: str = WAYS_OUT, group=None) -> None:
        import torch

        self.group = group  # this process's place in a torchrun job (None: one process): it runs its share of tokens
        self._chunks: list[int] = []  # the chunk of each micro-batch this process runs (LayerwiseModel.blocks)
        self._observing: Any = None  # the Observers of the block run now (their chunk follows the micro-batch)

        self.root = Path(source.root)
        self.device = torch.device(device)
        self.other = other
        self.raw = source.config()
        # the checkpoint as the plan sees it: a quantized input (FP8, INT4, MXFP4 blocks) is its decoded fp32 weight,
        # read from its on-disk tensors (self.disk) and decoded exactly on the run's device when its block loads
        from fp4convert.formats import input_weights

        on_disk = source.tensors()
        self.disk = {t.name: t for t in on_disk}
        logical, self.decodes = input_weights(on_disk, self.raw)
        self.infos = {t.name: t for t in logical}
        self.cfg, self.model = build_meta(self.root, self.raw, other)
        why = structure_problem(self.model, self.cfg)
        if why is not None:
            raise PlanError(f"{self.root}: the layer-by-layer run cannot run this model: {why}; {other}")
        self.layers_name, self.layers = find_blocks(self.model)
        self.modules = dict(self.model.named_modules(remove_duplicate=False))
        self.names = {id(m): n for n, m in self.model.named_modules()}
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        self.heads = [self.names[id(head)]] if head is not None and id(head) in self.names else []
        self.towers = [n for n, m in self.model.named_modules() if n and is_tower(self.model, m)]
        emb = self.model.get_input_embeddings()
        self.embed_name = self.names.get(id(emb), "")
        self._meta_buffers: set[str] = set()  # buffers made from parameters (on meta): loaded like them
        for mn, m in self.model.named_modules(remove_duplicate=False):  # computed buffers to the device
            for n, b in list(m._buffers.items()):
                if b is not None and b.device.type == "meta":
                    self._meta_buffers.add(f"{mn}.{n}" if mn else n)
                elif b is not None:
                    m._buffers[n] = b.to(self.device)
        self._key_map()
        self.loaded = 0  # parameter bytes materialized now, and the most at once (tests check it is flat)
        self.peak_loaded = 0
        self._ahead: dict = {}  # checkpoint key -> Future of its bytes (the next block's, read ahead)
        self._replaced: dict = {}  # checkpoint key -> tensor loaded instead (reload_block)
        self._reads: dict | None = None  # while load_block(keep_reads=True) runs: checkpoint key -> tensor as read
        # streamed expert stacks (fp4convert.calibrate.experts), per block index: path -> ExpertStack; their
        # checkpoint tensors resident on the run's device as on disk (on-disk name -> typed tensor)
        self.stacks: dict[int, dict[str, ExpertStack]] = {}
        self._resident: dict[str, torch.Tensor] = {}
        self._reader: ThreadPoolExecutor | None = None
        self._pinned: list = [None, None]  # GPU runs: the direct reads' and the read-ahead's pinned buffers

    # -- checkpoint names -> parameters (transformers' own conversion) ------------------------------

    def _key_map(self) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

        conversions = get_model_conversion_mapping(self.model)
        self._renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        self._converter_of = {p: c for c in converters for p in c.source_patterns}
        meta = dict(self.model.named_parameters(remove_duplicate=False))
        meta.update(dict(self.model.named_buffers(remove_duplicate=False)))
        self.targets = meta
        self._buffer_names = set(dict(self.model.named_buffers(remove_duplicate=False)))
        self.keymap: dict[str, tuple[str, str | None]] = {}
        for name in sorted(self.infos, key=dot_natural_key):
            target, pattern = rename_source_key(name, self._renamings, converters, self.model.base_model_prefix, meta)
            if target not in meta and name in meta:
                target, pattern = name, None
            if target in meta:
                self.keymap[name] = (target, pattern)
        self.disk_of = {t: k for k, (t, _) in self.keymap.items()}  # (the last source of a merged target)
        # tied parameters (transformers' {target: source}; the meta build does not share them): one tensor,
        # unless the checkpoint holds both (transformers then leaves them untied)
        self.tied: dict[str, set[str]] = {}
        for target, src in (getattr(self.model, "all_tied_weights_keys", None) or {}).items():
            if target in meta and src in meta and not (target in self.disk_of and src in self.disk_of):
                group = self.tied.get(target, {target}) | self.tied.get(src, {src})
                for name in group:
                    self.tied[name] = group

    def _read(self, name: str) -> torch.Tensor:
        """One checkpoint tensor on the run's device (fp32 for floating-point tensors): from its block's
        read (:meth:`read_ahead`), else read on its own."""
        import torch

        from fp4convert.storage.safetensors import torch_dtypes

        info = self.infos[name]
        got = self._replaced.get(name)
        if got is not None:
            return got.to(self.device, torch.float32)
        if not self._readable(name):
            raise PlanError(f"{name}: dtype {info.dtype}; the layer-by-layer run reads F32/F16/BF16 checkpoints and "
                            "the quantized inputs fp4convert decodes (FP8, INT4, MXFP4 blocks)")
        if name in self.decodes:
            t = self._decoded(name)
            if self._reads is not None:
                self._reads[name] = t
            return t
        t = self._fetch(name).view(torch_dtypes()[info.dtype]).reshape(info.shape)
        if info.dtype not in _FLOAT:
            return t.to(self.device)
        # (on a GPU the copy leaves the pinned buffer free again; on the CPU an fp32 tensor stays a view of its
        # block's fresh buffer)
        t = t.to(self.device).float() if self.device.type == "cuda" else t.to(torch.float32)
        if self._reads is not None:
            self._reads[name] = t
        return t

    def _fetch(self, disk_name: str) -> torch.Tensor:
        """An on-disk tensor's bytes: from its block's read (:meth:`read_ahead`, :meth:`load_block`), else read now."""
        ahead = self._ahead.pop(disk_name, None)
        return ahead.result()[disk_name] if ahead is not None else self._read_raw([disk_name])[disk_name]

    def _decoded(self, name: str) -> torch.Tensor:
        """The exact fp32 weight quantized input ``name`` encodes: its on-disk tensors copied to the run's device
        as they are (FP8 / packed bytes: the host and the link carry the source's size) and decoded there."""
        import torch

        from fp4convert.quantizer.matrices import decoded
        from fp4convert.storage.safetensors import torch_dtypes

        dec = self.decodes[name]
        parts = [self._fetch(i.name).view(torch_dtypes()[i.dtype]).reshape(i.shape).to(self.device) for i in dec.inputs]
        return decoded(dec, parts, f"{name} (in {dec.inputs[0].file})").to(torch.float32)

    def _on_disk(self, keys: list[str]) -> list[str]:
        """The on-disk tensors that hold checkpoint keys ``keys`` (a quantized input's: its codes and scales)."""
        out: list[str] = []
        for k in keys:
            dec = self.decodes.get(k)
            out += [i.name for i in dec.inputs] if dec is not None else [k]
        return out

    def _readable(self, name: str) -> bool:
        """A floating-point tensor, a quantized input fp4convert decodes, or an integer/bool one loading into a
        buffer (position ids, DeepSeek-V4's token-to-expert table), kept as it is."""
        if name in self.decodes:
            return True
        dtype = self.infos[name].dtype
        if dtype in _FLOAT:
            return True
        target = self.keymap.get(name, ("", None))[0]
        return dtype in _INTEGER and target in self._buffer_names

    def _read_raw(self, keys: list[str], slot: int = 0) -> dict[str, torch.Tensor]:
        """The on-disk tensors' bytes (uint8 tensors, views of one buffer), read with plain reads at their header
        offsets (no mmap: pages of blocks already done are not kept mapped) on READ_THREADS threads.

        Why: a block is hundreds of MB; one thread copying page-cache pages into a fresh buffer ran at
        ~1.5 GB/s on the H200 host, slower than everything else the block runner does there. On a GPU the
        buffer is pinned (the copies to the device then run at the link's speed) and reused: ``slot`` 1 is
        the read-ahead's (one block at a time, consumed before the next is read), 0 the direct reads'
        (each copied to the device before the next)."""

        from fp4convert.storage.reads import read_many

        infos = [self.disk[k] for k in keys]
        total = sum(i.nbytes for i in infos)
        buf = self._buffer(total, slot)
        out, items, at = {}, [], 0
        for k, info in zip(keys, infos):
            view = buf[at: at + info.nbytes]
            out[k] = view
            items.append((self.root / info.file, info, memoryview(view.numpy())))
            at += info.nbytes
        read_many(items, threads=READ_THREADS)
        return out

    def _buffer(self, n: int, slot: int) -> torch.Tensor:
        """A host buffer of ``n`` bytes: on a GPU run (up to PINNED_MAX), pinned buffer ``slot``, grown
        when too small; otherwise a fresh one (a CPU run's fp32 tensors are views of it)."""
        import torch

        if self.device.type != "cuda" or n > PINNED_MAX:
            return torch.empty(n, dtype=torch.uint8)
        pool = self._pinned[slot]
        if pool is None or pool.numel() < n:
            self._pinned[slot] = None  # (the old one is unpinned before the larger one is pinned)
            pool = self._pinned[slot] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return pool[:n]

    def read_ahead(self, i: int) -> None:
        """Start reading block ``i``'s checkpoint bytes on a thread (file reads release the GIL), so the
        next block's weights arrive while this one runs; at most one block is read ahead."""
        from concurrent.futures import ThreadPoolExecutor

        if i >= len(self.layers):
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="fp4convert-calibrate-read")
        keys = [k for k in self._on_disk([k for k in self._keys_under(f"{self.layers_name}.{i}.") if self._readable(k)])
                if k not in self._ahead]
        if keys:
            fut = self._reader.submit(self._read_raw, keys, 1)
            for k in keys:
                self._ahead[k] = fut

    def close(self) -> None:
        """Drop what was read ahead and stop the reader thread."""
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    def _keys_under(self, prefix: str | None) -> list[str]:
        """Checkpoint keys loading into parameters under ``prefix`` (None: those outside the blocks,
        the heads and the towers)."""
        out = []
        skip = [self.layers_name + ".", *(h + "." for h in self.heads), *(t + "." for t in self.towers)]
        for k, (target, _) in self.keymap.items():
            if prefix is not None:
                if target.startswith(prefix):
                    out.append(k)
            elif not any(target.startswith(s) for s in skip):
                out.append(k)
        return out

    def _load_keys(self, keys: list[str]) -> None:
        """Materialize the parameters ``keys`` load into: plain renames read directly, merged/converted
        ones through a fresh copy of transformers' converter (as its loader does, one per target)."""
        import torch

        groups: dict[str, object] = {}
        for k in keys:
            target, pattern = self.keymap[k]
            if pattern is None:
                self._set(target, self._read(k))
            else:
                conv = groups.get(target)
                if conv is None:
                    conv = groups[target] = deepcopy(self._converter_of[pattern])
                conv.add_tensor(target, k, pattern, partial(self._read, k))  # type: ignore[attr-defined]
        for target, conv in groups.items():
            with torch.no_grad():
                made = conv.convert(target, model=self.model, config=self.model.config)  # type: ignore[attr-defined]
            for name, value in made.items():
                value = value[0] if isinstance(value, list) else value
                if name not in self.targets:
                    raise PlanError(f"{self.root}: transformers' conversion of {target} made {name}, not a parameter "
                                    f"of the model; the layer-by-layer run cannot load it ({self.other})")
                self._set(name, value.to(self.device, torch.float32))

    def _set(self, name: str, t: torch.Tensor) -> None:
        import torch

        owner, leaf = _owner(self.model, name)
        if leaf in owner._parameters:
            want = tuple(owner._parameters[leaf].shape)
            if tuple(t.shape) != want:
                raise PlanError(f"{self.root}: {self.disk_of.get(name, name)} loads as {list(t.shape)} but the model "
                                f"config.json describes has {name} {list(want)}; fix config.json, {self.other}")
            # the flag the definition gives (as transformers loads it): under no_grad nothing is recorded, but
            # linear's path for a non-contiguous 3-D input still depends on it (Longformer's transposed hidden
            # states: other last bits than the whole model's with requires_grad False)
            param = torch.nn.Parameter(t, requires_grad=owner._parameters[leaf].requires_grad and t.is_floating_point())
            for alias in self.tied.get(name, {name}):  # tied parameters are one tensor, as when loaded
                o, lf = _owner(self.model, alias)
                o._parameters[lf] = param
            self.loaded += t.numel() * t.element_size()
            self.peak_loaded = max(self.peak_loaded, self.loaded)
        else:
            owner._buffers[leaf] = t.to(owner._buffers[leaf].dtype)

    def _check_loaded(self, module, prefix: str, skip: set[str] | frozenset = frozenset()) -> None:
        meta_buffers = [(n, b) for n, b in module.named_buffers() if prefix + n in self._meta_buffers]
        for n, p in [*module.named_parameters(), *meta_buffers]:
            if p.device.type == "meta" and prefix + n not in skip:
                raise PlanError(f"{self.root}: no checkpoint tensor loads {prefix}{n} (its names differ from the "
                                f"transformers model's); the layer-by-layer run cannot load it ({self.other})")

    def _free_params(self, params: list[tuple[str, object]]) -> None:
        import torch

        for name, p in params:
            owner, leaf = _owner(self.model, name)
            if leaf in owner._buffers:  # a buffer made from parameters: back to meta, as built
                b = owner._buffers[leaf]
                if b is not None and name in self._meta_buffers:
                    owner._buffers[leaf] = torch.empty(b.shape, dtype=b.dtype, device="meta")
                continue
            q = owner._parameters.get(leaf)
            if q is None or q.device.type == "meta":
                continue
            self.loaded -= q.numel() * q.element_size()
            empty = torch.nn.Parameter(torch.empty(q.shape, dtype=q.dtype, device="meta"), requires_grad=q.requires_grad)
            for alias in self.tied.get(name, {name}):
                o, lf = _owner(self.model, alias)
                if o._parameters.get(lf) is q:
                    o._parameters[lf] = empty
        _trim_heap()

    def load_block(self, i: int, keep_reads: bool = False, stream: bool = False) -> dict[str, torch.Tensor]:
        """Materialize block ``i``'s parameters from the checkpoint (read ahead, or read now). With
        ``keep_reads``, returns the block's floating-point checkpoint tensors as read (key -> fp32 on the
        run's device, before any converter merges them): what a calibrated method quantizes, with no
        second read; else {}. With ``stream``, an expert stack that can run a group of experts at a time
        (:func:`~fp4convert.calibrate.experts.streamable`) is not materialized: its checkpoint tensors stay
        resident as on disk and its forward reads them a group at a time (:attr:`stacks`; a stack already
        there, as on a reload, is kept with what a method quantized of it)."""
        from concurrent.futures import Future

        prefix = f"{self.layers_name}.{i}."
        keys = self._keys_under(prefix)
        if stream and i not in self.stacks:
            from fp4convert.calibrate.experts import stream_stacks

            self.stacks[i] = stream_stacks(self, self.layers[i], prefix, keys)
        streamed = {k for st in self.stacks.get(i, {}).values() for ks in st.keys.values() for k in ks}
        keys = [k for k in keys if k not in streamed]
        direct = [k for k in self._on_disk([k for k in keys if k not in self._replaced and self._readable(k)])
                  if k not in self._ahead]
        if direct:  # one read of the block (its threads split it), not one per tensor
            done: Future = Future()
            done.set_result(self._read_raw(direct))
            for k in direct:
                self._ahead[k] = done
        reads: dict[str, torch.Tensor] = {}
        self._reads = reads if keep_reads else None
        try:
            self._load_keys(keys)
        finally:
            self._reads = None
        self._check_loaded(self.layers[i], prefix, skip={p + "." + n for p in self.stacks.get(i, {})
                                                         for n in ("gate_up_proj", "down_proj")})
        return reads

    def make_resident(self, keys: list[str]) -> None:
        """Checkpoint keys ``keys`` kept on the run's device as they are on disk (a streamed stack's: read ahead
        with their block, or now)."""
        from fp4convert.storage.safetensors import torch_dtypes

        for disk in self._on_disk(keys):
            info = self.disk[disk]
            self._resident[disk] = self._fetch(disk).view(torch_dtypes()[info.dtype]).reshape(info.shape).to(
                self.device, copy=True)

    def resident_fp32(self, key: str) -> torch.Tensor:
        """A streamed stack's checkpoint tensor ``key`` in fp32 on the run's device, from its resident bytes
        (decoded there, for a quantized input)."""
        import torch

        from fp4convert.quantizer.matrices import decoded

        dec = self.decodes.get(key)
        if dec is None:
            return self._resident[key].to(torch.float32)
        parts = [self._resident[i.name] for i in dec.inputs]
        return decoded(dec, parts, f"{key} (in {dec.inputs[0].file})").to(torch.float32)

    def converter_of(self, pattern: str):
        """A copy of transformers' converter for checkpoint keys matching ``pattern`` (to be fed and run once)."""
        return self._converter_of[pattern]

    def free_block(self, i: int, keep_stacks: bool = False) -> None:
        """Block ``i``'s parameters back to ``meta``; its streamed stacks too unless ``keep_stacks`` (a reload)."""
        prefix = f"{self.layers_name}.{i}."
        self._free_params([(prefix + n, p) for n, p in [*self.layers[i].named_parameters(),
                                                        *self.layers[i].named_buffers()]])
        if keep_stacks:
            return
        for stack in self.stacks.pop(i, {}).values():
            stack.module.__dict__.pop("forward", None)
            stack.release()
            for ks in stack.keys.values():
                for disk in self._on_disk(ks):
                    self._resident.pop(disk, None)
        _trim_heap()

    def load_outside(self) -> None:
        self._load_keys(self._keys_under(None))

    def free_outside(self) -> None:
        inside = [self.layers_name + ".", *(h + "." for h in self.heads)]
        self._free_params([(n, p) for n, p in [*self.model.named_parameters(remove_duplicate=False),
                                               *self.model.named_buffers()]
                           if not any(n.startswith(s) for s in inside)])

    # -- running ------------------------------------------------------------------------------------

    def read_fp32(self, name: str) -> torch.Tensor:
        """Checkpoint tensor ``name`` as fp32 on the run's device (a plain read; not read ahead)."""
        import torch

        from fp4convert.storage.safetensors import torch_dtypes

        if name in self.decodes:
            for disk_name, raw in self._read_raw(self._on_disk([name])).items():
                self._ahead[disk_name] = _done({disk_name: raw})
            return self._decoded(name)
        info = self.infos[name]
        t = self._read_raw([name])[name].view(torch_dtypes()[info.dtype]).reshape(info.shape)
        return t.to(self.device).float() if self.device.type == "cuda" else t.to(torch.float32)

    def total_bytes(self) -> int:
        """The fp32 bytes of every weight the model loads (what :meth:`whole` holds when resident)."""
        return sum(4 * numel(self.infos[k]) for k in self.keymap)


def _done(value):
    """A finished Future holding ``value`` (what a read ahead leaves for :meth:`BlockWeights._fetch`)."""
    from concurrent.futures import Future

    fut: Future = Future()
    fut.set_result(value)
    return fut


def numel(info) -> int:
    n = 1
    for s in info.shape:
        n *= int(s)
    return n


def _owner(module, name: str):
    """(the submodule holding parameter/buffer ``name``, its last name part)."""
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc): a freed block's tensors below malloc's mmap
    threshold otherwise stay resident as fragments, and resident memory creeps up block by block."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)  # type: ignore[operator]


_MALLOC_TRIM: object = None
