"""What a quantized source means for a conversion (docs/formats.md "Sources"), decided before planning.

- FP8, gpt-oss MXFP4 and INT4 ``pack-quantized`` checkpoints are *decoded*: the planner sees the exact fp32
  weights they encode (``fp4convert.formats`` input formats) and quantizes them like any other source.
- An FP4 checkpoint (NVFP4 / MXFP4 in compressed-tensors', ModelOpt's or the native layout) is *re-laid*: its
  E2M1 codes, block scales, global scales and W4A4 activation scales are copied bit for bit into the output
  format (``fp4convert.checkpoint.export``, which ``fp4convert quantize`` and ``fp4convert export`` run), when
  the settings asked for describe what the source holds (:func:`relayout_problems`). It is decoded and
  quantized again only when the conversion asks for it (``--requantize``).
- Anything else already quantized is refused by the planner, naming what it found.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp4convert.config import RTN, ConvertConfig
from fp4convert.errors import PlanError


@dataclass(frozen=True)
class FP4Source:
    """What an FP4 source holds, from its headers and config files (or its manifest)."""

    format: str  # the registered output format whose layout it is in
    scheme: str | None  # nvfp4 | mxfp4 (None: no FP4 module found)
    rotate: str | None
    activations: str  # "none" or the W4A4 activation scheme it carries (nvfp4: stored scales; mxfp4: dynamic)
    scale_rule: str | None = None  # how its block scales were chosen (recorded by fp4convert only)
    kept_dtype: str = "source"  # how its kept tensors were stored (recorded by fp4convert only)

    def describe(self) -> str:
        scheme = (self.scheme or "FP4").upper()
        extra = ", ".join(x for x in (f"{self.rotate}-rotated" if self.rotate else "",
                                      f"W4A4 {self.activations.upper()}" if self.activations != "none" else "") if x)
        return f"{scheme} in the {self.format} layout" + (f" ({extra})" if extra else "")


def check_source(root: Path, config_json: dict, manifest: dict | None, requantize: bool = False) -> None:
    """The conversion's gate on a quantized source, before planning: an FP4 checkpoint is re-laid, not planned
    (PlanError saying how, exit 2), unless ``requantize`` asks to quantize its exactly decoded weights again.
    Every other source goes on to the planner (which decodes FP8 / MXFP4 / INT4 inputs and refuses the rest)."""
    from fp4convert.formats import detect

    try:
        found = detect(root, config_json, manifest)
    except (AttributeError, TypeError):  # a value of the wrong type in an engine config: the planner reports it
        found = None
    if found is None and manifest is None:
        return
    if requantize and found is not None:
        return
    what = f"an fp4convert output ({found.name if found else '?'} format)" if manifest is not None else \
        f"FP4 weights in the {found.name if found else '?'} layout"
    raise PlanError(f"the source is already quantized ({what}): `fp4convert quantize` and `fp4convert export` re-lay "
                    "its codes and scales into another format bit for bit (fp4convert.checkpoint.export.export in "
                    "Python); to quantize its exactly decoded weights again instead, pass --requantize "
                    "(requantize=True)")


def relayout_problems(src: FP4Source, config: ConvertConfig, target_activation_modes: tuple[str, ...],
                      target_schemes: tuple[str, ...]) -> list[str]:
    """Why the output ``config`` asks for cannot be made from ``src``'s bytes (each with what to pass instead);
    empty when it can. The settings must describe what the source holds: a re-layout changes names, the scale
    layout and the form of the global and activation scales, never a value."""
    out: list[str] = []
    scheme = src.scheme or config.scheme
    if config.scheme != scheme:
        out.append(f"the source holds {scheme.upper()} weights, not {config.scheme.upper()}: pass --scheme {scheme} "
                   f"to re-lay them, or --requantize to quantize their exact values to {config.scheme.upper()}")
    if scheme not in target_schemes:
        out.append(f"--format {config.format} cannot hold {scheme.upper()} (it stores {'/'.join(target_schemes)}); "
                   "choose another --format, or --requantize")
    if (config.rotate or None) != src.rotate:
        out.append(f"the source's weights are {src.rotate}-rotated: pass --rotate {src.rotate}" if src.rotate else
                   f"the source's weights are not rotated: drop --rotate {config.rotate}, or --requantize")
    if config.activations not in ("none", src.activations):
        out.append(f"the source carries no {config.activations.upper()} activation scales "
                   + ("(it is weight-only)" if src.activations == "none" else f"(it is W4A4 {src.activations.upper()})")
                   + ": drop --activations, or --requantize (a calibration)")
    elif src.activations != "none" and src.activations not in target_activation_modes:
        out.append(f"the source is W4A4 {src.activations.upper()} and --format {config.format} has no activation "
                   "convention for it: choose --format "
                   + ("compressed-tensors or modelopt" if src.activations == "nvfp4" else "compressed-tensors"))
    if config.scale_rule is not None and config.scale_rule != src.scale_rule:
        out.append(f"--scale-rule {config.scale_rule} would choose other block scales: drop it, or --requantize")
    if config.method not in (None, RTN) or config.input_weights not in ("auto", "none"):  # (None: rtn)
        out.append("--method / --input-weights choose the codes and scales: a re-layout keeps the source's; "
                   "add --requantize to quantize its exact values again")
    if config.ignore or config.only:
        out.append("--ignore / --only choose what is quantized: a re-layout keeps the source's choice; add "
                   "--requantize to choose again")
    if config.kept_dtype != src.kept_dtype:
        out.append(f"--kept-dtype {config.kept_dtype}: a re-layout copies the source's kept tensors as they are "
                   f"(stored as {src.kept_dtype}); drop it, or --requantize")
    return out


def relayout_refusal(src: FP4Source, problems: list[str]) -> PlanError:
    """The refusal of a re-layout the settings cannot have (exit 2), one clause per problem."""
    return PlanError(f"cannot re-lay the source ({src.describe()}) as asked: {'; '.join(problems)}")
