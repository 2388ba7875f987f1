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
        if not isinstance(self.lanes, int) or self.lanes < 0:
            raise ConfigError(f"--lanes {self.lanes!r}: give a number of lanes (1 or more), or 0 to choose automatically")
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
        }


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*", text.upper())
    if not m:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB")
    num, unit = float(m.group(1)), (m.group(2) or "B")
    unit = unit if unit.endswith("B") else unit + "B"
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "KB": 1, "MB": 2, "GB": 3, "TB": 4}[unit.replace("I", "")]
    return int(num * base**power)


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as parse_size reads them)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"
