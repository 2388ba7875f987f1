"""A block's routed experts, run and quantized a group of experts at a time: the memory of a frontier MoE layer
(DeepSeek-V3: 256 experts of 7168 x 2048, 45 GB in fp32) bounded by the group, not the layer.

An expert stack that transformers runs with its canonical eager forward (57 architectures share it in
transformers 5: DeepSeek-V2/V3, Kimi, Qwen2/3-MoE, Qwen3.5-MoE, GLM-4.5, Mixtral, MiniMax, ...; recognised
by the source of its eager forward, :func:`streamable`) is not materialized with its block. Instead
:class:`ExpertStack` keeps the experts' checkpoint tensors resident on the run's device as they are on disk
(bf16, or FP8 codes and scales: the source's size), and materializes one group of experts in fp32 when the
forward reaches it, through transformers' own converter fed only that group's tensors (so a group's slice is
exactly the whole stack's). :meth:`ExpertStack.forward` is the canonical eager forward with the weights read
group by group: the same operations in the same order on the same values, so its outputs are the module's
own bit for bit, whatever the group size (tests/calibrate/test_experts.py). It also records each call's
inputs (the hidden states, the router's choice and weights), from which a calibrated method takes every
expert's statistics a group at a time (:meth:`ExpertStack.routed`).

A quantized expert is kept as its stored bytes (codes, block scales, global scale: about 0.56 bytes a
parameter) and dequantized exactly when its group is materialized again.
"""

from __future__ import annotations

import inspect
import logging
import re
from copy import deepcopy
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


class Weights(Protocol):
    """What a stack reads of the block weights that hold it (:class:`fp4convert.calibrate.weights.BlockWeights`)."""

    keymap: dict[str, tuple[str, str | None]]
    model: Any
    device: Any

    def converter_of(self, pattern: str) -> Any: ...

    def resident_fp32(self, key: str) -> torch.Tensor: ...

    def make_resident(self, keys: list[str]) -> None: ...

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# The policy for an expert the router sent too few tokens for a sound Hessian: fewer than FEW_TOKENS times its input
# width (below that its gate/up Hessian is rank-deficient), its Hessians come from every calibration token instead
FEW_TOKENS = 1.0
GROUP_BUDGET_MAX = 8 << 30  # fp32 bytes of experts materialized at once, at most (and a quarter of the free memory)
RECORD_BUDGET_SHARE = 0.25  # recorded stack inputs stay on a GPU within this share of its free memory, else on the host


def _canonical_source() -> str | None:
    """The canonical eager experts forward, normalized (transformers' Qwen3-MoE experts carry it)."""
    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError:  # pragma: no cover - another transformers
        return None
    return _normalized(Qwen3MoeExperts.forward)


def _normalized(forward) -> str | None:
    fn = getattr(forward, "__wrapped__", None)
    if fn is None:
        return None
    try:
        return re.sub(r"\s+", " ", inspect.getsource(fn)).strip()
    except (OSError, TypeError):
        return None


_CANONICAL: list[str | None] = []


