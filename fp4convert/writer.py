"""Writing a checkpoint safely: destination policy, a lock, shard writers, resume record, index, manifest last.

``convert`` (quantize from a source) and ``export`` (re-layout a native output) are siblings that
both write through here: :func:`prepare_destination` checks and locks DST, then each hands
:func:`write_outputs` a function that produces one work unit's tensors, and the writer streams them
into the shards the plan fixed in advance; :func:`finish` writes the other files and the manifest
and releases DST. Files are written as ``*.partial`` and renamed when complete; the progress record
names a finished shard (with its checksum) *before* the shard is renamed into place, so every state
an interruption can leave is one ``--resume`` finishes; the manifest is written last, so its
presence means the conversion finished.

Safety rules (issue 12): DST is never inside SRC nor SRC inside DST; ``--overwrite`` removes only
files a valid manifest or progress record lists and that this tool writes; one run at a time holds
``DST/.fp4convert.lock``; every OS error on DST becomes an :class:`OutputError` naming the file.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import stages
from .config import ConvertConfig
from .errors import FP4ConvertError, OutputError, SourceError
from .formats.base import OutputFormat
from .manifest import (LOCK_NAME, MANIFEST_NAME, PROGRESS_NAME, PROGRESS_ONLY, build_manifest, file_digest,
                       manifest_problem, portable_description)
from .plan import Decision, Plan
from .safetensors_io import StreamWriter, TensorInfo, header_bytes, torch_dtypes
from .source import INDEX_NAME, Source
from .version import __version__

if TYPE_CHECKING:  # planning and the destination policy need no torch; only the NaN/Inf check imports it
    import torch

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
UnitFn = Callable[[list[Decision], "ShardWriters"], dict[str, dict]]

MTIMES = "source_mtimes"  # in the progress record only: the manifest stays the same for a copied source
FULL_HASHES = "source_sha256"  # --verify-source: every weight file's full sha256 (progress record only)
SAMPLE_BLOCK = 64 << 10  # the content fingerprint: sha256 of this many bytes at SAMPLE_COUNT fixed offsets
SAMPLE_COUNT = 16
FORMAT_FILES = ("config.json", "hf_quant_config.json", "README.md")  # what finalize and the model card write
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_RANK_RECORD = re.compile(r"^" + re.escape(PROGRESS_NAME[: -len(".json")]) + r"\.rank\d+\.json$")
_COPY_CHUNK = 16 << 20
MAX_MANIFEST = 1 << 30  # bytes; a source "manifest" larger than this is not read


def human_bytes(n: float) -> str:
    """Adaptive units, so a small need never reads '0.00 GB'."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


@dataclass
class ConvertResult:
    """What a run did; the CLI prints it, ``--json`` emits :meth:`to_json`."""

    dst: Path
    plan: Plan
    wall_s: float
    peak_rss_bytes: int
    reused_files: list[str] = field(default_factory=list)
    read_wait_s: float = 0.0  # time the work loop waited for source reads (0: reading fully hidden)
    stages_s: dict[str, float] = field(default_factory=dict)  # busy seconds per stage (fp4convert.stages)
    counts: dict[str, float] = field(default_factory=dict)  # other quantities (pinned MB allocated)

    def to_json(self) -> dict:
        return {
            "dst": str(self.dst),
            **self.plan.summary(),
            "reused_files": self.reused_files,
            "warnings": list(self.plan.warnings),
            "wall_s": round(self.wall_s, 3),
            "read_wait_s": round(self.read_wait_s, 3),
            "peak_rss_bytes": self.peak_rss_bytes,
            "stages_s": self.stages_s,
            "counts": self.counts,
        }


# ---------------------------------------------------------------------------------------------
# OS errors: one line naming the file and what to do
# ---------------------------------------------------------------------------------------------

def output_error(exc: OSError, path: Path | str, resumable: bool = True) -> OutputError:
    """An OS error on the destination, as the one-line OutputError the CLI prints (exit 5)."""
    where = exc.filename or path
    code = errno.errorcode.get(exc.errno or 0, "")
    again = "; then run the same command with --resume" if resumable else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"{where}: no space left on the device ({code}); free some space{again}")
    if exc.errno == errno.EFBIG:
        return OutputError(f"{where}: file too large (EFBIG: the filesystem's or `ulimit -f` file-size limit); "
                           f"raise the limit or pass a smaller --max-shard-size{again}")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"{where}: cannot write ({exc.strerror}, {code}); choose a folder you can write to")
    if exc.errno == errno.EISDIR:
        return OutputError(f"{where} is a folder where fp4convert writes a file (EISDIR); remove it or choose "
                           "another DST")
    if exc.errno == errno.ENOTDIR:
        return OutputError(f"{where}: part of the path is a file, not a folder (ENOTDIR); choose another DST")
    if exc.errno == errno.EXDEV:
        return OutputError(f"{where}: cannot rename across filesystems (EXDEV); choose a DST on one filesystem")
    return OutputError(f"{where}: cannot write ({exc.strerror or exc}{', ' + code if code else ''}); "
                       "check the destination folder")


def source_error(exc: OSError, path: Path | str) -> SourceError:
    """An OS error while reading the source (exit 4)."""
    code = errno.errorcode.get(exc.errno or 0, "")
    return SourceError(f"{exc.filename or path}: cannot read ({exc.strerror or exc}{', ' + code if code else ''}); "
                       "check the file and its permissions")


