"""What each block is called with, taken from the model's own forward; and the experts' inputs.

:func:`block_calls`: the model's forward runs once per micro-batch with every block's ``forward``
replaced by a recorder that returns its input unchanged (the run stops at the output head, after
the last block): each block's positional and keyword arguments (attention masks, position embeddings,
layer-type specific masks of sliding/full attention models) are exactly those a whole-model forward
passes it, computed by the model's own code, not by a list of model types; a block the forward runs
several times over (ALBERT's shared layers) gets each of its calls. Only block 0's hidden states are
real; the next block's come from running block 0 (the runner replaces them).

:class:`ExpertTap`: the down projection's input of every expert of a 3-D expert stack, taken while
the stack's own eager forward runs (a ``TorchFunctionMode`` sees each ``linear``/``matmul`` whose
weight is a view of the stack's ``down_proj``, the view's offset saying which expert, or a batched
matmul over the whole stack, as Llama 4's experts compute).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

from fp4convert.errors import PlanError, StopForward

if TYPE_CHECKING:
    from collections.abc import Callable

    from fp4convert.calibrate.stats import Observers

log = logging.getLogger(__name__)


def hidden_slot(block) -> str:
    """The name of the block forward's first argument (its hidden states)."""
    params = [p for p in inspect.signature(block.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not params:
        raise PlanError(f"{type(block).__name__}.forward takes no positional hidden states; the layer-by-layer "
                        "run cannot feed it")
    return params[0].name


def block_calls(model, blocks, run_prefix, n_batches: int, stop=(),
                refuse: Callable[[str], PlanError] = PlanError) -> list[list[tuple[tuple, dict]]]:
    """``calls[i]``: the (args, kwargs) block ``i`` receives, micro-batch after micro-batch (``run_prefix(b)``
    runs the model's forward on micro-batch ``b``): as many per micro-batch as the forward calls the
    block (:func:`repeats`: one, or more where the forward runs one block over and over, as ALBERT runs
    its one shared layer group ``num_hidden_layers`` times), in the order it calls them. A recorder
    returns its hidden states in the form the block returns them (:func:`output_like`: RWKV's
    ``(hidden, state, attentions)``, SqueezeBERT's ``{"feature_map": ...}``), so the model's code between
    blocks runs as it does on real outputs; what else it returns stays on ``meta`` (:func:`run_block`
    refuses a block that uses it).

    After the last block the forward goes on (a repeated call may follow) until it calls a module of
    ``stop`` (the output heads) or, the last block called, one whose weights are still on ``meta``, or
    returns; an exception it raises once the last block has been called ends it too (nothing after the
    blocks is recorded). A forward that calls a block after a later one (a recurrence over the blocks:
    HRM's cycles), or runs weights outside the blocks between two calls of one block, is refused
    (``refuse(why)``): the runner runs the blocks once, in their order, each call on the one before's
    output."""
    rec = _Recorder(blocks, stop, refuse)
    handles = [m.register_forward_pre_hook(rec.watch(n, m)) for n, m in model.named_modules() if id(m) not in rec.inside]
    for i, b in enumerate(blocks):
        b.forward = rec.recorder(i, b)
    try:
        first: list[int] = []
        for k in range(n_batches):
            rec.run(run_prefix, k)
            if k == 0:
                first = list(rec.order)
            rec.check(first)
    finally:
        for hd in handles:
            hd.remove()
        for b in blocks:
            del b.forward
    return rec.calls


class _Recorder:
    """:func:`block_calls`' state: every block's recorded calls, the order of this micro-batch's calls, the
    weighted modules run since the last block call."""

    def __init__(self, blocks, stop, refuse: Callable[[str], PlanError]) -> None:
        self.blocks, self.refuse = blocks, refuse
        self.calls: list[list[tuple[tuple, dict]]] = [[] for _ in blocks]
        self.last = len(blocks) - 1
        self.slots = [hidden_slot(b) for b in blocks]
        self.order: list[int] = []  # the blocks this micro-batch's forward called, in order
        self.since: list[str] = []  # modules holding weights outside the blocks that ran since the last block call
        self.inside = {id(m) for b in blocks for m in b.modules()}
        self.stops = {id(m) for m in stop}

    def recorder(self, i: int, block):
        slot = self.slots[i]
        form: list = []  # the block's output on meta, made at its first call

        def forward(*args, **kwargs):
            if self.order and i < self.order[-1]:
                raise self.refuse(out_of_order(i, self.order[-1], self.blocks, i in self.order))
            if self.order and i == self.order[-1] and self.since:
                raise self.refuse(f"its forward runs {self.since[0]} between two calls of block {i} "
                                  f"({type(block).__name__}), and the layer-by-layer run carries each call's output "
                                  "straight to the next")
            self.calls[i].append((args, dict(kwargs)))
            self.order.append(i)
            self.since.clear()
            h = args[0] if args else kwargs[slot]
            if not form:
                form.append(output_like(block, args, kwargs))
            return with_hidden(form[0], h)
        return forward

    def watch(self, name: str, module):
        weighted = any(p is not None for p in module._parameters.values())

        def hook(_m, _a):
            if self.order and self.order[-1] == self.last and (id(module) in self.stops or any(
                    p is not None and p.device.type == "meta" for p in module._parameters.values())):
                raise StopForward  # a head, or weights not loaded: nothing the blocks need comes after
            if self.order and weighted:
                self.since.append(name)
        return hook

    def run(self, run_prefix, k: int) -> None:
        """The forward on micro-batch ``k``, up to the head (or an error after the last block)."""
        self.order.clear()
        self.since.clear()
        try:
            run_prefix(k)
        except StopForward:
            pass
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - after the last block: the forward's rest is not needed
            if not self.order or self.order[-1] != self.last:
                raise
            log.debug("the forward after the last block stopped at %s: %s", type(exc).__name__, exc)

    def check(self, first: list[int]) -> None:
        """This micro-batch's forward called every block, its last, and in the first micro-batch's order."""
        if not self.order or self.order[-1] != self.last:
            raise self.refuse("the model's forward returned without calling its last block: the blocks found are "
                              "not the layers it runs")
        missing = next((i for i in range(len(self.blocks)) if i not in self.order), None)
        if missing is not None:
            raise self.refuse(f"the model's forward did not call block {missing}; the layer-by-layer run cannot feed "
                              "its blocks")
        if self.order != first:
            raise self.refuse("the model's forward called its blocks a different number of times on two micro-batches; "
                              "the layer-by-layer run cannot feed its blocks")


def repeats(calls: list[list[tuple[tuple, dict]]], n_batches: int) -> list[int]:
    """How many times the forward calls each block per micro-batch (``calls``: :func:`block_calls`'s);
    call ``r`` of micro-batch ``b`` is ``calls[i][b * repeats[i] + r]``."""
    return [len(c) // n_batches for c in calls]


def out_of_order(i: int, after: int, blocks, again: bool) -> str:
    """Why a forward that calls block ``i`` after block ``after`` cannot run block by block."""
    what = "again after" if again else "after"
    why = "a recurrence over its blocks" if again else "out of their order"
    return (f"its forward runs block {i} ({type(blocks[i]).__name__}) {what} block {after} ({why}), and the "
            "layer-by-layer run goes through the blocks once, in their order, carrying only the hidden states")


def output_like(block, args: tuple, kwargs: dict):
    """What ``block`` returns, computed on ``meta`` (no weights: they are not loaded while the calls are
    recorded); None when its forward cannot run there (a data-dependent step, such as a MoE's routing):
    the recorder then returns the bare hidden states, which is what most blocks return."""
    import torch
    from torch.utils._pytree import tree_map

    def meta(x):
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    real = [(m, n, b) for m in block.modules() for n, b in m._buffers.items() if b is not None]
    try:
        for m, n, b in real:
            m._buffers[n] = b.to("meta")
        with torch.no_grad():
            return type(block).forward(block, *tree_map(meta, args), **tree_map(meta, kwargs))
    except Exception:  # noqa: BLE001 - any failure on meta: fall back to the bare hidden states
        return None
    finally:
        for m, n, b in real:
            m._buffers[n] = b


def with_hidden(form, h):
    """``form`` (a block's output on meta, or None) with ``h`` in its hidden-states slot (the slot
    :func:`block_output` reads)."""
    import torch

    if form is None or isinstance(form, torch.Tensor):
        return h
    if isinstance(form, dict) and form:  # a ModelOutput is a dict too: keep its class
        first = next(iter(form))
        out = type(form)(form) if not hasattr(form, "to_tuple") else type(form)(**form)
        out[first] = h
        return out
    if isinstance(form, (tuple, list)) and form:
        return type(form)([h, *form[1:]])
    return h


def run_block(block, i: int, args: tuple, kwargs: dict):
    """Block ``i`` (``block``) on one recorded call. An argument the block before it computed besides the
    hidden states (a recurrent state, HY-V4's shared top-k indices) was recorded on ``meta``: a block
    that ignores it runs; one that uses it fails there, and that is refused naming the argument."""
    try:
        return block(*args, **kwargs)
    except Exception as exc:
        carried = _meta_argument(hidden_slot(block), args, kwargs)
        if carried is None:
            raise
        raise PlanError(f"block {i} ({type(block).__name__}) uses {carried}, computed by the block before it besides "
                        "the hidden states (a carried state); the layer-by-layer run carries only the hidden "
                        "states") from exc


def _meta_argument(slot: str, args: tuple, kwargs: dict) -> str | None:
    """The name of an argument of a recorded call (other than the hidden states) that holds a ``meta``
    tensor: a value the block before computed and the recorder could not (None: none)."""
    import torch
    from torch.utils._pytree import tree_leaves

    named = [(f"argument {j}", a) for j, a in enumerate(args[1:], 1)] + [(k, v) for k, v in kwargs.items() if k != slot]
    for name, value in named:
        if any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in tree_leaves(value)):
            return name
    return None


def replace_hidden(block, args: tuple, kwargs: dict, h) -> tuple[tuple, dict]:
    """The recorded call of ``block`` with ``h`` as its hidden states."""
    if args:
        return (h, *args[1:]), kwargs
    slot = hidden_slot(block)
    return args, {**kwargs, slot: h}


def block_output(out: Any):
    """The hidden states a block returns (a tensor, or the first item of a tuple/ModelOutput)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    if isinstance(out, dict) and out and isinstance(next(iter(out.values())), torch.Tensor):
        return next(iter(out.values()))  # a dict of outputs, hidden states first (SqueezeBERT's feature_map)
    first = getattr(out, "to_tuple", None)
    if first is not None:
        return out.to_tuple()[0]
    raise PlanError(f"a block returned {type(out).__name__}, not hidden states; the layer-by-layer run cannot "
                    "carry it to the next block")


def is_expert_stack(module) -> bool:
    """A transformers experts module holding the experts as 3-D parameters (``down_proj [E, ., .]``)."""
    p = module._parameters.get("down_proj")
    return p is not None and p.dim() == 3


def expert_count(module) -> int:
    return int(module._parameters["down_proj"].shape[0])


class ExpertTap:
    """Observe a 3-D expert stack: its input (every expert's gate/up input) and each expert's down
    input; with ``all_experts`` the statistics pass sends every token through every expert (the
    block's output still uses the router's choice), as llm-compressor's ``moe_calibrate_all_experts``."""

    def __init__(self, name: str, module, observers: Observers, all_experts: bool = True) -> None:
        self.name, self.module, self.obs, self.all_experts = name, module, observers, all_experts
        self.routed = None  # tokens the router sent to each expert
        self.handle = module.register_forward_pre_hook(self._pre, with_kwargs=True)

    def remove(self) -> None:
        self.handle.remove()

    def _pre(self, module, args, kwargs):
        import torch

        x = args[0] if args else next(iter(kwargs.values()))
        index = args[1] if len(args) > 1 else None
        if index is None:
            index = next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and not v.is_floating_point()),
                         None)
        n = expert_count(module)
        if index is not None and not index.is_floating_point():
            counts = torch.bincount(index.reshape(-1).clamp(0, n).long(), minlength=n + 1)[:n]
            self.routed = counts if self.routed is None else self.routed + counts
        if not self.obs.enabled:
            return None
        self.obs.add(f"{self.name}:in", x)
        flat = x.reshape(-1, x.shape[-1])
        if self.all_experts and index is not None:
            every = torch.arange(n, device=flat.device).expand(flat.shape[0], n)
            ones = torch.ones(flat.shape[0], n, dtype=flat.dtype, device=flat.device)
            self._tapped(lambda: module.forward(flat, every, ones))
        elif index is None:  # a stack that takes its tokens already spread over the experts (Llama 4)
            self._tapped(lambda: module.forward(*args, **kwargs))
        return None

    def _tapped(self, call) -> None:
        """Run ``call`` (the stack's forward, eager) with every matmul on a ``down_proj`` view observed."""
        import torch
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode

        down = self.module._parameters["down_proj"]
        obs, name = self.obs, self.name
        funcs = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm}

        class Tap(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in funcs and len(args) >= 2:
                    w = args[1]
                    if isinstance(w, torch.Tensor) and w._base is down and w.dim() == 2:
                        e = (w.storage_offset() - down.storage_offset()) // down.stride(0)
                        obs.add(f"{name}:down:{e}", args[0])
                    elif w is down and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
                        for e in range(args[0].shape[0]):  # a batched matmul over the whole stack
                            obs.add(f"{name}:down:{e}", args[0][e])
                return func(*args, **kwargs)

        cfg = getattr(self.module, "config", None)
        saved = getattr(cfg, "_experts_implementation", None)
        if cfg is not None and saved is not None:
            cfg._experts_implementation = "eager"  # the per-expert loop: each expert's weight is a view
        try:
            with torch.no_grad(), Tap():
                call()
        finally:
            if cfg is not None and saved is not None:
                cfg._experts_implementation = saved
