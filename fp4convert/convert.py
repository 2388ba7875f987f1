"""The converter: source -> plan -> quantize -> write -> manifest, one work unit at a time.

A work unit is one tensor or one fused group. Its tensors are read with plain file reads (the next
unit's in a background thread, see :mod:`fp4convert.readahead`), quantized (pass 1: amax of every
member, pass 2: block quantization with the group's global scale) and streamed into output shards
whose headers the plan fixed in advance, so host memory holds at most two units whatever the model
or shard size. Files are written under ``.partial`` names and renamed
when complete; the manifest is written last and marks a finished conversion.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .config import ConvertConfig
from .errors import ConfigError, CUDAUnavailableError, FP4ConvertError, NonFiniteError, PlanError, QuantizationError
from .formats import detect, get_format
from .formats.base import OutputFormat
from .manifest import MANIFEST_NAME, load_manifest
from .plan import QUANTIZE, Decision, Matrix, Plan, make_plan
from .readahead import ReadAhead
from .scheme import get_scheme
from .source import Source, open_source
from .tensor import QuantizedTensor, dequantize_input, quantize
from .tensor import amax as tensor_amax
from .writer import ConvertResult, Progress, ShardWriters, finish, prepare_destination, run_identity, write_outputs

log = logging.getLogger(__name__)

__all__ = ["ConvertResult", "convert", "plan_conversion", "resolve_device"]


def resolve_device(device: str) -> torch.device:
    """'auto' is the first GPU whose kernels load, else the CPU (with one warning); 'cuda' must work."""
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        dev = torch.device("cuda")
        try:
            from .cuda import ops

            ops.ensure_loaded(dev)
        except CUDAUnavailableError as exc:
            log.warning("CUDA kernels unavailable (%s); converting on the CPU (same bytes, slower)",
                        str(exc).splitlines()[0])
            return torch.device("cpu")
        return dev
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {device!r} is not a device; use auto, cpu or cuda[:N]") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: only cpu and cuda are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CUDAUnavailableError(f"--device {device}: no CUDA GPU is visible here; use --device cpu")
    return dev


def plan_conversion(src: str | Source, config: ConvertConfig) -> tuple[Source, Plan, OutputFormat]:
    """Open the source and plan it from headers alone (what ``--dry-run`` shows)."""
    source = src if isinstance(src, Source) else open_source(src, config.revision)
    manifest = load_manifest(source.root)
    found = detect(source.root, source.config(), manifest)
    if manifest is not None or found is not None:
        marker = MANIFEST_NAME if manifest is not None else f"{found.name} files"
        raise PlanError(f"the source is already quantized (it has {marker}); fp4convert needs a bf16/fp16/fp32 checkpoint")
    fmt = get_format(config.format)
    plan = make_plan(source.tensors(), config, fmt, source.config())
    return source, plan, fmt


def convert(
    src: str | Source,
    dst: str | Path,
    config: ConvertConfig = ConvertConfig(),
    progress: Progress | None = None,
    *,
    plan: tuple[Source, Plan, OutputFormat] | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` (folder or Hub repo id) into ``dst``.

    ``plan``: the result of :func:`plan_conversion` when the caller already planned (the CLI prints
    the plan's warnings first), so the source is planned once.
    """
    t0 = time.perf_counter()
    dst = Path(dst)
    source, plan_, fmt = plan if plan is not None else plan_conversion(src, config)
    device = resolve_device(config.device)
    identity = run_identity(config, source)
    done = prepare_destination(dst, plan_, config, identity, source)

    reader: ReadAhead | None = None

    def start(pending: list[list[Decision]]) -> None:
        nonlocal reader
        units = [[t for d in u for t in d.reads] for u in pending if u[0].action == QUANTIZE or u[0].decode]
        reader = ReadAhead(units, source.local_path, pinned=device.type == "cuda")

    def process(unit: list[Decision], writers: ShardWriters) -> dict[str, dict]:
        d = unit[0]
        if d.action != QUANTIZE and d.decode is None:
            writers.raw(d.name, source.local_path(d.info.file), d.info)
            return {d.name: {}}
        hosts = reader.next()
        try:
            on_device = iter([h.to(device, non_blocking=True) for h in hosts])
            xs = [weight_of(d, [next(on_device) for _ in d.reads]) for d in unit]
            if d.action != QUANTIZE:  # a kept quantized input: written as the fp32 weight it encodes
                writers.tensor(d.name, xs[0].contiguous())
                return {d.name: {}}
            return _quantize_unit(unit, xs, config, fmt, writers)
        finally:
            reader.release()  # outputs are on the host now: every copy from these buffers is done

    try:
        write_outputs(plan_, dst, identity, done, progress or (lambda n: None), process, start)
    finally:
        if reader is not None:
            reader.close()
    finish(source, plan_, fmt, dst, identity)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reused = sorted(f for f in done if f in dict(plan_.shards))
    wait = reader.wait_s if reader is not None else 0.0
    return ConvertResult(dst, plan_, time.perf_counter() - t0, peak, reused, wait)


