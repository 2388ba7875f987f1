"""Tiny random checkpoints of every architecture the installed transformers ships (the sweep's inputs).

For each ``model_type`` of ``transformers.CONFIG_MAPPING``, the config class is instantiated with its
defaults and every size field is shrunk, recursively through its sub-configs (``text_config``,
``vision_config``, ``audio_config``, encoder/decoder configs, ...): 64 hidden, 128 intermediate, 2
layers, 4 heads of 16, 4 experts (2 per token), 512 tokens, small images. Every linear in-feature that
these sizes decide is a multiple of 32, so NVFP4 and MXFP4 can quantize all of them. The model class
is the config's own ``architectures`` when it names one, else the first Auto mapping (causal LM,
seq2seq LM, image-text-to-text, base model) that has the config class. The model is built with a
fixed seed in bf16 and written with ``save_pretrained`` (safetensors), whose save reverses
transformers' load-time key conversion: the names on disk are the checkpoint names users download.

:func:`build` returns an :class:`Outcome` (built, or skipped with the exception's class and first
line), so the sweep can say how many architectures it covers and why the rest are not.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SEED = 0
MAX_PARAMS = 20_000_000  # a tiny model that is not tiny is skipped (its build alone would take seconds)

# Size fields, by name, wherever they appear (top-level config or any sub-config).
SIZES: dict[str, int] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 96,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "d_model": 64, "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_hidden_size": 64, "decoder_hidden_size": 64,
    "encoder_num_hidden_layers": 2, "decoder_num_hidden_layers": 2,
    "encoder_num_attention_heads": 4, "decoder_num_attention_heads": 4,
    "encoder_intermediate_size": 128, "decoder_intermediate_size": 128,
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 128,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "vocab_size": 512, "embed_dim": 64, "projection_dim": 64, "ffn_dim": 128,
    "image_size": 32, "patch_size": 8,
    "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
    "emb_dim": 64, "n_layers": 2, "n_heads": 4, "dim": 64, "hidden_dim": 128, "embedding_size": 64,
    # Gemma 3n / Gemma 4: no KV sharing across 2 layers, small per-layer embeddings
    "num_kv_shared_layers": 0, "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 32,
}
# Left None by some defaults for the model to derive from sizes this module changes: set too.
DERIVED = {"head_dim", "num_key_value_heads", "moe_intermediate_size", "intermediate_size", "num_experts_per_tok"}
# Only lowered, never raised (a default already smaller than these is kept).
CAPS: dict[str, int] = {"max_position_embeddings": 2048, "n_positions": 512, "num_mel_bins": 80}
VOCAB = SIZES["vocab_size"]


def _is_config(obj) -> bool:
    from transformers import PretrainedConfig

    return isinstance(obj, PretrainedConfig)


def _shrink(cfg, seen: set[int]) -> None:
    """Shrink one config object in place, then its sub-configs (the fallback of :func:`tiny_config`)."""
    if id(cfg) in seen:
        return
    seen.add(id(cfg))
    _shrink_dict(cfg.__dict__)
    for value in list(cfg.__dict__.values()):
        if _is_config(value):
            _shrink(value, seen)
        elif isinstance(value, dict):
            for v in value.values():
                if _is_config(v):
                    _shrink(v, seen)


def _shrink_tree(d: dict) -> dict:
    """Shrink a config dict (``to_dict()``) and every nested config dict in it."""
    _shrink_dict(d)
    for key, value in d.items():
        if isinstance(value, dict) and not key.startswith("_") and key not in ("id2label", "label2id"):
            _shrink_tree(value)
    return d


def _shrink_dict(d: dict) -> None:
    """Shrink the size fields of one config's attributes, in place."""
    old_layers = {k: d.get(k) for k in ("num_hidden_layers", "num_layers", "n_layer", "decoder_layers",
                                        "encoder_layers", "num_decoder_layers")}
    old_lens = {v for v in old_layers.values() if isinstance(v, int) and v > 2}
    for key, value in SIZES.items():
        if key in d and (isinstance(d[key], int) and not isinstance(d[key], bool)
                         or d[key] is None and key in DERIVED):
            d[key] = value
    for key, cap in CAPS.items():
        if isinstance(d.get(key), int) and not isinstance(d[key], bool) and d[key] > cap:
            d[key] = cap
    n = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if isinstance(d.get(k), int)), 2)
    for key, value in list(d.items()):
        if key.startswith("_"):
            continue
        if isinstance(value, (list, tuple)) and value and (len(value) in old_lens or key in (
                "layer_types", "block_types", "layers_block_type", "hybrid_override_pattern")):
            d[key] = type(value)(value[:n])
        elif isinstance(value, str) and key in ("hybrid_override_pattern",) and len(value) > n:
            d[key] = value[:n]
        if key in ("mlp_only_layers", "attn_layer_indices", "full_attn_idxs", "global_attn_layers",
                   "attention_layers", "moe_layers", "dense_layers") and isinstance(value, (list, tuple)) and \
                all(isinstance(v, int) for v in value):
            d[key] = type(value)(v for v in value if v < n)
        if (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")
                or key in ("image_token_id", "video_token_id", "audio_token_id")):
            d[key] = _small_ids(value)


