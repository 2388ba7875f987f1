// fp4convert kernels, numerics: docs/numerics.md ("E2M1 elements" to "Had16 rotation", "Scale rules"), bit for bit with
// fp4convert/reference.py. Each device function names the reference function it mirrors.
//
// Every fp32 step is one IEEE operation with round-to-nearest-even (__fmul_rn / __fadd_rn /
// __fdiv_rn, and __fmaf_rn only where the fused result is exact by construction); the library is
// built with -fmad=false and without fast math.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <float.h>

// E2M1 conversion in hardware where the target has cvt.rn.satfinite.e2m1x2.f32 (sm_100a family,
// sm_120a family); elsewhere (sm_90 and older) the exact software path below.
#if defined(__CUDA_ARCH__) &&                                                                      \
    (defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM101_ALL) ||                 \
     defined(__CUDA_ARCH_FEAT_SM103_ALL) || defined(__CUDA_ARCH_FEAT_SM110_ALL) ||                 \
     defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL))
#define FP4C_HW_E2M1 1
#else
#define FP4C_HW_E2M1 0
#endif

namespace fp4c {

// Scale rules (the launchers' int scale_rule): NVFP4 max / 4over6 / mse / wmse, MXFP4 floor / rceil /
// mse / wmse. wmse is mse with the x^2-weighted block error (reference.block_error, weighted=True).
enum : int { RULE_PLAIN = 0, RULE_ALT = 1, RULE_MSE = 2, RULE_WMSE = 3 };

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// ------------------------------------------------------------------------------------------------
// Block scales
// ------------------------------------------------------------------------------------------------

// reference.e4m3_encode: fp32 -> E4M3 byte (RNE, saturating at 448, subnormals kept): the hardware
// conversion (sm_89+).
__device__ __forceinline__ uint32_t e4m3_from_f32(float s) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(0.0f), "f"(s));
  return d & 0xFFu;
}

// e4m3_from_f32 without the final mask: the conversion's other half is E4M3(0) = 0, so the 16-bit
// result already is the byte; as a 16-bit value the compiler indexes a table with it without masking.
__device__ __forceinline__ uint32_t e4m3_from_f32_x2(float s) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(0.0f), "f"(s));
  return d;
}

// reference.e4m3_decode: E4M3 byte -> fp32 (exact; every E4M3 value is an fp16 value).
__device__ __forceinline__ float f32_from_e4m3(uint32_t b) {
  uint32_t h2;
  unsigned short in = (unsigned short)b;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  return __half2float(__ushort_as_half((unsigned short)(h2 & 0xFFFFu)));
}

// Two E4M3 bytes (low byte: element 0) -> two fp32 (exact).
__device__ __forceinline__ float2 f32x2_from_e4m3x2(uint32_t two_bytes) {
  uint32_t h2;
  const unsigned short in = (unsigned short)two_bytes;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}

// reference.pow2_f32: exact 2^k from exponent bits, for k in [-127, 127].
__device__ __forceinline__ float pow2i(int k) {
  return k >= -126 ? __uint_as_float((uint32_t)(k + 127) << 23) : __uint_as_float(0x00400000u);
}

// reference.global_scale: gs = 2688 / amax (a true IEEE division), 1 for amax == 0, clamped to
// FLT_MAX. fminf drops NaN, so the caller flags a non-finite amax itself.
__device__ __forceinline__ float nvfp4_global_scale(float amax) {
  return amax == 0.0f ? 1.0f : fminf(__fdiv_rn(2688.0f, amax), FLT_MAX);
}

// reference.nvfp4_quantize, steps 3-4 (rule max): s = (gs * bmax) / 6 -> E4M3 byte; the block
// multiplier r = gs / sf (0 for sf == 0), clamped to FLT_MAX.
__device__ __forceinline__ float nvfp4_scale(float gs, uint32_t bmax_bits, uint32_t& byte) {
  const float s = __fdiv_rn(__fmul_rn(gs, __uint_as_float(bmax_bits)), 6.0f);
  byte = e4m3_from_f32(s);
  const float sf = f32_from_e4m3(byte);
  return sf > 0.0f ? fminf(__fdiv_rn(gs, sf), FLT_MAX) : 0.0f;
}

// docs/numerics.md "Scale rules", NVFP4 candidates: the /4 byte b4 = E4M3((gs * bmax) / 4) (the division by 4 is
// exact as a multiply by 0.25: both are RN of the same real).
__device__ __forceinline__ uint32_t nvfp4_byte4(float gs, uint32_t bmax_bits) {
  return e4m3_from_f32(__fmul_rn(__fmul_rn(gs, __uint_as_float(bmax_bits)), 0.25f));
}

// RN(p / 6) for p in [0, FLT_MAX] without the IEEE division's slow path: q0 = RN(p * RN(1/6)), the
// exact residual p - 6 q0 (one FMA), then one correction FMA (Markstein's sequence). Equal to
// __fdiv_rn(p, 6) on every fp32 p in [6 * 2^-126, FLT_MAX]; below, both are < 2^-125, so the E4M3 byte
// (the only use) is 0 either way (benchmarks/device/check_sm90_numerics.cpp checks every p in [0, FLT_MAX]).
// Callers clamp p to FLT_MAX first (inf / 6 = inf and FLT_MAX / 6 both saturate E4M3 at 448).
__device__ __forceinline__ float div6_rn(float p) {
  const float y = 0.16666667163372039795f;  // RN(1/6)
  const float q0 = __fmul_rn(p, y);
  const float rem = __fmaf_rn(-q0, 6.0f, p);
  return __fmaf_rn(rem, y, q0);
}

