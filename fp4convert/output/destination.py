"""The destination folder and its lock: what a run may write into DST, decided before it writes anything.

Safety rules (issue 12): DST is never inside SRC nor SRC inside DST; ``--overwrite`` removes only
files a valid manifest or progress record lists and that this tool writes; one run at a time holds
``DST/.fp4convert.lock`` (flock: the kernel drops it when the process dies); the space a run needs is
checked up front. :func:`prepare_destination` returns the :class:`Session` (the lock, released by
finishing or by a failure) and what a ``--resume`` may reuse.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.config import human_bytes
from fp4convert.errors import OutputError
from fp4convert.output.files import contained, output_error, source_error, through_link, writing
from fp4convert.output.record import merge_states, progress_records, read_record, resumable
from fp4convert.storage.checksum import file_matches, record_problem
from fp4convert.storage.names import FORMAT_FILES, INDEX_NAME, LOCK_NAME, MANIFEST_NAME, PART_RECORD, PARTIAL, PROGRESS_NAME, SHARD_PATTERN
from fp4convert.storage.safetensors import header_bytes

if TYPE_CHECKING:
    from fp4convert.config import ConvertConfig
    from fp4convert.plan.planner import Plan
    from fp4convert.source.source import Source


@dataclass
class Session:
    """A locked destination: released by the finish, or (:meth:`fail`) by a failed run."""

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

    def fail(self) -> None:
        """A failed run: drop the lock; remove the folders it created if they hold nothing."""
        self.release()
        for d in reversed(self.created):
            try:
                d.rmdir()  # only when empty
            except OSError:
                break


def check_paths(dst: Path, source: Source) -> None:
    """DST inside SRC, SRC inside DST, or the same folder: refused before anything is written."""
    d, s = dst.resolve(), source.root.resolve()
    if d == s:
        raise OutputError(f"{dst} is the source folder; choose another destination")
    if contained(d, s):
        raise OutputError(f"{dst} is inside the source folder {source.root}; fp4convert never writes into its "
                          "source: choose a destination outside it")
    if contained(s, d):
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
                raise through_link(dst, LOCK_NAME) from None
            raise output_error(exc, path, resumable=False) from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OutputError(f"{path} is not a regular file; fp4convert keeps its lock there: remove it or "
                              "choose another DST")
        if st.st_nlink > 1:  # a hard link (never one of ours): writing the pid would change the other name's file
            os.close(fd)
            raise OutputError(f"{path} is a hard link to a file with {st.st_nlink - 1} other name(s), which "
                              "fp4convert would overwrite with its lock: remove it or choose another DST")
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


def prepare_destination(dst: Path, plan: Plan, config: ConvertConfig, identity: dict, source: Source,
                        others: list[Path]) -> tuple[Session, dict]:
    """Check, lock and (for --overwrite) clean DST as the flags say. Returns the lock and the finished
    files a resume may reuse (:func:`~fp4convert.output.record.resumable`). ``others``: the source's
    other files the finish copies (walked once per run)."""
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
    session = Session(dst, fd, created)
    try:
        return session, _check_destination(dst, plan, config, identity, source, others)
    except BaseException:
        session.fail()
        raise


def planned_names(plan: Plan, source: Source, others: list[Path]) -> set[str]:
    """Every file (relative path) a run writes into DST."""
    names = {f for f, _ in plan.shards} | {INDEX_NAME, MANIFEST_NAME, PROGRESS_NAME, LOCK_NAME, *FORMAT_FILES}
    names |= {p.relative_to(source.root).as_posix() for p in others}
    return names


def dst_files(dst: Path) -> list[str]:
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


def _own_partial(name: str) -> bool:
    """The ``.partial`` of a control file (manifest, progress record, a part's record): a name only this
    tool writes, and a run killed while writing its first record leaves one that no record lists."""
    if not name.endswith(PARTIAL):
        return False
    base = name[: -len(PARTIAL)]
    return base in (MANIFEST_NAME, PROGRESS_NAME) or bool(PART_RECORD.match(base))


def _owned(dst: Path, records: list[dict], files: list[str]) -> set[str]:
    """The files in DST this tool wrote, as a valid record proves: our own control files, shard-named
    files and the index, and other listed files whose bytes still match the recorded checksum. The lock
    and a control file's ``.partial`` are ours by name, with or without a record."""
    owned = {f for f in files if f == LOCK_NAME or _own_partial(f)}
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
            if not name.endswith(".safetensors") or SHARD_PATTERN.match(name):
                listed[name] = None
    ours_by_name = {MANIFEST_NAME, PROGRESS_NAME, INDEX_NAME, LOCK_NAME}

    def is_ours(name: str) -> bool:
        if name in ours_by_name or PART_RECORD.match(name) or (SHARD_PATTERN.match(name) and name in listed):
            return True
        if name not in listed:
            return False
        rec = listed[name]
        if rec is None:  # named in the progress record before finish wrote it
            return True
        p = dst / name
        try:
            return p.is_file() and not p.is_symlink() and record_problem(rec) is None and file_matches(p, rec)
        except OSError:
            return False

    for name in files:
        base = name[: -len(PARTIAL)] if name.endswith(PARTIAL) else name
        if is_ours(base) or (base != name and SHARD_PATTERN.match(base)):
            owned.add(name)
    return owned


def _check_destination(dst: Path, plan: Plan, config: ConvertConfig, identity: dict, source: Source,
                       others: list[Path]) -> dict:
    files = dst_files(dst)
    existing = [f for f in files if f != LOCK_NAME]
    done: dict = {}
    if existing and not (config.overwrite or config.resume):
        raise OutputError(f"{dst} exists and is not empty; pass --overwrite to replace it or --resume to continue")
    records: list[dict] = []
    damaged: list[str] = []
    progress: list[dict] = []
    names = [(MANIFEST_NAME, "manifest"), (PROGRESS_NAME, "progress")]
    names += [(p.name, "progress") for p in progress_records(dst) if p.name != PROGRESS_NAME]  # the parts'
    for name, kind in names:
        if os.path.islink(dst / name):  # never read (nor trusted) through a symlink
            raise through_link(dst, name)
        if (dst / name).is_file():
            rec, why = read_record(dst / name, kind)
            if rec is not None:
                (records if kind == "manifest" else progress).append(rec)
            else:
                damaged.append(why)
        elif (dst / name).exists():
            raise OutputError(f"{dst / name} is not a file; remove it or choose another DST")
    owned = _owned(dst, records + progress, files)
    if progress:  # one record, or the merged records of an interrupted run's parts
        records.append(progress[0] if len(progress) == 1 else merge_states(progress))
    planned = planned_names(plan, source, others)
    foreign = []
    for f in existing:
        base = f[: -len(PARTIAL)] if f.endswith(PARTIAL) else f
        if f not in owned and (base in planned or f.endswith((".safetensors", ".safetensors.index.json"))):
            foreign.append(f)  # we would overwrite it, or loaders would take it for weights
    for p in sorted(planned):  # a folder (or a file) in the way of a file we write
        q = dst / p
        if q.is_dir() and not q.is_symlink():
            foreign.append(p + "/")
        for parent in list(Path(p).parents)[:-1]:
            if os.path.islink(dst / parent):  # a symlinked folder would send our files outside DST
                raise through_link(dst, parent.as_posix())
            if (dst / parent).exists() and not (dst / parent).is_dir():
                foreign.append(parent.as_posix())
    why = f" ({'; '.join(damaged)})" if damaged else ""
    if foreign:
        shown_names = sorted(set(foreign))
        shown = ", ".join(shown_names[:5]) + (f" and {len(shown_names) - 5} more" if len(shown_names) > 5 else "")
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
        done = resumable(dst, records, identity, config)
    _check_space(dst, plan, others, done)
    return done


def _check_space(dst: Path, plan: Plan, others: list[Path], done: dict) -> None:
    """Every byte the run writes: shard headers and data, copied files, format files, index, manifest, record."""
    need = 0
    for f, entries in plan.shards:
        if f not in done:
            need += len(header_bytes(entries, {"format": "pt"})) + sum(e.nbytes for e in entries)
    for p in others:
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
