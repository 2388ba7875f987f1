"""Every tensor's role from the module transformers loads it into: the rules of :func:`decide`.

Given one on-disk tensor, the parameter it loads into and the module holding it (:class:`TensorFacts`) and
what is known of the whole model (:class:`ModelFacts`), :func:`decide` says whether it is a matmul weight
(and its input axis on disk), a 3-D expert stack (its orientation and gate/up packing) or kept, and why.
Runs in the definition's child process; torch's ``nn`` and transformers' ``Conv1D`` are handed in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fp4convert.plan.roles import EXPERTS, KEPT, LINEAR, Role

if TYPE_CHECKING:
    from fp4convert.plan.fp4_loading import Fp4Loader

# Modules kept by a documented rule (docs/formats.md "Which tensors are quantized"): what lies outside a
# model's language model is decided by :mod:`fp4convert.plan.parts` from the definition; multimodal projector
# classes are kept wherever they sit.
_PROJECTOR_RX = re.compile(r"MultiModal|Multimodal|Projector|Embedder|PatchMerger", re.IGNORECASE)
_ROUTER_LEAVES = {"gate", "router", "shared_expert_gate", "router_proj"}
# A router class: MixtralTopKRouter, DbrxRouter, JetMoeTopKGating (not one that merely gates something:
# MoshiGatingMLP is a gated MLP, KimiLinearForgetGate computes a forget gate with two Linears). A class named
# a gate holding the routing weight itself (not in a Linear) is one too (_GATE_CLASS_RX); a module named
# ``gate``/``router`` is one whatever its class (HunYuan's ``mlp.gate`` holds its router Linear ``wg``).
_ROUTER_CLASS_RX = re.compile(r"Router|TopK")
_GATE_CLASS_RX = re.compile(r"(Gate|Gating)$")
_EXPERT_PARAMS = {"gate_up_proj": "gate_up", "down_proj": "down", "up_proj": "up"}


@dataclass(frozen=True, eq=False)
class TensorFacts:
    """One on-disk tensor and the parameter it loads into (what :func:`decide` decides from)."""

    name: str  # on disk
    path: str  # the module, as transformers builds it
    leaf: str  # the parameter's name in that module
    mod: Any
    cname: str
    info: Any  # TensorInfo
    param: Any
    axes: list | None  # the disk axis of each parameter axis (``model_build.disk_axes``)
    converter: Any
    ancestors: tuple[tuple[str, str], ...]  # (path, class) of every enclosing module, outermost first


@dataclass(frozen=True, eq=False)
class ModelFacts:
    """What :func:`decide` needs to know of the whole model."""

    heads: tuple[str, ...]
    parts: Any  # modelparts.Parts: the language model and what lies outside it
    routers: dict[str, str]  # Linear path -> why its output routes (modelparts.routing_linears)
    nn: Any
    Conv1D: Any
    fp4: Fp4Loader | None
    model_config: dict | None


def decide(t: TensorFacts, mf: ModelFacts) -> Role:
    """``t``'s role: the first rule that speaks, in order (module kind, routing, Linear, expert stack)."""
    role = _by_module_kind(t, mf) or _by_routing(t, mf)
    if role is not None:
        return role
    if t.axes is None:
        return _kept(t, f"{t.leaf} of {t.cname}: loaded through a transformers conversion this planner does not model")
    role = _linear(t, mf) or _expert_stack(t, mf)
    if role is not None:
        return role
    dim = t.param.dim()
    if dim in (2, 3):
        return _kept(t, f"{t.leaf} of {t.cname} ({dim}-D parameter of a custom module: its matmul layout is not "
                        "stated by the definition)")
    return _kept(t, f"{t.leaf} of {t.cname} ({dim}-D)")


def _kept(t: TensorFacts, why: str) -> Role:
    return Role(KEPT, t.path, t.cname, why)


