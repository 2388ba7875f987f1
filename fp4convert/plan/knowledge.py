"""What the planner knows about the model, and why a tensor is kept by default.

:class:`Knowledge` answers the planner's questions about each tensor from transformers' definition of the model
(:mod:`fp4convert.plan.definition`) or, when there is none, from the name rules (:mod:`fp4convert.plan.name_roles`,
the tables of :mod:`fp4convert.plan.families`): its role, its input axis, a 3-D stack's per-expert layout, the
spellings engines see, and :meth:`Knowledge.reason`, why it is not quantized by default (docs/formats.md
"Which tensors are quantized"). Pure: headers and config.json only.
"""

from __future__ import annotations

import re

from fp4convert.numerics.scheme import get_scheme
from fp4convert.plan import families as arch
from fp4convert.plan import name_roles
from fp4convert.plan.types import Decision
from fp4convert.storage.safetensors import FLOAT_DTYPES, TensorInfo

# Never quantized by default: (regex on the tensor name, reason).
EXCLUDE: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(^|\.)(embed_tokens|embeddings?|wte|wpe|word_embeddings|embed_positions|tok_embeddings)(\.|$)"),
     "embedding"),
    (re.compile(r"(^|\.)(lm_head|embed_out)(\.|$)|^output\.weight$"), "lm_head (output projection)"),
    (re.compile(r"(^|\.)gate\.|router|shared_expert_gate"), "MoE router / gate"),
    (re.compile(r"(^|\.)mtp(\.|_)|(^|\.)nextn"), "MTP (multi-token prediction) layer"),
    (re.compile(r"vision_tower|vision_model|(^|\.)visual\.|multi_modal_projector|mm_projector|vision_proj|"
                r"image_newline|audio_tower"), "vision/audio tower or projector"),
]


def fused_group(name: str, model_config: dict | None = None, knowledge: Knowledge | None = None) -> str | None:
    """The group id of a fused-GEMM member (per expert: the expert index is part of the prefix): vLLM's
    packed-module table first, then the definition's own merges (one expert's gate and up)."""
    g = arch.fused_group_of(name, model_config)
    if g is None and knowledge is not None and knowledge.definition is not None:
        role = knowledge.definition.role(name)
        g = role.group if role is not None else None
    return g


class Knowledge:
    """What the planner knows about the model: its transformers definition (``definition``), or, when
    there is none (``why`` says why), the name rules of :mod:`fp4convert.plan.name_roles`."""

    def __init__(self, model_config: dict, definition, why: str) -> None:
        self.cfg, self.definition, self.why = model_config, definition, why
        self._layouts: dict[str, arch.ExpertLayout | None] = {}

    @classmethod
    def of(cls, model_config: dict, tensors: list[TensorInfo]) -> Knowledge:
        from fp4convert.plan import definition as modeldef

        try:
            return cls(model_config, modeldef.load(model_config, tensors), "")
        except modeldef.Unknown as exc:
            return cls(model_config, None, str(exc))

    def describe(self) -> dict:
        if self.definition is not None:
            lm = getattr(self.definition, "language_model", None)
            return {"source": "model definition", "transformers": self.definition.transformers_version,
                    "model_class": self.definition.model_class,
                    # a multimodal model: the module whose linears are quantized (docs/formats.md)
                    **({"language_model": lm or "(the model)"} if lm is not None else {})}
        return {"source": "name rules", "why": self.why}

    def layout(self, name: str, shape: tuple[int, ...]) -> arch.ExpertLayout | None:
        """The per-expert split of a 3-D expert stack: stated by the definition's experts class, else by
        the family table (``architectures.stacked_experts``: gpt-oss, Llama 4, transformers-5 layouts)."""
        if name in self._layouts:
            return self._layouts[name]
        lay = None
        role = self.definition.role(name) if self.definition is not None else None
        if role is not None and role.proj is not None and role.kind in ("experts", "kept"):
            # the definition states the stack (kept ones too: their per-expert names go into ``ignore``)
            bias = f"{name}_bias" if name.endswith(("gate_up_proj", "down_proj")) else None
            lay = arch.expert_layout(name, tuple(shape), role.proj, role.transpose, role.split, role.module, bias,  # type: ignore[arg-type]
                                     f"{self.definition.source}: {role.module_class}",  # (a stated stack is 3-D)
                                     tuple(role.names) if role.names else arch.expert_names(self.cfg))
        elif role is None or role.kind == "kept" and len(shape) == 3:
            lay = arch.stacked_experts(name, tuple(shape), self.cfg)
        self._layouts[name] = lay
        return lay

    def describe_weight(self, name: str, shape: tuple[int, ...]) -> str:
        """A quantized weight's description: the name table's words, unless the definition contradicts
        them (DBRX's attention sits under ``norm_attn_norm``: a Linear, not a norm)."""
        what = name_roles.describe(name, shape, self.cfg)
        role = self.definition.role(name) if self.definition is not None else None
        if role is not None and name_roles.role_of(name, shape, self.cfg) not in ("linear", "expert"):
            what = f"matmul weight ({role.module_class} {role.module})"
        return what

    def custom_module(self, name: str) -> str | None:
        """The module of a kept matmul-shaped parameter of a custom module (DBRX's experts), to be named in
        the engine configs' ignore lists."""
        role = self.definition.role(name) if self.definition is not None else None
        if role is not None and role.kind == "kept" and "its matmul layout is not stated" in role.why:
            return role.module
        return None

    def is_kept_matmul(self, name: str) -> bool:
        """A kept tensor the definition says is a Linear weight (so engines must be told it is not FP4)."""
        role = self.definition.role(name) if self.definition is not None else None
        return role is not None and name.endswith(".weight") and role.module_class.endswith("Linear")

    def loaded_names(self, module: str, name: str) -> list[str]:
        """A kept module's spellings: on disk, and as transformers builds it (the definition's key
        conversion, or the renames the family table knows)."""
        names = arch.ignore_names(module, self.cfg)
        role = self.definition.role(name) if self.definition is not None else None
        if role is not None and role.module != "-":
            names += [m for m in (role.module, *role.also) if m not in names]
        return names

    def dequantizes_first(self, name: str) -> bool:
        """Whether transformers' compressed-tensors load routes this tensor through a converter that drops it
        unless it is FP4 (kept, it makes the whole output unloadable there)."""
        role = self.definition.role(name) if self.definition is not None else None
        return bool(role is not None and role.dequant_route)

    def transformers_cannot_load(self, name: str) -> str:
        """Why transformers cannot load any FP4 form of a tensor the plan quantizes ("" when it can)."""
        role = self.definition.role(name) if self.definition is not None else None
        return role.tf_fp4 if role is not None else ""

    def missing_heads(self, decisions: list[Decision]) -> list[str]:
        """Output heads transformers builds with no tensor on disk (tied to the embeddings)."""
        if self.definition is not None:  # a tied head's bias or norm on disk builds no weight: only weights count
            on_disk = {(self.definition.role(d.name) or _NO_ROLE).module for d in decisions if d.name.endswith("weight")}
            return [h for h in self.definition.heads if h not in on_disk]
        if arch.tied_lm_head(self.cfg) and not any(d.module.endswith("lm_head") for d in decisions):
            return ["lm_head"]
        return []

    def reason(self, info: TensorInfo, scheme: str, mtp: tuple[int, int] | None) -> str | None:
        """Why a float tensor is not quantized by default; None when it is."""
        name = info.name
        role = self.definition.role(name) if self.definition is not None else None
        if role is not None:
            if _in_mtp(name, mtp):
                return "MTP (multi-token prediction) layer"
            if role.absent:  # what the name rules say, and that the model has no such parameter
                rule = _rule_reason(info, scheme, mtp, self.cfg)
                return f"{rule}; {role.why}" if rule and rule != UNKNOWN_ROLE else role.why
            if role.kind == "kept":
                if role.proj is not None:  # a stated stack kept on purpose (no consumer reads it in FP4)
                    return role.why
                layout = self.layout(name, info.shape)  # an experts class the definition leaves unstated
                if layout is None:
                    return role.why
                return _k_reason(layout.matrices[0].shape[1], scheme)
            if role.kind == "experts":
                layout = self.layout(name, info.shape)
                if layout is None:
                    return f"{role.module_class} stack {list(info.shape)} cannot be split into gate and up halves"
                return _k_reason(layout.matrices[0].shape[1], scheme)
            if 0 in info.shape:
                return "empty tensor"
            return _k_reason(info.shape[role.input_axis if role.input_axis is not None else -1], scheme)
        return _rule_reason(info, scheme, mtp, self.cfg)

    def input_axis(self, name: str) -> int:
        """The input axis of a 2-D matmul weight on disk: 1 ([out, in]) unless the definition says 0
        (GPT-2's Conv1D, stored [in, out])."""
        role = self.definition.role(name) if self.definition is not None else None
        return role.input_axis if role is not None and role.kind == "linear" and role.input_axis is not None else 1


