"""A second, independent reading of docs/numerics.md: scalar Python, one element at a time.

Python floats are doubles; every fp32 operation is computed in double and rounded to fp32 with
``f32``. For +, -, *, / of two fp32 values that double rounding is exact (53 >= 2*24 + 2), so these
are true fp32 results. E2M1 and E4M3 are found by brute force over their value sets, so nothing here
shares logic with :mod:`fp4convert.numerics.reference`.
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


def e2m1_value(code: int) -> float:
    """The value of an E2M1 code (code 8 is -0.0)."""
    return math.copysign(E2M1[code & 7], -1.0 if code & 8 else 1.0)


def block_err(blk: list[float], codes: list[int], d: float, weighted: bool = False) -> float:
    """docs/numerics.md's block error ("Block error"), one fp32 operation per step: e = value * d - x; err = err + e * e.

    ``weighted`` (wmse): e = e * x before the square."""
    err = 0.0
    for x, c in zip(blk, codes):
        e = f32(f32(e2m1_value(c) * d) - x)
        if weighted:
            e = f32(e * x)
        err = f32(err + f32(e * e))
    return err


def _rotate_rows(rows: list[list[float]]) -> list[list[float]]:
    return [sum((had16(r[i : i + 16]) for i in range(0, len(r), 16)), []) for r in rows]


def nvfp4_candidate(blk: list[float], gs: float, c: int, weighted: bool = False) -> tuple[list[int], float]:
    """Codes and block error of E4M3 scale byte c."""
    sf = E4M3[c]
    r = min(f32(gs / sf), FLT_MAX) if sf > 0 else 0.0
    codes = [e2m1(f32(t * r)) for t in blk]
    return codes, block_err(blk, codes, f32(sf / gs), weighted)


def nvfp4_choose(blk: list[float], gs: float, rule: str = "max") -> int:
    """The scale byte of one block under a docs/numerics.md "Scale rules" rule, by brute force over the candidates."""
    bmax = max(abs(t) for t in blk)
    s = f32(gs * bmax)
    b6, b4 = e4m3(f32(s / 6.0)), e4m3(f32(s / 4.0))
    if rule == "max":
        return b6
    if rule == "4over6":
        return b4 if nvfp4_candidate(blk, gs, b4)[1] < nvfp4_candidate(blk, gs, b6)[1] else b6
    assert rule in ("mse", "wmse")
    cands = {b6, b4, max(b6 - 1, 0)}
    return min(cands, key=lambda c: (nvfp4_candidate(blk, gs, c, rule == "wmse")[1], -c))


def nvfp4_row_codes(
    rows: list[list[float]], rotate: bool = False, rule: str = "max", amax: float | None = None
) -> tuple[list[list[int]], list[list[int]], float]:
    """docs/numerics.md "NVFP4" and its "Scale rules", literally: returns (codes, scale bytes, gs).

    ``amax`` replaces the rows' own amax (a fused group's).
    """
    if rotate:
        rows = _rotate_rows(rows)
    if amax is None:
        amax = max(abs(t) for r in rows for t in r)
    gs = 1.0 if amax == 0 else min(f32(2688.0 / amax), FLT_MAX)
    codes, scales = [], []
    for r in rows:
        rc, rs = [], []
        for i in range(0, len(r), 16):
            blk = r[i : i + 16]
            sb = nvfp4_choose(blk, gs, rule)
            rc += nvfp4_candidate(blk, gs, sb)[0]
            rs.append(sb)
        codes.append(rc)
        scales.append(rs)
    return codes, scales, gs


def mxfp4_candidate(blk: list[float], c: int, weighted: bool = False) -> tuple[list[int], float]:
    """Codes and block error of E8M0 exponent c (multiplier 2^(127-c), step 2^(c-127), both exact)."""
    codes = [e2m1(f32(t * 2.0 ** (127 - c))) for t in blk]
    return codes, block_err(blk, codes, 2.0 ** (c - 127), weighted)


def mxfp4_choose(blk: list[float], rule: str = "floor") -> int:
    bmax = max(abs(t) for t in blk)
    e = 0 if bmax == 0 else max(0, min(254, ((f32_bits(bmax) >> 23) & 0xFF) - 2))
    up = min(e + 1, 254)
    if rule == "floor":
        return e
    if rule == "rceil":
        return up if f32(bmax * 2.0 ** (127 - e)) > 6.0 else e
    assert rule in ("mse", "wmse")
    w = rule == "wmse"
    return up if mxfp4_candidate(blk, up, w)[1] < mxfp4_candidate(blk, e, w)[1] else e


def mxfp4_row_codes(
    rows: list[list[float]], rule: str = "floor", rotate: bool = False
) -> tuple[list[list[int]], list[list[int]]]:
    """docs/numerics.md "MXFP4" and its "Scale rules", literally: returns (codes, E8M0 bytes)."""
    if rotate:
        rows = _rotate_rows(rows)
    codes, scales = [], []
    for r in rows:
        rc, rs = [], []
        for i in range(0, len(r), 32):
            blk = r[i : i + 32]
            e = mxfp4_choose(blk, rule)
            rc += mxfp4_candidate(blk, e)[0]
            rs.append(e)
        codes.append(rc)
        scales.append(rs)
    return codes, scales


# ---------------------------------------------------------------------------------------------
# Shared test data
# ---------------------------------------------------------------------------------------------

def fresh_seed() -> int:
    """A new random seed, printed so that pytest shows it with a failure (rerun with that seed)."""
    import torch

    seed = torch.seed() % 2**31
    print(f"seed = {seed}")
    return seed


def random_weight(rows: int, cols: int, seed: int):
    """Heavy-tailed values over many binades, with planted exact ties and a zero block."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    x[0, :16] = 0.0
    if cols >= 48:
        x[0, 32:48] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.25, -5.0, 0, 0, 0, 0, 1])
    return x
