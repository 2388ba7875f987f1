"""The safetensors file format at the byte level: header parsing, raw reads and a streaming writer.

We read and write the format ourselves rather than through ``safetensors.torch`` for two reasons:
planning needs only the JSON header (never the data), and a shard of several GB must be written
one tensor at a time so that host memory stays bounded. The layout is the documented one: an
8-byte little-endian header length, a JSON header of ``name -> {dtype, shape, data_offsets}``
(and an optional ``__metadata__``), then the tensor bytes back to back.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import CheckpointFormatError


DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
            "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1, "F4": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16")  # what the quantizer accepts as source

_MAX_HEADER = 100 * 1024 * 1024


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


def parse_header(raw: bytes, file: str, header_len: int) -> tuple[list[TensorInfo], dict[str, str]]:
    """Header JSON -> (tensors in file order, __metadata__)."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{file}: the safetensors header is not valid JSON ({exc})") from exc
    meta = header.pop("__metadata__", None) or {}
    base = 8 + header_len
    infos = []
    for name, h in header.items():
        try:
            begin, end = h["data_offsets"]
            info = TensorInfo(name, h["dtype"], tuple(int(d) for d in h["shape"]), file, base + begin, base + end)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointFormatError(f"{file}: tensor {name!r} has a malformed header entry") from exc
        size = ITEMSIZE.get(info.dtype)
        if size is not None and size * info.numel != info.nbytes:
            raise CheckpointFormatError(
                f"{file}: tensor {name!r} claims {info.nbytes} bytes for shape {list(info.shape)} {info.dtype}"
            )
        infos.append(info)
    infos.sort(key=lambda i: i.begin)
    return infos, meta


def read_header(path: Path, file: str | None = None) -> tuple[list[TensorInfo], dict[str, str]]:
    """Read only the header of a local safetensors file."""
    file = file or path.name
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointFormatError(f"{file}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise CheckpointFormatError(f"{file}: header length {n} is implausible; not a safetensors file?")
            raw = f.read(n)
            if len(raw) != n:
                raise CheckpointFormatError(f"{file}: truncated header")
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise CheckpointFormatError(f"{file}: cannot read ({exc.strerror})") from exc
    infos, meta = parse_header(raw, file, n)
    if infos and infos[-1].end > size:
        raise CheckpointFormatError(f"{file}: truncated (header needs {infos[-1].end} bytes, file has {size})")
    return infos, meta


def read_bytes(path: Path, info: TensorInfo) -> bytearray:
    """The tensor's raw bytes with a plain read (no mmap, so the pages do not linger in our RSS)."""
    buf = bytearray(info.nbytes)
    with open(path, "rb") as f:
        f.seek(info.begin)
        if f.readinto(buf) != info.nbytes:
            raise CheckpointFormatError(f"{info.file}: tensor {info.name!r} is truncated")
    return buf


def read_into(path: Path, info: TensorInfo, out: torch.Tensor) -> None:
    """Read the tensor's bytes into ``out`` (a contiguous uint8 CPU tensor, e.g. pinned memory)."""
    view = tensor_memoryview(out)
    with open(path, "rb") as f:
        f.seek(info.begin)
        if f.readinto(view) != info.nbytes:
            raise CheckpointFormatError(f"{info.file}: tensor {info.name!r} is truncated")


def read_tensor(path: Path, info: TensorInfo) -> torch.Tensor:
    dtype = DTYPES.get(info.dtype)
    if dtype is None:
        raise CheckpointFormatError(f"{info.file}: tensor {info.name!r} has dtype {info.dtype}, which torch cannot hold")
    buf = read_bytes(path, info)
    if not buf:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(info.shape)


def copy_range(src: BinaryIO, dst, begin: int, n: int, chunk: int = 16 << 20) -> None:
    """Copy n bytes at offset begin, in chunks (kept tensors never sit whole in memory)."""
    src.seek(begin)
    while n:
        block = src.read(min(chunk, n))
        if not block:
            raise CheckpointFormatError("unexpected end of file while copying a tensor")
        dst.write(block)
        n -= len(block)


@dataclass(frozen=True)
class OutEntry:
    """One tensor of an output file: its name, dtype and shape are known before any data exists."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


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


class StreamWriter:
    """Writes one safetensors file tensor by tensor, in the order its header fixed in advance.

    The data goes to ``<name>.partial`` and is renamed into place only by :meth:`close`, so an
    interrupted run never leaves a file that looks finished.
    """

    def __init__(self, path: Path, entries: list[OutEntry], metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        self._entries = entries
        self._next = 0
        self.sha256 = hashlib.sha256()
        self.size = 0
        self._f = open(self.partial, "wb")
        self.write(header_bytes(entries, metadata))

    def write(self, data: bytes | memoryview) -> None:
        """Every byte goes through here, so the checksum costs no second read."""
        self._f.write(data)
        self.sha256.update(data)
        self.size += len(data)

    @property
    def complete(self) -> bool:
        return self._next == len(self._entries)

    def _expect(self, name: str, nbytes: int) -> None:
        if self._next >= len(self._entries):
            raise RuntimeError(f"{self.path.name}: unexpected tensor {name!r} after the last one")
        e = self._entries[self._next]
        if e.name != name or e.nbytes != nbytes:
            raise RuntimeError(f"{self.path.name}: got {name!r} ({nbytes} B), the plan says {e.name!r} ({e.nbytes} B)")
        self._next += 1

    def write_tensor(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        self._expect(name, nbytes)
        if nbytes:
            self.write(tensor_memoryview(t))

    def copy_raw(self, name: str, src: Path, info: TensorInfo) -> None:
        self._expect(name, info.nbytes)
        with open(src, "rb") as f:
            copy_range(f, self, info.begin, info.nbytes)

    def close(self) -> None:
        if self._next != len(self._entries):
            raise RuntimeError(f"{self.path.name}: closed after {self._next} of {len(self._entries)} tensors")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.partial, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.partial.unlink(missing_ok=True)


def tensor_memoryview(t: torch.Tensor) -> memoryview:
    """Zero-copy view of a contiguous CPU tensor's bytes (numpy is not a dependency)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