def _by_module_kind(t: TensorFacts, mf: ModelFacts) -> Role | None:
    """Biases, output heads, what lies outside the language model, embeddings, convolutions, norms."""
    leaf, cname, mod, nn, fp4 = t.leaf, t.cname, t.mod, mf.nn, mf.fp4
    if leaf.endswith("bias") or leaf in ("e_score_correction_bias",):
        return _kept(t, f"bias of {cname}")
    if t.path in mf.heads:
        return _kept(t, f"output projection ({cname} {t.path}: kept like the embeddings it is often tied to)")
    outside = mf.parts.outside(t.path)
    if outside is not None:
        return _kept(t, outside)
    if isinstance(mod, nn.Embedding) or "Embedding" in cname:
        return _kept(t, f"embedding ({cname})")
    if isinstance(mod, mf.Conv1D):
        if leaf != "weight" or len(t.info.shape) != 2 or t.axes != [0, 1]:
            return _kept(t, f"{leaf} of Conv1D")
        # GPT-2 style: x @ W with W [in, out]. Quantized along its input axis (axis 0 on disk) and written
        # [out, in], the layout vLLM's GPT-2 loader reads for weight_packed (it transposes only ``.weight``).
        # transformers dequantizes into the parameter as stored ([in, out], blocks along out): it cannot load
        # any FP4 form of a Conv1D blocked along its input axis, so this output is for vLLM (the run says so).
        why = fp4.route(_disk_module(t.name), (t.info.shape[1], t.info.shape[0])) if fp4 is not None else ""
        return Role(LINEAR, t.path, cname, input_axis=0, tf_fp4=why)
    if isinstance(mod, nn.modules.conv._ConvNd):
        return _kept(t, f"convolution ({cname})")
    if "Norm" in cname or "norm" in leaf.lower() or isinstance(mod, (nn.LayerNorm, nn.GroupNorm)):
        return _kept(t, f"normalization ({cname})")
    return None


def _by_routing(t: TensorFacts, mf: ModelFacts) -> Role | None:
    """MoE routers (by class, by name or by role) and multimodal projectors."""
    cname, ancestors = t.cname, t.ancestors
    router = next((c for _, c in reversed(ancestors) if _ROUTER_CLASS_RX.search(c)), None)
    if router is None and not isinstance(t.mod, mf.nn.Linear) and _GATE_CLASS_RX.search(cname) \
            and t.param.dim() == 2:
        router = cname
    if router is None:  # a module named like a router (HunYuan's ``mlp.gate`` holds its Linear ``wg``)
        router = next((f"{c} {a.rpartition('.')[2]}" for a, c in reversed(ancestors)
                       if a.rpartition(".")[2] in _ROUTER_LEAVES), None)
    if router is not None:
        return _kept(t, f"MoE router ({router})")
    if t.path in mf.routers:  # by role: its output feeds a routing decision (Gemma 3n's altup.modality_router)
        return _kept(t, f"router ({cname} {t.path}; {mf.routers[t.path]})")
    # a projector class in a model without a language model beside other parts (with one, what lies outside it
    # was decided above, and Phi4MultimodalDecoderLayer is inside it)
    projector = next((c for _, c in ancestors if _PROJECTOR_RX.search(c)), None) \
        if mf.parts.language_model is None else None
    if projector is not None:
        return _kept(t, f"multimodal projector/embedder ({projector}: engines build it unquantized)")
    return None


def _linear(t: TensorFacts, mf: ModelFacts) -> Role | None:
    """An ``nn.Linear`` weight: quantized along its input axis when that is last on disk."""
    if not (isinstance(t.mod, mf.nn.Linear) and t.leaf == "weight" and t.param.dim() == 2):
        return None
    assert t.axes is not None  # decide() keeps a tensor whose axes are not known before this rule
    disk_in = t.axes[1]
    if not isinstance(disk_in, int) or len(t.info.shape) != 2:
        return _kept(t, f"{t.leaf} of {t.cname}: its input axis on disk is not known")
    if disk_in != 1:
        return _kept(t, f"{t.cname} weight stored [in, out] on disk: quantizing it would block the wrong axis")
    why = mf.fp4.route(_disk_module(t.name), tuple(t.info.shape)) if mf.fp4 is not None else ""
    if why:  # an nn.Linear both consumers load as bf16, but transformers not as FP4 under this name
        return replace(_kept(t, f"{t.cname} weight that transformers cannot load in FP4 ({why}); kept so that both "
                                "transformers and vLLM load it"), tf_fp4=why)
    return Role(LINEAR, t.path, t.cname, input_axis=1)


