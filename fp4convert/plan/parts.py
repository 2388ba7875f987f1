"""Which part of a model is its language model, and which Linears route, from the model definition.

fp4convert quantizes a model's language model (README "Plan first", docs/formats.md "Which tensors are
quantized"). For a model that holds a decoder-only language model beside encoders of other modalities (a
VLM, an audio LM, an omni model), the language model is found from what transformers itself exposes:

- the decoder its generation uses, ``model.get_decoder()``, widened to the outermost module built from
  the same config object that holds no encoder of another modality (``language_model`` of LLaVA, the
  whole ``OPTForCausalLM`` of InstructBLIP);
- text sub-models built from their own sub-config whose input is a token embedding belong to it too;
- parts: modules built from any other sub-config (``vision_config``, ``audio_config``, ``qformer_config``,
  ...: the module's ``config`` is that sub-config object) whose input is not a token embedding, and the
  encoders ``get_encoder()`` / ``get_encoder(modality)`` return when their input is another modality.

Everything outside the language model (parts, the modules that hold them, connectors, projectors,
embedding projections) is kept, with a reason naming the module's class and the part it belongs to. A
model that does not generate text (``can_generate()`` is false and no generation Auto class is registered
for its config: CLIP, SigLIP, BERT, ViT), an encoder-decoder (``config.is_encoder_decoder``: Whisper, T5,
Pix2Struct, Parakeet: one model trained end to end) or a model that holds nothing but its encoders (a CTC
speech encoder) has no language model beside other parts: it is quantized whole.

Routers by role (:func:`routing_linears`): a Linear whose output feeds a routing decision in the forward
source of the module that holds it (a ``topk`` of its output, or a method whose name says it
routes: Gemma 3n's ``AltUp.compute_router_modalities``) is a router, whatever it is called.

Imported only in the definition's child process (torch and transformers are imported by the caller).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

# Connectors inside a language model that holds its parts itself (GIT, Idefics, Phi-4-multimodal): classes
# that say they project, resample or merge another modality into the text stream (transformers' naming of
# these classes: GitProjection, IdeficsPerceiverResampler, LlavaMultiModalProjector, Qwen2VLPatchMerger).
_CONNECTOR_RX = re.compile(r"(Projector|Projection|Embedder|Merger|Resampler|Connector)$")
_GENERATION_MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
                        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING",
                        "MODEL_FOR_VISION_2_SEQ_MAPPING", "MODEL_FOR_MULTIMODAL_LM_MAPPING")
_PIP_RX = re.compile(r"pip install ([A-Za-z0-9_.\-\[\]]+)")


@dataclass(frozen=True)
class Parts:
    """The language model of a model and what lies outside it (module paths as transformers builds them).

    ``language_model`` is None when the model is quantized whole (no language model beside other parts);
    else the path of its root ("" for the model itself). ``regions``: the language model's root and its
    text sub-models; ``parts``: encoders of other modalities (path -> description); ``unbuilt``: parts
    transformers could not build here (path -> the packages to install)."""

    language_model: str | None
    lm_class: str = ""
    regions: tuple[str, ...] = ()
    parts: dict[str, str] = field(default_factory=dict)
    unbuilt: dict[str, str] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)  # path -> class of every module (for reasons)

    def outside(self, path: str) -> str | None:
        """Why the module ``path`` is outside the language model (a reason naming its class and part); None
        when it is inside, or when the model is quantized whole."""
        if self.language_model is None:
            return None
        lm = f"the language model {self.lm_class} {self.language_model or '(the model itself)'}"
        part = next((p for p in self.parts if _under(path, p)), None)
        if part is not None:
            what = self.parts[part]
            own = "" if path == part else f"{self.classes.get(path, '-')} {path} in "
            return f"{own}{what}: outside {lm}, kept (engines build it unquantized)"
        region = max((r for r in self.regions if _under(path, r)), key=len, default=None)
        if region is not None:
            if not any(_under(p, region) for p in self.parts):
                return None
            for a in _ancestors(path):
                if a == region or not _under(a, region):
                    continue
                cls = self.classes.get(a, "-")
                holds = [p for p in self.parts if _under(p, a) and p != a]
                own = "" if path == a else f"{self.classes.get(path, '-')} {path} in "
                if holds:
                    return (f"{own}{cls} {a}, which holds the {self.parts[holds[0]].split(' part ', 1)[0]} part "
                            f"{holds[0]}: outside {lm}, kept (engines build it unquantized)")
                if _CONNECTOR_RX.search(cls):
                    return f"{own}connector {cls} {a}: outside {lm}, kept (engines build it unquantized)"
            return None
        top = next((a for a in _ancestors(path) if not any(_under(r, a) for r in self.regions)), path)
        own = "" if path == top else f"{self.classes.get(path, '-')} {path} in "
        return (f"{own}{self.classes.get(top, '-')} {top} (a connector, projector or embedding projection), outside "
                f"{lm}: kept (engines build it unquantized)")


def _under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def _ancestors(path: str) -> list[str]:
    """``a``, ``a.b``, ``a.b.c`` for ``a.b.c`` (outermost first)."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def generates(model) -> bool:
    """Whether the model generates text: transformers' ``can_generate()``, or a generation Auto class is
    registered for its config (a base VLM class such as ``LlavaModel`` holds the same language model)."""
    try:
        if model.can_generate():
            return True
    except Exception:  # noqa: BLE001 - exotic classes may raise
        pass
    from transformers.models.auto import modeling_auto

    for name in _GENERATION_MAPPINGS:
        mapping = getattr(modeling_auto, name, None)
        try:
            if mapping is not None and type(model.config) in mapping:
                return True
        except Exception:  # noqa: BLE001
            continue
    return False


