"""The language model of a multimodal model, from its definition (fp4convert/plan/parts.py; issue 32).

Checkpoints here are real transformers classes built on the ``meta`` device and written with the state
dict's own names and shapes (zeros): planning reads headers only, and a meta build costs milliseconds where
initialising Gemma 3n's weights costs seconds. The architecture sweep (tests/e2e/test_model_sweep.py) checks
the same policy on every multimodal model type transformers ships, with real weights and transformers'
own load of the output.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file  # noqa: E402

from fp4convert.plan import parts as modelparts  # noqa: E402
from fp4convert.config import ConvertConfig  # noqa: E402
from fp4convert.run.convert import plan_conversion  # noqa: E402
from fp4convert.plan.roles import KEPT, Definition, Role  # noqa: E402
from fp4convert.plan.types import KEEP, QUANTIZE
from fp4convert.plan.knowledge import Knowledge  # noqa: E402

from tests import tiny_configs  # noqa: E402
from tests.checkpoints import definitions_in_process  # noqa: E402

CT = ConvertConfig(device="cpu", format="compressed-tensors")
HAS_TIMM = all(importlib.util.find_spec(p) is not None for p in ("timm", "PIL"))


@pytest.fixture(autouse=True)
def _in_process(monkeypatch) -> None:
    definitions_in_process(monkeypatch)


def _write(model, folder: Path, extra: dict[str, tuple[int, ...]] | None = None) -> Path:
    """The model's parameters and persistent buffers as a checkpoint (tied parameters once, under their first
    name, as ``save_pretrained`` writes them), plus ``extra`` tensors, with its config."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: torch.zeros(tuple(p.shape), dtype=torch.bfloat16) for n, p in model.named_parameters()}
    non_persistent = {f"{m}.{b}" if m else b for m, mod in model.named_modules()
                      for b in getattr(mod, "_non_persistent_buffers_set", ())}
    tensors.update({n: torch.zeros(tuple(b.shape), dtype=torch.bfloat16) for n, b in model.named_buffers()
                    if n not in non_persistent and b.is_floating_point()})
    tensors.update({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in (extra or {}).items()})
    save_file(tensors, str(folder / "model.safetensors"))
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    return folder


def _meta(cls_name: str, model_type: str):
    cfg = tiny_configs.tiny_config(model_type)
    with torch.device("meta"), modelparts.build_without_unbuildable_parts():
        return getattr(transformers, cls_name)(cfg)


def _plan(folder: Path):
    _, plan, _ = plan_conversion(str(folder), CT)
    return plan


# Names of the timm MobileNet-V5 vision tower of Gemma 3n releases (its weights load into TimmWrapperModel)
GEMMA3N_TIMM = {"model.vision_tower.timm_model.conv_stem.conv.weight": (64, 3, 3, 3),
                "model.vision_tower.timm_model.blocks.0.0.conv_pwl.weight": (64, 64, 1, 1),
                "model.vision_tower.timm_model.msfa.ffn.pw_proj.conv.weight": (64, 64, 1, 1),
                "model.vision_tower.timm_model.msfa.norm.weight": (64,)}


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory) -> Path:
    model = _meta("Gemma3nForConditionalGeneration", "gemma3n")
    return _write(model, tmp_path_factory.mktemp("gemma3n"), None if HAS_TIMM else GEMMA3N_TIMM)


def test_gemma3n_multimodal_is_planned_from_its_definition(gemma3n) -> None:
    """Without pillow/timm transformers cannot build Gemma 3n's vision tower; the plan still comes from the
    definition (the rest of the model is built), and says which packages the tower needs."""
    plan = _plan(gemma3n)
    assert plan.knowledge.describe()["source"] == "model definition", plan.knowledge.describe()
    assert plan.knowledge.definition.language_model == "model.language_model"
    assert plan.knowledge.describe()["language_model"] == "model.language_model"  # --dry-run --json says it
    by = plan.by_name
    lm = [d for n, d in by.items() if n.startswith("model.language_model.") and n.endswith("_proj.weight")
          and ".altup." not in n]
    assert lm and all(d.action == QUANTIZE for d in lm), [d.name for d in lm if d.action != QUANTIZE][:5]
    for name, d in by.items():
        if not name.startswith("model.language_model."):
            assert d.action == KEEP, name  # towers, embedders, everything outside the language model
    audio = by["model.audio_tower.conformer.0.attention.attn.q_proj.weight"]
    assert "audio part model.audio_tower" in audio.reason and "Gemma3nAudioEncoder" in audio.reason
    proj = by["model.embed_vision.embedding_projection.weight"]
    assert "Gemma3nMultimodalEmbedder model.embed_vision" in proj.reason and "outside the language model" in proj.reason
    router = by["model.language_model.layers.0.altup.modality_router.weight"]
    assert router.action == KEEP and router.reason.startswith("router") and "compute_router_modalities" in router.reason
    if not HAS_TIMM:
        tower = by["model.vision_tower.timm_model.blocks.0.0.conv_pwl.weight"]
        assert tower.action == KEEP and "vision part model.vision_tower" in tower.reason
        assert "pillow" in tower.reason and "timm" in tower.reason and "pip install" in tower.reason
        assert any("pillow" in w and "model.vision_tower" in w for w in plan.warnings), plan.warnings
    assert not any(w.startswith("planned from tensor names") for w in plan.warnings)


