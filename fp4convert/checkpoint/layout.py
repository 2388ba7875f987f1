"""Reading a checkpoint back: which format it is in, its quantized modules and its kept tensors.

``inspect`` and ``export`` share this; what the names mean is each format module's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fp4convert.config import kept_output_dtype
from fp4convert.errors import CheckpointFormatError
from fp4convert.formats import detect, get_format
from fp4convert.formats.base import QuantizedModule
from fp4convert.numerics.scheme import SCHEMES, get_scheme
from fp4convert.output.manifest import MANIFEST_NAME, load_manifest
from fp4convert.source.source import Source
from fp4convert.storage.reads import read_tensor
from fp4convert.storage.safetensors import TensorInfo

if TYPE_CHECKING:  # the layout is read from headers; only loading a module's data needs torch
    import torch

    from fp4convert.kernels.tensor import QuantizedTensor

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
    modules, problems = find_modules(fmt, candidates, manifest)
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


def find_modules(fmt, tensors: dict[str, TensorInfo], manifest: dict | None
                 ) -> tuple[dict[str, QuantizedModule], list[str]]:
    """``fmt.find_modules``, less the modules whose packed weight or block scales are not ``[..., M, N]``
    (a 1-D or 0-D tensor carrying a packed suffix): every reader takes a module's last two dims as the
    matrix. Such tensors stay in the layout as kept tensors, and the problem says why."""
    modules, problems = fmt.find_modules(tensors, manifest)
    for name, m in list(modules.items()):
        flat = next((t for t in (m.packed, m.scale) if len(t.shape) < 2), None)
        if flat is not None:
            problems.append(f"{flat.name}: shape {list(flat.shape)} is not a [..., rows, columns] matrix; "
                            "not read as a quantized weight")
            del modules[name]
    return modules, problems


def module_shape_problems(m: QuantizedModule) -> list[str]:
    """A quantized module's block scales and global scale against its packed weight and scheme."""
    from fp4convert.numerics.swizzle import padded_shape

    out = []
    *lead, rows, half = m.packed.shape
    bs = get_scheme(m.scheme).block_size
    k = half * 2
    if k % bs:
        return [f"{m.module}: K={k} is not a multiple of the {m.scheme} block size {bs}"]
    nb = k // bs
    want = (*lead, *padded_shape(rows, nb)) if m.swizzled else (*lead, rows, nb)
    if tuple(m.scale.shape) != tuple(want):
        out.append(f"{m.module}: scale shape {list(m.scale.shape)}, expected {list(want)} for {m.scheme}")
    if get_scheme(m.scheme).global_scale:
        if m.global_ is None:
            out.append(f"{m.module}: NVFP4 weight without a global scale")
        elif m.global_.dtype != "F32":
            out.append(f"{m.module}: global scale is {m.global_.dtype}, engines expect F32")
    return out


