"""The order a calibrated method quantizes a block's matrices in: which of the plan's decisions load into which
block (:func:`block_decisions`), and the true-sequential steps inside a block (:func:`steps`: one input at a time,
in the order the block's forward first feeds it; docs/numerics.md "GPTQ")."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    from fp4convert.calibrate.layerwise import LayerwiseModel
    from fp4convert.calibrate.stats import Observers
    from fp4convert.plan.planner import Plan
    from fp4convert.plan.types import Decision, Matrix


def block_decisions(lm: LayerwiseModel, plan: Plan) -> dict[int, list[Decision]]:
    """Block index -> the plan's quantized decisions whose tensor loads into that block."""
    out: dict[int, list[Decision]] = {}
    head = lm.layers_name + "."
    for d in plan.decisions:
        if d.action != QUANTIZE:
            continue
        got = lm.keymap.get(d.info.name)
        if got is None or not got[0].startswith(head):
            continue
        index = got[0][len(head):].split(".", 1)[0]
        if index.isdigit():
            out.setdefault(int(index), []).append(d)
    return out


def steps(prefix: str, decisions: list[Decision], observers: Observers, inputs: dict[str, str]) -> list[list[Decision]]:
    """True-sequential steps: the decisions grouped by what their input feeds, in the order the block's
    forward first fed it (the observers' insertion order): q/k/v, o, gate/up, down in a Llama block.
    An input is known by the matrices it feeds, their names with the numbers inside the block made
    wildcards, so every expert's down projection is one step (not one run of the block per expert).
    A fused group (one global scale) stays in its first member's step; a matrix whose input was never
    seen goes to the first step (its round-to-nearest fallback needs no input)."""
    first: dict[int, int] = {}
    for pos, (n, o) in enumerate(observers.items()):
        if n.startswith(prefix):
            first.setdefault(id(o), pos)

    def wild(module: str) -> str:
        return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", module[len(prefix):] if module.startswith(prefix) else module)

    def observer(m: Matrix):
        return observers.get(inputs.get(m.module, ""))

    feeds: dict[int, set[str]] = {}
    for d in decisions:
        for m in d.matrices:
            if (o := observer(m)) is not None:
                feeds.setdefault(id(o), set()).add(wild(m.module))
    at_kind: dict[frozenset, int] = {}
    for oid, kinds in feeds.items():
        key = frozenset(kinds)
        at_kind[key] = min(at_kind.get(key, first.get(oid, -1)), first.get(oid, -1))

    def position(m: Matrix) -> int:
        o = observer(m)
        return at_kind[frozenset(feeds[id(o)])] if o is not None else -1

    group_at: dict[str, int] = {}
    for d in decisions:
        for m in d.matrices:
            g = m.group or d.group or m.module
            group_at[g] = min(group_at.get(g, position(m)), position(m))
    at: dict[int, list[Decision]] = {}
    for d in decisions:
        at.setdefault(min(group_at[m.group or d.group or m.module] for m in d.matrices), []).append(d)
    return [at[k] for k in sorted(at)]

def input_names(prefix: str, step: list[Decision], observers: Observers, inputs: dict[str, str]) -> set[str]:
    """Every name under which the block observed the inputs of ``step`` (shared inputs have several)."""
    objs = {id(o) for d in step for m in d.matrices
            if (o := observers.get(inputs.get(m.module, ""))) is not None}
    return {n for n, o in observers.items() if n.startswith(prefix) and id(o) in objs}
