"""The quantized linears outside the repeated blocks: a pooler, a projection in or out, a head's dense layer.

The block runner observes the linears inside the blocks while each block runs. Those outside run in the
model's own forward before the first block (a projection of the embeddings: ALBERT, OPT's ``project_in``)
or after the last (a BERT-style pooler, OPT's ``project_out``, an LM head's dense layer). After the last
block, :func:`tail_pass` runs the model's forward once more per micro-batch with only the weights outside
the blocks loaded and every block replaced by a stand-in: the last one returns the outputs the last block
produced (in the form the block returns them), the others return their input. The embeddings, the final
norm, the pooler run for real on the calibration tokens, so the inputs of the linears outside the blocks
are those of a whole-model forward; memory is the weights outside the blocks, whatever the depth. The
output head's weights are never loaded: its input is taken (``lm_head``) and the forward stops there.

What no pass can observe is known before anything runs (:func:`blind_spots`): a quantized tensor that
loads into no ``nn.Linear`` / ``Conv1D`` / 3-D expert stack, one in a vision/audio tower (calibration runs
token ids), and, found by running the same stand-in forward on 8 token ids before any sample is made or
any block runs (:func:`discover`), a linear the forward on token ids never reaches. That forward also
shows a model whose code runs weights between two blocks (XLM/FlauBERT's attentions beside their
feed-forward list): the run, carrying each block's output straight to the next, would measure another
model, so it is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fp4convert.calibrate.capture import hidden_slot, out_of_order, output_like, with_hidden
from fp4convert.errors import PlanError, StopForward, UnloadedWeights
from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

    import torch

    from fp4convert.calibrate.stats import Observers
    from fp4convert.calibrate.weights import BlockWeights
    from fp4convert.plan.planner import Plan

log = logging.getLogger(__name__)

HEAD = "lm_head"  # the runner's name of the output head's input
BEFORE, BETWEEN, AFTER = "before the blocks", "between the blocks", "after the blocks"
DISCOVERY_TOKENS = 8


@dataclass
class Reach:
    """What one stand-in forward pass showed: each observed linear's phases (:data:`BEFORE`,
    :data:`BETWEEN`, :data:`AFTER`), the module it stopped at because nothing loads its weights, the
    modules holding weights outside the blocks that the forward ran between two blocks, and why its
    forward calls a block after a later one (a recurrence over the blocks; None: it does not)."""

    phases: dict[str, set[str]] = field(default_factory=dict)
    stopped: str | None = None
    between: list[str] = field(default_factory=list)
    out_of_order: str | None = None


def _under(name: str, prefixes: Collection[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def outside_linears(lm: BlockWeights) -> list[str]:
    """Every ``nn.Linear`` / GPT-2 ``Conv1D`` outside the blocks, the output heads and the towers."""
    import torch
    from transformers.pytorch_utils import Conv1D

    inside = [lm.layers_name, *lm.heads, *lm.towers]
    return [n for n, m in lm.model.named_modules()
            if n and isinstance(m, (torch.nn.Linear, Conv1D)) and not _under(n, inside)]


def outside_names(lm: BlockWeights, names: Collection[str]) -> set[str]:
    """Of the runner's input names ``names``, those a :func:`tail_pass` observes (outside linears, ``lm_head``)."""
    outside = set(outside_linears(lm))
    return {n for n in names if n in outside or (n == HEAD and lm.heads)}


def tail_pass(lm: BlockWeights, forward: Callable, batches: list[torch.Tensor], names: Collection[str] | None,
              head: bool, observers: Observers | None = None, finals: list[torch.Tensor] | None = None,
              chunks: list[int] | None = None) -> Reach:
    """The model's forward (``forward(ids)``: the runner's, :meth:`~fp4convert.calibrate.layerwise.LayerwiseModel._forward`)
    on each micro-batch of ``batches`` with the blocks replaced by stand-ins (the last
    returns ``finals[k]``, the last block's outputs on micro-batch ``k``; without ``finals`` its input),
    only the weights outside the blocks loaded. The inputs of the linears ``names`` (None: every
    :func:`outside_linears`) and, with ``head``, of the output head (``lm_head``) go to ``observers``
    when the forward runs them before the first block or after the last; a linear it runs between
    two blocks is not observed (its inputs there are not a whole-model forward's) and is dropped from
    ``observers``. The forward stops at the head (never loaded) and at a module no checkpoint tensor
    loads. Returns what the pass reached."""
    tail = _Tail(lm, set(outside_linears(lm) if names is None else names) - {HEAD}, head, observers, finals)
    tail.chunks = chunks or [0] * len(batches)
    handles: list = []
    lm.load_outside()
    try:
        handles = tail.install()
        tail.run(forward, batches)
    finally:
        for hd in handles:
            hd.remove()
        for b in lm.layers:
            b.__dict__.pop("forward", None)
        lm.free_outside()
    reach = tail.reach
    between = [n for n, p in reach.phases.items() if BETWEEN in p]
    if observers is not None and between:
        observers.drop(between)
    return reach


