"""The converter's entry point: source -> plan -> quantize -> write -> manifest.

:func:`plan_conversion` opens the source and plans it from headers alone (what ``--dry-run`` shows).
:func:`convert` then asks the kernel to start reading the source in plan order (``posix_fadvise``)
while the device starts, opens a backend by name (:mod:`fp4convert.quantizer.backend`; one per lane) and
hands the run to the one run loop (:mod:`fp4convert.run.runner`), which reads, quantizes and writes
every unit and finishes with the manifest. docs/architecture.md draws the whole data flow.

Importing this module imports no torch: ``--dry-run``, argument errors and the torch-free CUDA
backend never pay for it.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.config import ConvertConfig
from fp4convert.errors import ConfigError, CUDAUnavailableError, FP4ConvertError, PlanError
from fp4convert.run.distributed import World, assign
from fp4convert.run.progress import Bar, progress_bar
from fp4convert.run.readahead import advise
from fp4convert.run.runner import ConvertResult, Job, plan_warnings, run

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.store import Store
    from fp4convert.formats.base import OutputFormat
    from fp4convert.plan.planner import Plan
    from fp4convert.quantizer.backend import Backend, InputWeight, Settings
    from fp4convert.run.work import Work
    from fp4convert.source.release import ShardReleaser
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)

__all__ = ["ConvertResult", "convert", "plan_conversion", "plan_warnings", "resolve_device"]


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
            from fp4convert.kernels.cuda import ops

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


def plan_conversion(src: str | Source, config: ConvertConfig, fetch_ahead: bool = False, requantize: bool = False
                    ) -> tuple[Source, Plan, OutputFormat]:
    """Open the source and plan it from headers alone (what ``--dry-run`` shows).

    ``fetch_ahead`` (a conversion follows): a Hub source starts downloading its first shards while
    the plan is made (:meth:`Source.prefetch_early`; not for ``--resume`` or under torchrun, whose
    runs read another order); stopped again if planning fails. ``requantize``: an FP4 source is decoded
    and quantized again (by default it is refused here: ``fp4convert.checkpoint.export`` re-lays it)."""
    from fp4convert.formats import get_format
    from fp4convert.output.manifest import load_manifest
    from fp4convert.plan.planner import make_plan
    from fp4convert.plan.sources import check_source
    from fp4convert.source.open import open_source
    from fp4convert.source.source import Source

    source = src if isinstance(src, Source) else open_source(src, config.revision)
    check_source(source.root, source.config(), load_manifest(source.root), requantize)  # decode, re-lay or refuse
    fmt = get_format(config.format)
    if not source.config() and not config.allow_no_config:
        raise PlanError(f"{source.label} has no config.json: no loader (transformers, vLLM, SGLang) can load the "
                        "output, and the plan cannot know the model; add the model's config.json, or pass "
                        "--allow-no-config to convert the tensors anyway")
    if config.activations != "none":
        fmt = _w4a4_format(source, config, fmt)
    elif config.input_weight_source != "none":
        from fp4convert.calibrate import check_runnable

        check_runnable(source, config)  # --input-weights on a model the layer-by-layer run cannot run: exit 2
    if fetch_ahead and not config.resume and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
        source.prefetch_early()  # the first shard downloads while the headers are read and the plan is made
    try:
        tensors = source.tensors()  # every header (by range, for a Hub source, several at a time)
        plan = make_plan(tensors, config, fmt, source.config())
    except BaseException:
        source.stop_prefetch()
        raise
    return source, plan, fmt


def _w4a4_format(source: Source, config: ConvertConfig, fmt: OutputFormat) -> OutputFormat:
    """W4A4 (--activations): the format writing activation scales; a model calibration cannot run
    is refused here, before anything is written (fp4convert.calibrate)."""
    from fp4convert.calibrate import check_runnable
    from fp4convert.formats import get_format

    check_runnable(source, config)
    return get_format(fmt.name, config.activations)


@dataclass(frozen=True)
class Measured:
    """What the layer-by-layer stage measured, handed down to the work and the manifest as data."""

    input_weights: dict[str, InputWeight] | None = None  # the weight scale rules' input weights, per module
    input_weight_record: dict | None = None  # their identity (digest included): --resume refuses others
    activation_amax: dict[str, float] | None = None  # W4A4 NVFP4: each quantized module's input amax
    calibration: dict | None = None  # W4A4 NVFP4: how the activation amax was found (the manifest records it)
    quantized: Store | None = None  # --method gptq: the matrices it quantized (written instead of quantized again)
    method: dict | None = None  # --method gptq: what the manifest says of the pass


def _statistics(source: Source, plan: Plan, fmt: OutputFormat, config: ConvertConfig) -> Measured:
    """The layer-by-layer stage, before anything is written: W4A4 NVFP4's activation amax and the input
    weights of the weight scale rules (``config.input_weight_source``), with their identity record.
    Nothing runs when neither is asked for (the data-free default)."""
    from fp4convert.calibrate import runs_model, statistics

    calibrate = fmt.activations == "nvfp4"
    if not calibrate and not runs_model(config):
        return Measured()
    device = None if config.device == "auto" else config.device
    if device is None and runs_model(config):
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    with timing.timed("calibrate"):
        st = statistics(source, plan, config, device)
    if st.input_weights is not None:
        log.info("input weights (%s): %d matrices weighted", config.input_weight_source, len(st.input_weights))
    return Measured(st.input_weights, st.input_weight_record, st.amax if calibrate else None,
                    st.calibration if calibrate else None, st.gptq, st.gptq_record)


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
    progress: bool = False,
    *,
    delete_source_shards: bool = False,
    plan: tuple[Source, Plan, OutputFormat] | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` (folder or Hub repo id) into ``dst``.

    ``progress``: show the run's progress on stderr (:mod:`fp4convert.run.progress`: a bar on a
    terminal, a line every few seconds otherwise), in input bytes, from when the source is planned.
    ``delete_source_shards``: a Hub source's cached shards are deleted as soon as the run has read
    them for the last time (ConfigError for a local folder, or under torchrun). ``plan``: the result
    of :func:`plan_conversion` when the caller already planned (the CLI prints the plan's warnings
    first), so the source is planned once. Under torchrun (WORLD_SIZE > 1) every rank calls this
    with the same arguments.
    """
    t0 = time.perf_counter()
    timing.reset()
    dst = Path(dst)
    world = World.from_env()
    if plan is None:
        prewarm_device(config)  # the GPU starts while the source is planned
    with timing.timed("plan"):
        source, plan_, fmt = plan if plan is not None else plan_conversion(src, config, fetch_ahead=True)
    try:
        release = None
        if delete_source_shards:
            from fp4convert.source.release import ShardReleaser

            if world.distributed:
                raise ConfigError("--delete-source-shards cannot be used under torchrun (another rank may still "
                                  "read a shard); convert with one process, or keep the source shards")
            release = ShardReleaser(source, plan_)
        shown = progress_bar(plan_.summary()["bytes_in"], "quantize", progress)
    except BaseException:
        source.stop_prefetch()  # a Hub source may be fetching since planning: nothing more is downloaded
        raise
    return _convert(source, plan_, fmt, dst, config, world, shown, release, t0)


