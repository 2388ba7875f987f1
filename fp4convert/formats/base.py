"""What every on-disk format has in common, and the native convention's defaults.

A format is naming and layout only. Writing: from shapes alone it says which tensors a quantized
weight becomes (so the plan can size shards before any data is read), turns a QuantizedTensor into
exactly those tensors, and writes its files beside the shards. Reading: it recognises a folder as
its own, finds the quantized modules among a checkpoint's tensors, and loads one back as a
QuantizedTensor (``inspect`` and ``export`` use this; nothing else knows a format's names).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import ConfigError
from fp4convert.numerics.scheme import SCHEMES, Scheme, get_scheme
from fp4convert.numerics.swizzle import padded_shape
from fp4convert.storage.names import CONFIG_NAME
from fp4convert.storage.safetensors import OutEntry, TensorInfo

if TYPE_CHECKING:  # the names and shapes (what planning asks) need no torch; the tensor methods import it
    import torch

    from fp4convert.kernels.tensor import QuantizedTensor



@dataclass(frozen=True)
class OutputInfo:
    """What a format needs to know about a finished plan to write its config files."""

    scheme: str
    rotate: str | None
    scale_rule: str | None
    kept_modules: tuple[str, ...]  # 2-D weights left unquantized: engines must not treat them as FP4
    model_config: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Decode:
    """How a quantized INPUT tensor becomes the exact fp32 weight it encodes (docs/numerics.md, docs/formats.md
    "Sources"). Everything :func:`fp4convert.quantizer.matrices.weight_of` needs besides the tensors' data.

    ``kind``: "fp8_block" (``weight`` E4M3 x ``weight_scale_inv`` per ``block``), "fp8_scaled" (x ``weight_scale``
    per tensor or per row), "mxfp4_blocks" (gpt-oss ``*_blocks``/``*_scales``), "int4_pack" (compressed-tensors
    ``pack-quantized``: ``weight_packed`` int32, ``weight_scale`` per ``group`` weights or per row, the packed
    ``weight_zero_point`` when ``zero_point``, ``weight_shape``), "nvfp4" / "mxfp4" (an FP4 checkpoint in
    ``layout``, a registered output format's name: its codes, block scales and global, each format's own
    decode). ``transpose``: the planner's weight is the decoded tensor with its last two dims swapped (gpt-oss
    stores experts ``[E, out, in]`` as MXFP4 and ``[E, in, out]`` in bf16). ``cols``: INT4, the row length
    (packed rows are padded to whole int32 words). Inputs past the ones a kind decodes (an FP8 activation
    scale, an FP4 checkpoint's activation scale or Had16 transform) are consumed: read, not decoded.
    """

    kind: str
    inputs: tuple[TensorInfo, ...]  # the on-disk tensors it reads, the main one first
    block: tuple[int, int] | None = None
    transpose: bool = False
    group: int | None = None  # int4_pack: weights per scale along a row (None: one scale per row or tensor)
    cols: int | None = None  # int4_pack: the unpacked row length K
    zero_point: bool = False  # int4_pack: inputs[2] is the packed zero point (asymmetric)
    layout: str | None = None  # nvfp4 / mxfp4: the output format whose conventions the inputs follow
    swizzled: bool = False  # nvfp4 / mxfp4: block scales in the 128x4 layout (the native format's)
    decode_global: bool = False  # nvfp4: the stored global is the DECODE scale 1/gs (ModelOpt's weight_scale_2)

    def describe(self) -> str:
        if self.kind == "int4_pack":
            what = (f"INT4 pack-quantized ({'asymmetric' if self.zero_point else 'symmetric'}, "
                    + (f"a scale per {self.group}" if self.group else "a scale per row") + ")")
        elif self.kind in ("nvfp4", "mxfp4"):
            what = f"{self.kind.upper()} in the {self.layout} layout"
        else:
            what = {"fp8_block": f"FP8 E4M3 with {self.block[0]}x{self.block[1]} block scales" if self.block else "FP8",
                    "fp8_scaled": "FP8 E4M3 with a per-tensor/per-channel scale",
                    "mxfp4_blocks": "MXFP4 blocks (gpt-oss)"}[self.kind]
        return f"{what} ({', '.join(t.name for t in self.inputs)})"

    def to_json(self) -> dict:
        out = {"kind": self.kind, "inputs": [t.name for t in self.inputs],
               "block": list(self.block) if self.block else None, "transpose": self.transpose}
        extra = {"group": self.group, "cols": self.cols, "zero_point": self.zero_point, "layout": self.layout,
                 "swizzled": self.swizzled, "decode_global": self.decode_global}
        return {**out, **{k: v for k, v in extra.items() if v}}  # only what a kind sets (FP8's record unchanged)

    def arguments(self) -> dict:
        """The keywords :func:`fp4convert.kernels.tensor.dequantize_input` takes for this kind."""
        if self.kind == "int4_pack":
            return {"group": self.group, "cols": self.cols, "zero_point": self.zero_point}
        if self.kind in ("nvfp4", "mxfp4"):
            return {"swizzled": self.swizzled, "decode_global": self.decode_global}
        return {"block": self.block}


class InputFormat:
    """A quantized convention fp4convert reads (and decodes exactly) but never writes."""

    name: str = ""

    def decodes(self, tensors: dict[str, TensorInfo], config: dict) -> dict[str, tuple[TensorInfo, Decode]]:
        """logical weight name -> (its planner-facing TensorInfo, how to decode it); {} if none here."""
        return {}


@dataclass(frozen=True)
class QuantizedModule:
    """The tensors of one quantized weight, as found on disk."""

    module: str
    packed: TensorInfo
    scale: TensorInfo
    global_: TensorInfo | None  # the stored global tensor (what it means is the format's business)
    scheme: str
    swizzled: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return tuple(t for t in (self.packed, self.scale, self.global_) if t is not None)


def value_kind(v: object) -> str:
    """What a config value is, for a finding about a value of the wrong type ("an object", "null", ...)."""
    if v is None:
        return "null"
    return {bool: "true/false", str: "a string", int: "an integer", float: "a number", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


@dataclass(frozen=True)
class Excluded:
    """The modules a format's engine config keeps out of FP4, as found there: ``inspect`` checks them against
    the kept and the quantized weights with ``match(pattern, module)``; ``key`` names where they sit."""

    patterns: object
    match: Callable[[str, str], bool]
    key: str
    regex: bool = False


class OutputFormat:
    """A convention for storing FP4 weights; subclasses set the names and override what differs."""

    name: str = ""
    swizzled = False  # block scales in the 128x4 layout (engines swizzle at load, so theirs are linear)
    schemes: tuple[str, ...] = tuple(SCHEMES)
    packed_suffix, scale_suffix, global_suffix = ".weight_packed", ".weight_scale", ".weight_global_scale"
    input_suffix = ""  # W4A4: the static activation scale's suffix ("" where the format has none)
    activation_modes: tuple[str, ...] = ()  # --activations it can write besides "none" (the engines' W4A4 conventions)
    transformers_loads = False  # transformers loads its outputs (the plan then says what it cannot load of a model)
    described_by_manifest = False  # only the manifest (fp4convert.json) says what its tensors are (inspect expects one)
    stores_decode_scale = False  # the stored global (and activation) scale is the DECODE scale 1/gs (ModelOpt's)
    config_files: tuple[str, ...] = ()  # files it writes beside config.json (a re-layout does not copy a source's)

    def __init__(self, activations: str = "none") -> None:
        """``activations``: the W4A4 activation quantization this writer's outputs carry ("none": weight-only;
        else one of :attr:`activation_modes`). Part of what the format writes, fixed when it is made."""
        if activations != "none" and activations not in self.activation_modes:
            allowed = " or ".join(self.activation_modes) or "none"
            raise ConfigError(f"--format {self.name} has no {activations} activation convention (it writes "
                              f"--activations {allowed} only)")
        self.activations = activations

    def check(self, scheme: str, rotate: str | None) -> None:
        """Refuse settings this format cannot carry faithfully."""
        if scheme not in self.schemes:
            raise ConfigError(f"--format {self.name} stores {'/'.join(self.schemes)} only, not {scheme}")

    # -- writing: names and shapes ---------------------------------------------------------

    def global_shape(self, lead: tuple[int, ...]) -> tuple[int, ...]:
        return (*lead, 1)

    def encode_scale(self, stored: torch.Tensor) -> torch.Tensor:
        """Back from the stored global tensor to the encode scale gs (reading; inverse of global_float)."""
        import torch

        return stored.to(torch.float32)

    def entries(self, module: str, shape: tuple[int, ...], scheme: str, rotate: str | None = None) -> list[OutEntry]:
        """What a quantized ``[..., M, K]`` weight becomes, known before any data is read."""
        s = get_scheme(scheme)
        *lead, m, k = shape
        lead = tuple(lead)
        nb = s.scale_bytes(k)
        scale_shape = (*lead, *padded_shape(m, nb)) if self.swizzled else (*lead, m, nb)
        out = [
            OutEntry(module + self.packed_suffix, "U8", (*lead, m, k // 2)),
            OutEntry(module + self.scale_suffix, s.scale_dtype, scale_shape),
        ]
        if s.global_scale:
            out.append(OutEntry(module + self.global_suffix, "F32", self.global_shape(lead)))
        if self.activations == "nvfp4":  # W4A4 NVFP4: one static activation scale per matrix, shaped like its global
            out.append(OutEntry(module + self.input_suffix, "F32", self.global_shape(lead)))
        return out

    def global_float(self, gs: float) -> float:
        """The stored global value of one matrix from its encode scale gs, on a Python float (an fp32
        value; one fp32 operation at most, which double arithmetic rounded once to fp32 reproduces)."""
        return gs

    def global_value(self, gs: torch.Tensor) -> torch.Tensor:
        """The stored global tensor of encode scales ``gs`` (``inspect`` compares it with the file), from
        :meth:`global_float`: the one statement of what a format stores."""
        import torch

        flat = [self.global_float(v) for v in gs.to(torch.float32).flatten().tolist()]
        return torch.tensor(flat, dtype=torch.float32).reshape(self.global_shape(tuple(gs.shape)))

    def outputs(self, module: str, packed: memoryview, scale: memoryview, gs: float | None, scheme: str,
                rotate: str | None, input_amax: float | None = None) -> list[tuple[str, bytes | memoryview]]:
        """The bytes of one quantized 2-D matrix, in :meth:`entries` order: what the shards store.
        ``scale``: already in this format's layout (swizzled or linear); ``gs``: the encode scale (NVFP4);
        ``input_amax``: W4A4 NVFP4, the calibrated amax of the matrix's input (its module's, fused members
        already sharing), stored in this format's activation-scale convention. The only method a format
        writes tensors with."""
        out: list[tuple[str, bytes | memoryview]] = [(module + self.packed_suffix, packed),
                                                     (module + self.scale_suffix, scale)]
        if get_scheme(scheme).global_scale:
            out.append((module + self.global_suffix, struct.pack("<f", self.global_float(gs))))
        if self.activations == "nvfp4":
            if input_amax is None:
                raise RuntimeError(f"internal: no activation amax for {module} (calibration did not cover it)")
            out.append((module + self.input_suffix, struct.pack("<f", self.global_float(input_encode_scale(input_amax)))))
        return out

    def tensors(self, module: str, q: QuantizedTensor) -> list[tuple[str, bytes | memoryview]]:
        """:meth:`outputs` of a QuantizedTensor of one matrix (``export`` re-lays out a loaded one): its
        bytes with the block scales in this format's layout."""
        from fp4convert.kernels.tensor import as_bytes

        if self.swizzled and q.scale_layout != "swizzled":
            raise ValueError("internal: this format stores swizzled scales; quantize with scale_layout='swizzled'")
        scale = q.scale if self.swizzled else q.linear_scale()
        gs = None if q.global_scale is None else float(q.global_scale)
        return self.outputs(module, as_bytes(q.packed.cpu()), as_bytes(scale.cpu()), gs, q.scheme, q.rotate)

    card_library = "fp4convert"  # the model card's library_name: what loads this format

    def serving_text(self, repo: str, scheme: str, rotate: str | None, auto: str, activations: dict | None) -> str:
        """The model card's "Serving" section for an output in this format (Markdown): which engines read it
        and how, including what each does with W4A4 activation scales (``activations``: the manifest's
        W4A4 record as fp4convert.output.describe.activations_of gives it, None for weight-only)."""
        return ""

    def part_names(self, module: str) -> tuple[str, ...]:
        """Every tensor name this format gives a part of quantized ``module`` (the activation scale of
        W4A4 included, written or not): a reader of the format takes a tensor of one of these names for
        that part, so a kept tensor of such a name cannot sit beside the quantized module
        (fp4convert.plan.collisions)."""
        return tuple(dict.fromkeys(module + s for s in (self.packed_suffix, self.scale_suffix, self.global_suffix,
                                                        self.input_suffix) if s))

    # -- writing: beside the shards --------------------------------------------------------

    def finalize(self, dst: Path, info: OutputInfo) -> list[str]:
        """Write what the format needs beside the shards; returns the names written."""
        return []

    def config_problems(self, root: Path, config: dict, scheme: Scheme | None, modules: dict[str, QuantizedModule]
                        ) -> tuple[list[str], Excluded | None]:
        """What this format's engine config files in ``root`` (``config``: config.json) say against the tensors
        (``scheme``, ``modules``: what ``inspect`` found), and the modules they keep out of FP4 (None: no such
        list, or the config is too broken to read one). Every value is type-checked before use."""
        return [], None

    def serving_warning(self, rotate: str | None) -> str | None:
        """What a user must know before serving a checkpoint written with these settings (None: nothing).
        The command line prints it in every mode, ``--quiet`` included."""
        return None

    # -- reading ---------------------------------------------------------------------------

    def detect(self, root: Path, config: dict) -> bool:
        """Is this folder (without a manifest) in this format? (Its config.json says so, by default.)"""
        return self.detect_config(config)

    def detect_config(self, config: dict) -> bool:
        """Does config.json (``config``) alone declare an FP4 checkpoint in this format?"""
        return False

    def rotation(self, root: Path, config: dict, manifest: dict | None) -> str | None:
        """The rotation the folder's weights carry: the manifest's, else what config.json records."""
        return manifest.get("rotate") if manifest is not None else self.rotation_of_config(config)

    def rotation_of_config(self, config: dict) -> str | None:
        """The rotation config.json records for this format's weights (None: none)."""
        return None

    def is_swizzled(self, manifest: dict | None) -> bool:
        return self.swizzled

    def find_modules(self, tensors: dict[str, TensorInfo], manifest: dict | None
                     ) -> tuple[dict[str, QuantizedModule], list[str]]:
        """The quantized modules among ``tensors`` and the problems seen while pairing them up."""
        modules: dict[str, QuantizedModule] = {}
        problems: list[str] = []
        swizzled = self.is_swizzled(manifest)
        for name, info in tensors.items():
            if not name.endswith(self.packed_suffix) or info.dtype != "U8":
                continue
            module = name[: -len(self.packed_suffix)]
            scale = tensors.get(module + self.scale_suffix)
            if scale is None:
                problems.append(f"{name}: packed weight without {module + self.scale_suffix}")
                continue
            scheme = next((s.name for s in SCHEMES.values() if s.scale_dtype == scale.dtype), None)
            if scheme is None:
                problems.append(f"{module + self.scale_suffix}: block scales of dtype {scale.dtype} fit no FP4 scheme")
                continue
            modules[module] = QuantizedModule(module, info, scale, tensors.get(module + self.global_suffix),
                                              scheme, swizzled)
        used = {t.name for m in modules.values() for t in m.tensors}
        for name in tensors:
            if name in used:
                continue
            for suffix in (self.scale_suffix, self.global_suffix):
                if name.endswith(suffix) and name[: -len(suffix)] not in modules:
                    problems.append(f"{name}: a scale without its packed weight {name[: -len(suffix)] + self.packed_suffix}")
        return modules, problems

    def load(self, m: QuantizedModule, read: Callable[[TensorInfo], torch.Tensor], rotate: str | None
             ) -> QuantizedTensor:
        """A quantized module's data as a QuantizedTensor (scales in the layout they are stored in)."""
        from fp4convert.kernels.tensor import QuantizedTensor

        gs = None
        if get_scheme(m.scheme).global_scale and m.global_ is not None:
            gs = self.encode_scale(read(m.global_)).reshape(m.packed.shape[:-2])
        return QuantizedTensor(read(m.packed), read(m.scale), gs, m.scheme, rotate,
                               "swizzled" if m.swizzled else "linear")


