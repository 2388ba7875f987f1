"""The converter: source -> plan -> quantize -> write -> manifest, in an overlapped pipeline.

A work unit is one tensor or one fused group. Planning reads headers only; then the kernel is
asked to start reading the source in plan order (``posix_fadvise``) while torch and CUDA
initialise. Units are read ahead in a background thread (:mod:`fp4convert.readahead`), quantized
in batches (pass 1: amax of every member, pass 2: block quantization with the unit's global scale;
on CUDA several units share one launch per shape, see :mod:`fp4convert.pipeline`) and written by a
writer thread into output shards whose headers the plan fixed in advance, so host memory holds a
few batches whatever the model or shard size. Units whose tensors are not one whole matrix each
(3-D stacked experts, gate/up halves, FP8 or MXFP4 inputs decoded first) are computed one at a time
as their own read batch (:class:`_Complex`); their writes join the same ordered write-behind queue.
Files are written under ``.partial`` names and
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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from . import stages
from .config import ConvertConfig
from .distributed import World, assign, run_writes
from .errors import ConfigError, CUDAUnavailableError, PlanError
from .plan import QUANTIZE
from .readahead import advise

if TYPE_CHECKING:
    import torch

    from .formats.base import OutputFormat
    from .plan import Decision, Matrix, Plan
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
        # Always with an index: torch.cuda.set_device and the worker threads need one.
        n = torch.cuda.device_count()
        index = world.local_rank % n if world.distributed and n else torch.cuda.current_device()
        return torch.device("cuda", index)

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
    if not source.config() and not config.allow_no_config:
        raise PlanError(f"{source.label} has no config.json: no loader (transformers, vLLM, SGLang) can load the "
                        "output, and the plan cannot know the model; add the model's config.json, or pass "
                        "--allow-no-config to convert the tensors anyway")
    if config.activations != "none":
        fmt = _w4a4_format(source, config, fmt)
    plan = make_plan(source.tensors(), config, fmt, source.config())
    return source, plan, fmt


def _w4a4_format(source: Source, config: ConvertConfig, fmt: OutputFormat) -> OutputFormat:
    """W4A4 (--activations): the format writing activation scales; a model calibration cannot run
    is refused here, before anything is written (fp4convert.calibrate)."""
    from .calibrate import check_runnable
    from .formats.base import with_activations

    check_runnable(source, config)
    return with_activations(fmt, config.activations)


def _calibrate(source: Source, plan: Plan, fmt: OutputFormat, config: ConvertConfig) -> None:
    """W4A4 NVFP4: every quantized module's activation amax, set on the format before writing."""
    if getattr(fmt, "activations", "none") != "nvfp4":
        return
    from .calibrate import activation_amax

    device = None if config.device == "auto" else config.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    with stages.timed("calibrate"):
        amax, record = activation_amax(source, plan, config, device)
    fmt.input_amax = amax
    fmt.calibration = record


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
    stages.reset()
    dst = Path(dst)
    world = World.from_env()
    if plan is None:
        prewarm_device(config)  # the GPU starts while the source is planned
    with stages.timed("plan"):
        source, plan_, fmt = plan if plan is not None else plan_conversion(src, config)
    _calibrate(source, plan_, fmt, config)
    _advise_source(source, plan_, assign(plan_, world))

    t_start = time.perf_counter()
    from .schedule import Settings, WriteBehind
    from .scheme import get_scheme
    from .writer import ConvertResult, run_identity

    settings = Settings(get_scheme(config.scheme), config.rotate, fmt.swizzled, {"scale_rule": config.rule})
    rt = _direct_runtime(config, world, plan_)
    n_lanes = lane_count(config, world, plan_, source, rt is not None)
    lanes: list[_Lane] = []
    if rt is not None:  # the torch-free CUDA path (fp4convert.direct): torch is never imported
        from . import direct

        torch = None
        threads = 0
        for k in range(n_lanes):  # each lane its own stream; one library, one pinned pool
            lane_rt = rt if k == 0 else rt.lane()
            lanes.append(_Lane(source, config, fmt, settings, None, direct.DirectBackend(lane_rt),
                               (direct.BATCH_UNITS, direct.BATCH_BYTES), WriteBehind(init=rt.set_device),
                               direct.write_batch, 0, rt.pool.get, lane_rt.close if k else None, rt.set_device))
        nonfinite = rt.host_check
    else:
        import torch  # from here on the work needs it (the kernel is reading the source meanwhile)

        from . import pipeline
        from .pipeline import CpuBackend, StackedBackend

        world.init()
        device = resolve_device(config.device, world)
        threads = torch.get_num_threads()
        cores = threads if not (world.distributed and world.local_size > 1) else max(
            1, (os.cpu_count() or 1) // world.local_size)  # CPU ranks on one machine share its cores
        cores = max(1, cores // n_lanes)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # under torchrun: this rank's GPU for every stream and buffer
        cuda = device.type == "cuda"
        limits = (pipeline.CUDA_BATCH_UNITS, pipeline.CUDA_BATCH_BYTES) if cuda else (
            pipeline.CPU_BATCH_UNITS, pipeline.CPU_BATCH_BYTES)
        stacked = cuda or limits[0] > 1  # the tests run the CUDA scheduling on the CPU with larger batches
        if not stacked:
            torch.set_num_threads(1)  # parallel over units instead (see CpuBackend); restored below
        for _ in range(n_lanes):
            backend = StackedBackend(device) if stacked else CpuBackend(workers=cores)
            select = (lambda: torch.cuda.set_device(device)) if cuda else None
            lanes.append(_Lane(source, config, fmt, settings, device, backend, limits, WriteBehind(init=select),
                               pipeline.write_batch, cores, init=select))
        nonfinite = None
    stages.add("startup", time.perf_counter() - t_start)
    stages.count("lanes", len(lanes))
    identity = run_identity(config, source)

    closers = [ln.close for ln in lanes] + [rt.close if rt is not None else lambda: torch.set_num_threads(threads)]
    try:
        report = progress or (lambda n: None)
        if len(lanes) > 1:
            from .lanes import write_with_lanes

            told = threading.Lock()  # the lanes' writer threads report side by side

            def shared(n: int) -> None:
                with told:
                    report(n)

            done = write_with_lanes(plan_, dst, config, identity, source, fmt,
                                    [(ln.init, ln.progress(shared), ln.process, ln.start, ln.drain) for ln in lanes],
                                    nonfinite)
        else:
            done = run_writes(world, plan_, dst, config, identity, source, fmt, lanes[0].progress(report),
                              lanes[0].process, lanes[0].start, lanes[0].drain, nonfinite)
    except BaseException:
        _close_all(closers, raising=False)  # the run's own error is the one to report
        raise
    _close_all(closers)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reused = sorted(f for f in done if f in dict(plan_.shards))
    wait = sum(ln.reader.wait_s for ln in lanes if ln.reader is not None)
    return ConvertResult(dst, plan_, time.perf_counter() - t0, peak, reused, wait, stages.snapshot(), stages.counts())


class _Lane:
    """One stream of work: a reader, a backend (on CUDA its own stream) and a writer thread.

    A run has one; a one-process run may have several side by side, each writing its own output
    shards (:mod:`fp4convert.lanes`), so the host's writes, hashes and syncs run in parallel.
    """

    def __init__(self, source: Source, config: ConvertConfig, fmt: OutputFormat, settings, device, backend,
                 limits: tuple[int, int], behind, write_job, cores: int, host=None,
                 on_close: Callable[[], None] | None = None, init: Callable[[], None] | None = None) -> None:
        self.source, self.config, self.fmt, self.settings = source, config, fmt, settings
        self.init = init  # run first in a lane's own thread (CUDA: select this run's GPU)
        self.device, self.backend, self.limits, self.behind = device, backend, limits, behind
        self.write_job, self.cores, self.host, self.on_close = write_job, cores, host, on_close
        self.reader = None
        self.item_of: dict[int, object] = {}  # id(first unit) -> its batch (or its own, for a complex unit)

    def start(self, pending: list[list[Decision]]) -> None:
        """Batch the units this lane will process and start reading them."""
        from .readahead import ReadAhead
        from .schedule import Batch, make_batches

        items: list = []
        run: list[list[Decision]] = []

        def flush() -> None:
            items.extend(Batch(b) for b in make_batches(run, *self.limits))
            run.clear()

        for u in pending:
            if u[0].action != QUANTIZE and u[0].decode is None:
                flush()  # a kept tensor: copied by the writer thread, nothing to read here
            elif _simple(u):
                run.append(u)
            else:
                flush()
                items.append(_Complex(u, self.device, self.config, self.fmt, self.cores))
        flush()
        self.item_of.update({id(b.units[0]): b for b in items})
        device = self.device
        self.reader = ReadAhead([b.reads() for b in items], self.source.local_path,
                                pinned=device is not None and device.type == "cuda", device=device, host=self.host)

    def process(self, unit: list[Decision], writers) -> dict[str, dict]:
        """Quantize a unit's batch (started on the GPU) and queue its writes; returns its records."""
        d = unit[0]
        behind = self.behind
        if d.action != QUANTIZE and d.decode is None:
            behind.submit(lambda: writers.raw(d.name, self.source.local_path(d.info.file), d.info))
            return {d.name: {}}
        item = self.item_of.get(id(unit))
        if item is None:
            return {}  # a later unit of a batch: quantized and queued with its first unit
        reader = self.reader
        hosts = reader.next()
        records = {m.name: {} for m in item.members}
        freed = threading.Event()

        def free(event=None) -> None:  # exactly once: the reader may refill this batch's buffer set
            if not freed.is_set():
                freed.set()
                reader.release(event)

        try:
            with stages.timed("quantize"):
                result = _quantize_unit(item, hosts, self.backend, self.settings, free)
        except BaseException:
            free()
            raise
        if isinstance(item, _Complex):
            behind.submit(_write_complex(result, writers, records))
        else:
            behind.submit(self.write_job(item, result, self.settings, self.fmt, writers, records))
        return records

    def progress(self, report: Callable[[int], None]) -> Callable[[int], None]:
        # Progress follows the unit's writes (in the writer thread): a Hub source shard it lets go of
        # (--delete-source-shards) has then been read for the last time.
        return lambda n: self.behind.submit(lambda: report(n), light=True)

    def drain(self, ok: bool) -> None:
        self.behind.drain(ok)

    def close(self) -> None:
        self.behind.drain(False)  # stops the writer thread when the run failed before the writes began (else a no-op)
        if self.reader is not None:
            self.reader.close()
        self.backend.close()
        if self.on_close is not None:
            self.on_close()


def _close_all(closers: list[Callable[[], None]], raising: bool = True) -> None:
    """Run every closer even if one fails (a sticky CUDA error, say); then raise the first error
    (only logged when the run is failing already)."""
    error: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the rest are closed
            error = error or exc
            if not raising:
                log.debug("while closing after a failure: %s", exc)
    if error is not None and raising:
        raise error


def lane_count(config: ConvertConfig, world: World, plan: Plan, source: Source, direct: bool) -> int:
    """How many lanes this run gets: ``config.lanes``, else (0: auto) AUTO_LANES on the torch-free
    CUDA path of a local source and one elsewhere; never more than the shards there are to write."""
    from .lanes import AUTO_LANES

    if world.distributed or source.is_hub:
        return 1  # torchrun splits across processes; a Hub source's shards are released in plan order
    want = config.lanes or (AUTO_LANES if direct else 1)
    return max(1, min(want, len(plan.shards)))


def torch_free(config: ConvertConfig, world: World, plan: Plan) -> bool:
    """Can this run take the torch-free CUDA path (:mod:`fp4convert.direct`)? From the plan alone.

    Yes when it is one process, the device is CUDA (``auto`` or ``cuda[:N]``) and every quantized
    unit is plain 2-D bf16/fp16/fp32 weights (no stacked experts, no FP8/MXFP4 input to decode).
    ``FP4CONVERT_TORCH_PIPELINE=1`` forces the torch pipeline (the same bytes; an A/B switch).
    """
    from .direct import DTYPE_CODES

    if world.distributed or _cuda_index(config.device) is None or os.environ.get("FP4CONVERT_TORCH_PIPELINE") == "1":
        return False
    for unit in plan.units():
        if unit[0].decode is not None:
            return False
        if unit[0].action == QUANTIZE and not (_simple(unit) and all(d.info.dtype in DTYPE_CODES for d in unit)):
            return False
    return True


def _cuda_index(device: str) -> int | None:
    """The GPU a one-process run on ``device`` would use: ``auto`` / ``cuda`` -> 0, ``cuda:N`` -> N;
    None for the CPU or a malformed index (the torch pipeline reports that one)."""
    if device in ("auto", "cuda"):
        return 0
    if not device.startswith("cuda:"):
        return None
    try:
        return int(device.split(":", 1)[1])
    except ValueError:
        return None


def prewarm_device(config: ConvertConfig) -> None:
    """A one-process CUDA run: start the GPU (driver, kernel library, context) in the background now,
    while the source is planned. Imports nothing heavy; a machine without a GPU costs nothing."""
    index = _cuda_index(config.device)
    if index is None or World.from_env().distributed:
        return
    from .cuda.runtime import prewarm

    prewarm(index)


def _direct_runtime(config: ConvertConfig, world: World, plan: Plan):
    """The torch-free CUDA runtime when this run can use it and the GPU and kernel library are there;
    else None, and the torch pipeline runs (it reports errors as it always did: ``auto`` falls back
    to the CPU with a warning, ``cuda`` without a GPU is an error)."""
    if not torch_free(config, world, plan):
        return None
    from .cuda.runtime import Runtime
    from .errors import FP4ConvertError

    try:
        return Runtime(_cuda_index(config.device))  # no driver or GPU, an old GPU, no nvcc: CUDAUnavailableError
    except FP4ConvertError as exc:
        log.debug("torch-free CUDA path unavailable (%s); using the torch pipeline", exc)
        return None


def weight_of(d: Decision, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The weight a decision works on: the tensor itself, or the fp32 weight a quantized input encodes."""
    if d.decode is None:
        return tensors[0]
    from .errors import FP4ConvertError
    from .tensor import dequantize_input

    try:
        w = dequantize_input(d.decode.kind, tensors, block=d.decode.block)
    except FP4ConvertError as exc:
        raise type(exc)(f"{d.name} (in {d.info.file}): {exc}") from exc
    return w.transpose(-1, -2) if d.decode.transpose else w


def _batches(d: Decision, x: torch.Tensor) -> list[tuple[list[Matrix], torch.Tensor]]:
    """A decision's matrices as batches ``[B, N, K]`` (all experts of one gate/up/down part in one batch)."""
    if len(d.matrices) == 1 and d.matrices[0].expert is None:  # a whole 2-D weight ([in, out] on disk: W^T)
        m = d.matrices[0]
        return [(list(d.matrices), (x.transpose(-1, -2) if m.transpose else x).unsqueeze(0))]
    parts: dict[tuple, list[Matrix]] = {}
    for m in d.matrices:
        parts.setdefault((m.rows, m.transpose), []).append(m)
    out = []
    for (rows, transpose), ms in parts.items():
        v = x.transpose(-1, -2) if transpose else x
        experts = [m.expert for m in ms]
        v = v if experts == list(range(v.shape[0])) else v[experts]
        if rows is not None:
            v = v[:, rows[0]:rows[1]:rows[2]]
        out.append((ms, v))
    return out


def _simple(unit: list[Decision]) -> bool:
    """Every member quantizes its whole 2-D tensor as one matrix (the batched pipeline's case)."""
    from .plan import QUANTIZE

    for d in unit:
        if d.action != QUANTIZE or d.decode is not None or len(d.matrices) != 1 or len(d.info.shape) != 2:
            return False
        m = d.matrices[0]
        if (m.expert is not None or m.rows is not None or m.transpose or m.module != d.module
                or (m.group or d.group) != d.group or tuple(m.shape) != tuple(d.info.shape)):
            return False
    return True


class _Complex:
    """A unit the batched pipeline does not run (stacked experts, decoded quantized inputs, a kept
    decoded input): its own read batch, computed synchronously, written by the write-behind thread."""

    def __init__(self, unit: list[Decision], device, config: ConvertConfig, fmt: OutputFormat,
                 threads: int = 0) -> None:
        self.units = [unit]
        self.members = list(unit)
        self.device, self.config, self.fmt = device, config, fmt
        self.threads = threads  # CPU: torch's intra-op threads for this unit (the pool's workers run with one)

    def reads(self) -> list:
        return [t for d in self.members for t in d.reads]

    def run(self, hosts: list[torch.Tensor], free: Callable) -> Callable[[], tuple]:
        from .plan import QUANTIZE

        import torch

        unit, device = self.members, self.device
        before = torch.get_num_threads()
        if device.type == "cpu" and self.threads:
            torch.set_num_threads(self.threads)
        try:
            on_device = iter([h.to(device, non_blocking=True) for h in hosts])
            xs = [weight_of(d, [next(on_device) for _ in d.reads]) for d in unit]
            if unit[0].action != QUANTIZE:  # a kept quantized input: written as the fp32 weight it encodes
                out = [(unit[0].name, xs[0].contiguous().cpu())]
                recs: dict[str, dict] = {unit[0].name: {}}
            else:
                recs, out = _matrices_unit(unit, xs, self.config, self.fmt)
        finally:
            torch.set_num_threads(before)
            free(None)  # synchronous: outputs are on the host, every copy from these buffers is done
        return lambda: (recs, out)


def _quantize_unit(item, hosts, backend, settings, free):
    """Pass 1 and pass 2 of one batch (one unit on the CPU), started; returns the writer's result function."""
    if isinstance(item, _Complex):
        return item.run(hosts, free)
    return backend.run(item, hosts, settings, free)


def _write_complex(result: Callable[[], tuple], writers, records: dict) -> Callable[[], None]:
    """The writer-thread job of a complex unit: records first (a finished shard's record is complete), then the tensors."""

    def job() -> None:
        recs, out = result()
        for name, rec in recs.items():
            records[name].update(rec)
        for name, t in out:
            writers.tensor(name, t)

    return job


def _matrices_unit(unit: list[Decision], xs: list[torch.Tensor], config: ConvertConfig,
                   fmt: OutputFormat) -> tuple[dict[str, dict], list[tuple[str, torch.Tensor]]]:
    """Pass 1 (amax of every matrix, max per shared-scale group), then pass 2 (quantize, batched per part)."""
    import torch

    from .errors import NonFiniteError, QuantizationError
    from .scheme import get_scheme
    from .tensor import QuantizedTensor, quantize
    from .tensor import amax as tensor_amax

    scheme = get_scheme(config.scheme)
    batches = [(d, ms, t) for d, x in zip(unit, xs) for ms, t in _batches(d, x)]
    group_amax: list[torch.Tensor | None] = [None] * len(batches)
    amax_of: dict[str, float] = {}
    if scheme.global_scale:
        amaxes = [tensor_amax(t, rotate=config.rotate) for _, _, t in batches]
        for (d, _, _), a in zip(batches, amaxes):
            if not bool(torch.isfinite(a).all()):
                raise NonFiniteError(f"{d.name} (in {d.info.file}) holds NaN or Inf; fix the source or --ignore it")
        groups: dict[str, torch.Tensor] = {}
        for (d, ms, _), a in zip(batches, amaxes):
            for m, v in zip(ms, a):
                g = m.group or d.group
                if g:
                    groups[g] = torch.maximum(groups[g], v) if g in groups else v
        for i, ((d, ms, _), a) in enumerate(zip(batches, amaxes)):
            picks = [groups[m.group or d.group] if (m.group or d.group) else v for m, v in zip(ms, a)]
            group_amax[i] = torch.stack(picks)
    results: dict[str, QuantizedTensor] = {}
    for (d, ms, t), ga in zip(batches, group_amax):
        try:
            q = quantize(t, config.scheme, rotate=config.rotate, global_amax=ga, scale_rule=config.rule,
                         scale_layout="swizzled" if fmt.swizzled else "linear")
        except QuantizationError as exc:
            raise type(exc)(f"{d.name} (in {d.info.file}): {exc}") from exc
        if ga is not None:
            amax_of.update(zip((m.module for m in ms), ga.tolist()))
        for i, m in enumerate(ms):
            results[m.module] = q.matrix(i)
    records: dict[str, dict] = {}
    outputs: list[tuple[str, torch.Tensor]] = []
    for d in unit:
        per: dict[str, dict] = {}
        for m in d.matrices:
            q = results[m.module]
            for name, tensor in fmt.tensors(m.module, q):
                outputs.append((name, tensor.cpu()))
            if q.global_scale is not None:
                per[m.module] = {"global_scale": float(q.global_scale), "amax": amax_of[m.module]}
        records[d.name] = next(iter(per.values())) if len(d.matrices) == 1 and per else (
            {"matrices": per} if per else {})
    return records, outputs
