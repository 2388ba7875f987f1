"""The converter's settings, frozen: the CLI builds one, the library only reads it.

Importing this module imports no torch: the CLI validates options and prints help without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError
from .formats import DEFAULT_FORMAT, OUTPUT_FORMATS
from .scheme import SCHEMES, check_rotation

DEFAULT_MAX_SHARD = 5 * 10**9
ACTIVATIONS = ("none", "nvfp4", "mxfp4")
ACTIVATION_SCALES = ("calibrate", "constant")


@dataclass(frozen=True)
class ConvertConfig:
    """Everything that decides the output bytes (identity), and how to run (the rest)."""

    scheme: str = "nvfp4"
    rotate: str | None = None
    scale_rule: str | None = None  # None: the scheme's default (scheme.py: NVFP4 4over6, MXFP4 wmse)
    format: str = DEFAULT_FORMAT
    ignore: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    max_shard_size: int = DEFAULT_MAX_SHARD
    # Not part of the output's identity:
    device: str = "auto"
    overwrite: bool = False
    resume: bool = False
    revision: str | None = None
    verify_source: bool = False  # hash the source in full (recorded; --resume compares it)
    lanes: int = 0  # output shards written by this many lanes side by side in one process; 0: auto
    backend: str | None = None  # what quantizes (fp4convert.backends); None: chosen from the device and the plan
    allow_no_config: bool = False  # convert a source without config.json (nothing can load the output)
    base_model: str | None = None  # the model card's base_model (None: derived from the source)
    # W4A4 (docs/formats.md "W4A4"): activation quantization the engines apply, and how its static
    # scale is found. Part of the identity only when activations != "none" (W4A16 outputs unchanged).
    activations: str = "none"  # none | nvfp4 | mxfp4
    activation_scale: str = "calibrate"  # calibrate | constant (ModelOpt's amax 2688: input_scale 1.0)
    calibration_data: str | None = None  # text or JSON-lines file; None: the model generates its samples
    calibration_samples: int = 128
    calibration_seq_len: int = 512
    calibration_seed: int = 0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        SCHEMES[self.scheme].check_rule(self.scale_rule)
        check_rotation(self.rotate)
        if self.format not in OUTPUT_FORMATS:
            raise ConfigError(f"unknown format {self.format!r}; choose one of {', '.join(OUTPUT_FORMATS)}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|(cpu|cuda)(:\d+)?", self.device):
            # checked here, without torch (resolve_device, at run time, finds whether the GPU is there)
            raise ConfigError(f"--device {self.device!r} is not supported; use auto, cpu or cuda[:N]")
        if self.backend is not None:
            from .backend import backend_names

            if self.backend not in backend_names():
                raise ConfigError(f"--backend {self.backend!r}: choose one of {', '.join(backend_names())}")
        if not isinstance(self.lanes, int) or self.lanes < 0:
            raise ConfigError(f"--lanes {self.lanes!r}: give a number of lanes (1 or more), or 0 to choose automatically")
        if self.base_model is not None:
            from .modelcard import valid_repo_id

            if not valid_repo_id(self.base_model):
                raise ConfigError(f"--base-model {self.base_model!r} is not a Hub model id (org/name)")
        self._check_activations()
        if self.max_shard_size <= 0:
            raise ConfigError("--max-shard-size must be positive")
        if self.overwrite and self.resume:
            raise ConfigError("--overwrite and --resume contradict each other; pick one")
        for p in (*self.ignore, *self.only):
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as exc:
                    raise ConfigError(f"bad regex in pattern {p!r}: {exc}") from exc

    def _check_activations(self) -> None:
        """W4A4 settings: only the scheme/format pairs whose engines read activation scales."""
        if self.activations not in ACTIVATIONS:
            raise ConfigError(f"--activations {self.activations!r}: choose one of {', '.join(ACTIVATIONS)}")
        if self.activation_scale not in ACTIVATION_SCALES:
            raise ConfigError(f"--activation-scale {self.activation_scale!r}: choose one of {', '.join(ACTIVATION_SCALES)}")
        if self.calibration_samples < 1 or self.calibration_seq_len < 2:
            raise ConfigError("--calibration-samples must be >= 1 and --calibration-seq-len >= 2")
        if self.activations == "none":
            return
        if self.activations != self.scheme:
            raise ConfigError(f"--activations {self.activations} needs --scheme {self.activations} "
                              f"(weights and activations in one FP4 format), not --scheme {self.scheme}")
        if self.rotate:
            raise ConfigError("--activations cannot be combined with --rotate (the activation scales would have "
                              "to be measured on rotated activations); drop one of them")
        allowed = ("compressed-tensors", "modelopt") if self.activations == "nvfp4" else ("compressed-tensors",)
        if self.format not in allowed:
            raise ConfigError(f"--activations {self.activations} is written for --format {' or '.join(allowed)} "
                              f"only (the engines' W4A4 conventions), not --format {self.format}")

    @property
    def rule(self) -> str:
        """The scale rule in effect (the scheme's default when none was asked for)."""
        return SCHEMES[self.scheme].check_rule(self.scale_rule)

    def identity(self) -> dict:
        """The settings that determine the output bytes; resume refuses when these change."""
        return {
            "scheme": self.scheme,
            "rotate": self.rotate,
            "scale_rule": self.rule,
            "format": self.format,
            "ignore": list(self.ignore),
            "only": list(self.only),
            "max_shard_size": self.max_shard_size,
            "revision": self.revision,
            **self.activation_identity(),
        }

    def activation_identity(self) -> dict:
        """The W4A4 settings in the identity ({} for W4A16, whose identity stays as it was)."""
        if self.activations == "none":
            return {}
        out = {"activations": self.activations}
        if self.activations == "nvfp4":  # MXFP4 activations are dynamic: nothing is calibrated
            out["activation_scale"] = self.activation_scale
            if self.activation_scale == "calibrate":
                out["calibration"] = {"data": self.calibration_data, "samples": self.calibration_samples,
                                      "seq_len": self.calibration_seq_len, "seed": self.calibration_seed}
        return out


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000B' -> bytes.

    A unit is required: a bare ``10`` (which would mean 10 bytes, one shard per tensor) is refused,
    since ``--max-shard-size 10`` almost always meant 10 GB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*", text.upper())
    if not m:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB")
    if not m.group(2) and float(m.group(1)) > 0:
        raise ConfigError(f"size {text.strip()!r} has no unit (it would mean {text.strip()} bytes); write e.g. "
                          f"{text.strip()}GB or {text.strip()}MB, or {text.strip()}B if you mean bytes")
    num, unit = float(m.group(1)), (m.group(2) or "B")
    unit = unit if unit.endswith("B") else unit + "B"
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "KB": 1, "MB": 2, "GB": 3, "TB": 4}[unit.replace("I", "")]
    return int(num * base**power)


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB': decimal units, as parse_size reads them, adapted to the size (a small need
    never reads '0.00 GB'). The one size formatter of the CLI, the logs and the errors."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"