def manifest_disagreements(manifest: dict, layout: CheckpointLayout,
                           stored: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Where a (schema-valid) manifest and the shards' headers tell different stories, one line each.

    The schema (manifest.SCHEMA) checks types only; an edited manifest can still name outputs the shards
    do not hold, give a tensor a dtype or shape its outputs do not have, claim one output for two
    tensors, record a quantized tensor that no quantized module carries, or name fused groups that do not
    list their members, or settings the tensors contradict. ``stored`` (module -> its global tensor as
    stored) adds the recorded global scales. ``inspect`` reports these; ``export``, which plans from the
    manifest and copies its records, refuses the folder on the first (it would otherwise write wrong shapes,
    drop tensors, carry wrong scales or stop on an internal error).
    """
    from math import prod

    out: list[str] = []
    records: dict = manifest["tensors"]
    groups: dict = manifest.get("groups") or {}
    kept_dtype = (manifest.get("settings") or {}).get("kept_dtype", "source")  # --kept-dtype bf16: F32/F64 -> BF16
    owner = {t.name: m for m in layout.modules.values() for t in m.tensors}
    claimed: dict[str, str] = {}
    for name, rec in sorted(records.items()):
        for o, want in rec["outputs"].items():
            if o in claimed:
                out.append(f"{o}: an output of both {claimed[o]!r} and {name!r} in {MANIFEST_NAME}")
                continue
            claimed[o] = name
            got = layout.tensors.get(o)
            if got is None:
                out.append(f"{o}: listed in {MANIFEST_NAME} but not in any shard")
            elif got.dtype != want["dtype"] or list(got.shape) != want["shape"]:
                out.append(f"{o}: {got.dtype} {list(got.shape)} on disk, {MANIFEST_NAME} says {want['dtype']} "
                           f"{want['shape']}")
            elif want.get("file") and got.file != want["file"]:
                out.append(f"{o}: in {got.file}, {MANIFEST_NAME} says {want['file']}")
        if rec["action"] == "keep":
            if list(rec["outputs"]) != [name]:
                out.append(f"{name}: recorded as kept with outputs {sorted(rec['outputs'])[:3]}; a kept tensor's "
                           "only output is itself")
            elif name in owner:
                out.append(f"{name}: recorded as kept, but the shards hold it as part of quantized module "
                           f"{owner[name].module}")
            elif (rec["outputs"][name]["dtype"], rec["outputs"][name]["shape"]) != \
                    (kept_output_dtype(rec["dtype"], kept_dtype), rec["shape"]):
                w = rec["outputs"][name]
                out.append(f"{name}: recorded as kept {rec['dtype']} {rec['shape']}, its output is {w['dtype']} "
                           f"{w['shape']}" + (f" (kept_dtype {kept_dtype!r})" if kept_dtype != "source" else ""))
        else:
            mods = {owner[o].module: owner[o] for o in rec["outputs"] if o in owner}
            # A quantized tensor's outputs are named after it (``X.weight`` -> ``X.weight_packed``; a
            # stacked ``E.gate_up_proj`` -> ``E.0.gate_up_proj...``): a record under another name would
            # make export and --verify attribute the module to a tensor the source does not have.
            stem = name[: -len(".weight")] if name.endswith(".weight") else name.rpartition(".")[0]
            foreign = [o for o in rec["outputs"] if not o.startswith(stem + ".")] if stem else []
            if foreign:
                out.append(f"{name!r}: its output {foreign[0]} is not named after it")
            elif not mods:  # (other outputs may be the format's own: a had16 transform, a W4A4 input scale)
                out.append(f"{name}: recorded as quantized, but none of its outputs is a quantized module's tensor")
            else:
                partial = [t.name for m in mods.values() for t in m.tensors if t.name not in rec["outputs"]]
                if partial:
                    out.append(f"{name}: {partial[0]} belongs to its quantized module but is not listed as its output")
                elif sum(prod(m.shape) for m in mods.values()) != prod(rec["shape"]):
                    out.append(f"{name}: recorded as {rec['shape']}, its quantized module(s) hold "
                               f"{sum(prod(m.shape) for m in mods.values())} weights, not {prod(rec['shape'])}")
        g = rec.get("group")
        if g is not None and name not in groups.get(g, ()):
            out.append(f"{name}: in fused group {g!r}, which {MANIFEST_NAME}'s groups do not list it in")
    for g, members in sorted(groups.items()):
        for member in members:
            if member not in records or records[member].get("group") != g:
                out.append(f"fused group {g!r} lists {member!r}, which {MANIFEST_NAME} does not record in that group")
                break
    extra = sorted(set(layout.tensors) - set(claimed))
    if extra:
        out.append(f"{len(extra)} tensor(s) not in {MANIFEST_NAME}, e.g. {extra[0]}")
    scheme = manifest.get("scheme")
    if layout.scheme and scheme and layout.scheme != scheme:
        out.append(f"{MANIFEST_NAME} says scheme {scheme}, the block scales are {layout.scheme}")
    if scheme in SCHEMES and manifest.get("block_size") not in (None, get_scheme(scheme).block_size):
        out.append(f"{MANIFEST_NAME} says block size {manifest.get('block_size')}, {scheme} has "
                   f"{get_scheme(scheme).block_size}")
    rule = manifest.get("scale_rule")
    if scheme in SCHEMES and rule is not None and rule not in get_scheme(scheme).scale_rules:
        out.append(f"{MANIFEST_NAME} says scale rule {rule!r}, which {scheme} does not have")
    settings = manifest.get("settings") or {}
    for key in ("scheme", "format", "rotate"):
        if key in settings and settings[key] != manifest.get(key):
            out.append(f"{MANIFEST_NAME}: settings.{key} is {settings[key]!r} but {key} is {manifest.get(key)!r}")
    # A quantized source tensor becomes one module (a 2-D weight) or several (stacked experts split per
    # expert): its outputs name them, so the modules are counted through the outputs, not the names.
    quantized = {name: {owner[o].module for o in rec["outputs"] if o in owner}
                 for name, rec in records.items() if rec["action"] == "quantize"}
    covered = set().union(*quantized.values()) if quantized else set()
    stray = sorted(set(layout.modules) - covered)  # (a record with no module is reported above)
    if stray:
        out.append(f"{MANIFEST_NAME} lists {len(quantized)} quantized weights ({len(covered)} quantized modules), "
                   f"the shards hold {len(layout.modules)} (e.g. {stray[0]})")
    if stored:
        out += _global_disagreements(records, layout, stored)
    return out


def _global_disagreements(records: dict, layout: CheckpointLayout, stored: dict[str, torch.Tensor]) -> list[str]:
    """Recorded global scales (per tensor, or per matrix of a stacked expert tensor) against the stored ones."""
    import torch

    fmt = get_format(layout.format)
    out = []
    for name, rec in sorted(records.items()):
        recorded = [(name[: -len(".weight")], rec)] + sorted((rec.get("matrices") or {}).items())
        for module, r in recorded:
            if "global_scale" in r and module in stored:
                want = fmt.global_value(torch.tensor(r["global_scale"], dtype=torch.float32)).flatten()
                if want.shape != stored[module].shape or not torch.equal(want, stored[module]):
                    out.append(f"{module}: global scale {stored[module].tolist()} on disk, {MANIFEST_NAME} records "
                               f"{r['global_scale']!r} (stored as {want.tolist()})")
    return out


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