// docs/numerics.md "Scale rules", a candidate E4M3 byte c -> (r, d): sf = decode(c); r = sf > 0 ? min(gs / sf,
// FLT_MAX) : 0; d = sf / gs.
__device__ __forceinline__ void nvfp4_candidate(float gs, uint32_t byte, float& r, float& d) {
  const float sf = f32_from_e4m3(byte);
  r = sf > 0.0f ? fminf(__fdiv_rn(gs, sf), FLT_MAX) : 0.0f;
  d = __fdiv_rn(sf, gs);
}

// reference.e8m0_encode_from_bmax (MXFP4 floor rule): e = clamp(exponent_field(bmax) - 2, 0, 254);
// returns the multiplier 2^(127 - e), from bits.
__device__ __forceinline__ float mxfp4_scale(uint32_t bmax_bits, uint32_t& byte) {
  const int field = (int)((bmax_bits >> 23) & 0xFFu);
  const int e = min(max(field - 2, 0), 254);
  byte = (uint32_t)e;
  return pow2i(127 - e);
}

// docs/numerics.md "Scale rules", MXFP4 rceil: e + 1 (clamped to 254) when bmax * 2^(127 - e) > 6.
__device__ __forceinline__ uint32_t mxfp4_rceil(uint32_t bmax_bits, uint32_t e, float r) {
  return __fmul_rn(__uint_as_float(bmax_bits), r) > 6.0f ? min(e + 1u, 254u) : e;
}

// ------------------------------------------------------------------------------------------------
// Had16 (reference.had16)
// ------------------------------------------------------------------------------------------------

// docs/numerics.md "Had16 rotation": butterflies h = 1, 2, 4, 8 in this order (the * 0.25 is separate, below).
__device__ __forceinline__ void butterflies16(float v[16]) {
#pragma unroll
  for (int h = 1; h < 16; h <<= 1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      if ((i & h) == 0) {
        const float a = v[i], b = v[i + h];
        v[i] = __fadd_rn(a, b);
        v[i + h] = __fsub_rn(a, b);
      }
    }
  }
}

__device__ __forceinline__ void scale16(float v[16], float f) {
#pragma unroll
  for (int i = 0; i < 16; ++i) v[i] = __fmul_rn(v[i], f);
}

// reference.had16 = butterflies, then * 0.25. Its own inverse.
__device__ __forceinline__ void had16(float v[16]) {
  butterflies16(v);
  scale16(v, 0.25f);
}

// max|x * 0.25| of 16 butterfly outputs u, as a bit pattern: RN is monotone, so it is
// RN(0.25 * max|u|) and one multiply does. fmaxf drops NaN, but a NaN or Inf input to the
// butterflies makes all 16 outputs non-finite, so the result is NaN or Inf exactly when it must be.
__device__ __forceinline__ uint32_t amax16_rotated(const float u[16]) {
  float m = fabsf(u[0]);
#pragma unroll
  for (int i = 1; i < 16; ++i) m = fmaxf(m, fabsf(u[i]));
  return __float_as_uint(__fmul_rn(m, 0.25f));
}

// The rotated values are v = RN(0.25 u). Where 0.125 r is normal and r < 2^121, E2M1(v * r) uses
// only y/2 = RN(|v| * r/2), which equals RN(|u| * (0.125 r)) for |u| >= 2^-124 (0.25 u exact), and
// for smaller |u| both are < 2^-6 (code 0, same sign): so the 16 multiplies by 0.25 fold into r.
// Codes only: a block error needs the rotated values themselves (the search rules scale them).
__device__ __forceinline__ bool fold_quarter(float r) {
  return r == 0.0f || (r >= 0x1p-122f && r < 0x1p121f);
}

// ------------------------------------------------------------------------------------------------
// E2M1 (reference.e2m1_encode / e2m1_decode)
// ------------------------------------------------------------------------------------------------

// reference.e2m1_encode as written there (docs/numerics.md's predicate sum); the self test compares the fast
// paths with it.
__device__ __forceinline__ uint32_t e2m1_spec(float y) {
  const float a = fabsf(y);
  const uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
  return idx | ((__float_as_uint(y) >> 28) & 8u);
}

// reference.E2M1_VALUES / e2m1_decode for a magnitude index 0..7 (the self test's table).
__device__ __forceinline__ float e2m1_value_spec(uint32_t idx) {
  const float t[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) v = idx == (uint32_t)i ? t[i] : v;
  return v;
}

