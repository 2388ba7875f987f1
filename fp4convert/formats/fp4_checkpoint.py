"""An FP4 checkpoint (NVFP4 / MXFP4 in compressed-tensors', ModelOpt's or the native layout) read as an input
whose weights are decoded exactly, for ``--requantize`` only (docs/formats.md "Sources"): by default such a
source is re-laid bit for bit instead (``fp4convert.checkpoint.export``), and ``fp4convert.plan.sources``
refuses it before planning unless the conversion asks to quantize again.

Which layout the tensors follow is what config.json's ``quantization_config`` says (compressed-tensors
``nvfp4/mxfp4-pack-quantized``, ModelOpt ``quant_algo: NVFP4``, the native ``quant_method: fp4convert``); each
module is decoded the way its format's readers decode it: ``value(code) * (sf / gs)`` with the encode scale gs
(native, compressed-tensors), ``(value(code) * sf) * weight_scale_2`` with ModelOpt's decode scale,
``value(code) * 2^(e - 127)`` for MXFP4. A Had16-rotated checkpoint is refused: its weights are rotated, and
undoing the rotation rounds.
"""

from __future__ import annotations

from fp4convert.errors import SourceError
from fp4convert.formats.base import Decode, InputFormat, OutputFormat
from fp4convert.storage.safetensors import TensorInfo


def declared_format(config: dict) -> OutputFormat | None:
    """The FP4 output format config.json's ``quantization_config`` declares (None: no FP4 checkpoint's)."""
    from fp4convert.formats import all_formats

    for fmt in all_formats():
        try:
            if fmt.detect_config(config):
                return fmt
        except (AttributeError, TypeError):  # a value of the wrong type: no declaration fp4convert can read
            return None
    return None


class FP4CheckpointInput(InputFormat):
    name = "fp4"

    def decodes(self, tensors: dict[str, TensorInfo], config: dict) -> dict[str, tuple[TensorInfo, Decode]]:
        fmt = declared_format(config)
        if fmt is None:
            return {}
        qc = config.get("quantization_config") or {}
        manifest_like = {"scale_layout": qc.get("scale_layout", "128x4"), "rotate": qc.get("rotate")}
        rotate = fmt.rotation_of_config(config)
        modules, _ = fmt.find_modules(tensors, manifest_like)
        if modules and rotate:
            raise SourceError(f"config.json: the FP4 weights are {rotate}-rotated ({fmt.name}); decoding them to "
                              "their unrotated values rounds, so they cannot be quantized again exactly. Re-lay them "
                              "instead (drop --requantize) to a format that records the rotation")
        out: dict[str, tuple[TensorInfo, Decode]] = {}
        for module, m in modules.items():
            extra = tuple(t for t in (tensors.get(module + fmt.input_suffix) if fmt.input_suffix else None,)
                          if t is not None)
            name = module + ".weight"
            logical = TensorInfo(name, "F32", m.shape, m.packed.file, m.packed.begin, m.packed.end)
            out[name] = (logical, Decode(m.scheme, (*m.tensors, *extra), layout=fmt.name, swizzled=m.swizzled,
                                         decode_global=fmt.stores_decode_scale))
        return out


FORMAT = FP4CheckpointInput()