_id_seq: dict[int, int] = {}


def _small_ids(value):
    """Token ids valid in a 512-token vocabulary (ids above it become distinct ids near its end)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if value < VOCAB - 32:
            return value
        if value not in _id_seq:
            _id_seq[value] = VOCAB - 1 - (len(_id_seq) % 31)
        return _id_seq[value]
    if isinstance(value, (list, tuple)):
        return type(value)(_small_ids(v) for v in value)
    return value


def tiny_config(model_type: str):
    """The config class of ``model_type`` with defaults, shrunk (sub-configs included)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    _id_seq.clear()
    d = _shrink_tree(cls().to_dict())
    for key in ("transformers_version", "model_type"):
        d.pop(key, None)
    try:  # rebuilt from the shrunk values, so the class derives what depends on them (head_dim, layer_types)
        return cls(**d)
    except Exception:  # noqa: BLE001 - some classes refuse their own to_dict(); shrink the object instead
        _id_seq.clear()
        cfg = cls()
        _shrink(cfg, set())
        return cfg


AUTO_ORDER = ("MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
              "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", "MODEL_MAPPING", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING")
KIND = {"MODEL_FOR_CAUSAL_LM_MAPPING": "decoder", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING": "encoder-decoder",
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING": "vision-language", "MODEL_MAPPING": "base model",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING": "classifier"}


def candidates(config) -> list[tuple[type, str]]:
    """(class, kind) in order: the config's own ``architectures``, then each Auto mapping with its class."""
    import transformers
    from transformers.models.auto import modeling_auto

    out = []
    for a in getattr(config, "architectures", None) or []:
        c = getattr(transformers, a, None)
        if isinstance(c, type):
            out.append((c, "architectures"))
    for name in AUTO_ORDER:
        try:
            c = getattr(modeling_auto, name)[type(config)]
        except KeyError:
            continue
        if all(c is not o for o, _ in out):
            out.append((c, KIND[name]))
    return out


def model_classes(config) -> list[tuple[type, str]]:
    """(class, kind) of every candidate that builds from ``config`` (on the meta device), in order; the
    first candidate's error is raised when none does ([] when there is no candidate)."""
    import torch

    first, out = None, []
    for cls, kind in candidates(config):
        try:
            with torch.device("meta"):
                cls(config)
            out.append((cls, kind))
        except Exception as exc:  # noqa: BLE001 - a mapping may name a class this config does not fit
            first = first or exc
    if not out and first is not None:
        raise first
    return out


def model_class(config):
    """(class, kind): the first candidate that builds from ``config`` (on the meta device), else the
    first candidate's error is raised (None, None when there is no candidate)."""
    found = model_classes(config)
    return found[0] if found else (None, None)


def reads_back(model, folder: Path) -> bool:
    """Whether transformers maps every key ``save_pretrained`` wrote for ``model`` back onto a parameter or
    buffer of it (its own key conversion, as ``from_pretrained`` applies it). A class whose save it cannot
    read back (a ShieldGemma2 config in Gemma3ForConditionalGeneration: the shieldgemma2 prefix conversion
    is meant for ShieldGemma2ForImageClassification) would make a case about nothing."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    conv = get_model_conversion_mapping(model)
    ren = [c for c in conv if not isinstance(c, WeightConverter)]
    cvt = [c for c in conv if isinstance(c, WeightConverter)]
    state = dict.fromkeys(model.state_dict())
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            keys = [k for k in json.loads(fh.read(n)) if k != "__metadata__"]
        if any(rename_source_key(k, ren, cvt, model.base_model_prefix, state)[0] not in state for k in keys):
            return False
    return True


@dataclass
class Outcome:
    """What building one model_type gave: ``path`` when built, else ``error`` (class: first line)."""

    model_type: str
    ok: bool
    model_class: str = ""
    kind: str = ""
    path: str = ""
    error: str = ""
    seconds: float = 0.0
    params: int = 0


class _Timeout(Exception):
    pass


def _first_line(exc: BaseException) -> str:
    s = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {s[0][:200] if s else ''}"


def build(model_type: str, root: Path, timeout: int = 30) -> Outcome:
    """Build and save the tiny ``model_type`` under ``root/model_type`` (reused when already there)."""
    import torch

    out = Path(root) / model_type
    record = out / "outcome.json"
    if record.exists():
        return Outcome(**json.loads(record.read_text()))
    t0 = time.perf_counter()
    res = Outcome(model_type, False)

    def alarm(*_):
        raise _Timeout(f"build took over {timeout} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        cfg = tiny_config(model_type)
        found = model_classes(cfg)
        if not found:
            raise LookupError(f"no causal-LM/seq2seq/image-text/base model class for {type(cfg).__name__}")
        for i, (cls, kind) in enumerate(found):  # the first class whose save transformers reads back, else the first
            res.model_class, res.kind = cls.__name__, kind
            with torch.device("meta"):  # the size first, without paying for initialisation
                res.params = sum(p.numel() for p in cls(cfg).parameters())  # noqa: built twice on meta: cheap
            if res.params > MAX_PARAMS:
                raise ValueError(f"still {res.params / 1e6:.0f}M parameters after shrinking")
            torch.manual_seed(SEED)
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = cls(copy.deepcopy(cfg))
            finally:
                torch.set_default_dtype(prev)
            model = model.to(torch.bfloat16).eval()
            shutil.rmtree(out / "model", ignore_errors=True)
            model.save_pretrained(out / "model", safe_serialization=True)
            if not any((out / "model").glob("*.safetensors")):
                raise FileNotFoundError("save_pretrained wrote no safetensors file")
            if len(found) == 1 or reads_back(model, out / "model"):
                break
            if i == len(found) - 1:  # none reads back: the first, as before
                cls, kind = found[0]
                res.model_class, res.kind = cls.__name__, kind
                torch.manual_seed(SEED)
                torch.set_default_dtype(torch.bfloat16)
                try:
                    model = cls(copy.deepcopy(cfg))
                finally:
                    torch.set_default_dtype(prev)
                shutil.rmtree(out / "model", ignore_errors=True)
                model.to(torch.bfloat16).eval().save_pretrained(out / "model", safe_serialization=True)
        res.ok, res.path = True, str(out / "model")
    except BaseException as exc:  # noqa: BLE001 - any failure is a skip with its reason
        if isinstance(exc, KeyboardInterrupt):
            raise
        res.error = _first_line(exc)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    res.seconds = round(time.perf_counter() - t0, 3)
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(asdict(res)))
    return res


def model_types() -> list[str]:
    """Every model_type of the installed transformers, sorted."""
    from transformers import CONFIG_MAPPING

    return sorted(CONFIG_MAPPING.keys())


if __name__ == "__main__":  # python tests/tiny_configs.py ROOT [TYPES...]: build and print outcomes
    import sys

    root = Path(sys.argv[1])
    todo = sys.argv[2:] or model_types()
    for mt in todo:
        o = build(mt, root)
        print(json.dumps(asdict(o)), flush=True)
