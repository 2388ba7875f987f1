"""The converter: source -> plan -> quantize -> write -> manifest, one work unit at a time.

A work unit is one tensor or one fused group. Its tensors are read with plain file reads (the next
unit's in a background thread, see :mod:`fp4convert.readahead`), quantized (pass 1: amax of every
member, pass 2: block quantization with the group's global scale) and streamed into output shards
whose headers the plan fixed in advance, so host memory holds at most two units whatever the model
or shard size. Files are written under ``.partial`` names and renamed
when complete; the manifest is written last and marks a finished conversion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__
from .config import ConfigError, ConvertConfig
from .errors import FP4ConvertError, NonFiniteError, QuantizationError
from .formats import OutputFormat, get_format
from .manifest import MANIFEST_NAME, PROGRESS_NAME, build_manifest, file_digest
from .plan import QUANTIZE, Decision, Plan, PlanError, make_plan
from .readahead import ReadAhead
from .safetensors_io import StreamWriter
from .source import INDEX_NAME, Source, open_source
from .tensor import amax as tensor_amax
from .tensor import quantize

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


class OutputError(FP4ConvertError):
    """The destination cannot be written as asked (exists, full, or from other settings)."""

    exit_code = 5


@dataclass
class ConvertResult:
    """What a conversion did; the CLI prints it, ``--json`` emits :meth:`to_json`."""

    dst: Path
    plan: Plan
    wall_s: float
    peak_rss_bytes: int
    reused_files: list[str] = field(default_factory=list)
    read_wait_s: float = 0.0  # time the work loop waited for source reads (0: reading fully hidden)

    def to_json(self) -> dict:
        return {
            "dst": str(self.dst),
            **self.plan.summary(),
            "reused_files": self.reused_files,
            "wall_s": round(self.wall_s, 3),
            "read_wait_s": round(self.read_wait_s, 3),
            "peak_rss_bytes": self.peak_rss_bytes,
        }


def resolve_device(device: str) -> torch.device:
    """'auto' is the first GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {device!r} is not a device; use auto, cpu or cuda[:N]") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: only cpu and cuda are supported")
    return dev


def plan_conversion(src: str | Source, config: ConvertConfig) -> tuple[Source, Plan, OutputFormat]:
    """Open the source and plan it from headers alone (what ``--dry-run`` shows)."""
    source = src if isinstance(src, Source) else open_source(src, config.revision)
    for marker in (MANIFEST_NAME, "hf_quant_config.json"):
        if (source.root / marker).exists():
            raise PlanError(f"the source is already quantized (it has {marker}); fp4convert needs a bf16/fp16/fp32 checkpoint")
    fmt = get_format(config.format)
    plan = make_plan(source.tensors(), config, fmt, source.config())
    return source, plan, fmt


def convert(
    src: str | Source,
    dst: str | Path,
    config: ConvertConfig = ConvertConfig(),
    progress: Progress | None = None,
) -> ConvertResult:
    """Convert checkpoint ``src`` (folder or Hub repo id) into ``dst``."""
    t0 = time.perf_counter()
    dst = Path(dst)
    source, plan, fmt = plan_conversion(src, config)
    device = resolve_device(config.device)
    identity = {"settings": config.identity(), "source": source_fingerprint(source), "version": __version__,
                MTIMES: source_mtimes(source)}
    done = prepare_destination(dst, plan, config, identity, source)

    reader: ReadAhead | None = None

    def start(pending: list[list[Decision]]) -> None:
        nonlocal reader
        units = [[d.info for d in u] for u in pending if u[0].action == QUANTIZE]
        reader = ReadAhead(units, source.local_path, pinned=device.type == "cuda")

    def process(unit: list[Decision], writers: _Writers) -> dict[str, dict]:
        if unit[0].action == QUANTIZE:
            hosts = reader.next()
            try:
                xs = [h.to(device, non_blocking=True) for h in hosts]
                return _quantize_unit(unit, xs, config, fmt, writers)
            finally:
                reader.release()  # outputs are on the host now: every copy from these buffers is done
        d = unit[0]
        writers.raw(d.name, source.local_path(d.info.file), d.info)
        return {d.name: {}}

    try:
        write_outputs(plan, dst, identity, done, progress or (lambda n: None), process, start)
    finally:
        if reader is not None:
            reader.close()
    finish(source, plan, fmt, dst, identity)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    reused = sorted(f for f in done if f in dict(plan.shards))
    wait = reader.wait_s if reader is not None else 0.0
    return ConvertResult(dst, plan, time.perf_counter() - t0, peak, reused, wait)


# ---------------------------------------------------------------------------------------------
# Destination
# ---------------------------------------------------------------------------------------------

MTIMES = "source_mtimes"  # in the progress record only: the manifest stays the same for a copied source


