"""The JSON types of the config.json keys fp4convert itself reads, checked once where the source reads the file.

A hostile or hand-edited config.json may hold any JSON value under any key (``"architectures": 5``, a
string where a number goes, an object where a list goes). The planner, the model definition, the
calibration stage, the formats and the model card all read a handful of keys; rather than guard each
read, :func:`check_types` refuses a wrongly typed value of those keys up front, with one line naming the
file, the key and what to write instead (exit 4: the source is malformed). ``null`` is accepted for
every key (transformers treats it as "not set"). Values transformers alone reads are left to it: the
model definition falls back to name rules when transformers cannot build the model, and the
layer-by-layer stages refuse such a config while planning (``fp4convert.calibrate``), as does
``vocab_size`` there (so it is not repeated here).
"""

from __future__ import annotations

from fp4convert.errors import ConfigJSONError

# key -> (predicate, what the value should be). Only keys fp4convert's own code reads.
_STR = (lambda v: isinstance(v, str), "a string")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_OBJ = (lambda v: isinstance(v, dict), "a JSON object")
_NAMES = (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
          'a list of class names, e.g. ["LlamaForCausalLM"]')


def _count(v: object) -> bool:
    """A non-negative integer, or an object (LXMERT: ``{"language": 9, "vision": 5}``) or a list (ERNIE 4.5
    VL: ``moe_num_experts: [64, 64]``) of them."""
    values = list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, list) else [v]
    return bool(values) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in values)


_COUNT = (_count, "a non-negative integer")
_SIZE = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive integer")

KEYS: dict[str, tuple] = {
    "architectures": _NAMES,  # the model definition, the tied lm_head check, the card's Auto class
    "model_type": _STR,  # the model definition, the calibration stage, the native format's config
    "_name_or_path": _STR,  # the card's base_model
    "tie_word_embeddings": _BOOL,  # whether lm_head is on disk
    "is_encoder_decoder": _BOOL,  # the card's Auto class
    "quantization_config": _OBJ,  # already-quantized sources, FP8 decoding, format detection
    "hidden_size": _SIZE,  # the plan's expert layouts
    # the plan's MTP layers and the model definition's size bounds
    **{k: _COUNT for k in ("num_hidden_layers", "num_nextn_predict_layers", "num_layers", "n_layer",
                           "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                           "encoder_layers", "decoder_layers", "num_decoder_layers")},
}
SUBCONFIGS = ("text_config", "vision_config", "audio_config")  # checked with the same table


def _kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    kinds: dict[type, str] = {str: "a string", list: "a JSON list", dict: "a JSON object"}
    return kinds.get(type(v), type(v).__name__)


def _shown(v: object) -> str:
    """The value for the message, bounded (a 400-digit number or a deep list is cut, never printed whole)."""
    if isinstance(v, (dict, list)):
        return ""
    text = repr(v) if isinstance(v, str) else str(v) if not isinstance(v, int) or v.bit_length() < 64 else "a huge integer"
    return f" ({text[:40]}{'...' if len(text) > 40 else ''})"


def check_types(cfg: dict, label: str) -> None:
    """Raise :class:`ConfigJSONError` for the first key of ``cfg`` (config.json, shown as ``label``) whose
    value has a type fp4convert cannot use."""
    _check(cfg, label, "")
    for sub in SUBCONFIGS:
        value = cfg.get(sub)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigJSONError(f"{label}: {sub} is {_kind(value)}{_shown(value)}, not a JSON object; fix "
                                  f"config.json (or remove {sub})")
        _check(value, label, f"{sub}.")


def _check(cfg: dict, label: str, prefix: str) -> None:
    for key, (ok, want) in KEYS.items():
        value = cfg.get(key)
        if value is None or ok(value):
            continue
        if key == "quantization_config":  # the wording the source has always used for this key
            raise ConfigJSONError(f"{label}: {prefix}{key} is {_kind(value)}, not a JSON object; fix config.json "
                                  f"(or remove {key} from an unquantized checkpoint's config)")
        raise ConfigJSONError(f"{label}: {prefix}{key} is {_kind(value)}{_shown(value)}, not {want}; fix "
                              f"config.json ({prefix}{key})")
