"""Re-lay an FP4 checkpoint into another format: no source weights, no requantization (docs/formats.md "Sources").

Sources: fp4convert's own outputs in any format (their manifest records every source tensor, the global scales
and the W4A4 calibration) and FP4 checkpoints other tools wrote, compressed-tensors ``nvfp4/mxfp4-pack-quantized``
and ModelOpt NVFP4 (read from their headers and config files). The packed nibbles are copied, block scales
swizzled or unswizzled (exact) and tensors renamed; each global scale and W4A4 activation scale becomes what the
target stores (the encode scale, or ModelOpt's decode scale 1/gs), from the manifest's records where there is one.
The bytes equal a direct ``quantize --format TARGET`` of the same source weights.

``fp4convert export`` re-lays with the source's own settings; ``fp4convert quantize`` on an FP4 source re-lays
when its settings describe what the source holds (:func:`fp4convert.plan.sources.relayout_problems`), and says
why not otherwise. What is read and written per module: :mod:`fp4convert.checkpoint.relay`.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from fp4convert.checkpoint.layout import (
    CheckpointLayout,
    load_quantized,
    manifest_disagreements,
    module_shape_problems,
    read_layout,
)
from fp4convert.checkpoint.relay import (
    RelayWork,
    activations_held,
    carried_calibration,
    check_global_scales,
    relay_method,
    verify_files,
)
from fp4convert.config import ConvertConfig
from fp4convert.errors import CheckpointFormatError, ConfigError, PlanError
from fp4convert.formats import get_format
from fp4convert.formats.base import Decode, OutputFormat, QuantizedModule
from fp4convert.output.manifest import MANIFEST_NAME, manifest_problem
from fp4convert.output.record import run_identity
from fp4convert.plan.collisions import check_part_names
from fp4convert.plan.knowledge import fused_group
from fp4convert.plan.planner import Plan, check_collisions, layout_shards
from fp4convert.plan.sources import FP4Source, relayout_problems, relayout_refusal
from fp4convert.plan.types import KEEP, QUANTIZE, Decision, Matrix
from fp4convert.run.distributed import World
from fp4convert.run.progress import progress_bar
from fp4convert.run.runner import ConvertResult, Job, run
from fp4convert.source.open import open_source
from fp4convert.source.source import Source
from fp4convert.storage.safetensors import DTYPE_BITS, OutEntry, TensorInfo, dtype_nbytes


@dataclass
class RelayPlan(Plan):
    """A re-layout's plan: the decisions, plus the plain module names the source's own exclusion list gives
    (a tied ``lm_head``, modules as transformers builds them), so the target's list names what the source's did."""

    excluded: tuple[str, ...] = field(default=())

    def kept_modules(self, model_config: dict | None = None) -> tuple[str, ...]:
        return tuple(sorted({*super().kept_modules(model_config), *self.excluded}))


class Relayout(NamedTuple):
    """A planned re-layout: indexed like :func:`fp4convert.run.convert.plan_conversion`'s (source, plan, format)."""

    source: Source
    plan: RelayPlan
    fmt: OutputFormat
    layout: CheckpointLayout
    origin: FP4Source


def fp4_source(source: Source, layout: CheckpointLayout) -> FP4Source:
    """What an FP4 checkpoint holds: its format, scheme, rotation, W4A4 activations and (ours) scale rule."""
    manifest = layout.manifest or {}
    rule = manifest.get("scale_rule") if isinstance(manifest.get("scale_rule"), str) else None
    kept = ((manifest.get("settings") or {}) if isinstance(manifest.get("settings"), dict) else {}).get("kept_dtype")
    return FP4Source(layout.format, layout.scheme, layout.rotate, activations_held(source, layout), rule,
                     kept if kept in ("source", "bf16") else "source")