def _convert(source: Source, plan_: Plan, fmt: OutputFormat, dst: Path, config: ConvertConfig, world: World,
             shown: AbstractContextManager[Bar], release: ShardReleaser | None, t0: float) -> ConvertResult:
    """The conversion once planned: statistics, backends, the run loop (which tells ``release`` and the
    progress display ``shown``, started once the statistics are measured: a calibration shows its own)."""
    from fp4convert.calibrate import check_destination, runs_model
    from fp4convert.numerics.scheme import get_scheme
    from fp4convert.output.record import run_identity
    from fp4convert.quantizer.backend import Settings
    from fp4convert.run.work import QuantizeWork

    try:
        if world.rank == 0 and (fmt.activations == "nvfp4" or runs_model(config)):
            check_destination(dst, source, config)  # before the model runs: a refusal costs no calibration
        measured = _statistics(source, plan_, fmt, config)
        _advise_source(source, plan_, assign(plan_, world))
        others = source.other_files(exclude=dst)  # the one walk of the source folder

        t_start = time.perf_counter()
        settings = Settings(get_scheme(config.scheme), config.rotate, fmt.swizzled, config.rule)
        backends = open_backends(config, world, plan_, source, settings)
    except BaseException:
        source.stop_prefetch()  # a Hub source may be fetching since planning: nothing more is downloaded
        raise
    timing.add("startup", time.perf_counter() - t_start)
    timing.count("lanes", len(backends))
    works: list[Work] = [QuantizeWork(source, fmt, settings, b, measured.input_weights, measured.activation_amax,
                                      measured.quantized) for b in backends]
    try:
        # what the input weights were measured as (digest included): --resume refuses other statistics
        record = measured.input_weight_record
        identity = run_identity(config, source, **({"input_weights": record} if record else {}))
        job = Job(source, plan_, fmt, dst, config, identity, others, release, measured.calibration, measured.method)
        with shown as bar:
            done = run(job, world, works, bar)
    except BaseException:
        source.stop_prefetch()
        _close_all([b.close for b in reversed(backends)], raising=False)  # the run's own error is the one to report
        if measured.quantized is not None and world.rank == 0:
            _keep_quantized(measured.quantized)
        raise
    _close_all([b.close for b in reversed(backends)])
    _gpu_peak()
    if measured.quantized is not None and world.rank == 0:
        measured.quantized.remove()  # written: the kept matrices are not needed again
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reused = sorted(f for f in done if f in dict(plan_.shards))
    wait = sum(w.read_wait_s for w in works)
    return ConvertResult(dst, plan_, time.perf_counter() - t0, peak, reused, wait, timing.snapshot(), timing.counts())


