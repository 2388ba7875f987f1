"""The run record: what identifies a run, what each part of it has finished, and what ``--resume`` may reuse.

A run's identity (settings, version, the source's fingerprint) is recorded in the progress record
before any shard exists and in the manifest at the end; ``--resume`` refuses a destination started
with another identity, naming the setting or the file that changed. Each part of a run (a torchrun
rank or a lane, :mod:`fp4convert.run.runner`) keeps its own progress record (:class:`PartRecord`), which
names a finished shard with its checksum *before* the shard is renamed into place: every state an
interruption can leave is one ``--resume`` finishes. The run merges the parts' records into one
before it finishes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4convert.output.files import atomic_write, is_regular, output_error, rename_in, source_error, writing
from fp4convert.output.manifest import PROGRESS_ONLY, portable_description
from fp4convert.storage.checksum import file_matches, file_sha256, record_problem
from fp4convert.storage.names import PART_RECORD, PARTIAL, PROGRESS_NAME, SHARD_PATTERN
from fp4convert.version import __version__

if TYPE_CHECKING:
    from fp4convert.config import ConvertConfig
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)

MTIMES = "source_mtimes"  # in the progress record only: the manifest stays the same for a copied source
FULL_HASHES = "source_sha256"  # --verify-source: every weight file's full sha256 (progress record only)
SAMPLE_BLOCK = 64 << 10  # the content fingerprint: sha256 of this many bytes at SAMPLE_COUNT fixed offsets
SAMPLE_COUNT = 16


# ---------------------------------------------------------------------------------------------
# Identity: what a resume must find unchanged
# ---------------------------------------------------------------------------------------------

def source_mtimes(source: Source) -> dict[str, int]:
    """Modification times of local weight files: a hint that values may have changed."""
    return {} if source.is_hub else {f: (source.root / f).stat().st_mtime_ns for f in source.weight_files}


def source_fingerprint(source: Source) -> dict:
    """What identifies the input: the Hub commit, or each local file's size, header hash and sampled content."""
    desc = portable_description(source)
    if source.is_hub:
        return desc
    files = {}
    for f in source.weight_files:
        path = source.root / f
        try:
            files[f] = {"size": path.stat().st_size, "header_sha256": header_digest(path),
                        "sample_sha256": sample_digest(path)}
        except OSError as exc:
            raise source_error(exc, path) from exc
    return {**desc, "files": files}


def header_digest(path: Path) -> str:
    """sha256 of a safetensors file's raw header bytes (the 8-byte length excluded)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return hashlib.sha256(fh.read(n)).hexdigest()


def sample_digest(path: Path) -> str:
    """A cheap content fingerprint: sha256 of SAMPLE_COUNT blocks of 64 KiB at fixed offsets (first and
    last included; the whole file when it is small), so changed values at equal shapes are noticed."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size <= SAMPLE_BLOCK * SAMPLE_COUNT:
            offsets = [0]
            block = size
        else:
            step = (size - SAMPLE_BLOCK) / (SAMPLE_COUNT - 1)
            offsets = [round(i * step) for i in range(SAMPLE_COUNT)]
            block = SAMPLE_BLOCK
        for off in offsets:
            fh.seek(off)
            h.update(fh.read(block))
    return h.hexdigest()


def run_identity(config: ConvertConfig, source: Source, **extra) -> dict:
    """The identity recorded in the progress record and the manifest (PROGRESS_ONLY keys: record only)."""
    identity = {"settings": config.identity(), "source": source_fingerprint(source), **extra,
                "version": __version__}
    identity[MTIMES] = source_mtimes(source)
    if getattr(config, "verify_source", False) and not source.is_hub:
        hashes = {}
        for f in source.weight_files:
            try:
                hashes[f] = file_sha256(source.root / f)
            except OSError as exc:
                raise source_error(exc, source.root / f) from exc
        identity[FULL_HASHES] = hashes
    return identity


