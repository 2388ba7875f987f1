"""The safetensors file format at the byte level: strict header parsing and output headers.

Raw reads of the data are in :mod:`fp4convert.storage.reads`, the hardened JSON in :mod:`fp4convert.storage.strict_json`.

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

import ctypes
import json
import struct
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from fp4convert.errors import CheckpointFormatError
from fp4convert.storage.strict_json import file_label, json_error, json_kind, loads_strict, quoted

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
    file = file_label(file)
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
    name = file_label(file)

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
            raise bad(f"__metadata__ entry {quoted(k)} is a {json_kind(v)}, not a string")
        if not (_utf8_ok(k) and _utf8_ok(v)):
            raise bad(f"__metadata__ entry {quoted(k)} is not valid Unicode (lone surrogate escape)")

    base = 8 + len(raw)
    infos: list[TensorInfo] = []
    for tname, h in header.items():
        infos.append(_tensor_info(tname, h, file, base, bad))

    # The spans, sorted, must tile the data region exactly (as the library checks; ties: empty first).
    infos.sort(key=lambda i: (i.begin, i.end, i.name))
    expected, prev = base, None
    for i in infos:
        if i.begin < expected:
            raise bad(f"tensor {quoted(i.name)} overlaps tensor {quoted(prev.name)} (data_offsets "
                      f"[{i.begin - base}, {i.end - base}] start before {expected - base})")
        if i.begin > expected:
            raise bad(f"bytes {expected - base}..{i.begin - base} of the data belong to no tensor "
                      f"(a hole before tensor {quoted(i.name)})")
        expected, prev = i.end, i
    if file_size is not None and expected != file_size:
        if expected > file_size:
            last = f" (tensor {quoted(prev.name)} ends at byte {expected})" if prev else ""
            raise bad(f"truncated: the header needs {expected} bytes{last}, the file has {file_size}")
        raise bad(f"{file_size - expected} bytes after the last tensor's data belong to no tensor")
    return infos, meta


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor_info(tname: str, h: object, file: str, base: int, bad) -> TensorInfo:
    t = f"tensor {quoted(tname)}"
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
        raise bad(f"{t}: dtype {quoted(dtype, 20)} is not a safetensors dtype")
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
