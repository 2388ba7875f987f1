"""The safetensors file format at the byte level: strict header parsing, raw reads, output headers.

We read and write the format ourselves rather than through ``safetensors.torch`` for two reasons:
planning needs only the JSON header (never the data), and a shard of several GB is written tensor by
tensor at offsets its header fixed in advance (:mod:`fp4convert.output.shards`), so that host memory
stays bounded. The layout is the documented one: an
8-byte little-endian header length, a JSON header of ``name -> {dtype, shape, data_offsets}``
(and an optional ``__metadata__``), then the tensor bytes back to back.

Validation is at least as strict as the ``safetensors`` library's (0.8), from the header alone:
header length at most 100,000,000 bytes; UTF-8; starts with ``{``; a JSON object; ``__metadata__``
null or a str -> str map; every tensor a known dtype, a shape of integers 0 <= d < 2**63 whose byte
size (elements x bits / 8, whole bytes) equals its ``data_offsets`` span, and the spans, sorted,
tiling the data region from 0 to the end of the file with no overlap and no hole. Stricter than the
library: duplicate keys anywhere, lone UTF-16 surrogate escapes, NaN/Infinity, integers of more than
20 digits, non-finite numbers and nesting deeper than :data:`MAX_JSON_DEPTH` are refused, and the
header must start with ``{`` (0.8 also accepts leading whitespace). Every failure is a
:class:`CheckpointFormatError` whose one-line message names the file (and the tensor).
"""

from __future__ import annotations

import array
import ctypes
import functools
import itertools
import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import CheckpointFormatError, NotRegularFile

if TYPE_CHECKING:
    import torch

# Dtype facts are plain data, so planning (names, shapes, sizes) never imports torch. The torch dtypes
# are resolved on first use: torch_dtypes() (or the module attribute DTYPES) maps each name below to
# the attribute of ``torch`` that holds it.
TORCH_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                     "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
            "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1, "F4": 1}
# Bits per element of every dtype the safetensors library (0.8) knows; sub-byte types pack whole bytes.
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64}
FLOAT_DTYPES = ("F32", "F16", "BF16")  # what the quantizer accepts as source

MAX_HEADER = 100_000_000  # bytes; the safetensors library's limit
MAX_JSON_DEPTH = 64  # a header needs 3 levels; serde_json (the library's parser) stops at 128
MAX_INT_DIGITS = 20  # 2**64 - 1 has 20 digits
_U64 = 1 << 64
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64


@cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype name -> torch dtype, for the functions that read and write tensor data."""
    import torch

    return {name: getattr(torch, attr) for name, attr in TORCH_DTYPE_NAMES.items()}


def __getattr__(name: str):
    if name == "DTYPES":  # PEP 562: built on first use, so importing this module does not import torch
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from the header alone."""

    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    file: str  # file name relative to the checkpoint root
    begin: int  # absolute byte offset of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# ---------------------------------------------------------------------------------------------
# Hardened JSON (also used for the index and config.json)
# ---------------------------------------------------------------------------------------------

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as signed bytes: +1 +1 -1 -1


def json_depth(raw: bytes) -> int:
    """Deepest bracket nesting outside JSON strings, without recursion (cheap; run before json.loads).

    Each bracket becomes a +1/-1 step and the running sum's maximum is the depth; ``accumulate`` over
    a signed byte array runs in C (about 25 ns a bracket, faster than torch even for 10M brackets).
    """
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    steps = array.array("b", brackets.translate(_BRACKET_STEP))
    return max(itertools.accumulate(steps, initial=0))


def _object_no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"key {_q(k)} appears twice")
            seen.add(k)
    return out


def _int(s: str) -> int | float:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer {s[:12]}... has {len(s)} digits (at most {MAX_INT_DIGITS})")
    if s == "-0":
        return -0.0  # as serde_json (the library's parser) reads it: a float, so never a size or offset
    return int(s)


def _float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:24]} is out of range")
    return v


def _constant(s: str) -> float:
    raise ValueError(f"{s} is not JSON")


