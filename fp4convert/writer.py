"""Writing a checkpoint safely: destination policy, shard writers, resume record, index, manifest last.

``convert`` (quantize from a source) and ``export`` (re-layout a native output) are siblings that
both write through here: each hands :func:`write_outputs` a function that produces one work unit's
tensors, and the writer streams them into the shards the plan fixed in advance. Files are written as
``*.partial`` and renamed when complete; a progress record lists finished shards (for ``--resume``);
the manifest is written last, so its presence means the conversion finished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ConvertConfig
from .errors import OutputError
from .formats.base import OutputFormat
from .manifest import MANIFEST_NAME, PROGRESS_NAME, build_manifest, file_digest
from .plan import Decision, Plan
from .safetensors_io import StreamWriter, TensorInfo
from .source import INDEX_NAME, Source
from .version import __version__

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
UnitFn = Callable[[list[Decision], "ShardWriters"], dict[str, dict]]

MTIMES = "source_mtimes"  # in the progress record only: the manifest stays the same for a copied source


@dataclass
class ConvertResult:
    """What a run did; the CLI prints it, ``--json`` emits :meth:`to_json`."""

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


# ---------------------------------------------------------------------------------------------
# Identity: what a resume must find unchanged
# ---------------------------------------------------------------------------------------------

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
        files[f] = {"size": path.stat().st_size, "header_sha256": header_digest(path)}
    return {**desc, "files": files}


def header_digest(path: Path) -> str:
    """sha256 of a safetensors file's raw header bytes (the 8-byte length excluded)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return hashlib.sha256(fh.read(n)).hexdigest()


def run_identity(config: ConvertConfig, source: Source, **extra) -> dict:
    """The identity recorded in the progress record and the manifest."""
    identity = {"settings": config.identity(), "source": source_fingerprint(source), **extra,
                "version": __version__}
    identity[MTIMES] = source_mtimes(source)
    return identity


# ---------------------------------------------------------------------------------------------
# Destination policy
# ---------------------------------------------------------------------------------------------

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
    records = set(progress_records(dst))
    for p in dst.iterdir():
        if p.is_file() and (p.name in names or p.suffix == ".safetensors" or p.name.endswith(".partial")
                            or p in records):
            p.unlink()


def rank_progress_name(rank: int) -> str:
    """Under torchrun each rank keeps its own progress record (no write race); rank 0 merges them."""
    return PROGRESS_NAME.replace(".json", f".rank{rank}.json")


def progress_records(dst: Path) -> list[Path]:
    """The progress record of an interrupted run: one file, or one per rank (any number of ranks)."""
    stem = PROGRESS_NAME[: -len(".json")]
    return sorted(p for p in dst.glob(stem + "*.json") if p.name == PROGRESS_NAME or p.name.startswith(stem + ".rank"))


def merge_states(states: list[dict]) -> dict:
    """Several progress records (ranks) as one; they must share one identity."""
    merged: dict = {"identity": states[0].get("identity", {}), "files": {}, "tensors": {}}
    for st in states:
        if st.get("identity", {}) != merged["identity"]:
            merged["identity"] = {"mismatch": True}  # refused below: other settings somewhere
        merged["files"].update(st.get("files", {}))
        merge_tensor_records(merged["tensors"], st.get("tensors", {}))
    return merged


def merge_tensor_records(into: dict, more: dict) -> None:
    """A unit's record is empty until its results are in (write-behind): never let one hide a full one."""
    for name, rec in more.items():
        if rec or name not in into:
            into[name] = rec


def _resumable(dst: Path, identity: dict) -> dict:
    """Finished shards of an interrupted run with the same settings, re-verified by checksum."""
    records = progress_records(dst)
    manifest = dst / MANIFEST_NAME
    if not records and manifest.exists():
        records = [manifest]
    if not records:
        if any(p.suffix == ".safetensors" for p in dst.iterdir()):
            raise OutputError(f"{dst}: has safetensors files but no fp4convert progress record; use --overwrite")
        return {}
    state = merge_states([json.loads(p.read_text()) for p in records])
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
# Shards
# ---------------------------------------------------------------------------------------------

