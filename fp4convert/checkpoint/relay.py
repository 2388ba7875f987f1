"""What a re-layout reads and writes per module (:mod:`fp4convert.checkpoint.export` plans it): the run loop's
work, the values each target stores, and the records the manifest and the card keep of the source.

Per quantized module: the packed codes are copied; the block scales are copied in the target's layout (the
128x4 swizzle applied or undone: exact); the global scale is written in the target's convention from the ENCODE
scale gs, which is the recorded one where our manifest has it, the stored one where the source stores gs
(native, compressed-tensors), and the fp32 reciprocal of ModelOpt's stored decode scale otherwise (what
compressed-tensors' own ModelOpt converter computes; 1 ulp from the original gs for about 15% of matrices,
docs/formats.md "ModelOpt"). W4A4 activation scales the same way, from the recorded calibration amax when
there is one. Every other tensor is copied unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.checkpoint.layout import CheckpointLayout, load_quantized, manifest_disagreements
from fp4convert.errors import CheckpointFormatError
from fp4convert.formats import get_format
from fp4convert.formats.base import OutputFormat, QuantizedModule, f32, input_encode_scale
from fp4convert.output.manifest import MANIFEST_NAME
from fp4convert.plan.types import QUANTIZE, Decision
from fp4convert.run.work import WriteJob
from fp4convert.storage import checksum
from fp4convert.storage.reads import open_regular, read_tensor

if TYPE_CHECKING:
    from fp4convert.kernels.tensor import QuantizedTensor
    from fp4convert.output.shards import ShardSet
    from fp4convert.plan.sources import FP4Source
    from fp4convert.source.source import Source


# ---------------------------------------------------------------------------------------------
# What the source carries, for the plan, the manifest and the card
# ---------------------------------------------------------------------------------------------

def activations_held(source: Source, layout: CheckpointLayout) -> str:
    """The W4A4 activation scheme an FP4 checkpoint carries ("none": weight-only): our manifest's record, else
    stored activation scales (NVFP4), else compressed-tensors' declared ``input_activations`` (4-bit float:
    ``tensor_group`` NVFP4 with stored scales, ``group`` MXFP4, dynamic)."""
    if layout.manifest is not None:
        acts = (layout.manifest.get("activations") or {}).get("scheme")
        return acts if isinstance(acts, str) else "none"
    suffix = get_format(layout.format).input_suffix
    if suffix and any(m + suffix in layout.tensors for m in layout.modules):
        return "nvfp4"
    qc = source.config().get("quantization_config")
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    for g in (groups.values() if isinstance(groups, dict) else ()):
        a = g.get("input_activations") if isinstance(g, dict) else None
        if isinstance(a, dict) and a.get("num_bits") == 4 and a.get("type") == "float":
            return {"tensor_group": "nvfp4", "group": "mxfp4"}.get(str(a.get("strategy")), "none")
    return "none"


def carried_calibration(layout: CheckpointLayout, fmt: OutputFormat) -> dict | None:
    """The W4A4 record the re-laid output's manifest keeps: our source's calibration, or (another tool's
    checkpoint) that the scales were stored in the source, how they were had not being recorded."""
    if fmt.activations != "nvfp4":
        return None
    cal = ((layout.manifest or {}).get("activations") or {}).get("calibration")
    return cal if isinstance(cal, dict) else {"method": "stored"}


def relay_method(layout: CheckpointLayout, origin: FP4Source) -> dict | None:
    """The manifest's ``method`` record of a re-layout (the card's "weight scales" row says it). Our own output
    keeps its own record: its bytes are those of a direct conversion, made the way that record says (data-free:
    none). Another tool's checkpoint: re-laid without re-quantizing, how it was quantized not recorded."""
    if layout.manifest is not None:
        rec = layout.manifest.get("method")
        return rec if isinstance(rec, dict) else None
    return {"method": "relayout", "source": origin.describe(),
            "description": f"re-laid from {origin.describe()} without re-quantizing (E2M1 codes and scales copied "
                           "bit for bit; how the source was quantized is not recorded)"}


# ---------------------------------------------------------------------------------------------
# The values a target stores
# ---------------------------------------------------------------------------------------------

