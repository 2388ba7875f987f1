"""The converter: source -> plan -> quantize -> write -> manifest, in an overlapped pipeline.

A work unit is one tensor or one fused group. Planning reads headers only; then the kernel is
asked to start reading the source in plan order (``posix_fadvise``) while torch and CUDA
initialise. Units are read ahead in a background thread (:mod:`fp4convert.readahead`), quantized
in batches (pass 1: amax of every member, pass 2: block quantization with the unit's global scale;
on CUDA several units share one launch per shape, see :mod:`fp4convert.pipeline`) and written by a
writer thread into output shards whose headers the plan fixed in advance, so host memory holds a
few batches whatever the model or shard size. Files are written under ``.partial`` names and
renamed when complete; the manifest is written last and marks a finished conversion.

Under ``torchrun`` each rank writes its share of the shards (:mod:`fp4convert.distributed`).
Importing this module imports no torch: ``--dry-run`` and argument errors never pay for it.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ConvertConfig
from .distributed import World, assign, run_writes
from .errors import ConfigError, CUDAUnavailableError, PlanError
from .readahead import advise

if TYPE_CHECKING:
    import torch

    from .formats.base import OutputFormat
    from .plan import Decision, Plan
    from .source import Source
    from .writer import ConvertResult, Progress

log = logging.getLogger(__name__)

__all__ = ["ConvertResult", "convert", "plan_conversion", "resolve_device"]


def __getattr__(name: str):
    if name == "ConvertResult":  # re-exported lazily: writer imports torch
        from .writer import ConvertResult

        return ConvertResult
    raise AttributeError(name)


def resolve_device(device: str, world: World | None = None) -> torch.device:
    """'auto' is the first GPU whose kernels load, else the CPU (with one warning); 'cuda' must work.

    Under torchrun, 'auto' and 'cuda' mean this rank's GPU (LOCAL_RANK, modulo the visible GPUs).
    """
    import torch

    world = world or World()

    def local_gpu() -> torch.device:
        n = torch.cuda.device_count()
        return torch.device("cuda", world.local_rank % n) if world.distributed and n else torch.device("cuda")

    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        dev = local_gpu()
        try:
            from .cuda import ops

            ops.ensure_loaded(dev)
        except CUDAUnavailableError as exc:
            log.warning("CUDA kernels unavailable (%s); converting on the CPU (same bytes, slower)",
                        str(exc).splitlines()[0])
            return torch.device("cpu")
        return dev
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {device!r} is not a device; use auto, cpu or cuda[:N]") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: only cpu and cuda are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CUDAUnavailableError(f"--device {device}: no CUDA GPU is visible here; use --device cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = local_gpu()
    return dev


def plan_conversion(src: str | Source, config: ConvertConfig) -> tuple[Source, Plan, OutputFormat]:
    """Open the source and plan it from headers alone (what ``--dry-run`` shows)."""
    from .formats import detect, get_format
    from .manifest import MANIFEST_NAME, load_manifest
    from .plan import make_plan
    from .source import Source, open_source

    source = src if isinstance(src, Source) else open_source(src, config.revision)
    manifest = load_manifest(source.root)
    found = detect(source.root, source.config(), manifest)
    if manifest is not None or found is not None:
        marker = MANIFEST_NAME if manifest is not None else f"{found.name} files"
        raise PlanError(f"the source is already quantized (it has {marker}); fp4convert needs a bf16/fp16/fp32 checkpoint")
    fmt = get_format(config.format)
    plan = make_plan(source.tensors(), config, fmt, source.config())
    return source, plan, fmt


def _advise_source(source: Source, plan: Plan, mine: set[str]) -> None:
    """Start the kernel reading what this rank will read, in plan order (before torch/CUDA start)."""
    if source.is_hub:
        return  # files arrive shard by shard from the Hub; nothing local to advise yet
    shard_of = plan.shard_of()
    ranges = []
    for unit in plan.units():
        if any(shard_of[e.name] in mine for d in unit for e in d.outputs):
            ranges += [(source.root / d.info.file, d.info.begin, d.info.end) for d in unit]
    advise(ranges)


def convert(
    src: str | Source,
    dst: str | Path,
    config: ConvertConfig = ConvertConfig(),
    progress: Progress | None = None,
    *,
    plan: tuple[Source, Plan, OutputFormat] | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` (folder or Hub repo id) into ``dst``.

    ``plan``: the result of :func:`plan_conversion` when the caller already planned (the CLI prints
    the plan's warnings first), so the source is planned once. Under torchrun (WORLD_SIZE > 1)
    every rank calls this with the same arguments.
    """
    t0 = time.perf_counter()
    dst = Path(dst)
    world = World.from_env()
    source, plan_, fmt = plan if plan is not None else plan_conversion(src, config)
    _advise_source(source, plan_, assign(plan_, world))

    import torch  # from here on the work needs it (the kernel is reading the source meanwhile)

    from . import pipeline
    from .pipeline import Batch, CpuBackend, Settings, StackedBackend, WriteBehind, make_batches, write_batch
    from .plan import QUANTIZE
    from .readahead import ReadAhead
    from .scheme import get_scheme
    from .writer import ConvertResult, run_identity

    world.init()
    device = resolve_device(config.device, world)
    threads = torch.get_num_threads()
    cores = threads if not (world.distributed and world.local_size > 1) else max(
        1, (os.cpu_count() or 1) // world.local_size)  # CPU ranks on one machine share its cores
    if device.type == "cuda":
        torch.cuda.set_device(device)  # under torchrun: this rank's GPU for every stream and buffer
    identity = run_identity(config, source)
    settings = Settings(get_scheme(config.scheme), config.rotate, fmt.swizzled, _scale_rule(config))
    cuda = device.type == "cuda"
    limits = (pipeline.CUDA_BATCH_UNITS, pipeline.CUDA_BATCH_BYTES) if cuda else (
        pipeline.CPU_BATCH_UNITS, pipeline.CPU_BATCH_BYTES)
    stacked = cuda or limits[0] > 1  # the tests run the CUDA scheduling on the CPU with larger batches
    backend = StackedBackend(device) if stacked else CpuBackend(workers=cores)
    if not stacked:
        torch.set_num_threads(1)  # parallel over units instead (see CpuBackend); restored below

    reader: ReadAhead | None = None
    behind = WriteBehind(device=device)
    batch_of: dict[int, Batch] = {}  # id(first unit) -> its batch

    def start(pending: list[list[Decision]]) -> None:
        nonlocal reader
        batches = [Batch(b) for b in make_batches(pending, *limits)]
        batch_of.update({id(b.units[0]): b for b in batches})
        reader = ReadAhead([[d.info for d in b.members] for b in batches], source.local_path, pinned=cuda, device=device)

    def process(unit: list[Decision], writers) -> dict[str, dict]:
        if unit[0].action != QUANTIZE:
            d = unit[0]
            behind.submit(lambda: writers.raw(d.name, source.local_path(d.info.file), d.info))
            return {d.name: {}}
        batch = batch_of.get(id(unit))
        if batch is None:
            return {}  # a later unit of a batch: quantized and queued with its first unit
        hosts = reader.next()
        records = {d.name: {} for d in batch.members}
        freed = threading.Event()

        def free(event=None) -> None:  # exactly once: the reader may refill this batch's buffer set
            if not freed.is_set():
                freed.set()
                reader.release(event)

        try:
            result = _quantize_unit(batch, hosts, backend, settings, free)
        except BaseException:
            free()
            raise
        behind.submit(write_batch(batch, result, settings, fmt, writers, records))
        return records

    try:
        done = run_writes(world, plan_, dst, config, identity, source, fmt, progress or (lambda n: None), process,
                          start, behind.drain)
    finally:
        if reader is not None:
            reader.close()
        backend.close()
        torch.set_num_threads(threads)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reused = sorted(f for f in done if f in dict(plan_.shards))
    wait = reader.wait_s if reader is not None else 0.0
    return ConvertResult(dst, plan_, time.perf_counter() - t0, peak, reused, wait)


def _scale_rule(config: ConvertConfig) -> dict:
    """A non-default block-scale rule, when the config carries one (the backend's keyword)."""
    rule = getattr(config, "scale_rule", None)
    if rule is None:
        return {}
    from .scheme import get_scheme

    s = get_scheme(config.scheme)
    rule = s.check_rule(rule)
    return {} if rule == s.default_rule else {"scale_rule": rule}


def _quantize_unit(batch, hosts, backend, settings, free):
    """Pass 1 and pass 2 of one batch (one unit on the CPU), started; returns the writer's result function."""
    return backend.run(batch, hosts, settings, free)
