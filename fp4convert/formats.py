"""Output formats: how a quantized weight is named and laid out on disk (SPEC.md section 7).

A format is pure naming and layout. It says, from shapes alone, which tensors a quantized weight
becomes (so the plan can size shards before any data is read), and turns a QuantizedTensor into
exactly those tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ConfigError
from .safetensors_io import OutEntry
from .swizzle import padded_shape
from .tensor import BLOCK_SIZE, QuantizedTensor


@dataclass(frozen=True)
class OutputFormat:
    """One on-disk convention for quantized weights."""

    name: str
    swizzled: bool  # block scales in the 128x4 layout (native) or linear (engines swizzle at load)
    schemes: tuple[str, ...] = ("nvfp4", "mxfp4")

    def check(self, scheme: str, rotate: str | None) -> None:
        """Refuse settings this format cannot carry faithfully."""
        if scheme not in self.schemes:
            raise ConfigError(f"--format {self.name} stores {'/'.join(self.schemes)} only, not {scheme}")

    def names(self, module: str) -> dict[str, str]:
        """Output tensor names for the weight of ``module``: packed, scale, and global (NVFP4)."""
        return {
            "packed": f"{module}.weight_packed",
            "scale": f"{module}.weight_scale",
            "global": f"{module}.weight_global_scale",
        }

    def entries(self, module: str, shape: tuple[int, ...], scheme: str) -> list[OutEntry]:
        """What a quantized ``[..., M, K]`` weight becomes, known before any data is read."""
        *lead, m, k = shape
        lead = tuple(lead)
        nb = k // BLOCK_SIZE[scheme]
        scale_shape = (*lead, *padded_shape(m, nb)) if self.swizzled else (*lead, m, nb)
        n = self.names(module)
        out = [
            OutEntry(n["packed"], "U8", (*lead, m, k // 2)),
            OutEntry(n["scale"], "F8_E4M3" if scheme == "nvfp4" else "U8", scale_shape),
        ]
        if scheme == "nvfp4":
            out.append(OutEntry(n["global"], "F32", self.global_shape(lead)))
        return out

    def global_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, 1)

    def global_value(self, gs: torch.Tensor) -> torch.Tensor:
        """The stored global tensor from the encode scale gs."""
        return gs.reshape(*gs.shape, 1).to(torch.float32)

    def finalize(self, dst, plan, source) -> None:
        """Write what the format needs beside the shards (config edits); the native one needs nothing."""

    def tensors(self, module: str, q: QuantizedTensor) -> list[tuple[str, torch.Tensor]]:
        """The output tensors of one quantized weight, in :meth:`entries` order."""
        n = self.names(module)
        scale = q.scale if (q.scale_layout == "swizzled") == self.swizzled else q.linear_scale()
        if self.swizzled and q.scale_layout != "swizzled":
            raise ValueError("internal: a swizzled format needs scale_layout='swizzled'")
        out = [(n["packed"], q.packed), (n["scale"], scale)]
        if q.fmt == "nvfp4":
            out.append((n["global"], self.global_value(q.global_scale)))
        return out


NATIVE = OutputFormat("fp4convert", swizzled=True)

FORMATS: dict[str, OutputFormat] = {NATIVE.name: NATIVE}


def get_format(name: str) -> OutputFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ConfigError(
            f"--format {name} is not available in this version; available: {', '.join(FORMATS)}"
        ) from None