#if !FP4C_HW_E2M1
// Software E2M1 magnitude (sm_90 and older), from y2 = |y| / 2. idx = R1 + R2 + R3 with
// R1 = rne(min(2a, 4)), R2 = rne(clamp(a - 2, 0, 2)), R3 = rne(clamp(a/2 - 2, 0, 1)), a = |y|. Each
// clamp is a .SAT (to [0, 1]) of an exact fp32 value; each rne is the magic add of 2^23 (ulp 1) and
// is exact with ties to even because the running sum it lands on is even whenever the new term is
// non-zero (R1 = 4 once a > 2, R1 + R2 = 6 once a > 4). This equals docs/numerics.md's predicate sum on every
// fp32 input (checked exhaustively by fp4c_e2m1_selftest). Seven FP32-pipe operations, no compares.
// The result's bits are 0x4B000000 + idx.
__device__ __forceinline__ uint32_t e2m1_mag_sw(float y2) {
  const float u1 = __saturatef(y2);
  const float t1 = __fmaf_rn(u1, 4.0f, 8388608.0f);
  const float u2 = __saturatef(__fadd_rn(y2, -1.0f));
  const float t2 = __fmaf_rn(u2, 2.0f, t1);
  const float u3 = __saturatef(__fadd_rn(y2, -2.0f));
  return __float_as_uint(__fadd_rn(t2, u3));
}

// value(E2M1(y)) for y >= 0, without the code: what a search rule needs to score a candidate (its
// codes are packed from the value, see block_err_codes). With y' = min(y, 6), let c = 2^max(0, floor(log2 y')), the
// exponent bits of max(y', 1): in c's binade (and in [0, 1), where c = 1) E2M1's grid is the
// multiples of c/2. t = RN(y' + 2^22 c) rounds y' to a multiple of ulp(2^22 c) = c/2, since
// y' + 2^22 c stays in that binade (y' <= 6 < 2^22); ties go to an even multiple because 2^22 c is
// an even one (2^23 of them), which is E2M1's tie rule (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
// 2.5 -> 2, 3.5 -> 4, 5 -> 4); the top of a binade rounds up into the next (1.9 -> 2). q = t - 2^22 c
// is exact. Six FP32-pipe operations (five without CLAMP, which the caller may drop only where
// every y < 7: there y and min(y, 6) have the same value, 6 for y in [5, 7)). The self test checks it
// against the predicate sum on all 2^32 inputs.
template <bool CLAMP>
__device__ __forceinline__ float e2m1_value_of(float y) {
  if constexpr (CLAMP) y = fminf(y, 6.0f);
  const float c = __uint_as_float(__float_as_uint(fmaxf(y, 1.0f)) & 0x7F800000u);
  const float t = __fmaf_rn(c, 4194304.0f, y);
  return __fmaf_rn(c, -4194304.0f, t);
}

// e2m1_value_of<false>'s chain in the domain scaled by S = 2^-104, ending at the packed form:
// for ys = y * S with 0 <= y < 7 (y = RN(x r), ys = RN(x (r S)): the same rounding while y >= 2^-22,
// and both give code 0 below), returns value(E2M1(y)) * 2^-126, whose bits are idx << 22 (see
// block_err_codes). cs = c S is the exponent bits of max(ys, S); t = RN(cs 2^22 + ys) is S times
// e2m1_value_of's t (all terms normal, so scaling by S commutes with rounding); t 2^-22 - cs is
// value * 2^-126 exactly, so the FMA returns it: one FP32 operation fewer than the value and then
// its packed form. CS_MIN: the lower bound of cs (S, or 2S for the MXFP4 candidate e + 1, whose
// grid in the units of e is E2M1's scaled by 2: c = max(c, 2)).
__device__ __forceinline__ float e2m1_cs(float ys) {
  return __uint_as_float(__float_as_uint(fmaxf(ys, 0x1p-104f)) & 0x7F800000u);
}
__device__ __forceinline__ float e2m1_p_from_cs(float ys, float cs) {
  const float t = __fmaf_rn(cs, 4194304.0f, ys);
  return __fmaf_rn(t, 0x1p-22f, -cs);
}
// The MXFP4 candidate e + 1 from e's cs: its c is max(c, 2) in the units of e, so with ch = max(cs, 2S)
// / 2 = max(cs / 2, S) (one integer add-and-max on the bits: cs is a normal power of 2) the same chain
// with 2^23 and 2^-23 ends at value(E2M1(y / 2)) * 2^-126, the packed form of e + 1's own code. It
// also takes the unmasked m = max(ys, S) of e2m1_p_unmasked for cs (halving m is exact), with that
// chain's exceptions at y / 2 (benchmarks/device/check_sm90_numerics.cpp).
__device__ __forceinline__ float e2m1_p_half_from_cs(float ys, float cs) {
  const float ch = __int_as_float(max(__float_as_int(cs) - 0x00800000, __float_as_int(0x1p-104f)));
  const float t = __fmaf_rn(ch, 8388608.0f, ys);
  return __fmaf_rn(t, 0x1p-23f, -ch);
}

// The packing step of block_err_codes: code word w += p's bits (idx << 22) moved to nibble i % 8.
__device__ __forceinline__ void pack_idx22(uint32_t* codes, int i, float p) {
  const uint32_t b = __float_as_uint(p);
  const int j = 4 * (i % 8);
  codes[i / 8] += j <= 22 ? b >> (22 - j) : b << (j - 22);
}

