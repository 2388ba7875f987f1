"""NVIDIA ModelOpt NVFP4 (TensorRT-LLM, SGLang, vLLM ``--quantization modelopt_fp4``).

``X.weight`` (U8 packed), ``X.weight_scale`` (F8_E4M3 linear), ``X.weight_scale_2`` (F32 scalar: the
DECODE scale 1/gs), and ``hf_quant_config.json``. NVFP4 only, no rotation (the format has no field
for one).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import ConfigError
from fp4convert.formats.base import Excluded, OutputFormat, OutputInfo, read_json, update_config, value_kind, write_json
from fp4convert.storage.names import HF_QUANT_CONFIG
from fp4convert.version import producer as version_producer

if TYPE_CHECKING:
    import torch


class ModelOptFormat(OutputFormat):
    name = "modelopt"
    swizzled = False
    schemes = ("nvfp4",)
    packed_suffix, scale_suffix, global_suffix = ".weight", ".weight_scale", ".weight_scale_2"
    activation_modes = ("nvfp4",)  # quant_algo NVFP4 with a static input_scale per linear
    input_suffix = ".input_scale"  # W4A4: the activation DECODE scale amax / 2688, F32 scalar like weight_scale_2
    stores_decode_scale = True
    config_files = (HF_QUANT_CONFIG,)

    def check(self, scheme: str, rotate: str | None) -> None:
        if scheme != "nvfp4":
            raise ConfigError("--format modelopt stores NVFP4 only; use --format compressed-tensors for MXFP4")
        if rotate:
            raise ConfigError(
                "--format modelopt cannot record a rotation: engines would not rotate activations and would "
                "compute wrong outputs. Use --format compressed-tensors (transform_config) or drop --rotate"
            )

    card_library = "vllm"

    def serving_text(self, repo: str, scheme: str, rotate: str | None, auto: str, activations: dict | None) -> str:
        lines = [
            "NVIDIA ModelOpt NVFP4 (`hf_quant_config.json`): vLLM, SGLang and TensorRT-LLM read it; transformers does not.",
            "",
            "```bash",
            f"vllm serve {repo} --quantization modelopt_fp4",
            "```",
            "",
        ]
        if activations is None:
            lines.append("No activation scales are stored (weight-only conversion): on Blackwell vLLM treats ModelOpt "
                         "NVFP4 as W4A4; prefer the compressed-tensors format for weight-only serving.")
        else:
            lines.append("W4A4: a static activation scale per linear (`input_scale`) is stored; on Blackwell the engines "
                         "quantize activations to NVFP4 with it (FP4 x FP4 GEMMs).")
        return "\n".join(lines)

    def config_problems(self, root, config, scheme, modules):
        qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else None
        hq = read_json(root / HF_QUANT_CONFIG).get("quantization")  # a Hub snapshot has it too
        section = hq if hq is not None else qc
        where = f"{HF_QUANT_CONFIG}'s quantization" if hq is not None else "config.json's quantization_config"
        if section is None:
            return [f"neither {HF_QUANT_CONFIG} nor config.json's quantization_config describes the weights"], None
        if not isinstance(section, dict):
            return [f"{where} is {value_kind(section)}, not an object"], None
        out: list[str] = []
        if section.get("quant_algo") != "NVFP4":
            out.append(f"ModelOpt quant_algo is {section.get('quant_algo')!r:.40}, the tensors are NVFP4")
        if section.get("group_size", 16) != 16:
            out.append(f"ModelOpt group_size is {section.get('group_size')!r:.40}, NVFP4 scales are per 16")
        exclude = section.get("exclude_modules", section.get("ignore", []))
        return out, Excluded(exclude, lambda p, m: fnmatch.fnmatchcase(m, p), "exclude_modules")

    def global_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return lead  # a scalar per matrix

    def global_float(self, gs: float) -> float:
        return 1.0 / gs  # the DECODE scale

    def encode_scale(self, stored: torch.Tensor) -> torch.Tensor:
        import torch

        return 1.0 / stored.to(torch.float32)

    def quant_section(self, info: OutputInfo) -> dict:
        exclude = list(info.kept_modules) or ["lm_head"]  # SGLang refuses an empty list
        return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}

    def input_activations(self) -> dict | None:
        """W4A4: ModelOpt's NVFP4 activation entry (static global ``input_scale``, per-16 FP8 scales)."""
        if self.activations == "nvfp4":
            return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        return None

    def finalize(self, dst: Path, info: OutputInfo) -> list[str]:
        producer = version_producer()
        quant = self.quant_section(info)
        write_json(dst / HF_QUANT_CONFIG, {"producer": producer, "quantization": quant})
        # ModelOpt's own config.json shape. vLLM reads exclusions from "ignore" in this flat form (and
        # "exclude_modules" only inside hf_quant_config.json), so both keys are written.
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        update_config(dst, "quantization_config", {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": self.input_activations()}},
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "ignore": quant["exclude_modules"],
            "exclude_modules": quant["exclude_modules"],
            "producer": producer,
        })
        return [HF_QUANT_CONFIG, "config.json"]

    # -- reading ---------------------------------------------------------------------------

    def detect(self, root: Path, config: dict) -> bool:
        """A ModelOpt NVFP4 checkpoint (its FP8 ones are inputs, not this): config.json, or hf_quant_config.json."""
        qc = config.get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
            return qc.get("quant_algo") == "NVFP4"
        hq = read_json(root / HF_QUANT_CONFIG).get("quantization")
        return isinstance(hq, dict) and hq.get("quant_algo") == "NVFP4"

    def detect_config(self, config: dict) -> bool:
        qc = config.get("quantization_config")
        return isinstance(qc, dict) and qc.get("quant_method") == "modelopt" and qc.get("quant_algo") == "NVFP4"


FORMAT = ModelOptFormat()
