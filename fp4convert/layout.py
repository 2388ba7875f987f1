"""Reading a checkpoint back: which format it is in, its quantized modules and its kept tensors.

``inspect`` and ``export`` share this; what the names mean is each format module's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import CheckpointFormatError
from .formats import detect, get_format
from .formats.base import QuantizedModule
from .manifest import load_manifest
from .safetensors_io import TensorInfo, read_tensor
from .source import Source

if TYPE_CHECKING:  # the layout is read from headers; only loading a module's data needs torch
    import torch

    from .tensor import QuantizedTensor

UNQUANTIZED = "unquantized"


@dataclass
class CheckpointLayout:
    """What a checkpoint is: its format, and its quantized modules and kept tensors."""

    format: str  # a registered format name, or "unquantized"
    scheme: str | None
    rotate: str | None
    modules: dict[str, QuantizedModule]
    kept: list[TensorInfo]
    tensors: dict[str, TensorInfo]
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return self.format != UNQUANTIZED


def read_layout(source: Source, *, manifest_errors: list[str] | None = None) -> CheckpointLayout:
    """The layout from headers, config files and the manifest (no tensor data read).

    A damaged manifest raises CheckpointFormatError; with ``manifest_errors`` (``inspect``) it is
    appended there instead and the folder is read as if it had none."""
    try:
        manifest = load_manifest(source.root, source.roots)
    except CheckpointFormatError as exc:
        if manifest_errors is None:
            raise
        manifest_errors.append(str(exc))
        manifest = None
    config = source.config()
    try:
        fmt = detect(source.root, config, manifest)
    except (AttributeError, TypeError) as exc:  # a value of the wrong type in an engine config
        raise CheckpointFormatError(f"{source.label}: the quantization config is malformed ({exc}); "
                                    "config.json's quantization_config / hf_quant_config.json") from None
    listed = source.tensors(check_index=False)  # an index that disagrees is a finding, not a crash
    tensors = {t.name: t for t in listed}
    index_problems = source.index_problems(listed)
    if fmt is None:
        return CheckpointLayout(UNQUANTIZED, None, None, {}, list(tensors.values()), tensors, manifest,
                                index_problems)
    # A tensor the manifest records as a kept tensor's output is kept, whatever its name and dtype say
    # (ModelOpt's packed weights are U8 ``.weight``: so is a source's kept U8 ``.weight``).
    kept_outputs = _kept_outputs(manifest)
    candidates = {n: t for n, t in tensors.items() if n not in kept_outputs}
    modules, problems = fmt.find_modules(candidates, manifest)
    problems = index_problems + problems
    used = {t.name for m in modules.values() for t in m.tensors}
    kept = [t for n, t in tensors.items() if n not in used]
    schemes = {m.scheme for m in modules.values()}
    if len(schemes) > 1:
        problems.append(f"mixed schemes in one checkpoint: {sorted(schemes)}")
    scheme = schemes.pop() if len(schemes) == 1 else None
    try:
        rotate = fmt.rotation(source.root, config, manifest)
    except (AttributeError, TypeError) as exc:
        problems.append(f"config.json's quantization_config.transform_config is malformed ({exc})")
        rotate = None
    return CheckpointLayout(fmt.name, scheme, rotate, modules, kept, tensors, manifest, problems)


def _kept_outputs(manifest: dict | None) -> set[str]:
    """The output names of the tensors a (validated) manifest records as kept."""
    if not manifest:
        return set()
    return {o for rec in manifest.get("tensors", {}).values() if rec.get("action") == "keep"
            for o in rec.get("outputs", {})}


def read_global(source: Source, layout: CheckpointLayout, m: QuantizedModule) -> torch.Tensor | None:
    """The module's ENCODE scale gs, whatever the format stores."""
    if m.global_ is None:
        return None
    g = read_tensor(source.local_path(m.global_.file), m.global_)
    return get_format(layout.format).encode_scale(g).reshape(m.packed.shape[:-2])


def load_quantized(source: Source, layout: CheckpointLayout, m: QuantizedModule) -> QuantizedTensor:
    """A quantized module's data as a QuantizedTensor (scales in the layout they are stored in)."""
    return get_format(layout.format).load(m, lambda info: read_tensor(source.local_path(info.file), info),
                                          layout.rotate)
