"""A second, independent reading of SPEC.md: scalar Python, one element at a time.

Python floats are doubles; every fp32 operation is computed in double and rounded to fp32 with
``f32``. For +, -, *, / of two fp32 values that double rounding is exact (53 >= 2*24 + 2), so these
are true fp32 results. E2M1 and E4M3 are found by brute force over their value sets, so nothing here
shares logic with :mod:`fp4convert.reference`.
"""

from __future__ import annotations

import math
import struct

FLT_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]


def f32(v: float) -> float:
    if math.isinf(v) or abs(v) > FLT_MAX * (1 + 2**-25):
        return math.copysign(math.inf, v)
    return struct.unpack("<f", struct.pack("<f", v))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1(y: float) -> int:
    """Nearest E2M1 magnitude, ties to the even code (= even mantissa), saturating; sign bit kept."""
    a = min(abs(y), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))
    sign = f32_bits(y) >> 31
    return best | (sign << 3)


def _e4m3_values() -> list[float]:
    vals = []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


E4M3 = _e4m3_values()


def e4m3(s: float) -> int:
    """Nearest E4M3 value to s >= 0 (ties to the even code), saturating at 448."""
    s = min(s, 448.0)
    return min(range(0x7F), key=lambda c: (abs(E4M3[c] - s), c % 2))


def had16(v: list[float]) -> list[float]:
    v = list(v)
    for h in (1, 2, 4, 8):
        for i in range(16):
            if not i & h:
                a, b = v[i], v[i + h]
                v[i], v[i + h] = f32(a + b), f32(a - b)
    return [f32(t * 0.25) for t in v]


def nvfp4_row_codes(rows: list[list[float]], rotate: bool = False) -> tuple[list[list[int]], list[list[int]], float]:
    """SPEC.md section 2, literally: returns (codes, scale bytes, gs)."""
    if rotate:
        rows = [sum((had16(r[i : i + 16]) for i in range(0, len(r), 16)), []) for r in rows]
    amax = max(abs(t) for r in rows for t in r)
    gs = 1.0 if amax == 0 else min(f32(2688.0 / amax), FLT_MAX)
    codes, scales = [], []
    for r in rows:
        rc, rs = [], []
        for i in range(0, len(r), 16):
            blk = r[i : i + 16]
            bmax = max(abs(t) for t in blk)
            s = f32(f32(gs * bmax) / 6.0)
            sb = e4m3(s)
            sf = E4M3[sb]
            rr = min(f32(gs / sf), FLT_MAX) if sf > 0 else 0.0
            rc += [e2m1(f32(t * rr)) for t in blk]
            rs.append(sb)
        codes.append(rc)
        scales.append(rs)
    return codes, scales, gs


def mxfp4_row_codes(rows: list[list[float]]) -> tuple[list[list[int]], list[list[int]]]:
    """SPEC.md section 3, literally: returns (codes, E8M0 bytes)."""
    codes, scales = [], []
    for r in rows:
        rc, rs = [], []
        for i in range(0, len(r), 32):
            blk = r[i : i + 32]
            bmax = max(abs(t) for t in blk)
            e = 0 if bmax == 0 else max(0, min(254, ((f32_bits(bmax) >> 23) & 0xFF) - 2))
            mult = 2.0 ** (127 - e)
            rc += [e2m1(f32(t * mult)) for t in blk]
            rs.append(e)
        codes.append(rc)
        scales.append(rs)
    return codes, scales