def source_mtimes(source: Source) -> dict[str, int]:
    """Modification times of local weight files: resume refuses if values changed but shapes did not."""
    return {} if source.is_hub else {f: (source.root / f).stat().st_mtime_ns for f in source.weight_files}


def source_fingerprint(source: Source) -> dict:
    """What identifies the input: the Hub commit, or each local file's size and header hash."""
    desc = source.describe()
    if source.is_hub:
        return desc
    files = {}
    for f in source.weight_files:
        path = source.root / f
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            head = fh.read(n)
        files[f] = {"size": path.stat().st_size, "header_sha256": hashlib.sha256(head).hexdigest()}
    return {**desc, "files": files}


def prepare_destination(dst: Path, plan: Plan, config: ConvertConfig, identity: dict, source: Source) -> dict:
    """Refuse or clean DST as the flags say; return the finished files a resume may reuse."""
    if dst.resolve() == source.root.resolve():
        raise OutputError("the destination is the source folder; choose another one")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst} exists and is not a folder")
    existing = [p for p in dst.iterdir()] if dst.exists() else []
    done: dict = {}
    if existing and not (config.overwrite or config.resume):
        raise OutputError(f"{dst} exists and is not empty; pass --overwrite to replace it or --resume to continue")
    if existing and config.overwrite:
        _remove_outputs(dst)
    if existing and config.resume:
        done = _resumable(dst, identity)
    dst.mkdir(parents=True, exist_ok=True)
    need = sum(e.nbytes for f, entries in plan.shards if f not in done for e in entries)
    free = shutil.disk_usage(dst).free
    if need > free:
        raise OutputError(f"{dst}: needs {need / 1e9:.2f} GB for the output, only {free / 1e9:.2f} GB free")
    return done


def _remove_outputs(dst: Path) -> None:
    """--overwrite: remove what an earlier conversion wrote, and nothing else."""
    names = {MANIFEST_NAME, PROGRESS_NAME, INDEX_NAME}
    manifest = dst / MANIFEST_NAME
    if manifest.exists():
        try:
            names.update(json.loads(manifest.read_text()).get("files", {}))
        except json.JSONDecodeError:
            pass
    for p in dst.iterdir():
        if p.is_file() and (p.name in names or p.suffix == ".safetensors" or p.name.endswith(".partial")):
            p.unlink()


def _resumable(dst: Path, identity: dict) -> dict:
    """Finished shards of an interrupted run with the same settings, re-verified by checksum."""
    progress = dst / PROGRESS_NAME
    manifest = dst / MANIFEST_NAME
    path = progress if progress.exists() else manifest if manifest.exists() else None
    if path is None:
        if any(p.suffix == ".safetensors" for p in dst.iterdir()):
            raise OutputError(f"{dst}: has safetensors files but no fp4convert progress record; use --overwrite")
        return {}
    state = json.loads(path.read_text())
    stable = {k: v for k, v in identity.items() if k != MTIMES}
    if {k: v for k, v in state.get("identity", {}).items() if k != MTIMES} != stable:
        raise OutputError(
            f"{dst} was started with other settings or another source; --resume needs the same ones "
            "(or use --overwrite to start again)"
        )
    if MTIMES in state.get("identity", {}) and state["identity"][MTIMES] != identity.get(MTIMES):
        raise OutputError(
            f"{dst}: the source's weight files were modified since the interrupted run; "
            "use --overwrite to start again"
        )
    done = {}
    for f, rec in state.get("files", {}).items():
        p = dst / f
        if p.exists() and p.stat().st_size == rec["size"] and file_digest(p) == rec["sha256"]:
            done[f] = rec
        else:
            log.info("resume: %s is missing or differs, rewriting it", f)
    done["__tensors__"] = state.get("tensors", {})
    return done


# ---------------------------------------------------------------------------------------------
# The work
# ---------------------------------------------------------------------------------------------

class _Writers:
    """Open output shards (at most two at once: a unit can straddle a boundary)."""

    def __init__(self, dst: Path, plan: Plan, done: dict, on_close: Callable[[str, dict], None]) -> None:
        self.dst, self.done, self.on_close = dst, done, on_close
        self.entries = dict(plan.shards)
        self.shard_of = plan.shard_of()
        self.open: dict[str, StreamWriter] = {}

    def skip(self, name: str) -> bool:
        return self.shard_of[name] in self.done

    def _writer(self, name: str) -> StreamWriter:
        f = self.shard_of[name]
        if f not in self.open:
            self.open[f] = StreamWriter(self.dst / f, self.entries[f], {"format": "pt"})
        return self.open[f]

    def _maybe_close(self, f: str) -> None:
        w = self.open[f]
        if w.complete:
            w.close()
            del self.open[f]
            self.on_close(f, {"sha256": w.sha256.hexdigest(), "size": w.size})
            log.info("wrote %s (%.1f MB)", f, w.size / 1e6)

    def tensor(self, name: str, t: torch.Tensor) -> None:
        if self.skip(name):
            return
        w = self._writer(name)
        w.write_tensor(name, t)
        self._maybe_close(self.shard_of[name])

    def raw(self, name: str, path: Path, info) -> None:
        if self.skip(name):
            return
        w = self._writer(name)
        w.copy_raw(name, path, info)
        self._maybe_close(self.shard_of[name])

    def abort(self) -> None:
        for w in self.open.values():
            w.abort()
        self.open.clear()


