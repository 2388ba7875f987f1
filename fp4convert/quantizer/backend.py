"""The backend seam: what quantizes a run's work items, whatever it launches them on.

A backend is one module in :mod:`fp4convert.quantizer.backends` whose ``BACKEND`` class implements
:class:`Backend`; it is found by its name (the module's, ``_`` read as ``-``), so adding one is adding
that module. Every backend takes the same items (:mod:`fp4convert.quantizer.items`: a :class:`~fp4convert.
schedule.Batch` of plain 2-D weights, or one :class:`~fp4convert.quantizer.items.Complex` unit: stacked
experts, a decoded FP8/MXFP4 input) from the same reader, runs the same two passes (docs/numerics.md,
"The pipeline"): pass 1 takes every matrix's amax, :func:`unit_amax` the max over each fused group,
pass 2 quantizes every block with its group's amax; and returns one :class:`Result`, which one write
job (:func:`fp4convert.run.work.write_result`) checks (:func:`refuse_nonfinite`) and hands to the format
and the shards. The bytes never depend on the backend (tests/run/test_pipeline.py, tests/quantizer/test_backend_cuda.py).

A backend never calls up: :meth:`Backend.stage` and :meth:`Backend.quantize` return data
(:class:`Staged`, :class:`Pending`) that say when the reader may refill the item's host buffer, and the
run loop (:mod:`fp4convert.run.work`) tells the reader.

Imports nothing heavy: choosing a backend does not import torch. What the run asks before opening one
(whether it needs torch, its rank for the automatic choice, whether its device starts while the source is
planned, whether it runs the input-weighted search) is a class attribute of the backend, read from its
module's source (:func:`backend_facts`), so no name of a backend is compared outside its module.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fp4convert.errors import ConfigError, nonfinite_error
from fp4convert.numerics.scheme import Scheme
from fp4convert.quantizer.backends import BACKENDS, BackendFacts

log = logging.getLogger(__name__)

# Below this amax NVFP4's global scale 2688 / amax saturates at FLT_MAX (docs/numerics.md "The global
# scale") and the matrix's blocks decode to (almost) zeros.
_SATURATING_AMAX = 2688.0 / 3.4028234663852886e38

if TYPE_CHECKING:
    from fp4convert.plan.planner import Plan
    from fp4convert.quantizer.items import Item
    from fp4convert.storage.safetensors import TensorInfo


@dataclass(frozen=True)
class Settings:
    """What quantizing needs from the config and the output format."""

    scheme: Scheme
    rotate: str | None
    swizzle: bool  # block scales in the 128x4 layout (the native format) or linear (the engines')
    rule: str  # the scale rule in effect (scheme.py lists each scheme's rules)


class Place(Protocol):
    """This process's place in a torchrun job, as a backend needs it (:class:`fp4convert.run.distributed.World`)."""

    @property
    def distributed(self) -> bool: ...
    @property
    def local_size(self) -> int: ...


@dataclass(frozen=True)
class Context:
    """Where and how a backend runs: the settings, the resolved device ("cpu", "cuda:N"), this process's
    place in a torchrun job, and how many lanes of this backend will run side by side."""

    settings: Settings
    device: str
    world: Place
    lanes: int = 1


class HostBuffer(Protocol):
    """Host memory the reader fills (pinned for a GPU backend): its size and byte views."""

    size: int

    def view(self, offset: int, n: int) -> memoryview: ...


class Event(Protocol):
    """A point in a device's work (a CUDA event): done once ``synchronize()`` returns."""

    def synchronize(self) -> None: ...


# An item's inputs as the reader delivers them: one buffer, and each read tensor's offset in it.
Inputs = tuple[HostBuffer, list[tuple[int, "TensorInfo"]]]


@dataclass(frozen=True)
class InputWeight:
    """One linear input's per-channel weights for the search rules' block error (docs/numerics.md
    "Input weights"): fp32 [K] (little-endian bytes: no torch needed to carry them), and the module
    whose input was measured. Fused members share one input, hence one object: a backend launches
    consecutive matrices with the same ``key`` together."""

    key: str
    data: bytes

    @property
    def k(self) -> int:
        return len(self.data) // 4


def attach_input_weights(items: Iterable[Item], weights: Mapping[str, InputWeight] | None) -> None:
    """Give each item's matrices their module's input weight (a missing module: unweighted). Without
    weights the items keep ``input_weights = None`` and every backend runs its unweighted path."""
    if not weights:
        return
    for it in items:
        it.input_weights = [weights.get(m.module) for _, m in it.matrices]