// The same chain with m = max(ys, S) itself in place of its exponent bits cs (one instruction fewer):
// t = RN(m 2^22 + ys) still rounds ys to the grid of m's binade (m 2^22 is a multiple of its half
// step; a tie y has a short significand, so m = y or S is even there), except where m 2^22 + ys
// overflows into the next binade: exactly y in E2M1_UNMASKED_BAD (benchmarks/device/check_sm90_numerics.cpp
// enumerates every y in [0, 7)). nvfp4_unmasked_safe tells the candidates that no input can hit.
__device__ __forceinline__ float e2m1_p_unmasked(float ys) {
  const float m = fmaxf(ys, 0x1p-104f);
  const float t = __fmaf_rn(m, 4194304.0f, ys);
  return __fmaf_rn(t, 0x1p-22f, -m);
}
// Whether no input value x of bf16 (BF16) or fp16 gives RN(x r) in E2M1_UNMASKED_BAD (the four y in
// [0, 7) where e2m1_p_unmasked differs: 2 - 3 * 2^-23, 2 - 2^-23, 4 - 3 * 2^-22, 4 - 2^-22), for the
// NVFP4 candidate (r, d) = nvfp4_candidate(gs, byte). RN(x r) = Y needs x within ~2^-24 (relative) of
// Y / r, and values of DT are >= 2^-11 apart (relative), so only the one nearest Y / r can; Y d is
// within ~3 * 2^-24 of Y / r (r and d are RN of reciprocal quotients), so that one is RN_DT(Y d), and
// the test of it is exact. Bytes with r >= 2^100 or d < 2^-100 (where r may be clamped or d inexact)
// are reported unsafe.
template <bool BF16>
__device__ __forceinline__ bool nvfp4_unmasked_safe(float r, float d) {
  if (!(r < 0x1p100f && d >= 0x1p-100f)) return r == 0.0f;
  constexpr float E2M1_UNMASKED_BAD[4] = {0x1.fffffap+0f, 0x1.fffffep+0f, 0x1.fffffap+1f, 0x1.fffffep+1f};
  bool safe = true;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float y = E2M1_UNMASKED_BAD[k];
    const float z = __fmul_rn(y, d);
    float x;
    if constexpr (BF16) x = __bfloat162float(__float2bfloat16_rn(z));
    else x = __half2float(__float2half_rn(z));
    safe &= __fmul_rn(x, r) != y;
  }
  return safe;
}

// block_err_codes<N, false, WEIGHTED> (same error bits, same codes without signs) on the scaled
// chain above, for a candidate whose every y = RN(x_i r) is below 7 (any y with CLAMP6), with rs = r * 2^-104 and
// dd = d * 2^126 both exact (nvfp4_fast_ok): value * d = p * dd exactly, so RN(value * d) is one
// multiply of p. IW: c holds the N input weights. MASKED: the exponent-bits chain; !MASKED: the
// unmasked one, only where nvfp4_unmasked_safe holds for the input's type. 10 instructions per
// element (9 unmasked; one more each weighted).
template <int N, bool WEIGHTED, bool IW, bool MASKED = true, bool CLAMP6 = false>
__device__ __forceinline__ float block_err_codes_scaled(const float* v, float rs, float dd, uint32_t* codes,
                                                        const float* c) {
  float err = 0.0f;
#pragma unroll
  for (int w = 0; w < N / 8; ++w) codes[w] = 0u;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float a = fabsf(v[i]);
    // CLAMP6: y = min(y, 6) first (E2M1(y) = 6 for every y >= 5, and min(y, 6) differs from y only above
    // 6), so any y, however large, stays on the chain's domain; the error still uses x itself
    const float ys = CLAMP6 ? fminf(__fmul_rn(a, rs), 0x1.8p-102f) : __fmul_rn(a, rs);
    const float p = MASKED ? e2m1_p_from_cs(ys, e2m1_cs(ys)) : e2m1_p_unmasked(ys);
    pack_idx22(codes, i, p);
    float e = __fsub_rn(__fmul_rn(p, dd), a);
    if constexpr (WEIGHTED) e = __fmul_rn(e, a);
    float sq = __fmul_rn(e, e);
    if constexpr (IW) sq = __fmul_rn(sq, c[i]);
    err = i == 0 ? sq : __fadd_rn(err, sq);
  }
  return err;
}

// When block_err_codes_scaled gives block_err_codes' result for the NVFP4 candidate (r, d) =
// nvfp4_candidate(gs, byte) of a block with max bmax: every RN(x r) < 7 (RN is monotone: RN(bmax r) <
// 7), d * 2^126 finite (d < 4) and r * 2^-104 exact (r == 0 or r >= 2^-22), which d < 4 implies: d =
// RN(sf / gs) < 4 means sf / gs < 4, so r = RN(gs / sf) >= 0.25 (or sf = 0 and r = d = 0). Real
// weights always qualify; a block that does not takes the general clamped path.
__device__ __forceinline__ bool nvfp4_fast_ok(float bmax, float r, float d) {
  return __fmul_rn(bmax, r) < 7.0f && d < 4.0f;
}
#endif