def _expert_stack(t: TensorFacts, mf: ModelFacts) -> Role | None:
    """A 3-D expert stack (or one expert's 2-D weight merged into one) its class or transformers' swap states."""
    leaf, cname, mod, fp4, model_config = t.leaf, t.cname, t.mod, mf.fp4, mf.model_config
    proj = _EXPERT_PARAMS.get(leaf)
    stated = hasattr(mod, "is_transposed")
    swapped = fp4.expert_linears(t.path) if fp4 is not None and proj is not None and t.param.dim() == 3 else None
    if proj is None or not (stated or swapped is not None) or t.param.dim() != 3:
        return None
    layout = _stack_layout(t, mf, proj, stated, swapped)
    if isinstance(layout, Role):
        return layout
    disk_in, split, names = layout
    assert t.axes is not None  # decide() keeps a tensor whose axes are not known before this rule
    if "E" in t.axes:  # one expert's 2-D weight, merged into the stack at load
        return _one_expert(t, mf, disk_in)
    if len(t.info.shape) != 3 or t.axes[0] != 0 or disk_in not in (1, 2):
        return _kept(t, f"{leaf} of {cname}: the expert axis or input axis on disk is not known")
    from fp4convert.plan import families as arch

    if arch.quantized_experts_unread(model_config):  # kept, with its layout (per-expert names for ignore)
        return Role(KEPT, t.path, cname, f"{leaf} of {cname}: {arch.quantized_experts_unread(model_config)}",
                    input_axis=disk_in, transpose=disk_in == 1, split=split, proj=proj, names=names)
    why = ""
    if fp4 is not None:
        gate, up, down = names or arch.expert_names(model_config)
        e, a, b = t.info.shape
        n, k = (b, a) if disk_in == 1 else (a, b)
        probe = {"gate_up": (gate, n // 2), "up": (up, n), "down": (down, n)}[proj]
        why = fp4.route(f"{t.path}.0.{probe[0]}", (probe[1], k))
    return Role(EXPERTS, t.path, cname, input_axis=disk_in, transpose=disk_in == 1, split=split, proj=proj,
                names=names, tf_fp4=why)


def _stack_layout(
    t: TensorFacts, mf: ModelFacts, proj: str, stated: bool, swapped: tuple | None
) -> Role | tuple[Any, str | None, tuple[str, ...] | None]:
    """(input axis on disk, gate/up packing, per-expert names) of an expert stack, or why it is kept."""
    leaf, cname, mod = t.leaf, t.cname, t.mod
    split = None
    if stated:
        assert t.axes is not None  # decide() keeps a tensor whose axes are not known before this rule
        t_in = 1 if mod.is_transposed else 2
        disk_in = t.axes[t_in]
        if proj == "gate_up" and getattr(mod, "has_gate", True):
            split = "concatenated" if getattr(mod, "is_concatenated", True) else "interleaved"
        return disk_in, split, None
    # transformers swaps the stack for per-expert Linears to load a quantized checkpoint (Llama 4)
    assert swapped is not None  # not stated: the condition of _expert_stack holds through the swap
    names, lins = swapped
    disk_in = _swapped_input_axis(proj, tuple(t.info.shape), lins)
    if disk_in is None:
        return _kept(t, f"{leaf} of {cname}: its shape matches no orientation of the per-expert Linears "
                        "transformers loads a quantized checkpoint into")
    if proj == "gate_up":
        split = _family_split(mf.model_config)
        if split is None:
            return _kept(t, f"{leaf} of {cname}: how gate and up are packed is stated neither by the class "
                            "nor by the family table")
    return disk_in, split, names


def _one_expert(t: TensorFacts, mf: ModelFacts, disk_in: Any) -> Role:
    """One expert's 2-D weight that transformers merges into the stack at load (its gate/up share a scale group)."""
    name, converter = t.name, t.converter
    if len(t.info.shape) != 2 or disk_in != 1:
        return _kept(t, f"one expert's {t.leaf} of {t.cname} with its input axis not last on disk")
    group = None
    if converter is not None and len(converter.source_patterns) > 1:
        m = re.search(r"(^|\.)experts\.(\d+)\.", name)
        if m:
            members = ",".join(p.rpartition("*.")[2].removesuffix(".weight") for p in converter.source_patterns)
            group = f"{name[:m.end() - 1]}.{{{members}}}"
    why = mf.fp4.route(_disk_module(name), tuple(t.info.shape)) if mf.fp4 is not None else ""
    return Role(LINEAR, t.path, t.cname, input_axis=1, group=group, tf_fp4=why)


def _disk_module(name: str) -> str:
    """The module an on-disk weight's FP4 tensors are written under (the plan's rule: the name less ``.weight``)."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _swapped_input_axis(proj: str, shape: tuple[int, ...], lins) -> int | None:
    """The input axis of a 3-D stack ``[E, a, b]`` on disk, from the per-expert Linears it loads into
    (gate, up, down): the axis of size ``in_features`` whose other axis is the right ``out_features``
    (gate/up: twice a half); None when the shapes leave it open (a square stack)."""
    if len(shape) != 3:
        return None
    gate, _, down = lins
    lin = down if proj == "down" else gate
    out = lin.out_features * (2 if proj == "gate_up" else 1)
    fits = [ax for ax in (1, 2) if shape[ax] == lin.in_features and shape[3 - ax] == out]
    return fits[0] if len(fits) == 1 else None


def _family_split(model_config: dict | None) -> str | None:
    """How gate and up are packed in a stack whose class does not say (the family table)."""
    from fp4convert.plan import families as arch

    return arch.gate_up_packing(model_config)