def encode_of(stored: float, source_format: OutputFormat) -> float:
    """The encode scale a source's stored global (or activation) scale stands for: itself, or the fp32
    reciprocal of a stored decode scale (one fp32 division, which double arithmetic rounded once reproduces)."""
    return f32(1.0 / stored) if source_format.stores_decode_scale else stored


def relaid_tensors(fmt: OutputFormat, module: str, q: QuantizedTensor, gs: float | None,
                   input_encode: float | None) -> list[tuple[str, bytes | memoryview]]:
    """One matrix's tensors in format ``fmt``: its codes, its block scales in ``fmt``'s layout, its encode scale
    ``gs`` and (W4A4 NVFP4) its activation encode scale, each as ``fmt`` stores it."""
    from fp4convert.kernels.tensor import as_bytes
    from fp4convert.numerics.swizzle import swizzle_scales

    scale = q.scale if (q.scale_layout == "swizzled") == fmt.swizzled else \
        swizzle_scales(q.linear_scale()) if fmt.swizzled else q.linear_scale()
    weights = get_format(fmt.name)  # the weight-only writer: the activation scale is written below, as stored
    out = weights.outputs(module, as_bytes(q.packed.cpu()), as_bytes(scale.cpu()), gs, q.scheme, q.rotate)
    if fmt.activations == "nvfp4":
        if input_encode is None:
            raise CheckpointFormatError(f"{module}: a W4A4 layer without an activation scale in the source")
        out.append((module + fmt.input_suffix, struct.pack("<f", fmt.global_float(input_encode))))
    return out


def _recorded(rec: dict | None, module: str, key: str) -> float | None:
    """A module's recorded value in its tensor's manifest record (one matrix: the record's; several: per matrix)."""
    if not rec:
        return None
    per = rec.get("matrices")
    v = per.get(module, {}).get(key) if isinstance(per, dict) else rec.get(key)
    return float(v) if isinstance(v, (int, float)) else None


# ---------------------------------------------------------------------------------------------
# The run loop's work
# ---------------------------------------------------------------------------------------------

@dataclass
class RelayUnit(WriteJob):
    """One unit of a re-layout: its modules read from the source and written in the target format."""

    unit: list[Decision]
    records: dict[str, dict]


class RelayWork:
    """The run loop's work for a re-layout (:class:`fp4convert.run.work.Work`): each quantized module read
    from the source and written in the target format, every other tensor copied unchanged."""

    read_wait_s = 0.0

    def __init__(self, source: Source, layout: CheckpointLayout, fmt: OutputFormat,
                 load: Callable[[Source, CheckpointLayout, QuantizedModule], QuantizedTensor] = load_quantized) -> None:
        self.source, self.layout, self.fmt, self.load = source, layout, fmt, load
        self.src_fmt = get_format(layout.format)
        self.manifest = layout.manifest
        cal = ((self.manifest or {}).get("activations") or {}).get("calibration")
        self.amax = cal.get("amax") if isinstance(cal, dict) else None  # recorded per module (or one constant)

    def start(self, pending: list[list[Decision]]) -> None:
        if self.manifest is None:  # decisions read this checkpoint's tensors: a Hub source fetches them ahead
            self.source.prefetch(pending)

    def unit(self, unit: list[Decision]) -> tuple[dict[str, dict], list[WriteJob]]:
        records: dict[str, dict] = {}
        for d in unit:
            rec = (self.manifest or {}).get("tensors", {}).get(d.name) if self.manifest else None
            records[d.name] = ({k: rec[k] for k in ("global_scale", "amax", "matrices") if k in rec}
                               if d.action == QUANTIZE and rec else {})
        return records, [RelayUnit(unit, records)]

    def write(self, job: WriteJob, shards: ShardSet) -> None:
        assert isinstance(job, RelayUnit)
        for d in job.unit:
            if d.action != QUANTIZE:
                info = self.layout.tensors[d.name]
                shards.copy_kept(d.name, self.source.local_path(info.file), info)
                continue
            rec = (self.manifest or {}).get("tensors", {}).get(d.name)
            for mx in d.matrices:
                m = self.layout.modules[mx.module]
                q = self.load(self.source, self.layout, m)
                gs = self._global(m, q, rec)
                if gs is not None and self.manifest is None:
                    job.records[d.name]["global_scale"] = gs  # (one matrix per foreign decision)
                for name, data in relaid_tensors(self.fmt, mx.module, q, gs, self._input_encode(m, rec)):
                    shards.write(name, data)

    def _global(self, m: QuantizedModule, q: QuantizedTensor, rec: dict | None) -> float | None:
        if q.global_scale is None:
            return None
        recorded = _recorded(rec, m.module, "global_scale")
        if recorded is not None or m.global_ is None:
            return recorded
        stored = read_tensor(self.source.local_path(m.global_.file), m.global_)
        return encode_of(float(stored.reshape(-1)[0]), self.src_fmt)

    def _input_encode(self, m: QuantizedModule, rec: dict | None) -> float | None:
        """The module's activation encode scale: from the recorded calibration amax, else the stored scale."""
        if self.fmt.activations != "nvfp4":
            return None
        amax = self.amax.get(m.module) if isinstance(self.amax, dict) else self.amax
        if isinstance(amax, (int, float)) and not isinstance(amax, bool):
            return input_encode_scale(float(amax))
        t = self.layout.tensors.get(m.module + self.src_fmt.input_suffix) if self.src_fmt.input_suffix else None
        if t is None:
            return None
        return encode_of(float(read_tensor(self.source.local_path(t.file), t).reshape(-1)[0]), self.src_fmt)

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        from fp4convert.quantizer.matrices import nonfinite_bytes

        return nonfinite_bytes(dtype, data)

    def thread_init(self) -> None:
        pass

    def close(self) -> None:
        self.source.stop_prefetch()