def streamable(module) -> bool:
    """An expert stack transformers runs with the canonical eager forward: 3-D ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``, no biases, its gate applied by ``_apply_gate``."""
    if not _CANONICAL:
        _CANONICAL.append(_canonical_source())
    gu, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
    if gu is None or down is None or gu.dim() != 3 or down.dim() != 3 or any(
            n.endswith("bias") and p is not None for n, p in module._parameters.items()):
        return False
    e, two_i, h = gu.shape
    if down.shape != (e, h, two_i // 2) or not hasattr(module, "_apply_gate"):
        return False
    return _CANONICAL[0] is not None and _normalized(type(module).forward) == _CANONICAL[0]


@dataclass
class Quantized:
    """An expert matrix as stored: E2M1 codes, linear block scales (bytes), the global scale's amax (NVFP4)."""

    packed: torch.Tensor
    scale: torch.Tensor
    amax: float | None


@dataclass
class ExpertStack:
    """One block's expert stack (module path ``path``): its checkpoint tensors resident as on disk, its groups
    materialized in fp32 on demand, the calls recorded while :attr:`recording`."""

    weights: Weights
    path: str
    module: object
    keys: dict[int, list[str]]  # expert -> the checkpoint keys that load it (its gate, up, down)
    targets: dict[str, str]  # checkpoint key -> the stack parameter it loads into (gate_up_proj, down_proj)
    group: int  # experts materialized at once
    scheme: str = "nvfp4"
    rotate: str | None = None
    recording: bool = False
    chunk: int = 0  # the chunk of calibration samples the micro-batch being run belongs to (Observer.parts)
    idle: bool = False  # a run whose outputs nobody reads (a true-sequential step): recorded, not computed (zeros)
    calls: list = field(default_factory=list)  # (chunk, hidden states, top-k index, top-k weights) per call, recorded
    quantized: dict[str, Quantized] = field(default_factory=dict)  # checkpoint key -> its quantized form
    _group: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None  # ((first, last), parameter -> fp32 slice)
    peak_bytes: int = 0  # the most fp32 expert bytes materialized at once (tests check the bound)
    _home: str | None = None  # where recorded inputs go ("cpu" past the budget)

    @property
    def experts(self) -> int:
        return int(self.module._parameters["down_proj"].shape[0])  # type: ignore[attr-defined]

    # -- weights -------------------------------------------------------------------------------------

    def tensor(self, key: str) -> torch.Tensor:
        """Checkpoint tensor ``key`` in fp32 on the run's device: its quantized form dequantized once a method
        quantized it, else the resident checkpoint tensor (decoded, for a quantized input)."""
        q = self.quantized.get(key)
        if q is not None:
            return dequantized(q, self.scheme, self.rotate)
        return self.weights.resident_fp32(key)

    def materialize(self, first: int) -> dict[str, torch.Tensor]:
        """The forward's group of experts starting at ``first`` (a multiple of :attr:`group`): stack parameter ->
        its ``[G, ...]`` fp32 slice (kept until another group is asked for)."""
        return self.materialize_range(first, min(first + self.group, self.experts))

    def materialize_range(self, first: int, last: int) -> dict[str, torch.Tensor]:
        """Experts ``first .. last-1`` in fp32: stack parameter -> its ``[last - first, ...]`` slice, made by
        transformers' converter from those experts' tensors only (their quantized forms once quantized)."""
        if self._group is not None and self._group[0] == (first, last):
            return self._group[1]
        import torch

        self._group = None
        conv: dict[str, object] = {}
        for e in range(first, last):
            for k in self.keys[e]:
                target, pattern = self.weights.keymap[k]
                assert pattern is not None  # (a streamed stack's keys are merged by a converter: BlockWeights._stream)
                c = conv.get(target)
                if c is None:
                    c = conv[target] = deepcopy(self.weights.converter_of(pattern))
                c.add_tensor(target, k, pattern, partial(self.tensor, k))  # type: ignore[attr-defined]
        made: dict[str, torch.Tensor] = {}
        for target, c in conv.items():
            with torch.no_grad():
                out = c.convert(target, model=self.weights.model, config=self.weights.model.config)  # type: ignore[attr-defined]
            for name, value in out.items():
                made[name.rpartition(".")[2]] = (value[0] if isinstance(value, list) else value).to(torch.float32)
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * 4 for t in made.values()))
        self._group = ((first, last), made)
        return made

    def release(self) -> None:
        """Drop the materialized group (the next use materializes again)."""
        self._group = None

    # -- running -------------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The canonical eager forward (see the module's docstring), its weights read a group at a time."""
        import torch
        import torch.nn.functional as F

        if self.recording:
            self.calls.append((self.chunk, *(t.detach().to(self.home(hidden_states)) for t in
                                             (hidden_states, top_k_index, top_k_weights))))
        if self.idle:
            return torch.zeros_like(hidden_states)
        n = self.experts
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=n + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in hit:
            e = int(expert_idx[0])
            if e == n:
                continue
            group = self.materialize(e - e % self.group)
            top_k_pos, token_idx = torch.where(mask[e])
            current = self.module._apply_gate(F.linear(hidden_states[token_idx], group["gate_up_proj"][e % self.group]))  # type: ignore[attr-defined]
            current = F.linear(current, group["down_proj"][e % self.group]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, current.to(final.dtype))
        if self.weights.device.type == "cuda" and self.group < n:
            self.release()  # (the next micro-batch starts from the first group again)
        return final

    def home(self, like: torch.Tensor) -> str:
        """Where recorded inputs are kept: the run's device while they fit its budget, else the host."""
        if self._home is None:
            self._home = str(like.device)
        return self._home

    def routed(self, first: int, last: int) -> dict[int, list[torch.Tensor]]:
        """For experts ``first .. last-1``: the indices of the recorded tokens the router sent to each, per
        recorded call (the tokens as ``hidden_states[index]``), on the run's device."""
        import torch

        out: dict[int, list[torch.Tensor]] = {e: [] for e in range(first, last)}
        for _c, _x, idx, _w in self.calls:
            idx = idx.to(self.weights.device)
            for e in range(first, last):
                out[e].append(torch.nonzero((idx == e).any(dim=-1)).flatten())
        return out

    def counts(self) -> list[int]:
        """Tokens the router sent to each expert over the recorded calls."""
        import torch

        n = self.experts
        total = torch.zeros(n + 1, dtype=torch.long)
        for _c, _x, idx, _w in self.calls:
            total += torch.bincount(idx.reshape(-1).clamp(0, n).long().cpu(), minlength=n + 1)[: n + 1]
        return [int(c) for c in total[:n]]

    def gate(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """The expert's intermediate activations (what its down projection multiplies) for inputs ``x``."""
        import torch.nn.functional as F

        return self.module._apply_gate(F.linear(x, gate_up))  # type: ignore[attr-defined]


def stream_stacks(weights: Weights, block, prefix: str, keys: list[str]) -> dict[str, ExpertStack]:
    """The streamable expert stacks of ``block`` (its checkpoint keys ``keys``, names under ``prefix``), their
    checkpoint tensors made resident on the run's device as they are on disk, their forwards replaced (per
    instance) by the stacks'. A stack whose experts are not one checkpoint key per expert matrix (stored 3-D on
    disk: gpt-oss, Llama 4) is left to be materialized whole."""
    out: dict[str, ExpertStack] = {}
    for n, m in block.named_modules():
        if not streamable(m):
            continue
        path = prefix + n
        params = {path + ".gate_up_proj", path + ".down_proj"}
        mine = [k for k in keys if weights.keymap[k][0] in params]
        by_expert: dict[int, list[str]] = {}
        for k in mine:
            e = expert_index(k)
            if e is None or weights.keymap[k][1] is None:
                break
            by_expert.setdefault(e, []).append(k)
        else:
            gu, down = m._parameters["gate_up_proj"], m._parameters["down_proj"]
            experts = int(gu.shape[0])
            if sorted(by_expert) != list(range(experts)):
                continue
            weights.make_resident(mine)
            stack = ExpertStack(weights, path, m, by_expert, {k: weights.keymap[k][0] for k in mine},
                                group_size(4 * (gu[0].numel() + down[0].numel()), experts, weights.device))
            m.forward = stack.forward
            out[path] = stack
    return out


def expert_index(key: str) -> int | None:
    """The expert a per-expert checkpoint key belongs to (``...experts.12.gate_proj.weight`` -> 12)."""
    hit = _EXPERT.search(key)
    return None if hit is None else int(hit.group(1))


def dequantized(q: Quantized, scheme: str, rotate: str | None) -> torch.Tensor:
    """The exact fp32 weight an expert matrix's stored bytes encode (the rotation undone)."""
    import torch

    from fp4convert.numerics import reference as ref

    if scheme == "nvfp4":
        assert q.amax is not None
        gs = ref.global_scale(torch.tensor(q.amax, dtype=torch.float32, device=q.packed.device))
        return ref.nvfp4_dequantize(q.packed, q.scale.view(torch.float8_e4m3fn), gs, rotate)
    return ref.mxfp4_dequantize(q.packed, q.scale, rotate)


def expert_inputs(stack: ExpertStack, first: int, last: int, every: set[int]) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """For experts ``first .. last-1``: the recorded tokens each sees, call by call, on the run's device, with their
    chunk: the tokens the router sent it, or every token for the experts in ``every`` (the policy for an expert sent
    too few for a sound Hessian, docs/numerics.md "GPTQ", "Experts")."""
    routed = stack.routed(first, last)
    out: dict[int, list] = {}
    for e in range(first, last):
        xs = []
        for (chunk, x, _i, _w), idx in zip(stack.calls, routed[e]):
            x = x.to(stack.weights.device)
            xs.append((chunk, x if e in every else x[idx]))
        out[e] = xs
    return out


def input_observers(inputs: dict[int, list[torch.Tensor]], rotate: str | None) -> dict:
    """Expert -> an Observer of its tokens (``inputs``: :func:`expert_inputs`'), its Hessian taken (gate/up's)."""
    from fp4convert.calibrate.stats import Observer

    out = {}
    for e, xs in inputs.items():
        o = out[e] = Observer(hessian=True, rotate=rotate)
        for chunk, x in xs:
            o.add(x, chunk)
    return out


def down_observers(stack: ExpertStack, first: int, last: int, inputs: dict[int, list[torch.Tensor]], rotate: str | None,
                   note: Callable | None = None) -> dict:
    """Expert -> an Observer of its down projection's input on the tokens it sees (``inputs``), through its gate/up
    as the stack now holds them (quantized, once a method quantized them). ``note(name, x)``: also every
    expert's down input over every recorded token (W4A4's activation scale is the experts' max, docs/formats.md
    "W4A4"), under the runner's name ``{path}:down:{e}``."""
    from fp4convert.calibrate.stats import Observer

    group = stack.materialize_range(first, last)["gate_up_proj"]
    out = {}
    for e in range(first, last):
        o = out[e] = Observer(hessian=True, rotate=rotate)
        for chunk, x in inputs[e]:
            o.add(stack.gate(x, group[e - first]), chunk)
        if note is not None:
            for _c, x, _i, _w in stack.calls:
                note(f"{stack.path}:down:{e}", stack.gate(x.to(group.device), group[e - first]))
    return out


def sweep_group(stack: ExpertStack, device) -> int:
    """Experts whose Hessians and fp32 weights are held at once while a method quantizes them: gate/up's and
    down's ``H x H`` and ``I x I`` fp64 Hessians, their three matrices fp32, twice (weights and working copies)."""
    gu = stack.module._parameters["gate_up_proj"]  # type: ignore[attr-defined]
    i2, h = int(gu.shape[1]), int(gu.shape[2])
    per_expert = 8 * (h * h + (i2 // 2) ** 2) + 2 * 4 * (i2 * h + h * i2 // 2)
    return group_size(per_expert, stack.experts, device)


def group_size(per_expert_bytes: int, experts: int, device) -> int:
    """Experts materialized at once: as many as fit GROUP_BUDGET_MAX and a quarter of the device's free memory
    (the whole stack when it fits: it is then materialized once per block), at least one."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
    else:
        import os

        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = GROUP_BUDGET_MAX
    budget = min(GROUP_BUDGET_MAX, free // 4)
    return max(1, min(experts, budget // max(per_expert_bytes, 1)))


def hook(stack: ExpertStack) -> Callable:
    """The module's forward replaced by the stack's (removed by deleting the instance attribute)."""
    return stack.forward
