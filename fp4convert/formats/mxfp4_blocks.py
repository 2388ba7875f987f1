"""gpt-oss's MXFP4 release format, read as an input and decoded exactly to fp32.

Experts are ``P_blocks`` U8 ``[E, out, in/32, 16]`` (two E2M1 codes a byte, element 2j in the low
nibble) and ``P_scales`` U8 ``[E, out, in/32]`` (E8M0, bias 127). The planner sees ``P`` in the bf16
checkpoint's layout ``[E, in, out]`` (what transformers' dequantizing loader rebuilds), so converting
this checkpoint equals converting its fp32-dequantized twin byte for byte.
"""

from __future__ import annotations

from fp4convert.formats.base import Decode, InputFormat
from fp4convert.storage.safetensors import TensorInfo


class MXFP4BlocksInput(InputFormat):
    name = "gpt-oss-mxfp4"

    def decodes(self, tensors: dict[str, TensorInfo], config: dict) -> dict[str, tuple[TensorInfo, Decode]]:
        out: dict[str, tuple[TensorInfo, Decode]] = {}
        for name, blocks in tensors.items():
            if not name.endswith("_blocks") or blocks.dtype != "U8" or len(blocks.shape) < 3 or blocks.shape[-1] != 16:
                continue
            base = name[: -len("_blocks")]
            scales = tensors.get(base + "_scales")
            if scales is None or scales.dtype != "U8" or tuple(scales.shape) != tuple(blocks.shape[:-1]):
                continue
            *lead, rows, groups, _ = blocks.shape
            shape = (*lead, groups * 32, rows)  # [.., in, out]: the decoded [.., out, in] transposed
            logical = TensorInfo(base, "F32", tuple(shape), blocks.file, blocks.begin, blocks.end)
            out[base] = (logical, Decode("mxfp4_blocks", (blocks, scales), transpose=True))
        return out


FORMAT = MXFP4BlocksInput()
