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
