"""Re-layout a native checkpoint into an engine format, with no source weights and no requantization.

Quantize once, ship several formats: the packed nibbles are copied, swizzled scales are unswizzled
(exact), and tensors are renamed; the global scale becomes whatever the target stores (the encode
scale, or ModelOpt's 1/gs). The bytes equal a direct ``quantize --format TARGET`` of the same source.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, replace
from pathlib import Path

from fp4convert.checkpoint.layout import load_quantized, manifest_disagreements, module_shape_problems, read_layout
from fp4convert.config import ConvertConfig
from fp4convert.errors import CheckpointFormatError, ConfigError
from fp4convert.formats import DEFAULT_FORMAT, get_format
from fp4convert.output.manifest import MANIFEST_NAME, manifest_problem
from fp4convert.output.record import run_identity
from fp4convert.plan.collisions import check_part_names
from fp4convert.plan.planner import Plan, check_collisions, layout_shards
from fp4convert.plan.types import QUANTIZE, Decision, Matrix
from fp4convert.run.distributed import World
from fp4convert.run.progress import progress_bar
from fp4convert.run.runner import ConvertResult, Job, run
from fp4convert.run.work import WriteJob
from fp4convert.source.open import open_source
from fp4convert.storage import checksum
from fp4convert.storage.reads import open_regular, read_tensor
from fp4convert.storage.safetensors import DTYPE_BITS, OutEntry, TensorInfo, dtype_nbytes


def plan_export(src: str, config: ConvertConfig):
    """The export's plan, from the native manifest alone (no tensor data read)."""
    source = open_source(src)
    layout = read_layout(source)
    manifest = layout.manifest
    if manifest is None:
        raise ConfigError(f"{src}: export reads fp4convert's native format (a folder with {MANIFEST_NAME}), and "
                          f"{src} has no {MANIFEST_NAME}; convert the original with fp4convert quantize --format ...")
    native = get_format(DEFAULT_FORMAT)
    if manifest.get("format") != native.name:
        raise ConfigError(f"{src}: its {MANIFEST_NAME} says it is already in the {str(manifest.get('format'))[:40]!r} "
                          f"format; export re-lays out fp4convert's native format only. Use this folder as it is, "
                          f"or convert the original with fp4convert quantize --format ...")
    problem = manifest_problem(manifest)
    if problem:
        raise CheckpointFormatError(f"{source.root / MANIFEST_NAME}: {problem}; re-create the checkpoint with "
                                    "fp4convert quantize")
    where = source.root / MANIFEST_NAME
    _check_consistent(source, manifest, layout, where)
    try:  # (kept tensors stay as the native output stores them: --kept-dtype carries over)
        config = replace(config, scheme=manifest["scheme"], rotate=manifest.get("rotate"),
                         scale_rule=manifest.get("scale_rule"),
                         kept_dtype=(manifest.get("settings") or {}).get("kept_dtype", "source"))
    except ConfigError as exc:  # the recorded settings, not the user's options, are wrong
        raise CheckpointFormatError(f"{where}: the recorded settings are invalid ({exc}); re-create the "
                                    "checkpoint with fp4convert quantize") from None
    fmt = get_format(config.format)
    fmt.check(config.scheme, config.rotate)
    # Replay the original processing order (the order of the native outputs), so the bytes equal a
    # direct conversion to the target format.
    position = {name: i for i, name in enumerate(layout.tensors)}
    # A quantized tensor's outputs are those of its quantized modules: one for a linear weight, one per
    # expert (and gate/up half) for a stacked expert tensor, written [out, in] for a GPT-2 Conv1D. Each
    # module's shape comes from the shards, never from the record's (source) shape.
    owner = {t.name: m for m in layout.modules.values() for t in m.tensors}

    def first_output(item: tuple[str, dict]) -> int:
        return min(position[o] for o in item[1]["outputs"])

    decisions = []
    for name, rec in sorted(manifest["tensors"].items(), key=first_output):
        shape = tuple(rec["shape"])
        nbytes = dtype_nbytes(rec["dtype"], shape)  # the original tensor's size, for the summary
        info = TensorInfo(name, rec["dtype"], shape, rec["source_file"], 0, nbytes)
        if rec["action"] == QUANTIZE:
            modules = _modules_of(rec, owner, position)
            outputs = tuple(e for m in modules for e in fmt.entries(m.module, m.shape, config.scheme, config.rotate))
            matrices = tuple(Matrix(m.module, tuple(m.shape)) for m in modules)
        else:
            # its dtype as stored (the source's, or BF16 for an F32/F64 one with --kept-dtype bf16)
            outputs, matrices = (OutEntry(name, rec["outputs"][name]["dtype"], tuple(rec["shape"])),), ()
        decisions.append(Decision(name, rec["action"], rec["reason"], info, rec.get("group"), outputs, matrices))
    check_collisions(decisions)
    check_part_names(decisions, fmt)
    plan = Plan(decisions, manifest.get("groups", {}), layout_shards(decisions, config.max_shard_size), config)
    return source, layout, manifest, plan, fmt


