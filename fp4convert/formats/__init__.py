"""On-disk conventions ("formats"): one module each, every one owning both writing and reading.

The registry below is the only list of formats: the CLI's choices, the config's validation, the
planner, ``inspect`` and ``export`` all consult it. Modules are imported on first use, so the names
are known without importing torch (``fp4convert --help`` stays fast). Adding a format is one module
and one line here.
"""

from __future__ import annotations

import importlib
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fp4convert.formats.base import OutputFormat

# name -> module (relative to this package); the first is the default output.
OUTPUT_FORMATS: dict[str, str] = {
    "fp4convert": "native",
    "compressed-tensors": "compressed_tensors",
    "modelopt": "modelopt",
}
DEFAULT_FORMAT = next(iter(OUTPUT_FORMATS))
# Quantized conventions read as inputs only (decoded exactly to fp32): name -> module.
INPUT_FORMATS: dict[str, str] = {
    "fp8": "fp8",
    "gpt-oss-mxfp4": "mxfp4_blocks",
    "int4-pack-quantized": "pack_quantized",
    "fp4": "fp4_checkpoint",  # decoded only when a conversion asks to quantize again (fp4convert.plan.sources)
}


@cache
def get_format(name: str, activations: str = "none") -> OutputFormat:
    """The format object registered under ``name``; with ``activations`` (W4A4), a writer of that format
    whose outputs carry the activation scales (ConfigError when the format has no such convention)."""
    from fp4convert.errors import ConfigError

    try:
        module = OUTPUT_FORMATS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown format {name!r}; choose one of {', '.join(OUTPUT_FORMATS)}") from None
    fmt = importlib.import_module(f".{module}", __name__).FORMAT
    return fmt if activations == "none" else type(fmt)(activations)


def all_formats() -> list[OutputFormat]:
    return [get_format(n) for n in OUTPUT_FORMATS]


def input_weights(tensors: list, config: dict) -> tuple[list, dict]:
    """The weights a checkpoint holds, with quantized inputs replaced by the fp32 weights they encode.

    Returns (tensor infos in file order, with decoded weights in place of their on-disk tensors and
    the consumed scale tensors removed; logical name -> Decode).
    """
    by_name = {t.name: t for t in tensors}
    decodes: dict = {}
    logical: dict = {}
    for module in INPUT_FORMATS.values():
        fmt = importlib.import_module(f".{module}", __name__).FORMAT
        for name, (info, decode) in fmt.decodes(by_name, config).items():
            logical[decode.inputs[0].name] = info
            decodes[name] = decode
    consumed = {t.name for d in decodes.values() for t in d.inputs[1:]}
    out = [logical.get(t.name, t) for t in tensors if t.name not in consumed]
    return out, decodes


def detect(root: Path, config: dict, manifest: dict | None) -> OutputFormat | None:
    """The output format a checkpoint folder is in, or None for an unquantized one.

    The manifest decides when there is one (it names the format); otherwise each format looks at
    the files its convention writes (config.json's ``quantization_config``, ``hf_quant_config.json``).
    """
    if manifest is not None:
        return get_format(manifest.get("format", DEFAULT_FORMAT))
    for fmt in all_formats():
        if fmt.detect(root, config):
            return fmt
    return None


LOW_PRECISION_DTYPES = ("U8", "F8_E4M3", "F8_E5M2")
FP8_BLOCK_SCALE_SUFFIX = ".weight_scale_inv"  # DeepSeek-style FP8 block scales


def quantized_tensor_names(tensors: list) -> list[str]:
    """Names (of TensorInfo-like ``tensors``) that only an already-quantized checkpoint has."""
    markers = {FP8_BLOCK_SCALE_SUFFIX}
    scale_suffixes = set()
    for fmt in all_formats():
        markers.add(fmt.global_suffix)
        if fmt.packed_suffix != ".weight":
            markers.add(fmt.packed_suffix)
        scale_suffixes.add(fmt.scale_suffix)
    low = {t.name for t in tensors if t.dtype in LOW_PRECISION_DTYPES}
    out = []
    for t in tensors:
        if t.name.endswith(tuple(markers)):
            out.append(t.name)
        elif any(t.name.endswith(s) and t.name[: -len(s)] + ".weight" in low for s in scale_suffixes):
            out.append(t.name)
    return out
