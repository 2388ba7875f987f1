// CPU proof of the fp32 identities behind the sm_90 (software E2M1) fast paths of csrc/fp4c_numerics.cuh,
// emulated with IEEE fp32 operations (one rounding each; fmaf fused) against docs/numerics.md's definitions.
// Why on the CPU: the identities are claims about fp32 arithmetic, which any IEEE machine reproduces, and
// the GPU tests only sample them. Exhaustive where the input is one fp32 value:
//   1. div6_rn(p) == p / 6 (IEEE) for every p in [6 * 2^-126, FLT_MAX] (a normal quotient); below, both
//      are under 2^-125, far under E4M3's smallest step (2^-9), so both encode to byte 0;
//   2. the scaled chain e2m1_p_from_cs(ys, e2m1_cs(ys)), ys = RN(y * 2^-104), has the bits idx(y) << 22
//      (idx = the predicate sum) for every fp32 y in [0, 7);
//   3. MXFP4: the clamped chain of e (min at 6 * 2^-126) for every y in [0, 8), and the chain of e + 1
//      (e2m1_p_half_from_cs) has the bits idx(y / 2) << 22 for every y in [0, 8);
//   5. the unmasked chain (e2m1_p_unmasked) is wrong exactly at the four listed y of [0, 7);
//   7. MXFP4: both chains started from the unmasked m are wrong only at y with more than 11 significant
//      bits, which bf16/fp16 inputs (y = x * 2^k) never have;
//   6. nvfp4_unmasked_safe: over sampled global scales (some built so that an input hits a listed y) and
//      every E4M3 byte, no bf16 or fp16 input value (all of them are tried) hits one where it says safe;
// and, by random sampling with targeted edge cases (E2M1 ties, binade edges, r near 2^-22, d near 4,
// subnormal d), the per-element error terms of block_err_codes_scaled / mxfp4_block_mse_iw against the
// reference's e = RN(RN(value * d) - x), f = RN(e * x), s = RN(f * f) (the block sums add these in the same
// order). Build and run (about a minute on one core):
//   g++ -O2 -ffp-contract=off -march=native -o /tmp/check benchmarks/device/check_sm90_numerics.cpp && /tmp/check
// -ffp-contract=off matters: a contracted a * b + c would not be the kernels' separate operations.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

static float f(uint32_t b) { float x; std::memcpy(&x, &b, 4); return x; }
static uint32_t u(float x) { uint32_t b; std::memcpy(&b, &x, 4); return b; }
static float fmaf_(float a, float b, float c) { return std::fmaf(a, b, c); }