@contextmanager
def writing(path: Path, resumable: bool = True) -> Iterator[None]:
    """OS errors inside become OutputError naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise output_error(exc, path, resumable) from exc


# ---------------------------------------------------------------------------------------------
# Containment: every file fp4convert creates or opens in DST
# ---------------------------------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _through_link(dst: Path, rel: str) -> OutputError:
    """A symlink (or a file) where fp4convert needs one of DST's own folders or files."""
    where = dst / rel
    try:
        what = f"a symlink to {os.readlink(where)}" if os.path.islink(where) else "not a folder"
    except OSError:
        what = "not a real folder"
    return OutputError(f"{where} is {what}; fp4convert writes only into real files and folders inside {dst}, "
                       "never through a symlink: remove it or choose another DST")


@contextmanager
def dst_dir(dst: Path, rel_dir: str, create: bool = False) -> Iterator[int]:
    """A descriptor of the folder ``rel_dir`` inside DST, opened component by component with O_NOFOLLOW
    (openat-style: a symlinked folder anywhere below DST is refused, whatever happens to the names
    meanwhile); ``create`` makes the missing ones. DST itself may be a symlink the user named."""
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        done: list[str] = []
        for part in [p for p in rel_dir.split("/") if p]:
            done.append(part)
            try:
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _through_link(dst, "/".join(done)) from None
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def _split(rel: str) -> tuple[str, str]:
    parent, _, leaf = rel.rpartition("/")
    return parent, leaf


def open_new(dst: Path, rel: str) -> int:
    """A new, empty file DST/``rel`` for writing (a temporary ``*.partial`` name, whatever was there is
    removed first): parents are real folders inside DST, created as needed, and the file is created
    with O_EXCL|O_NOFOLLOW, so a symlink left in its place is never written through."""
    parent, leaf = _split(rel)
    with writing(dst / rel):
        with dst_dir(dst, parent, create=True) as dfd:
            try:
                os.unlink(leaf, dir_fd=dfd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                raise output_error(OSError(errno.EISDIR, "Is a directory", str(dst / rel)), dst / rel) from None
            return os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                           dir_fd=dfd)


def rename_in(dst: Path, rel_from: str, rel_to: str) -> None:
    """Rename a file inside one folder of DST (renameat: a symlink at ``rel_to`` is replaced, not followed)."""
    parent, a = _split(rel_from)
    parent_to, b = _split(rel_to)
    assert parent == parent_to, (rel_from, rel_to)
    with writing(dst / rel_to):
        with dst_dir(dst, parent) as dfd:
            os.replace(a, b, src_dir_fd=dfd, dst_dir_fd=dfd)


def unlink_in(dst: Path, rel: str) -> None:
    """Remove DST/``rel`` if it is there (a symlink is removed itself, its target untouched)."""
    parent, leaf = _split(rel)
    with writing(dst / rel):
        try:
            with dst_dir(dst, parent) as dfd:
                os.unlink(leaf, dir_fd=dfd)
        except FileNotFoundError:
            pass


def write_new(dst: Path, rel: str, data: bytes) -> None:
    """DST/``rel`` written whole, atomically: a ``.partial`` file (see :func:`open_new`) renamed into place."""
    tmp = rel + ".partial"
    fd = open_new(dst, tmp)
    with writing(dst / tmp), os.fdopen(fd, "wb") as fh:
        fh.write(data)
    rename_in(dst, tmp, rel)


