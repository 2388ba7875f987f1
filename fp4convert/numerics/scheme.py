"""The FP4 schemes (NVFP4, MXFP4): every fact about a scheme, stated once.

"Scheme" is the number format of the weights; "format" (:mod:`fp4convert.formats`) is only the
on-disk convention that stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp4convert.errors import ConfigError


@dataclass(frozen=True)
class ScaleRule:
    """How a block's scale is chosen (docs/numerics.md "Scale rules"): the one list every layer reads.

    ``code`` is what the compiled kernels take (``csrc/``: the CPU kernel's and the CUDA launchers' rule
    argument); ``searches`` says whether the rule tries several scales per block and keeps the one with
    the lowest error, which is what input weights (``--input-weights``) change. The global scale never
    depends on the rule.
    """

    name: str
    code: int
    searches: bool


@dataclass(frozen=True)
class Scheme:
    """An FP4 weight scheme: E2M1 elements, one scale per block, and (NVFP4) a per-matrix global scale."""

    name: str
    block_size: int
    scale_encoding: str  # "e4m3" (float8_e4m3fn bytes) or "e8m0" (power-of-two exponent bytes)
    scale_dtype: str  # safetensors dtype of the stored block scales
    global_scale: bool  # an fp32 encode scale gs = 2688 / amax per matrix
    rules: tuple[ScaleRule, ...]
    default: str  # the rule used when none is given: the best measured on real models (BENCHMARKS.md)

    @property
    def default_rule(self) -> str:
        return self.default

    @property
    def scale_rules(self) -> tuple[str, ...]:
        """The rules' names, in code order."""
        return tuple(r.name for r in self.rules)

    def rule(self, name: str | None) -> ScaleRule:
        """The :class:`ScaleRule` called ``name`` (the default for None); refuses one this scheme lacks."""
        name = self.check_rule(name)
        return next(r for r in self.rules if r.name == name)

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


NVFP4 = Scheme("nvfp4", 16, "e4m3", "F8_E4M3", True, (
    ScaleRule("max", 0, searches=False),  # (gs * bmax) / 6: the textbook rule
    ScaleRule("4over6", 1, searches=True),  # the /6 or the /4 scale, the lower block error
    ScaleRule("mse", 2, searches=True),  # a fixed candidate set, the lower block error
    ScaleRule("wmse", 3, searches=True),  # the same, the error weighted by x^2
), "4over6")
MXFP4 = Scheme("mxfp4", 32, "e8m0", "U8", False, (
    ScaleRule("floor", 0, searches=False),  # OCP: the exponent of bmax, minus 2
    ScaleRule("rceil", 1, searches=False),  # floor, one up when the block would saturate
    ScaleRule("mse", 2, searches=True),  # e or e + 1, the lower block error
    ScaleRule("wmse", 3, searches=True),  # the same, the error weighted by x^2
), "wmse")
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
