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
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.config import ConvertConfig
from fp4convert.errors import ConfigError, PlanError
from fp4convert.run.distributed import World, assign
from fp4convert.run.progress import Bar, progress_bar
from fp4convert.run.readahead import advise
from fp4convert.run.runner import ConvertResult, Job, plan_warnings, run

if TYPE_CHECKING:

    from fp4convert.calibrate.store import Store
    from fp4convert.formats.base import OutputFormat
    from fp4convert.plan.planner import Plan
    from fp4convert.quantizer.backend import InputWeight
    from fp4convert.run.work import Work
    from fp4convert.source.release import ShardReleaser
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)

__all__ = ["ConvertResult", "convert", "plan_conversion", "plan_warnings", "start_early"]


def plan_conversion(src: str | Source, config: ConvertConfig, fetch_ahead: bool = False, requantize: bool = False
                    ) -> tuple[Source, Plan, OutputFormat]:
    """Open the source and plan it from headers alone (what ``--dry-run`` shows).

    ``fetch_ahead`` (a conversion follows): a Hub source starts downloading its first shards while
    the plan is made (:meth:`Source.prefetch_early`; not for ``--resume`` or under torchrun, whose
    runs read another order); stopped again if planning fails. ``requantize``: an FP4 source is decoded
    and quantized again (by default it is refused here: ``fp4convert.checkpoint.export`` re-lays it)."""
    from fp4convert.calibrate import plan_calibration
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
        fmt = get_format(fmt.name, config.activations)  # the format writing activation scales (W4A4)
    calibration = plan_calibration(source, config)  # a model run that cannot happen is refused here: exit 2
    if fetch_ahead and not config.resume and int(os.environ.get("WORLD_SIZE", "1") or 1) == 1:
        source.prefetch_early()  # the first shard downloads while the headers are read and the plan is made
    try:
        tensors = source.tensors()  # every header (by range, for a Hub source, several at a time)
        plan = make_plan(tensors, config, fmt, source.config())
        plan.calibration = calibration
    except BaseException:
        source.stop_prefetch()
        raise
    return source, plan, fmt


@dataclass(frozen=True)
class Measured:
    """What the layer-by-layer stage measured, handed down to the work and the manifest as data."""

    input_weights: dict[str, InputWeight] | None = None  # the weight scale rules' input weights, per module
    input_weight_record: dict | None = None  # their identity (digest included): --resume refuses others
    activation_amax: dict[str, float] | None = None  # W4A4 NVFP4: each quantized module's input amax
    calibration: dict | None = None  # W4A4 NVFP4: how the activation amax was found (the manifest records it)
    store: Store | None = None  # a calibrated method: the matrices it quantized (written instead of quantized again)
    method: dict | None = None  # a calibrated method: what the manifest says of its pass


def _statistics(source: Source, plan: Plan, config: ConvertConfig, world: World) -> Measured:
    """The layer-by-layer stage, before anything is written: whatever the plan's calibration
    (:attr:`Plan.calibration`) asks: W4A4 NVFP4's activation amax, the weight scale rules' input weights,
    a calibrated method's pass. Nothing runs for the data-free default. Under torchrun the ranks share it
    (fp4convert.calibrate.statistics) and every rank ends with the result one process would have."""
    from fp4convert.calibrate import statistics

    cal = plan.calibration
    if cal is None or (cal.amax == "none" and not cal.runs_model):
        return Measured()
    device = None if config.device == "auto" else config.device
    if device is None and cal.runs_model:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if world.distributed and device == "cuda":
        import torch

        device = f"cuda:{world.local_rank % max(torch.cuda.device_count(), 1)}"  # (each rank its own GPU)
    world.init()  # (torchrun: the ranks share the calibration, run/distributed.py)
    with timing.timed("calibrate"):
        st = statistics(source, plan, config, device, world.calibration_group(device))
    if st.input_weights is not None:
        log.info("input weights (%s): %d matrices weighted", cal.input_weights, len(st.input_weights))
    amax = cal.amax != "none"
    return Measured(st.input_weights, st.input_weight_record, st.amax if amax else None,
                    st.calibration if amax else None, st.store, st.method_record)


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
        start_early(config)  # the GPU starts while the source is planned
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
    from fp4convert.calibrate import check_destination
    from fp4convert.numerics.scheme import get_scheme
    from fp4convert.output.record import run_identity
    from fp4convert.quantizer.backend import Settings
    from fp4convert.quantizer.choice import close_all, open_backends
    from fp4convert.run.work import QuantizeWork

    try:
        if world.rank == 0 and plan_.calibration is not None and plan_.calibration.runs_model:
            check_destination(dst, source, config)  # before the model runs: a refusal costs no calibration
        measured = _statistics(source, plan_, config, world)
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
                                      measured.store) for b in backends]
    try:
        # what the input weights were measured as (digest included): --resume refuses other statistics
        record = measured.input_weight_record
        identity = run_identity(config, source, **({"input_weights": record} if record else {}))
        job = Job(source, plan_, fmt, dst, config, identity, others, release, measured.calibration, measured.method)
        with shown as bar:
            done = run(job, world, works, bar)
    except BaseException:
        source.stop_prefetch()
        close_all([b.close for b in reversed(backends)], raising=False)  # the run's own error is the one to report
        if measured.store is not None and world.rank == 0:
            _persist_store(measured.store)
        raise
    close_all([b.close for b in reversed(backends)])
    _gpu_peak()
    if measured.store is not None and world.rank == 0:
        measured.store.remove()  # written: the method's matrices are not needed again
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reused = sorted(f for f in done if f in dict(plan_.shards))
    wait = sum(w.read_wait_s for w in works)
    return ConvertResult(dst, plan_, time.perf_counter() - t0, peak, reused, wait, timing.snapshot(), timing.counts())


def _persist_store(store: Store) -> None:
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


def start_early(config: ConvertConfig) -> None:
    """What can start while the source is planned: the device the run will take (a GPU's context, the CPU
    kernel's build: :func:`~fp4convert.quantizer.choice.prewarm_device`) and, on a thread, the model card's
    library (the card is the run's last step). Imports nothing heavy."""
    from fp4convert.output.card import preload
    from fp4convert.quantizer.choice import prewarm_device

    preload()
    prewarm_device(config)

