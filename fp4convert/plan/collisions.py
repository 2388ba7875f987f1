"""Kept tensors whose names a format gives the parts of a quantized weight.

A bf16 checkpoint may hold ``x.weight`` and ``x.input_scale`` (or ``x.weight_scale``, ...). Quantizing
``x.weight`` with ``--format modelopt`` keeps ``x.input_scale`` as it is, under the very name ModelOpt
uses for ``x``'s activation scale: every reader (engines, ``fp4convert inspect``) then takes a bf16
source tensor for a W4A4 scale. Two outputs of one name are refused by
:func:`fp4convert.plan.check_collisions`; this check refuses the subtler case, a kept tensor whose name
the format reserves for a quantized module's parts (:meth:`OutputFormat.part_names`: the knowledge
comes from the format). Both the planner and ``export`` (a native output may hold such a tensor: the
native format reserves fewer names) call it before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from fp4convert.errors import PlanError

if TYPE_CHECKING:
    from fp4convert.formats.base import OutputFormat
    from fp4convert.plan.types import Decision


def check_part_names(decisions: Iterable[Decision], fmt: OutputFormat) -> None:
    """Raise PlanError naming both tensors when a kept tensor has a name ``fmt`` gives part of a quantized one."""
    decisions = list(decisions)
    parts: dict[str, str] = {}  # reserved name -> the quantized source tensor it belongs to
    for d in decisions:
        if d.action != "quantize":
            continue
        modules = {m.module for m in d.matrices} or {d.module}
        for module in modules:
            for name in fmt.part_names(module):
                parts.setdefault(name, d.name)
    for d in decisions:
        if d.action == "quantize":
            continue
        for out in d.outputs:
            owner = parts.get(out.name)
            if owner is not None and owner != d.name:
                raise PlanError(
                    f"source tensor {out.name!r} would be kept under a name --format {fmt.name} gives a part of the "
                    f"quantized {owner!r}: readers would take one for the other. Keep {owner} unquantized "
                    f"(--ignore {owner}), choose another --format, or rename {out.name} in the source")
