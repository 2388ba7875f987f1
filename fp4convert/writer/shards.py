"""Output shards: the passive writer. It writes the bytes it is handed where the plan put them.

The plan fixed every shard's header (names, dtypes, shapes, offsets) before a byte was read, so a
shard's file is opened when its first tensor comes and closed when its last one has been written:
flushed here, then (on the file's hasher thread) recorded with its checksum, fsync'd and renamed
from ``NAME.partial`` into place. Kept tensors are copied from the source unchanged, their floats
scanned for NaN/Inf as they stream. Nothing here decides what is written or when: the run loop
(:mod:`fp4convert.runner`) and the write jobs it queues call down into :class:`ShardSet`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .. import stages
from ..config import human_bytes
from ..errors import OutputError, SourceError
from ..names import PARTIAL
from ..safetensors_io import StreamWriter
from .files import open_new, source_error, step, writing

if TYPE_CHECKING:
    from ..plan import Plan
    from ..safetensors_io import TensorInfo

log = logging.getLogger(__name__)

NonfiniteCheck = Callable[[str, memoryview], bool]  # (safetensors dtype, bytes) -> NaN/Inf present
FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # the dtypes whose kept bytes are scanned for NaN/Inf
COPY_CHUNK = 16 << 20
# A shard's written bytes are handed to the disk in ranges of this size while the run goes on, so the
# fsync before its rename finds little left to write (it took 1.42 s at the end of the H100 dense run at
# the default shard size, issue 21).
WRITEBACK = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux), or None where there is none (then the fsync does it all)."""
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _writeback_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="fp4convert-writeback")


