"""Exception classes of fp4convert; the CLI maps each family to an exit code."""

from __future__ import annotations


class FP4ConvertError(Exception):
    """Base class of every error fp4convert raises on purpose."""

    exit_code = 1


class QuantizationError(FP4ConvertError, ValueError):
    """A tensor cannot be quantized under the requested scheme."""

    exit_code = 3


class NonFiniteError(QuantizationError):
    """The tensor holds NaN or Inf, which no FP4 code can represent."""


class ShapeError(QuantizationError):
    """The tensor's shape does not fit the scheme (block size, packing, rank)."""