def _token_input(module) -> bool:
    """Whether a (sub-)model's input is a token embedding (a text model), from its ``get_input_embeddings``."""
    import torch.nn as nn

    get = getattr(module, "get_input_embeddings", None)
    if get is None:
        return False
    try:
        emb = get()
    except Exception:  # noqa: BLE001 - vision/audio models without token embeddings may raise
        return False
    return isinstance(emb, nn.Embedding)


def _other_input(module) -> bool:
    """Whether a module positively takes another modality: its input embedding is a convolution or a Linear
    (Whisper's encoder: ``conv1``), not a token embedding."""
    import torch.nn as nn

    get = getattr(module, "get_input_embeddings", None)
    try:
        emb = get() if get is not None else None
    except Exception:  # noqa: BLE001 - not declared: the input the class names below decides
        emb = None
    if emb is not None:
        return isinstance(emb, (nn.modules.conv._ConvNd, nn.Linear))
    # the input the model class declares (Speech2TextEncoder: ``input_features``; a text stack: ``input_ids``)
    main = getattr(module, "main_input_name", None)
    return isinstance(main, str) and main not in ("input_ids", "inputs_embeds", "decoder_input_ids")


def find_parts(model, modules: dict, unbuilt: dict[str, str] | None = None) -> Parts:
    """The language model of ``model`` and the parts outside it (see the module docstring)."""
    from transformers import PretrainedConfig

    unbuilt = dict(unbuilt or {})
    classes = {p: type(m).__name__ for p, m in modules.items()}
    classes.update({p: why.split(",", 1)[0] for p, why in unbuilt.items()})  # the class it would have been
    top = model.config
    try:
        text_cfg = top.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - several text configs: no single one
        text_cfg = top
    inv = {id(m): p for p, m in modules.items()}
    try:
        dec = model.get_decoder()
    except Exception:  # noqa: BLE001 - a model without a decoder lookup
        dec = model
    dec_path = inv.get(id(dec), "")
    dec_cfg = getattr(modules.get(dec_path), "config", None)
    sub_keys = {}
    for key in getattr(top, "sub_configs", None) or {}:
        c = getattr(top, key, None)
        if isinstance(c, PretrainedConfig):
            sub_keys[id(c)] = key

    def describe(path: str, cfg) -> str:
        key = sub_keys.get(id(cfg)) if cfg is not None else None
        kind = key.removesuffix("_config").replace("_", " ") if key else (
            type(cfg).__name__ if cfg is not None else "encoder")
        return f"{kind} part {path} ({classes.get(path, '-')})"

    own_lm = dec_cfg is not None and dec_cfg is not top  # the decoder is a sub-model built from its own config
    parts: dict[str, str] = {}
    text_parts: list[str] = []
    for path, m in modules.items():
        if not path or any(_under(path, p) for p in parts):
            continue
        if _under(dec_path, path) or (own_lm and _under(path, dec_path)):
            continue  # the decoder, its ancestors and (a sub-model's) insides
        if path in unbuilt:
            parts[path] = describe(path, getattr(m, "config", None))
            continue
        cfg = getattr(m, "config", None)
        if not isinstance(cfg, PretrainedConfig) or cfg is top or cfg is dec_cfg:
            continue
        if _token_input(m):  # a text sub-model of its own (T5Gemma's encoder): part of the language model
            text_parts.append(path)
            continue
        if type(cfg) in (type(top), type(text_cfg), type(dec_cfg)):
            continue  # not built from another sub-config (GitEncoder holds the model's own config)
        parts[path] = describe(path, cfg)
    parts = _encoder_parts(model, inv, dec_path, parts, describe)
    if not generates(model) or getattr(top, "is_encoder_decoder", False) or not (parts or (text_cfg is not top
                                                                                        and own_lm)):
        return Parts(None, classes=classes)
    if dec_path in ("", getattr(model, "base_model_prefix", "")) and text_cfg is not top:
        # the text config builds a sub-model of its own, yet transformers' decoder is the whole model (CLVP: a
        # contrastive speech-text model whose generation is a speech decoder): no language model beside parts
        return Parts(None, classes=classes)
    lm = _language_model_path(dec_path, dec_cfg, modules, parts) if dec is not model else dec_path
    text_parts = [t for t in text_parts if not _under(t, lm) and not any(_under(t, p) for p in parts)]
    return Parts(lm, classes.get(lm, "-"), (lm, *text_parts), parts, unbuilt, classes)


