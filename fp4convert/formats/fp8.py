"""FP8 E4M3 checkpoints, read as inputs (DeepSeek-V3/R1, Kimi K2, Qwen3-FP8, compressed-tensors
``float-quantized``, ModelOpt FP8) and decoded exactly to fp32 before quantization.

- Block-scaled: ``X.weight`` F8_E4M3 ``[M, N]`` + ``X.weight_scale_inv`` F32 ``[ceil(M/bm), ceil(N/bn)]``,
  the block from config.json ``quantization_config.weight_block_size`` (default 128x128).
- Per tensor / per channel: ``X.weight`` F8_E4M3 + ``X.weight_scale`` (scalar, ``[1]``, ``[M]`` or
  ``[M, 1]``); an activation ``X.input_scale`` is dropped (fp4convert writes weight-only checkpoints).
"""

from __future__ import annotations

from fp4convert.formats.base import Decode, InputFormat
from fp4convert.storage.safetensors import TensorInfo

F8 = ("F8_E4M3",)
SCALE_DTYPES = ("F32", "BF16", "F16")


def _logical(info: TensorInfo) -> TensorInfo:
    """The fp32 weight the planner sees, at the FP8 tensor's place in the file."""
    return TensorInfo(info.name, "F32", info.shape, info.file, info.begin, info.end)


DEFAULT_BLOCK = (128, 128)
MAX_BLOCK = 1 << 20  # a block side larger than this is no FP8 checkpoint's


def weight_block_size(config: dict) -> tuple[int, int]:
    """config.json ``quantization_config.weight_block_size`` as (rows, cols), DEFAULT_BLOCK when absent.

    Anything but two positive integers is refused (exit 4) naming the file and the key: a block size
    cannot be guessed, and a wrong one decodes every FP8 weight with the wrong scales."""
    from fp4convert.errors import SourceError

    qc = config.get("quantization_config")
    block = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if block is None:
        return DEFAULT_BLOCK
    if (not isinstance(block, list) or len(block) != 2
            or not all(type(b) is int and 0 < b <= MAX_BLOCK for b in block)):
        shown = str(block)[:60]
        raise SourceError(f"config.json: quantization_config.weight_block_size is {shown}, not two positive "
                          "integers (e.g. [128, 128]); fix the checkpoint's config.json")
    return block[0], block[1]


class FP8Input(InputFormat):
    name = "fp8"

    def decodes(self, tensors: dict[str, TensorInfo], config: dict) -> dict[str, tuple[TensorInfo, Decode]]:
        block = weight_block_size(config)
        out: dict[str, tuple[TensorInfo, Decode]] = {}
        for name, info in tensors.items():
            if info.dtype not in F8 or not name.endswith(".weight") or len(info.shape) != 2:
                continue
            inv = tensors.get(name + "_scale_inv")
            scale = tensors.get(name + "_scale")
            if inv is not None and inv.dtype in SCALE_DTYPES:
                out[name] = (_logical(info), Decode("fp8_block", (info, inv), block))
            elif scale is not None and scale.dtype in SCALE_DTYPES and scale.numel in (1, info.shape[0]):
                extra = tensors.get(name[: -len("weight")] + "input_scale")
                inputs = (info, scale) + ((extra,) if extra is not None else ())
                out[name] = (_logical(info), Decode("fp8_scaled", inputs))
        return out


FORMAT = FP8Input()