def matrix_weights(item: Item) -> list[InputWeight | None]:
    """The input weight of each of the item's matrices (None: unweighted), in ``item.matrices`` order."""
    w = item.input_weights
    return list(w) if w is not None else [None] * len(item.matrices)


def weight_runs(idx: Sequence[int], weights: Sequence[InputWeight | None]) -> list[tuple[int, int, InputWeight | None]]:
    """A launch group's members (matrix indices ``idx``, in launch order) cut into runs ``[j0, j1)`` of
    consecutive members with one input weight: a kernel launch takes one weight vector for all its
    matrices. Unweighted items are one run."""
    runs: list[tuple[int, int, InputWeight | None]] = []
    for j, i in enumerate(idx):
        w = weights[i]
        if runs and _key(runs[-1][2]) == _key(w):
            runs[-1] = (runs[-1][0], j + 1, runs[-1][2])
        else:
            runs.append((j, j + 1, w))
    return runs


def _key(w: InputWeight | None) -> str | None:
    return None if w is None else w.key


@dataclass
class MatrixOut:
    """One quantized matrix: the bytes a format stores, and its record's values."""

    packed: memoryview  # E2M1 codes, two per byte, [M, K/2]
    scale: memoryview  # block scales in the format's layout (Settings.swizzle)
    gs: float | None  # NVFP4: the encode scale 2688 / amax (fp32 value); MXFP4: None
    amax: float | None  # NVFP4: the amax gs came from (its fused group's); MXFP4: None


@dataclass
class Result:
    """What a backend made of one item, in the item's matrix order (``item.matrices``).

    ``refused[i]``: matrix i met NaN/Inf (its amax, or a block in pass 2); then ``matrices[i]`` may be
    None, and nothing of the item is written. ``tensors``: outputs that are no quantized matrix (a kept
    decoded input, written as its fp32 weight). ``keep``: holds the memory the views point into until
    the bytes are written.
    """

    matrices: list[MatrixOut | None]
    refused: list[bool]
    tensors: list[tuple[str, memoryview]] = field(default_factory=list)
    keep: object = None


class InUse:
    """The passes still read the item's host buffer itself (:data:`IN_USE`): the :class:`Pending` says when it is free."""

    def __repr__(self) -> str:
        return "IN_USE"


IN_USE = InUse()


@dataclass
class Staged:
    """An item a backend has taken in (:meth:`Backend.stage`), before its passes.

    ``inputs_free``: when the reader may refill the item's host buffer: once the event has completed
    (a GPU backend's copy of the inputs to the device), None: now, or :data:`IN_USE` while the passes
    read the buffer in place (the CPU backends; the ``cuda`` backend, whose one stream syncs after pass
    1). ``state``: the backend's own, what its :meth:`Backend.quantize` continues from.
    """

    item: Item
    inputs: Inputs
    inputs_free: Event | None | InUse = IN_USE
    state: Any = None


class Pending:
    """One item's passes as :meth:`Backend.quantize` returns them: started, perhaps still running.

    ``inputs_free``: when the reader may refill the item's host buffer (once the event completed; None:
    now), for an item whose :class:`Staged` said :data:`IN_USE`. :meth:`result` waits for the
    :class:`Result` (the write job calls it on a writer thread). This class holds a finished Result; a
    backend whose work finishes later returns a subclass whose :meth:`result` waits for it.
    """

    def __init__(self, result: Result | None = None, inputs_free: Event | None = None) -> None:
        self._result = result
        self.inputs_free = inputs_free

    def result(self) -> Result:
        assert self._result is not None, "a Pending subclass waits for its result"
        return self._result


class Backend(Protocol):
    """What the run loop asks of a backend (one instance per lane)."""

    name: ClassVar[str]  # its row in fp4convert.quantizer.backends.BACKENDS (devices, auto rank, ...)
    batch_units: ClassVar[int]  # consecutive plain units one batch may hold (1: a unit at a time)
    batch_bytes: ClassVar[int]  # ... and their input bytes at most
    auto_lanes: ClassVar[int]  # lanes a one-process run of a local folder gets when --lanes is not given

    @classmethod
    def supports(cls, plan: Plan) -> bool:
        """Can it run every unit of this plan (decided from the plan alone)?"""
        ...

    @classmethod
    def open(cls, ctx: Context) -> Backend:
        """The first lane's backend; CUDAUnavailableError when the device cannot run it."""
        ...

    def lane(self) -> Backend:
        """Another lane's backend (its own stream and buffers; what can be shared is)."""
        ...

    def thread_init(self) -> None:
        """Run first in every thread that allocates or launches for it (CUDA: select its GPU)."""
        ...

    def host_buffer(self, nbytes: int) -> HostBuffer:
        """A buffer the reader fills with an item's inputs (pinned memory for a GPU)."""
        ...

    def stage(self, item: Item, inputs: Inputs) -> Staged:
        """Take in ``item``'s inputs (a GPU backend queues their copy to the device); the
        :class:`Staged` says when the reader may refill their buffer."""
        ...

    def quantize(self, staged: Staged) -> Pending:
        """Start both passes on a staged item; returns once they are queued or done (never waiting for
        the writes): the :class:`Pending` says when the inputs are free and waits for the :class:`Result`."""
        ...

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        """NaN or Inf anywhere in ``data`` (a kept tensor's bytes, safetensors ``dtype``)."""
        ...

    def close(self) -> None: ...


