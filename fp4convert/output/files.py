"""Files inside DST: every file fp4convert creates, opens, renames or removes there, contained and named.

Containment (issue 12): a file is created with ``O_EXCL | O_NOFOLLOW`` inside folders opened component
by component with ``O_NOFOLLOW``, so nothing is ever written through a symlink, whatever happens to
the names meanwhile. Every OS error on DST becomes an :class:`~fp4convert.errors.OutputError` naming
the file and what to do (exit 5), every one on the source a :class:`~fp4convert.errors.SourceError`.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fp4convert.errors import OutputError, SourceError
from fp4convert.storage.names import PARTIAL

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


def contained(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies below it (paths compared as given)."""
    return inner == outer or outer in inner.parents


def os_error(exc: OSError, dst: Path) -> Exception:
    """A raw OS error that escaped a run: the destination's (OutputError) or the source's (SourceError)."""
    where = Path(exc.filename) if exc.filename else None
    if where is not None and contained(Path(os.path.abspath(where)), Path(os.path.abspath(dst))):
        return output_error(exc, where)
    return source_error(exc, where or "a source file")


# ---------------------------------------------------------------------------------------------
# Containment: every file fp4convert creates or opens in DST
# ---------------------------------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def through_link(dst: Path, rel: str) -> OutputError:
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
                    raise through_link(dst, "/".join(done)) from None
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def _split(rel: str) -> tuple[str, str]:
    parent, _, leaf = rel.rpartition("/")
    return parent, leaf


def open_new(dst: Path, rel: str, flags: int = os.O_WRONLY) -> int:
    """A new, empty file DST/``rel`` (a temporary ``*.partial`` name, whatever was there is removed
    first): parents are real folders inside DST, created as needed, and the file is created with
    O_EXCL|O_NOFOLLOW, so a symlink left in its place is never written through. ``flags``: O_WRONLY,
    or O_RDWR for a file that is read back while written (a shard's hashes)."""
    parent, leaf = _split(rel)
    with writing(dst / rel):
        with dst_dir(dst, parent, create=True) as dfd:
            try:
                os.unlink(leaf, dir_fd=dfd)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                raise output_error(OSError(errno.EISDIR, "Is a directory", str(dst / rel)), dst / rel) from None
            return os.open(leaf, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)


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
    tmp = rel + PARTIAL
    fd = open_new(dst, tmp)
    with writing(dst / tmp), os.fdopen(fd, "wb") as fh:
        fh.write(data)
    rename_in(dst, tmp, rel)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to a .partial file and rename it into place (never through a symlink: :func:`write_new`)."""
    write_new(path.parent, path.name, text.encode())


def is_regular(path: Path) -> bool:
    """A regular file itself (lstat: a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# Test hooks
# ---------------------------------------------------------------------------------------------

_steps = 0
_step_lock = threading.Lock()  # shards close on pool threads: steps may come from several


def step() -> None:
    """A step of a run is done (a unit, a shard's record before its rename, a finishing write): the
    test hooks. FP4CONVERT_TEST_DELAY sleeps that many seconds, so a test can interrupt the run at
    random moments; FP4CONVERT_TEST_KILL_AT=N SIGKILLs the process at the N-th step."""
    global _steps
    delay = os.environ.get("FP4CONVERT_TEST_DELAY")
    if delay:
        time.sleep(float(delay))
    kill_at = os.environ.get("FP4CONVERT_TEST_KILL_AT")
    if kill_at:
        with _step_lock:
            _steps += 1
            if _steps == int(kill_at):
                os.kill(os.getpid(), 9)
