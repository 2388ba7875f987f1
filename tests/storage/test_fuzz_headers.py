"""A bounded safetensors header fuzzer: mutated real headers are either accepted with a self-consistent
result that the ``safetensors`` library reads identically, or refused with fp4convert's own one-line
:class:`CheckpointFormatError` -- never any other exception.

Seeds are real files (written by ``safetensors`` itself: a small Llama, a file with every dtype incl.
sub-byte ones, empty and 0-d tensors, metadata). Mutations: byte flips/inserts/deletes in the header,
length-field and file-size changes, and JSON-aware ones (field types swapped, numbers huge / negative
/ float / 1e999 / 5000 digits / NaN, keys duplicated or dropped, tensors added, removed or aliased,
offsets shifted onto each other, values nested up to 200,000 deep, __metadata__ broken).

Under pytest: hypothesis with a fixed derandomized seed and a bounded example count (a few seconds).
As a script, N mutations without hypothesis's limits, with counts and elapsed time::

    PYTHONPATH=$PWD python tests/storage/test_fuzz_headers.py --mutations 20000 [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import struct
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # script mode: the repo root on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import safetensors
import torch
from safetensors.torch import save_file

from fp4convert.storage.safetensors import DTYPE_BITS, CheckpointFormatError, header_length, parse_header
from fp4convert.storage.reads import read_header

FILE = "fuzz-00001-of-00002.safetensors"
DEEP = (2, 10, 63, 64, 65, 200, 5000, 200_000)
_SEEDS: list[bytes] = []


def seeds() -> list[bytes]:
    """Real safetensors files' bytes (built once per process)."""
    if _SEEDS:
        return _SEEDS
    from tests import checkpoints as ck

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ck.llama(d / "llama", hidden=32, layers=1, single=True, zoo=True)
        _SEEDS.append((d / "llama" / "model.safetensors").read_bytes())
        g = torch.Generator().manual_seed(1)
        save_file({"w": torch.randn(4, 8, generator=g).to(torch.bfloat16), "z": torch.zeros(0, 3),
                   "s": torch.tensor(1.5), "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
                   "f8": torch.zeros(5, dtype=torch.float8_e4m3fn), "b": torch.tensor([True])},
                  str(d / "mixed.safetensors"), metadata={"format": "pt", "k": "v"})
        _SEEDS.append((d / "mixed.safetensors").read_bytes())
    # Hand-built: dtypes torch cannot write (sub-byte, complex, unsigned), offsets in name order.
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in [("f4", "F4", [2, 8]), ("f6", "F6_E2M3", [4]), ("c", "C64", [2]), ("u", "U32", [3]),
                               ("e", "F8_E8M0", [0]), ("x", "BF16", [1, 2, 3])]:
        nbytes = DTYPE_BITS[dtype] * _prod(shape) // 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    _SEEDS.append(_file(json.dumps(header).encode(), bytes(range(256)) * (off // 256) + bytes(off % 256)))
    return _SEEDS


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _file(raw: bytes, data: bytes, pad: bool = True) -> bytes:
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _split(blob: bytes) -> tuple[bytes, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return blob[8:8 + n], blob[8 + n:]


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------

def _value(rnd: random.Random, depth: int = 0):
    """A random JSON value of a random type (what a field could be swapped for)."""
    kind = rnd.randrange(12 if depth < 2 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice([0, 1, -1, 7, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, 10 ** 30])
    if kind == 3:
        return rnd.choice([0.0, 0.5, -1.0, 2.0, 1e308, -0.0])
    if kind == 4:
        return rnd.choice(["", "BF16", "BF17", "u8", "F4", "__metadata__", "\u00e9", "\U0001f600", "a" * 300])
    if kind == 5:
        return rnd.choice(list(DTYPE_BITS))
    if kind == 6:
        return rnd.randrange(-3, 10 ** 6)
    if kind == 7:
        return rnd.randrange(0, 3)
    if kind == 8:
        return [_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    if kind == 9:
        return {str(rnd.randrange(9)): _value(rnd, depth + 1) for _ in range(rnd.randrange(3))}
    if kind == 10:
        return [rnd.randrange(0, 9) for _ in range(rnd.randrange(1, 4))]
    return [rnd.randrange(-2, 2 ** 20), rnd.randrange(-2, 2 ** 20)]


def _json_mutation(h: dict, rnd: random.Random) -> None:
    """One structural change to a parsed header, in place."""
    names = [k for k in h if k != "__metadata__"]
    op = rnd.randrange(14)
    if not names and op < 11:
        op = 12
    name = rnd.choice(names) if names else None
    e = h.get(name) if name is not None else None
    if op == 0 and isinstance(e, dict):  # a field swapped for any type
        e[rnd.choice(["dtype", "shape", "data_offsets"])] = _value(rnd)
    elif op == 1 and isinstance(e, dict):  # a field dropped, or an unknown one added
        if rnd.random() < 0.5:
            e.pop(rnd.choice(["dtype", "shape", "data_offsets"]), None)
        else:
            e[rnd.choice(["extra", "offsets", "dtype2"])] = _value(rnd)
    elif op == 2 and isinstance(e, dict) and isinstance(e.get("shape"), list):  # a dim changed
        s = e["shape"]
        if s and rnd.random() < 0.7:
            i = rnd.randrange(len(s))
            s[i] = rnd.choice([0, 1, -1, s[i] + 1 if isinstance(s[i], int) else 1, 2 ** 32, 2 ** 63, 2 ** 64, 3.0])
        else:
            s.insert(rnd.randrange(len(s) + 1), rnd.choice([0, 1, 2, 2 ** 40]))
    elif op == 3 and isinstance(e, dict) and isinstance(e.get("data_offsets"), list):  # offsets shifted
        o = e["data_offsets"]
        if len(o) == 2 and all(isinstance(v, int) for v in o):
            i = rnd.randrange(2)
            o[i] = o[i] + rnd.choice([-1, 1, -8, 8, -(o[i] + 1), 2 ** 64 - o[i], 2 ** 63])
    elif op == 4 and isinstance(e, dict):  # another dtype (usually a size mismatch)
        e["dtype"] = rnd.choice(list(DTYPE_BITS))
    elif op == 5 and len(names) > 1:  # aliased: two tensors on the same bytes
        other = h[rnd.choice([n for n in names if n != name])]
        if isinstance(e, dict) and isinstance(other, dict):
            e["data_offsets"] = json.loads(json.dumps(other.get("data_offsets")))
    elif op == 6:  # a tensor removed (a hole, or a shorter region)
        del h[name]
    elif op == 7:  # a tensor added somewhere
        h[name + ".extra"] = {"dtype": rnd.choice(list(DTYPE_BITS)), "shape": [rnd.randrange(5)],
                              "data_offsets": [rnd.randrange(64), rnd.randrange(64)]}
    elif op == 8 and isinstance(e, dict):  # offsets swapped or made floats
        o = e.get("data_offsets")
        if isinstance(o, list) and len(o) == 2:
            e["data_offsets"] = o[::-1] if rnd.random() < 0.5 else [float(v) if isinstance(v, int) else v for v in o]
    elif op == 9:  # a whole entry replaced
        h[name] = _value(rnd)
    elif op == 10 and isinstance(e, dict):  # renamed to a weird name
        h[rnd.choice(["", "__metadata__", "a\nb", "\u0000", "x" * 1000, "\ud800"])] = h.pop(name)
    elif op == 11:  # __metadata__ broken
        h["__metadata__"] = rnd.choice([_value(rnd), {"k": _value(rnd)}, {"format": "pt", "n": 1}, None, []])
    elif op == 12:  # __metadata__ dropped or extended
        if rnd.random() < 0.5:
            h.pop("__metadata__", None)
        else:
            h["__metadata__"] = {"format": "pt", **{str(i): "v" for i in range(rnd.randrange(3))}}
    elif op == 13 and names:  # keys reordered (offset order != key order)
        items = list(h.items())
        rnd.shuffle(items)
        h.clear()
        h.update(items)


_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")


def _text_mutation(raw: bytes, rnd: random.Random) -> bytes:
    """One change to the header text: numbers JSON round-trips cannot make, duplicates, nesting, bytes."""
    op = rnd.randrange(9)
    if op == 0:  # a number replaced by something no writer emits
        nums = list(_NUMBER.finditer(raw))
        if nums:
            m = rnd.choice(nums)
            new = rnd.choice([b"1e999", b"-1e999", b"NaN", b"Infinity", b"-0", b"7" * 5000, b"1" * 21,
                              b"18446744073709551616", b"1.5", b"2e3", b"0x10", b"01"])
            return raw[:m.start()] + new + raw[m.end():]
    if op == 1:  # a key duplicated (the first "name": { ... } pair repeated)
        m = re.search(rb'"[^"\\]*":\s*\{[^{}]*\}', raw)
        if m and raw.startswith(b"{"):
            return b"{" + m.group() + b"," + raw[1:]
    if op == 2:  # a value nested deep
        nums = list(_NUMBER.finditer(raw))
        if nums:
            m = rnd.choice(nums)
            d = rnd.choice(DEEP)
            opener = rnd.choice([b"[", b'{"k":'])
            closer = b"]" if opener == b"[" else b"}"
            return raw[:m.start()] + opener * d + m.group() + closer * d + raw[m.end():]
    if op == 3 and raw:  # bit flip
        i = rnd.randrange(len(raw))
        return raw[:i] + bytes([raw[i] ^ (1 << rnd.randrange(8))]) + raw[i + 1:]
    if op == 4 and raw:  # a random byte (non-UTF-8 included)
        i = rnd.randrange(len(raw))
        return raw[:i] + bytes([rnd.randrange(256)]) + raw[i + 1:]
    if op == 5 and raw:  # a byte inserted or deleted
        i = rnd.randrange(len(raw))
        return raw[:i] + bytes([rnd.choice(b'{}[]",:0 \\')]) + raw[i:] if rnd.random() < 0.5 else raw[:i] + raw[i + 1:]
    if op == 6:  # leading/trailing junk
        return rnd.choice([b" ", b"\xef\xbb\xbf", b"\n"]) + raw if rnd.random() < 0.5 else raw + rnd.choice(
            [b"x", b"\0", b"}", b" ", b"\t"])
    if op == 7:  # a string escape that is not valid Unicode
        i = raw.find(b'"', 1)
        if i > 0:
            return raw[:i + 1] + rnd.choice([b"\\ud800", b"\\udfff", b"\\u0000", b"\\x"]) + raw[i + 1:]
    if op == 8:  # the whole header another JSON type
        return rnd.choice([b"[]", b'"x"', b"1", b"null", b"{}", b'{"a":1}', b"[" * 100000 + b"]" * 100000])
    return raw


def mutate(blob: bytes, rnd: random.Random) -> bytes:
    """1-3 mutations of a real file: JSON-aware, text-level, or framing (length field, file size)."""
    raw, data = _split(blob)
    for _ in range(rnd.randrange(1, 4)):
        kind = rnd.random()
        if kind < 0.45:
            try:
                h = json.loads(raw)
            except (ValueError, RecursionError):  # an earlier mutation broke it: mutate the text instead
                h = None
            if isinstance(h, dict):
                _json_mutation(h, rnd)
                raw = json.dumps(h, separators=rnd.choice([(",", ":"), (", ", ": ")]),
                                 ensure_ascii=rnd.random() < 0.5).encode("utf-8", "surrogatepass")
                if rnd.random() < 0.6:  # data sized to what the mutated header claims, so deeper checks run
                    ends = [v["data_offsets"][1] for k, v in h.items() if k != "__metadata__" and isinstance(v, dict)
                            and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
                            and isinstance(v["data_offsets"][1], int)]
                    end = max(ends, default=0)
                    if 0 <= end <= 1 << 20:
                        data = (data + bytes(end))[:end]
        elif kind < 0.85:
            raw = _text_mutation(raw, rnd)
        else:
            break
    out = _file(raw, data, pad=rnd.random() < 0.9)
    f = rnd.random()
    if f < 0.05:  # length field wrong
        n = rnd.choice([0, 1, 7, len(raw) - 1, len(raw) + 1, 10 ** 8, 10 ** 8 + 1, 2 ** 63, 2 ** 64 - 1])
        out = struct.pack("<Q", max(0, n)) + out[8:]
    elif f < 0.10:  # file truncated or extended
        out = out[:rnd.randrange(len(out) + 1)] if rnd.random() < 0.5 else out + bytes(rnd.randrange(1, 9))
    return out


# ---------------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------------

def check(blob: bytes, path: Path | None = None) -> str:
    """'accepted' or 'rejected'; any other exception, or an inconsistent acceptance, propagates.

    With ``path`` the blob is also written there and read through :func:`read_header` (the local path).
    """
    try:
        if path is not None:
            path.write_bytes(blob)
            infos, meta = read_header(path, FILE)
        else:
            n = header_length(blob[:8], FILE, len(blob))
            infos, meta = parse_header(blob[8:8 + n], FILE, len(blob))
    except CheckpointFormatError as exc:
        msg = str(exc)
        assert msg.startswith(FILE + ": ") and "\n" not in msg and len(msg) < 600, msg
        return "rejected"
    n = struct.unpack("<Q", blob[:8])[0]
    assert isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    names = [i.name for i in infos]
    assert len(set(names)) == len(names) and "__metadata__" not in names
    pos = 8 + n
    for i in infos:
        assert i.file == FILE and i.dtype in DTYPE_BITS
        assert all(isinstance(d, int) and 0 <= d < 2 ** 63 for d in i.shape)
        assert i.begin == pos and i.numel * DTYPE_BITS[i.dtype] == 8 * i.nbytes
        pos = i.end
    assert pos == len(blob)
    # We accepted it: the library must read the same tensors with the same bytes.
    lib = {name: t for name, t in safetensors.deserialize(blob)}
    assert set(lib) == set(names)
    for i in infos:
        t = lib[i.name]
        assert t["dtype"] == i.dtype and list(t["shape"]) == list(i.shape)
        assert bytes(t["data"]) == blob[i.begin:i.end]
    return "accepted"


def lib_accepts(blob: bytes) -> bool:
    try:
        safetensors.deserialize(blob)
    except Exception:  # noqa: BLE001 - any refusal by the library
        return False
    return True


try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # script mode without hypothesis still works
    given = None

if given is not None:
    @settings(derandomize=True, max_examples=600, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(rnd=st.randoms(use_true_random=False), which=st.integers(0, 2))
    def test_fuzzed_headers_accept_consistently_or_refuse_cleanly(rnd, which) -> None:
        check(mutate(seeds()[which], rnd))

    @settings(derandomize=True, max_examples=100, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(rnd=st.randoms(use_true_random=False), which=st.integers(0, 2))
    def test_fuzzed_files_through_read_header(rnd, which, tmp_path_factory) -> None:
        check(mutate(seeds()[which], rnd), tmp_path_factory.mktemp("fz") / FILE)


def test_seeds_are_accepted() -> None:
    assert [check(s) for s in seeds()] == ["accepted"] * 3


def test_mutations_reach_every_outcome() -> None:
    """The mutator is not trivially all-reject: a fixed seed yields acceptances and refusals."""
    rnd = random.Random(12)
    got = collections.Counter(check(mutate(seeds()[i % 3], rnd)) for i in range(300))
    assert got["accepted"] >= 10 and got["rejected"] >= 100, got


# ---------------------------------------------------------------------------------------------
# Script mode
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutations", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--file-every", type=int, default=10, help="every Nth case also goes through a real file")
    args = ap.parse_args(argv)
    rnd = random.Random(args.seed)
    base = seeds()
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / FILE
        for i in range(args.mutations):
            blob = mutate(base[i % len(base)], rnd)
            try:
                outcome = check(blob, path if args.file_every and i % args.file_every == 0 else None)
            except CheckpointFormatError:
                raise  # unreachable: check() catches it
            except Exception as exc:  # noqa: BLE001 - the point: count anything else
                counts["FAILED"] += 1
                if len(failures) < 5:
                    failures.append(f"#{i}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            counts[outcome] += 1
            if outcome == "rejected":
                lib = lib_accepts(blob)
                counts["rejected, library also rejects" if not lib else "rejected, library accepts (stricter)"] += 1
                if lib:
                    try:
                        n = header_length(blob[:8], FILE, len(blob))
                        parse_header(blob[8:8 + n], FILE, len(blob))
                    except CheckpointFormatError as exc:
                        reasons[re.sub(r"'[^']*'|\d+", "_", str(exc).split(": ", 1)[1])[:70]] += 1
    wall = time.perf_counter() - t0
    print(f"{args.mutations} mutations (seed {args.seed}) in {wall:.1f} s ({args.mutations / wall:.0f}/s)")
    for k in sorted(counts):
        print(f"  {k:42s} {counts[k]}")
    if reasons:
        print("  where fp4convert is stricter than the library:")
        for r, c in reasons.most_common(8):
            print(f"    {c:6d}  {r}")
    for f in failures:
        print("  FAILURE", f)
    return 1 if counts["FAILED"] else 0


if __name__ == "__main__":
    sys.exit(main())