def plan_relayout(source: Source, config: ConvertConfig, *, keep_settings: bool = False) -> Relayout | None:
    """The re-layout of FP4 source ``source`` into ``config.format`` (None: the source holds no FP4 weights).

    ``keep_settings`` (``export``): the output takes the source's scheme, rotation, activations and (ours)
    scale rule and kept dtype; otherwise ``config`` must describe what the source holds. Refused, before anything
    is written: a source already in the target format, settings the bytes cannot give (PlanError, exit 2), a
    checkpoint that does not match its manifest (CheckpointFormatError, exit 4)."""
    from fp4convert.formats import detect
    from fp4convert.output.manifest import load_manifest

    try:  # (a plain source is told by its config files and manifest alone: its headers are not read here)
        if detect(source.root, source.config(), load_manifest(source.root, source.roots)) is None:
            return None
    except (AttributeError, TypeError):  # a value of the wrong type in an engine config: the planner reports it
        return None
    layout = read_layout(source)
    if not layout.quantized or not layout.modules:  # (config files of a format beside no FP4 tensor: the
        return None  # conversion's own gate refuses the folder, fp4convert.plan.sources.check_source)
    src = fp4_source(source, layout)
    if config.format == layout.format:
        raise PlanError(f"the source is already quantized ({src.describe()}), in the --format asked for: use it as it "
                        "is, choose another --format to re-lay it, or pass --requantize to quantize it again")
    manifest = layout.manifest
    if manifest is not None:
        problem = manifest_problem(manifest)
        if problem:
            raise CheckpointFormatError(f"{source.root / MANIFEST_NAME}: {problem}; re-create the checkpoint with "
                                        "fp4convert quantize")
    config = _settings(config, src, keep_settings)
    target = get_format(config.format)
    problems = relayout_problems(src, config, target.activation_modes, target.schemes)
    if problems:
        raise relayout_refusal(src, problems)
    fmt = get_format(config.format, src.activations)
    fmt.check(config.scheme, config.rotate)
    config = _recorded_settings(config, src, manifest)
    if manifest is not None:
        _check_consistent(source, manifest, layout)
        decisions, groups = _decisions_from_manifest(manifest, layout, fmt, config)
    else:
        _check_readable(layout, src)
        decisions, groups = _decisions_from_headers(layout, fmt, config, src)
    check_collisions(decisions)
    check_part_names(decisions, fmt)
    plan = RelayPlan(decisions, groups, layout_shards(decisions, config.max_shard_size), config,
                     excluded=_excluded(source, layout))
    return Relayout(source, plan, fmt, layout, src)


def _settings(config: ConvertConfig, src: FP4Source, keep_settings: bool) -> ConvertConfig:
    """The re-layout's settings: ``config`` as given, or (``export``) with the source's own."""
    if not keep_settings:
        return config
    try:
        return replace(config, scheme=src.scheme or config.scheme, rotate=src.rotate, scale_rule=src.scale_rule,
                       kept_dtype=src.kept_dtype)
    except ConfigError as exc:  # the recorded settings, not the user's options, are wrong
        raise CheckpointFormatError(f"{MANIFEST_NAME}: the recorded settings are invalid ({exc}); re-create the "
                                    "checkpoint with fp4convert quantize") from None


def _recorded_settings(config: ConvertConfig, src: FP4Source, manifest: dict | None) -> ConvertConfig:
    """The settings the output's manifest and card record: what the source holds (its activations; ours: its
    scale rule and how its activation scales were had), no measurement of this run's own."""
    settings = (manifest or {}).get("settings") or {}
    scale = settings.get("activation_scale") if settings.get("activation_scale") in ("calibrate", "constant") else None
    return replace(config, activations=src.activations, scale_rule=config.scale_rule or src.scale_rule,
                   input_weights="none", activation_scale=scale or config.activation_scale)


def _check_readable(layout: CheckpointLayout, src: FP4Source) -> None:
    """A foreign checkpoint whose modules do not pair up, or whose scales do not fit them, is refused (exit 4)
    naming the first problem; so is a W4A4 one with a layer lacking its activation scale."""
    problems = [*layout.problems, *(p for m in layout.modules.values() for p in module_shape_problems(m))]
    if src.scheme is None:
        problems.append("no quantized module found")
    problems += [f"{m.packed.name}: a stacked {list(m.shape)} FP4 tensor (fp4convert re-lays 2-D matrices)"
                 for m in layout.modules.values() if len(m.packed.shape) != 2][:1]
    suffix = get_format(layout.format).input_suffix
    if src.activations == "nvfp4" and suffix:
        problems += [f"{m}: a W4A4 layer without its activation scale {m + suffix} (engines would run it "
                     "uninitialised; --requantize calibrates again)" for m in layout.modules if m + suffix not in
                     layout.tensors][:1]
    if problems:
        raise CheckpointFormatError(f"{layout.format} checkpoint: {problems[0]}; run fp4convert inspect on it")