// Sign bits of eight fp32 values as E2M1 sign bits (bit 3 of nibble i), from their bit patterns:
// replicate each sign into a byte (prmt sign mode), odd elements in H, even in L, then interleave
// nibbles and keep bit 3 of each.
__device__ __forceinline__ uint32_t e2m1_signs8(const float* v) {
  const uint32_t* b = reinterpret_cast<const uint32_t*>(v);
  const uint32_t l = prmt(prmt(b[0], b[2], 0xFBu), prmt(b[4], b[6], 0xFBu), 0x5410u);
  const uint32_t hh = prmt(prmt(b[1], b[3], 0xFBu), prmt(b[5], b[7], 0xFBu), 0x5410u);
  const uint32_t s = (hh & 0xF0F0F0F0u) | (l & 0x0F0F0F0Fu);
  return s & 0x88888888u;
}

#if FP4C_HW_E2M1
// Four fp32 pairs -> one u32 of eight codes (element 2j in the low nibble of byte j).
__device__ __forceinline__ uint32_t e2m1x8_hw(const float y[8]) {
  uint32_t r;
  asm("{\n"
      ".reg .b8 b0, b1, b2, b3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n"
      "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n"
      "mov.b32 %0, {b0, b1, b2, b3};\n"
      "}"
      : "=r"(r)
      : "f"(y[0]), "f"(y[1]), "f"(y[2]), "f"(y[3]), "f"(y[4]), "f"(y[5]), "f"(y[6]), "f"(y[7]));
  return r;
}

// Two codes (one byte, element 0 in the low nibble) -> their values, exact (every E2M1 value is an
// fp16 value): the hardware decode.
__device__ __forceinline__ float2 e2m1x2_values_hw(uint32_t byte) {
  uint32_t h2;
  asm("{\n"
      ".reg .b8 b0, b1, b2, b3;\n"
      "mov.b32 {b0, b1, b2, b3}, %1;\n"
      "cvt.rn.f16x2.e2m1x2 %0, b0;\n"
      "}"
      : "=r"(h2)
      : "r"(byte));
  return __half22float2(*reinterpret_cast<const __half2*>(&h2));
}
#endif

// reference.e2m1_encode(v * r) for eight values v and the block multiplier r -> eight packed codes.
// The code's sign is the sign bit of y = v * r, which is v's because r >= 0.
__device__ __forceinline__ uint32_t encode8(const float* v, float r) {
#if FP4C_HW_E2M1
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(v[i], r);
  return e2m1x8_hw(y);
#else
  // y2 = |v| * (r/2) = |y| / 2 exactly (r/2 is exact; an underflowed y2 only occurs where every
  // term is 0 anyway).
  const float h = __fmul_rn(r, 0.5f);
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc += e2m1_mag_sw(__fmul_rn(fabsf(v[i]), h)) << (4 * i);
  acc -= 0xFB000000u;  // the 0x4B000000 of elements 0 and 1 that survived the shifts
  return acc | e2m1_signs8(v);
#endif
}

// docs/numerics.md "Scale rules", the block error of one candidate (multiplier r, step d) over N values, in element
// order: e = value(E2M1(x_i * r)) * d - x_i; err = err + e * e (each a separate fp32 operation);
// also the candidate's packed codes (eight per word, element 0 in the low nibble), so the winner
// needs no second encode. CLAMP: see e2m1_value_of (the hardware conversion saturates by itself).
//   Software path: magnitudes only (value(code) carries x's sign, so e = +-(value * d - |x|) and
// e * e is the same), and the codes without their signs (search_signs8 adds them): q * 2^-126 puts
// value 1 at the smallest normal, so its bits are exactly idx << 22 for every E2M1 value q (0.5 is
// the subnormal 2^-127 = 1 << 22, 6 is 1.5 * 2^-124 = 7 << 22): one multiply and one shift-add.
//   Hardware path: the cvt's codes (signs included), decoded back by the hardware (exact).
//   WEIGHTED (the wmse rules): e = e * x_i before squaring, one more fp32 multiply; on the software
// path e * |x| = +-(e * x) exactly, so the square is the reference's.
//   c (input_weight, may be null): the input channel's weight of each element, sq = (e * e) * c_i
// before the sum (reference.block_error's input_weight); null is the unweighted error.
template <int N, bool CLAMP, bool WEIGHTED = false>
__device__ __forceinline__ float block_err_codes(const float* v, float r, float d, uint32_t* codes,
                                                 const float* c = nullptr) {
  float err = 0.0f;
#if FP4C_HW_E2M1
#pragma unroll
  for (int j = 0; j < N; j += 8) {
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = __fmul_rn(v[j + i], r);
    codes[j / 8] = e2m1x8_hw(y);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 q = e2m1x2_values_hw(codes[j / 8] >> (8 * i));
      float e0 = __fsub_rn(__fmul_rn(q.x, d), v[j + 2 * i]);
      if constexpr (WEIGHTED) e0 = __fmul_rn(e0, v[j + 2 * i]);
      float s0 = __fmul_rn(e0, e0);
      if (c) s0 = __fmul_rn(s0, c[j + 2 * i]);
      err = __fadd_rn(err, s0);
      float e1 = __fsub_rn(__fmul_rn(q.y, d), v[j + 2 * i + 1]);
      if constexpr (WEIGHTED) e1 = __fmul_rn(e1, v[j + 2 * i + 1]);
      float s1 = __fmul_rn(e1, e1);
      if (c) s1 = __fmul_rn(s1, c[j + 2 * i + 1]);
      err = __fadd_rn(err, s1);
    }
  }
