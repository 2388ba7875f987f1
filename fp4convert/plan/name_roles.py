"""What a tensor is from its name alone: a coarse role, and the words of a plan reason.

The planner's fallback when transformers has no definition of the model (nothing is quantized on a guess:
:func:`known_linear_leaf`), and the description of every decision either way ("attention query projection",
"MoE router", a 3-D stack's layout). Pure (names, shapes and config.json dicts only); the family tables it
reads (stacked experts) are :mod:`fp4convert.plan.families`.
"""

from __future__ import annotations

import re

from fp4convert.plan.families import ExpertLayout, stacked_experts, text_config

_NORM_RX = re.compile(r"(norm|(^|\.)ln_?\w*\.|(^|\.)ln\d*\.)", re.IGNORECASE)


def is_norm(tensor_name: str) -> bool:
    """Normalization layers, any spelling (``input_layernorm``, BERT ``LayerNorm``, ``ln_f``, ``q_norm``)."""
    return bool(_NORM_RX.search(tensor_name))


_ROLE_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("vision", re.compile(r"(^|\.)(vision_tower|vision_model|visual|image_tower|audio_tower|vision_encoder)(\.|$)")),
    ("projector", re.compile(r"(^|\.)(multi_modal_projector|mm_projector|vision_proj|image_newline)(\.|$)")),
    ("norm", re.compile(r"$^")),  # placeholder: norms are checked here, by is_norm (case-insensitive)
    ("embedding", re.compile(r"(^|\.)(embed_tokens|embeddings?|wte|wpe|word_embeddings|position_embeddings|"
                             r"token_type_embeddings|embed_positions|tok_embeddings|embedding)(\.|$)")),
    ("lm_head", re.compile(r"(^|\.)(lm_head|embed_out)(\.|$)|^output\.weight$")),
    ("router", re.compile(r"(^|\.)(router|gate|shared_expert_gate)\.(weight|bias|e_score_correction_bias)$"
                          r"|(^|\.)router\.")),
)

_LEAF_ROLES: dict[str, str] = {
    "q_proj": "attention query projection", "k_proj": "attention key projection",
    "v_proj": "attention value projection", "o_proj": "attention output projection",
    "query": "attention query projection", "key": "attention key projection", "value": "attention value projection",
    "qkv_proj": "fused attention q/k/v projection", "qkv": "fused attention q/k/v projection",
    "out_proj": "attention output projection",
    "q_a_proj": "MLA query down-projection", "q_b_proj": "MLA query up-projection",
    "kv_a_proj_with_mqa": "MLA key/value down-projection", "kv_b_proj": "MLA key/value up-projection",
    "gate_proj": "MLP gate projection", "up_proj": "MLP up projection", "down_proj": "MLP down projection",
    "w1": "MLP gate projection (w1)", "w3": "MLP up projection (w3)", "w2": "MLP down projection (w2)",
    "fc1": "MLP first projection", "fc2": "MLP second projection", "c_fc": "MLP first projection",
    "c_proj": "output projection", "c_attn": "fused attention q/k/v projection",
}


_DENSE_ROLES = (("attention.output", "attention output projection"), ("intermediate", "MLP up projection"),
                ("output", "MLP down projection"), ("pooler", "pooler projection"))


def role_of(tensor_name: str, shape: tuple[int, ...] = (), model_config: dict | None = None) -> str:
    """A coarse role: vision, projector, embedding, lm_head, router, norm, mtp, expert, linear, other.

    ``expert`` covers routed experts (per-expert 2-D weights and 3-D stacked tensors); ``linear`` any
    other 2-D ``.weight`` matrix. Used for default exclusions and for the consumer tests' shares.
    """
    for role, rx in _ROLE_RULES:
        if role == "norm" and is_norm(tensor_name) or rx.search(tensor_name):
            return role
    if _is_mtp(tensor_name, model_config):
        return "mtp"
    if stacked_experts(tensor_name, shape, model_config) is not None:
        return "expert"
    if re.search(r"(^|\.)experts\.\d+\.", tensor_name) and tensor_name.endswith(".weight"):
        return "expert"
    if tensor_name.endswith(".weight") and len(shape) == 2:
        return "linear"
    return "other"


def _is_mtp(tensor_name: str, model_config: dict | None) -> bool:
    if re.search(r"(^|\.)mtp(\.|_)|(^|\.)nextn", tensor_name):
        return True
    cfg = text_config(model_config)
    n, k = cfg.get("num_hidden_layers"), cfg.get("num_nextn_predict_layers") or 0
    m = re.search(r"(^|\.)layers\.(\d{1,4000})\.", tensor_name)
    return bool(m and isinstance(n, int) and k and n <= int(m.group(2)) < n + k)


def describe_layout(layout: ExpertLayout) -> str:
    """A plan reason's description of a 3-D expert stack."""
    what = {"gate_up": "gate/up", "down": "down", "up": "up"}[layout.kind]
    how = {"interleaved": ", gate/up interleaved", "concatenated": ", gate then up", None: ""}[layout.split]
    orient = "[E, in, out]" if layout.transpose else "[E, out, in]"
    return f"MoE expert {what} projection (3-D stacked {orient}, {layout.num_experts} experts{how})"


def known_linear_leaf(tensor_name: str) -> bool:
    """Without a model definition: whether the name alone positively says "a linear layer's [out, in]
    weight" (a leaf of the table above, or BERT's ``dense``); anything else is not quantized on a guess."""
    module = tensor_name[: -len(".weight")] if tensor_name.endswith(".weight") else tensor_name
    leaf = module.rpartition(".")[2]
    return leaf in _LEAF_ROLES or leaf == "dense"


def describe(tensor_name: str, shape: tuple[int, ...] = (), model_config: dict | None = None) -> str:
    """What a tensor IS, for plan reasons: "attention query projection", "router", "vision tower", ..."""
    role = role_of(tensor_name, shape, model_config)
    if role == "vision":
        return "vision tower"
    if role == "projector":
        return "multimodal projector"
    if role == "embedding":
        return "embedding"
    if role == "lm_head":
        return "lm_head (output projection)"
    if role == "router":
        return "MoE router" if "shared_expert_gate" not in tensor_name else "MoE shared-expert gate"
    if role == "norm":
        return "normalization layer"
    if role == "mtp":
        return "MTP (multi-token prediction) layer"
    if tensor_name.endswith(".bias"):
        return f"bias of {describe(tensor_name[:-len('.bias')] + '.weight', (), model_config)}"
    if re.search(r"\.experts\.(gate_up_proj|down_proj)_bias$", tensor_name):
        return "MoE expert bias (3-D stacked, kept as is)"
    if tensor_name.endswith(".sinks"):
        return "attention sinks"
    layout = stacked_experts(tensor_name, shape, model_config)
    if layout is not None:
        return describe_layout(layout)
    module = tensor_name[: -len(".weight")] if tensor_name.endswith(".weight") else tensor_name
    parent, _, leaf = module.rpartition(".")
    base = _LEAF_ROLES.get(leaf)
    if base is None and leaf == "dense":  # BERT-style names
        base = next((what for end, what in _DENSE_ROLES if parent == end or parent.endswith("." + end)),
                    "dense projection")
    base = base or ("linear layer" if role == "linear" else "tensor")
    if role == "expert":
        m = re.search(r"(^|\.)experts\.(\d+)\.", tensor_name)
        base = f"MoE expert {m.group(2)} {base.replace('MLP ', '')}" if m else f"MoE expert {base}"
    elif re.search(r"(^|\.)shared_experts?\.", tensor_name):
        base = f"shared expert {base.replace('MLP ', '')}"
    return base