# ---------------------------------------------------------------------------------------------
# Our own source: its files and recorded scales checked before anything is written
# ---------------------------------------------------------------------------------------------

def check_global_scales(source: Source, manifest: dict, layout: CheckpointLayout) -> None:
    """The recorded global scales are what the re-layout writes: they must be the stored ones. Read from the
    shards, so only after :func:`verify_files` (a corrupted shard is named as corrupted, not as a manifest that
    disagrees with it)."""
    stored = {m.module: read_tensor(source.local_path(m.global_.file), m.global_).flatten()
              for m in layout.modules.values() if m.global_ is not None and m.global_.dtype == "F32"}
    problems = manifest_disagreements(manifest, layout, stored)
    if problems:
        raise CheckpointFormatError(f"{source.root / MANIFEST_NAME}: {problems[0]}; the checkpoint does not match "
                                    "its manifest: re-create it with fp4convert quantize")


def verify_files(root: Path, manifest: dict, weight_files: list[str], progress=None) -> None:
    """Every weight file is listed in our manifest, and every file it lists has its recorded size and sha256,
    before anything is written: a corrupted checkpoint must not be re-laid with fresh checksums for its bad bytes."""
    import os

    unlisted = [f for f in weight_files if f not in manifest["files"]]
    if unlisted:
        raise CheckpointFormatError(f"{root / unlisted[0]}: not listed in {MANIFEST_NAME}'s files; the manifest does "
                                    "not match the checkpoint: re-create it with fp4convert quantize")
    top = os.path.realpath(root)
    for rel, rec in sorted(manifest["files"].items()):
        path = root / rel  # relative and without '..' (the manifest schema checked it)
        real = os.path.realpath(path)
        if os.path.lexists(path) and not real.startswith(top.rstrip(os.sep) + os.sep):
            raise CheckpointFormatError(f"{path}: resolves to {real}, outside {root}; not read")
        try:
            fd = open_regular(path)  # never a FIFO or device: they would hang the read
        except FileNotFoundError:
            raise CheckpointFormatError(f"{path}: listed in {MANIFEST_NAME} but missing; the checkpoint is "
                                        "incomplete: re-create it with fp4convert quantize") from None
        except OSError as exc:
            raise CheckpointFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        with open(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != rec["size"]:
                raise CheckpointFormatError(f"{path}: {size} bytes, the manifest records {rec['size']}; the "
                                            "checkpoint is corrupted: re-create it with fp4convert quantize")
            if not checksum.matches(f, rec, progress):
                raise CheckpointFormatError(f"{path}: sha256 differs from the manifest; the checkpoint is "
                                            "corrupted: re-create it with fp4convert quantize")
