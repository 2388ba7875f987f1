"""Where a checkpoint comes from: a local folder or a Hugging Face Hub repo.

Planning reads only safetensors headers. Shard data is fetched through ``huggingface_hub`` (token,
cache, offline mode and endpoint from its usual environment variables), one shard at a time in the
order the run reads them, a few shards ahead of the conversion (:meth:`Source.prefetch`,
:mod:`fp4convert.source.prefetch`), or on first use where nothing prefetches (inspect, export).

Containment: every file read resolves (``os.path.realpath``) inside the checkpoint folder, or, for a
Hub source, inside that repo's snapshot folder or its blob store in the HF cache (snapshot entries
are symlinks into ``../../blobs``). Weight files and index entries that leave it are refused; other
files that leave it are not copied (skipped with a warning).

Which non-weight files are copied is one pure rule, :func:`copy_rule`, for local folders and Hub
snapshots alike; the Hub download's ``ignore_patterns`` (:func:`hub_ignore_patterns`) only skip
downloading files the rule would never copy.
"""

from __future__ import annotations

import difflib
import errno
import logging
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import CheckpointFormatError, CheckpointIndexError, FP4ConvertError, OutsideSourceError, SourceError
from fp4convert.source.config_json import check_types
from fp4convert.source.prefetch import AHEAD, Cancelled, Prefetcher
from fp4convert.storage.names import INDEX_NAME, LOCK_NAME, MANIFEST_NAME, OWN_FILES, PROGRESS_NAME  # noqa: F401
from fp4convert.storage.reads import read_header
from fp4convert.storage.safetensors import TensorInfo, header_length, parse_header
from fp4convert.storage.strict_json import json_error, json_kind, loads_bounded, loads_strict

if TYPE_CHECKING:
    from fp4convert.plan.types import Decision

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Weight files of any format: never copied into the output, never downloaded with a Hub snapshot.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".hdf5", ".keras",
                   ".msgpack", ".gguf", ".ggml", ".onnx", ".onnx_data", ".onnx.data", ".tflite", ".ot", ".npz",
                   ".npy", ".pb", ".nemo", ".mlmodel")
# Folders that hold another framework's export (with its own config copies): skipped whole.
WEIGHT_DIRS = ("onnx", "openvino", "flax", "tf", "tensorflow", "coreml", "tflite")
SKIP_DIRS = ("__pycache__",)  # hidden folders (.git, .cache, ...) are skipped too
KEEP_HIDDEN = (".gitattributes",)  # the only dot-files copied (top level): LFS rules for a Hub upload
MAX_JSON_FILE = 100_000_000  # bytes; an index or config.json larger than this is not one
HEADER_CONNECTIONS = 8  # Hub header reads in flight at once (tiny range requests)
MAX_CARD = 4_000_000  # bytes; a source model card larger than this is not kept below ours
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def one_line(exc: BaseException, limit: int = 300) -> str:
    """huggingface_hub's multi-line messages (and signed URLs) folded into one short line."""
    text = " ".join(str(exc).split())
    text = re.sub(r"(https?://[^\s?]+)\?\S+", r"\1?...", text)  # drop signed query strings
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _q(name: object, limit: int = 120) -> str:
    s = str(name)
    return repr(s) if len(s) <= limit else repr(s[:limit]) + "..."


# ---------------------------------------------------------------------------------------------
# Paths: lexical checks, containment
# ---------------------------------------------------------------------------------------------

def check_relative(rel: object, what: str) -> str:
    """A file name from the checkpoint (index entry, listing) must be a plain relative path below it."""
    if not isinstance(rel, str) or not rel:
        raise OutsideSourceError(f"{what}: {_q(rel)} is not a file name")
    if "\0" in rel or "\\" in rel or not rel.isprintable():
        raise OutsideSourceError(f"{what}: {_q(rel)} has characters a checkpoint file name cannot have")
    if rel.startswith("/") or re.match(r"^[A-Za-z]:", rel):
        raise OutsideSourceError(f"{what}: {_q(rel)} is an absolute path; entries must be relative to the folder")
    parts = rel.split("/")
    if ".." in parts:
        raise OutsideSourceError(f"{what}: {_q(rel)} leads out of the checkpoint folder ('..')")
    if any(p in ("", ".") for p in parts):
        raise OutsideSourceError(f"{what}: {_q(rel)} is not a normalised relative path")
    return rel


ODD_NAME = "its name has characters a checkpoint file name cannot have (rename it to copy it)"


def _odd_name(rel: str) -> bool:
    """A name :func:`check_relative` refuses (tabs, newlines, ...): such a file is not copied, decided
    with the plan, rather than refused when the run opens it after the shards are written."""
    try:
        check_relative(rel, "file")
    except OutsideSourceError:
        return True
    return False


def _inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def cache_snapshot(root: Path) -> bool:
    """Is ``root`` a snapshot folder of the HF cache (``models--org--name/snapshots/<commit>``, beside
    ``blobs/``), as ``hf download`` prints it? Its files are symlinks into ``../../blobs``."""
    repo = root.parent.parent
    return (root.parent.name == "snapshots" and repo.name.startswith("models--")
            and os.path.isdir(repo / "blobs") and not os.path.islink(repo / "blobs"))


def _roots_for(root: Path, hub: bool) -> tuple[str, ...]:
    """Where reads may land: the folder; for a Hub snapshot (opened by repo id, or by the path
    ``hf download`` prints) also that repo's blob store, and nothing else of the cache."""
    roots = [os.path.realpath(root)]
    if hub or cache_snapshot(root):
        roots.append(os.path.realpath(root.parent.parent / "blobs"))  # models--org--name/snapshots/<commit>
    return tuple(roots)