def test_a_router_is_kept_by_what_its_output_feeds() -> None:
    """Routers by role: Gemma 3n's ``altup.modality_router`` (its holder's ``compute_router_modalities``), a
    Mixtral-style ``gate`` feeding a softmax; never a gated MLP's ``gate_proj`` (Gemma 3n's activation-sparsity
    ``_gaussian_topk`` is not a routing top-k)."""
    text = _meta("Gemma3nForCausalLM", "gemma3n_text")
    routers = modelparts.routing_linears(dict(text.named_modules()))
    assert "model.layers.0.altup.modality_router" in routers
    assert not any(p.endswith(("gate_proj", "up_proj", "down_proj", "q_proj")) for p in routers), routers
    qwen = _meta("Qwen2MoeForCausalLM", "qwen2_moe")
    routers = modelparts.routing_linears(dict(qwen.named_modules()))
    assert not any(p.endswith(("gate_proj", "up_proj", "down_proj", "q_proj", "o_proj")) for p in routers), routers


@pytest.mark.parametrize("cls_name,model_type,lm,part", [
    ("VoxtralForConditionalGeneration", "voxtral", "model.language_model", "model.audio_tower"),
    ("Idefics3ForConditionalGeneration", "idefics3", "model.text_model", "model.vision_model"),
    ("LlavaForConditionalGeneration", "llava", "model.language_model", "model.vision_tower"),
])
def test_only_the_language_model_is_quantized(cls_name, model_type, lm, part, tmp_path) -> None:
    """Voxtral's and LLaVA's ``language_model``, Idefics3's ``text_model``: quantized; the
    encoder of the other modality and every connector (Idefics3's ``connector.modality_projection.proj``,
    LLaVA's ``multi_modal_projector``) kept, with a reason naming their class and part."""
    model = _meta(cls_name, model_type)
    modules = dict(model.named_modules())
    parts = modelparts.find_parts(model, modules)
    assert parts.language_model == lm and part in parts.parts, (parts.language_model, parts.parts)
    plan = _plan(_write(model, tmp_path / model_type))
    assert plan.knowledge.definition.language_model == lm
    role = plan.knowledge.definition.role
    quantized = [d for d in plan.decisions if d.action == QUANTIZE]
    assert quantized
    for d in quantized:
        assert role(d.name).module.startswith(lm + "."), d.name
    linears = [d for d in plan.decisions if d.name.endswith(".weight") and len(d.info.shape) == 2
               and type(modules.get(role(d.name).module)).__name__ == "Linear"]
    for d in linears:
        inside = role(d.name).module.startswith(lm + ".")
        if not inside and not d.reason.startswith("output projection"):
            assert d.action == KEEP and "language model" in d.reason and role(d.name).module_class in d.reason, \
                (d.name, d.reason)
        elif d.action == KEEP:  # inside: only the documented rules (heads, routers, K not a multiple of 16)
            assert d.reason.startswith(("output projection", "router", "MoE router", "in-features K=")), d.reason
    connector = {"idefics3": "model.connector.modality_projection.proj.weight",
                 "llava": "model.multi_modal_projector.linear_1.weight"}.get(model_type)
    if connector:
        assert plan.by_name[connector].action == KEEP


@pytest.mark.parametrize("cls_name,model_type", [("CLIPModel", "clip"), ("SiglipModel", "siglip"),
                                                  ("BertModel", "bert"),
                                                  ("WhisperForConditionalGeneration", "whisper")])
def test_encoders_without_a_language_model_are_quantized_whole(cls_name, model_type, tmp_path) -> None:
    """One policy for standalone encoders, dual encoders and encoder-decoders: no language model beside other
    parts, so every Linear of every encoder (text, vision, audio alike) and the embedding projections are
    quantized (Whisper's audio encoder as its decoder; CLIP's text and vision encoders and both projections)."""
    model = _meta(cls_name, model_type)
    assert modelparts.find_parts(model, dict(model.named_modules())).language_model is None
    plan = _plan(_write(model, tmp_path / model_type))
    role = plan.knowledge.definition.role
    modules = dict(model.named_modules())
    linears = [d for d in plan.decisions if d.name.endswith(".weight") and len(d.info.shape) == 2
               and type(modules.get(role(d.name).module)).__name__ == "Linear"]
    linears = [d for d in linears if not d.reason.startswith("output projection")]  # the head: kept everywhere
    assert linears and all(d.action == QUANTIZE for d in linears), \
        [(d.name, d.reason) for d in linears if d.action != QUANTIZE][:4]