def _keep_quantized(store: Store) -> None:
    """An interrupted conversion keeps the calibrated method's matrices for ``--resume`` (those held in
    memory go to disk now); best effort: failing costs only a second pass."""
    try:
        store.persist()
    except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
        log.warning("the quantized matrices of the calibrated pass were not kept (%s): --resume runs it again", exc)


def _gpu_peak() -> None:
    """The run's peak GPU memory held by torch (calibration, GPTQ, the torch backends), when it used CUDA."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        timing.count("gpu_peak_MB", max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())) / 2**20)


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


def lane_count(config: ConvertConfig, world: World, plan: Plan, source: Source, auto: int) -> int:
    """How many lanes this run gets: ``config.lanes``, else (0: auto) the backend's ``auto`` for a local
    source in one process, one elsewhere; never more than the shards there are to write."""
    if world.distributed or source.is_hub:
        return 1  # torchrun splits across processes; a Hub source's shards are released in plan order
    want = config.lanes or auto
    return max(1, min(want, len(plan.shards)))


def choose_backend(config: ConvertConfig, world: World, plan: Plan) -> str | None:
    """The backend a run takes from the plan alone: ``--backend`` when given; in one process, the best
    torch-free backend (:func:`~fp4convert.quantizer.backend.auto_backends`) that runs on the device asked
    for (``--device cpu``: the CPU; ``auto`` or ``cuda[:N]``: a GPU) and supports the plan; else None:
    torch's, decided once the device is known (:func:`open_backends`). Imports no torch backend."""
    from fp4convert.quantizer.backend import auto_backends, backend_facts, backend_names, get_backend

    if config.backend:
        if config.backend not in backend_names():
            raise ConfigError(f"--backend {config.backend!r}: choose one of {', '.join(backend_names())}")
        facts = backend_facts(config.backend)
        if config.input_weight_source != "none" and not facts.input_weighted:
            other = next((f.name for d in facts.devices for f in auto_backends(d, True) + auto_backends(d, False)
                          if f.input_weighted), None)
            raise ConfigError(f"--backend {config.backend} has no input-weighted search; "
                              + (f"choose --backend {other} for " if other else "leave out ")
                              + f"--input-weights {config.input_weight_source}")
        return config.backend
    device_type = _device_type(config.device)
    if world.distributed or device_type is None:
        return None
    return next((f.name for f in auto_backends(device_type, needs_torch=False) if get_backend(f.name).supports(plan)),
                None)