def _check_consistent(source: Source, manifest: dict, layout: CheckpointLayout) -> None:
    """Our manifest and the shards must tell one story before anything is planned from it: the layout read
    cleanly, every module's scales fit its packed weight, every record agrees with the shards and a quantized
    record's outputs are exactly its modules' tensors. Refused (exit 4) naming the first disagreement."""
    where = source.root / MANIFEST_NAME

    def refuse(why: str) -> None:
        raise CheckpointFormatError(f"{where}: {why}; the checkpoint does not match its manifest: re-create it "
                                    "with fp4convert quantize")

    problems = [*layout.problems, *(p for m in layout.modules.values() for p in module_shape_problems(m))]
    if not problems:
        problems = manifest_disagreements(manifest, layout)
    if problems:
        refuse(problems[0])
    acts = (manifest.get("activations") or {}).get("scheme") or "none"
    own = get_format(manifest["format"], acts if acts in get_format(manifest["format"]).activation_modes else "none")
    owner = {t.name: m for m in layout.modules.values() for t in m.tensors}
    position = {o: i for i, o in enumerate(layout.tensors)}
    for name, rec in manifest["tensors"].items():
        if rec["dtype"] not in DTYPE_BITS:
            refuse(f"tensor {name!r} has unknown dtype {rec['dtype']!r}")
        if rec["action"] != QUANTIZE:
            continue
        mods = _modules_of(rec, owner, position)
        want = {e.name: (e.dtype, list(e.shape)) for m in mods
                for e in own.entries(m.module, m.shape, manifest["scheme"], manifest.get("rotate"))}
        got = {o: (r["dtype"], r["shape"]) for o, r in rec["outputs"].items()}
        if want != got:
            diff = sorted(set(want) ^ set(got)) or sorted(k for k in want if want[k] != got[k])
            refuse(f"quantized tensor {name!r} lists outputs that are not its modules' tensors (e.g. {diff[0]})")


def _modules_of(rec: dict, owner: dict, position: dict[str, int]) -> list[QuantizedModule]:
    """The quantized modules holding a record's outputs, in the order the shards hold them."""
    mods: dict = {}
    for o in sorted((o for o in rec["outputs"] if o in owner), key=position.__getitem__):
        mods.setdefault(owner[o].module, owner[o])
    return list(mods.values())


def _module_decode(m: QuantizedModule, layout: CheckpointLayout, scheme: str) -> Decode:
    """What a module's re-layout reads: its tensors and, when it has them, its activation scale and Had16
    transform (the target writes its own), as the decode of the same module would (``--requantize``)."""
    src = get_format(layout.format)
    names = [m.module + src.input_suffix] if src.input_suffix else []
    if layout.rotate:
        names.append(f"{m.module}.{layout.rotate}_input.weight")  # compressed-tensors' online transform
    inputs = (*m.tensors, *(layout.tensors[n] for n in names if n in layout.tensors))
    return Decode(scheme, inputs, layout=layout.format, swizzled=m.swizzled, decode_global=src.stores_decode_scale)


def _decisions_from_manifest(manifest: dict, layout: CheckpointLayout, fmt: OutputFormat, config: ConvertConfig
                             ) -> tuple[list[Decision], dict[str, list[str]]]:
    """Our own output: its manifest's records replayed in the order the shards hold their outputs (the
    original processing order, so the bytes equal a direct conversion's), each module re-laid."""
    position = {name: i for i, name in enumerate(layout.tensors)}
    owner = {t.name: m for m in layout.modules.values() for t in m.tensors}
    origin = fp4_reason(layout)
    decisions = []
    for name, rec in sorted(manifest["tensors"].items(), key=lambda it: min(position[o] for o in it[1]["outputs"])):
        shape = tuple(rec["shape"])
        info = TensorInfo(name, rec["dtype"], shape, rec["source_file"], 0, dtype_nbytes(rec["dtype"], shape))
        if rec["action"] == QUANTIZE:
            modules = _modules_of(rec, owner, position)
            outputs = tuple(e for m in modules for e in fmt.entries(m.module, m.shape, config.scheme, config.rotate))
            matrices = tuple(Matrix(m.module, tuple(m.shape)) for m in modules)  # type: ignore[arg-type]
            decisions.append(Decision(name, QUANTIZE, f"{rec['reason']}; {origin}", info, rec.get("group"), outputs,
                                      matrices))
        else:  # its dtype as stored (the source's, or BF16 for an F32/F64 one with --kept-dtype bf16)
            outputs = (OutEntry(name, rec["outputs"][name]["dtype"], shape),)
            decisions.append(Decision(name, rec["action"], rec["reason"], info, rec.get("group"), outputs))
    return decisions, dict(manifest.get("groups") or {})


def fp4_reason(layout: CheckpointLayout) -> str:
    """What every re-laid weight's reason says."""
    return (f"re-laid from {(layout.scheme or 'fp4').upper()} in the {layout.format} layout without re-quantizing "
            "(E2M1 codes, block scales, global and activation scales copied bit for bit)")