class _Tail:
    """One tail pass's hooks and state: where the forward is (before, between or after the blocks, on which
    micro-batch), the blocks' stand-ins, and what it reached."""

    def __init__(self, lm: BlockWeights, names: set[str], head: bool, observers: Observers | None,
                 finals: list[torch.Tensor] | None) -> None:
        self.lm, self.names, self.head, self.observers, self.finals = lm, names, head, observers, finals
        self.reach = Reach()
        self.k, self.phase = 0, BEFORE  # (the micro-batch, the phase)
        self.called: list[int] = []  # the blocks this micro-batch called
        self.forms: dict[type, object] = {}  # a block's output form, by class (computed on meta)
        self.chunks: list[int] = []  # the chunk of each micro-batch (the observers' sums, Observer.parts)

    def add(self, name: str, x) -> None:
        if x.numel() == 0:
            return  # no token reaches it in this call (Higgs-Audio's audio head on text tokens)
        self.reach.phases.setdefault(name, set()).add(self.phase)
        if self.observers is not None and self.phase != BETWEEN:
            self.observers.add(name, x)

    def stand_in(self, i: int, block) -> Callable:
        """Block ``i``'s stand-in: it records the call's order and phase and returns the hidden states (the
        last block's real outputs, ``finals``, after the last block) in the form the block returns them."""
        slot = hidden_slot(block)
        last = len(self.lm.layers) - 1

        def standing_in(*args, **kwargs):
            h = args[0] if args else kwargs[slot]
            if self.called and i < self.called[-1] and self.reach.out_of_order is None:
                self.reach.out_of_order = out_of_order(i, self.called[-1], self.lm.layers, i in self.called)
            self.called.append(i)
            if type(block) not in self.forms:
                self.forms[type(block)] = output_like(block, args, kwargs)
            if i == last:
                self.phase = AFTER
                if self.finals is not None:
                    h = self.finals[self.k]
            else:
                self.phase = BETWEEN
            return with_hidden(self.forms[type(block)], h)
        return standing_in

    def head_hook(self, _m, a):
        if self.head:
            self.add(HEAD, a[0])
        raise StopForward  # the head's weights are not loaded; nothing after it is observed

    def install(self) -> list:
        """The hooks and stand-ins in place (the returned handles remove the hooks)."""
        lm = self.lm

        def unloaded(name: str) -> Callable:
            def hook(_m, _a):
                raise UnloadedWeights(name)
            return hook

        def weighted(name: str) -> Callable:
            def hook(_m, _a):
                if self.phase == BETWEEN and name not in self.reach.between:
                    self.reach.between.append(name)
            return hook

        handles = [lm.modules[n].register_forward_pre_hook(lambda _m, a, _n=n: self.add(_n, a[0]))
                   for n in sorted(self.names)]
        handles += [lm.modules[h].register_forward_pre_hook(self.head_hook) for h in lm.heads]
        handles += [m.register_forward_pre_hook(weighted(n)) for n, m in _weighted_modules(lm)]
        handles += [m.register_forward_pre_hook(unloaded(n)) for n, m in _unloaded_modules(lm)]
        for i, b in enumerate(lm.layers):
            b.forward = self.stand_in(i, b)
        return handles

    def run(self, forward: Callable, batches: list[torch.Tensor]) -> None:
        """The model's forward on every micro-batch, up to the head or to weights nothing loads."""
        import torch

        for k, ids in enumerate(batches):
            self.k, self.phase, self.called = k, BEFORE, []
            if self.observers is not None:
                self.observers.chunk = self.chunks[k]
            try:
                with torch.no_grad():
                    forward(ids)
            except StopForward:
                pass
            except UnloadedWeights as stop:
                self.reach.stopped = stop.name


def _weighted_modules(lm: BlockWeights) -> list[tuple[str, torch.nn.Module]]:
    """Modules outside the blocks, the heads and the towers that hold a weight of their own."""
    return [(n, m) for n, m in lm.model.named_modules() if n and not _under(n, [lm.layers_name, *lm.heads, *lm.towers])
            and any(p is not None for p in m._parameters.values())]


def _unloaded_modules(lm: BlockWeights) -> list[tuple[str, torch.nn.Module]]:
    """Modules outside the blocks and the heads holding a weight still on ``meta`` after
    :meth:`~fp4convert.calibrate.weights.BlockWeights.load_outside` (no checkpoint tensor loads it), other
    than the modules holding the blocks (their forward is the one that runs)."""
    parts = lm.layers_name.split(".")
    holders = {".".join(parts[:j]) for j in range(len(parts))}  # "" (the model) and each module down to the list
    out = []
    for n, m in lm.model.named_modules():
        if n in holders or _under(n, [lm.layers_name, *lm.heads]):
            continue
        own = [*m._parameters.values(), *(b for bn, b in m._buffers.items() if f"{n}.{bn}" in lm._meta_buffers)]
        if any(p is not None and p.device.type == "meta" for p in own):
            out.append((n, m))
    return out


