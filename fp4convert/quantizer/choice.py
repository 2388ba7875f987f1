"""Where a conversion computes: the device (a GPU whose kernels load, else the CPU) and the backend that
quantizes on it, chosen by name from the backends' facts (:data:`fp4convert.quantizer.backends.BACKENDS`);
one backend per lane; the device started early while the source is planned.

Choosing imports no torch backend: the facts table says which backends run before torch, which the run
takes without ``--backend`` (the best ``auto_rank`` of its kind on the device, torch-free ones first),
which start their device while the source is planned, and which take ``--input-weights``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from fp4convert.errors import ConfigError, CUDAUnavailableError, FP4ConvertError

if TYPE_CHECKING:
    import torch

    from fp4convert.config import ConvertConfig
    from fp4convert.plan.planner import Plan
    from fp4convert.quantizer.backend import Backend, Settings
    from fp4convert.quantizer.backends import BackendFacts
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)


class World(Protocol):
    """This process's place in a torchrun job, as choosing a device needs it (:class:`fp4convert.run.distributed.World`)."""

    @property
    def distributed(self) -> bool: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def local_size(self) -> int: ...
    def init(self) -> None: ...


def resolve_device(device: str, world: World) -> torch.device:
    """'auto' is the first GPU whose kernels load, else the CPU (with one warning); 'cuda' must work.

    Under torchrun, 'auto' and 'cuda' mean this rank's GPU (LOCAL_RANK, modulo the visible GPUs).
    """
    import torch

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
    device_type = device_kind(config.device)
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
    if name is not None and facts is not None and not facts.needs_torch:
        index = cuda_index(config.device)
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
        if name is not None and config.device == "auto" and "cuda" not in backend_facts(name).devices:
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
        devices = backend_facts(name).devices
        if device.type not in devices:
            raise ConfigError(f"--backend {name} runs on {' or '.join(devices)}, not on {device}; "
                              f"choose --device {devices[0]} or another backend")
        lanes = lane_count(config, world, plan, source, cls.auto_lanes)
        first = cls.open(Context(settings, str(device), world, lanes))
    backends = [first]
    try:
        backends += [first.lane() for _ in range(lanes - 1)]
    except BaseException:
        close_all([b.close for b in reversed(backends)], raising=False)
        raise
    return backends


def device_kind(device: str) -> str | None:
    """The device type a one-process run on ``device`` asks for: ``cpu`` -> "cpu"; ``auto``, ``cuda`` and
    ``cuda:N`` -> "cuda" (``auto`` tries the GPU first); None for anything else (torch's parsing reports it)."""
    return "cpu" if device == "cpu" else "cuda" if cuda_index(device) is not None else None


def cuda_index(device: str) -> int | None:
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
    name, or the torch-free default for the device) says so (its ``prewarm`` fact). Imports nothing heavy
    (the backend's facts are the table's); a machine without a GPU costs nothing."""
    from fp4convert.quantizer.backend import auto_backends, backend_facts, backend_names

    device_type = device_kind(config.device)
    if device_type is None or config.backend not in (None, *backend_names()):  # an unknown one: refused later
        return
    facts: BackendFacts | None = backend_facts(config.backend) if config.backend else \
        next(iter(auto_backends(device_type, needs_torch=False)), None)
    if facts is None or not facts.prewarm or device_type not in facts.devices:
        return
    if device_type == "cpu":
        from fp4convert.kernels import cpu_lib as cpu_kernel

        cpu_kernel.prepare()  # the CPU kernel's one-time build (or load) overlaps the planning
        return
    index = cuda_index(config.device)
    if index is None or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # (torchrun: each rank starts its own)
        return
    from fp4convert.kernels.cuda.runtime import prewarm

    prewarm(index)


def close_all(closers: list[Callable[[], None]], raising: bool = True) -> None:
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