def _encoder_parts(model, inv: dict, dec_path: str, parts: dict[str, str], describe) -> dict[str, str]:
    """``parts`` with the encoders transformers' ``get_encoder`` names for another modality (they replace the
    parts found inside them)."""
    top = model.config
    for modality in (None, "image", "audio"):
        try:
            enc = model.get_encoder(modality=modality) if modality else model.get_encoder()
        except Exception:  # noqa: BLE001
            continue
        p = inv.get(id(enc))
        if p is None or enc is model or enc is getattr(model, "base_model", None) or _under(dec_path, p) \
                or any(_under(p, q) for q in parts) or _token_input(enc):
            continue
        if modality is None and not _other_input(enc):
            continue  # the text stack BERT-style models call ``encoder`` (GIT's GitEncoder): not another modality
        parts = {q: d for q, d in parts.items() if not _under(q, p)}
        parts[p] = describe(p, getattr(enc, "config", None)).replace("encoder part", "encoder", 1) \
            if getattr(enc, "config", None) is top else describe(p, getattr(enc, "config", None))
    return parts


def _language_model_path(dec_path: str, dec_cfg, modules: dict, parts: dict[str, str]) -> str:
    """The decoder's path, climbed to the outermost ancestor built from the same config that holds no part."""
    lm = dec_path
    while lm:
        parent = lm.rpartition(".")[0]
        pm = modules.get(parent)
        if pm is None or getattr(pm, "config", None) is not dec_cfg or any(_under(p, parent) for p in parts):
            break
        lm = parent
    return lm


def missing_packages(exc: BaseException) -> list[str]:
    """The packages transformers' ``requires_backends`` error says to install (``pip install pillow``)."""
    return list(dict.fromkeys(_PIP_RX.findall(str(exc))))