def discover(lm: BlockWeights, forward: Callable, names: Collection[str], head: bool) -> Reach:
    """:func:`tail_pass` on :data:`DISCOVERY_TOKENS` token ids, before any block runs (each stand-in returns
    its input): which of ``names`` the forward reaches, before, between or after the blocks."""
    import torch

    name = lm.embed_name + ".weight"
    info = lm.infos.get(lm.disk_of.get(name, ""))
    rows = info.shape[0] if info is not None and info.shape else DISCOVERY_TOKENS + 1
    ids = (torch.arange(1, DISCOVERY_TOKENS + 1) % rows).unsqueeze(0).to(lm.device)
    return tail_pass(lm, forward, [ids], names, head)


@dataclass
class Blind:
    """A quantized matrix whose input no pass of the runner observes: its checkpoint tensor, module, why."""

    tensor: str
    module: str
    why: str


def blind_spots(lm: BlockWeights, forward: Callable, plan: Plan,
                inputs: dict[str, str]) -> tuple[list[Blind], set[str]]:
    """(the quantized matrices whose inputs the layer-by-layer run cannot observe, with why; the runner names
    outside the blocks it observes: what the pass passes to :func:`tail_pass`), known before any block runs
    (``inputs``: :func:`~fp4convert.calibrate.stage.plan_inputs`; ``forward``: as :func:`tail_pass`). A
    linear inside the blocks is taken as observed (whether a token reaches it shows only when its block
    runs: the run names it then), and so is the output head (a causal LM's forward ends there). Raises
    PlanError when the forward runs weights between two blocks or calls a block after a later one (HRM's
    cycles; looked for only when a quantized linear other than the head lies outside the blocks: that is
    when the forward runs here; the block runner's capture refuses the latter in any case)."""
    blind: list[Blind] = []
    candidates: dict[str, list[tuple[str, str]]] = {}  # runner name -> (tensor, module) outside the blocks
    blocks = lm.layers_name + "."
    for d in plan.decisions:
        if d.action != QUANTIZE:
            continue
        got = lm.keymap.get(d.info.name)
        for m in d.matrices:
            n = inputs.get(m.module)
            if n is None:
                blind.append(Blind(d.info.name, m.module, _why_unmapped(lm, got)))
                continue
            path = n.split(":", 1)[0]
            if n != HEAD and _under(path, lm.towers):
                tower = next(t for t in lm.towers if _under(path, [t]))
                blind.append(Blind(d.info.name, m.module, f"it is in {tower} ({type(lm.modules[tower]).__name__}), "
                                                          "which calibration on token ids does not run"))
            elif n == HEAD or not path.startswith(blocks):
                candidates.setdefault(n, []).append((d.info.name, m.module))
    if not candidates:
        return blind, set()
    if set(candidates) == {HEAD}:  # a causal LM's quantized head: its forward ends there (no run to find it)
        return blind, {HEAD}
    reach = discover(lm, forward, set(candidates) - {HEAD}, HEAD in candidates)
    if reach.out_of_order is not None:  # HRM's cycles: known here, before any sample is made
        raise PlanError(f"{lm.root}: the layer-by-layer run cannot run this {type(lm.model).__name__} (blocks "
                        f"{lm.layers_name}): {reach.out_of_order}; {lm.other}")
    if reach.between:
        n = reach.between[0]
        raise PlanError(f"{lm.root}: the layer-by-layer run cannot run this model: its forward runs {n} "
                        f"({type(lm.modules[n]).__name__}) between two of its blocks ({lm.layers_name}), and the run "
                        f"carries each block's output straight to the next; {lm.other}")
    seen: set[str] = set()
    for n, mats in candidates.items():
        if reach.phases.get(n):
            seen.add(n)
            continue
        why = "the model's forward on token ids does not reach it (or no token gets to it)"
        if reach.stopped is not None:
            why += f" (it stops at {reach.stopped}, whose weights no checkpoint tensor loads)"
        blind += [Blind(t, m, why) for t, m in mats]
    return blind, seen


def _why_unmapped(lm: BlockWeights, got: tuple[str, str | None] | None) -> str:
    if got is None:
        return f"no parameter of the transformers model ({type(lm.model).__name__}) loads it"
    path = got[0].rpartition(".")[0]
    mod = lm.modules.get(path)
    return (f"it loads into {path} ({type(mod).__name__}), not an nn.Linear, Conv1D or 3-D expert stack, whose "
            "inputs the run observes")


def refusal(blind: list[Blind], what: str, other: str) -> PlanError:
    """The one-line refusal of a pass that must observe every quantized input (W4A4's activation amax)."""
    b = blind[0]
    more = f" (and {len(blind) - 1} more)" if len(blind) > 1 else ""
    return PlanError(f"{b.tensor}: {what} cannot observe the input of {b.module}{more}: {b.why}; keep it "
                     f"unquantized (--ignore {b.tensor}), {other}")