def weight_of(d: Decision, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The weight a decision works on: the tensor itself, or the fp32 weight a quantized input encodes."""
    if d.decode is None:
        return tensors[0]
    try:
        w = dequantize_input(d.decode.kind, tensors, block=d.decode.block)
    except FP4ConvertError as exc:
        raise type(exc)(f"{d.name} (in {d.info.file}): {exc}") from exc
    return w.transpose(-1, -2) if d.decode.transpose else w


def _batches(d: Decision, x: torch.Tensor) -> list[tuple[list[Matrix], torch.Tensor]]:
    """A decision's matrices as batches ``[B, N, K]`` (all experts of one gate/up/down part in one batch)."""
    if len(d.matrices) == 1 and d.matrices[0].expert is None:
        return [(list(d.matrices), x.unsqueeze(0))]
    parts: dict[tuple, list[Matrix]] = {}
    for m in d.matrices:
        parts.setdefault((m.rows, m.transpose), []).append(m)
    out = []
    for (rows, transpose), ms in parts.items():
        v = x.transpose(-1, -2) if transpose else x
        experts = [m.expert for m in ms]
        v = v if experts == list(range(v.shape[0])) else v[experts]
        if rows is not None:
            v = v[:, rows[0]:rows[1]:rows[2]]
        out.append((ms, v))
    return out


def _quantize_unit(unit: list[Decision], xs: list[torch.Tensor], config: ConvertConfig, fmt: OutputFormat,
                   writers: ShardWriters) -> dict[str, dict]:
    """Pass 1 (amax of every matrix, max per shared-scale group), then pass 2 (quantize, batched per part)."""
    scheme = get_scheme(config.scheme)
    batches = [(d, ms, t) for d, x in zip(unit, xs) for ms, t in _batches(d, x)]
    group_amax: list[torch.Tensor | None] = [None] * len(batches)
    amax_of: dict[str, float] = {}
    if scheme.global_scale:
        amaxes = [tensor_amax(t, rotate=config.rotate) for _, _, t in batches]
        for (d, _, _), a in zip(batches, amaxes):
            if not bool(torch.isfinite(a).all()):
                raise NonFiniteError(f"{d.name} (in {d.info.file}) holds NaN or Inf; fix the source or --ignore it")
        groups: dict[str, torch.Tensor] = {}
        for (d, ms, _), a in zip(batches, amaxes):
            for m, v in zip(ms, a):
                g = m.group or d.group
                if g:
                    groups[g] = torch.maximum(groups[g], v) if g in groups else v
        for i, ((d, ms, _), a) in enumerate(zip(batches, amaxes)):
            picks = [groups[m.group or d.group] if (m.group or d.group) else v for m, v in zip(ms, a)]
            group_amax[i] = torch.stack(picks)
    results: dict[str, QuantizedTensor] = {}
    for (d, ms, t), ga in zip(batches, group_amax):
        try:
            q = quantize(t, config.scheme, rotate=config.rotate, global_amax=ga, scale_rule=config.rule,
                         scale_layout="swizzled" if fmt.swizzled else "linear")
        except QuantizationError as exc:
            raise type(exc)(f"{d.name} (in {d.info.file}): {exc}") from exc
        if ga is not None:
            amax_of.update(zip((m.module for m in ms), ga.tolist()))
        for i, m in enumerate(ms):
            results[m.module] = q.matrix(i)
    records: dict[str, dict] = {}
    for d in unit:
        per: dict[str, dict] = {}
        for m in d.matrices:
            q = results[m.module]
            for name, tensor in fmt.tensors(m.module, q):
                writers.tensor(name, tensor)
            if q.global_scale is not None:
                per[m.module] = {"global_scale": float(q.global_scale), "amax": amax_of[m.module]}
        records[d.name] = next(iter(per.values())) if len(d.matrices) == 1 and per else (
            {"matrices": per} if per else {})
    return records
