"""Every exception class fp4convert raises on purpose, and the exit code the CLI gives each family.

The CLI turns an ``FP4ConvertError`` into one line on stderr and ``exit_code``; ``EXIT_CODES`` is
the table that ``fp4convert --help`` and the README print (a test checks they agree).
"""

from __future__ import annotations

EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "an unexpected internal error (please report it, with --debug output)",
    2: "bad options, or a plan that cannot be carried out",
    3: "a tensor that cannot be quantized (NaN/Inf, shape)",
    4: "the source cannot be found, fetched or read (or is malformed)",
    5: "the destination cannot be written (exists, full, locked, other settings)",
    6: "inspect found problems",
    7: "the CUDA kernels cannot be built or run here (--device cpu always works)",
    130: "interrupted (Ctrl-C); --resume continues",
    141: "stdout was closed early (e.g. piped into head): output stopped, no error",
}
STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell shows for a command stopped by a closed pipe


class FP4ConvertError(Exception):
    """Base class of every error fp4convert raises on purpose."""

    exit_code = 1


# -- 2: options and plans ---------------------------------------------------------------------

class ConfigError(FP4ConvertError, ValueError):
    """The requested settings are contradictory or malformed."""

    exit_code = 2


class PlanError(FP4ConvertError):
    """The checkpoint cannot be converted as asked (validation failed before any work)."""

    exit_code = 2


# -- 3: tensors -------------------------------------------------------------------------------

class QuantizationError(FP4ConvertError, ValueError):
    """A tensor cannot be quantized under the requested scheme."""

    exit_code = 3


class NonFiniteError(QuantizationError):
    """The tensor holds NaN or Inf, which no FP4 code can represent."""


class RotationOverflowError(NonFiniteError):
    """A finite tensor whose Had16-rotated values overflow fp32 (its values are near the fp32 limit)."""


HAD16_GAIN = 4.0  # the largest |rotated value| / max|x| of the normalised 16-point Hadamard (16 / sqrt(16))
FP32_MAX = 3.4028234663852886e38


def nonfinite_error(name: str, file: str, rotate: str | None, amax: float | None = None) -> NonFiniteError:
    """The error for a tensor whose quantization met NaN/Inf. Without a rotation the source holds them;
    with one, a finite source near the fp32 limit overflows in the rotation: with the source's max |x|
    (``amax``) known the message says which, otherwise it names both causes and the limit."""
    where = f"{name} (in {file})"
    if not rotate:
        return NonFiniteError(f"{where} holds NaN or Inf; fix the source or --ignore it")
    if amax is not None and amax == amax and amax != float("inf"):
        return RotationOverflowError(
            f"{where}: the {rotate} rotation overflowed fp32 (the source is finite, max |x| {amax:.3g}; a rotated "
            f"value reaches up to {HAD16_GAIN:g}x that, fp32 ends at {FP32_MAX:.3g}); convert without --rotate "
            "or --ignore it")
    return NonFiniteError(
        f"{where} holds NaN or Inf, or finite values above {FP32_MAX / HAD16_GAIN:.3g} that overflow fp32 in the "
        f"{rotate} rotation (up to {HAD16_GAIN:g}x); fix the source, convert without --rotate, or --ignore it")


def kept_overflow_error(name: str, file: str, dtype: str) -> QuantizationError:
    """A kept tensor whose finite values BF16 cannot hold (``--kept-dtype bf16`` would write Inf)."""
    return QuantizationError(f"{name} (kept unquantized, {dtype} in {file}) holds finite values beyond BF16's range "
                             "(|x| of about 3.396e38 or more) that --kept-dtype bf16 would store as Inf; convert with --kept-dtype "
                             "source")


class ShapeError(QuantizationError):
    """The tensor's shape does not fit the scheme (block size, packing, rank)."""


# -- 4: sources -------------------------------------------------------------------------------

class SourceError(FP4ConvertError):
    """The checkpoint cannot be found, fetched or read."""

    exit_code = 4


class CheckpointFormatError(SourceError):
    """A safetensors file is malformed or not what its index says."""


class OutsideSourceError(SourceError):
    """A file the checkpoint names resolves outside the checkpoint folder (or the repo's HF cache)."""


class ConfigJSONError(SourceError):
    """config.json holds a value of the wrong JSON type under a key fp4convert reads (fp4convert.config_json)."""


class CheckpointIndexError(SourceError):
    """The weight index is malformed or disagrees with the weight files it names."""


# -- 5: destinations --------------------------------------------------------------------------

class OutputError(FP4ConvertError):
    """The destination cannot be written as asked (exists, full, or from other settings)."""

    exit_code = 5


class PushError(OutputError):
    """Uploading the output to the Hugging Face Hub failed (rerun to upload only what is missing)."""


# -- 6: inspect -------------------------------------------------------------------------------

class InspectFailed(FP4ConvertError):
    """``inspect`` ran and found problems (the report lists them)."""

    exit_code = 6


# -- 7: CUDA ----------------------------------------------------------------------------------

class CUDAUnavailableError(FP4ConvertError):
    """No usable CUDA device, driver or nvcc for the kernels; the CPU path still works."""

    exit_code = 7


class CUDABuildError(CUDAUnavailableError):
    """nvcc failed to build the kernel library (its output is in the message)."""


class CUDAKernelError(FP4ConvertError):
    """A kernel launch or a launcher argument check failed."""

    exit_code = 7


# -- 130: interrupted -------------------------------------------------------------------------

class Interrupted(FP4ConvertError):
    """The run was interrupted (Ctrl-C or SIGTERM); what was finished is kept for --resume."""

    exit_code = 130


# -- under torchrun: another rank's error -----------------------------------------------------

class RankFailed(FP4ConvertError):
    """Another rank of a torchrun conversion failed; carries its one-line error and exit code."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):
        return (type(self), (str(self), self.exit_code))


class NotRegularFile(OSError):
    """A FIFO, device, socket or folder where a regular file was expected (never opened for reading)."""


class RankStopped(Exception):
    """Under torchrun: another rank failed, so this one stops and reports at the final gather (internal)."""


class DefinitionUnknown(Exception):
    """The model definition cannot be had (internal: the planner falls back to name rules and says why)."""


class BuildFailed(Exception):
    """A lazy build's default error (fp4convert.kernels.jit): the compiler is missing or failed (callers usually fall back)."""


class StopForward(Exception):
    """Raised by the calibration runner's recorder after the last block it needs: the rest of the forward is not run (internal)."""


class UnloadedWeights(Exception):
    """Raised by a calibration stand-in forward at a module whose weights no checkpoint tensor loads (internal)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class Cancelled(Exception):
    """Raised inside a Hub download or a checksum pass when the prefetcher stops (fp4convert.source.prefetch)."""