def unit_amax(amax: Sequence[float], keys: Sequence[Hashable | None]) -> list[float]:
    """Per matrix, the amax its global scale comes from: the max over the matrices sharing its key (a
    fused group shares one global scale, docs/numerics.md), its own for key None. NaN propagates:
    such a group is refused before pass 2 anyway, and never gets a finite scale from a NaN."""
    best: dict[Hashable, float] = {}
    for a, k in zip(amax, keys):
        if k is None:
            continue
        m = best.get(k)
        if m is None or a != a or (m == m and a > m):  # a NaN, once in, stays
            best[k] = a
    return [a if k is None else best[k] for a, k in zip(amax, keys)]


def nonfinite_amax(amax: Sequence[float]) -> list[bool]:
    """Pass 1's verdict per matrix: its amax is NaN or Inf (the matrix holds them, or overflowed in the rotation)."""
    return [not math.isfinite(a) for a in amax]


def two_passes(item: Item, settings: Settings, amax_pass: Callable[[], list[float]],
               quantize_pass: Callable[[list[float] | None], Pending]) -> Pending:
    """The order every backend runs an item in: pass 1 (``amax_pass``: every matrix's amax, on the
    host), each fused group's max, the refusal of NaN/Inf before anything is quantized (a finished
    :class:`Pending` of refused matrices, its inputs free now: pass 1 is done with them), then pass 2
    (``quantize_pass`` with each matrix's group amax; None for a scheme without a global scale).
    The two callables are the backend's own passes, called here and now (nothing is kept)."""
    ga = None
    if settings.scheme.global_scale:
        amax = amax_pass()
        refused = nonfinite_amax(amax)
        if any(refused):
            return Pending(Result([None] * len(refused), refused), inputs_free=None)
        ga = unit_amax(amax, item.keys)
        for (d, _), a in zip(item.matrices, ga):
            if 0.0 < a < _SATURATING_AMAX:
                log.warning("warning: %s: every |value| is below %.2g (max %.3g), so its NVFP4 global scale saturates "
                            "and it decodes to zeros; keep it unquantized (--ignore) or fix the source", d.name,
                            _SATURATING_AMAX, a)
    return quantize_pass(ga)


def refuse_nonfinite(item: Item, refused: Sequence[bool], rotate: str | None) -> None:
    """The refusal, stated once: the first matrix that met NaN/Inf names its source tensor (exit 3)."""
    for (d, _), bad in zip(item.matrices, refused):
        if bad:
            raise nonfinite_error(d.name, d.info.file, rotate)


# -- the registry -----------------------------------------------------------------------------------

def backend_names() -> list[str]:
    """Every backend's name (:data:`fp4convert.quantizer.backends.BACKENDS`; none is imported)."""
    return sorted(BACKENDS)


def get_backend(name: str) -> type[Backend]:
    """The backend class registered under ``name`` (its module is imported now)."""
    return importlib.import_module(f".backends.{backend_facts(name).module}", __package__).BACKEND


def backend_facts(name: str) -> BackendFacts:
    """The :class:`~fp4convert.quantizer.backends.BackendFacts` of the backend registered under ``name``
    (from the table: choosing a backend, and starting its device while the source is planned, import
    neither torch nor the backend)."""
    facts = BACKENDS.get(name)
    if facts is None:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(backend_names())}")
    return facts


def auto_backends(device_type: str, needs_torch: bool) -> list[BackendFacts]:
    """The backends a run without ``--backend`` may take on ``device_type`` ("cpu", "cuda"), of one kind
    (torch-free ones, tried before torch is imported; or torch's, once the device is known), best first
    (``Backend.auto_rank``; 0: never without ``--backend``)."""
    facts = [backend_facts(n) for n in backend_names()]
    return sorted((f for f in facts if f.auto_rank > 0 and device_type in f.devices and f.needs_torch == needs_torch),
                  key=lambda f: -f.auto_rank)