def _modules_of(rec: dict, owner: dict, position: dict[str, int]) -> list:
    """The quantized modules holding a record's outputs, in the order the shards hold them."""
    mods: dict = {}
    for o in sorted((o for o in rec["outputs"] if o in owner), key=position.__getitem__):
        mods.setdefault(owner[o].module, owner[o])
    return list(mods.values())


def _check_consistent(source, manifest: dict, layout, where: Path) -> None:
    """The native manifest and the shards must tell one story before anything is planned from it: the
    layout read cleanly, every module's scales fit its packed weight, every record agrees with the shards
    (layout.manifest_disagreements) and a quantized record's outputs are exactly its modules' tensors.
    An edited or mismatched manifest is refused (exit 4) naming the first disagreement."""
    def refuse(why: str) -> None:
        raise CheckpointFormatError(f"{where}: {why}; the checkpoint does not match its manifest: re-create it "
                                    "with fp4convert quantize")

    problems = [*layout.problems, *(p for m in layout.modules.values() for p in module_shape_problems(m))]
    if not problems:
        problems = manifest_disagreements(manifest, layout)
    if problems:
        refuse(problems[0])
    native = get_format(manifest["format"])
    owner = {t.name: m for m in layout.modules.values() for t in m.tensors}
    position = {o: i for i, o in enumerate(layout.tensors)}
    for name, rec in manifest["tensors"].items():
        if rec["dtype"] not in DTYPE_BITS:
            refuse(f"tensor {name!r} has unknown dtype {rec['dtype']!r}")
        if rec["action"] != QUANTIZE:
            continue
        mods = _modules_of(rec, owner, position)
        want = {e.name: (e.dtype, list(e.shape)) for m in mods
                for e in native.entries(m.module, m.shape, manifest["scheme"], manifest.get("rotate"))}
        got = {o: (r["dtype"], r["shape"]) for o, r in rec["outputs"].items()}
        if want != got:
            diff = sorted(set(want) ^ set(got)) or sorted(k for k in want if want[k] != got[k])
            refuse(f"quantized tensor {name!r} lists outputs that are not its modules' tensors (e.g. {diff[0]})")


def check_global_scales(source, manifest: dict, layout) -> None:
    """The recorded global scales are copied into the new manifest: they must be the stored ones. Read
    from the shards, so only after :func:`verify_files` (a corrupted shard is named as corrupted, not as
    a manifest that disagrees with it)."""
    stored = {m.module: read_tensor(source.local_path(m.global_.file), m.global_).flatten()
              for m in layout.modules.values() if m.global_ is not None and m.global_.dtype == "F32"}
    problems = manifest_disagreements(manifest, layout, stored)
    if problems:
        raise CheckpointFormatError(f"{source.root / MANIFEST_NAME}: {problems[0]}; the checkpoint does not match "
                                    "its manifest: re-create it with fp4convert quantize")