#else
#pragma unroll
  for (int w = 0; w < N / 8; ++w) codes[w] = 0u;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float a = fabsf(v[i]);
    const float q = e2m1_value_of<CLAMP>(__fmul_rn(a, r));
    const uint32_t idx22 = __float_as_uint(__fmul_rn(q, 0x1p-126f));
    const int j = 4 * (i % 8);
    codes[i / 8] += j <= 22 ? idx22 >> (22 - j) : idx22 << (j - 22);
    float e = __fsub_rn(__fmul_rn(q, d), a);
    if constexpr (WEIGHTED) e = __fmul_rn(e, a);
    float sq = __fmul_rn(e, e);
    if (c) sq = __fmul_rn(sq, c[i]);
    err = i == 0 ? sq : __fadd_rn(err, sq);  // 0 + sq is sq exactly (sq >= 0 or NaN)
  }
#endif
  return err;
}

// e2m1_signs8 of eight bf16 elements from their four raw words (element 2j in the low half of w[j]):
// sign-replicated bytes of two words per prmt, then the even and odd elements gathered, ored into
// codes under their masks: six instructions per eight elements (e2m1_signs8 on the fp32 values: eight).
__device__ __forceinline__ uint32_t or_signs8_bf16(uint32_t codes, const uint32_t* w) {
  const uint32_t a = prmt(w[0], w[1], 0xFDB9u), b = prmt(w[2], w[3], 0xFDB9u);
  return (codes | (prmt(a, b, 0x7531u) & 0x80808080u)) | (prmt(a, b, 0x6420u) & 0x08080808u);
}

// The sign bits to or into block_err_codes' codes: none on the hardware path (its codes carry them).
__device__ __forceinline__ uint32_t search_signs8(const float* v) {
#if FP4C_HW_E2M1
  (void)v;
  return 0u;
#else
  return e2m1_signs8(v);
#endif
}

// search_signs8 ored into codes: the precomputed sign word *sg when given (see signs8_raw), else from
// the fp32 values v.
__device__ __forceinline__ uint32_t or_search_signs8(uint32_t codes, const float* v, const uint32_t* sg) {
#if FP4C_HW_E2M1
  (void)v;
  (void)sg;
  return codes;
#else
  return sg ? codes | *sg : codes | e2m1_signs8(v);
#endif
}

// search_signs8 of eight bf16 elements from their raw words, taken where the words are loaded so that
// only the sign word stays live through the candidates (or_search_signs8 ors it in).
__device__ __forceinline__ uint32_t signs8_raw(const uint32_t* w) {
#if FP4C_HW_E2M1
  (void)w;
  return 0u;
#else
  return or_signs8_bf16(0u, w);
#endif
}

// ------------------------------------------------------------------------------------------------
// Scale-rule block steps (docs/numerics.md "Scale rules"). v: the block's values after the rotation (exact v, not the
// folded u); bmax_bits: max|v| as a bit pattern. Each candidate is scored, and its codes packed, by
// block_err_codes; the winner's codes are kept. Out: the packed codes and the chosen scale byte.
// ------------------------------------------------------------------------------------------------

// NVFP4 candidate multipliers and steps per E4M3 byte for the matrix's gs, (r, d) =
// (sf > 0 ? min(gs / sf, FLT_MAX) : 0, sf / gs): a search kernel fills a shared table of these once
// per matrix (the same IEEE divisions, done once instead of twice per candidate and block).
__device__ __forceinline__ float2 nvfp4_candidate(float gs, uint32_t byte) {
  const float sf = f32_from_e4m3(byte);
  return make_float2(sf > 0.0f ? fminf(__fdiv_rn(gs, sf), FLT_MAX) : 0.0f, __fdiv_rn(sf, gs));
}

#if !FP4C_HW_E2M1
// block_err_codes_scaled for the NVFP4 candidate (r, d) = k: rs = r * 2^-104, dd = d * 2^126 (exact where
// the caller's test holds), the unmasked chain where UM.
template <bool W, bool IW, bool UM, bool CLAMP6 = false>
__device__ __forceinline__ float nvfp4_scaled_err(const float v[16], float2 k, uint32_t cw[2], const float* c) {
  return block_err_codes_scaled<16, W, IW, !UM, CLAMP6>(v, __fmul_rn(k.x, 0x1p-104f), __fmul_rn(k.y, 0x1p126f), cw, c);
}
#endif