def open_contained(root: Path, rel: str, roots: tuple[str, ...], what: str) -> int:
    """A read-only descriptor of root/``rel``, which must be a regular file whose real path lies inside
    ``roots``. The real path is opened from ``/`` one component at a time with O_NOFOLLOW, so the file
    opened is the one that was checked, whatever is renamed or relinked meanwhile; O_NONBLOCK, so a
    FIFO cannot hang the open (it is then refused as not a regular file)."""
    path = _contained(root, rel, roots, what)
    real = os.path.realpath(path)
    path_flag = getattr(os, "O_PATH", os.O_RDONLY)
    fd = os.open("/", path_flag | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parts = [p for p in real.split(os.sep) if p]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = (os.O_RDONLY | os.O_NONBLOCK) if last else (path_flag | os.O_DIRECTORY)
            nfd = os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceError(f"{what} {_q(rel)} is not a regular file")
        os.set_blocking(fd, True)
        out, fd = fd, -1
        return out
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OutsideSourceError(f"{what} {_q(rel)} changed while being opened (a symlink appeared in its "
                                     "path); fp4convert reads only files inside the checkpoint folder") from None
        raise SourceError(f"{what} {_q(rel)}: cannot read ({exc.strerror or exc})") from exc
    finally:
        if fd >= 0:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# Which non-weight files are copied
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CopyDecision:
    """One file (or folder, ending in '/') of the source and whether it goes into the output."""

    path: str  # relative to the checkpoint root, '/' separated
    copy: bool
    reason: str


def copy_rule(rel: str, skip_dirs: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether the non-weight file (or, ending in '/', the folder) ``rel`` is copied, and why. Pure.

    Copied: configs, tokenizer files, chat templates, generation/processor configs, licences, README,
    custom code, images, ``.gitattributes`` -- anything that is not one of: a weight file of any format
    or its index, a folder of another framework's export, fp4convert's own files, a hidden file or
    folder, a folder in ``skip_dirs`` (nested fp4convert outputs, the destination; folder -> reason), or
    a name no checkpoint file can have (a tab, a newline: refused when opened, so decided here).
    """
    is_dir = rel.endswith("/")
    parts = rel.rstrip("/").split("/")
    dirs, leaf = (parts, "") if is_dir else (parts[:-1], parts[-1])
    for i in range(len(dirs)):
        d = "/".join(dirs[: i + 1])
        if skip_dirs and d in skip_dirs:
            return False, skip_dirs[d]
        low = dirs[i].lower()
        if dirs[i].startswith("."):
            return False, f"hidden folder {dirs[i]}/"
        if low in SKIP_DIRS:
            return False, f"cache folder {dirs[i]}/"
        if low in WEIGHT_DIRS:
            return False, f"folder {dirs[i]}/ holds another framework's weights"
    if is_dir:
        return (False, ODD_NAME) if _odd_name(rel.rstrip("/")) else (True, "folder searched")
    low = leaf.lower()
    if leaf in OWN_FILES or low.endswith(".partial"):
        return False, "fp4convert's own file"
    if leaf.startswith("."):
        if rel in KEEP_HIDDEN:
            return True, "repository metadata"
        return False, "hidden file"
    if low.endswith(".safetensors"):
        return False, "weight file (the output has its own)"
    if low.endswith(".index.json") and low[: -len(".index.json")].endswith(WEIGHT_SUFFIXES):
        return False, "weight index (the output has its own)" if low.endswith(".safetensors.index.json") \
            else "index of another weight format"
    for s in WEIGHT_SUFFIXES:
        if low.endswith(s):
            return False, f"another weight format ({s})"
    return (False, ODD_NAME) if _odd_name(rel) else (True, "not a weight file")


def hub_ignore_patterns() -> list[str]:
    """``snapshot_download`` ignore patterns: only files :func:`copy_rule` refuses (weights first).

    fnmatch's ``*`` crosses '/', so ``*.bin`` covers every folder; folder rules name the top level and
    any depth. A file these miss is downloaded (it is small) and then judged by :func:`copy_rule`.
    """
    pats = ["*" + s for s in WEIGHT_SUFFIXES]
    pats += ["*" + s + ".index.json" for s in WEIGHT_SUFFIXES if s != ".safetensors"]
    for d in (*WEIGHT_DIRS, *SKIP_DIRS, ".git", ".cache"):
        pats += [f"{d}/*", f"*/{d}/*"]
    return pats


# ---------------------------------------------------------------------------------------------
# JSON files of the checkpoint
# ---------------------------------------------------------------------------------------------

def _read_json_file(path: Path, label: str, strict: bool) -> object:
    """A small JSON file -> value; every failure a one-line SourceError naming ``label``.

    ``strict`` also refuses duplicate keys and NaN/Infinity (the index); config.json is read as
    Python's json (and transformers) read it, apart from the nesting and size bounds.
    """
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise SourceError(f"{label} is a folder, not a JSON file")
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"{label} is not a regular file")
        if st.st_size > MAX_JSON_FILE:
            raise SourceError(f"{label}: {st.st_size} bytes is too large for a JSON file")
        raw = path.read_bytes()
    except OSError as exc:
        raise SourceError(f"{label}: cannot read ({exc.strerror or exc})") from exc
    try:
        return loads_strict(raw) if strict else loads_bounded(raw)
    except ValueError as exc:
        raise SourceError(f"{label}: {json_error(exc)}") from None


def _read_index(root: Path, roots: tuple[str, ...], label: str) -> dict[str, str]:
    """The index's weight_map (tensor -> file), every entry checked; raises on anything malformed."""
    where = f"{label}/{INDEX_NAME}" if label else INDEX_NAME
    _contained(root, INDEX_NAME, roots, "the weight index")
    data = _read_json_file(root / INDEX_NAME, where, strict=True)
    if not isinstance(data, dict):
        raise CheckpointIndexError(f"{where}: a {json_kind(data)}, not a JSON object")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointIndexError(f"{where}: 'weight_map' is missing or not an object")
    if not weight_map:
        raise CheckpointIndexError(f"{where}: 'weight_map' is empty; the index names no tensors")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointIndexError(f"{where}: tensor {_q(name)} maps to a {json_kind(file)}, not a file name")
        check_relative(file, f"{where}: tensor {_q(name)}")
        if not file.endswith(".safetensors"):
            raise CheckpointIndexError(f"{where}: tensor {_q(name)} maps to {_q(file)}, not a .safetensors file")
    return weight_map


def _contained(root: Path, rel: str, roots: tuple[str, ...], what: str) -> Path:
    """root/rel, after the lexical check and with its real path inside ``roots``."""
    check_relative(rel, what)
    path = root / rel
    real = os.path.realpath(path)
    if not _inside(real, roots):
        raise OutsideSourceError(
            f"{what} {_q(rel)} resolves to {real}, outside the checkpoint folder {root}; fp4convert reads only "
            "files inside it (copy the file in, e.g. with cp -L; for a Hub model, pass its repo id: it is read "
            "from the HF cache)")
    return path


# ---------------------------------------------------------------------------------------------
# The source
# ---------------------------------------------------------------------------------------------

@dataclass
class Source:
    """A checkpoint's weight files and other files, resolved to local paths on demand."""

    label: str  # what the user typed
    root: Path  # local folder holding the non-weight files
    weight_files: list[str]  # safetensors files, relative names, in index order
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    weight_map: dict[str, str] | None = None  # the index's tensor -> file, when there is an index
    roots: tuple[str, ...] = ()  # real paths every read must resolve inside (default: root's)
    token: str | None = None  # Hub token for gated/private repos (None: huggingface_hub's own login)
    cache_dir: str | None = None  # Hub cache folder (None: HF_HUB_CACHE)
    _header_cache: dict[str, tuple[list[TensorInfo], dict[str, str]]] = field(default_factory=dict, repr=False)
    _config: dict | None = field(default=None, repr=False)
    _hashes: dict[str, tuple[str, str]] | None = field(default=None, repr=False)  # the Hub's per-file hashes
    _verified: set[str] = field(default_factory=set, repr=False)  # weight files checked against them
    _verify_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards _file_locks, _hashes
    _file_locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)  # one per file: two
    # prefetch connections hash two files at once
    _prefetcher: Prefetcher | None = field(default=None, repr=False)  # Hub: shards fetched ahead (prefetch)
    _headers_pending: threading.Event | None = field(default=None, repr=False)  # set once read_headers ends

    def __post_init__(self) -> None:
        if not self.roots:
            self.roots = _roots_for(self.root, self.is_hub)

    @property
    def is_hub(self) -> bool:
        return self.repo_id is not None

    def describe(self) -> dict[str, str | None]:
        if self.is_hub:
            return {"type": "hub", "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}
        return {"type": "local", "path": str(self.root)}

    def config(self) -> dict:
        """config.json as a dict ({} when absent); a malformed one is a one-line SourceError."""
        if self._config is None:
            self._config = self._read_config()
        return self._config

    def _read_config(self) -> dict:
        path = self.root / "config.json"
        label = f"{self.label}/config.json"
        if not os.path.lexists(path):
            return {}
        if not path.exists():
            raise SourceError(f"{label} is a broken symlink")
        _contained(self.root, "config.json", self.roots, "config.json")
        cfg = _read_json_file(path, label, strict=False)
        if not isinstance(cfg, dict):
            raise SourceError(f"{label}: a {json_kind(cfg)}, not a JSON object")
        check_types(cfg, label)  # the keys fp4convert reads, each of the JSON type it needs
        return cfg

    # --- non-weight files ------------------------------------------------------------------------

    def file_plan(self, exclude: Path | None = None) -> list[CopyDecision]:
        """Every non-weight file and skipped folder under the root with the copy decision and reason.

        ``exclude`` (the destination, when it lies inside the source) is skipped whole. Folders are
        not descended into when skipped (``.git`` is never walked); symlinked folders are not followed.
        """
        root_real = os.path.realpath(self.root)
        skip: dict[str, str] = {}
        if exclude is not None:
            ex = os.path.realpath(exclude)
            if _inside(ex, (root_real,)) and ex != root_real:
                skip[os.path.relpath(ex, root_real).replace(os.sep, "/")] = "the destination folder"
        out: list[CopyDecision] = []
        errors: list[OSError] = []
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False, onerror=errors.append):
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            rel_dir = "" if rel_dir == "." else rel_dir + "/"
            keep_dirs = []
            for d in sorted(dirnames):
                rel = rel_dir + d
                full = Path(dirpath) / d
                if os.path.islink(full):
                    out.append(CopyDecision(rel + "/", False, "symlinked folder (not followed)"))
                    continue
                if any((full / own).exists() for own in OWN_FILES):
                    skip[rel] = "a nested fp4convert output"
                ok, why = copy_rule(rel + "/", skip)
                if ok:
                    keep_dirs.append(d)
                else:
                    out.append(CopyDecision(rel + "/", False, why))
            dirnames[:] = keep_dirs
            for name in sorted(filenames):
                rel = rel_dir + name
                ok, why = copy_rule(rel, skip)
                if ok:
                    ok, why = self._copyable(Path(dirpath) / name, why)
                out.append(CopyDecision(rel, ok, why))
        for exc in errors:
            where = os.path.relpath(exc.filename, self.root) if exc.filename else "?"
            out.append(CopyDecision(where + "/", False, f"unreadable ({exc.strerror or exc})"))
        return sorted(out, key=lambda d: d.path)

    def _copyable(self, path: Path, why: str) -> tuple[bool, str]:
        real = os.path.realpath(path)
        if not _inside(real, self.roots):
            return False, f"symlink to {real}, outside the checkpoint folder"
        try:
            st = os.stat(real)
        except OSError as exc:
            return False, f"unreadable ({exc.strerror or exc})"
        if not stat.S_ISREG(st.st_mode):
            return False, "not a regular file"
        if not os.access(real, os.R_OK):
            return False, "unreadable (permission denied)"
        return True, why

    def other_files(self, exclude: Path | None = None) -> list[Path]:
        """The non-weight files to copy (config, tokenizer, README...), as paths under ``root``.

        Files refused for a reason the user may not expect (a symlink out of the folder, unreadable)
        are logged as warnings.
        """
        out = []
        for d in self.file_plan(exclude):
            if d.copy:
                out.append(self.root / d.path)
            elif d.reason.startswith(("symlink to", "unreadable", "not a regular", "its name has")):
                log.warning("not copying %s: %s", _q(d.path), d.reason)
            else:
                log.debug("not copying %s: %s", d.path, d.reason)
        return out

    def open_file(self, rel: str, what: str = "file") -> int:
        """A read-only descriptor of a file of the checkpoint, contained (:func:`open_contained`)."""
        return open_contained(self.root, rel, self.roots, what)

    def read_card(self, limit: int = MAX_CARD) -> str | None:
        """The source's model card (README.md) text, or None when there is none or it cannot be used.

        Read through the same containment as every other file: a README.md that is a symlink out of
        the checkpoint (``-> /proc/self/environ``), a FIFO or a huge file is never read (a warning says
        why), so nothing from outside SRC can reach the generated card or the Hub."""
        from fp4convert.storage.names import CARD_NAME

        if not os.path.lexists(self.root / CARD_NAME):
            return None
        try:
            fd = self.open_file(CARD_NAME, "the model card")
        except SourceError as exc:
            log.warning("not using the source's %s: %s", CARD_NAME, str(exc))
            return None
        with os.fdopen(fd, "rb") as fh:
            data = fh.read(limit + 1)
        if len(data) > limit:
            log.warning("not using the source's %s: larger than %d bytes", CARD_NAME, limit)
            return None
        return data.decode("utf-8", errors="replace")

    # --- weight files ----------------------------------------------------------------------------

    def local_path(self, file: str) -> Path:
        """A weight file as a local path inside the source: downloaded (or taken from the cache) on first
        use, or waited for when :meth:`prefetch` fetches it (its error, if it failed, is raised here)."""
        if file not in self.weight_files:
            raise SourceError(f"{_q(file)} is not a weight file of {self.label}")
        if not self.is_hub:
            return _contained(self.root, file, self.roots, "weight file")
        prefetcher = self._prefetcher
        if prefetcher is not None:
            path = prefetcher.get(file)
            if path is not None:
                return path
        return self._fetch(file)

    def prefetch(self, units: Iterable[Iterable[Decision]], ahead: int = AHEAD) -> None:
        """Hub: fetch the weight files ``units`` read (the units a run will process, in plan order) in
        the background, ahead of :meth:`local_path` (:mod:`fp4convert.source.prefetch`); local: nothing to do.

        A fetch ahead of need starts only while the cache's filesystem keeps room for the output the
        units not yet reached will write (what the destination's pre-check counted on)."""
        if not self.is_hub:
            return
        order: list[str] = []
        index: dict[str, int] = {}
        out_at: list[int] = []  # output bytes of the units that cannot start before file i is reached
        for unit in units:
            last, out = 0, 0
            for d in unit:
                for t in d.reads:
                    if t.file not in index:
                        index[t.file] = len(order)
                        order.append(t.file)
                        out_at.append(0)
                    last = max(last, index[t.file])
                out += sum(e.nbytes for e in d.outputs) + (0 if d.outputs else d.info.nbytes)
            if out_at:
                out_at[last] += out
        def room(file: str, position: int) -> bool:
            return self._room_after(file, sum(out_at[position:]))

        early = self._prefetcher
        if early is not None and early.order == order and early.ahead == ahead:
            early.set_room(room)  # the early start guessed the run's order: it goes on, with the plan's room
            return
        self.stop_prefetch()  # another order (resume, --only, ...): what it fetched is in the cache
        if order:
            self._prefetcher = self._prefetcher_for(order, ahead, room)

    def prefetch_early(self, ahead: int = AHEAD) -> None:
        """Hub: start fetching the weight files in index order before the plan exists.

        Planning a Hub source (the model definition from transformers, the destination's checks) takes
        seconds in which the link would idle: on the H100 host a 1.15 GB conversion at 50 MB/s took 1.6x
        the plain download, ~11 s of it before the first byte was asked for. The run reads shards in index
        order almost always; :meth:`prefetch` keeps this prefetcher when the plan's order is the same and
        replaces it otherwise (files already fetched are then cache hits). It starts before the headers
        are read (:meth:`read_headers`; a download's check waits for its file's header, to compare them).
        Bounded as the run's own prefetch is at its start (the first file and ``ahead`` more), and the
        files after the first only once every header is known and while the cache's filesystem keeps room
        for the whole source beside them (the output's size is not known yet, and is at most the
        source's for these formats)."""
        if not self.is_hub or self._prefetcher is not None or not self.weight_files:
            return

        def room(file: str, position: int) -> bool:
            if any(f not in self._header_cache for f in self.weight_files):
                return False  # sizes unknown until the headers are read (the first file needs no room check)
            total = sum(max((t.end for t in self._header_cache[f][0]), default=0) for f in self.weight_files)
            return self._room_after(file, total)

        self._prefetcher = self._prefetcher_for(list(self.weight_files), ahead, room)

    def _room_after(self, file: str, need: int) -> bool:
        """Would downloading ``file`` leave ``need`` bytes free in the cache's filesystem?"""
        size = max((t.end for t in self._header_cache.get(file, ([], {}))[0]), default=0)
        try:
            free = shutil.disk_usage(self.roots[-1]).free  # the repo's blob store: where downloads land
        except OSError:
            return False
        return free - size >= need

    def stop_prefetch(self) -> None:
        """Cancel the background fetches (an in-flight download stops at its next chunk; huggingface_hub
        removes its partial file) and wait for them to end. Safe to call at any time, repeatedly."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            for file in prefetcher.stop():
                self._drop_incomplete(file)

    def _drop_incomplete(self, file: str) -> None:
        """Remove the temporary file of a download left stalled at stop (huggingface_hub removes it
        itself when the download ends, which a process exiting first would not wait for): it is named
        after the Hub's sha256 of the file plus a random part, so no later run would reuse it."""
        kind, sha = (self._hashes or {}).get(file, (None, None))
        if kind != "sha256" or sha is None:
            return
        for p in Path(self.roots[-1]).glob(f"{sha}*.incomplete"):
            try:
                p.unlink()
            except OSError:
                pass

    def _fetch(self, file: str, cancelled: Callable[[], bool] | None = None) -> Path:
        """Download ``file`` (or take it from the cache), check its containment and its checksum.
        ``cancelled``: polled while downloading and hashing; raises :class:`Cancelled` once true."""
        path = self._download(file, cancelled)
        self._verify_once(file, path, cancelled)
        return path

    def _prefetcher_for(self, order: list[str], ahead: int, room: Callable[[str, int], bool]) -> Prefetcher:
        """Downloads on the prefetcher's connections, checksums on its checker thread: a connection
        starts its next file while the last one is hashed, so the link does not idle for the hash. The
        Hub's checksums are asked for at once, on their own thread."""
        if self._hashes is None and not _offline():  # asked now, so the first check does not wait for it
            threading.Thread(target=self._hub_hashes, name="fp4convert-hub-hashes", daemon=True).start()
        return Prefetcher(order, self._download, ahead=ahead, room=room, check=self._verify_once)

    def _download(self, file: str, cancelled: Callable[[], bool] | None = None) -> Path:
        """``file`` from the Hub (or the cache), contained in the repo's cache folder; not yet verified."""
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(self.repo_id, file, revision=self.commit or self.revision,
                                        local_files_only=_offline(), token=self.token, cache_dir=self.cache_dir,
                                        tqdm_class=_cancellable_bar(cancelled) if cancelled else None))
        except Cancelled:
            raise
        except Exception as exc:  # huggingface_hub raises many types; all mean "cannot fetch"
            raise SourceError(f"{self.repo_id}: cannot fetch {file} ({one_line(exc)})") from exc
        real = os.path.realpath(path)
        if not _inside(real, self.roots):
            raise OutsideSourceError(f"{self.repo_id}: {file} resolves to {real}, outside the repo's cache folder")
        return path

    def _verify_once(self, file: str, path: Path, cancelled: Callable[[], bool] | None = None) -> None:
        """:meth:`_verify_download` once per file, whichever thread asks first (the others wait for it)."""
        with self._verify_lock:
            lock = self._file_locks.setdefault(file, threading.Lock())
        with lock:
            if file not in self._verified:
                self._verify_download(file, path, cancelled)
                self._verified.add(file)

    def _hub_hashes(self) -> dict[str, tuple[str, str]]:
        """The Hub's own hash of each weight file at this commit: (``sha256`` of an LFS file | ``sha1`` git
        blob id, hex), from ``get_paths_info`` (one call); {} when offline or the Hub cannot answer."""
        with self._verify_lock:  # one call, whichever prefetch connection asks first; the other waits for it
            if self._hashes is None:
                self._hashes = self._ask_hub_hashes()
            return self._hashes

    def _ask_hub_hashes(self) -> dict[str, tuple[str, str]]:
        hashes: dict[str, tuple[str, str]] = {}
        if _offline():
            return hashes
        from huggingface_hub import HfApi

        try:
            infos = HfApi(token=self.token).get_paths_info(self.repo_id, list(self.weight_files),
                                                          revision=self.commit or self.revision)
        except Exception as exc:  # verification then falls back to the cache's blob names
            log.warning("warning: cannot ask the Hub for the checksums of %s (%s); checking the "
                        "downloads against the cache's own records only", self.repo_id, one_line(exc))
            infos = []
        for info in infos:
            lfs = getattr(info, "lfs", None)
            if lfs is not None and getattr(lfs, "sha256", None):
                hashes[info.path] = ("sha256", str(lfs.sha256).lower())
            elif getattr(info, "blob_id", None):
                hashes[info.path] = ("sha1", str(info.blob_id).lower())
        return hashes

    def _verify_download(self, file: str, path: Path, cancelled: Callable[[], bool] | None = None) -> None:
        """A downloaded (or cached) weight file must hash to what the Hub reports for it (its LFS sha256,
        or the blob id the cache named it by when offline), and its header must be the one read by
        range when planning: a CDN serving same-size corrupt or re-laid-out bytes is exit 4, naming the
        file, before any of it is converted; the bad blob leaves the cache so a rerun fetches it again."""
        import hashlib

        kind, want = self._hub_hashes().get(file, (None, None))
        blob = os.path.basename(os.path.realpath(path))
        if want is None and re.fullmatch(r"[0-9a-f]{64}", blob):
            kind, want = "sha256", blob  # huggingface_hub names an LFS blob by the sha256 the Hub sent
        if want is not None:
            h = hashlib.sha256() if kind == "sha256" else hashlib.sha1()
            try:
                with open(path, "rb") as fh:
                    if kind == "sha1":
                        h.update(b"blob %d\0" % os.fstat(fh.fileno()).st_size)
                    while block := fh.read(16 << 20):
                        h.update(block)
                        if cancelled is not None and cancelled():
                            raise Cancelled(file)
            except OSError as exc:
                raise SourceError(f"{self.repo_id}: {file}: cannot read ({exc.strerror or exc})") from exc
            if h.hexdigest() != want:
                self._drop_from_cache(path)
                raise CheckpointFormatError(
                    f"{self.repo_id}: {file} does not match the Hub's {kind} ({want[:12]}..., the download hashes to "
                    f"{h.hexdigest()[:12]}...): a corrupt download, removed from the cache; run the same command "
                    "again to download it again")
        else:
            log.debug("%s: no Hub checksum known for %s; not verified", self.repo_id, file)
        pending = self._headers_pending  # a prefetch may finish before the range reads (read_headers) do
        while pending is not None and not pending.wait(0.5):
            if cancelled is not None and cancelled():
                raise Cancelled(file)
        remote = self._header_cache.get(file)
        if remote is not None:
            local = read_header(path, file)
            if local != remote:
                self._drop_from_cache(path)
                raise CheckpointFormatError(
                    f"{self.repo_id}: {file}: the downloaded file's header differs from the one read by range when "
                    "planning (the server sent other bytes); removed from the cache: run the same command again, "
                    "and if it repeats, the Hub's server is serving two versions of the file: try later or convert a "
                    "local copy")

    def _drop_from_cache(self, path: Path) -> None:
        """Remove a bad download (its blob and its snapshot link) from the HF cache."""
        real = Path(os.path.realpath(path))
        for p in {Path(path), real}:
            try:
                if _inside(os.path.realpath(p.parent), self.roots):
                    p.unlink()
            except OSError:
                pass

    def header(self, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
        """A weight file's header; from the Hub by HTTP range requests when online (no shard download)."""
        if file not in self._header_cache:
            self._header_cache[file] = self._read_header(file)
        return self._header_cache[file]

    def _read_header(self, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
        if self.is_hub and not _offline():
            remote = _remote_header(self.repo_id, file, self.commit or self.revision, self.token)
            if remote is not None:
                return remote
        path = self.local_path(file)
        if not path.exists():
            raise SourceError(f"{file} is listed in the checkpoint but missing at {path}")
        return read_header(path, file)

    def read_headers(self) -> None:
        """Hub: read every weight file's header by range, ``HEADER_CONNECTIONS`` at a time.

        Each header is three round trips (metadata, the length, the header itself): one after another
        they cost ~0.3 s a shard on a loaded machine, seconds for a model of many shards, while the link
        idles before the first download. The reads run concurrently; the results are cached in file order
        and a failure is raised for the first file (in order) that has one, as a sequential read would.
        A header the range read cannot get is left to :meth:`header` (it downloads the shard instead),
        one at a time: nothing here downloads a whole shard."""
        missing = [f for f in self.weight_files if f not in self._header_cache]
        if not self.is_hub or _offline() or not missing:
            return
        rev = self.commit or self.revision
        self._headers_pending = pending = threading.Event()
        try:
            # daemon threads, not a ThreadPoolExecutor: Ctrl-C on a stalled read must not wait for its timeout
            results = _in_daemon_threads([partial(_remote_header, self.repo_id, f, rev, self.token) for f in missing],
                                         HEADER_CONNECTIONS, "fp4convert-header")
            for file, result in zip(missing, results):
                remote = result.result()  # raises a malformed header's error, first file first
                if remote is not None:
                    self._header_cache[file] = remote
            unread = [f for f in missing if f not in self._header_cache]
            if unread:
                more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
                log.warning("warning: %s: the Hub did not answer a range request for the header of %s%s; downloading "
                            "whole shards to read their headers", self.repo_id, _q(unread[0]), more)
        finally:
            pending.set()  # a download waiting to compare its header goes on
            if self._prefetcher is not None:
                self._prefetcher.wake()  # the early prefetch's room check needs every header

    def tensors(self, check_index: bool = True) -> list[TensorInfo]:
        """Every tensor of every weight file, in file order then offset order.

        With ``check_index`` (the default) the index and the files must agree both ways; ``inspect``
        passes False and reports :meth:`index_problems` as findings instead.
        """
        self.read_headers()
        seen: dict[str, str] = {}
        out = []
        for file in self.weight_files:
            infos, _ = self.header(file)
            for info in infos:
                if info.name in seen:
                    raise SourceError(f"tensor {_q(info.name)} appears in both {seen[info.name]} and {file}")
                seen[info.name] = file
                out.append(info)
        if check_index:
            problems = self.index_problems(out)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise CheckpointIndexError(problems[0] + more)
        return out

    def index_problems(self, tensors: list[TensorInfo] | None = None) -> list[str]:
        """Where the index and the weight files disagree (empty without an index), one line each."""
        if self.weight_map is None:
            return []
        tensors = self.tensors(check_index=False) if tensors is None else tensors
        problems = []
        found = {i.name: i.file for i in tensors}
        for name, file in found.items():
            listed = self.weight_map.get(name)
            if listed is None:
                problems.append(f"{file} holds tensor {_q(name)}, which {INDEX_NAME} does not list")
            elif listed != file:
                problems.append(f"{INDEX_NAME} lists tensor {_q(name)} in {listed}, but it is in {file}")
        for name, file in self.weight_map.items():
            if name not in found:
                problems.append(f"{INDEX_NAME} lists tensor {_q(name)} in {file}, but {file} does not hold it")
        return problems


def _cancellable_bar(cancelled: Callable[[], bool]) -> type:
    """huggingface_hub's own progress bar (shown or not as it decides), whose ``update`` -- called for
    every chunk a download receives -- raises :class:`Cancelled` once ``cancelled()``: the only way to
    stop an ``hf_hub_download`` from another thread (it then deletes its temporary file itself)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class CancellableBar(hf_tqdm):  # type: ignore[misc, valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            if cancelled():
                raise Cancelled("download cancelled")
            return super().update(n)

    return CancellableBar


def _in_daemon_threads(calls: list[Callable[[], object]], workers: int, name: str) -> list[Future]:
    """Run ``calls`` on up to ``workers`` daemon threads, one Future each, in order. Unlike a
    ThreadPoolExecutor's, these threads never delay the process's exit (Ctrl-C on a stalled read)."""
    todo = [(Future(), call) for call in calls]
    futures = [f for f, _ in todo]
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                future, call = todo.pop(0)
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - raised by future.result()
                future.set_exception(exc)

    for _ in range(max(1, min(workers, len(calls)))):
        threading.Thread(target=work, name=name, daemon=True).start()
    return futures


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _remote_header(repo_id: str, file: str, revision: str | None, token: str | None = None
                   ) -> tuple[list[TensorInfo], dict[str, str]] | None:
    """Header bytes by range request, validated like a local file's; None when fetching fails (the
    caller downloads instead). A malformed header raises at once (no download to find that out)."""
    from urllib.parse import urlsplit

    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    try:
        url = hf_hub_url(repo_id, file, revision=revision)
        meta = get_hf_file_metadata(url, token=token)
        headers = build_hf_headers(token=token)
        if urlsplit(meta.location).netloc != urlsplit(url).netloc:
            headers.pop("authorization", None)  # a signed CDN URL: the token stays on the Hub (as in hf_hub_download)
        first = _range(meta.location, headers, 0, 7)
        if first is None:
            return None
        head, total = first
        size = meta.size if meta.size is not None else total
        if size is None:
            return None
        n = header_length(head, file, size)
        body = _range(meta.location, headers, 8, 7 + n)
        if body is None:
            return None
    except Exception as exc:  # any failure to fetch falls back to the plain download path
        if isinstance(exc, FP4ConvertError):
            raise
        log.debug("range read of %s failed (%s); downloading instead", file, exc)
        return None
    return parse_header(body[0], file, size)


def _range(url: str, headers: dict, start: int, end: int) -> tuple[bytes, int | None] | None:
    """Bytes start..end of ``url`` and the total size from Content-Range; None unless the server
    answers 206 with exactly those (a server that ignores Range would send the whole shard: stop
    before reading it)."""
    from huggingface_hub.utils import get_session

    with get_session().stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end}"}, timeout=30) as r:
        if r.status_code != 206:
            return None
        data = r.read()
        total = r.headers.get("Content-Range", "").rpartition("/")[2]
    if len(data) != end - start + 1:
        return None
    return data, int(total) if total.isdigit() else None


def _weight_files_in(root: Path, label: str, roots: tuple[str, ...] | None = None
                     ) -> tuple[list[str], dict[str, str] | None]:
    """(weight files, index weight_map or None) of a folder; local files must exist inside it."""
    roots = roots or _roots_for(root, False)
    if os.path.lexists(root / INDEX_NAME):
        weight_map = _read_index(root, roots, label)
        return sorted(set(weight_map.values())), weight_map  # shard order, not the (name-sorted) map's order
    files = sorted(p.name for p in root.glob("*.safetensors"))
    if files:
        return files, None
    pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise SourceError(
            f"{label} has only pickle weights ({', '.join(pickles[:3])}); fp4convert reads safetensors only, "
            f"because unpickling runs arbitrary code. {PICKLE_HOW}"
        )
    raise SourceError(_no_weights_here(root, label))


# How to turn a trusted pickle checkpoint into safetensors (said wherever one is refused).
PICKLE_HOW = ("Convert them to safetensors first, if you trust the files (loading them runs their code): "
              "python -c \"from transformers import AutoModel as A; A.from_pretrained('IN').save_pretrained('OUT')\" "
              "(save_pretrained writes safetensors; use the model's own Auto class, e.g. AutoModelForCausalLM), "
              "then convert OUT")


def _no_weights_here(root: Path, label: str) -> str:
    """Why a folder has no weights, and where they are when they can be found: the root of a Hugging Face
    cache entry (``models--org--name``: its snapshots hold them), or a subfolder holding safetensors (looked
    for a few levels down, without following symlinks, a bounded number of entries)."""
    snaps = root / "snapshots"
    if root.name.startswith("models--") and snaps.is_dir() and not snaps.is_symlink():
        found = sorted(p.name for p in snaps.iterdir() if p.is_dir())
        ref = root / "refs" / "main"
        main = ref.read_text(errors="replace").strip()[:64] if ref.is_file() and not ref.is_symlink() else ""
        pick = main if main in found else (found[-1] if found else "<commit>")
        repo = root.name[len("models--"):].replace("--", "/")
        return (f"{label} is the root of a Hugging Face cache entry, not a checkpoint folder: pass a snapshot "
                f"folder inside it ({snaps / pick}), or the repo id {repo!r} with --cache-dir {root.parent}")
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        depth = len(Path(dirpath).relative_to(root).parts)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < 3 else []
        seen += len(filenames) + len(dirnames)
        hits = sorted(f for f in filenames if f.endswith(".safetensors"))
        if hits and depth > 0:
            rel = Path(dirpath).relative_to(root)
            return (f"{label}: no *.safetensors weights at its top level; {rel}/ holds {len(hits)} (e.g. {hits[0]}): "
                    f"pass that folder ({Path(dirpath)}) if it is the checkpoint")
        if seen > 10_000:
            break
    return f"{label}: no *.safetensors weights found"


def _check_local_weights(root: Path, files: list[str], roots: tuple[str, ...], label: str) -> None:
    for f in files:
        path = _contained(root, f, roots, "weight file")
        if not path.exists():
            raise SourceError(f"{label}: {INDEX_NAME} lists {f}, which is missing")
        if not path.is_file():
            raise SourceError(f"{label}: weight file {f} is not a regular file")


# ---------------------------------------------------------------------------------------------
# Opening: local folder or Hub repo id
# ---------------------------------------------------------------------------------------------

def local_path_hint(src: str) -> str | None:
    """None when ``src`` (no such path here) may be a Hub repo id; else why it must be a mistyped local path.

    Local-looking: no '/' or more than one, starts with '.', '/' or '~', contains a backslash, is not of
    the form org/name, or its first component exists here or is a close misspelling of a folder here
    (``exmaples/tiny-llama`` next to ``examples/``).
    """
    if src.startswith((".", "/", "~")) or "\\" in src:
        return "a path"
    if src.count("/") != 1:
        return "a path" if "/" in src else "not a Hub repo id of the form org/name"
    if not _REPO_ID.match(src):
        return "not a Hub repo id of the form org/name"
    first, rest = src.split("/", 1)
    if os.path.lexists(first):
        return f"{first} exists here, but not {src}"
    try:
        with os.scandir(".") as it:
            here = [e.name for _, e in zip(range(5000), it) if e.is_dir()]
    except OSError:
        here = []
    close = difflib.get_close_matches(first, here, n=1, cutoff=0.8)
    if close:
        return f"did you mean {close[0]}/{rest}?"
    return None


def open_source(src: str, revision: str | None = None, *, token: str | None = None,
                cache_dir: str | None = None) -> Source:
    """A local folder if ``src`` is one; a Hub repo id only if it cannot be a mistyped local path
    (``token``, ``cache_dir``: Hub only)."""
    src = str(src)
    if not src or "\0" in src:
        raise SourceError(f"{_q(src)}: not a folder or a Hub repo id")
    path = Path(src).expanduser()
    try:
        exists, is_link = path.exists(), path.is_symlink()
        if exists:
            if not path.is_dir():
                raise SourceError(f"{src} is a file; give the checkpoint folder that holds it")
            if revision:
                raise SourceError("--revision applies to Hub repos, not to a local folder")
            root = path.resolve()
            roots = _roots_for(root, False)
            files, weight_map = _weight_files_in(root, src, roots)
            _check_local_weights(root, files, roots, src)
            return Source(src, root, files, weight_map=weight_map, roots=roots)
    except OSError as exc:
        raise SourceError(f"{src}: cannot read ({exc.strerror or exc})") from exc
    if is_link:
        raise SourceError(f"{src}: no such folder (a broken symlink)")
    hint = local_path_hint(src)
    if hint is not None:
        raise SourceError(f"{src}: no such folder ({hint})")
    return _open_hub(src, revision, token, cache_dir)


def _open_hub(repo_id: str, revision: str | None, token: str | None = None, cache_dir: str | None = None) -> Source:
    from huggingface_hub import snapshot_download

    try:
        # Everything but the weights now (small files); weights shard by shard later.
        # local_files_only when offline: huggingface_hub 1.x would otherwise try to list a commit's tree.
        root = Path(snapshot_download(repo_id, revision=revision, ignore_patterns=hub_ignore_patterns(),
                                      local_files_only=_offline(), token=token, cache_dir=cache_dir))
    except Exception as exc:
        what = f"{repo_id}@{revision}" if revision else repo_id
        hint = (f" (HF_HUB_OFFLINE is set and {'this revision of ' if revision else ''}the repo is not in the cache)"
                if _offline() else "")
        raise SourceError(f"{what}: cannot open on the Hub{hint}: {one_line(exc)}") from exc
    commit = root.name  # snapshots/<commit>
    roots = _roots_for(root, True)
    weight_map = None
    if os.path.lexists(root / INDEX_NAME):
        files, weight_map = _weight_files_in(root, repo_id, roots)
    else:
        files = _hub_listing(repo_id, commit, root, token)
    return Source(repo_id, root, files, repo_id=repo_id, revision=revision, commit=commit, weight_map=weight_map,
                  roots=roots, token=token, cache_dir=cache_dir)


def _hub_listing(repo_id: str, commit: str, snapshot: Path, token: str | None = None) -> list[str]:
    """Weight files of a repo with no index: ask the Hub, or (offline) list the cached snapshot."""
    names: list[str] = []
    if not _offline():
        from huggingface_hub import HfApi

        try:
            names = HfApi(token=token).list_repo_files(repo_id, revision=commit)
        except Exception as exc:
            log.debug("listing %s failed: %s", repo_id, exc)
    if not names:
        names = sorted(p.name for p in snapshot.iterdir())
    st = [n for n in names if n.endswith(".safetensors") and "/" not in n]
    for n in st:
        check_relative(n, f"{repo_id}: weight file")
    if st:
        return sorted(st)
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise SourceError(
            f"{repo_id} has only pickle weights ({', '.join(pickles[:3])}); fp4convert reads safetensors only, "
            f"because unpickling runs arbitrary code. {PICKLE_HOW}"
        )
    raise SourceError(f"{repo_id}: no *.safetensors weights found")