def is_regular(path: Path) -> bool:
    """A regular file itself (lstat: a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


_pauses = 0
_pause_lock = threading.Lock()  # shards close on their hasher threads: steps may come from several


def _test_pause() -> None:
    """Test hooks at each step of a run (after a unit, between a shard's record and its rename, between the
    finishing writes): FP4CONVERT_TEST_DELAY sleeps that many seconds, so a test can interrupt the run at
    random moments; FP4CONVERT_TEST_KILL_AT=N SIGKILLs the process at the N-th step."""
    global _pauses
    delay = os.environ.get("FP4CONVERT_TEST_DELAY")
    if delay:
        time.sleep(float(delay))
    kill_at = os.environ.get("FP4CONVERT_TEST_KILL_AT")
    if kill_at:
        with _pause_lock:
            _pauses += 1
            if _pauses == int(kill_at):
                os.kill(os.getpid(), 9)


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
                hashes[f] = file_digest(source.root / f)
            except OSError as exc:
                raise source_error(exc, source.root / f) from exc
        identity[FULL_HASHES] = hashes
    return identity


def _identity_mismatch(dst: Path, old: dict, new: dict, verify_source: bool) -> str | None:
    """Why a run recorded as ``old`` cannot be resumed as ``new`` (None: it can): names the setting with
    both values, or the changed source file."""
    if not isinstance(old, dict):
        return f"{dst}: the progress record holds no run identity; use --overwrite to start again"
    os_, ns = old.get("settings"), new.get("settings")
    if os_ != ns:
        if isinstance(os_, dict):
            diffs = [f"{k} was {os_.get(k)!r}, now {ns.get(k)!r}" for k in sorted(set(os_) | set(ns))
                     if os_.get(k) != ns.get(k)]
        else:
            diffs = ["unreadable"]
        return (f"{dst} was started with other settings ({'; '.join(diffs)}); --resume needs the same ones "
                "(or use --overwrite to start again)")
    osrc, nsrc = old.get("source"), new.get("source")
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
# Destination policy
# ---------------------------------------------------------------------------------------------

@dataclass
class _Session:
    """A locked destination: released by finish() or by a failure in write_outputs()/finish()."""

    dst: Path
    fd: int
    created: list[Path]  # folders this run created (innermost last)

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            (self.dst / LOCK_NAME).unlink(missing_ok=True)  # still held: no one else can be using it
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1
        _SESSIONS.pop(_key(self.dst), None)

    def fail(self) -> None:
        """A failed run: drop the lock; remove what it created if it holds nothing."""
        self.release()
        for d in reversed(self.created):
            try:
                d.rmdir()  # only when empty
            except OSError:
                break


_SESSIONS: dict[str, _Session] = {}


def _key(dst: Path) -> str:
    return os.path.abspath(dst)


def _contained(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_paths(dst: Path, source: Source) -> None:
    """DST inside SRC, SRC inside DST, or the same folder: refused before anything is written."""
    d, s = dst.resolve(), source.root.resolve()
    if d == s:
        raise OutputError(f"{dst} is the source folder; choose another destination")
    if _contained(d, s):
        raise OutputError(f"{dst} is inside the source folder {source.root}; fp4convert never writes into its "
                          "source: choose a destination outside it")
    if _contained(s, d):
        raise OutputError(f"the source {source.root} is inside the destination {dst}; choose a destination "
                          "that does not contain the source")


def _make_dst(dst: Path) -> list[Path]:
    """Create DST (and missing parents); the folders created, outermost first."""
    if dst.is_symlink() and not dst.exists():
        raise OutputError(f"{dst} is a symlink to {os.readlink(dst)}, which does not exist; create that folder "
                          "or choose another DST")
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst} exists and is not a folder; choose another DST")
    missing = []
    p = Path(os.path.abspath(dst))
    while not p.exists() and not p.is_symlink():
        missing.append(p)
        p = p.parent
    if p.exists() and not p.is_dir():
        raise OutputError(f"{dst}: {p} is a file, not a folder; choose another DST")
    created = []
    for d in reversed(missing):
        with writing(d, resumable=False):
            try:
                d.mkdir()
            except FileExistsError:
                continue  # a concurrent run made it: the lock decides who goes on
        created.append(d)
    return created


def _lock(dst: Path) -> int:
    """flock DST/.fp4convert.lock (the kernel releases it if we die); refuse while another run holds it."""
    path = dst / LOCK_NAME
    while True:
        try:
            # O_NOFOLLOW: a symlink there (dangling or not) is refused, never truncated nor created through.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _through_link(dst, LOCK_NAME) from None
            raise output_error(exc, path, resumable=False) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OutputError(f"{path} is not a regular file; fp4convert keeps its lock there: remove it or "
                              "choose another DST")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise OutputError(f"{dst} is in use by another fp4convert run (pid {pid}, lock {path}); wait for it "
                              "to finish or choose another DST") from None
        except OSError as exc:
            os.close(fd)
            raise output_error(exc, path, resumable=False) from exc
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino  # not a lock file a finishing run just removed
        except FileNotFoundError:
            same = False
        if same:
            with writing(path, resumable=False):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def prepare_destination(dst: Path, plan: Plan, config: ConvertConfig, identity: dict, source: Source) -> dict:
    """Check, lock and (for --overwrite) clean DST as the flags say; return the finished files a resume may reuse.

    The lock and the cleanup of a failed run are handed to :func:`write_outputs` and :func:`finish`.
    """
    dst = Path(dst)
    check_paths(dst, source)
    created = _make_dst(dst)
    try:
        fd = _lock(dst)
    except BaseException:
        for d in reversed(created):
            try:
                d.rmdir()
            except OSError:
                break
        raise
    session = _Session(dst, fd, created)
    _SESSIONS[_key(dst)] = session
    try:
        return _check_destination(dst, plan, config, identity, source)
    except BaseException:
        session.fail()
        raise


def _planned_names(plan: Plan, source: Source, dst: Path) -> set[str]:
    """Every file (relative path) a run writes into DST."""
    names = {f for f, _ in plan.shards} | {INDEX_NAME, MANIFEST_NAME, PROGRESS_NAME, LOCK_NAME, *FORMAT_FILES}
    names |= {p.relative_to(source.root).as_posix() for p in source.other_files(exclude=dst)}
    return names


def _dst_files(dst: Path) -> list[str]:
    """Every entry below DST (files, symlinks, and folders that hold no files), relative posix names."""
    out = []
    for root, dirs, files in os.walk(dst):
        rel_root = Path(root).relative_to(dst)
        for name in files:
            out.append((rel_root / name).as_posix())
        for name in list(dirs):
            p = Path(root) / name
            if p.is_symlink():
                out.append((rel_root / name).as_posix())
                dirs.remove(name)
    return sorted(out)


def _read_record(path: Path, kind: str) -> tuple[dict | None, str | None]:
    """(the record, None) if ``path`` holds a valid manifest/progress record, else (None, why not)."""
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
        elif any(not isinstance(r, dict) or not isinstance(r.get("sha256"), str) or not isinstance(r.get("size"), int)
                 for r in obj["files"].values()):
            why = "a file record is malformed"
        elif not all(isinstance(n, str) for n in obj.get("pending", [])):
            why = "its pending list is malformed"
    return (obj, None) if why is None else (None, f"{path.name}: {why}")


def _owned(dst: Path, records: list[dict], files: list[str]) -> set[str]:
    """The files in DST this tool wrote, as a valid record proves: our own control files, shard-named
    files and the index, and other listed files whose bytes still match the recorded checksum."""
    owned = {LOCK_NAME} & set(files)
    if not records:
        return owned
    listed: dict[str, dict | None] = {}
    for r in records:
        for name, rec in r.get("files", {}).items():
            listed[name] = rec
    for r in records:
        # A progress record names what finish is about to write before it writes any of it, so a name
        # there is ours whatever bytes it holds now (a resumed finish killed mid-way leaves the source's
        # README.md or config.json where the manifest recorded the generated ones).
        for name in r.get("pending", []):
            if not name.endswith(".safetensors") or _SHARD_NAME.match(name):
                listed[name] = None
    ours_by_name = {MANIFEST_NAME, PROGRESS_NAME, INDEX_NAME, LOCK_NAME}

    def is_ours(name: str) -> bool:
        if name in ours_by_name or _RANK_RECORD.match(name) or (_SHARD_NAME.match(name) and name in listed):
            return True
        if name not in listed:
            return False
        rec = listed[name]
        if rec is None:  # named in the progress record before finish wrote it
            return True
        p = dst / name
        try:
            return (p.is_file() and not p.is_symlink() and p.stat().st_size == rec.get("size")
                    and file_digest(p) == rec.get("sha256"))
        except OSError:
            return False

    for name in files:
        base = name[: -len(".partial")] if name.endswith(".partial") else name
        if is_ours(base) or (base != name and _SHARD_NAME.match(base)):
            owned.add(name)
    return owned


def _check_destination(dst: Path, plan: Plan, config: ConvertConfig, identity: dict, source: Source) -> dict:
    files = _dst_files(dst)
    existing = [f for f in files if f != LOCK_NAME]
    done: dict = {}
    if existing and not (config.overwrite or config.resume):
        raise OutputError(f"{dst} exists and is not empty; pass --overwrite to replace it or --resume to continue")
    records, damaged, progress = [], [], []
    names = [(MANIFEST_NAME, "manifest"), (PROGRESS_NAME, "progress")]
    names += [(p.name, "progress") for p in progress_records(dst) if p.name != PROGRESS_NAME]  # torchrun ranks
    for name, kind in names:
        if os.path.islink(dst / name):  # never read (nor trusted) through a symlink
            raise _through_link(dst, name)
        if (dst / name).is_file():
            rec, why = _read_record(dst / name, kind)
            if rec is not None:
                (records if kind == "manifest" else progress).append(rec)
            else:
                damaged.append(why)
        elif (dst / name).exists():
            raise OutputError(f"{dst / name} is not a file; remove it or choose another DST")
    owned = _owned(dst, records + progress, files)
    if progress:  # one record, or the merged records of an interrupted torchrun's ranks
        records.append(progress[0] if len(progress) == 1 else merge_states(progress))
    planned = _planned_names(plan, source, dst)
    foreign = []
    for f in existing:
        base = f[: -len(".partial")] if f.endswith(".partial") else f
        if f not in owned and (base in planned or f.endswith((".safetensors", ".safetensors.index.json"))):
            foreign.append(f)  # we would overwrite it, or loaders would take it for weights
    for p in sorted(planned):  # a folder (or a file) in the way of a file we write
        q = dst / p
        if q.is_dir() and not q.is_symlink():
            foreign.append(p + "/")
        for parent in list(Path(p).parents)[:-1]:
            if os.path.islink(dst / parent):  # a symlinked folder would send our files outside DST
                raise _through_link(dst, parent.as_posix())
            if (dst / parent).exists() and not (dst / parent).is_dir():
                foreign.append(parent.as_posix())
    why = f" ({'; '.join(damaged)})" if damaged else ""
    if foreign:
        names = sorted(set(foreign))
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise OutputError(f"{dst} holds files fp4convert did not write (no valid manifest or progress record lists "
                          f"them{why}): {shown}; remove them or choose another folder")
    if damaged and config.resume:
        raise OutputError(f"{dst}: {'; '.join(damaged)}; --resume cannot trust this folder: remove it (or the "
                          "damaged file) or choose another DST")
    if existing and config.overwrite:
        for f in sorted(owned - {LOCK_NAME}):
            with writing(dst / f, resumable=False):
                (dst / f).unlink(missing_ok=True)
        done = {}
    elif existing and config.resume:
        done = _resumable(dst, records, identity, config)
    _check_space(dst, plan, source, done)
    return done


def _check_space(dst: Path, plan: Plan, source: Source, done: dict) -> None:
    """Every byte the run writes: shard headers and data, copied files, format files, index, manifest, record."""
    need = 0
    for f, entries in plan.shards:
        if f not in done:
            need += len(header_bytes(entries, {"format": "pt"})) + sum(e.nbytes for e in entries)
    for p in source.other_files(exclude=dst):
        try:
            need += p.stat().st_size
        except OSError as exc:
            raise source_error(exc, p) from exc
    n_out = sum(len(d.outputs) for d in plan.decisions)
    index_est = 100 * n_out + 1000
    manifest_est = 600 * len(plan.decisions) + 120 * n_out + 300 * (len(plan.shards) + 20) + 8000
    record_est = 200 * len(plan.decisions) + 200 * len(plan.shards) + 4000
    need += index_est + manifest_est + 2 * record_est + (64 << 10)  # + config files, the lock: slack
    try:
        free = shutil.disk_usage(dst).free
    except OSError as exc:
        raise output_error(exc, dst, resumable=False) from exc
    if need > free:
        raise OutputError(f"{dst}: needs {human_bytes(need)} for the output, only {human_bytes(free)} free; "
                          "free some space or choose another folder")


def rank_progress_name(rank: int) -> str:
    """Under torchrun each rank keeps its own progress record (no write race); rank 0 merges them."""
    return PROGRESS_NAME.replace(".json", f".rank{rank}.json")


def progress_records(dst: Path) -> list[Path]:
    """The progress record of an interrupted run: one file, and/or one per rank (any number of ranks)."""
    try:
        return sorted(p for p in dst.iterdir() if p.name == PROGRESS_NAME or _RANK_RECORD.match(p.name))
    except OSError as exc:
        raise output_error(exc, dst, resumable=False) from exc


def merge_states(states: list[dict]) -> dict:
    """Several progress records (ranks) as one; they must share one identity."""
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


def _resumable(dst: Path, records: list[dict], identity: dict, config: ConvertConfig) -> dict:
    """Finished shards of an interrupted run with the same settings and source, re-verified by checksum."""
    state = records[-1] if records else None  # the progress record when there is one, else the manifest
    if state is None:
        return {}
    mismatch = _identity_mismatch(dst, state.get("identity"), identity, getattr(config, "verify_source", False))
    if mismatch:
        raise OutputError(mismatch)
    done = {}
    for f, rec in state.get("files", {}).items():
        if not _SHARD_NAME.match(f):
            continue
        p = dst / f
        partial = p.with_name(p.name + ".partial")
        try:
            # lstat only: a symlink in place of a shard (or its .partial) is never reused nor renamed into place
            if not os.path.lexists(p) and is_regular(partial) and partial.stat().st_size == rec["size"] \
                    and file_digest(partial) == rec["sha256"]:
                rename_in(dst, partial.name, p.name)  # recorded as finished just before its rename: finish it
            if is_regular(p) and p.stat().st_size == rec["size"] and file_digest(p) == rec["sha256"]:
                done[f] = {"sha256": rec["sha256"], "size": rec["size"]}
                continue
        except OSError as exc:
            raise output_error(exc, p) from exc
        log.info("resume: %s is missing or differs, rewriting it", f)
    done["__tensors__"] = state.get("tensors", {})
    done["__pending__"] = list(state.get("pending", []))  # files an interrupted finish may have written
    return done


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------

def _copy_file(src: Path, target: Path, source: Source, dst: Path) -> None:
    """Copy a whole file of the source to ``target`` (a ``.partial`` name inside DST), telling a read error
    (the source's) from a write error (the destination's). Both ends are contained: the source file is
    opened through :meth:`Source.open_file` (never outside SRC), the target with :func:`open_new`."""
    fd = source.open_file(src.relative_to(source.root).as_posix(), "file")
    with os.fdopen(fd, "rb") as fin:
        out = open_new(dst, target.relative_to(dst).as_posix())
        with writing(target):
            fout = os.fdopen(out, "wb")
        with fout:
            while True:
                try:
                    block = fin.read(_COPY_CHUNK)
                except OSError as exc:
                    raise source_error(exc, src) from exc
                if not block:
                    break
                with writing(target):
                    fout.write(block)
            with writing(target):
                fout.flush()


def _nonfinite(dtype: str, block: bytes | bytearray | memoryview) -> bool:
    """Does this chunk of a kept tensor's bytes hold NaN or Inf? One vectorized min/max pass: a NaN
    propagates into both, an Inf is the min or the max. (``isfinite().all()`` was 44x slower on
    bf16 and took 30% of the writer thread on a checkpoint with large kept embeddings.)"""
    import math

    import torch

    if dtype in ("F64", "F32", "F16", "BF16"):
        t = torch.frombuffer(block, dtype=torch_dtypes()[dtype]) if len(block) else None
        if t is None:
            return False
        lo, hi = torch.aminmax(t)
        return not (math.isfinite(lo.item()) and math.isfinite(hi.item()))
    if dtype in ("F8_E4M3", "F8_E5M2"):
        u = torch.frombuffer(block, dtype=torch.uint8)
        if dtype == "F8_E4M3":
            return bool(((u & 0x7F) == 0x7F).any())
        return bool(((u & 0x7C) == 0x7C).any())
    return False


_FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # the dtypes whose kept bytes are scanned for NaN/Inf


class _Chunk:
    """A pooled copy buffer: back in the pool when the last holder (the file's hasher) lets go."""

    def __init__(self, pool: _ChunkPool | None, buf: bytearray) -> None:
        self.buf, self._pool = buf, pool

    def __del__(self) -> None:
        if self._pool is not None:
            self._pool.put(self.buf)


class _ChunkPool:
    """Reused kept-copy buffers: a fresh bytearray is zero-filled under the GIL (~3 ms per 16 MB,
    stalling every other thread), and these are few (the hash backlog bounds those in flight)."""

    def __init__(self, size: int) -> None:
        self.size, self._free, self._lock = size, [], threading.Lock()

    def get(self, n: int) -> _Chunk:
        """A buffer of at least ``n`` bytes: a pooled full-size one, or (the last, short chunk of a
        tensor: a norm's few KB) one of its own size, so a small kept tensor never costs a full chunk."""
        if n < self.size:
            return _Chunk(None, bytearray(n))
        with self._lock:
            buf = self._free.pop() if self._free else None
        return _Chunk(self, buf if buf is not None else bytearray(self.size))

    def put(self, buf: bytearray) -> None:
        with self._lock:
            self._free.append(buf)


_chunks = _ChunkPool(_COPY_CHUNK)


@functools.cache
def _loader():
    from concurrent.futures import ThreadPoolExecutor

    # Each kept copy waits for its own next chunk; several threads serve lanes copying side by side.
    return ThreadPoolExecutor(4, thread_name_prefix="fp4convert-copy-read")


def _stream_writer(dst: Path, f: str, entries: list) -> StreamWriter:
    """A shard's StreamWriter on a ``.partial`` file this run created itself (:func:`open_new`: whatever
    an interrupted run left there, a symlink included, is removed first, never written through); the
    file the writer opened is checked to be that one."""
    fd = open_new(dst, f + ".partial")
    try:
        with writing(dst / f):
            w = StreamWriter(dst / f, entries, {"format": "pt"})
        mine, got = os.fstat(fd), os.fstat(w._f.fileno())
        if (mine.st_dev, mine.st_ino) != (got.st_dev, got.st_ino):
            w.abort()
            raise OutputError(f"{w.partial} was replaced while fp4convert opened it (another process writes into "
                              f"{dst}?); nothing was written through it: stop the other writer and --resume")
        return w
    finally:
        os.close(fd)


class ShardWriters:
    """Open output shards (at most two at once: a unit can straddle a boundary)."""

    def __init__(self, dst: Path, plan: Plan, done: dict, on_close: Callable[[str, dict], None],
                 owns: Callable[[str], bool] | None = None,
                 nonfinite: Callable[[str, memoryview], bool] | None = None) -> None:
        self.dst, self.done, self.on_close = dst, done, on_close
        self.check = nonfinite or _nonfinite  # (dtype, bytes) -> NaN/Inf present; the torch-free path brings its own
        self.owns = owns or (lambda f: True)  # under torchrun: the shards this rank writes
        self.entries = dict(plan.shards)
        self.shard_of = plan.shard_of()
        self.open: dict[str, StreamWriter] = {}
        self.closing: list = []  # futures of finished shards' closes (on each file's hasher thread)
        self.nonfinite: dict[str, str] = {}  # kept tensors copied with NaN/Inf: name -> source file

    def skip(self, name: str) -> bool:
        f = self.shard_of[name]
        return f in self.done or not self.owns(f)

    def _writer(self, name: str) -> StreamWriter:
        self._check_closing()
        f = self.shard_of[name]
        if f not in self.open:
            try:
                self.open[f] = _stream_writer(self.dst, f, self.entries[f])
            except BaseException:
                (self.dst / (f + ".partial")).unlink(missing_ok=True)
                raise
        return self.open[f]

    def _maybe_close(self, f: str) -> None:
        w = self.open[f]
        if not w.complete:
            return
        # Flushed here (the last write's thread), so a killed process leaves the whole .partial for
        # --resume; the rest runs on the file's hasher thread once its hash is complete, while the
        # writer goes on: record the finished shard (checksum, size) first, then fsync and rename it.
        # An interruption in between leaves a record that --resume can use (it checks the file).
        with writing(w.partial):
            w.flush()
        del self.open[f]

        def close(sha256: str) -> None:
            self.on_close(f, {"sha256": sha256, "size": w.size})
            _test_pause()
            with writing(self.dst / f):
                w.close()
            log.info("wrote %s (%s)", f, human_bytes(w.size))

        self.closing.append((w, w.then(close)))

    def _check_closing(self) -> None:
        """Raise a finished shard's close error now (fsync and rename run beside the writes)."""
        for _, fut in self.closing:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def wait_closed(self) -> None:
        """Every finished shard recorded, synced and renamed; raises the first close error."""
        for _, fut in self.closing:
            fut.result()

    def tensor(self, name: str, t: torch.Tensor | bytes | memoryview, owner: object = None) -> None:
        """Write output tensor ``name``: a tensor, or its raw bytes (``owner`` keeps their memory alive)."""
        if self.skip(name):
            return
        w = self._writer(name)
        with writing(w.partial):
            if isinstance(t, (bytes, bytearray, memoryview)):
                w.write_bytes(name, t, owner)
            else:
                w.write_tensor(name, t)
        self._maybe_close(self.shard_of[name])

    def raw(self, name: str, path: Path, info: TensorInfo) -> None:
        """Copy a kept tensor's bytes unchanged, checking floats for NaN/Inf as they stream."""
        with stages.timed("copy_kept"):
            self._raw(name, path, info)

    def _raw(self, name: str, path: Path, info: TensorInfo) -> None:
        # A unit re-done on resume (its shard was finished, its record was not saved yet) is read again
        # for the NaN/Inf check only, so its warning is the same as in an uninterrupted run.
        w = None if self.skip(name) else self._writer(name)
        if w is not None:
            w._expect(name, info.nbytes)
        elif not self.owns(self.shard_of[name]) or info.dtype not in _FLOATS:
            return
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise source_error(exc, path) from exc
        check = self.check if info.dtype in _FLOATS else None

        def load(offset: int, n: int) -> tuple[_Chunk, memoryview, bool]:
            """Read one chunk into a pooled buffer and scan it (on the loader thread)."""
            chunk = _chunks.get(n)
            view = memoryview(chunk.buf)[:n]
            got = 0
            while got < n:
                try:
                    k = os.preadv(fh.fileno(), [view[got:]], offset + got)
                except OSError as exc:
                    raise source_error(exc, path) from exc
                if not k:
                    raise SourceError(f"{info.file}: tensor {name!r} is truncated (the file ended while copying it)")
                got += k
            return chunk, view, bool(check and check(info.dtype, view))

        # The next chunk is read and scanned on a loader thread while this one is written (the writer
        # thread writes and nothing else: it is the pipeline's bottleneck on a fast GPU).
        parts = [(info.begin + o, min(_COPY_CHUNK, info.nbytes - o)) for o in range(0, info.nbytes, _COPY_CHUNK)]
        bad = False
        with fh:
            ahead = _loader().submit(load, *parts[0]) if parts else None
            for k in range(len(parts)):
                chunk, view, flagged = ahead.result()
                ahead = _loader().submit(load, *parts[k + 1]) if k + 1 < len(parts) else None
                bad = bad or flagged
                if w is not None:
                    with writing(w.partial):
                        w.write(view, owner=chunk)
                del chunk, view
            if ahead is not None:
                ahead.result()
        if bad:
            self.nonfinite[name] = info.file
        if w is not None:
            self._maybe_close(self.shard_of[name])

    def abort(self) -> None:
        for w, fut in self.closing:  # a close in flight finishes (its record may already be saved)
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the run is failing already; keep the .partial for --resume
                pass
        for w in self.open.values():
            try:
                w.abort()
            except OSError:
                pass
        self.open.clear()


def nonfinite_warning(name: str, file: str) -> str:
    return f"{name} (kept unquantized, in {file}) holds NaN or Inf values; they were copied unchanged"


def write_outputs(plan: Plan, dst: Path, identity: dict, done: dict, progress: Progress, process: UnitFn,
                  start: Callable[[list[list[Decision]]], None] | None = None, *,
                  owns: Callable[[str], bool] | None = None, progress_name: str = PROGRESS_NAME,
                  drain: Callable[[bool], None] | None = None,
                  nonfinite: Callable[[str, memoryview], bool] | None = None,
                  reports: Callable[[list[Decision]], bool] | None = None,
                  lane: int | None = None) -> tuple[dict, dict]:
    """Stream every work unit's outputs into the planned shards; ``process`` makes a unit's tensors.

    ``start`` is told up front which units will be processed (those a resume does not skip), so
    their reading can begin ahead of time. On failure the open shards are removed and DST released.
    Under torchrun, ``owns`` selects the shards this rank writes and ``progress_name`` is this rank's
    own progress record (and ``reports`` the units whose progress this one tells, when several
    share a progress bar; ``lane``: one of several lanes, which log the plan's warnings once (lane 0),
    leave the NaN/Inf warnings and DST's lock to their caller, once every lane stopped). ``drain(True)`` waits for the writes ``process`` queued (a write-behind
    thread); ``drain(False)`` runs what is queued, then stops, before an abort. Returns this run's
    (files, tensors) records.
    """
    session = _SESSIONS.get(_key(dst)) if lane is None else None
    for w in plan_warnings(plan) if not lane else []:
        log.warning("warning: %s", w)
    tensors_state: dict = dict(done.get("__tensors__", {}))
    files_state = {f: rec for f, rec in done.items() if not f.startswith("__")}
    # A resumed run keeps naming the files an interrupted finish wrote, until its own finish does:
    # without them, a run killed before reaching finish left files no record claimed.
    finish_files = list(done.get("__pending__", [])) or None
    lock = threading.RLock()  # on_close and the NaN/Inf flags may come from a write-behind thread
    warned: set[str] = set()

    def flag_nonfinite() -> None:
        """Kept tensors found holding NaN/Inf (the copy may run in the writer thread): flag their records."""
        with lock:
            for n, file in list(writers.nonfinite.items()):
                if n in tensors_state and not tensors_state[n].get("nonfinite"):
                    tensors_state[n] = {**tensors_state[n], "nonfinite": True}
                if n not in warned:
                    warned.add(n)
                    log.warning("warning: %s", nonfinite_warning(n, file))

    def save() -> None:
        with lock:
            flag_nonfinite()
            _save_progress(dst, identity, files_state, tensors_state, finish_files, progress_name)

    def on_close(f: str, rec: dict) -> None:
        with lock:
            files_state[f] = rec
            save()

    writers = ShardWriters(dst, plan, files_state, on_close, owns, nonfinite)
    shard_of = writers.shard_of

    def finished(unit: list[Decision]) -> bool:
        outputs = [e.name for d in unit for e in d.outputs]
        mine = [d for d in unit if any(writers.owns(shard_of[e.name]) for e in d.outputs)]
        return all(writers.skip(n) for n in outputs) and all(d.name in tensors_state for d in mine)

    try:
        save()  # a record exists before any shard does
        units = plan.units()
        pending = [u for u in units if not finished(u)]
        if start is not None:
            start(pending)
        pending_ids = {id(u) for u in pending}
        for unit in units:
            told = reports is None or reports(unit)
            if id(unit) not in pending_ids:
                if told:
                    progress(sum(d.info.nbytes for d in unit))
                continue
            records = process(unit, writers)
            with lock:
                for n, rec in records.items():
                    tensors_state[n] = {**rec, "nonfinite": True} if n in writers.nonfinite else rec
                flag_nonfinite()
            if told:
                progress(sum(d.info.nbytes for d in unit))
            _test_pause()
        if drain is not None:
            drain(True)
        writers.wait_closed()
        if writers.open:  # the plan and the work disagree: never leave this silently
            raise RuntimeError("internal: output shards left incomplete")
        save()
    except BaseException as exc:
        if drain is not None:
            drain(False)
        writers.abort()
        if not files_state:  # nothing finished: nothing to resume, leave no trace
            (dst / progress_name).unlink(missing_ok=True)
        (dst / (progress_name + ".partial")).unlink(missing_ok=True)
        if session is not None:
            session.fail()
        if isinstance(exc, OSError) and not isinstance(exc, FP4ConvertError):
            where = Path(exc.filename) if exc.filename else None
            if where is not None and _contained(Path(os.path.abspath(where)), Path(os.path.abspath(dst))):
                raise output_error(exc, where) from exc
            raise source_error(exc, where or "a source file") from exc
        raise
    for n, rec in tensors_state.items() if lane is None else ():  # lanes: added once all are done (fp4convert.lanes)
        if rec.get("nonfinite"):
            d = plan.by_name.get(n)
            w = nonfinite_warning(n, d.info.file if d else "?")
            if w not in plan.warnings:
                plan.warnings.append(w)
    return files_state, tensors_state


def release(dst: Path, failed: bool = True) -> None:
    """Drop this process's hold on DST (a torchrun rank 0 whose other rank failed before finish)."""
    session = _SESSIONS.get(_key(Path(dst)))
    if session is not None:
        session.fail() if failed else session.release()


def plan_warnings(plan: Plan) -> list[str]:
    """The plan's warnings and every --ignore/--only pattern that matches no tensor (a typo, usually)."""
    from .plan import matches

    out = list(plan.warnings)
    for flag, patterns in (("--ignore", plan.config.ignore), ("--only", plan.config.only)):
        for p in patterns:
            if not any(matches(p, d.name) for d in plan.decisions):
                out.append(f"{flag} {p} matches no tensor")
    return out


def _save_progress(dst: Path, identity: dict, files: dict, tensors: dict, pending: list[str] | None = None,
                   name: str = PROGRESS_NAME) -> None:
    state = {"identity": identity, "files": files, "tensors": tensors}
    if pending:
        state["pending"] = pending
    with writing(dst / name):  # compact: json's C encoder (indent falls back to pure Python, ~0.2 MB per save
        # on a MoE, under the GIL, once per finished shard)
        atomic_write(dst / name, json.dumps(state, sort_keys=True, separators=(",", ":")))


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a .partial file and rename it into place (never through a symlink: :func:`write_new`)."""
    write_new(path.parent, path.name, text.encode())


# ---------------------------------------------------------------------------------------------
# Finish: other files, the format's files, index, manifest
# ---------------------------------------------------------------------------------------------

def finish(source: Source, plan: Plan, fmt: OutputFormat, dst: Path, identity: dict) -> None:
    """Other files, the index, then the manifest (last: its presence means 'finished'); releases DST."""
    session = _SESSIONS.get(_key(dst))
    try:
        with stages.timed("finish"):
            _finish(source, plan, fmt, dst, identity)
    except BaseException as exc:
        for name in _planned_names(plan, source, dst) - {f for f, _ in plan.shards}:  # only our own temporary files
            try:
                unlink_in(dst, name + ".partial")
            except (OSError, OutputError):
                pass
        if session is not None:
            session.fail()
        if isinstance(exc, OSError) and not isinstance(exc, FP4ConvertError):
            raise output_error(exc, exc.filename or dst) from exc
        raise
    if session is not None:
        session.release()


def _finish(source: Source, plan: Plan, fmt: OutputFormat, dst: Path, identity: dict) -> None:
    state = json.loads((dst / PROGRESS_NAME).read_text())
    others = source.other_files(exclude=dst)
    rels = [p.relative_to(source.root).as_posix() for p in others]
    # Name every file finish writes in the record first: --overwrite then knows they are ours.
    _save_progress(dst, identity, state["files"], state["tensors"],
                   sorted({*state.get("pending", []), INDEX_NAME, *rels, *FORMAT_FILES}))
    written = [INDEX_NAME]
    for p, rel in zip(others, rels):
        written.append(rel)
        _copy_file(p, dst / (rel + ".partial"), source, dst)
        rename_in(dst, rel + ".partial", rel)
        _test_pause()
    # The format's files are written by path (formats.base.write_json): no symlink may stand where it
    # writes or reads (config.json is a regular file once copied; the temporary names are ours).
    for name in FORMAT_FILES:
        unlink_in(dst, name + ".partial")
        if os.path.islink(dst / name):
            unlink_in(dst, name)
    with writing(dst):
        written += fmt.finalize(dst, plan.output_info(source.config()))
    shard_of = plan.shard_of()
    total = sum(e.nbytes for _, entries in plan.shards for e in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(shard_of.items()))}
    with writing(dst / INDEX_NAME):
        atomic_write(dst / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    _test_pause()
    with writing(dst / MANIFEST_NAME):
        written = _write_model_card(source, plan, fmt, dst, identity, state, written)
        manifest = build_manifest(plan, fmt, source, identity, state, dst, written)
        atomic_write(dst / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _test_pause()
    with writing(dst / PROGRESS_NAME):
        (dst / PROGRESS_NAME).unlink()


def _write_model_card(source: Source, plan: Plan, fmt: OutputFormat, dst: Path, identity: dict, state: dict,
                      written: list[str]) -> list[str]:
    """README.md: the generated card (from what the manifest will say) above the source's own card.

    The source card is read contained (:meth:`Source.read_card`); it counts as our own earlier card
    (exporting a native output) only when the source's manifest lists its sha256."""
    from .modelcard import CARD_NAME, build_card, default_base_model, own_card, split_card

    text = source.read_card()
    src_manifest = _source_manifest(source)
    ours = own_card(text, src_manifest) if text else False
    origin = src_manifest.get("source") if ours and isinstance(src_manifest.get("source"), dict) else None
    draft = build_manifest(plan, fmt, source, identity, state, dst, [w for w in written if w != CARD_NAME])
    config = source.config()
    base = getattr(plan.config, "base_model", None) or default_base_model(
        origin or source.describe(), source.root, config, split_card(text)[0] if ours else None)
    write_new(dst, CARD_NAME, build_card(draft, text, base_model=base, config=config, original_is_ours=ours,
                                         origin=origin).encode())
    return written if CARD_NAME in written else [*written, CARD_NAME]


def _source_manifest(source: Source) -> dict | None:
    """The source's fp4convert manifest (exporting a native output), read contained; None if absent or unreadable."""
    if not os.path.lexists(source.root / MANIFEST_NAME):
        return None
    try:
        fd = source.open_file(MANIFEST_NAME, "the manifest")
    except SourceError:
        return None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_MANIFEST + 1)
    try:
        m = json.loads(data) if len(data) <= MAX_MANIFEST else None
    except (ValueError, RecursionError):
        return None
    return m if isinstance(m, dict) else None