def test_a_tied_head_with_other_tensors_on_disk_is_still_in_ignore() -> None:
    """A head tied to the embeddings has no weight on disk even when its bias is there: compressed-tensors
    must find it in ``ignore`` (else it builds an FP4 module with no FP4 weight to load)."""
    roles = {"lm_head.bias": Role(KEPT, "lm_head", "Linear", "bias of Linear"),
             "model.embed_tokens.weight": Role(KEPT, "model.embed_tokens", "Embedding", "embedding (Embedding)")}
    d = Definition("XForCausalLM", "5", roles, ("lm_head",), head_on_disk=False)
    know = Knowledge({}, d, "")
    from fp4convert.plan.types import Decision
    from fp4convert.storage.safetensors import TensorInfo

    decisions = [Decision(n, KEEP, r.why, TensorInfo(n, "BF16", (8,), "", 0, 0)) for n, r in roles.items()]
    assert know.missing_heads(decisions) == ["lm_head"]


def test_parts_survive_the_definition_cache(gemma3n, tmp_path, monkeypatch) -> None:
    """What the child process answers (JSON, and the on-disk cache) keeps the language model and the note on
    unbuilt parts."""
    from fp4convert.plan import definition as modeldef

    cfg = json.loads((gemma3n / "config.json").read_text())
    _, plan, _ = plan_conversion(str(gemma3n), CT)
    d = plan.knowledge.definition
    again = modeldef._from_json(json.loads(json.dumps(modeldef._to_json(d))))
    assert again.language_model == d.language_model == "model.language_model"
    assert again.unbuilt == d.unbuilt and (HAS_TIMM or "pillow" in again.unbuilt)
    assert cfg["architectures"] == ["Gemma3nForConditionalGeneration"]


def _multimodal_types() -> list[str]:
    from transformers import CONFIG_MAPPING

    out = []
    for mt in tiny_configs.model_types():
        try:
            keys = list(getattr(CONFIG_MAPPING[mt], "sub_configs", None) or {})
        except Exception:  # noqa: BLE001 - a lazy mapping entry that cannot import
            continue
        if any(w in k for k in keys for w in ("vision", "audio", "image", "speech", "video")):
            out.append(mt)
    return out


@pytest.mark.slow
def test_every_multimodal_type_finds_its_language_model(request) -> None:
    """Every multimodal model type transformers ships, built on the meta device (so the ones the sweep cannot
    build with weights, for size or a missing package, are covered too): a model that generates text and is
    not an encoder-decoder has a language model that holds transformers' ``get_decoder()``, and no module
    built from a vision/audio/... sub-config lies inside it; the others are quantized whole. Part of the
    sweep's long tail (20-40 s on 2 cores): runs with ``-m slow`` or ``FP4CONVERT_SWEEP=all``."""
    import os
    import re

    expr = request.config.getoption("markexpr") or ""
    if os.environ.get("FP4CONVERT_SWEEP") != "all" and not ("slow" in expr and "not slow" not in expr):
        pytest.skip("long tail of the sweep: run with -m slow or FP4CONVERT_SWEEP=all")

    from transformers import PretrainedConfig

    checked, problems = [], []
    for mt in _multimodal_types():
        try:
            cfg = tiny_configs.tiny_config(mt)
        except Exception:  # noqa: BLE001 - a config its own validators refuse once shrunk: not ours to test
            continue
        model = None
        for cls, _ in tiny_configs.candidates(cfg):
            try:
                with torch.device("meta"), modelparts.build_without_unbuildable_parts():
                    model = cls(cfg)
                break
            except Exception:  # noqa: BLE001 - a mapping may name a class this config does not fit
                continue
        if model is None:
            continue
        modules = dict(model.named_modules())
        parts = modelparts.find_parts(model, modules)
        checked.append(mt)
        top = model.config
        if parts.language_model is None:
            if modelparts.generates(model) and not top.is_encoder_decoder and parts.parts:
                problems.append(f"{mt}: generates beside parts {list(parts.parts)[:2]}, yet no language model")
            continue
        lm = parts.language_model
        inv = {id(m): p for p, m in modules.items()}
        dec = inv.get(id(model.get_decoder()))
        if dec is not None and not (lm == "" or dec == lm or dec.startswith(lm + ".")):
            problems.append(f"{mt}: language model {lm} does not hold get_decoder() {dec}")
        keys = {id(getattr(top, k)): k for k in (top.sub_configs or {})
                if re.search(r"vision|audio|image|video|speech", k) and isinstance(getattr(top, k, None), PretrainedConfig)}
        for p, m in modules.items():
            if p and id(getattr(m, "config", None)) in keys and parts.outside(p) is None:
                problems.append(f"{mt}: {p} (built from {keys[id(m.config)]}) is inside the language model {lm}")
                break
    assert len(checked) >= 60, checked
    assert not problems, problems
