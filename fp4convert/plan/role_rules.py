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
    name, path, leaf, mod, cname, info, param = t.name, t.path, t.leaf, t.mod, t.cname, t.info, t.param
    axes, converter, ancestors = t.axes, t.converter, t.ancestors
    heads, nn, Conv1D, fp4, model_config = mf.heads, mf.nn, mf.Conv1D, mf.fp4, mf.model_config

    def kept(why: str) -> Role:
        return Role(KEPT, path, cname, why)

    if leaf.endswith("bias") or leaf in ("e_score_correction_bias",):
        return kept(f"bias of {cname}")
    if path in heads:
        return kept(f"output projection ({cname} {path}: kept like the embeddings it is often tied to)")
    outside = mf.parts.outside(path)
    if outside is not None:
        return kept(outside)
    if isinstance(mod, nn.Embedding) or "Embedding" in cname:
        return kept(f"embedding ({cname})")
    if isinstance(mod, Conv1D):
        if leaf != "weight" or len(info.shape) != 2 or axes != [0, 1]:
            return kept(f"{leaf} of Conv1D")
        # GPT-2 style: x @ W with W [in, out]. Quantized along its input axis (axis 0 on disk) and written
        # [out, in], the layout vLLM's GPT-2 loader reads for weight_packed (it transposes only ``.weight``).
        # transformers dequantizes into the parameter as stored ([in, out], blocks along out): it cannot load
        # any FP4 form of a Conv1D blocked along its input axis, so this output is for vLLM (the run says so).
        why = fp4.route(_disk_module(name), (info.shape[1], info.shape[0])) if fp4 is not None else ""
        return Role(LINEAR, path, cname, input_axis=0, tf_fp4=why)
    if isinstance(mod, nn.modules.conv._ConvNd):
        return kept(f"convolution ({cname})")
    if "Norm" in cname or "norm" in leaf.lower() or isinstance(mod, (nn.LayerNorm, nn.GroupNorm)):
        return kept(f"normalization ({cname})")
    router = next((c for _, c in reversed(ancestors) if _ROUTER_CLASS_RX.search(c)), None)
    if router is None and not isinstance(mod, nn.Linear) and _GATE_CLASS_RX.search(cname) and param.dim() == 2:
        router = cname
    if router is None:  # a module named like a router (HunYuan's ``mlp.gate`` holds its Linear ``wg``)
        router = next((f"{c} {a.rpartition('.')[2]}" for a, c in reversed(ancestors)
                       if a.rpartition(".")[2] in _ROUTER_LEAVES), None)
    if router is not None:
        return kept(f"MoE router ({router})")
    if path in mf.routers:  # by role: its output feeds a routing decision (Gemma 3n's altup.modality_router)
        return kept(f"router ({cname} {path}; {mf.routers[path]})")
    # a projector class in a model without a language model beside other parts (with one, what lies outside it
    # was decided above, and Phi4MultimodalDecoderLayer is inside it)
    projector = next((c for _, c in ancestors if _PROJECTOR_RX.search(c)), None) \
        if mf.parts.language_model is None else None
    if projector is not None:
        return kept(f"multimodal projector/embedder ({projector}: engines build it unquantized)")
    if axes is None:
        return kept(f"{leaf} of {cname}: loaded through a transformers conversion this planner does not model")
    if isinstance(mod, nn.Linear) and leaf == "weight" and param.dim() == 2:
        disk_in = axes[1]
        if not isinstance(disk_in, int) or len(info.shape) != 2:
            return kept(f"{leaf} of {cname}: its input axis on disk is not known")
        if disk_in != 1:
            return kept(f"{cname} weight stored [in, out] on disk: quantizing it would block the wrong axis")
        why = fp4.route(_disk_module(name), tuple(info.shape)) if fp4 is not None else ""
        if why:  # an nn.Linear both consumers load as bf16, but transformers not as FP4 under this name
            return replace(kept(f"{cname} weight that transformers cannot load in FP4 ({why}); kept so that both "
                                "transformers and vLLM load it"), tf_fp4=why)
        return Role(LINEAR, path, cname, input_axis=1)
    proj = _EXPERT_PARAMS.get(leaf)
    stated = hasattr(mod, "is_transposed")
    swapped = fp4.expert_linears(path) if fp4 is not None and proj is not None and param.dim() == 3 else None
    if proj is not None and (stated or swapped is not None) and param.dim() == 3:
        split = None
        if stated:
            t_in = 1 if mod.is_transposed else 2
            disk_in = axes[t_in]
            if proj == "gate_up" and getattr(mod, "has_gate", True):
                split = "concatenated" if getattr(mod, "is_concatenated", True) else "interleaved"
            names = None
        else:  # transformers swaps the stack for per-expert Linears to load a quantized checkpoint (Llama 4)
            assert swapped is not None  # not stated: the condition above holds through the swap
            names, lins = swapped
            disk_in = _swapped_input_axis(proj, tuple(info.shape), lins)
            if disk_in is None:
                return kept(f"{leaf} of {cname}: its shape matches no orientation of the per-expert Linears "
                            "transformers loads a quantized checkpoint into")
            if proj == "gate_up":
                split = _family_split(model_config)
                if split is None:
                    return kept(f"{leaf} of {cname}: how gate and up are packed is stated neither by the class "
                                "nor by the family table")
        if "E" in axes:  # one expert's 2-D weight, merged into the stack at load
            if len(info.shape) != 2 or disk_in != 1:
                return kept(f"one expert's {leaf} of {cname} with its input axis not last on disk")
            group = None
            if converter is not None and len(converter.source_patterns) > 1:
                m = re.search(r"(^|\.)experts\.(\d+)\.", name)
                if m:
                    members = ",".join(p.rpartition("*.")[2].removesuffix(".weight") for p in converter.source_patterns)
                    group = f"{name[:m.end() - 1]}.{{{members}}}"
            why = fp4.route(_disk_module(name), tuple(info.shape)) if fp4 is not None else ""
            return Role(LINEAR, path, cname, input_axis=1, group=group, tf_fp4=why)
        if len(info.shape) != 3 or axes[0] != 0 or disk_in not in (1, 2):
            return kept(f"{leaf} of {cname}: the expert axis or input axis on disk is not known")
        from fp4convert.plan import families as arch

        if arch.quantized_experts_unread(model_config):  # kept, with its layout (per-expert names for ignore)
            return Role(KEPT, path, cname, f"{leaf} of {cname}: {arch.quantized_experts_unread(model_config)}",
                        input_axis=disk_in, transpose=disk_in == 1, split=split, proj=proj, names=names)
        why = ""
        if fp4 is not None:
            gate, up, down = names or arch.expert_names(model_config)
            e, a, b = info.shape
            n, k = (b, a) if disk_in == 1 else (a, b)
            probe = {"gate_up": (gate, n // 2), "up": (up, n), "down": (down, n)}[proj]
            why = fp4.route(f"{path}.0.{probe[0]}", (probe[1], k))
        return Role(EXPERTS, path, cname, input_axis=disk_in, transpose=disk_in == 1, split=split, proj=proj,
                    names=names, tf_fp4=why)
    if param.dim() in (2, 3):
        return kept(f"{leaf} of {cname} ({param.dim()}-D parameter of a custom module: its matmul layout is not "
                    "stated by the definition)")
    return kept(f"{leaf} of {cname} ({param.dim()}-D)")


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
