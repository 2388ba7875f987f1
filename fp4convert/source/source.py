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

import errno
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import CheckpointIndexError, OutsideSourceError, SourceError
from fp4convert.source.config_json import check_types
from fp4convert.source.copying import CopyDecision, copy_rule
from fp4convert.source.paths import check_relative, qname
from fp4convert.source.prefetch import AHEAD
from fp4convert.storage.names import INDEX_NAME, LOCK_NAME, MANIFEST_NAME, OWN_FILES, PROGRESS_NAME  # noqa: F401
from fp4convert.storage.reads import read_header
from fp4convert.storage.safetensors import TensorInfo
from fp4convert.storage.strict_json import json_error, json_kind, loads_bounded, loads_strict

if TYPE_CHECKING:
    from fp4convert.plan.types import Decision

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Weight files of any format: never copied into the output, never downloaded with a Hub snapshot.
MAX_JSON_FILE = 100_000_000  # bytes; an index or config.json larger than this is not one
MAX_CARD = 4_000_000  # bytes; a source model card larger than this is not kept below ours


def is_inside(real: str, roots: tuple[str, ...]) -> bool:
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def cache_snapshot(root: Path) -> bool:
    """Is ``root`` a snapshot folder of the HF cache (``models--org--name/snapshots/<commit>``, beside
    ``blobs/``), as ``hf download`` prints it? Its files are symlinks into ``../../blobs``."""
    repo = root.parent.parent
    return (root.parent.name == "snapshots" and repo.name.startswith("models--")
            and os.path.isdir(repo / "blobs") and not os.path.islink(repo / "blobs"))


def roots_for(root: Path, hub: bool) -> tuple[str, ...]:
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
    path = contained_path(root, rel, roots, what)
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
            raise SourceError(f"{what} {qname(rel)} is not a regular file")
        os.set_blocking(fd, True)
        out, fd = fd, -1
        return out
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OutsideSourceError(f"{what} {qname(rel)} changed while being opened (a symlink appeared in its "
                                     "path); fp4convert reads only files inside the checkpoint folder") from None
        raise SourceError(f"{what} {qname(rel)}: cannot read ({exc.strerror or exc})") from exc
    finally:
        if fd >= 0:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# Which non-weight files are copied
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
    contained_path(root, INDEX_NAME, roots, "the weight index")
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
            raise CheckpointIndexError(f"{where}: tensor {qname(name)} maps to a {json_kind(file)}, not a file name")
        check_relative(file, f"{where}: tensor {qname(name)}")
        if not file.endswith(".safetensors"):
            raise CheckpointIndexError(f"{where}: tensor {qname(name)} maps to {qname(file)}, not a .safetensors file")
    return weight_map


def contained_path(root: Path, rel: str, roots: tuple[str, ...], what: str) -> Path:
    """root/rel, after the lexical check and with its real path inside ``roots``."""
    check_relative(rel, what)
    path = root / rel
    real = os.path.realpath(path)
    if not is_inside(real, roots):
        raise OutsideSourceError(
            f"{what} {qname(rel)} resolves to {real}, outside the checkpoint folder {root}; fp4convert reads only "
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

    def __post_init__(self) -> None:
        if not self.roots:
            self.roots = roots_for(self.root, self.is_hub)

    @property
    def is_hub(self) -> bool:
        return False  # a local folder; fp4convert.source.hub.HubSource is a Hub repo

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
        contained_path(self.root, "config.json", self.roots, "config.json")
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
            if is_inside(ex, (root_real,)) and ex != root_real:
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
        if not is_inside(real, self.roots):
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
                log.warning("not copying %s: %s", qname(d.path), d.reason)
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

    def describe(self) -> dict[str, str | None]:
        return {"type": "local", "path": str(self.root)}

    def local_path(self, file: str) -> Path:
        """A weight file as a local path inside the source (a Hub source downloads it first)."""
        if file not in self.weight_files:
            raise SourceError(f"{qname(file)} is not a weight file of {self.label}")
        return contained_path(self.root, file, self.roots, "weight file")

    def prefetch(self, units: Iterable[Iterable[Decision]], ahead: int = AHEAD) -> None:
        """Fetch the weight files ``units`` read ahead of :meth:`local_path` (a Hub source does; a local
        folder has nothing to fetch)."""

    def prefetch_early(self, ahead: int = AHEAD) -> None:
        """Start fetching the weight files before the plan exists (a Hub source does; here nothing)."""

    def stop_prefetch(self) -> None:
        """Cancel the background fetches, if any. Safe to call at any time, repeatedly."""

    def read_headers(self) -> None:
        """Read every weight file's header at once, where that saves round trips (a Hub source by range);
        a local folder reads each on first use (:meth:`header`)."""

    def header(self, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
        """A weight file's header; from the Hub by HTTP range requests when online (no shard download)."""
        if file not in self._header_cache:
            self._header_cache[file] = self._read_header(file)
        return self._header_cache[file]

    def _read_header(self, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
        path = self.local_path(file)
        if not path.exists():
            raise SourceError(f"{file} is listed in the checkpoint but missing at {path}")
        return read_header(path, file)

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
                    raise SourceError(f"tensor {qname(info.name)} appears in both {seen[info.name]} and {file}")
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
                problems.append(f"{file} holds tensor {qname(name)}, which {INDEX_NAME} does not list")
            elif listed != file:
                problems.append(f"{INDEX_NAME} lists tensor {qname(name)} in {listed}, but it is in {file}")
        for name, file in self.weight_map.items():
            if name not in found:
                problems.append(f"{INDEX_NAME} lists tensor {qname(name)} in {file}, but {file} does not hold it")
        return problems


def weight_files_in(root: Path, label: str, roots: tuple[str, ...] | None = None
                     ) -> tuple[list[str], dict[str, str] | None]:
    """(weight files, index weight_map or None) of a folder; local files must exist inside it."""
    roots = roots or roots_for(root, False)
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


def check_local_weights(root: Path, files: list[str], roots: tuple[str, ...], label: str) -> None:
    for f in files:
        path = contained_path(root, f, roots, "weight file")
        if not path.exists():
            raise SourceError(f"{label}: {INDEX_NAME} lists {f}, which is missing")
        if not path.is_file():
            raise SourceError(f"{label}: weight file {f} is not a regular file")


# ---------------------------------------------------------------------------------------------
# Opening: local folder or Hub repo id
# ---------------------------------------------------------------------------------------------