def loads_strict(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> object:
    """Bytes -> JSON value, refusing what a careless parse would accept or crash on.

    Raises :class:`ValueError` (``UnicodeDecodeError``, ``json.JSONDecodeError`` or a plain one from
    the hooks) with a short message; never ``RecursionError`` or a traceback-worthy type.
    """
    text = raw.decode("utf-8")  # strict: UnicodeDecodeError is a ValueError
    if json_depth(raw) > max_depth:
        raise ValueError(f"JSON nests deeper than {max_depth} levels")
    try:
        return json.loads(text, object_pairs_hook=_object_no_duplicates, parse_int=_int, parse_float=_float,
                          parse_constant=_constant)
    except RecursionError as exc:  # not reached after json_depth; kept so no caller ever sees one
        raise ValueError("JSON nests too deeply") from exc


def loads_bounded(raw: bytes) -> object:
    """Bytes -> JSON value as Python's json reads it (NaN, duplicate keys: last wins), but UTF-8 only and
    with nesting bounded, so a hostile file is a ValueError, never a RecursionError (config.json)."""
    text = raw.decode("utf-8")
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("JSON nests too deeply") from exc


def json_kind(v: object) -> str:
    """'JSON list', 'string', 'null'... for messages about a value of the wrong type."""
    return {dict: "JSON object", list: "JSON list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def json_error(exc: ValueError) -> str:
    """A one-line reason for a :func:`loads_strict` failure (no document text echoed)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 (byte {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at byte {exc.pos})"
    return " ".join(str(exc).split())[:200]


def _q(name: object, limit: int = 80) -> str:
    """A name for a one-line message: repr (escapes newlines), truncated."""
    s = str(name)
    return repr(s) if len(s) <= limit else repr(s[:limit]) + "..."


def _f(file: str) -> str:
    """A file name for a message: as is when printable, else quoted."""
    return file if file.isprintable() and len(file) <= 200 else _q(file, 200)


def _utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \\udXXX escape
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Header parsing
# ---------------------------------------------------------------------------------------------

def header_length(head: bytes, file: str, file_size: int | None) -> int:
    """The 8-byte length prefix, checked against the limit and the file size (the value is not echoed:
    for a file that is not safetensors it is just its first 8 bytes)."""
    file = _f(file)
    if len(head) < 8:
        raise CheckpointFormatError(f"{file}: {len(head)} bytes, too short to be a safetensors file")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER:
        raise CheckpointFormatError(
            f"{file}: not a safetensors file (its header length field says more than {MAX_HEADER} bytes)")
    if n < 2:
        raise CheckpointFormatError(f"{file}: not a safetensors file (header length {n})")
    if file_size is not None and 8 + n > file_size:
        raise CheckpointFormatError(
            f"{file}: truncated or not a safetensors file (the header runs past the end of the file, "
            f"{file_size} bytes)")
    return n


def parse_header(raw: bytes, file: str, file_size: int | None) -> tuple[list[TensorInfo], dict[str, str]]:
    """Header JSON bytes -> (tensors in file order, __metadata__), validated as described above.

    ``file_size`` is the whole file's size (8 + header + data); None skips only the final
    "the data ends where the file ends" check (for callers that cannot know it).
    """
    name = _f(file)

    def bad(what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{name}: {what}")

    if len(raw) > MAX_HEADER:
        raise bad(f"header of {len(raw)} bytes exceeds the {MAX_HEADER}-byte limit")
    if not raw.startswith(b"{"):
        raise bad("header does not start with '{'; not a safetensors file")
    try:
        header = loads_strict(raw)
    except ValueError as exc:
        raise bad(f"header {json_error(exc)}") from None
    if not isinstance(header, dict):
        raise bad(f"header is a JSON {type(header).__name__}, not an object")

    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise bad(f"__metadata__ is a {json_kind(meta)}, not a map of strings")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise bad(f"__metadata__ entry {_q(k)} is a {json_kind(v)}, not a string")
        if not (_utf8_ok(k) and _utf8_ok(v)):
            raise bad(f"__metadata__ entry {_q(k)} is not valid Unicode (lone surrogate escape)")

    base = 8 + len(raw)
    infos: list[TensorInfo] = []
    for tname, h in header.items():
        infos.append(_tensor_info(tname, h, file, base, bad))

    # The spans, sorted, must tile the data region exactly (as the library checks; ties: empty first).
    infos.sort(key=lambda i: (i.begin, i.end, i.name))
    expected, prev = base, None
    for i in infos:
        if i.begin < expected:
            raise bad(f"tensor {_q(i.name)} overlaps tensor {_q(prev.name)} (data_offsets "
                      f"[{i.begin - base}, {i.end - base}] start before {expected - base})")
        if i.begin > expected:
            raise bad(f"bytes {expected - base}..{i.begin - base} of the data belong to no tensor "
                      f"(a hole before tensor {_q(i.name)})")
        expected, prev = i.end, i
    if file_size is not None and expected != file_size:
        if expected > file_size:
            last = f" (tensor {_q(prev.name)} ends at byte {expected})" if prev else ""
            raise bad(f"truncated: the header needs {expected} bytes{last}, the file has {file_size}")
        raise bad(f"{file_size - expected} bytes after the last tensor's data belong to no tensor")
    return infos, meta


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor_info(tname: str, h: object, file: str, base: int, bad) -> TensorInfo:
    t = f"tensor {_q(tname)}"
    if not _utf8_ok(tname):
        raise bad(f"{t}: the name is not valid Unicode (lone surrogate escape)")
    if not isinstance(h, dict):
        raise bad(f"{t}: entry is a {json_kind(h)}, not an object with dtype, shape and data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in h:
            raise bad(f"{t}: entry has no {key!r}")
    dtype, shape, offsets = h["dtype"], h["shape"], h["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"{t}: dtype is a {json_kind(dtype)}, not a dtype name")
    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise bad(f"{t}: dtype {_q(dtype, 20)} is not a safetensors dtype")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise bad(f"{t}: shape must be a list of integers")
    if any(d < 0 or d > _MAX_DIM for d in shape):
        raise bad(f"{t}: shape {_short(shape)} has a dimension outside 0..2**63-1")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise bad(f"{t}: data_offsets must be a list of two integers")
    begin, end = offsets
    if begin < 0 or end < 0 or begin >= _U64 or end >= _U64:
        raise bad(f"{t}: data_offsets {_short(offsets)} are not unsigned 64-bit integers")
    if end < begin:
        raise bad(f"{t}: data_offsets {_short(offsets)} end before they begin")
    numel = _numel(shape)
    if numel * bits >= _U64 * 8:
        raise bad(f"{t}: shape {_short(shape)} of {dtype} is more than 2**64 bytes")
    if numel * bits % 8:
        raise bad(f"{t}: shape {_short(shape)} of {dtype} is not a whole number of bytes")
    if numel * bits // 8 != end - begin:
        raise bad(f"{t}: shape {_short(shape)} of {dtype} needs {numel * bits // 8} bytes, "
                  f"data_offsets {_short(offsets)} hold {end - begin}")
    return TensorInfo(tname, dtype, tuple(shape), file, base + begin, base + end)


def _numel(shape: list[int]) -> int:
    """The product, stopping early once it is past any byte count (a 10^6-dim shape costs no bigint work)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n >= _U64 * 8:
            return n
    return n


def _short(v: list) -> str:
    s = str(v)
    return s if len(s) <= 80 else s[:80] + "...]"


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of ``path`` that is certainly a regular file: opened with O_NONBLOCK (so a
    FIFO cannot block the open, nor a device the first read) and checked with fstat on the descriptor
    itself (no race with a rename between a stat and the open). Raises NotRegularFile otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a socket"
                    if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special")
            raise NotRegularFile(0, f"{kind}, not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: str | os.PathLike, limit: int) -> bytes:
    """A small regular file's bytes (config, index, manifest): never blocks on special files, and refuses
    more than ``limit`` bytes (OSError with EFBIG) before reading them."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise OSError(27, f"{size} bytes is too large (at most {limit})", str(path))  # EFBIG
        return f.read(limit + 1)[:limit]


def read_header(path: Path, file: str | None = None) -> tuple[list[TensorInfo], dict[str, str]]:
    """Read and validate only the header of a local safetensors file (the data is never read)."""
    file = file or path.name
    try:
        with open(open_regular(path), "rb") as f:  # a FIFO or device would block a plain open(path)
            st = os.fstat(f.fileno())
            n = header_length(f.read(8), file, st.st_size)
            raw = f.read(n)
    except NotRegularFile as exc:
        raise CheckpointFormatError(f"{_f(file)}: not a regular file ({exc.strerror.split(',')[0]})") from exc
    except OSError as exc:
        raise CheckpointFormatError(f"{_f(file)}: cannot read ({exc.strerror or exc})") from exc
    if len(raw) != n:
        raise CheckpointFormatError(f"{_f(file)}: truncated header")
    return parse_header(raw, file, st.st_size)


def read_bytes(path: Path, info: TensorInfo) -> bytearray:
    """The tensor's raw bytes with a plain read (no mmap, so the pages do not linger in our RSS)."""
    buf = bytearray(info.nbytes)
    read_many([(path, info, memoryview(buf))])
    return buf


IOV_MAX = 1024  # buffers per preadv call (Linux's limit)
SPLIT_MIN = 8 << 20  # a parallel read gives each thread at least this much


def read_many(items: list[tuple[Path, TensorInfo, memoryview]], threads: int = 1) -> None:
    """Read each tensor into its buffer. A run of tensors adjacent in one file is one ``preadv``
    scattering into their buffers (a layer's experts are one run: on the H100 machine 1,536 separate
    1.5 MB reads ran at 1.6 GB/s), and each file is opened once per thread. ``threads`` > 1 splits
    the bytes (tensors cut at page boundaries where need be) over that many threads: page-cache
    copies into pinned memory ran at 5.0 GB/s on one thread there, 17.8 GB/s on four."""
    pieces = [(path, info, info.begin, view[: info.nbytes]) for path, info, view in items if info.nbytes]
    total = sum(len(p[3]) for p in pieces)
    parts = min(threads, total // SPLIT_MIN)
    if parts <= 1:
        _read_pieces(pieces)
        return
    first, *rest = _split(pieces, -(-total // parts))
    futures = []
    try:
        for part in rest:
            futures.append(_readers(threads).submit(_read_pieces, part))
        _read_pieces(first)
    finally:
        errors = [f.exception() for f in futures]  # every thread has stopped writing into the buffers
    for exc in errors:
        if exc is not None:
            raise exc


@functools.lru_cache(maxsize=None)
def _readers(threads: int):
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(threads - 1, thread_name_prefix="fp4convert-read")


def _split(pieces: list, per: int) -> list[list]:
    """Consecutive parts of about ``per`` bytes each; a piece crossing a boundary is cut at a page."""
    parts: list[list] = [[]]
    room = per
    for path, info, off, view in pieces:
        while len(view) > room:
            cut = room + (-(off + room)) % 4096  # end the part at a page boundary of the file
            if cut >= len(view):
                break
            if cut:
                parts[-1].append((path, info, off, view[:cut]))
            off, view = off + cut, view[cut:]
            parts.append([])
            room = per
        parts[-1].append((path, info, off, view))
        room -= len(view)
        if room <= 0:
            parts.append([])
            room = per
    return [p for p in parts if p]


def _read_pieces(pieces: list) -> None:
    """(path, info, file offset, view) pieces: runs adjacent in one file are one preadv."""
    fds: dict[Path, int] = {}
    try:
        i = 0
        while i < len(pieces):
            path, info, off, view = pieces[i]
            j, end = i + 1, off + len(view)
            while j < len(pieces) and j - i < IOV_MAX and pieces[j][0] == path and pieces[j][2] == end:
                end += len(pieces[j][3])
                j += 1
            try:
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = open_regular(path)
            except OSError as exc:
                raise CheckpointFormatError(f"{_f(info.file)}: cannot read tensor {_q(info.name)} "
                                            f"({exc.strerror or exc})") from exc
            _preadv_exact(fd, pieces[i:j])
            i = j
    finally:
        for fd in fds.values():
            os.close(fd)


def _preadv_exact(fd: int, run: list) -> None:
    """Fill the run's buffers from its first piece's offset on; a short file names the tensor it cut."""
    views = [v for _, _, _, v in run]
    names = [info for _, info, _, _ in run]
    offset = run[0][2]
    k = 0  # the view being filled
    while k < len(views):
        try:
            if hasattr(os, "preadv"):
                got = os.preadv(fd, views[k : k + IOV_MAX], offset)
            else:  # no preadv here: one view at a time
                os.lseek(fd, offset, os.SEEK_SET)
                got = os.readv(fd, views[k : k + 1])
        except OSError as exc:
            raise CheckpointFormatError(f"{_f(names[k].file)}: cannot read tensor {_q(names[k].name)} "
                                        f"({exc.strerror or exc})") from exc
        if not got:
            raise CheckpointFormatError(f"{_f(names[k].file)}: tensor {_q(names[k].name)} is truncated")
        offset += got
        while got and k < len(views):  # skip the views this read filled; keep the rest of a part-filled one
            if got >= len(views[k]):
                got -= len(views[k])
                k += 1
            else:
                views[k] = views[k][got:]
                got = 0


def read_tensor(path: Path, info: TensorInfo) -> torch.Tensor:
    import torch

    dtype = torch_dtypes().get(info.dtype)
    if dtype is None:
        raise CheckpointFormatError(
            f"{_f(info.file)}: tensor {_q(info.name)} has dtype {info.dtype}, which torch cannot hold")
    buf = read_bytes(path, info)
    if not buf:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(info.shape)


@dataclass(frozen=True)
class OutEntry:
    """One tensor of an output file: its name, dtype and shape are known before any data exists."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return dtype_nbytes(self.dtype, self.shape)


def dtype_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor of any safetensors dtype (sub-byte ones pack: F4 is half a byte an element)."""
    n = DTYPE_BITS[dtype]
    for d in shape:
        n *= d
    return n // 8


def header_bytes(entries: list[OutEntry], metadata: dict[str, str] | None = None) -> bytes:
    """The header for ``entries`` laid out back to back in the given order, padded to 8 bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes (numpy is not a dependency)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