def read_json(path: Path) -> dict:
    """A JSON object from ``path`` ({} when the file is absent)."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting too: a malformed file is absent
        return {}
    return obj if isinstance(obj, dict) else {}


def write_json(path: Path, obj: dict) -> None:
    """Atomically (a .partial file renamed into place)."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


# The native format marks its config.json with this quant_method (so loaders refuse it) and keeps the
# source's model_type inside its quantization_config; restore_config undoes both.
NATIVE_QUANT_METHOD = "fp4convert"


def restore_config(cfg: dict) -> dict:
    """A native config.json as the source had it: the model type back, the native quantization_config gone."""
    qc = cfg.get("quantization_config")
    if not (isinstance(qc, dict) and qc.get("quant_method") == NATIVE_QUANT_METHOD):
        return cfg
    out = dict(cfg)
    if qc.get("model_type") is not None:
        out["model_type"] = qc["model_type"]
    del out["quantization_config"]
    return out


def update_config(dst: Path, key: str, value: object) -> None:
    """Set one key of DST's config.json (copied from the source earlier), keeping the rest.

    ``export`` copies a native config.json: the source's model type comes back first."""
    path = dst / CONFIG_NAME
    cfg = restore_config(read_json(path))
    cfg[key] = value
    write_json(path, cfg)


# -- W4A4: activation quantization the engines apply (docs/formats.md "W4A4") -------------------

CONSTANT_AMAX = 2688.0  # ModelOpt's constant_amax recipe: 6 * 448, i.e. input_scale 1.0 (no calibration)


def f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a Python float)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def input_encode_scale(amax: float) -> float:
    """The activation ENCODE scale 448 * 6 / amax, as fp32 division gives it (one correctly rounded
    fp32 operation on fp32 operands, which double arithmetic rounded once to fp32 reproduces)."""
    a = f32(amax)
    if not (a > 0 and a != float("inf")):
        raise ValueError(f"activation amax {amax!r} is not finite and positive")
    return f32(CONSTANT_AMAX / a)