class build_without_unbuildable_parts:  # noqa: N801 - used as a context manager, like a function
    """While active, a sub-model transformers builds through ``_from_config`` (what ``AutoModel.from_config``
    calls for a sub-config) that cannot be built here (an optional package missing: Gemma 3n's timm vision
    tower needs pillow and timm) becomes a placeholder module that holds no parameters, so the rest of the
    model (its language model) is built from the definition. ``unbuilt`` collects (id of the placeholder ->
    (the class that failed, the packages to install))."""

    def __init__(self) -> None:
        self.unbuilt: dict[int, tuple[str, str]] = {}

    def __enter__(self):
        import torch.nn as nn
        from transformers import PreTrainedModel

        original = PreTrainedModel.__dict__["_from_config"]
        self._original = original
        outer = self

        class Unbuilt(nn.Module):
            """A part transformers could not build here (its optional packages are missing)."""

            def __init__(self, config) -> None:
                super().__init__()
                self.config = config

        def _from_config(cls, config, **kwargs):
            try:
                return original.__func__(cls, config, **kwargs)
            except ImportError as exc:
                ph = Unbuilt(config)
                outer.unbuilt[id(ph)] = (cls.__name__, ", ".join(missing_packages(exc)) or _first(exc))
                return ph

        PreTrainedModel._from_config = classmethod(_from_config)
        return self

    def __exit__(self, *exc) -> None:
        from transformers import PreTrainedModel

        PreTrainedModel._from_config = self._original


def _first(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:80]


# ---------------------------------------------------------------------------------------------
# Routers by role
# ---------------------------------------------------------------------------------------------

_ROUTE_FN_RX = re.compile(r"rout", re.IGNORECASE)
# a selection among experts or modalities: torch.topk(, .topk( -- not Gemma 3n's _gaussian_topk(; not a softmax or
# an argmax alone (ConvBERT's dynamic kernels, a CTC head's vocabulary, PP-LCNet's classifier end in one)
_DECISION = r"(?<!\w)topk"
_SOURCE_CACHE: dict[type, list[tuple[str, str]] | None] = {}


def _methods(cls: type) -> list[tuple[str, str]] | None:
    """(name, source) of every method a class defines (its own and inherited from model code), or None."""
    if cls in _SOURCE_CACHE:
        return _SOURCE_CACHE[cls]
    out: list[tuple[str, str]] = []
    try:
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch."):
                break
            for name, fn in vars(klass).items():
                if inspect.isfunction(fn) and name != "__init__":
                    out.append((name, inspect.getsource(fn)))
    except (OSError, TypeError):
        out = []
    _SOURCE_CACHE[cls] = out or None
    return _SOURCE_CACHE[cls]


def routing_linears(modules: dict) -> dict[str, str]:
    """Linear modules whose output feeds a routing decision, from the forward source of their holder:
    path -> why (naming the holder's class and method)."""
    import torch.nn as nn

    out: dict[str, str] = {}
    for path, holder in modules.items():
        children = [(n, c) for n, c in holder.named_children() if isinstance(c, nn.Linear)]
        if not children:
            continue
        methods = _methods(type(holder))
        if not methods:
            continue
        for leaf, _ in children:
            call = rf"self\.{re.escape(leaf)}\("
            for fname, src in methods:
                if not re.search(call, src):
                    continue
                var = re.search(rf"(\w+)\s*=\s*{call}", src)
                direct = re.search(rf"{_DECISION}\(\s*{call}", src)
                fed = var is not None and re.search(
                    rf"{_DECISION}\(\s*{re.escape(var.group(1))}\b|\b{re.escape(var.group(1))}\s*\.\s*{_DECISION}\(", src)
                if direct or fed or _ROUTE_FN_RX.search(fname):
                    how = "its output feeds " + ("a top-k" if direct or fed else f"{fname}()")
                    out[f"{path}.{leaf}" if path else leaf] = f"{type(holder).__name__}.{fname}: {how}"
                    break
    return out
