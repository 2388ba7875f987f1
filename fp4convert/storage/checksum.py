"""File checksums: what the manifest records of each file, and the one check every reader uses.

A weight shard is recorded with its ``chunked_sha256``: the file cut into chunks of :data:`CHUNK`
bytes (16 MiB; the last one shorter), each chunk's sha256, and the sha256 of those 32-byte digests
concatenated in file order (an empty file: the sha256 of nothing). A whole-file sha256 is sequential
(about 1 GB/s a core on the H100 host: 2.9 s for a 3 GB shard, longer than the rest of the run);
chunks are hashed side by side, by the writer as each chunk's bytes are complete and by every
verifier. Every other file (config, tokenizer, index, card: written whole, small) keeps its plain
``sha256``, which ``sha256sum`` reproduces. Manifests written before the chunked checksum list
``sha256`` for every file; both kinds are verified here, by :func:`matches`, for ``inspect
--check-files``, ``push``, ``export`` and ``--resume`` alike.

Stdlib only: the torch-free CUDA path writes shards through this module.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, cast

CHUNK = 16 << 20  # part of the chunked_sha256's definition: never change it (docs/formats.md, the manifest)
KINDS = ("chunked_sha256", "sha256")  # a file record holds at least one; each one present is checked
BLOCK = 1 << 20  # bytes read at a time while hashing: a thread's whole buffer
_HEX = frozenset("0123456789abcdef")

Progress = Callable[[int], None]  # told the bytes checked so far, from the calling thread


def threads() -> int:
    """Hashing threads (a core hashes ~1 GB/s; a few outrun the disk)."""
    return max(1, min(4, os.cpu_count() or 1))


def chunk_count(size: int) -> int:
    return -(-size // CHUNK)


def chunk_span(i: int, size: int) -> tuple[int, int]:
    """Chunk ``i`` of a file of ``size`` bytes: (offset, length)."""
    off = i * CHUNK
    return off, min(CHUNK, size - off)


def combine(digests: Iterable[bytes]) -> str:
    """The chunked_sha256 of a file, from its chunks' sha256 digests in file order."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def chunked_sha256_of_bytes(data: bytes | bytearray | memoryview) -> str:
    """The definition, over bytes in memory (tests and small files)."""
    view = memoryview(data)
    return combine(hashlib.sha256(view[o : o + CHUNK]).digest() for o in range(0, len(view), CHUNK))


_local = threading.local()


def _buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(BLOCK))
    return buf


def hash_range(fd: int, offset: int, n: int, h=None):
    """sha256 (``h``, updated, or a new one) of ``n`` bytes of ``fd`` from ``offset``, read with pread
    (no shared file position: any thread, any fd). A file that ends early hashes what it holds."""
    h = hashlib.sha256() if h is None else h
    buf = _buffer()
    end = offset + n
    while offset < end:
        got = os.preadv(fd, [buf[: min(BLOCK, end - offset)]], offset)
        if not got:
            break
        h.update(buf[:got])
        offset += got
    return h


def chunk_digest(fd: int, i: int, size: int) -> bytes:
    """sha256 digest of chunk ``i`` of the file ``fd`` of ``size`` bytes (read back, e.g. from the page cache)."""
    off, n = chunk_span(i, size)
    return hash_range(fd, off, n).digest()


def chunked_sha256(fd: int, size: int, progress: Progress | None = None, workers: int | None = None) -> str:
    """The chunked_sha256 of the first ``size`` bytes of ``fd``, its chunks hashed on ``workers`` threads."""
    n = chunk_count(size)
    workers = min(workers or threads(), n)
    if workers <= 1:
        digests = []
        for i in range(n):
            digests.append(chunk_digest(fd, i, size))
            if progress is not None:
                progress(chunk_span(i, size)[1])
        return combine(digests)
    with ThreadPoolExecutor(workers, thread_name_prefix="fp4convert-verify") as pool:
        digests = []
        for i, d in enumerate(pool.map(lambda i: chunk_digest(fd, i, size), range(n))):  # in file order
            digests.append(d)
            if progress is not None:
                progress(chunk_span(i, size)[1])
        return combine(digests)


def sha256(fd: int, size: int, progress: Progress | None = None) -> str:
    """The whole-file sha256 of the first ``size`` bytes of ``fd`` (sequential by definition)."""
    h = hashlib.sha256()
    for off in range(0, size, CHUNK):
        n = min(CHUNK, size - off)
        hash_range(fd, off, n, h)
        if progress is not None:
            progress(n)
    return h.hexdigest()


def record_problem(rec: object) -> str | None:
    """Why ``rec`` is not a file record (None when it is): ``size`` and at least one checksum, each a
    64-digit lower-case hex string."""
    if not isinstance(rec, dict):
        return "is not an object"
    size = rec.get("size")
    if type(size) is not int or size < 0:
        return "has no size in bytes"
    present = [k for k in KINDS if k in rec]
    if not present:
        return f"has no checksum ({' or '.join(KINDS)})"
    for k in present:
        v = rec[k]
        if not isinstance(v, str) or len(v) != 64 or not set(v) <= _HEX:
            return f"has a malformed {k} (not 64 hex digits)"
    return None


def kind(rec: dict) -> str:
    """The checksum a record states (the chunked one when it has both)."""
    return next(k for k in KINDS if k in rec)


def matches(f: BinaryIO | int, rec: dict, progress: object = None) -> bool:
    """Do the bytes of the open file ``f`` (a file object or a descriptor) match every checksum of the
    manifest record ``rec``? The size is the caller's check (its own message); this reads up to the
    end of the file. ``progress``: a callable or an object with ``update(n)`` (a tqdm bar), told the
    bytes hashed; the chunked checksum is computed on several threads."""
    fd = f if isinstance(f, int) else f.fileno()
    size = os.fstat(fd).st_size
    tell = cast("Progress | None", getattr(progress, "update", progress))
    ok = True
    for k in KINDS:
        if k in rec and ok:
            got = chunked_sha256(fd, size, tell) if k == "chunked_sha256" else sha256(fd, size, tell)
            ok = got == rec[k]
    return ok


def file_matches(path: Path, rec: dict) -> bool:
    """:func:`matches` on the file at ``path`` (its size included)."""
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size == rec.get("size") and matches(f, rec)


def file_record(path: Path) -> dict:
    """A weight shard's record as the writer makes it: ``{"chunked_sha256", "size"}``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return {"chunked_sha256": chunked_sha256(f.fileno(), size), "size": size}


def file_sha256(path: Path) -> str:
    """The whole-file sha256 of the file at ``path``: what the manifest records of every file that is not
    a weight shard (and of the source's files, for ``--verify-source``)."""
    with open(path, "rb") as f:
        return sha256(f.fileno(), os.fstat(f.fileno()).st_size)
