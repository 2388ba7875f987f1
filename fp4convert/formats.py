"""Output formats: how a quantized weight is named and laid out on disk (SPEC.md section 7).

A format is naming and layout only. It says, from shapes alone, which tensors a quantized weight
becomes (so the plan can size shards before any data is read), turns a QuantizedTensor into exactly
those tensors, and writes what it needs beside the shards (``config.json`` edits).

- ``fp4convert`` (native): scales swizzled 128x4, global ENCODE scale ``[1]``, described by the manifest.
- ``compressed-tensors``: scales linear, ``weight_global_scale`` ``[1]`` (ENCODE), config.json
  ``quantization_config`` (and a ``transform_config`` for Had16, which vLLM applies online).
- ``modelopt``: ``weight`` / ``weight_scale`` / ``weight_scale_2`` (0-dim DECODE scale = 1/gs),
  ``hf_quant_config.json``; NVFP4 only, no rotation (the format has no field for one).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import __version__
from .config import ConfigError
from .safetensors_io import OutEntry
from .swizzle import padded_shape
from .tensor import BLOCK_SIZE, QuantizedTensor

if TYPE_CHECKING:
    from .plan import Plan

log = logging.getLogger(__name__)


class OutputFormat:
    """The native convention; engine formats override what differs."""

    name = "fp4convert"
    swizzled = True  # block scales in the 128x4 layout (engines swizzle at load, so theirs are linear)
    schemes: tuple[str, ...] = ("nvfp4", "mxfp4")
    packed_suffix, scale_suffix, global_suffix = ".weight_packed", ".weight_scale", ".weight_global_scale"

    def check(self, scheme: str, rotate: str | None) -> None:
        """Refuse settings this format cannot carry faithfully."""
        if scheme not in self.schemes:
            raise ConfigError(f"--format {self.name} stores {'/'.join(self.schemes)} only, not {scheme}")

    # -- names and shapes ------------------------------------------------------------------

    def global_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, 1)

    def global_value(self, gs: torch.Tensor) -> torch.Tensor:
        """The stored global tensor from the encode scale gs."""
        return gs.to(torch.float32).reshape(self.global_shape(tuple(gs.shape)))

    def entries(self, module: str, shape: tuple[int, ...], scheme: str, rotate: str | None = None) -> list[OutEntry]:
        """What a quantized ``[..., M, K]`` weight becomes, known before any data is read."""
        *lead, m, k = shape
        lead = tuple(lead)
        nb = k // BLOCK_SIZE[scheme]
        scale_shape = (*lead, *padded_shape(m, nb)) if self.swizzled else (*lead, m, nb)
        out = [
            OutEntry(module + self.packed_suffix, "U8", (*lead, m, k // 2)),
            OutEntry(module + self.scale_suffix, "F8_E4M3" if scheme == "nvfp4" else "U8", scale_shape),
        ]
        if scheme == "nvfp4":
            out.append(OutEntry(module + self.global_suffix, "F32", self.global_shape(lead)))
        return out

    def tensors(self, module: str, q: QuantizedTensor) -> list[tuple[str, torch.Tensor]]:
        """The output tensors of one quantized weight, in :meth:`entries` order."""
        scale = q.scale if self.swizzled else q.linear_scale()
        if self.swizzled and q.scale_layout != "swizzled":
            raise ValueError("internal: the native format needs scale_layout='swizzled'")
        out = [(module + self.packed_suffix, q.packed), (module + self.scale_suffix, scale)]
        if q.fmt == "nvfp4":
            out.append((module + self.global_suffix, self.global_value(q.global_scale)))
        return out

    def encode_scale(self, stored: torch.Tensor) -> torch.Tensor:
        """Back from the stored global tensor to the encode scale gs (inverse of global_value)."""
        return stored.to(torch.float32)

    # -- beside the shards -----------------------------------------------------------------

    def finalize(self, dst: Path, plan: Plan) -> list[str]:
        """Write what the format needs beside the shards; returns the names written (native: none)."""
        return []


def unquantized_modules(plan: Plan) -> list[str]:
    """Module names of every 2-D weight left unquantized (what engines must not treat as FP4)."""
    from .plan import KEEP

    mods = [d.module for d in plan.decisions if d.action == KEEP and d.name.endswith(".weight") and len(d.info.shape) == 2]
    return sorted(dict.fromkeys(mods))


def _update_config(dst: Path, key: str, value: dict) -> None:
    path = dst / "config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg[key] = value
    _write_json(path, cfg)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The unnormalized +-1 Sylvester Hadamard matrix in natural order."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


class CompressedTensorsFormat(OutputFormat):
    """compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` (vLLM, transformers)."""

    name = "compressed-tensors"
    swizzled = False
    transform_scheme = "had16"

    def entries(self, module, shape, scheme, rotate=None):
        out = super().entries(module, shape, scheme, rotate)
        if rotate == "had16":
            # vLLM loads the online transform as a parameter of the layer: <module>.<scheme>_input.weight.
            out.append(OutEntry(f"{module}.{self.transform_scheme}_input.weight", "BF16", (16, 16)))
        return out

    def tensors(self, module, q):
        out = super().tensors(module, q)
        if q.rotate == "had16":
            out.append((f"{module}.{self.transform_scheme}_input.weight", sylvester_hadamard(16).to(torch.bfloat16)))
        return out

    def quantization_config(self, plan: Plan) -> dict:
        cfg = plan.config
        fmt = f"{cfg.scheme}-pack-quantized"
        weights = {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group" if cfg.scheme == "nvfp4" else "group",
            "group_size": BLOCK_SIZE[cfg.scheme],
            "symmetric": True,
            "dynamic": False,
        }
        ignore = unquantized_modules(plan)
        qc = {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": None,
                    "output_activations": None,
                    "format": fmt,
                }
            },
            "ignore": ignore,
            "kv_cache_scheme": None,
        }
        if cfg.rotate == "had16":
            # W_rot = W @ blockdiag(H16/4) was fused offline ("weight_input", inverse); the runtime must
            # rotate activations the same way ("input"). Only the online entry is executed by vLLM.
            args = {"targets": ["Linear"], "ignore": ignore}
            qc["transform_config"] = {
                "config_groups": {
                    self.transform_scheme: {
                        "type": "hadamard",
                        "head_dim": 16,
                        "randomize": False,
                        "requires_grad": False,
                        "precision": "torch.float32",
                        "apply": [
                            {**args, "location": "input", "inverse": False},
                            {**args, "location": "weight_input", "inverse": True},
                        ],
                    }
                }
            }
        return qc

    def finalize(self, dst: Path, plan: Plan) -> list[str]:
        _update_config(dst, "quantization_config", self.quantization_config(plan))
        if plan.config.rotate:
            log.warning(
                "Had16-rotated compressed-tensors checkpoint: vLLM rotates activations from transform_config "
                "(tensor parallel 1 only); transformers ignores transform_config and would compute wrong outputs"
            )
        return ["config.json"]


class ModelOptFormat(OutputFormat):
    """NVIDIA ModelOpt NVFP4 (TensorRT-LLM, SGLang, vLLM ``--quantization modelopt_fp4``)."""

    name = "modelopt"
    swizzled = False
    schemes = ("nvfp4",)
    packed_suffix, scale_suffix, global_suffix = ".weight", ".weight_scale", ".weight_scale_2"

    def check(self, scheme: str, rotate: str | None) -> None:
        if scheme != "nvfp4":
            raise ConfigError("--format modelopt stores NVFP4 only; use --format compressed-tensors for MXFP4")
        if rotate:
            raise ConfigError(
                "--format modelopt cannot record a rotation: engines would not rotate activations and would "
                "compute wrong outputs. Use --format compressed-tensors (transform_config) or drop --rotate"
            )

    def global_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return lead  # a scalar per matrix

    def global_value(self, gs: torch.Tensor) -> torch.Tensor:
        return (1.0 / gs.to(torch.float32)).reshape(self.global_shape(tuple(gs.shape)))  # the DECODE scale

    def encode_scale(self, stored: torch.Tensor) -> torch.Tensor:
        return 1.0 / stored.to(torch.float32)

    def quant_section(self, plan: Plan) -> dict:
        exclude = unquantized_modules(plan) or ["lm_head"]  # SGLang refuses an empty list
        return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}

    def finalize(self, dst: Path, plan: Plan) -> list[str]:
        producer = {"name": "fp4convert", "version": __version__}
        quant = self.quant_section(plan)
        _write_json(dst / "hf_quant_config.json", {"producer": producer, "quantization": quant})
        # ModelOpt's own config.json shape. vLLM reads exclusions from "ignore" in this flat form (and
        # "exclude_modules" only inside hf_quant_config.json), so both keys are written.
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        _update_config(dst, "quantization_config", {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "ignore": quant["exclude_modules"],
            "exclude_modules": quant["exclude_modules"],
            "producer": producer,
        })
        return ["hf_quant_config.json", "config.json"]


NATIVE = OutputFormat()
FORMATS: dict[str, OutputFormat] = {f.name: f for f in (NATIVE, CompressedTensorsFormat(), ModelOptFormat())}


def get_format(name: str) -> OutputFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(f"unknown format {name!r}; available: {', '.join(FORMATS)}") from None