UnitFn = Callable[[list[Decision], "_Writers"], dict[str, dict]]


def write_outputs(plan: Plan, dst: Path, identity: dict, done: dict, progress: Progress, process: UnitFn,
                  start: Callable[[list[list[Decision]]], None] | None = None) -> None:
    """Stream every work unit's outputs into the planned shards; ``process`` makes a unit's tensors.

    ``start`` is told up front which units will be processed (those a resume does not skip), so
    their reading can begin ahead of time.
    """
    tensors_state: dict = dict(done.get("__tensors__", {}))
    files_state = {f: rec for f, rec in done.items() if not f.startswith("__")}

    def on_close(f: str, rec: dict) -> None:
        files_state[f] = rec
        _save_progress(dst, identity, files_state, tensors_state)

    writers = _Writers(dst, plan, files_state, on_close)

    def finished(unit: list[Decision]) -> bool:
        outputs = [e.name for d in unit for e in d.outputs]
        return all(writers.skip(n) for n in outputs) and all(d.name in tensors_state for d in unit)

    units = plan.units()
    pending = [u for u in units if not finished(u)]
    if start is not None:
        start(pending)
    pending_ids = {id(u) for u in pending}
    try:
        for unit in units:
            if id(unit) not in pending_ids:
                progress(sum(d.info.nbytes for d in unit))
                continue
            tensors_state.update(process(unit, writers))
            progress(sum(d.info.nbytes for d in unit))
    except BaseException:
        writers.abort()
        raise
    if writers.open:  # the plan and the work disagree: never leave this silently
        writers.abort()
        raise RuntimeError("internal: output shards left incomplete")
    _save_progress(dst, identity, files_state, tensors_state)


def _quantize_unit(unit: list[Decision], xs: list[torch.Tensor], config: ConvertConfig, fmt: OutputFormat,
                   writers: _Writers) -> dict[str, dict]:
    """Pass 1 (amax of every member), then pass 2 (quantize each with the group's global scale)."""
    group_amax = None
    records: dict[str, dict] = {}
    if config.scheme == "nvfp4":
        amaxes = [tensor_amax(x, rotate=config.rotate) for x in xs]
        for d, a in zip(unit, amaxes):
            if not bool(torch.isfinite(a).all()):
                raise NonFiniteError(f"{d.name} (in {d.info.file}) holds NaN or Inf; fix the source or --ignore it")
        group_amax = torch.stack(amaxes).amax(0)
    for d, x in zip(unit, xs):
        try:
            q = quantize(x, config.scheme, rotate=config.rotate, global_amax=group_amax,
                         scale_layout="swizzled" if fmt.swizzled else "linear")
        except QuantizationError as exc:
            raise type(exc)(f"{d.name} (in {d.info.file}): {exc}") from exc
        for name, t in fmt.tensors(d.module, q):
            writers.tensor(name, t)
        rec: dict = {}
        if q.global_scale is not None:
            rec["global_scale"] = float(q.global_scale)
            rec["amax"] = float(group_amax)
        records[d.name] = rec
    return records


def _save_progress(dst: Path, identity: dict, files: dict, tensors: dict) -> None:
    state = {"identity": identity, "files": files, "tensors": tensors}
    _atomic_write(dst / PROGRESS_NAME, json.dumps(state, indent=1, sort_keys=True))


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def finish(source: Source, plan: Plan, fmt: OutputFormat, dst: Path, identity: dict) -> None:
    """Other files, the index, then the manifest (last: its presence means 'finished')."""
    state = json.loads((dst / PROGRESS_NAME).read_text())
    written = [INDEX_NAME]
    for p in source.other_files():
        written.append(p.relative_to(source.root).as_posix())
        target = dst / p.relative_to(source.root)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        shutil.copyfile(p, tmp)
        os.replace(tmp, target)
    written += fmt.finalize(dst, plan)
    shard_of = plan.shard_of()
    total = sum(e.nbytes for _, entries in plan.shards for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(shard_of.items()))}
    _atomic_write(dst / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    manifest = build_manifest(plan, fmt, source, identity, state, dst, written)
    _atomic_write(dst / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (dst / PROGRESS_NAME).unlink()


