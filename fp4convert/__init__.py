"""fp4convert: offline conversion of safetensors checkpoints to NVFP4 / MXFP4.

The tensor API below is what the converter itself uses; the numerics live in
:mod:`fp4convert.numerics.reference` (described in docs/numerics.md) and the kernels (built on first CUDA use)
in :mod:`fp4convert.kernels.cuda`. The converter's data flow is source -> plan -> quantize -> write ->
manifest (:mod:`fp4convert.run.convert`).
"""

from __future__ import annotations

import warnings

# torch warns "Failed to initialize NumPy" at import when numpy is absent; fp4convert never uses numpy
# (it is not a dependency), so the warning would only confuse users of a fresh install.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from fp4convert.errors import ConfigError, FP4ConvertError, NonFiniteError, QuantizationError, ShapeError
from fp4convert.numerics.scheme import MXFP4, NVFP4, SCHEMES, Scheme
from fp4convert.version import __version__

# The tensor API needs torch; it is imported on first use, so the command line (``--help``,
# ``--version``, option errors, Ctrl-C during start-up) answers without paying torch's start-up.
_LAZY = {
    "QuantizedTensor": "kernels.tensor", "amax": "kernels.tensor", "dequantize": "kernels.tensor",
    "quantize": "kernels.tensor", "swizzle_scales": "numerics.swizzle", "unswizzle_scales": "numerics.swizzle",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fp4convert' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


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
