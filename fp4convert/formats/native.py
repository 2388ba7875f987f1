"""fp4convert's native format: block scales in the 128x4 tensor-core layout, described by the manifest.

Per quantized ``X.weight``: ``X.weight_packed`` (U8 ``[M, K/2]``), ``X.weight_scale`` (F8_E4M3 for
NVFP4, U8 E8M0 for MXFP4; swizzled ``[Mp, nbp]``, zero padding) and, for NVFP4,
``X.weight_global_scale`` (F32 ``[1]``, the encode scale gs). ``fp4convert.json`` says everything
else. See docs/formats.md.

No engine reads this layout, so config.json must stop loaders from treating the folder as the
source model (transformers would otherwise load it with every quantized linear layer randomly
initialised). It gets a ``quantization_config`` with ``quant_method: fp4convert`` (vLLM refuses an
unknown method by name) and ``model_type: fp4convert``: transformers 5 only *warns* about an unknown
quant_method and then loads random weights, but it refuses a model type it does not know. The
source's model type is kept in ``quantization_config["model_type"]``; :func:`~fp4convert.formats.base.restore_config` puts it
back when ``export`` writes an engine format.
"""

from __future__ import annotations

from pathlib import Path

from fp4convert.formats.base import NATIVE_QUANT_METHOD, OutputFormat, OutputInfo, read_json, write_json
from fp4convert.numerics.scheme import get_scheme
from fp4convert.storage.names import CONFIG_NAME
from fp4convert.version import producer

MODEL_TYPE = "fp4convert"  # what config.json's model_type becomes (loaders refuse it)
NOTE = ("fp4convert native layout (128x4 swizzled block scales): no engine loads it as is. "
        "Run `fp4convert export DIR OUT --format compressed-tensors` (or modelopt) for vLLM / transformers.")


class NativeFormat(OutputFormat):
    name = "fp4convert"
    described_by_manifest = True
    swizzled = True

    def quantization_config(self, info: OutputInfo) -> dict:
        s = get_scheme(info.scheme)
        return {
            "quant_method": NATIVE_QUANT_METHOD,
            "producer": producer(),
            "format": self.name,
            "scheme": s.name,
            "block_size": s.block_size,
            "scale_dtype": s.scale_dtype,
            "scale_layout": "128x4",
            "scale_rule": info.scale_rule or s.default_rule,
            "global_scale": "encode scale gs = 2688 / amax" if s.global_scale else None,
            "rotate": info.rotate,
            "ignore": list(info.kept_modules),
            "model_type": info.model_config.get("model_type"),
            "note": NOTE,
        }

    def finalize(self, dst: Path, info: OutputInfo) -> list[str]:
        path = dst / CONFIG_NAME
        cfg = read_json(path)
        qc = self.quantization_config(info)
        qc["model_type"] = cfg.get("model_type", qc["model_type"])
        if "model_type" in cfg:
            cfg["model_type"] = MODEL_TYPE  # in place: export restores it at the same position
        cfg["quantization_config"] = qc
        write_json(path, cfg)
        return [CONFIG_NAME]

    def serving_text(self, repo: str, scheme: str, rotate: str | None, auto: str, activations: dict | None) -> str:
        return "\n".join([
            "fp4convert's native layout (block scales pre-swizzled to the 128x4 tensor-core layout, described by "
            "`fp4convert.json`). No engine loads it as is, and transformers refuses it (its config.json says "
            "`model_type: fp4convert`). Re-layout it, losslessly and without the source weights:",
            "",
            "```bash",
            f"fp4convert export {repo} out-ct --format compressed-tensors   # vLLM, transformers",
            f"fp4convert export {repo} out-mo --format modelopt             # vLLM / SGLang / TensorRT-LLM"
            + ("" if scheme == "nvfp4" else " (NVFP4 only)"),
            "```",
        ])

    def config_problems(self, root, config, scheme, modules):
        qc = config.get("quantization_config") if isinstance(config.get("quantization_config"), dict) else None
        out: list[str] = []
        if qc is not None and scheme is not None:
            if qc.get("scheme") not in (None, scheme.name):
                out.append(f"config.json's quantization_config says {qc.get('scheme')!r:.40}, the tensors are {scheme.name}")
            if qc.get("block_size") not in (None, scheme.block_size):
                out.append(f"config.json's quantization_config block_size {qc.get('block_size')!r:.40}, {scheme.name} "
                           f"has {scheme.block_size}")
        return out, None

    def is_swizzled(self, manifest: dict | None) -> bool:
        return (manifest or {}).get("scale_layout", "128x4") == "128x4"

    def detect_config(self, config: dict) -> bool:
        """A native folder is known by its manifest, or (manifest lost) by config.json's quant_method."""
        qc = config.get("quantization_config")
        return isinstance(qc, dict) and qc.get("quant_method") == NATIVE_QUANT_METHOD

    def rotation_of_config(self, config: dict) -> str | None:
        qc = config.get("quantization_config")
        rotate = qc.get("rotate") if isinstance(qc, dict) else None
        return rotate if isinstance(rotate, str) else None


FORMAT = NativeFormat()