class ShardWriters:
    """Open output shards (at most two at once: a unit can straddle a boundary)."""

    def __init__(self, dst: Path, plan: Plan, done: dict, on_close: Callable[[str, dict], None],
                 owns: Callable[[str], bool] | None = None) -> None:
        self.dst, self.done, self.on_close = dst, done, on_close
        self.owns = owns or (lambda f: True)  # under torchrun: the shards this rank writes
        self.entries = dict(plan.shards)
        self.shard_of = plan.shard_of()
        self.open: dict[str, StreamWriter] = {}

    def skip(self, name: str) -> bool:
        f = self.shard_of[name]
        return f in self.done or not self.owns(f)

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

    def raw(self, name: str, path: Path, info: TensorInfo) -> None:
        """Copy a kept tensor's bytes unchanged."""
        if self.skip(name):
            return
        w = self._writer(name)
        w.copy_raw(name, path, info)
        self._maybe_close(self.shard_of[name])

    def abort(self) -> None:
        for w in self.open.values():
            w.abort()
        self.open.clear()


def write_outputs(plan: Plan, dst: Path, identity: dict, done: dict, progress: Progress, process: UnitFn,
                  start: Callable[[list[list[Decision]]], None] | None = None, *,
                  owns: Callable[[str], bool] | None = None, progress_name: str = PROGRESS_NAME,
                  drain: Callable[[bool], None] | None = None) -> tuple[dict, dict]:
    """Stream every work unit's outputs into the planned shards; ``process`` makes a unit's tensors.

    ``start`` is told up front which units will be processed (those a resume does not skip), so
    their reading can begin ahead of time. Under torchrun, ``owns`` selects the shards this rank
    writes and ``progress_name`` is this rank's own progress record. ``drain(True)`` waits for
    writes ``process`` queued (a write-behind thread); ``drain(False)`` stops them before an abort.
    Returns this run's (files, tensors) records.
    """
    tensors_state: dict = dict(done.get("__tensors__", {}))
    files_state = {f: rec for f, rec in done.items() if not f.startswith("__")}
    lock = threading.Lock()  # on_close may run in a write-behind thread

    def on_close(f: str, rec: dict) -> None:
        with lock:
            files_state[f] = rec
            _save_progress(dst, identity, files_state, tensors_state, progress_name)

    writers = ShardWriters(dst, plan, files_state, on_close, owns)
    shard_of = writers.shard_of

    def finished(unit: list[Decision]) -> bool:
        outputs = [e.name for d in unit for e in d.outputs]
        mine = [d for d in unit if any(writers.owns(shard_of[e.name]) for e in d.outputs)]
        return all(writers.skip(n) for n in outputs) and all(d.name in tensors_state for d in mine)

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
            records = process(unit, writers)
            with lock:
                tensors_state.update(records)
            progress(sum(d.info.nbytes for d in unit))
        if drain is not None:
            drain(True)
    except BaseException:
        if drain is not None:
            drain(False)
        writers.abort()
        raise
    if writers.open:  # the plan and the work disagree: never leave this silently
        writers.abort()
        raise RuntimeError("internal: output shards left incomplete")
    _save_progress(dst, identity, files_state, tensors_state, progress_name)
    return files_state, tensors_state


def _save_progress(dst: Path, identity: dict, files: dict, tensors: dict, name: str = PROGRESS_NAME) -> None:
    state = {"identity": identity, "files": files, "tensors": tensors}
    atomic_write(dst / name, json.dumps(state, indent=1, sort_keys=True))


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a .partial file and rename it into place."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Finish: other files, the format's files, index, manifest
# ---------------------------------------------------------------------------------------------

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
    written += fmt.finalize(dst, plan.output_info(source.config()))
    shard_of = plan.shard_of()
    total = sum(e.nbytes for _, entries in plan.shards for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(shard_of.items()))}
    atomic_write(dst / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    manifest = build_manifest(plan, fmt, source, identity, state, dst, written)
    atomic_write(dst / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (dst / PROGRESS_NAME).unlink()
