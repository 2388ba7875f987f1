"""Re-layout a native checkpoint into an engine format, with no source weights and no requantization.

Quantize once, ship several formats: the packed nibbles are copied, swizzled scales are unswizzled
(exact), and tensors are renamed; the global scale becomes whatever the target stores (the encode
scale, or ModelOpt's 1/gs). The bytes equal a direct ``quantize --format TARGET`` of the same source.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import replace
from pathlib import Path

from . import checksum
from .config import ConvertConfig
from .distributed import World
from .errors import CheckpointFormatError, ConfigError
from .formats import get_format
from .layout import load_quantized, read_layout
from .manifest import MANIFEST_NAME, manifest_problem
from .plan import QUANTIZE, Decision, Plan, check_collisions, layout_shards
from .runner import ConvertResult, Job, Progress, run
from .safetensors_io import DTYPE_BITS, OutEntry, TensorInfo, dtype_nbytes, open_regular
from .source import open_source
from .writer import run_identity


def plan_export(src: str, config: ConvertConfig):
    """The export's plan, from the native manifest alone (no tensor data read)."""
    source = open_source(src)
    layout = read_layout(source)
    manifest = layout.manifest
    if manifest is None or manifest.get("format") != "fp4convert":
        raise ConfigError(f"{src}: export reads fp4convert's native format (a folder with fp4convert.json)")
    problem = manifest_problem(manifest)
    if problem:
        raise CheckpointFormatError(f"{source.root / MANIFEST_NAME}: {problem}; re-create the checkpoint with "
                                    "fp4convert quantize")
    config = replace(config, scheme=manifest["scheme"], rotate=manifest.get("rotate"),
                     scale_rule=manifest.get("scale_rule"))
    fmt = get_format(config.format)
    fmt.check(config.scheme, config.rotate)
    # Replay the original processing order (the order of the native outputs), so the bytes equal a
    # direct conversion to the target format.
    position = {name: i for i, name in enumerate(layout.tensors)}

    where = source.root / MANIFEST_NAME
    for name, rec in manifest["tensors"].items():
        missing = [o for o in rec["outputs"] if o not in position]
        if not rec["outputs"] or missing:
            raise CheckpointFormatError(f"{where}: tensor {name!r} lists outputs the shards do not hold "
                                        f"({', '.join(missing[:3]) or 'none'}); the checkpoint does not match "
                                        "its manifest")
        if rec["dtype"] not in DTYPE_BITS:
            raise CheckpointFormatError(f"{where}: tensor {name!r} has unknown dtype {rec['dtype']!r}")
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if rec["action"] == QUANTIZE and module not in layout.modules:
            raise CheckpointFormatError(f"{where}: {name!r} is recorded as quantized but the shards hold no "
                                        "quantized module for it; the checkpoint does not match its manifest")

    def first_output(item: tuple[str, dict]) -> int:
        return min(position[o] for o in item[1]["outputs"])

    decisions = []
    for name, rec in sorted(manifest["tensors"].items(), key=first_output):
        shape = tuple(rec["shape"])
        nbytes = dtype_nbytes(rec["dtype"], shape)  # the original tensor's size, for the summary
        info = TensorInfo(name, rec["dtype"], shape, rec["source_file"], 0, nbytes)
        if rec["action"] == QUANTIZE:
            module = name[: -len(".weight")]
            outputs = tuple(fmt.entries(module, info.shape, config.scheme, config.rotate))
        else:
            outputs = (OutEntry(name, rec["dtype"], tuple(rec["shape"])),)
        decisions.append(Decision(name, rec["action"], rec["reason"], info, rec.get("group"), outputs))
    check_collisions(decisions)
    plan = Plan(decisions, manifest.get("groups", {}), layout_shards(decisions, config.max_shard_size), config)
    return source, layout, manifest, plan, fmt


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


def export(src: str, dst: str | Path, config: ConvertConfig, progress: Progress | None = None,
           bar=None) -> ConvertResult:
    """Write native checkpoint ``src`` as ``config.format`` into ``dst``.

    ``bar``: a progress bar (``total``, ``update(n)``; the CLI's tqdm) for the whole export: the sha256
    check of every listed file, then the writing, in bytes; ``progress`` alone counts the writing."""
    t0 = time.perf_counter()
    dst = Path(dst)
    source, layout, manifest, plan, fmt = plan_export(src, config)
    if bar is not None:
        bar.total = sum(rec["size"] for rec in manifest["files"].values()) + plan.summary()["bytes_in"]
        if hasattr(bar, "refresh"):
            bar.refresh()
        progress = progress or bar.update
    verify_files(source.root, manifest, source.weight_files, progress=bar)
    identity = run_identity(plan.config, source, exported_from=manifest.get("identity"))

    world = World.from_env()  # under torchrun each rank writes its share of the shards
    world.init()
    job = Job(source, plan, fmt, dst, plan.config, identity, source.other_files(exclude=dst))
    done = run(job, world, [_ExportWork(source, layout, manifest, fmt)], progress)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return ConvertResult(dst, plan, time.perf_counter() - t0, peak, sorted(f for f in done if f in dict(plan.shards)))


class _ExportWork:
    """The run loop's work for an export (:class:`fp4convert.work.Work`): each quantized module loaded
    from the native shards and written in the target format, every other tensor copied unchanged."""

    read_wait_s = 0.0

    def __init__(self, source, layout, manifest: dict, fmt) -> None:
        self.source, self.layout, self.manifest, self.fmt = source, layout, manifest, fmt

    def start(self, pending: list[list[Decision]]) -> None:
        pass

    def unit(self, unit: list[Decision]):
        records = {}
        for d in unit:
            rec = self.manifest["tensors"][d.name]
            records[d.name] = {k: rec[k] for k in ("global_scale", "amax") if k in rec} if d.action == QUANTIZE else {}

        def job(shards) -> None:
            for d in unit:
                if d.action == QUANTIZE:
                    m = self.layout.modules[d.module]
                    for name, data in self.fmt.tensors(d.module, load_quantized(self.source, self.layout, m)):
                        shards.write(name, data)
                else:
                    info = self.layout.tensors[d.name]
                    shards.copy_kept(d.name, self.source.local_path(info.file), info)

        return records, job

    def nonfinite(self, dtype: str, data: memoryview) -> bool:
        from .matrices import nonfinite_bytes

        return nonfinite_bytes(dtype, data)

    def thread_init(self) -> None:
        pass

    def close(self) -> None:
        pass
