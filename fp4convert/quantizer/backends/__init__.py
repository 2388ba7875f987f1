"""The backends: one module each, named as ``--backend`` names it (``_`` read as ``-``), and :data:`BACKENDS`,
the table of what the run decides before it opens one.

Each module defines ``BACKEND``, a class implementing :class:`fp4convert.quantizer.backend.Backend`. The table
below is the only list of backends (as :data:`fp4convert.formats.OUTPUT_FORMATS` is for formats): the CLI's
choices, ``--backend``'s refusals and the choice without it (:mod:`fp4convert.quantizer.choice`) read it without
importing any backend module (a torch backend's module imports torch). Adding a backend is a module here, its
row below, and its test.

- ``cpu``: the host's cores, each matrix cut in row slices run by a thread pool (torch CPU ops);
- ``stacked``: torch on a GPU, every shape group of a batch one ``[B, M, K]`` launch (every unit
  kind, torchrun); on the CPU it runs the same scheduling, which is how the tests check it;
- ``cuda``: the GPU without torch (the kernel library through ctypes), plain 2-D weights only;
- ``cpu-native``: the CPU without torch (the compiled CPU kernel through ctypes, every shape group of
  a batch one threaded call), plain 2-D weights only: ``--device cpu``'s default where it qualifies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendFacts:
    """What the run decides about a backend before it opens one (and before torch is imported)."""

    name: str
    devices: tuple[str, ...]  # device types it runs on ("cpu", "cuda")
    needs_torch: bool  # its module imports torch: opened once torch has resolved the device
    auto_rank: int  # without --backend: the highest rank of its kind (torch-free ones are tried first, before
    # torch is imported) that runs on the device and supports the plan; 0: only by name
    prewarm: bool  # its device's start-up (the CPU kernel's build, a GPU's context) overlaps planning
    input_weighted: bool  # it runs the input-weighted search rules (--input-weights)

    @property
    def module(self) -> str:
        return self.name.replace("-", "_")


BACKENDS: dict[str, BackendFacts] = {f.name: f for f in (
    # torch's default on the CPU (before ``stacked``, which runs there too); calls the compiled CPU kernel where it can
    BackendFacts("cpu", ("cpu",), needs_torch=True, auto_rank=2, prewarm=True, input_weighted=True),
    # --device cpu's default for the plans it supports; the CPU kernel (built or loaded while planning) has no
    # input-weighted search
    BackendFacts("cpu-native", ("cpu",), needs_torch=False, auto_rank=1, prewarm=True, input_weighted=False),
    # the default on a GPU (--device auto or cuda[:N]) for the plans it supports; the GPU's driver, kernel library
    # and context start while the source is planned
    BackendFacts("cuda", ("cuda",), needs_torch=False, auto_rank=1, prewarm=True, input_weighted=True),
    # torch's default on a GPU (on the CPU ``cpu`` ranks higher); torch starts its own device
    BackendFacts("stacked", ("cuda", "cpu"), needs_torch=True, auto_rank=1, prewarm=False, input_weighted=True),
)}
