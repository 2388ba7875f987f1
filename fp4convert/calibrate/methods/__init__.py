"""Calibrated rounding methods (``--method``): one module each, found by name, like the backends.

A method is a module here whose ``METHOD`` class implements :class:`Method`. ``rtn`` (round to nearest,
every block on its own) is no method module: it is the quantize stage itself (the recipe's ``method`` is
None). Everything a method is lives in its module:

- its **settings**: a frozen type (``Method.Settings``) implementing :class:`~fp4convert.config.MethodSettings`
  (its defaults, the recipe-dependent ones resolved by ``resolved``, its refusals in ``check``, the values that
  decide the bytes in ``identity``); the recipe carries one value of it (``ConvertConfig.method``);
- its **command-line options**: :class:`Option` specs on the settings type (``Settings.options``), which the
  CLI turns into click options and back into a settings value (:func:`settings`);
- its **pass**: run while the model runs block by block on the calibration tokens
  (:meth:`~fp4convert.calibrate.layerwise.LayerwiseModel.blocks`), quantizing each block's matrices into a
  :class:`~fp4convert.calibrate.store.Store`, which the quantize stage writes instead of quantizing again;
- its **record**: :meth:`Method.record`, the manifest's ``method`` entry (the card and ``inspect`` say its
  ``description``).

The statistics stage, the store, ``--resume``, the manifest, the card and ``inspect`` take any method
through this protocol; none of them names one.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fp4convert.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.layerwise import LayerwiseModel
    from fp4convert.calibrate.resume import Checkpoint
    from fp4convert.calibrate.stats import Observers
    from fp4convert.calibrate.store import Store
    from fp4convert.config import ConvertConfig, MethodSettings
    from fp4convert.plan.planner import Plan


@dataclass(frozen=True)
class Option:
    """One command-line option of a method's settings (the CLI builds the click option from it).

    ``flags``: ``"--gptq-damp"``, or ``"--act-order/--no-act-order"`` for an on/off pair (``kind`` bool).
    The option's value is the settings field ``field``; an option not given leaves the field at its default
    (None where the default depends on the rest of the recipe). ``low`` / ``high``: the accepted range
    (``*_open``: that end excluded)."""

    field: str
    flags: str
    kind: type
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False


class Method(Protocol):
    """What the statistics stage asks of a calibrated method."""

    name: ClassVar[str]
    Settings: ClassVar[type]  # the frozen settings type (fp4convert.config.MethodSettings), with its `options`
    hessian: ClassVar[bool]  # its observers keep X^T X (squares: mean squares)
    squares: ClassVar[bool]

    def __init__(self, lm: LayerwiseModel, plan: Plan, config: ConvertConfig, settings: MethodSettings,
                 inputs: dict[str, str], store: Store) -> None:
        """``settings``: the method's settings resolved for this recipe; ``inputs``: plan module -> the
        runner's name of the input it multiplies."""
        ...

    def run(self, tokens: torch.Tensor, observers: Observers, head: bool, micro_batch: int, progress: bool,
            checkpoint: Checkpoint | None = None) -> None:
        """The pass over every block: observe, quantize into the store, reload the block quantized (``checkpoint``:
        passed to the block runner, which starts where an interrupted pass stopped and keeps its progress)."""
        ...

    def state(self) -> dict:
        """What the method has gathered so far besides the store's bytes (JSON-able): kept with a pass's progress."""
        ...

    def restore(self, state: dict) -> None:
        """Take back :meth:`state` (an interrupted pass continued by ``--resume``)."""
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


def settings(name: str, **values: Any) -> MethodSettings:
    """The settings value of method ``name`` with these fields set (the others at their defaults): what
    ``ConvertConfig(method=...)`` takes. Unknown fields are a ConfigError naming the method's fields."""
    cls = get_method(name).Settings
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"--method {name} has no setting {unknown[0]!r}; its settings: {', '.join(sorted(known))}")
    return cls(**values)


def all_options() -> dict[str, tuple[Option, ...]]:
    """method name -> its command-line options (every method's module is imported: they import no torch)."""
    return {n: tuple(getattr(get_method(n).Settings, "options", ())) for n in method_names()}