_NO_ROLE = type("NoRole", (), {"module": None})()


def _k_reason(k: int, scheme: str) -> str | None:
    bs = get_scheme(scheme).block_size
    return f"in-features K={k} is not a multiple of the {scheme} block size {bs}" if k % bs else None


def mtp_layers(model_config: dict) -> tuple[int, int] | None:
    """DeepSeek-style MTP layers sit after the last decoder layer: layers N .. N+k-1 (as a range: a
    config's k is not trusted to be small)."""
    n = model_config.get("num_hidden_layers")
    k = model_config.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        return None
    return (n, n + k)


def _in_mtp(name: str, mtp: tuple[int, int] | None) -> bool:
    m = re.search(r"(^|\.)layers\.(\d{1,4000})\.", name)
    return bool(m and mtp and mtp[0] <= int(m.group(2)) < mtp[1])


def _rule_reason(info: TensorInfo, scheme: str, mtp: tuple[int, int] | None, model_config: dict) -> str | None:
    """Without a model definition: the name rules, and nothing quantized on a guess."""
    name = info.name
    for rx, reason in EXCLUDE:
        if rx.search(name):
            return reason
    if name_roles.is_norm(name):
        return "normalization layer"
    layout = arch.stacked_experts(name, info.shape, model_config)
    if layout is not None:
        return _k_reason(layout.matrices[0].shape[1], scheme)
    if not name.endswith(".weight"):
        return f"not a weight ({name_roles.describe(name, info.shape, model_config)})"
    if _in_mtp(name, mtp):
        return "MTP (multi-token prediction) layer"
    if len(info.shape) != 2:
        return f"{len(info.shape)}-D tensor, not a linear layer's [out, in] weight"
    if 0 in info.shape:
        return "empty tensor"
    return _k_reason(info.shape[-1], scheme) or (None if name_roles.known_linear_leaf(name) else UNKNOWN_ROLE)


UNKNOWN_ROLE = "role unknown without the model definition (kept rather than quantized on a guess)"


def default_reason(info: TensorInfo, scheme: str, knowledge: Knowledge, mtp: tuple[int, int] | None) -> str | None:
    """Why a tensor is not quantized by default; None when it is."""
    if info.dtype not in FLOAT_DTYPES:
        if info.dtype.startswith("F"):
            return f"dtype {info.dtype} is not a bf16/fp16/fp32 source weight"
        return f"not floating point ({info.dtype})"
    return knowledge.reason(info, scheme, mtp)