// docs/numerics.md "E2M1 elements": the predicate sum (reference.e2m1_encode's magnitude index).
static uint32_t idx_spec(float a) {
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
}
static const float VALUES[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

// The device functions, op for op.
static float div6_rn(float p) {
  const float y = 0.16666667163372039795f;
  const float q0 = p * y;
  const float rem = fmaf_(-q0, 6.0f, p);
  return fmaf_(rem, y, q0);
}
static float e2m1_cs(float ys) { return f(u(std::fmax(ys, 0x1p-104f)) & 0x7F800000u); }
static float e2m1_p_from_cs(float ys, float cs) {
  const float t = fmaf_(cs, 4194304.0f, ys);
  return fmaf_(t, 0x1p-22f, -cs);
}
static float e2m1_p_half_from_cs(float ys, float cs) {
  const int32_t hb = (int32_t)u(cs) - 0x00800000, sb = (int32_t)u(0x1p-104f);
  const float ch = f((uint32_t)(hb > sb ? hb : sb));
  const float t = fmaf_(ch, 8388608.0f, ys);
  return fmaf_(t, 0x1p-23f, -ch);
}

static float e2m1_p_unmasked(float ys) {
  const float m = std::fmax(ys, 0x1p-104f);
  const float t = fmaf_(m, 4194304.0f, ys);
  return fmaf_(t, 0x1p-22f, -m);
}
static const float UNMASKED_BAD[4] = {0x1.fffffap+0f, 0x1.fffffep+0f, 0x1.fffffap+1f, 0x1.fffffep+1f};
// RN to bf16 / fp16 and back (the device's cvt.rn; inputs here are finite and non-negative).
static float rn_bf16(float x) {
  uint32_t b = u(x);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return f(b & 0xFFFF0000u);
}
static float rn_f16(float x) {  // via the exact decomposition: fp16 has 11 significant bits, min normal 2^-14
  if (!(x < 65520.0f)) return INFINITY;
  const int e = x >= 0x1p-14f ? std::ilogb(x) : -14;
  return std::nearbyint(std::ldexp(x, 10 - e)) * std::ldexp(1.0f, e - 10);  // ties to even (default mode)
}
static bool unmasked_safe(float r, float d, bool bf16) {  // csrc: nvfp4_unmasked_safe
  if (!(r < 0x1p100f && d >= 0x1p-100f)) return r == 0.0f;
  bool safe = true;
  for (float y : UNMASKED_BAD) {
    const float z = y * d;
    const float x = bf16 ? rn_bf16(z) : rn_f16(z);
    safe &= x * r != y;
  }
  return safe;
}
// E4M3 byte -> value (bytes 0..126)
static float e4m3_value(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  return e ? std::ldexp(1.0f + m / 8.0f, (int)e - 7) : std::ldexp(m / 8.0f, -6);
}

static unsigned long long bad = 0;
static void fail(const char* what, uint32_t a, uint32_t b, uint32_t c) {
  if (bad++ < 20) std::printf("MISMATCH %s: %08x %08x %08x\n", what, a, b, c);
}

int main() {
  // 1. div6_rn
  for (uint32_t b = 0; b <= 0x7F7FFFFFu; ++b) {
    const float p = f(b), q = div6_rn(p), want = p / 6.0f;
    if (p >= 6.0f * 0x1p-126f ? u(q) != u(want) : !(q < 0x1p-125f && want < 0x1p-125f)) fail("div6", b, u(q), u(want));
  }
  std::printf("1. div6_rn: %llu mismatches over [0, FLT_MAX]\n", bad);
  // 2. scaled chain, NVFP4 (y < 7), and 3. the MXFP4 chains (y < 8)
  const unsigned long long before2 = bad;
  for (uint32_t b = 0; b < 0x41000000u; ++b) {  // [0, 8)
    const float y = f(b);
    const float ys = y * 0x1p-104f;
    const float cs = e2m1_cs(ys);
    const float p = e2m1_p_from_cs(ys, cs);
    const uint32_t id = idx_spec(y);
    if (y < 7.0f && u(p) != id << 22) fail("chain", b, u(p), id);
    if (y < 7.0f && p * 0x1p126f != VALUES[id]) fail("chain value", b, u(p), id);
    const float p0 = std::fmin(p, 0x1.8p-124f);
    if (u(p0) != id << 22) fail("mx e chain", b, u(p0), id);
    const float p1 = e2m1_p_half_from_cs(ys, cs);
    const uint32_t id1 = idx_spec(y * 0.5f);
    if (u(p1) != id1 << 22) fail("mx e+1 chain", b, u(p1), id1);
  }
  std::printf("2-3. chains: %llu mismatches over every y in [0, 8)\n", bad - before2);
  // 5. the unmasked chain: wrong exactly at the four UNMASKED_BAD values of y in [0, 7)
  const unsigned long long before5 = bad;
  int nbad = 0;
  for (uint32_t b = 0; b < 0x40E00000u; ++b) {
    const float y = f(b);
    const bool wrong = u(e2m1_p_unmasked(y * 0x1p-104f)) != idx_spec(y) << 22;
    const bool listed = y == UNMASKED_BAD[0] || y == UNMASKED_BAD[1] || y == UNMASKED_BAD[2] || y == UNMASKED_BAD[3];
    nbad += wrong;
    if (wrong != listed) fail("unmasked", b, wrong, listed);
  }
  std::printf("5. unmasked chain: wrong on %d values of y in [0, 7), %llu not the listed four\n", nbad,
              bad - before5);
  // 7. MXFP4 with short inputs (bf16/fp16 unrotated, y = x * 2^k): both chains from the unmasked m are
  //    wrong only where y has more than 11 significant bits
  const unsigned long long before7 = bad;
  int nwrong7 = 0;
  for (uint32_t b = 0; b < 0x41000000u; ++b) {
    const float y = f(b);
    const float ys = y * 0x1p-104f, m = std::fmax(ys, 0x1p-104f);
    const float p0 = std::fmin(e2m1_p_from_cs(ys, m), 0x1.8p-124f), p1 = e2m1_p_half_from_cs(ys, m);
    const bool wrong = u(p0) != idx_spec(y) << 22 || u(p1) != idx_spec(y * 0.5f) << 22;
    nwrong7 += wrong;
    if (wrong && (b & 0x1FFFu) == 0) fail("mx unmasked", b, u(p0), u(p1));
  }
  std::printf("7. MXFP4 unmasked chains: wrong on %d values of y in [0, 8), %llu of them with <= 11 significant "
              "bits\n", nwrong7, bad - before7);
  // 6. nvfp4_unmasked_safe against every bf16 and fp16 value x, for (r, d) = nvfp4_candidate(gs, byte)
  //    over random global scales and every byte, plus scales built so that some x hits a listed y
  const unsigned long long before6 = bad;
  std::mt19937_64 rng6(777);
  long nsafe = 0, nunsafe = 0, ntab = 0;
  for (int it = 0; it < 300; ++it) {
    float gs;
    if (it % 3 == 0) {  // aim: a random 16-bit x and a listed y: gs such that x * gs / sf = y for some byte
      const bool bf = rng6() % 2;
      const uint32_t xb = 0x3000u + (uint32_t)(rng6() % 0x1F00u);
      const float x = bf ? f(xb << 16) : (float)std::ldexp(1.0 + (xb & 0x3FF) / 1024.0, (int)((xb >> 10) & 31) - 15);
      const float sf = e4m3_value(1 + (uint32_t)(rng6() % 126));
      gs = UNMASKED_BAD[rng6() % 4] / x * sf;
      gs = f(u(gs) + (uint32_t)(rng6() % 5) - 2u);
    } else {
      gs = std::ldexp(1.0f + (float)(rng6() % 1000000) / 1e6f, (int)(rng6() % 80) - 30);
    }
    for (uint32_t byte = 0; byte < 127; ++byte) {
      const float sf = e4m3_value(byte);
      const float r = sf > 0.0f ? std::fmin(gs / sf, FLT_MAX) : 0.0f, d = sf / gs;
      for (int bf = 0; bf < 2; ++bf) {
        bool hit = false;
        for (uint32_t xb = 0; xb < 0x7F80u && !hit; ++xb) {  // every finite non-negative value of the type
          float x;
          if (bf) x = f(xb << 16);
          else if (xb < 0x7C00u) x = (float)std::ldexp((xb >> 10) ? 1.0 + (xb & 0x3FF) / 1024.0 : (xb & 0x3FF) / 1024.0,
                                                      (int)((xb >> 10) ? (xb >> 10) : 1) - 15);
          else break;
          const float y = x * r;
          hit = y == UNMASKED_BAD[0] || y == UNMASKED_BAD[1] || y == UNMASKED_BAD[2] || y == UNMASKED_BAD[3];
        }
        const bool safe = unmasked_safe(r, d, bf);
        ++ntab;
        nsafe += safe;
        nunsafe += hit;
        if (safe && hit) fail("unmasked_safe", u(gs), byte, (uint32_t)bf);
      }
    }
  }
  std::printf("6. unmasked_safe: %llu unsafe bytes called safe, over %ld (gs, byte, type): %ld safe, %ld with a "
              "hitting x\n", bad - before6, ntab, nsafe, nunsafe);
  // 4. per-element error terms, sampled
  const unsigned long long before4 = bad;
  std::mt19937_64 rng(12345);
  auto rnd_f = [&](float lo, float hi) {  // log-uniform in [lo, hi)
    std::uniform_real_distribution<double> d(std::log2(lo), std::log2(hi));
    return (float)std::exp2(d(rng));
  };
  const float ties[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 1.0f, 2.0f, 4.0f, 6.0f};
  long n4 = 0;
  for (long it = 0; it < 40000000; ++it) {
    // NVFP4 candidate: r in the fast range (>= 2^-22, or a few near the edge), d < 4 (some subnormal)
    float r, d;
    const int kind = (int)(rng() % 8);
    if (kind == 0) r = f(u(0x1p-22f) + (uint32_t)(rng() % 64));
    else r = rnd_f(0x1p-22f, 0x1p40f);
    if (kind == 1) d = f((uint32_t)(rng() % 0x00800000u));  // subnormal d
    else if (kind == 2) d = f(u(4.0f) - 1 - (uint32_t)(rng() % 64));
    else d = rnd_f(0x1p-126f, 4.0f);
    // x: bf16-like, fp16-like or fp32; near a tie of x * r half the time
    float x;
    if (rng() % 2) {
      const float t = ties[rng() % 11];
      x = f(u(t / r) + (uint32_t)(rng() % 9) - 4u);
    } else {
      x = rnd_f(1e-30f, 8.0f / r);
    }
    const int prec = (int)(rng() % 3);
    if (prec == 0) x = f(u(x) & 0xFFFF0000u);
    else if (prec == 1) x = f(u(x) & 0xFFFFE000u);
    if (!(std::isfinite(x)) || x * r >= 7.0f) continue;
    if (rng() % 2) x = -x;
    ++n4;
    const float a = std::fabs(x);
    // reference
    const float y = x * r;
    const uint32_t id = idx_spec(std::fabs(y));
    const float q = std::copysign(VALUES[id], y);
    const float e = q * d - x;
    const float s = e * e, fw = e * x, sw = fw * fw;
    // fast: block_err_codes_scaled
    const float rs = r * 0x1p-104f, dd = d * 0x1p126f;
    const float ys = a * rs;
    const float p = e2m1_p_from_cs(ys, e2m1_cs(ys));
    const float e2 = p * dd - a;
    const float s2 = e2 * e2, fw2 = e2 * a, sw2 = fw2 * fw2;
    if (u(p) != id << 22) fail("nv code", u(x), u(r), u(d));
    if (u(s2) != u(s) || u(sw2) != u(sw)) fail("nv err", u(x), u(r), u(d));
    // MXFP4: e in [0, 127], both candidates from one chain
    const int ee = (int)(rng() % 128);
    const float r0 = std::ldexp(1.0f, 127 - ee), d0 = std::ldexp(1.0f, ee - 127);
    const float r1 = std::ldexp(1.0f, 126 - ee), d1 = std::ldexp(1.0f, ee - 126);
    float xm = rnd_f(1e-38f, 8.0f * d0);
    if (rng() % 2) xm = f(u(ties[rng() % 11] * d0) + (uint32_t)(rng() % 9) - 4u);
    if (prec == 0) xm = f(u(xm) & 0xFFFF0000u);
    if (!(xm * r0 < 8.0f) || !(xm > 0.0f)) continue;
    const uint32_t i0 = idx_spec(std::fmin(xm * r0, 1e30f)), i1 = idx_spec(xm * r1);
    const float m0 = VALUES[i0] * d0 - xm, m1 = VALUES[i1] * d1 - xm;
    const float rsm = std::ldexp(1.0f, 23 - ee), ddm = std::ldexp(1.0f, ee - 1);
    const float ysm = xm * rsm, cs0 = e2m1_cs(ysm);
    const float p0 = std::fmin(e2m1_p_from_cs(ysm, cs0), 0x1.8p-124f);
    const float p1 = e2m1_p_half_from_cs(ysm, cs0);
    const float g0 = fmaf_(p0, ddm, -xm), g1 = fmaf_(p1, ddm * 2.0f, -xm);
    if (u(p0) != i0 << 22 || u(p1) != i1 << 22) fail("mx code", u(xm), (uint32_t)ee, 0);
    if (u(g0 * g0) != u(m0 * m0) || u(g1 * g1) != u(m1 * m1)) fail("mx err", u(xm), (uint32_t)ee, 1);
    const float w0 = g0 * xm, w1 = g1 * xm, v0 = m0 * xm, v1 = m1 * xm;
    if (u(w0 * w0) != u(v0 * v0) || u(w1 * w1) != u(v1 * v1)) fail("mx werr", u(xm), (uint32_t)ee, 2);
  }
  std::printf("4. error terms: %llu mismatches over %ld sampled (x, r, d) and MXFP4 (x, e)\n", bad - before4, n4);
  std::printf("%s\n", bad ? "FAILED" : "all identities hold");
  return bad ? 1 : 0;
}