// One NVFP4 candidate (r, d) = k of a block with max bmax: its block error and codes (no signs), on
// the scaled software path where nvfp4_fast_ok allows, else block_err_codes with the clamp.
// UM: the unmasked chain (one instruction fewer per element), only where nvfp4_unmasked_safe holds for
// every byte of the matrix's table and the kernel's input type (fill_candidates decides per matrix, so a
// warp never runs both chains: per byte, a global scale whose table has an unsafe class, one byte in
// eight, would split nearly every warp).
// CLAMP6: the scaled chain clamps y at 6 itself, so only d < 4 is asked of the candidate (the b6 - 1
// candidate of mse / wmse, whose products reach 7 on many blocks: without it those blocks would take the
// general path and split their warps).
template <bool W, bool IW, bool UM = false, bool CLAMP6 = false>
__device__ __forceinline__ float nvfp4_candidate_err(const float v[16], float bmax, float2 k, uint32_t cw[2],
                                                     const float* c) {
#if FP4C_HW_E2M1
  (void)bmax;
  return block_err_codes<16, true, W>(v, k.x, k.y, cw, IW ? c : nullptr);
#else
  if (CLAMP6 ? k.y < 4.0f && bmax <= FLT_MAX : nvfp4_fast_ok(bmax, k.x, k.y))  // (a NaN / Inf block: general)
    return nvfp4_scaled_err<W, IW, UM, CLAMP6>(v, k, cw, c);
  return block_err_codes<16, true, W>(v, k.x, k.y, cw, IW ? c : nullptr);
#endif
}

// The two candidates b6 and b4 of one block, in one branch where both take the scaled chain (the common
// case), so that their chains share a basic block and interleave.
template <bool W, bool IW, bool UM>
__device__ __forceinline__ void nvfp4_candidates_64(const float v[16], float bmax, float2 k6, float2 k4,
                                                    uint32_t c6[2], uint32_t c4[2], float& err6, float& err4,
                                                    const float* c) {
#if !FP4C_HW_E2M1
  if (nvfp4_fast_ok(bmax, k6.x, k6.y) && nvfp4_fast_ok(bmax, k4.x, k4.y)) {
    err6 = nvfp4_scaled_err<W, IW, UM>(v, k6, c6, c);
    err4 = nvfp4_scaled_err<W, IW, UM>(v, k4, c4, c);
    return;
  }
#endif
  err6 = nvfp4_candidate_err<W, IW, UM>(v, bmax, k6, c6, c);
  err4 = nvfp4_candidate_err<W, IW, UM>(v, bmax, k4, c4, c);
}

// nvfp4_block_search with the input weight's presence known at compile time (IW: c is the block's 16
// weights; !IW: c is ignored), so the unweighted path carries no per-element weight test.
// sg (may be null): the block's two sign words (signs8_raw), else the signs come from v.
template <int RULE, bool IW, bool UM = false>
__device__ __forceinline__ void nvfp4_block_search_iw(const float v[16], float gs, uint32_t bmax_bits,
                                                      const float2* rd, uint32_t codes[2], uint32_t& byte,
                                                      const float* c, const uint32_t* sg = nullptr) {
  const float bmax = __uint_as_float(bmax_bits);
  const float gb = fminf(__fmul_rn(gs, bmax), FLT_MAX);  // inf / 6 and FLT_MAX / 6 both saturate to 448
  const uint32_t b6 = e4m3_from_f32_x2(div6_rn(gb));
  const uint32_t b4 = e4m3_from_f32_x2(__fmul_rn(gb, 0.25f));
  const float2 k6 = rd[b6], k4 = rd[b4];
  constexpr bool W = RULE == RULE_WMSE;
  uint32_t c6[2], c4[2];
  float err6, err4;
  nvfp4_candidates_64<W, IW, UM>(v, bmax, k6, k4, c6, c4, err6, err4, c);
  uint32_t best = b6, k0 = c6[0], k1 = c6[1];
  if constexpr (RULE == RULE_MSE || RULE == RULE_WMSE) {
    float best_err = err6;
    if (err4 <= best_err) best = b4, k0 = c4[0], k1 = c4[1], best_err = err4;  // a tie: the larger byte
    const uint32_t bm = b6 > 0u ? b6 - 1u : 0u;
    uint32_t cm[2];
    const float errm = nvfp4_candidate_err<W, IW, UM, true>(v, bmax, rd[bm], cm, c);
    if (errm < best_err || (errm == best_err && bm > best)) best = bm, k0 = cm[0], k1 = cm[1];
  } else {
    if (err4 < err6) best = b4, k0 = c4[0], k1 = c4[1];  // ties keep the /6 scale
  }
  codes[0] = or_search_signs8(k0, v, sg);
  codes[1] = or_search_signs8(k1, v + 8, sg ? sg + 1 : nullptr);
  byte = best;
}

// NVFP4 4over6 / mse / wmse for one block of 16; rd: the (r, d) table above. 4over6: b6 unless b4
// has a strictly lower error. mse: the lowest error among {b6, b4, b6 - 1} (b6 - 1 of byte 0 is 0),
// ties to the larger byte; wmse: the same with the weighted error.
// c: the block's 16 input-channel weights (input_weight), or null.
//   b6 = E4M3(RN(RN(gs * bmax) / 6)) with gs * bmax clamped to FLT_MAX first (the same byte: the
// quotient of inf and of FLT_MAX both saturate at 448); each candidate as nvfp4_candidate_err.
template <int RULE>
__device__ __forceinline__ void nvfp4_block_search(const float v[16], float gs, uint32_t bmax_bits,
                                                   const float2* rd, uint32_t codes[2], uint32_t& byte,
                                                   const float* c = nullptr) {
  if (c) nvfp4_block_search_iw<RULE, true>(v, gs, bmax_bits, rd, codes, byte, c);
  else nvfp4_block_search_iw<RULE, false>(v, gs, bmax_bits, rd, codes, byte, nullptr);
}

