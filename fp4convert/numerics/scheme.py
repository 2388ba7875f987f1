"""The FP4 schemes (NVFP4, MXFP4): every fact about a scheme, stated once.

"Scheme" is the number format of the weights; "format" (:mod:`fp4convert.formats`) is only the
on-disk convention that stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp4convert.errors import ConfigError


@dataclass(frozen=True)
class Scheme:
    """An FP4 weight scheme: E2M1 elements, one scale per block, and (NVFP4) a per-matrix global scale."""

    name: str
    block_size: int
    scale_encoding: str  # "e4m3" (float8_e4m3fn bytes) or "e8m0" (power-of-two exponent bytes)
    scale_dtype: str  # safetensors dtype of the stored block scales
    global_scale: bool  # an fp32 encode scale gs = 2688 / amax per matrix
    scale_rules: tuple[str, ...]  # in the kernels' rule-code order (index = launcher code)
    default: str  # the rule used when none is given: the best measured on real models (BENCHMARKS.md)

    @property
    def default_rule(self) -> str:
        return self.default

    def check_rule(self, rule: str | None) -> str:
        """The rule to use (the default for None); refuses a rule this scheme does not have."""
        if rule is None:
            return self.default_rule
        if rule not in self.scale_rules:
            raise ConfigError(
                f"scale rule {rule!r} does not apply to {self.name}; choose one of {', '.join(self.scale_rules)}"
            )
        return rule

    def scale_bytes(self, k: int) -> int:
        """Block scales per row of K elements."""
        return k // self.block_size


NVFP4 = Scheme("nvfp4", 16, "e4m3", "F8_E4M3", True, ("max", "4over6", "mse", "wmse"), "4over6")
MXFP4 = Scheme("mxfp4", 32, "e8m0", "U8", False, ("floor", "rceil", "mse", "wmse"), "wmse")
SCHEMES: dict[str, Scheme] = {s.name: s for s in (NVFP4, MXFP4)}
ROTATIONS: tuple[str, ...] = ("had16",)


def get_scheme(name: str | Scheme) -> Scheme:
    if isinstance(name, Scheme):
        return name
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown scheme {name!r}; choose one of {', '.join(SCHEMES)}") from None


def check_rotation(rotate: str | None) -> str | None:
    if rotate is not None and rotate not in ROTATIONS:
        raise ConfigError(f"unknown rotation {rotate!r}; the only one is 'had16'")
    return rotate
