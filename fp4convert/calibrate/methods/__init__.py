"""Calibrated rounding methods (``--method``): one module each, found by name, like the backends.

A method is a module here whose ``METHOD`` class implements :class:`Method`. ``rtn`` (round to nearest,
every block on its own) is no method module: it is the quantize stage itself. A method runs while the
model runs block by block on the calibration tokens (:meth:`~fp4convert.calibrate.layerwise.LayerwiseModel.blocks`),
quantizes each block's matrices, and keeps their bytes in a :class:`~fp4convert.calibrate.store.Store`;
the quantize stage writes those instead of quantizing them again, and the manifest records
:meth:`Method.record` (the card and ``inspect`` say its ``description``).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, ClassVar, Protocol

from fp4convert.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.layerwise import LayerwiseModel
    from fp4convert.calibrate.stats import Observers
    from fp4convert.calibrate.store import Store
    from fp4convert.config import ConvertConfig
    from fp4convert.plan.planner import Plan


class Method(Protocol):
    """What the statistics stage asks of a calibrated method."""

    name: ClassVar[str]
    hessian: ClassVar[bool]  # its observers keep X^T X (squares: mean squares)
    squares: ClassVar[bool]

    def __init__(self, lm: LayerwiseModel, plan: Plan, config: ConvertConfig, inputs: dict[str, str],
                 store: Store) -> None:
        """``inputs``: plan module -> the runner's name of the input it multiplies."""
        ...

    def run(self, tokens: torch.Tensor, observers: Observers, head: bool, micro_batch: int, progress: bool) -> None:
        """The pass over every block: observe, quantize into the store, reload the block quantized."""
        ...

    @property
    def unseen(self) -> list[str]:
        """Quantized matrices whose input the pass never saw (left to round-to-nearest)."""
        ...

    def record(self) -> dict:
        """The manifest's ``method`` record: ``{"method": name, "description": one phrase, ...}``."""
        ...


def method_names() -> list[str]:
    """Every calibrated method's name (the modules of this package; none is imported)."""
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def get_method(name: str) -> type[Method]:
    """The method class registered under ``name`` (its module is imported now)."""
    if name not in method_names():
        raise ConfigError(f"unknown method {name!r}; choose one of rtn, {', '.join(method_names())}")
    return importlib.import_module(f".{name.replace('-', '_')}", __package__).METHOD