// mxfp4_block_mse with the input weight's presence known at compile time (see nvfp4_block_search_iw);
// sg (may be null): the block's four sign words (signs8_raw).
// SHORT: every input has at most 11 significant bits (bf16 or fp16, unrotated), so y = x 2^(127 - e)
// has too, and never is one of the unmasked chain's exceptions (24-bit significands: 2 - 3 * 2^-23 and
// the like, at y and at y / 2): both chains may then start from m = max(ys, S) unmasked.
//   Software path, e <= 127 (block max below 8): both candidates from one product per element.
// r and d are powers of 2, so y = x * 2^(127 - e) is exact (or below 2^-22, where both codes are 0),
// value * d is exact and e_i = RN(value * d - x) is one FMA (p * d * 2^126, d * 2^126 finite for e <=
// 127). Candidate e + 1 scores y / 2, whose E2M1 grid in the units of e is E2M1's with c = max(c, 2):
// its chain reuses e's cs (e2m1_p_half_from_cs). The clamp at 6 of e is a min on its packed value
// (the grid rounding is monotone, and y < 8). The general path (larger blocks, and the hardware
// targets) scores each candidate with block_err_codes.
template <bool W, bool IW, bool SHORT = false>
__device__ __forceinline__ void mxfp4_block_mse_iw(const float v[32], uint32_t bmax_bits, uint32_t codes[4],
                                                   uint32_t& byte, const float* c, const uint32_t* sg = nullptr) {
  uint32_t e;
  const float r0 = mxfp4_scale(bmax_bits, e);
#if !FP4C_HW_E2M1
  if (e <= 127u) {
    const float rs = pow2i(23 - (int)e);  // r * 2^-104
    const float dd = pow2i((int)e - 1);   // d * 2^126 (e + 1: 2 dd)
    float err0 = 0.0f, err1 = 0.0f;
    uint32_t k0[4] = {0u, 0u, 0u, 0u}, k1[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const float a = fabsf(v[i]);
      const float ys = __fmul_rn(a, rs);
      const float cs0 = SHORT ? fmaxf(ys, 0x1p-104f) : e2m1_cs(ys);
      const float p0 = fminf(e2m1_p_from_cs(ys, cs0), 0x1.8p-124f);  // value <= 6
      const float p1 = e2m1_p_half_from_cs(ys, cs0);                 // e + 1's value, <= 4
      pack_idx22(k0, i, p0);
      pack_idx22(k1, i, p1);
      float e0 = __fmaf_rn(p0, dd, -a);
      float e1 = __fmaf_rn(p1, __fmul_rn(dd, 2.0f), -a);
      if constexpr (W) {
        e0 = __fmul_rn(e0, a);
        e1 = __fmul_rn(e1, a);
      }
      float s0 = __fmul_rn(e0, e0), s1 = __fmul_rn(e1, e1);
      if constexpr (IW) {
        s0 = __fmul_rn(s0, c[i]);
        s1 = __fmul_rn(s1, c[i]);
      }
      err0 = i == 0 ? s0 : __fadd_rn(err0, s0);
      err1 = i == 0 ? s1 : __fadd_rn(err1, s1);
    }
    const bool up = err1 < err0;
#pragma unroll
    for (int w = 0; w < 4; ++w) codes[w] = or_search_signs8(up ? k1[w] : k0[w], v + 8 * w, sg ? sg + w : nullptr);
    byte = up ? e + 1u : e;
    return;
  }
#endif
  const uint32_t e1 = min(e + 1u, 254u);
  const float r1 = pow2i(127 - (int)e1);
  const float* cw = IW ? c : nullptr;
  uint32_t k0[4], k1[4];
  const float err0 = block_err_codes<32, true, W>(v, r0, pow2i((int)e - 127), k0, cw);
  // e + 1 keeps every value below 4 (bmax * 2^(127 - e) < 8); e == 254 has no e + 1 (same candidate:
  // kept, whatever its unclamped score; scored anyway, so the common path has no branch around it)
  const float err1 = block_err_codes<32, false, W>(v, r1, pow2i((int)e1 - 127), k1, cw);
  const bool up = e1 != e && err1 < err0;
#pragma unroll
  for (int w = 0; w < 4; ++w) codes[w] = or_search_signs8(up ? k1[w] : k0[w], v + 8 * w, sg ? sg + w : nullptr);
  byte = up ? e1 : e;
}

// MXFP4 mse (wmse: W, the weighted error) for one block of 32: e (floor) against min(e + 1, 254),
// ties to e. With e + 1 the values stay below 4 (bmax * 2^(127 - e) < 8), so only e's error clamps.
template <bool W>
__device__ __forceinline__ void mxfp4_block_mse(const float v[32], uint32_t bmax_bits, uint32_t codes[4],
                                                uint32_t& byte, const float* c = nullptr) {
  if (c) mxfp4_block_mse_iw<W, true>(v, bmax_bits, codes, byte, c);
  else mxfp4_block_mse_iw<W, false>(v, bmax_bits, codes, byte, nullptr);
}

}  // namespace fp4c
