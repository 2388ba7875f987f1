"""fp4convert: offline conversion of safetensors checkpoints to NVFP4 / MXFP4.

The tensor API below is what the converter itself uses; the numerics live in
:mod:`fp4convert.reference` (described in docs/numerics.md) and the kernels (built on first CUDA use)
in :mod:`fp4convert.cuda`. The converter's data flow is source -> plan -> quantize -> write ->
manifest (:mod:`fp4convert.convert`).
"""

from __future__ import annotations

import warnings

# torch warns "Failed to initialize NumPy" at import when numpy is absent; fp4convert never uses numpy
# (it is not a dependency), so the warning would only confuse users of a fresh install.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from .errors import ConfigError, FP4ConvertError, NonFiniteError, QuantizationError, ShapeError
from .scheme import MXFP4, NVFP4, SCHEMES, Scheme
from .swizzle import swizzle_scales, unswizzle_scales
from .tensor import QuantizedTensor, amax, dequantize, quantize
from .version import __version__

__all__ = [
    "MXFP4",
    "NVFP4",
    "SCHEMES",
    "ConfigError",
    "FP4ConvertError",
    "NonFiniteError",
    "QuantizationError",
    "QuantizedTensor",
    "Scheme",
    "ShapeError",
    "__version__",
    "amax",
    "dequantize",
    "quantize",
    "swizzle_scales",
    "unswizzle_scales",
]