def identity_mismatch(dst: Path, old: Any, new: dict, verify_source: bool) -> str | None:
    """Why a run recorded as ``old`` cannot be resumed as ``new`` (None: it can): names the setting with
    both values, or the changed source file."""
    if not isinstance(old, dict):
        return f"{dst}: the progress record holds no run identity; use --overwrite to start again"
    os_, ns = old.get("settings"), new.get("settings") or {}
    if os_ != ns:
        if isinstance(os_, dict):
            diffs = [f"{k} was {os_.get(k)!r}, now {ns.get(k)!r}" for k in sorted(set(os_) | set(ns))
                     if os_.get(k) != ns.get(k)]
        else:
            diffs = ["unreadable"]
        return (f"{dst} was started with other settings ({'; '.join(diffs)}); --resume needs the same ones "
                "(or use --overwrite to start again)")
    osrc, nsrc = old.get("source"), new.get("source") or {}
    if osrc != nsrc:
        osrc = osrc if isinstance(osrc, dict) else {}
        ofiles, nfiles = osrc.get("files") or {}, nsrc.get("files") or {}
        desc_old = {k: v for k, v in osrc.items() if k != "files"}
        desc_new = {k: v for k, v in nsrc.items() if k != "files"}
        if desc_old != desc_new:
            why = f"was {desc_old}, now {desc_new}"
        elif set(ofiles) != set(nfiles):
            why = f"weight files were {sorted(ofiles)}, now {sorted(nfiles)}"
        else:
            f = next(f for f in sorted(nfiles) if ofiles[f] != nfiles[f])
            what = [k for k in ("size", "header_sha256", "sample_sha256")
                    if not isinstance(ofiles[f], dict) or ofiles[f].get(k) != nfiles[f].get(k)]
            label = {"size": "size", "header_sha256": "header", "sample_sha256": "sampled content"}
            why = f"{f} changed since the interrupted run ({', '.join(label[k] for k in what)} differ)"
        return (f"{dst} was started from another source: {why}; --resume would mix old and new weights "
                "(use --overwrite to start again)")
    for k in sorted((set(old) | set(new)) - {"settings", "source", *PROGRESS_ONLY}):
        if old.get(k) != new.get(k):
            return (f"{dst} was started with other settings ({k} was {old.get(k)!r}, now {new.get(k)!r}); "
                    "use --overwrite to start again")
    if verify_source and nsrc.get("type") == "local":
        recorded = old.get(FULL_HASHES)
        if not isinstance(recorded, dict):
            return (f"{dst}: the interrupted run recorded no full source hashes (it ran without --verify-source), "
                    "so --verify-source cannot compare; resume without it, or use --overwrite")
        for f, h in sorted(new.get(FULL_HASHES, {}).items()):
            if recorded.get(f) != h:
                return (f"{dst} was started from another source: {f} changed since the interrupted run "
                        "(full sha256 differs); use --overwrite to start again")
        return None
    old_m = old.get(MTIMES)
    if isinstance(old_m, dict):
        for f, t in sorted((new.get(MTIMES) or {}).items()):
            if old_m.get(f) != t:
                return (f"{dst}: the source file {f} was modified since the interrupted run (its modification "
                        "time changed); use --resume --verify-source to compare its full content if the run "
                        "recorded it, else --overwrite to start again")
    return None


# ---------------------------------------------------------------------------------------------
# Progress records
# ---------------------------------------------------------------------------------------------

def save_progress(dst: Path, state: dict, name: str = PROGRESS_NAME) -> None:
    """Write a progress record ``{identity, files, tensors[, pending]}`` atomically."""
    with writing(dst / name):  # compact: json's C encoder (indent falls back to pure Python, ~0.2 MB per save
        # on a MoE, under the GIL, once per finished shard)
        atomic_write(dst / name, json.dumps(state, sort_keys=True, separators=(",", ":")))


def read_record(path: Path, kind: str) -> tuple[dict | None, str]:
    """(the record, None) if ``path`` holds a valid manifest/progress record, else (None, why not)."""
    from fp4convert.output.manifest import manifest_problem

    try:
        obj = json.loads(path.read_text())
    except OSError as exc:
        raise output_error(exc, path, resumable=False) from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{path.name} is not valid JSON ({str(exc).splitlines()[0][:80]}; truncated?)"
    if kind == "manifest":
        why = manifest_problem(obj)
    else:
        why = None
        if not isinstance(obj, dict) or not isinstance(obj.get("identity"), dict):
            why = "it is not an fp4convert progress record"
        elif not isinstance(obj.get("files"), dict) or not isinstance(obj.get("tensors", {}), dict):
            why = "its file list is malformed"
        elif any(record_problem(r) for r in obj["files"].values()):
            why = "a file record is malformed"
        elif not all(isinstance(n, str) for n in obj.get("pending", [])):
            why = "its pending list is malformed"
    return (obj, "") if why is None else (None, f"{path.name}: {why}")


def progress_records(dst: Path) -> list[Path]:
    """The progress record of an interrupted run: one file, and/or one per part (any number of parts)."""
    try:
        return sorted(p for p in dst.iterdir() if p.name == PROGRESS_NAME or PART_RECORD.match(p.name))
    except OSError as exc:
        raise output_error(exc, dst, resumable=False) from exc


def drop_part_records(dst: Path) -> None:
    """Remove the parts' progress records once the one record holds their state."""
    for p in progress_records(dst):
        if p.name != PROGRESS_NAME:
            p.unlink()


def merge_states(states: list[dict]) -> dict:
    """Several progress records (parts) as one; they must share one identity."""
    merged: dict = {"identity": states[0].get("identity", {}), "files": {}, "tensors": {}}
    pending: list[str] = []
    for st in states:
        if st.get("identity", {}) != merged["identity"]:
            merged["identity"] = {"mismatch": True}  # refused by --resume: other settings somewhere
        merged["files"].update(st.get("files", {}))
        merge_tensor_records(merged["tensors"], st.get("tensors", {}))
        pending += [n for n in st.get("pending", []) if n not in pending]
    if pending:
        merged["pending"] = pending
    return merged


