"""fp4convert: offline conversion of safetensors checkpoints to NVFP4 / MXFP4.

The tensor API below is what the converter itself uses; the numerics live in
:mod:`fp4convert.reference` and the kernels (built on first CUDA use) in :mod:`fp4convert.cuda`.
"""

from __future__ import annotations

from .errors import FP4ConvertError, NonFiniteError, QuantizationError, ShapeError
from .swizzle import swizzle_scales, unswizzle_scales
from .tensor import QuantizedTensor, amax, dequantize, quantize

__version__ = "0.1.0"

__all__ = [
    "FP4ConvertError",
    "NonFiniteError",
    "QuantizationError",
    "QuantizedTensor",
    "ShapeError",
    "__version__",
    "amax",
    "dequantize",
    "quantize",
    "swizzle_scales",
    "unswizzle_scales",
]