def open_backends(config: ConvertConfig, world: World, plan: Plan, source: Source,
                  settings: Settings) -> list[Backend]:
    """One backend per lane, chosen by name (:func:`choose_backend`). A torch-free backend
    (``Backend.needs_torch`` False: ``cuda``, ``cpu-native``) falls back to torch's when the GPU or the kernel
    library is not there (``auto`` then falls back to the CPU with a warning, ``cuda`` without a GPU is an
    error); torch's is the best one for the device (``Backend.auto_rank``: ``stacked`` on a GPU, ``cpu`` on
    the CPU)."""
    from fp4convert.quantizer.backend import Context, auto_backends, backend_facts, get_backend

    name = choose_backend(config, world, plan)
    first = None
    facts = backend_facts(name) if name is not None else None
    if facts is not None and not facts.needs_torch:
        index = _cuda_index(config.device)
        on_gpu = "cpu" not in facts.devices
        if on_gpu and index is None:
            raise ConfigError(f"--backend {name} runs on a GPU; --device {config.device} is not one")
        lanes = lane_count(config, world, plan, source, get_backend(name).auto_lanes)
        try:
            device = f"cuda:{index}" if on_gpu else "cpu" if config.device == "auto" else config.device
            first = get_backend(name).open(Context(settings, device, world, lanes))
        except FP4ConvertError as exc:
            if config.backend:
                raise
            log.debug("torch-free %s backend unavailable (%s); using torch", name, exc)
            name = None
    if first is None:
        world.init()
        if name is not None and config.device == "auto" and "cuda" not in get_backend(name).devices:
            import torch

            device = torch.device("cpu")  # --backend cpu on a machine with a GPU
        else:
            device = resolve_device(config.device, world)  # from here on the work needs torch
        if name is None:
            name = next((f.name for f in auto_backends(device.type, needs_torch=True) if get_backend(f.name).supports(plan)),
                        None)
            if name is None:
                raise ConfigError(f"no backend runs this plan on {device}; choose one with --backend")
        cls = get_backend(name)
        if device.type not in cls.devices:
            raise ConfigError(f"--backend {name} runs on {' or '.join(cls.devices)}, not on {device}; "
                              f"choose --device {cls.devices[0]} or another backend")
        lanes = lane_count(config, world, plan, source, cls.auto_lanes)
        first = cls.open(Context(settings, str(device), world, lanes))
    backends = [first]
    try:
        backends += [first.lane() for _ in range(lanes - 1)]
    except BaseException:
        _close_all([b.close for b in reversed(backends)], raising=False)
        raise
    return backends


def _device_type(device: str) -> str | None:
    """The device type a one-process run on ``device`` asks for: ``cpu`` -> "cpu"; ``auto``, ``cuda`` and
    ``cuda:N`` -> "cuda" (``auto`` tries the GPU first); None for anything else (torch's parsing reports it)."""
    return "cpu" if device == "cpu" else "cuda" if _cuda_index(device) is not None else None


def _cuda_index(device: str) -> int | None:
    """The GPU a one-process run on ``device`` would use: ``auto`` / ``cuda`` -> 0, ``cuda:N`` -> N;
    None for the CPU or a malformed index (torch's device parsing reports that one)."""
    if device in ("auto", "cuda"):
        return 0
    if not device.startswith("cuda:"):
        return None
    try:
        return int(device.split(":", 1)[1])
    except ValueError:
        return None


def prewarm_device(config: ConvertConfig) -> None:
    """Start the device in the background now, while the source is planned: a one-process CUDA run's
    GPU (driver, kernel library, context), a CPU run's kernel, when the backend the run will take (by
    name, or the torch-free default for the device) says so (``Backend.prewarm``). Imports nothing heavy
    (the backend's facts are read from its source); a machine without a GPU costs nothing. The model
    card's library is imported on a thread too (the card is the run's last step)."""
    from fp4convert.output.card import preload
    from fp4convert.quantizer.backend import auto_backends, backend_facts, backend_names

    preload()
    device_type = _device_type(config.device)
    if device_type is None or config.backend not in (None, *backend_names()):  # an unknown one: refused later
        return
    if config.backend:
        facts = backend_facts(config.backend)
    else:
        facts = next(iter(auto_backends(device_type, needs_torch=False)), None)
    if facts is None or not facts.prewarm or device_type not in facts.devices:
        return
    if device_type == "cpu":
        from fp4convert.kernels import cpu_lib as cpu_kernel

        cpu_kernel.prepare()  # the CPU kernel's one-time build (or load) overlaps the planning
        return
    index = _cuda_index(config.device)
    if index is None or World.from_env().distributed:
        return
    from fp4convert.kernels.cuda.runtime import prewarm

    prewarm(index)