def _decisions_from_headers(layout: CheckpointLayout, fmt: OutputFormat, config: ConvertConfig, src: FP4Source
                            ) -> tuple[list[Decision], dict[str, list[str]]]:
    """A foreign checkpoint: one decision per quantized module (``X.weight``, its exact weight's name) and per
    other tensor, in the order the files hold them; a module's activation scale and transform are its own."""
    position = {name: i for i, name in enumerate(layout.tensors)}
    reason = fp4_reason(layout)
    decisions: list[tuple[int, Decision]] = []
    consumed: set[str] = set()
    ids = {m: fused_group(m + ".weight") for m in layout.modules}
    members: dict[str, list[str]] = {}
    for mod, g in ids.items():
        if g:
            members.setdefault(g, []).append(mod + ".weight")
    groups = {g: names for g, names in members.items() if len(names) > 1}
    for module, m in layout.modules.items():
        decode = _module_decode(m, layout, src.scheme or config.scheme)
        consumed.update(t.name for t in decode.inputs)
        name = module + ".weight"
        info = TensorInfo(name, "F32", m.shape, m.packed.file, m.packed.begin, m.packed.end)
        g = ids[module] if ids[module] in groups else None
        outputs = tuple(fmt.entries(module, m.shape, config.scheme, config.rotate))
        matrix = Matrix(module, (m.shape[-2], m.shape[-1]))  # 2-D (a stacked FP4 tensor is refused before)
        d = Decision(name, QUANTIZE, reason, info, g, outputs, (matrix,), decode)
        decisions.append((min(position[t.name] for t in m.tensors), d))
    for name, t in layout.tensors.items():
        if name not in consumed:
            decisions.append((position[name], Decision(name, KEEP, "kept in the source (copied as it is)", t, None,
                                                       (OutEntry(name, t.dtype, t.shape),))))
    return [d for _, d in sorted(decisions, key=lambda x: x[0])], groups


def _excluded(source: Source, layout: CheckpointLayout) -> tuple[str, ...]:
    """The plain module names (no pattern) in the source's own exclusion list that name no quantized module."""
    from fp4convert.numerics.scheme import get_scheme

    src = get_format(layout.format)
    scheme = get_scheme(layout.scheme) if layout.scheme else None
    try:
        _, excluded = src.config_problems(source.root, source.config(), scheme, layout.modules)
    except (AttributeError, TypeError):
        return ()
    patterns = excluded.patterns if excluded is not None and isinstance(excluded.patterns, list) else []
    return tuple(sorted({p for p in patterns if isinstance(p, str) and not p.startswith("re:")
                         and not any(c in p for c in "*?[") and p not in layout.modules}))


# ---------------------------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------------------------

def export(src: str, dst: str | Path, config: ConvertConfig, progress: bool = False) -> ConvertResult:
    """Re-lay FP4 checkpoint ``src`` (ours in any format, compressed-tensors' or ModelOpt's) as ``config.format``
    into ``dst``, with the source's own settings (``fp4convert export``).

    ``progress``: show progress (:mod:`fp4convert.run.progress`) for the whole export: the sha256 check of
    every file our manifest lists, then the writing, in bytes."""
    planned = plan_relayout(open_source(src), config, keep_settings=True)
    if planned is None:
        raise ConfigError(f"{src}: holds no FP4 weights; export re-lays an FP4 checkpoint (fp4convert's, "
                          "compressed-tensors' or ModelOpt's): convert this one with fp4convert quantize")
    return relayout(planned, dst, progress=progress, command="export")


def relayout(planned: Relayout, dst: str | Path, *, progress: bool = False, delete_source_shards: bool = False,
             command: str = "quantize") -> ConvertResult:
    """Write a planned re-layout into ``dst`` (the files our manifest lists checked first), through the run loop;
    ``command`` names its progress display."""
    if delete_source_shards:
        raise ConfigError("--delete-source-shards: a re-layout reads the source's shards to the end; keep them")
    t0 = time.perf_counter()
    dst = Path(dst)
    source, plan, fmt, layout, origin = planned
    manifest = layout.manifest
    listed = sum(rec["size"] for rec in manifest["files"].values()) if manifest and not source.is_hub else 0
    with progress_bar(listed + plan.summary()["bytes_in"], command, progress) as bar:
        if manifest is not None and not source.is_hub:
            verify_files(source.root, manifest, source.weight_files, progress=bar)
            check_global_scales(source, manifest, layout)
        identity = run_identity(plan.config, source, exported_from=(manifest or {}).get("identity"))
        world = World.from_env()  # under torchrun each rank writes its share of the shards
        world.init()
        src_fmt = get_format(layout.format)
        others = [p for p in source.other_files(exclude=dst) if p.name not in src_fmt.config_files]
        job = Job(source, plan, fmt, dst, plan.config, identity, others,
                  calibration=carried_calibration(layout, fmt), method=relay_method(layout, origin))
        done = run(job, world, [RelayWork(source, layout, fmt, load_quantized)], bar)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return ConvertResult(dst, plan, time.perf_counter() - t0, peak, sorted(f for f in done if f in dict(plan.shards)))