def merge_tensor_records(into: dict, more: dict) -> None:
    """A unit's record is empty until its results are in (write-behind): never let one hide a full one."""
    for name, rec in more.items():
        if rec or name not in into:
            into[name] = rec


def resumable(dst: Path, records: list[dict], identity: dict, config: ConvertConfig) -> dict:
    """Finished shards of an interrupted run with the same settings and source, re-verified by checksum.

    Returns ``{shard: its record (checksum, size)}, "__tensors__": the units' records, "__pending__": the files an
    interrupted finish may have written}``: what :class:`PartRecord` starts from."""
    from fp4convert.errors import OutputError

    state = records[-1] if records else None  # the progress record when there is one, else the manifest
    if state is None:
        return {}
    mismatch = identity_mismatch(dst, state.get("identity"), identity, getattr(config, "verify_source", False))
    if mismatch:
        raise OutputError(mismatch)
    done: dict = {}
    for f, rec in state.get("files", {}).items():
        if not SHARD_PATTERN.match(f):
            continue
        p = dst / f
        partial = p.with_name(p.name + PARTIAL)
        try:
            # lstat only: a symlink in place of a shard (or its .partial) is never reused nor renamed into place
            if not os.path.lexists(p) and is_regular(partial) and file_matches(partial, rec):
                rename_in(dst, partial.name, p.name)  # recorded as finished just before its rename: finish it
            if is_regular(p) and file_matches(p, rec):
                done[f] = rec
                continue
        except OSError as exc:
            raise output_error(exc, p) from exc
        log.info("resume: %s is missing or differs, rewriting it", f)
    done["__tensors__"] = state.get("tensors", {})
    done["__pending__"] = list(state.get("pending", []))  # files an interrupted finish may have written
    return done


def nonfinite_warning(name: str, file: str) -> str:
    return f"{name} (kept unquantized, in {file}) holds NaN or Inf values; they were copied unchanged"


class PartRecord:
    """One part's progress record, kept up to date while its units are written.

    ``files``: its finished shards (checksum, size); ``tensors``: each written unit's record (a unit's
    record object is filled by its write job, so a shard's save holds the records of the units it
    contains); ``pending``: files an interrupted finish may have written (named until this run's own
    finish does, so ``--overwrite`` and ``--resume`` know them as ours). Shards close and kept tensors
    are scanned on other threads: every change holds the lock.
    """

    def __init__(self, dst: Path, identity: dict, done: dict, name: str) -> None:
        self.dst, self.identity, self.name = dst, identity, name
        self.files: dict[str, dict] = {f: rec for f, rec in done.items() if not f.startswith("__")}
        self.tensors: dict[str, dict] = dict(done.get("__tensors__", {}))
        self.pending: list[str] = list(done.get("__pending__", []))
        self.nonfinite: dict[str, str] = {}  # kept tensors copied with NaN/Inf: name -> source file
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    def state(self) -> dict:
        with self._lock:
            state: dict[str, Any] = {"identity": self.identity, "files": dict(self.files),
                                     "tensors": dict(self.tensors)}
            if self.pending:
                state["pending"] = list(self.pending)
            return state

    def save(self) -> None:
        with self._lock:
            self._flag_nonfinite()
            save_progress(self.dst, self.state(), self.name)

    def shard_done(self, f: str, rec: dict) -> None:
        """A shard is complete and hashed (before its rename): recorded and saved."""
        with self._lock:
            self.files[f] = rec
            self.save()

    def units_done(self, records: dict[str, dict]) -> None:
        """Units handed to the writer: their record objects (filled by their write jobs)."""
        with self._lock:
            for n, rec in records.items():
                self.tensors[n] = {**rec, "nonfinite": True} if n in self.nonfinite else rec
            self._flag_nonfinite()

    def found_nonfinite(self, name: str, file: str) -> None:
        """A kept tensor holds NaN/Inf (its copy found it): flagged in its record, warned about once."""
        with self._lock:
            self.nonfinite[name] = file
            self._flag_nonfinite()

    def _flag_nonfinite(self) -> None:
        for n, file in list(self.nonfinite.items()):
            if n in self.tensors and not self.tensors[n].get("nonfinite"):
                self.tensors[n] = {**self.tensors[n], "nonfinite": True}
            if n not in self._warned:
                self._warned.add(n)
                log.warning("warning: %s", nonfinite_warning(n, file))

    def discard(self) -> None:
        """A failed part: with nothing finished there is nothing to resume, so no record stays."""
        if not self.files:
            (self.dst / self.name).unlink(missing_ok=True)
        (self.dst / (self.name + PARTIAL)).unlink(missing_ok=True)