def verify_files(root: Path, manifest: dict, weight_files: list[str], progress=None) -> None:
    """Every weight file is listed in the native manifest, and every file it lists has its recorded size and
    sha256, before anything is written: a corrupted native checkpoint must not be re-exported with fresh
    checksums for its bad bytes."""
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
            raise CheckpointFormatError(f"{path}: listed in {MANIFEST_NAME} but missing; the native checkpoint "
                                        "is incomplete: re-create it with fp4convert quantize") from None
        except OSError as exc:
            raise CheckpointFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        with open(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != rec["size"]:
                raise CheckpointFormatError(f"{path}: {size} bytes, the manifest records {rec['size']}; the native "
                                            "checkpoint is corrupted: re-create it with fp4convert quantize")
            if not checksum.matches(f, rec, progress):
                raise CheckpointFormatError(f"{path}: sha256 differs from the manifest; the native checkpoint is "
                                            "corrupted: re-create it with fp4convert quantize")


def export(src: str, dst: str | Path, config: ConvertConfig, progress: bool = False) -> ConvertResult:
    """Write native checkpoint ``src`` as ``config.format`` into ``dst``.

    ``progress``: show progress (:mod:`fp4convert.run.progress`) for the whole export: the sha256
    check of every listed file, then the writing, in bytes."""
    t0 = time.perf_counter()
    dst = Path(dst)
    source, layout, manifest, plan, fmt = plan_export(src, config)
    total = sum(rec["size"] for rec in manifest["files"].values()) + plan.summary()["bytes_in"]
    with progress_bar(total, "export", progress) as bar:
        return _export(source, layout, manifest, plan, fmt, dst, bar, t0)


def _export(source, layout, manifest: dict, plan: Plan, fmt, dst: Path, bar, t0: float) -> ConvertResult:
    """The export once planned: the files checked, then the run loop, both advancing ``bar``."""
    verify_files(source.root, manifest, source.weight_files, progress=bar)
    check_global_scales(source, manifest, layout)
    identity = run_identity(plan.config, source, exported_from=manifest.get("identity"))

    world = World.from_env()  # under torchrun each rank writes its share of the shards
    world.init()
    job = Job(source, plan, fmt, dst, plan.config, identity, source.other_files(exclude=dst))
    done = run(job, world, [_ExportWork(source, layout, manifest, fmt)], bar)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return ConvertResult(dst, plan, time.perf_counter() - t0, peak, sorted(f for f in done if f in dict(plan.shards)))


@dataclass
class _ExportUnit(WriteJob):
    """One unit of an export: its modules loaded from the native shards and written in the target format."""

    unit: list[Decision]


class _ExportWork:
    """The run loop's work for an export (:class:`fp4convert.run.work.Work`): each quantized module loaded
    from the native shards and written in the target format, every other tensor copied unchanged."""

    read_wait_s = 0.0

    def __init__(self, source, layout, manifest: dict, fmt) -> None:
        self.source, self.layout, self.manifest, self.fmt = source, layout, manifest, fmt

    def start(self, pending: list[list[Decision]]) -> None:
        pass

    def unit(self, unit: list[Decision]) -> tuple[dict[str, dict], list[WriteJob]]:
        records = {}
        for d in unit:
            rec = self.manifest["tensors"][d.name]
            records[d.name] = ({k: rec[k] for k in ("global_scale", "amax", "matrices") if k in rec}
                              if d.action == QUANTIZE else {})
        return records, [_ExportUnit(unit)]

    def write(self, job: WriteJob, shards) -> None:
        assert isinstance(job, _ExportUnit)
        for d in job.unit:
            if d.action == QUANTIZE:
                for mx in d.matrices:
                    m = self.layout.modules[mx.module]
                    for name, data in self.fmt.tensors(mx.module, load_quantized(self.source, self.layout, m)):
                        shards.write(name, data)
            else:
                info = self.layout.tensors[d.name]
                shards.copy_kept(d.name, self.source.local_path(info.file), info)

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        from fp4convert.quantizer.matrices import nonfinite_bytes

        return nonfinite_bytes(dtype, data)

    def thread_init(self) -> None:
        pass

    def close(self) -> None:
        pass
