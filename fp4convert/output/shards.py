"""Output shards: the passive writer. It writes the bytes it is handed where the plan put them.

The plan fixed every shard's header (names, dtypes, shapes, offsets) before a byte was read, so every
tensor's bytes go straight to their offset (``pwrite``), from any of a part's writer threads and in
any order: a quantized item's outputs, the pieces of a kept tensor's copy. A shard's file is created
(``NAME.partial``) when its first bytes come. The file is cut into the checksum's chunks
(:data:`fp4convert.storage.checksum.CHUNK`); once every byte of a chunk is written, the chunk is handed to
the disk (``sync_file_range``, so the final fsync finds little left to write) and hashed, read back
from the page cache on the hash threads. Once every chunk is hashed the shard is complete: recorded
with its ``chunked_sha256`` and size, fsync'd and renamed into place (on a closer thread). Kept
tensors are copied from the source unchanged, each piece scanned for NaN/Inf before it is written, or,
where the plan gave one another dtype (``--kept-dtype bf16``: F32/F64 -> BF16), each piece converted
(:func:`fp4convert.quantizer.matrices.kept_bytes_to_bf16`) and written at its place in the smaller tensor.
Nothing here decides what is written or when: the run loop (:mod:`fp4convert.run.runner`) and the write
jobs it queues call down into :class:`ShardSet`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.config import human_bytes
from fp4convert.errors import SourceError, kept_overflow_error
from fp4convert.output.files import open_new, rename_in, source_error, step, writing
from fp4convert.storage import checksum
from fp4convert.storage.names import PARTIAL
from fp4convert.storage.safetensors import ITEMSIZE, header_bytes

if TYPE_CHECKING:
    from fp4convert.plan.planner import Plan
    from fp4convert.storage.safetensors import OutEntry, TensorInfo

log = logging.getLogger(__name__)

NonfiniteCheck = Callable[[str, memoryview], bool]  # (safetensors dtype, bytes) -> NaN/Inf present
FLOATS = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # the dtypes whose kept bytes are scanned for NaN/Inf
# A kept tensor is copied in pieces of this size, each its own write job (read, scan, write), so the
# part's writer threads copy one large tensor (an embedding, lm_head) side by side. A piece is also
# a writer thread's whole copy buffer.
PIECE = 8 << 20
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
def _pool(kind: str):
    """The process's helper threads: ``writeback`` (one: sync_file_range may wait while the device's
    queue is full, and must never hold up hashing), ``hash`` (the chunks' sha256), ``close`` (a
    finished shard's record, fsync and rename: an fsync waits for the disk)."""
    from concurrent.futures import ThreadPoolExecutor

    n = {"writeback": 1, "hash": checksum.threads(), "close": 2}[kind]
    return ThreadPoolExecutor(n, thread_name_prefix=f"fp4convert-{kind}")


def background(kind: str, fn: Callable[[], None]) -> Future:
    """Run ``fn`` on the ``kind`` helper threads (tests run it inline: a shard then closes within the
    write that completes it)."""
    return _pool(kind).submit(fn)


def start_writeback(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + n)`` of ``fd`` to the disk (asynchronously, on
    the writeback thread); closes ``fd`` (a dup) after."""
    fn = _sync_file_range()
    assert fn is not None

    def run() -> None:
        try:
            with timing.timed("writeback_start"):
                fn(fd, offset, n, _SYNC_FILE_RANGE_WRITE)  # advisory: an error leaves the work to the fsync
        finally:
            os.close(fd)

    background("writeback", run)


_local = threading.local()


def _copy_buffer(n: int, which: str = "buf") -> memoryview:
    """This thread's copy buffer (``which``: ``buf`` the bytes read, ``out`` their conversion), at least
    ``n`` bytes (grown on demand: a small kept tensor never costs a whole piece)."""
    buf = getattr(_local, which, None)
    if buf is None or len(buf) < n:
        buf = memoryview(bytearray(max(n, 64 << 10)))
        setattr(_local, which, buf)
    return buf[:n]


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        k = os.pwrite(fd, view, offset)
        view, offset = view[k:], offset + k


class ShardFile:
    """One shard being written: its ``.partial`` file, created here (inside DST, never through a symlink:
    :func:`~fp4convert.output.files.open_new`) with its header; each tensor's span; what is still
    missing, by tensor and by chunk; the chunks' digests. Writes come from any thread."""

    def __init__(self, dst: Path, name: str, entries: list[OutEntry]) -> None:
        self.dst, self.name = dst, name
        self.partial = dst / (name + PARTIAL)
        header = header_bytes(entries, {"format": "pt"})
        self.spans: dict[str, tuple[int, int]] = {}
        off = len(header)
        for e in entries:
            self.spans[e.name] = (off, e.nbytes)
            off += e.nbytes
        self.size = off
        n = checksum.chunk_count(self.size)
        self._missing = [checksum.chunk_span(i, self.size)[1] for i in range(n)]  # bytes not yet written, a chunk
        self._left = {e.name: e.nbytes for e in entries}  # bytes not yet written, a tensor
        self.digests: list[bytes | None] = [None] * n
        self._unhashed = n
        self._lock = threading.Lock()
        self.aborted = False
        self.closing = False  # every chunk hashed: the close (record, fsync, rename) has started
        self.tasks: list[Future] = []  # its chunks' hashes
        self.finished: Future = Future()  # the close's outcome
        self.fd = open_new(dst, name + PARTIAL, os.O_RDWR)  # read back by the hashes
        try:
            self.first = self._put(header, 0)  # chunks complete with the header alone (a header-only shard)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, name: str, data: bytes | memoryview, at: int = 0) -> list[int]:
        """Write ``data`` as the bytes of tensor ``name`` from byte ``at`` of it; returns the chunks this
        completed (every byte written)."""
        off, nbytes = self.spans[name]
        n = memoryview(data).nbytes
        with self._lock:
            left = self._left[name]
            if at < 0 or at + n > nbytes or n > left:
                raise RuntimeError(f"internal: {self.name}: {n} B of {name!r} at {at} do not fit its {nbytes} B "
                                   f"({left} B not yet written)")
            self._left[name] = left - n
        return self._put(data, off + at)

    def _put(self, data: bytes | memoryview, offset: int) -> list[int]:
        n = memoryview(data).nbytes
        if not n:
            return []
        with timing.timed("write"):
            _pwrite_all(self.fd, data, offset)
        done = []
        with self._lock:
            i, end = offset // checksum.CHUNK, offset + n
            while i * checksum.CHUNK < end:
                lo, hi = max(offset, i * checksum.CHUNK), min(end, (i + 1) * checksum.CHUNK)
                self._missing[i] -= hi - lo
                if self._missing[i] == 0:
                    done.append(i)
                i += 1
        return done

    def digested(self, i: int, digest: bytes) -> bool:
        """Chunk ``i``'s digest is in; True when it was the last one (the shard is complete: close it)."""
        with self._lock:
            if self.aborted:
                return False
            self.digests[i] = digest
            self._unhashed -= 1
            self.closing = self._unhashed == 0
            return self.closing

    @property
    def complete(self) -> bool:
        with self._lock:
            return not any(self._missing)

    def checksum(self) -> str:
        return checksum.combine(d for d in self.digests if d is not None)

    def close(self) -> None:
        """fsync, then rename into place (every byte written and hashed first)."""
        with timing.timed("fsync"):
            os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        rename_in(self.dst, self.name + PARTIAL, self.name)

    def fail(self, exc: BaseException) -> None:
        """A hash or the close failed: the shard's outcome (the first error)."""
        with self._lock:
            if not self.finished.done():
                self.finished.set_exception(exc)

    def abort(self) -> bool:
        """Stop, unless every byte is written (then False: its hashes and close go on, and it is kept for
        --resume as an uninterrupted run would keep it): no close starts, the hashes in flight end, the
        ``.partial`` file is removed."""
        with self._lock:
            if self.closing or not any(self._missing):
                return False
            self.aborted = True
        for t in list(self.tasks):
            try:
                t.result()
            except BaseException:  # noqa: BLE001 - the run is failing already
                pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.partial.unlink(missing_ok=True)
        return True


class ShardSet:
    """The output shards one part of a run writes, from any of its writer threads.

    ``done``: shards finished earlier (a resume; never rewritten); ``owns``: the shards this part writes;
    ``on_close(shard, {chunked_sha256, size})``: a shard is complete and hashed, before its rename;
    ``check``: the NaN/Inf scan of kept floats; ``on_nonfinite(name, file)``: a kept tensor holds them.
    """

    def __init__(self, dst: Path, plan: Plan, done: dict, on_close: Callable[[str, dict], None],
                 owns: Callable[[str], bool], check: NonfiniteCheck,
                 on_nonfinite: Callable[[str, str], None]) -> None:
        self.dst, self.done, self.on_close = dst, done, on_close
        self.check, self.on_nonfinite, self.owns = check, on_nonfinite, owns
        self.entries = dict(plan.shards)
        self.shard_of = plan.shard_of()
        self.dtype_of = {e.name: e.dtype for _, entries in plan.shards for e in entries}
        self.files: dict[str, ShardFile] = {}  # every shard this run opened, in order
        self._lock = threading.Lock()

    def skip(self, name: str) -> bool:
        """Output tensor ``name`` is not written by this part (another part's shard, or finished earlier)."""
        f = self.shard_of[name]
        return f in self.done or not self.owns(f)

    def _file(self, f: str) -> ShardFile:
        with self._lock:
            self._check_closing()
            sf = self.files.get(f)
            if sf is not None:
                return sf
            try:
                with writing(self.dst / f):
                    sf = ShardFile(self.dst, f, self.entries[f])
            except BaseException:
                (self.dst / (f + PARTIAL)).unlink(missing_ok=True)
                raise
            self.files[f] = sf
        self._hand_over(sf, sf.first)
        return sf

    def _hand_over(self, sf: ShardFile, chunks: list[int]) -> None:
        """Complete chunks: to the disk (writeback) and to the hash threads (each with its own descriptor,
        so an abort may close the shard's at any time)."""
        for i in chunks:
            off, n = checksum.chunk_span(i, sf.size)
            try:
                with writing(sf.partial):
                    if _sync_file_range() is not None:
                        start_writeback(os.dup(sf.fd), off, n)
                    fd = os.dup(sf.fd)
                sf.tasks.append(background("hash", functools.partial(self._hash, sf, i, fd)))
            except BaseException as exc:
                sf.fail(exc)  # it will never finish: nothing waits for it
                raise

    def _hash(self, sf: ShardFile, i: int, fd: int) -> None:
        try:
            if sf.aborted:
                return
            with timing.timed("hash"), writing(sf.partial):
                digest = checksum.chunk_digest(fd, i, sf.size)
            if sf.digested(i, digest):
                background("close", functools.partial(self._close, sf))
        except BaseException as exc:  # noqa: BLE001 - reported by the next write or finish()
            sf.fail(exc)
        finally:
            os.close(fd)

    def _close(self, sf: ShardFile) -> None:
        """Record the finished shard (checksum, size) first, then fsync and rename it. An interruption in
        between leaves a record that --resume can use (it checks the file)."""
        try:
            self.on_close(sf.name, {"chunked_sha256": sf.checksum(), "size": sf.size})
            step()
            with writing(self.dst / sf.name):
                sf.close()
            log.info("wrote %s (%s)", sf.name, human_bytes(sf.size))
            sf.finished.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the next write or finish()
            sf.fail(exc)

    def _check_closing(self) -> None:
        """Raise a shard's hash or close error now (they run beside the writes)."""
        for sf in self.files.values():
            if sf.finished.done() and sf.finished.exception() is not None:
                raise sf.finished.exception()  # type: ignore[misc]

    def finish(self) -> None:
        """Every shard this part owns is written, recorded, synced and renamed; raises the first error."""
        for sf in self.files.values():
            if not sf.complete:  # the plan and the work disagree: never leave this silently
                raise RuntimeError(f"internal: output shard {sf.name} left incomplete")
        for sf in self.files.values():
            sf.finished.result()

    def write(self, name: str, data: bytes | memoryview, owner: object = None, at: int = 0) -> None:
        """Write output tensor ``name`` (or the bytes of it from byte ``at``), given as raw bytes (``owner``:
        what keeps their memory alive; the bytes are in the page cache when this returns)."""
        if self.skip(name):
            return
        sf = self._file(self.shard_of[name])
        with writing(sf.partial):
            done = sf.write(name, data, at)
        self._hand_over(sf, done)

    def copy_piece(self, name: str, path: Path, info: TensorInfo, at: int, n: int) -> None:
        """Copy bytes ``[at, at + n)`` of kept tensor ``name`` (a whole number of elements), scanning floats
        for NaN/Inf first (a flagged tensor is recorded before any of its bytes can complete the shard):
        unchanged, or converted to the dtype the plan gave it (F32/F64 -> BF16, written at the same
        element's place; a finite value BF16 cannot hold is refused, never written as Inf)."""
        with timing.timed("copy_kept"):
            # A unit re-done on resume (its shard was finished, its record was not saved yet) is read again
            # for the NaN/Inf check only, so its warning is the same as in an uninterrupted run.
            skip = self.skip(name)
            if skip and (not self.owns(self.shard_of[name]) or info.dtype not in FLOATS):
                return
            view = _copy_buffer(n)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise source_error(exc, path) from exc
            try:
                got = 0
                while got < n:
                    try:
                        k = os.preadv(fd, [view[got:]], info.begin + at + got)
                    except OSError as exc:
                        raise source_error(exc, path) from exc
                    if not k:
                        raise SourceError(f"{info.file}: tensor {name!r} is truncated (the file ended while copying it)")
                    got += k
            finally:
                os.close(fd)
            bad = info.dtype in FLOATS and self.check(info.dtype, view)
            if bad:
                self.on_nonfinite(name, info.file)
            if skip:
                return
            out_dtype = self.dtype_of[name]
            if out_dtype == info.dtype:
                self.write(name, view, at=at)
                return
            if out_dtype != "BF16" or info.dtype not in ("F32", "F64"):
                raise RuntimeError(f"internal: kept tensor {name!r} planned as {out_dtype}, its source is {info.dtype}")
            from fp4convert.quantizer.matrices import kept_bytes_to_bf16

            ratio = ITEMSIZE[info.dtype] // ITEMSIZE[out_dtype]
            out = _copy_buffer(n // ratio, "out")
            if kept_bytes_to_bf16(info.dtype, view, out):
                raise kept_overflow_error(name, info.file, info.dtype)
            self.write(name, out, at=at // ratio)

    def copy_kept(self, name: str, path: Path, info: TensorInfo) -> None:
        """Copy a whole kept tensor, piece by piece in this thread (:func:`pieces` are separate jobs for a
        conversion's copies)."""
        for at, n in pieces(info.nbytes):
            self.copy_piece(name, path, info, at, n)

    def abort(self) -> None:
        """A failed part: a shard whose bytes are all written is finished (hashed, recorded, renamed: it
        stays for --resume); every other unfinished shard's ``.partial`` is removed."""
        for sf in self.files.values():
            if sf.finished.done() and sf.finished.exception() is None:
                continue  # finished and renamed
            try:
                if sf.abort():
                    continue
            except OSError:
                continue
            try:
                sf.finished.result()
            except BaseException:  # noqa: BLE001 - the run is failing already; the .partial stays for --resume
                pass


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """A kept tensor's copy pieces: (offset in the tensor, length)."""
    return [(o, min(PIECE, nbytes - o)) for o in range(0, nbytes, PIECE)]
