"""Model-family knowledge: which layers engines fuse, how stacked experts are laid out, and what
transformers calls a module once it has loaded a checkpoint.

Pure (names, shapes and config.json dicts only; no torch at import): the planner and the formats ask
this module, so a new family is one table entry here, not a special case in the planner. The facts
and their sources (vLLM model loaders, transformers 5.23 ``conversion_mapping.py``) are collected in
docs/model-families.md; each table entry names the file it comes from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Fused GEMMs: layers an engine loads into ONE weight (so their NVFP4 members need one global scale)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FusedModule:
    """One packed mapping: the engine module ``fused`` is built from the checkpoint modules ``members``.

    ``parent`` (a regex on the module path before the member leaf) limits a mapping to where its
    leaves mean what the entry says (BERT's ``query``/``key``/``value`` sit under ``attention.self``).
    """

    fused: str
    members: tuple[str, ...]
    source: str
    parent: str | None = None
    per_expert: bool = False  # members of one routed expert, stacked into FusedMoE's w13


# vLLM ``packed_modules_mapping`` (and FusedMoE's per-expert w1/w3 -> w13 stacking). Paths are in
# github.com/vllm-project/vllm, vllm/model_executor/...
FUSED_MODULES: tuple[FusedModule, ...] = (
    FusedModule("qkv_proj", ("q_proj", "k_proj", "v_proj"),
                "models/llama.py LlamaForCausalLM.packed_modules_mapping; same in qwen2.py, qwen3.py, qwen3_moe.py, "
                "mixtral.py, llama4.py, gpt_oss.py (GptOssForCausalLM), gemma3.py, gemma3_mm.py, siglip.py"),
    FusedModule("gate_up_proj", ("gate_proj", "up_proj"),
                "models/llama.py LlamaForCausalLM.packed_modules_mapping; same in qwen2/qwen3/qwen3_moe (dense "
                "and shared-expert MLPs), deepseek_v2.py, gemma3.py, gemma3_mm.py, llama4.py (shared expert, "
                "dense layers)"),
    FusedModule("qkv_proj", ("query", "key", "value"),
                "models/bert.py BertModel.packed_modules_mapping (RoBERTa/XLM-R reuse it via models/roberta.py)",
                parent=r"(^|\.)attention\.self$"),
    FusedModule("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa"),
                "models/deepseek_v2.py DeepseekV2ForCausalLM.packed_modules_mapping (when q_lora_rank is set; "
                "DeepseekV2/V3/R1, Kimi K2, GLM-4.5-MoE-lite)"),
    FusedModule("gate_up_proj", ("w1", "w3"),
                "models/deepseek_v4.py packed_modules_mapping (shared expert w1/w3); Mixtral experts below"),
    FusedModule("in_proj_qkvz", ("in_proj_qkv", "in_proj_z"),
                "models/qwen3_5.py Qwen3_5ForCausalLM.packed_modules_mapping (gated delta-net linear attention; "
                "also qwen3_5_moe); vLLM loads both into one in_proj_qkvz weight"),
    FusedModule("in_proj_ba", ("in_proj_b", "in_proj_a"),
                "models/qwen3_5.py Qwen3_5ForCausalLM.packed_modules_mapping (gated delta-net b/a projections)"),
    FusedModule("experts.w13", ("gate_proj", "up_proj"),
                "layers/fused_moe/layer.py FusedMoE.make_expert_params_mapping: shard w1 = ckpt_gate_proj_name, "
                "w3 = ckpt_up_proj_name, both into experts.w13_*; compressed_tensors_moe.py keeps ONE "
                "w13_weight_global_scale per expert (w1's) and warns when w1 and w3 differ",
                parent=r"(^|\.)experts\.\d+$", per_expert=True),
    FusedModule("experts.w13", ("w1", "w3"),
                "models/mixtral.py MixtralModel.load_weights: make_expert_params_mapping(ckpt_gate_proj_name='w1', "
                "ckpt_down_proj_name='w2', ckpt_up_proj_name='w3')",
                parent=r"(^|\.)experts\.\d+$", per_expert=True),
)


def _mapping_for(parent: str, leaf: str) -> FusedModule | None:
    """The most specific mapping that holds ``leaf`` under ``parent`` (per-expert before generic)."""
    hits = [f for f in FUSED_MODULES if leaf in f.members and (f.parent is None or re.search(f.parent, parent))]
    hits.sort(key=lambda f: f.parent is None)  # scoped entries first
    return hits[0] if hits else None


def fused_group_of(tensor_name: str, model_config: dict | None = None) -> str | None:
    """The fused-group id of a 2-D checkpoint weight, or None.

    The id is ``<parent>.{m1,m2,...}``: the parent path (which includes a routed expert's index,
    so every expert is its own group) and the mapping's members in the engine's order.
    A member absent from the checkpoint simply does not join (DeepSeek-V2-Lite's lone ``q_proj``
    forms a group of one, which is the same as no group). ``model_config`` is accepted for mappings
    that depend on the architecture; none of the current ones do (``fused_qkv_a_proj`` exists exactly
    where ``q_a_proj`` does, i.e. where ``q_lora_rank`` is set).
    """
    if not tensor_name.endswith(".weight"):
        return None
    module = tensor_name[: -len(".weight")]
    parent, _, leaf = module.rpartition(".")
    f = _mapping_for(parent, leaf)
    if f is None:
        return None
    return f"{parent}.{{{','.join(f.members)}}}" if parent else f"{{{','.join(f.members)}}}"


# ---------------------------------------------------------------------------------------------
# Stacked (3-D) experts
# ---------------------------------------------------------------------------------------------

# Families whose checkpoints store experts in-features FIRST ([E, K, N]) and how gate/up are packed.
#   gpt-oss: transformers models/gpt_oss/modeling_gpt_oss.py GptOssExperts (gate_up_proj [E, H, 2I],
#     forward uses gate = gate_up[..., ::2], up = gate_up[..., 1::2]); vLLM's SwigluOAIAndMul
#     (layers/activation.py) reads the same interleave.
#   llama4: transformers models/llama4/modeling_llama4.py Llama4TextExperts (gate_up_proj [E, H, 2I],
#     chunk(2, dim=-1): gate first); vLLM models/llama4.py Llama4Model.load_moe_expert_weights chunks
#     dim -1 in two and transposes.
_IN_FIRST: dict[str, str] = {"gpt_oss": "interleaved", "llama4": "concatenated", "llama4_text": "concatenated"}
# transformers-5 in-memory classes that hold [E, 2I, H] (out-features first, gate then up): the
# qwen2_moe / mixtral conversions in transformers conversion_mapping.py (MergeModulelist(dim=0) then
# Concatenate(dim=1) of gate, up); a checkpoint saved from such a class without its reverse
# conversion (e.g. Qwen3.5-MoE, MiniMax) has these shapes on disk.
_OUT_FIRST_SPLIT = "concatenated"

# Per-expert checkpoint names vLLM's loader reads for an architecture whose experts are stored as one 3-D
# stack (gate, up, down): the ``ckpt_*_proj_name`` its ``FusedMoE.make_expert_params_mapping`` is given.
# Default ("gate_proj", "up_proj", "down_proj"): qwen2/3-MoE, DeepSeek, gpt-oss (``GptOssForCausalLM.
# get_expert_mapping``), Llama 4, GraniteMoeHybrid (``get_expert_mapping``).
#   GraniteMoE / GraniteMoeShared: vllm/model_executor/models/granitemoe.py ``GraniteMoeModel._load_weights``
#   (``ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3"``; its ``load_weights`` cuts
#   the bf16 ``input_linear`` into ``experts.{e}.w1/w3``); granitemoeshared.py reuses that loader.
_EXPERT_NAMES: dict[str, tuple[str, str, str]] = {
    "GraniteMoeForCausalLM": ("w1", "w3", "w2"),
    "GraniteMoeSharedForCausalLM": ("w1", "w3", "w2"),
}
# Architectures whose vLLM loader reads no quantized experts in any layout (so an FP4 expert would be read by
# no consumer): vllm/model_executor/models/aria.py ``AriaFusedMoE.weight_loader`` ("Loading expert weights
# with quantization is not supported"; it reads only the 3-D ``experts.fc1/fc2.weight``).
_QUANTIZED_EXPERTS_UNREAD: dict[str, str] = {
    "aria": "vLLM's Aria loader reads no quantized experts (models/aria.py AriaFusedMoE.weight_loader) and "
            "transformers cannot load FP4 experts of this model type",
}


def _architectures(model_config: dict | None) -> list[str]:
    cfg = model_config or {}
    archs = cfg.get("architectures") or []
    return [a for a in archs if isinstance(a, str)]


def expert_names(model_config: dict | None) -> tuple[str, str, str]:
    """The (gate, up, down) per-expert leaves vLLM's loader reads for this architecture (``_EXPERT_NAMES``)."""
    return next((_EXPERT_NAMES[a] for a in _architectures(model_config) if a in _EXPERT_NAMES),
                ("gate_proj", "up_proj", "down_proj"))


def quantized_experts_unread(model_config: dict | None) -> str:
    """Why no consumer reads FP4 experts of this model ("" when vLLM's loader does)."""
    mt = _model_type(model_config)
    for t in (mt, mt.removesuffix("_text"), _model_type(text_config(model_config))):
        if t in _QUANTIZED_EXPERTS_UNREAD:
            return _QUANTIZED_EXPERTS_UNREAD[t]
    return ""


def gate_up_packing(model_config: dict | None) -> str | None:
    """How gate and up are packed in a stack whose class does not state it (the family table ``_IN_FIRST``)."""
    mt = _model_type(model_config) or _model_type(text_config(model_config))
    return _IN_FIRST.get(mt) or _IN_FIRST.get(_model_type(text_config(model_config)))


@dataclass(frozen=True)
class ExpertMatrix:
    """One 2-D ``[N, K]`` matrix cut from a stacked expert tensor.

    Rows ``row_start:row_stop:row_step`` of expert ``expert`` (after the transpose when the layout has
    one) form the matrix that is written as module ``module`` (append ``.weight_packed`` etc.).
    """

    expert: int
    proj: str  # "gate", "up" or "down"
    module: str
    shape: tuple[int, int]
    row_start: int
    row_stop: int
    row_step: int
    group: str | None  # shared global-scale group (gate_e with up_e); None for down


@dataclass(frozen=True)
class ExpertLayout:
    """How a 3-D ``[E, a, b]`` expert tensor becomes per-expert 2-D matrices."""

    name: str
    shape: tuple[int, int, int]
    kind: str  # "gate_up" or "down"
    transpose: bool  # True when the checkpoint is [E, K, N] (in-features first)
    split: str | None  # None (down), "interleaved" (even rows gate, odd rows up) or "concatenated" (gate then up)
    matrices: tuple[ExpertMatrix, ...]
    bias: str | None  # the tensor name of this projection's expert bias, kept as it is
    source: str

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def groups(self) -> dict[str, list[str]]:
        """Shared-scale group id -> output module names (gate_e and up_e of each expert)."""
        out: dict[str, list[str]] = {}
        for m in self.matrices:
            if m.group:
                out.setdefault(m.group, []).append(m.module)
        return out

    def extract(self, w, m: ExpertMatrix):
        """The ``[N, K]`` matrix ``m`` of the stacked tensor ``w`` (a torch.Tensor; a strided view)."""
        x = w[m.expert]
        if self.transpose:
            x = x.transpose(0, 1)
        return x[m.row_start:m.row_stop:m.row_step]


_STACKED_RX = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


def _model_type(model_config: dict | None) -> str:
    cfg = model_config or {}
    return str(cfg.get("model_type") or "")


def text_config(model_config: dict | None) -> dict:
    """The text model's part of a multimodal config.json (``text_config``), else the config itself."""
    cfg = model_config or {}
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def _hidden_size(model_config: dict | None) -> int | None:
    h = text_config(model_config).get("hidden_size") or (model_config or {}).get("hidden_size")
    return h if isinstance(h, int) else None


def stacked_experts(tensor_name: str, shape: tuple[int, ...], model_config: dict | None = None
                    ) -> ExpertLayout | None:
    """The per-expert layout of a 3-D stacked expert weight, or None when it is not one.

    Orientation comes from the architecture (``_IN_FIRST``) and is checked against ``hidden_size``;
    another architecture is accepted only as ``[E, out, in]`` with gate first (transformers-5
    fused experts), decided unambiguously by ``hidden_size``; anything else returns None, so the
    planner keeps the tensor with a reason instead of guessing a layout.
    Output modules are ``<prefix>.experts.<e>.{gate_proj,up_proj,down_proj}``: the per-expert names
    vLLM's FusedMoE.make_expert_params_mapping reads (and its compressed-tensors MoE methods stack
    into ``w13_*`` / ``w2_*``).
    """
    m = _STACKED_RX.match(tensor_name)
    if m is None or len(shape) != 3 or 0 in shape:
        return None
    e, a, b = (int(s) for s in shape)
    kind = "gate_up" if m["proj"] == "gate_up_proj" else "down"
    mt = _model_type(model_config) or _model_type(text_config(model_config))
    h = _hidden_size(model_config)
    if mt in _IN_FIRST:
        transpose, split = True, _IN_FIRST[mt]
        if h is not None and ((kind == "gate_up" and a != h) or (kind == "down" and b != h)):
            return None  # not the documented [E, H, 2I] / [E, I, H]: refuse to guess
        source = f"{mt}: in-features first [E, K, N] (see _IN_FIRST)"
    else:
        if h is None:
            return None
        # [E, N, K] has K = H for gate_up (a = 2I) and N = H for down (a = H). Unknown families are
        # accepted only in this transformers-5 orientation, whose gate/up order is known (gate first);
        # an in-features-first unknown could interleave like gpt-oss, so it is not guessed.
        out_first = (b == h and a != h) if kind == "gate_up" else (a == h and b != h)
        if not out_first:
            return None
        transpose, split = False, _OUT_FIRST_SPLIT
        source = "[E, out, in] (transformers-5 fused experts: gate then up)"
    bias = f"{tensor_name}_bias" if mt == "gpt_oss" else None
    return expert_layout(tensor_name, (e, a, b), kind, transpose, split if kind == "gate_up" else None,
                         m["prefix"], bias, source, expert_names(model_config))


def expert_layout(tensor_name: str, shape: tuple[int, int, int], kind: str, transpose: bool, split: str | None,
                  prefix: str, bias: str | None, source: str,
                  names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> ExpertLayout | None:
    """The per-expert matrices of a 3-D stack whose layout is known (from the model definition or the
    family table above): ``kind`` "gate_up" (``split`` says how gate and up are packed), "down" or
    "up" (an up projection without a gate); ``transpose`` when the stack is ``[E, in, out]``.
    Output modules are ``<prefix>.<e>.<leaf>`` with the (gate, up, down) leaves ``names``
    (:func:`expert_names`: the ones the engine's loader for this architecture reads). None when a
    gate/up stack has an odd number of output rows (it cannot be two halves)."""
    e, a, b = (int(s) for s in shape)
    n, k = (b, a) if transpose else (a, b)
    if kind == "gate_up" and (n % 2 or split is None):
        return None
    leaf = dict(zip(("gate", "up", "down"), names))
    matrices: list[ExpertMatrix] = []
    for x in range(e):
        if kind != "gate_up":
            proj = "down" if kind == "down" else "up"
            matrices.append(ExpertMatrix(x, proj, f"{prefix}.{x}.{leaf[proj]}", (n, k), 0, n, 1, None))
            continue
        half = n // 2
        group = f"{prefix}.{x}.{{{leaf['gate']},{leaf['up']}}}"
        if split == "interleaved":
            rows = {"gate": (0, n, 2), "up": (1, n, 2)}
        else:
            rows = {"gate": (0, half, 1), "up": (half, n, 1)}
        for proj in ("gate", "up"):
            s, t, st = rows[proj]
            matrices.append(ExpertMatrix(x, proj, f"{prefix}.{x}.{leaf[proj]}", (half, k), s, t, st, group))
    return ExpertLayout(tensor_name, (e, a, b), kind, transpose, split if kind == "gate_up" else None,
                        tuple(matrices), bias, source)


# ---------------------------------------------------------------------------------------------
# Module names as transformers builds them (compressed-tensors matches ``ignore`` against these)
# ---------------------------------------------------------------------------------------------

# transformers 5.23 conversion_mapping.py: "llava" (used for gemma3, paligemma, aya_vision, got_ocr2,
# internvl, vipllava, mistral3, aria, pp_chart2table via _MODEL_TO_CONVERSION_PATTERN) and
# "LlavaModel" (language_model.model -> language_model inside the base model).
_LLAVA_TYPES = {"llava", "gemma3", "paligemma", "aya_vision", "got_ocr2", "internvl", "vipllava", "mistral3",
                "aria", "pp_chart2table", "llava_next", "llava_next_video", "llava_onevision"}
_LLAVA_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^language_model\.lm_head(?=\.|$)"), "lm_head"),
    (re.compile(r"^language_model\.model\."), "model.language_model."),
    (re.compile(r"^language_model\."), "model.language_model."),
    (re.compile(r"^vision_tower\."), "model.vision_tower."),
    (re.compile(r"^multi_modal_projector\."), "model.multi_modal_projector."),
)
# conversion_mapping.py "CLIPVisionModel": PrefixChange(prefix_to_remove="vision_model"), which
# SiglipVisionModel / Siglip2VisionModel / CLIP-style towers map to: the tower's own
# ``vision_model.`` level is dropped (Gemma 3's ``vision_tower.vision_model.encoder`` loads as
# ``model.vision_tower.encoder``).
_TOWER_PREFIX = re.compile(r"^(model\.vision_tower\.)vision_model\.")
# conversion_mapping.py "mixtral" (also minimax, minimax_m2): WeightRenaming(".block_sparse_moe.", ".mlp.").
_MIXTRAL_TYPES = {"mixtral", "minimax", "minimax_m2"}


def loaded_module_name(on_disk_name: str, model_config: dict | None = None) -> str:
    """The name transformers 5.23 gives an on-disk tensor (or module) name after its key conversion.

    Only renames are modelled; stacking per-expert tensors into one 3-D parameter changes no module
    name that ``ignore`` can match (the merged experts are not Linear modules in transformers 5).
    """
    mt = _model_type(model_config)
    name = on_disk_name
    if mt in _LLAVA_TYPES:
        for rx, new in _LLAVA_RENAMES:
            if rx.search(name):
                name = rx.sub(new, name, count=1)
                break
        name = _TOWER_PREFIX.sub(r"\1", name)
    if mt in _MIXTRAL_TYPES:
        name = name.replace(".block_sparse_moe.", ".mlp.")
    return name


def ignore_names(on_disk_module: str, model_config: dict | None = None) -> list[str]:
    """Every spelling a consumer may match a kept module by: the on-disk name and transformers' name.

    transformers (compressed-tensors' ``ignore``) matches the module names it builds (after its key
    conversion); vLLM maps ``ignore`` through the model's ``hf_to_vllm_mapper``
    (``CompressedTensorsConfig.apply_vllm_mapper``), which turns transformers-5 names such as
    ``model.vision_tower.`` back into its own, but its own modules keep levels transformers drops
    (SigLIP's ``vision_tower.vision_model.``), which only the on-disk spelling of a release has.
    Listing both costs nothing: an entry that matches no module is ignored (measured with
    transformers 5.23 + compressed-tensors 0.20).
    """
    loaded = loaded_module_name(on_disk_module, model_config)
    return [on_disk_module] if loaded == on_disk_module else [on_disk_module, loaded]


_HEAD_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def tied_lm_head(model_config: dict | None) -> bool:
    """Whether the model has an ``lm_head`` module tied to the embeddings (so none is on disk).

    transformers builds ``lm_head`` as a Linear and ties its weight at load; compressed-tensors must
    find it in ``ignore`` or it targets it as a quantized Linear with no tensors to load. The flag is
    the text config's when it has one (composite VLM configs), else the top level's; transformers'
    default is True. Only architectures with a language-model head have one.
    """
    cfg = model_config or {}
    archs = cfg.get("architectures") or []
    if not any(str(a).endswith(_HEAD_SUFFIXES) for a in archs):
        return False
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and "tie_word_embeddings" in tc:
        return bool(tc["tie_word_embeddings"])
    return bool(cfg.get("tie_word_embeddings", True))
