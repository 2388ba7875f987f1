"""compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` (vLLM, transformers).

Same tensor names as the native format, linear ``[M, K/bs]`` scales (engines swizzle at load),
``weight_global_scale`` F32 ``[1]`` (the encode scale), and config.json's ``quantization_config``.
Had16 is recorded as a ``transform_config`` with the online rotation as ``<module>.had16_input.weight``
(vLLM applies it; transformers ignores transform_config).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.formats.base import Excluded, OutputFormat, OutputInfo, read_json, update_config, value_kind
from fp4convert.numerics.scheme import get_scheme
from fp4convert.storage.safetensors import OutEntry

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

QUANT_METHOD = "compressed-tensors"
FP4_FORMATS = ("nvfp4-pack-quantized", "mxfp4-pack-quantized")


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The unnormalized +-1 Sylvester Hadamard matrix in natural order."""
    import torch

    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard16_bf16_bytes() -> bytes:
    """sylvester_hadamard(16) in bf16, without torch: entry (i, j) is (-1)^popcount(i & j)."""
    one, minus = b"\x80\x3f", b"\x80\xbf"  # bf16 1.0 and -1.0, little-endian
    return b"".join(minus if bin(i & j).count("1") % 2 else one for i in range(16) for j in range(16))


class CompressedTensorsFormat(OutputFormat):
    name = "compressed-tensors"
    swizzled = False
    transformers_loads = True  # with compressed-tensors installed: CompressedTensorsConfig decompresses at load
    activation_modes = ("nvfp4", "mxfp4")  # NVFP4: a static input_global_scale per linear; MXFP4: dynamic
    input_suffix = ".input_global_scale"  # W4A4 NVFP4: the activation ENCODE scale, F32 [1] like weight_global_scale
    transform_scheme = "had16"

    def _transform_name(self, module: str) -> str:
        # vLLM loads the online transform as a parameter of the layer: <module>.<scheme>_input.weight.
        return f"{module}.{self.transform_scheme}_input.weight"

    def entries(self, module, shape, scheme, rotate=None):
        out = super().entries(module, shape, scheme, rotate)
        if rotate == "had16":
            out.append(OutEntry(self._transform_name(module), "BF16", (16, 16)))
        return out

    def outputs(self, module, packed, scale, gs, scheme, rotate, input_amax=None):
        out = super().outputs(module, packed, scale, gs, scheme, rotate, input_amax)
        if rotate == "had16":
            out.append((self._transform_name(module), hadamard16_bf16_bytes()))
        return out

    def quantization_config(self, info: OutputInfo) -> dict:
        s = get_scheme(info.scheme)
        fmt = f"{s.name}-pack-quantized"
        weights = {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group" if s.global_scale else "group",
            "group_size": s.block_size,
            "symmetric": True,
            "dynamic": False,
        }
        ignore = list(info.kept_modules)
        qc = {
            "quant_method": QUANT_METHOD,
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
        acts = self.input_activations()
        if acts is not None:
            qc["config_groups"]["group_0"]["input_activations"] = acts
        if info.rotate == "had16":
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

    card_library = "transformers"

    def serving_text(self, repo: str, scheme: str, rotate: str | None, auto: str, activations: dict | None) -> str:
        lines = [
            "compressed-tensors: vLLM and transformers (with `compressed-tensors` installed) read it from config.json.",
            "",
            "```bash",
            f"vllm serve {repo}",
            "```",
            "",
            "```python",
            "import torch",
            f"from transformers import AutoConfig, {auto}",
            f'config = AutoConfig.from_pretrained("{repo}")',
            'config.quantization_config["dequantize"] = True  # plain Linear layers holding the FP4 values',
            f'model = {auto}.from_pretrained("{repo}", config=config, dtype=torch.bfloat16)',
            "```",
        ]
        if activations is not None:
            stored = (" from the stored `input_global_scale` tensors" if activations.get("scales") != "dynamic"
                      else " with dynamic scales")
            lines += ["", f"W4A4: vLLM on Blackwell quantizes activations to {str(activations.get('scheme')).upper()}"
                          f"{stored} (FP4 x FP4 GEMMs). The transformers snippet above dequantizes the weights and "
                          "runs the activations unquantized (weight-only"
                          + ("; it reports the `input_global_scale` tensors as unexpected keys" if
                             activations.get("scales") != "dynamic" else "") + ")."]
        if rotate:
            lines += ["", "The weights carry a Had16 rotation recorded as `transform_config`: vLLM applies it "
                          "(tensor parallel 1 only); transformers ignores it and computes wrong outputs."]
        return "\n".join(lines)

    def input_activations(self) -> dict | None:
        """W4A4: compressed-tensors' own NVFP4 / MXFP4 presets (quantization/quant_scheme.py):
        NVFP4 per-16 local FP8 scales computed at run time under the stored static global
        (``dynamic: "local"``), MXFP4 fully dynamic per-32 E8M0 scales. ``scale_dtype`` is needed:
        without it compressed-tensors 0.20 leaves the run-time block scales unrounded (not FP8)."""
        if self.activations == "nvfp4":
            return {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "symmetric": True, "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn"}
        if self.activations == "mxfp4":
            return {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": True, "scale_dtype": "torch.uint8"}
        return None

    def finalize(self, dst: Path, info: OutputInfo) -> list[str]:
        update_config(dst, "quantization_config", self.quantization_config(info))
        # compressed-tensors decompresses FP4 weights to bf16 whatever the model's dtype: an fp32/fp16
        # model would load with bf16 Linear weights and fail at the first matmul ("Float and BFloat16").
        # The model's dtype becomes bf16, so a plain from_pretrained loads every tensor as bf16.
        cfg = read_json(dst / "config.json")
        for key in [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]:
            if cfg.get(key) != "bfloat16":
                update_config(dst, key, "bfloat16")
        warning = self.serving_warning(info.rotate)
        if warning:
            log.warning(warning, extra={"serving": True})  # the command line prints it itself, in every mode
        return ["config.json"]

    def config_problems(self, root, config, scheme, modules):
        qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else None
        out: list[str] = []
        if qc is None:
            return ["config.json has no quantization_config: engines will not read the weights as compressed-tensors"], None
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            return [f"quantization_config.config_groups is {value_kind(groups)}, not an object"], None
        if not groups:
            out.append("quantization_config has no config_groups")
        for gname, g in groups.items():
            where = f"quantization_config.config_groups.{gname}"
            w = (g or {}).get("weights") if isinstance(g, dict) else None
            if not isinstance(g, dict) or not isinstance(w, dict):
                out.append(f"{where}{'' if not isinstance(g, dict) else '.weights'} is "
                           f"{value_kind(w if isinstance(g, dict) else g)}, not an object")
                continue
            where += ".weights"
            if w.get("num_bits") != 4 or w.get("type") != "float":
                out.append(f"{where}: num_bits {w.get('num_bits')!r} type {w.get('type')!r}, FP4 is 4 / float")
            if scheme is not None:
                if w.get("group_size") != scheme.block_size:
                    out.append(f"{where}.group_size is {w.get('group_size')!r}, the {scheme.name} scales are per "
                               f"{scheme.block_size}")
                want = "tensor_group" if scheme.global_scale else "group"
                if w.get("strategy") != want:
                    out.append(f"{where}.strategy is {w.get('strategy')!r:.40}, {scheme.name} tensors need {want!r}")
                fmt = g.get("format") or qc.get("format")
                if fmt != f"{scheme.name}-pack-quantized":
                    out.append(f"quantization_config format {fmt!r:.60} does not match the {scheme.name} tensors "
                               f"({scheme.scale_dtype} block scales)")
        gs = next(((g.get("weights") or {}).get("group_size") for g in groups.values()
                   if isinstance(g, dict) and isinstance(g.get("weights"), dict)), None)
        if type(gs) is int and gs > 0:
            for m in modules.values():
                k = m.shape[-1]
                if not m.swizzled and m.scale.shape[-1] * gs != k:
                    out.append(f"{m.module}: {m.scale.shape[-1]} scales per row for K={k} disagree with group_size {gs}")
                    break
        transform = qc.get("transform_config")
        if transform is not None and not isinstance(transform, dict):
            out.append(f"quantization_config.transform_config is {value_kind(transform)}, not an object")
        return out, Excluded(qc.get("ignore", []), matches_ignore, "quantization_config.ignore", regex=True)

    def serving_warning(self, rotate: str | None) -> str | None:
        if not rotate:
            return None
        return ("Had16-rotated compressed-tensors checkpoint: vLLM rotates activations from transform_config "
                "(tensor parallel 1 only); transformers ignores transform_config and computes WRONG outputs from "
                "these weights (serve it with vLLM, or convert without --rotate for transformers)")

    # -- reading ---------------------------------------------------------------------------

    def detect_config(self, config: dict) -> bool:
        """An FP4 compressed-tensors checkpoint (its FP8 ``float-quantized`` and INT4 ``pack-quantized`` ones are
        inputs, not this)."""
        qc = config.get("quantization_config")
        if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
            return False
        if qc.get("format") in FP4_FORMATS:
            return True
        groups = qc.get("config_groups") or {}
        return any(isinstance(g, dict) and (g.get("format") in FP4_FORMATS or
                                            ((g.get("weights") or {}).get("num_bits") == 4
                                             and (g.get("weights") or {}).get("type") == "float"))
                   for g in groups.values())

    def rotation_of_config(self, config: dict) -> str | None:
        qc = config.get("quantization_config") or {}
        groups = (qc.get("transform_config") or {}).get("config_groups", {})
        had16 = any(g.get("type") == "hadamard" and g.get("head_dim") == 16 for g in groups.values())
        return "had16" if had16 else None


FORMAT = CompressedTensorsFormat()


def matches_ignore(pattern: str, module: str) -> bool:
    """compressed-tensors' ignore entries: exact module names, or ``re:`` regexes (matched in full)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module
