"""fp4convert's native format: block scales in the 128x4 tensor-core layout, described by the manifest.

Per quantized ``X.weight``: ``X.weight_packed`` (U8 ``[M, K/2]``), ``X.weight_scale`` (F8_E4M3 for
NVFP4, U8 E8M0 for MXFP4; swizzled ``[Mp, nbp]``, zero padding) and, for NVFP4,
``X.weight_global_scale`` (F32 ``[1]``, the encode scale gs). ``fp4convert.json`` says everything
else. See docs/formats.md.
"""

from __future__ import annotations

from pathlib import Path

from .base import OutputFormat


class NativeFormat(OutputFormat):
    name = "fp4convert"
    swizzled = True

    def is_swizzled(self, manifest: dict | None) -> bool:
        return (manifest or {}).get("scale_layout", "128x4") == "128x4"

    def detect(self, root: Path, config: dict) -> bool:
        return False  # only its manifest identifies it (formats.detect looks there first)


FORMAT = NativeFormat()
