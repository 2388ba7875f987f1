"""Strict safetensors header validation: every malformed case of issue 12, each checked three ways.

For each case: fp4convert raises :class:`CheckpointFormatError` (exit 4) with a one-line message that
names the file (and says what is wrong), from a local file (:func:`read_header`) and from the same
bytes as a Hub range read hands them over (:func:`parse_header`); and the real ``safetensors``
library rejects the same bytes too -- or, where fp4convert is deliberately stricter, the library
accepts them and the case says why we refuse (so this file notices if the library changes).
"""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import safetensors
import torch
from safetensors.torch import save_file

import fp4convert.storage.safetensors as sio
import fp4convert.storage.reads as reads
import fp4convert.storage.strict_json as strict_json
from fp4convert.storage.safetensors import DTYPE_BITS, MAX_HEADER, CheckpointFormatError, parse_header
from fp4convert.storage.strict_json import loads_strict
from fp4convert.storage.reads import read_header

FILE = "case-0001.safetensors"
A = {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}  # a valid 2-byte tensor


def blob(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file's bytes: length prefix (default: the real one), header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def entry(dtype="U8", shape=(2,), offsets=(0, 2)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def raw_entry(text: str) -> bytes:
    """A header whose tensor 'a' entry is given as raw JSON text (numbers JSON cannot round-trip)."""
    return ('{"a":' + text + "}").encode()


# Each case: id -> (file bytes, words the message must contain, why we are stricter or None if the library
# rejects too). Ids follow issue 12's list.
DEEP = 200_000
CASES: dict[str, tuple[bytes, str, str | None]] = {
    # header framing
    "file_shorter_than_8_bytes": (b"\x01\x02\x03", "too short", None),
    "header_length_over_limit": (struct.pack("<Q", MAX_HEADER + 1) + b"{}", "header length", None),
    "header_length_past_end_of_file": (blob({"a": A}, b"\0\0", length=4096), "past the end", None),
    "header_length_zero": (struct.pack("<Q", 0), "header length 0", None),
    "etc_passwd_like_text": (b"root:x:0:0:root:/root:/bin/bash\n" * 3, "not a safetensors file", None),
    "header_not_utf8": (blob(b'{"\xff\xfe":' + json.dumps(A).encode() + b"}", b"\0\0"), "not UTF-8", None),
    "header_utf8_bom": (blob(b"\xef\xbb\xbf{}     "), "start with '{'", None),
    "header_leading_space": (blob(b" {}     "), "start with '{'",
                             "the library (0.8) skips leading whitespace; every writer starts with '{' and the "
                             "format's reference implementation intends to require it (InvalidHeaderStart)"),
    "header_trailing_garbage": (blob(b'{}xx'), "not valid JSON", None),
    "header_nul_padding": (blob(b"{}\0\0\0\0\0\0"), "not valid JSON", None),
    "header_not_json": (blob(b"{not json}"), "not valid JSON", None),
    # top-level type
    "header_is_a_list": (blob(b"[]"), "start with '{'", None),
    "header_is_a_string": (blob(b'"abc"'), "start with '{'", None),
    # nesting and numbers
    "nesting_200k_deep": (blob(b'{"x":' + b"[" * DEEP + b"]" * DEEP + b"}"), "nests deeper", None),
    "number_1e999": (blob(raw_entry('{"dtype":"U8","shape":[1e999],"data_offsets":[0,2]}'), b"\0\0"),
                     "out of range", None),
    "integer_5000_digits": (blob(raw_entry('{"dtype":"U8","shape":[' + "7" * 5000 + '],"data_offsets":[0,2]}'),
                                 b"\0\0"), "5000 digits", None),
    "minus_zero_offset": (blob(raw_entry('{"dtype":"U8","shape":[2],"data_offsets":[-0,2]}'), b"\0\0"),
                          "two integers", None),  # found by the fuzzer: serde_json reads -0 as a float
    "nan_constant": (blob(raw_entry('{"dtype":"U8","shape":[NaN],"data_offsets":[0,2]}'), b"\0\0"),
                     "NaN is not JSON", None),
    # duplicate keys
    "duplicate_tensor_name": (blob(b'{"a":' + json.dumps(A).encode() + b',"a":' + json.dumps(A).encode() + b"}",
                                   b"\0\0"), "'a' appears twice",
                              "the library keeps the last of two tensors with one name; which one a reader "
                              "gets is then an accident of the parser"),
    "duplicate_field_in_entry": (blob(raw_entry('{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}'),
                                      b"\0\0"), "'dtype' appears twice", None),
    "duplicate_metadata": (blob(b'{"__metadata__":{},"__metadata__":{}}'), "'__metadata__' appears twice", None),
    "duplicate_key_in_metadata": (blob(b'{"__metadata__":{"k":"1","k":"2"}}'), "'k' appears twice",
                                  "the library keeps the last value; a duplicate key is never written on purpose"),
    # __metadata__
    "metadata_value_not_string": (blob({"__metadata__": {"format": 1}}), "__metadata__ entry 'format'", None),
    "metadata_is_a_list": (blob({"__metadata__": ["pt"]}), "__metadata__ is a JSON list", None),
    "metadata_is_a_string": (blob({"__metadata__": "pt"}), "__metadata__ is a string", None),
    # dtype
    "dtype_is_a_list": (blob({"a": entry(dtype=["BF16"])}, b"\0\0"), "dtype is a JSON list", None),
    "dtype_is_a_number": (blob({"a": entry(dtype=16)}, b"\0\0"), "dtype is a number", None),
    "dtype_unknown_BF17": (blob({"a": entry(dtype="BF17")}, b"\0\0"), "'BF17' is not a safetensors dtype", None),
    "dtype_lowercase": (blob({"a": entry(dtype="u8")}, b"\0\0"), "not a safetensors dtype", None),
    "dtype_missing": (blob({"a": {"shape": [2], "data_offsets": [0, 2]}}, b"\0\0"), "no 'dtype'", None),
    # shape
    "shape_negative_dim": (blob({"a": entry(shape=(-2,))}, b"\0\0"), "outside 0..2**63-1", None),
    "shape_float_dim": (blob({"a": entry(shape=(2.0,))}, b"\0\0"), "list of integers", None),
    "shape_bool_dim": (blob({"a": entry(shape=(True, 2))}, b"\0\0"), "list of integers", None),
    "shape_not_a_list": (blob({"a": {"dtype": "U8", "shape": 2, "data_offsets": [0, 2]}}, b"\0\0"),
                         "list of integers", None),
    "shape_dim_2_64": (blob({"a": entry(shape=(2 ** 64,))}, b"\0\0"), "outside 0..2**63-1", None),
    "shape_dim_2_63_with_zero": (blob({"a": entry(shape=(0, 2 ** 63), offsets=(0, 0))}), "outside 0..2**63-1",
                                 "the library takes dims up to 2**64-1 when another dim is 0; torch sizes are "
                                 "int64, so such a tensor could not even be created empty"),
    "shape_product_overflows": (blob({"a": entry(shape=(2 ** 32, 2 ** 32))}, b"\0\0"), "more than 2**64 bytes",
                                None),
    "shape_size_mismatch": (blob({"a": entry(shape=(3,))}, b"\0\0"), "needs 3 bytes", None),
    "subbyte_not_whole_bytes": (blob({"a": entry(dtype="F4", shape=(3,), offsets=(0, 2))}, b"\0\0"),
                                "not a whole number of bytes", None),
    # data_offsets
    "offsets_negative": (blob({"a": entry(offsets=(-8, -6))}, b"\0\0"), "not unsigned 64-bit", None),
    "offsets_float": (blob({"a": entry(offsets=(0.0, 2.0))}, b"\0\0"), "two integers", None),
    "offsets_three_numbers": (blob({"a": entry(offsets=(0, 2, 2))}, b"\0\0"), "two integers", None),
    "offsets_reversed": (blob({"a": entry(offsets=(2, 0))}, b"\0\0"), "end before they begin", None),
    "offsets_2_64": (blob({"a": entry(offsets=(2 ** 64, 2 ** 64 + 2))}, b"\0\0"), "not unsigned 64-bit", None),
    "offsets_overlap": (blob({"a": entry(shape=(4,), offsets=(0, 4)), "b": entry(offsets=(2, 4))}, b"\0" * 4),
                        "tensor 'b' overlaps tensor 'a'", None),
    "offsets_hole": (blob({"a": entry(offsets=(0, 2)), "b": entry(offsets=(3, 5))}, b"\0" * 5),
                     "belong to no tensor", None),
    "offsets_not_from_zero": (blob({"a": entry(offsets=(2, 4))}, b"\0" * 4), "bytes 0..2", None),
    "empty_tensor_inside_another": (blob({"a": entry(), "b": entry(shape=(0,), offsets=(1, 1))}, b"\0\0"),
                                    "'b' overlaps", None),
    # truncation / trailing data
    "truncated_last_tensor": (blob({"a": entry(), "b": entry(offsets=(2, 4))}, b"\0\0\0"), "truncated", None),
    "truncated_middle_tensor_dropped": (blob({"a": entry(shape=(8,), offsets=(0, 8)), "b": entry(offsets=(2, 4))},
                                             b"\0" * 4), "overlaps", None),
    "bytes_after_last_tensor": (blob({"a": entry()}, b"\0\0\0"), "after the last tensor", None),
    "no_tensor_but_data": (blob({}, b"\0"), "after the last tensor", None),
    # names
    "name_lone_surrogate": (blob(raw_entry('{"dtype":"U8","shape":[2],"data_offsets":[0,2]}').replace(
        b'"a"', b'"\\ud800"'), b"\0\0"), "lone surrogate", None),
    "entry_is_a_list": (blob({"a": [0, 2]}, b"\0\0"), "entry is a JSON list", None),
    "entry_is_null": (blob({"a": None}, b"\0\0"), "entry is a null", None),
}


def lib_load(data: bytes) -> list:
    return safetensors.deserialize(data)


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_header(case: str, tmp_path) -> None:
    data, words, stricter = CASES[case]
    path = tmp_path / FILE
    path.write_bytes(data)
    with pytest.raises(CheckpointFormatError) as e:
        read_header(path)
    msg = str(e.value)
    assert msg.startswith(FILE + ": "), msg
    assert words in msg, (words, msg)
    assert "\n" not in msg and len(msg) < 400, msg
    assert e.value.exit_code == 4
    # The Hub path hands parse_header the header bytes and the file size from the server.
    if len(data) >= 8:
        n = struct.unpack("<Q", data[:8])[0]
        if 2 <= n <= MAX_HEADER and 8 + n <= len(data):
            with pytest.raises(CheckpointFormatError) as e2:
                parse_header(data[8:8 + n], FILE, len(data))
            assert str(e2.value) == msg
    # The real library.
    if stricter is None:
        with pytest.raises(safetensors.SafetensorError):
            lib_load(data)
    else:
        lib_load(data)  # the library accepts it; `stricter` says why we do not


def test_dtype_set_equals_the_librarys() -> None:
    """DTYPE_BITS knows exactly the dtypes the installed safetensors knows (from its own error message)."""
    with pytest.raises(safetensors.SafetensorError) as e:
        lib_load(blob({"a": entry(dtype="NOPE")}, b"\0\0"))
    names = set(re.findall(r"`(\w+)`", str(e.value).split("expected one of", 1)[1]))
    assert names == set(DTYPE_BITS)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_dtype_size_agrees_with_the_library(dtype: str) -> None:
    """For each dtype: 8 elements are accepted with exactly bits bytes, by us and by the library."""
    nbytes = DTYPE_BITS[dtype]  # 8 elements x bits / 8
    data = blob({"a": entry(dtype=dtype, shape=(2, 4), offsets=(0, nbytes))}, bytes(nbytes))
    lib_load(data)
    infos, _ = parse_header(data[8:8 + struct.unpack("<Q", data[:8])[0]], FILE, len(data))
    assert infos[0].nbytes == nbytes and infos[0].dtype == dtype
    bad = blob({"a": entry(dtype=dtype, shape=(2, 4), offsets=(0, nbytes + 1))}, bytes(nbytes + 1))
    with pytest.raises(safetensors.SafetensorError):
        lib_load(bad)
    with pytest.raises(CheckpointFormatError, match="needs"):
        parse_header(bad[8:8 + struct.unpack("<Q", bad[:8])[0]], FILE, len(bad))


# --- valid files ---------------------------------------------------------------------------------

def test_real_files_parse_like_the_library(tmp_path) -> None:
    """Files written by safetensors itself (every torch dtype it writes, empty and 0-d tensors, metadata)."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "w.f32": torch.randn(7, generator=g),
        "w.f16": torch.randn(2, 2, 2, generator=g).half(),
        "w.f64": torch.randn(1, generator=g).double(),
        "i.i64": torch.arange(3), "i.i32": torch.arange(3, dtype=torch.int32),
        "i.u8": torch.arange(5, dtype=torch.uint8), "b": torch.tensor([True, False]),
        "f8": torch.zeros(4, dtype=torch.float8_e4m3fn), "f8b": torch.zeros(4, dtype=torch.float8_e5m2),
        "empty": torch.zeros(0, 4), "empty2": torch.zeros(3, 0, dtype=torch.int16), "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "x"})
    infos, meta = read_header(path)
    assert meta == {"format": "pt", "note": "x"}
    assert {i.name for i in infos} == set(tensors)
    with safetensors.safe_open(str(path), "pt") as f:
        for i in infos:
            t = f.get_tensor(i.name)
            assert list(i.shape) == list(t.shape)
            assert i.nbytes == t.numel() * t.element_size()
            assert torch.equal(reads.read_tensor(path, i), tensors[i.name])
    # File order, contiguous, from the header's end to the file's end.
    start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert infos[0].begin == start and infos[-1].end == path.stat().st_size
    assert all(a.end == b.begin for a, b in zip(infos, infos[1:]))


def test_empty_file_with_no_tensors(tmp_path) -> None:
    path = tmp_path / "e.safetensors"
    save_file({}, str(path))
    assert read_header(path) == ([], {})
    assert read_header(path)[0] == [] and lib_load(path.read_bytes()) == []


def test_empty_tensors_share_an_offset() -> None:
    data = blob({"z1": entry(shape=(0,), offsets=(0, 0)), "a": entry(), "z2": entry(shape=(0, 5), offsets=(2, 2))},
                b"\0\0")
    lib_load(data)
    infos, _ = parse_header(data[8:8 + struct.unpack("<Q", data[:8])[0]], FILE, len(data))
    assert [i.name for i in infos] == ["z1", "a", "z2"]


def test_unknown_fields_and_null_metadata_accepted_like_the_library() -> None:
    data = blob({"__metadata__": None, "a": {**entry(), "extra": [1, {"x": "y"}]}}, b"\0\0")
    lib_load(data)
    infos, meta = parse_header(data[8:8 + struct.unpack("<Q", data[:8])[0]], FILE, len(data))
    assert meta == {} and infos[0].name == "a"


def test_header_limit_is_the_librarys(tmp_path) -> None:
    """Exactly 100,000,000 bytes is allowed, one more is not (sparse data, nothing big is written)."""
    ok = b"{}" + b" " * (MAX_HEADER - 2)
    assert parse_header(ok, FILE, 8 + MAX_HEADER) == ([], {})
    path = tmp_path / FILE
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER + 1))
        f.truncate(8 + MAX_HEADER + 1)
    with pytest.raises(CheckpointFormatError, match="more than 100000000 bytes"):
        read_header(path)


# --- reading -------------------------------------------------------------------------------------

def test_reads_only_the_header(tmp_path, monkeypatch) -> None:
    """Validation never touches tensor data: the bytes read are 8 + header length."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(1000, 1000), "b": torch.ones(10)}, str(path))
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    read_total = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, size=-1):
            data = self.f.read(size)
            read_total.append(len(data))
            return data

        def __getattr__(self, k):
            return getattr(self.f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    monkeypatch.setattr(reads, "open", lambda *a, **k: Counting(real_open(*a, **k)), raising=False)
    read_header(path)
    assert sum(read_total) == 8 + n


def test_not_a_regular_file(tmp_path) -> None:
    fifo = tmp_path / "p.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointFormatError, match="p.safetensors: not a regular file"):
        read_header(fifo)  # must not block
    d = tmp_path / "d.safetensors"
    d.mkdir()
    with pytest.raises(CheckpointFormatError, match="d.safetensors: not a regular file"):
        read_header(d)


def test_unreadable_file_is_a_format_error(tmp_path) -> None:
    with pytest.raises(CheckpointFormatError, match="missing.safetensors: cannot read"):
        read_header(tmp_path / "missing.safetensors")


def test_name_with_newline_stays_one_line() -> None:
    data = blob({"evil\nname": entry(dtype="BF17")}, b"\0\0")
    with pytest.raises(CheckpointFormatError) as e:
        parse_header(data[8:8 + struct.unpack("<Q", data[:8])[0]], "dir/x.safetensors", len(data))
    assert "\n" not in str(e.value) and "'evil\\nname'" in str(e.value)


def test_loads_strict_is_shared_json_hardening() -> None:
    assert loads_strict(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    for bad in (b'{"a":1,"a":2}', b"[" * 100 + b"]" * 100, b"1" * 30, b"Infinity", b"\xff"):
        with pytest.raises(ValueError):
            loads_strict(bad)


def test_depth_scan_ignores_brackets_in_strings() -> None:
    name = "[" * 500 + "{" * 500
    data = blob({name: entry()}, b"\0\0")
    infos, _ = parse_header(data[8:8 + struct.unpack("<Q", data[:8])[0]], FILE, len(data))
    assert infos[0].name == name
    assert strict_json.json_depth(b'{"a": [[["]]]]]]"]]]}') == 4
    deep = b"[" * 70_000 + b"]" * 70_000
    assert strict_json.json_depth(deep) == 70_000 and strict_json.json_depth(b"[]" * 70_000) == 1
    assert strict_json.json_depth(b"") == 0 and strict_json.json_depth(b"]]}[") == 0 and strict_json.json_depth(b"{}][[[") == 2


def test_torch_dtypes_cover_what_torch_holds() -> None:
    """The lazily built torch table: every name torch can hold, with the byte size ITEMSIZE says."""
    import torch

    assert sio.DTYPES is sio.torch_dtypes() and set(sio.DTYPES) <= set(sio.ITEMSIZE)
    for name, dtype in sio.DTYPES.items():
        assert isinstance(dtype, torch.dtype) and torch.empty(0, dtype=dtype).element_size() == sio.ITEMSIZE[name]
    assert all(sio.DTYPES[n].is_floating_point for n in sio.FLOAT_DTYPES)


def _add_raw_tensor(path, name: str, dtype: str, shape: list[int]) -> bytes:
    """Append a tensor of any safetensors dtype to ``path`` (bytes 0, 1, 2, ...); returns its bytes."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    nbytes = sio.dtype_nbytes(dtype, shape)
    payload = bytes(i % 251 for i in range(nbytes))
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data + payload)
    return payload


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_safetensors_dtype_is_kept_as_raw_bytes(tmp_path, dtype) -> None:
    """Issue 23 item 10: C64, F6_E2M3, F6_E3M2, F8_E4M3FNUZ, F8_E5M2FNUZ were internal errors and a kept
    F4 tensor failed mid-write (its size was counted as a byte an element). Every dtype the safetensors
    format knows is kept bit for bit, by quantize and by export."""
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert
    from fp4convert.checkpoint.export import export

    from tests import checkpoints as ck

    cfg = ck.llama_config(layers=1)
    ck.write(tmp_path / "src", ck.llama_tensors(cfg), cfg)
    name = "model.extra.table" if dtype in sio.FLOAT_DTYPES else "model.extra.weight"  # a float .weight is quantized
    payload = _add_raw_tensor(tmp_path / "src" / "model.safetensors", name, dtype, [32, 64])
    convert(tmp_path / "src", tmp_path / "q", ConvertConfig(device="cpu"))
    export(str(tmp_path / "q"), tmp_path / "ct", ConvertConfig(format="compressed-tensors"))
    for out in ("q", "ct"):
        shard = ck.shard_with(tmp_path / out, name)
        (info,) = [i for i in reads.read_header(shard)[0] if i.name == name]
        assert info.dtype == dtype and list(info.shape) == [32, 64]
        assert bytes(reads.read_bytes(shard, info)) == payload