def start_writeback(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + n)`` of ``fd`` to the disk (asynchronously, on
    a helper thread: the call may wait while the device's queue is full); closes ``fd`` (a dup) after."""
    fn = _sync_file_range()
    assert fn is not None

    def run() -> None:
        try:
            with stages.timed("writeback_start"):
                fn(fd, offset, n, _SYNC_FILE_RANGE_WRITE)  # advisory: an error leaves the work to the fsync
        finally:
            os.close(fd)

    _writeback_pool().submit(run)


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
        self.size, self._lock = size, threading.Lock()
        self._free: list[bytearray] = []

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


_chunks = _ChunkPool(COPY_CHUNK)


@functools.cache
def _loader():
    from concurrent.futures import ThreadPoolExecutor

    # Each kept copy waits for its own next chunk; several threads serve lanes copying side by side.
    return ThreadPoolExecutor(4, thread_name_prefix="fp4convert-copy-read")


def _stream_writer(dst: Path, f: str, entries: list) -> StreamWriter:
    """A shard's StreamWriter on a ``.partial`` file this run created itself (:func:`open_new`: whatever
    an interrupted run left there, a symlink included, is removed first, never written through); the
    file the writer opened is checked to be that one."""
    fd = open_new(dst, f + PARTIAL)
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


class ShardSet:
    """The output shards one part of a run writes (at most two open at once: a unit can straddle a boundary).

    ``done``: shards finished earlier (a resume; never rewritten); ``owns``: the shards this part writes;
    ``on_close(shard, {sha256, size})``: a shard is complete and hashed, before its rename;
    ``check``: the NaN/Inf scan of kept floats; ``on_nonfinite(name, file)``: a kept tensor holds them.
    """

    def __init__(self, dst: Path, plan: Plan, done: dict, on_close: Callable[[str, dict], None],
                 owns: Callable[[str], bool], check: NonfiniteCheck,
                 on_nonfinite: Callable[[str, str], None]) -> None:
        self.dst, self.done, self.on_close = dst, done, on_close
        self.check, self.on_nonfinite, self.owns = check, on_nonfinite, owns
        self.entries = dict(plan.shards)
        self.shard_of = plan.shard_of()
        self.open: dict[str, StreamWriter] = {}
        self.closing: list = []  # futures of finished shards' closes (on each file's hasher thread)
        self.handed: dict[str, int] = {}  # shard -> bytes already handed to the disk (start_writeback)

    def skip(self, name: str) -> bool:
        """Output tensor ``name`` is not written by this part (another part's shard, or finished earlier)."""
        f = self.shard_of[name]
        return f in self.done or not self.owns(f)

    def _writer(self, name: str) -> StreamWriter:
        self._check_closing()
        f = self.shard_of[name]
        if f not in self.open:
            try:
                self.open[f] = _stream_writer(self.dst, f, self.entries[f])
            except BaseException:
                (self.dst / (f + PARTIAL)).unlink(missing_ok=True)
                raise
        return self.open[f]

    def _writeback(self, f: str) -> None:
        """Hand the shard's bytes written since the last time to the disk, once there are WRITEBACK of them."""
        w = self.open[f]
        done = self.handed.get(f, 0)
        if w.size - done < WRITEBACK or _sync_file_range() is None:
            return
        with writing(w.partial):
            w.flush()  # the writer's buffered bytes into the page cache first
            fd = os.dup(w._f.fileno())
        self.handed[f] = w.size
        start_writeback(fd, done, w.size - done)

    def _maybe_close(self, f: str) -> None:
        w = self.open[f]
        if not w.complete:
            self._writeback(f)
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
            step()
            with writing(self.dst / f):
                w.close()
            log.info("wrote %s (%s)", f, human_bytes(w.size))

        self.closing.append((w, w.then(close)))

    def _check_closing(self) -> None:
        """Raise a finished shard's close error now (fsync and rename run beside the writes)."""
        for _, fut in self.closing:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def finish(self) -> None:
        """Every shard this part owns is written, recorded, synced and renamed; raises the first close error."""
        for _, fut in self.closing:
            fut.result()
        if self.open:  # the plan and the work disagree: never leave this silently
            raise RuntimeError("internal: output shards left incomplete")

    def write(self, name: str, data: bytes | memoryview, owner: object = None) -> None:
        """Write output tensor ``name``, given as its raw bytes (``owner`` keeps their memory alive)."""
        if self.skip(name):
            return
        w = self._writer(name)
        with writing(w.partial):
            w.write_bytes(name, data, owner)
        self._maybe_close(self.shard_of[name])

    def copy_kept(self, name: str, path: Path, info: TensorInfo) -> None:
        """Copy a kept tensor's bytes unchanged, checking floats for NaN/Inf as they stream."""
        with stages.timed("copy_kept"):
            self._copy_kept(name, path, info)

    def _copy_kept(self, name: str, path: Path, info: TensorInfo) -> None:
        # A unit re-done on resume (its shard was finished, its record was not saved yet) is read again
        # for the NaN/Inf check only, so its warning is the same as in an uninterrupted run.
        w = None if self.skip(name) else self._writer(name)
        if w is not None:
            w._expect(name, info.nbytes)
        elif not self.owns(self.shard_of[name]) or info.dtype not in FLOATS:
            return
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise source_error(exc, path) from exc
        check = self.check if info.dtype in FLOATS else None

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
        parts = [(info.begin + o, min(COPY_CHUNK, info.nbytes - o)) for o in range(0, info.nbytes, COPY_CHUNK)]
        bad = False
        with fh:
            ahead = _loader().submit(load, *parts[0]) if parts else None
            for k in range(len(parts)):
                assert ahead is not None
                chunk, view, flagged = ahead.result()
                ahead = _loader().submit(load, *parts[k + 1]) if k + 1 < len(parts) else None
                bad = bad or flagged
                if w is not None:
                    with writing(w.partial):
                        w.write(view, owner=chunk)
                    self._writeback(self.shard_of[name])
                del chunk, view
            if ahead is not None:
                ahead.result()
        if bad:
            self.on_nonfinite(name, info.file)
        if w is not None:
            self._maybe_close(self.shard_of[name])

    def abort(self) -> None:
        for _, fut in self.closing:  # a close in flight finishes (its record may already be saved)
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
