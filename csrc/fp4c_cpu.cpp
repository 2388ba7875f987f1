// fp4convert's CPU kernel: fp4convert/reference.py (docs/numerics.md) in plain C++, vectorised by the
// compiler and threaded inside, bit for bit with the reference.
//
// Plain C ABI (no torch headers): fp4convert/cpu_kernel.py builds this file with the C++ compiler on
// first use and calls it through ctypes on raw pointers (ctypes releases the GIL for the call).
//
// Numerics. Every fp32 step is one IEEE operation rounded to nearest even, in the reference's order:
// the build uses -O3 -fno-fast-math -ffp-contract=off (no FMA contraction, no reassociation, true
// divisions), and each worker thread sets the SSE control register to IEEE (no flush-to-zero, no
// denormals-are-zero, round to nearest) for the duration of the call, so a caller's FTZ/DAZ setting
// cannot change a byte. The vectoriser only widens element-wise operations: nothing here is a
// floating-point reduction across vector lanes (the block error is summed in element order within
// each lane, and maxima are taken on integer bit patterns).
//
// Layout. A *tile* is L consecutive blocks of one matrix, transposed: v[i][lane] is element i of
// block `lane`. Every per-block quantity (block max, scale byte, multiplier, error) is then one lane
// of a vector, and each per-element step is a vector operation across L blocks: the block error's
// element-order sum becomes L independent sums computed side by side.
//
// Vector width. The library must run on any x86-64 machine the cache is shared with, so the hot
// functions are compiled three times (GCC function multiversioning, target_clones): x86-64-v4
// (AVX-512), x86-64-v3 (AVX2) and the x86-64 baseline (SSE2); the dynamic loader picks one clone per
// process from the CPU it runs on. The scale rules and the encode are written as explicit vectors of
// the target's width instead (16, 8 or 4 lanes, one set per level, picked once at load: see "explicit
// vectors" below). All compute the same IEEE operations, so the bytes never depend on the clone or the
// width. Elsewhere (aarch64: NEON is baseline) one plain build.
//
// Subnormals. The kernel runs with FTZ/DAZ off (exact bytes need them), and Intel CPUs take a microcode
// assist (~100 cycles) on each operation that makes or reads a subnormal; the hot loops make none on
// ordinary weights (the E2M1 index comes from integer operations, not from a multiply into the
// subnormal range: that one multiply per element held the search rules to 0.24 GB/s per thread on a
// Xeon, benchmarks in BENCHMARKS.md "Issue 33").
//
// Scale rules. Each rule is one `choose_*` function (a tile's scale bytes and element multipliers)
// plus one line in rule_table(); the rule codes are fp4convert.reference.SCALE_RULES' order, as the
// CUDA launchers'. Rules the table lacks make fp4c_cpu_has_rule return 0, and the Python side keeps
// the torch path for them.

#include <stdint.h>
#include <string.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FP4C_X86 1
#else
#define FP4C_X86 0
#endif

#if FP4C_X86 && defined(__GNUC__) && !defined(__clang__) && !defined(FP4C_NO_CLONES)
#define FP4C_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FP4C_CLONES
#endif
#define FP4C_INLINE inline __attribute__((always_inline))

#define FP4C_CPU_ABI 3

namespace {

// ------------------------------------------------------------------------------------------------
// Codes shared with fp4convert/cpu_kernel.py
// ------------------------------------------------------------------------------------------------

enum Dtype : int { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum Scheme : int { NVFP4 = 0, MXFP4 = 1 };
enum Status : int { OK = 0, BAD_ARGUMENT = 1, UNKNOWN_RULE = 2, NEGATIVE_SCALE = 3, NONFINITE = 4 };

constexpr int L = 16;                       // blocks per tile (one AVX-512 vector, two AVX2 vectors)
constexpr int64_t JOB_ELEMS = int64_t(1) << 16;  // elements per unit of work a thread takes at a time
constexpr float FLT_MAX_F = 3.40282346638528859812e+38f;

template <class To, class From>
FP4C_INLINE To bits_as(From x) {
  return __builtin_bit_cast(To, x);
}

// ------------------------------------------------------------------------------------------------
// Scalar building blocks, each named after the reference function it mirrors
// ------------------------------------------------------------------------------------------------

// reference.pow2_f32 for k in [-127, 127] (exact, from bits; 2^-127 is the subnormal 1 << 22).
FP4C_INLINE float pow2i(int k) {
  return k >= -126 ? bits_as<float>(uint32_t(k + 127) << 23) : bits_as<float>(uint32_t(0x00400000u));
}

// reference.e4m3_encode after cpu.py's nan_to_num(nan=0): clamp to 448, then 3 mantissa bits with
// ties to even; below 2^-6 round(s * 2^9) to an integer, ties to even (the add of 2^23 rounds it).
FP4C_INLINE uint32_t e4m3_encode(float s) {
  s = s != s ? 0.0f : s;
  s = s > 448.0f ? 448.0f : s;
  const uint32_t b = bits_as<uint32_t>(s);
  const int exp = int((b >> 23) & 0xFFu);
  const uint32_t keep = (b & 0x7FFFFFu) >> 20, rest = b & 0xFFFFFu;
  const uint32_t up = (rest > 0x80000u) | ((rest == 0x80000u) & (keep & 1u));
  const uint32_t normal = ((uint32_t(exp - 120) << 3) | keep) + up;  // exp - 127 + 7; a carry bumps the exponent
  const float t = s * 512.0f;                                            // exact (a power of two)
  const uint32_t sub = uint32_t(int((t + 8388608.0f) - 8388608.0f));  // rne(t) for 0 <= t < 2^22
  const uint32_t code = exp >= 121 ? normal : sub;
  return code > 0x7Eu ? 0x7Eu : code;
}

// reference.e4m3_decode for bytes 0..0x7E (exact).
FP4C_INLINE float e4m3_decode(uint32_t c) {
  const int e = int((c >> 3) & 0xFu), m = int(c & 7u);
  return e == 0 ? float(m) * 0x1p-9f : float(8 + m) * pow2i(e - 10);
}

// |value(E2M1(y))| for y >= 0 (not NaN): with y' = min(y, 6) and c = 2^max(0, floor(log2 y')) (the
// exponent bits of max(y', 1)), E2M1's grid in c's binade (and in [0, 1), where c = 1) is the
// multiples of c / 2; y' + 2^22 c rounds y' to such a multiple, ties to even (2^22 c is an even
// multiple), which is the predicate sum's rounding (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
// 2.5 -> 2, 3.5 -> 4, 5 -> 4, 1.9 -> 2); the product and the subtraction are exact. Checked against
// the predicate sum on every fp32 input by fp4c_cpu_e2m1_selftest.
FP4C_INLINE float e2m1_value(float y) {
  y = y > 6.0f ? 6.0f : y;
  const float big = y > 1.0f ? y : 1.0f;
  const float c = bits_as<float>(bits_as<uint32_t>(big) & 0x7F800000u) * 4194304.0f;
  return (y + c) - c;
}

// The E2M1 magnitude index of a value q of the grid: q * 2^-126 puts 1 at the smallest normal, so
// its bits are idx << 22 for every grid value (0.5 -> 2^-127 = 1 << 22, 6 -> 1.5 * 2^-124 = 7 << 22).
FP4C_INLINE uint32_t e2m1_index(float q) { return bits_as<uint32_t>(q * 0x1p-126f) >> 22; }

// reference.e2m1_encode as written there (the predicate sum): the self test's yardstick.
FP4C_INLINE uint32_t e2m1_spec(float y) {
  const float a = __builtin_fabsf(y);
  const uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                       (a > 5.0f);
  return idx | ((bits_as<uint32_t>(y) >> 28) & 8u);
}

// Input widening (exact): bf16 is the top half of an fp32; fp16 through the exponent rebias
// 2^112 (exact for normals and subnormals), Inf/NaN kept.
FP4C_INLINE float widen_bf16(uint16_t h) { return bits_as<float>(uint32_t(h) << 16); }
FP4C_INLINE float widen_f16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, em = h & 0x7FFFu;
  const uint32_t fin = bits_as<uint32_t>(bits_as<float>(em << 13) * 0x1p112f);
  return bits_as<float>((em >= 0x7C00u ? ((em << 13) | 0x7F800000u) : fin) | sign);
}
FP4C_INLINE uint32_t f16_abs_bits_to_f32_bits(uint32_t em) { return bits_as<uint32_t>(widen_f16(uint16_t(em))); }

// ------------------------------------------------------------------------------------------------
// Tiles
// ------------------------------------------------------------------------------------------------

template <int BS>
struct Tile {
  alignas(64) float v[BS][L];  // element i of block `lane` (after widening and rotation)
  alignas(64) uint32_t bmax[L];  // max |v| per block as a bit pattern (NaN > Inf > any finite value)
};

// Widen n <= L consecutive blocks starting at x (blocks of BS elements) into the tile; lanes >= n
// are zero (computed, never stored).
template <int BS, class T, float (*WIDEN)(T)>
FP4C_INLINE void load_as(Tile<BS>& t, const T* x, int n) {
  if (n == L) {
    for (int lane = 0; lane < L; ++lane)
      for (int i = 0; i < BS; ++i) t.v[i][lane] = WIDEN(x[lane * BS + i]);
  } else {
    for (int lane = 0; lane < L; ++lane)
      for (int i = 0; i < BS; ++i) t.v[i][lane] = lane < n ? WIDEN(x[lane * BS + i]) : 0.0f;
  }
}

FP4C_INLINE float widen_f32(float x) { return x; }

template <int BS>
FP4C_INLINE void load(Tile<BS>& t, const void* x, int dtype, int64_t block0, int n) {
  const int64_t off = block0 * BS;
  if (dtype == DT_BF16)
    load_as<BS, uint16_t, widen_bf16>(t, static_cast<const uint16_t*>(x) + off, n);
  else if (dtype == DT_F16)
    load_as<BS, uint16_t, widen_f16>(t, static_cast<const uint16_t*>(x) + off, n);
  else
    load_as<BS, float, widen_f32>(t, static_cast<const float*>(x) + off, n);
}

// reference.had16 on every run of 16 elements: butterflies h = 1, 2, 4, 8 (a + b, a - b), then * 0.25.
template <int BS>
FP4C_INLINE void had16(Tile<BS>& t) {
  for (int g = 0; g < BS; g += 16) {
    for (int h = 1; h < 16; h <<= 1) {
      for (int j = g; j < g + 16; j += 2 * h) {
        for (int o = 0; o < h; ++o) {
          float* a = t.v[j + o];
          float* b = t.v[j + o + h];
          for (int lane = 0; lane < L; ++lane) {
            const float x = a[lane], y = b[lane];
            a[lane] = x + y;
            b[lane] = x - y;
          }
        }
      }
    }
  }
  for (int i = 0; i < BS; ++i)
    for (int lane = 0; lane < L; ++lane) t.v[i][lane] = t.v[i][lane] * 0.25f;
}

// bmax per block: the maximum of |v| taken on the bit patterns (monotone for non-negative floats,
// and NaN patterns sort above Inf, so a non-finite block shows as bmax >= 0x7F800000).
template <int BS>
FP4C_INLINE void block_max(Tile<BS>& t) {
  for (int lane = 0; lane < L; ++lane) t.bmax[lane] = 0u;
  for (int i = 0; i < BS; ++i)
    for (int lane = 0; lane < L; ++lane) {
      const uint32_t a = bits_as<uint32_t>(t.v[i][lane]) & 0x7FFFFFFFu;
      t.bmax[lane] = a > t.bmax[lane] ? a : t.bmax[lane];
    }
}

// reference.block_error for each lane's candidate (multiplier r, step d): e = value(code_i) * d - x_i
// (weighted: e = e * x_i), err = err + e * e, elements in order. On magnitudes: value(code) carries
// x's sign and IEEE rounding is symmetric, so e (and e * x) only change sign; 0 + e_0^2 is e_0^2.
template <int BS, bool WEIGHTED>
FP4C_INLINE float error_term(float v, float r, float d) {
  const float a = __builtin_fabsf(v);
  const float q = e2m1_value(a * r);
  float e = q * d - a;
  if (WEIGHTED) e = e * a;
  return e * e;
}

// With input weights c (element i's weight, the same for every lane; GPTQ's sweep): the reference's
// sq = (e * e) * c_i, summed alike (0 + sq is sq: sq is +0, positive or NaN).
template <int BS, bool WEIGHTED>
FP4C_INLINE void block_error(const Tile<BS>& t, const float* r, const float* d, const float* c, float* err) {
  if (c == nullptr) {
    for (int lane = 0; lane < L; ++lane) err[lane] = error_term<BS, WEIGHTED>(t.v[0][lane], r[lane], d[lane]);
    for (int i = 1; i < BS; ++i)  // (a forced full unroll here was slower and tripled the build time)
      for (int lane = 0; lane < L; ++lane) err[lane] = err[lane] + error_term<BS, WEIGHTED>(t.v[i][lane], r[lane], d[lane]);
    return;
  }
  for (int lane = 0; lane < L; ++lane) err[lane] = error_term<BS, WEIGHTED>(t.v[0][lane], r[lane], d[lane]) * c[0];
  for (int i = 1; i < BS; ++i)
    for (int lane = 0; lane < L; ++lane)
      err[lane] = err[lane] + error_term<BS, WEIGHTED>(t.v[i][lane], r[lane], d[lane]) * c[i];
}

// reference.e2m1_encode(v * r) and pack_nibbles: element 2j in the low nibble of byte j of a block.
// Each block's codes are assembled in 32-bit words, eight nibbles each, side by side across the
// lanes (element i at bits 4 (i % 8) of word i / 8: little-endian, so byte j holds elements 2j and
// 2j + 1), then stored as words.
template <int BS>
FP4C_INLINE void encode(const Tile<BS>& t, const float* r, uint8_t* out, int n) {
  alignas(64) uint32_t w[BS / 8][L];
  for (int k = 0; k < BS / 8; ++k) {
    for (int lane = 0; lane < L; ++lane) w[k][lane] = 0u;
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i)
      for (int lane = 0; lane < L; ++lane) {
        const float y = t.v[8 * k + i][lane] * r[lane];
        const uint32_t code = e2m1_index(e2m1_value(__builtin_fabsf(y))) | ((bits_as<uint32_t>(y) >> 28) & 8u);
        w[k][lane] |= code << (4 * i);
      }
  }
  for (int lane = 0; lane < n; ++lane)
    for (int k = 0; k < BS / 8; ++k) memcpy(out + lane * (BS / 2) + 4 * k, &w[k][lane], 4);
}

// ------------------------------------------------------------------------------------------------
// Scale rules: each chooses every block's scale byte and element multiplier r for one tile.
// ------------------------------------------------------------------------------------------------

struct Ctx {
  // NVFP4: the matrix's gs and, per E4M3 byte c (0..0x7E), the candidate's multiplier
  // r = sf > 0 ? min(gs / sf, FLT_MAX) : 0 (a NaN passes the clamp, as torch.clamp's) and step
  // d = sf / gs, the reference's divisions done once per matrix instead of per block.
  float gs;
  float r[128];
  float d[128];
};

FP4C_INLINE void nvfp4_context(Ctx& c, float gs) {
  c.gs = gs;
  for (uint32_t b = 0; b < 128; ++b) {
    const float sf = b == 0x7F ? 0.0f : e4m3_decode(b);
    const float q = gs / sf;
    c.r[b] = sf > 0.0f ? (q > FLT_MAX_F ? FLT_MAX_F : q) : 0.0f;
    c.d[b] = sf / gs;
  }
}

// NVFP4 anchors: b6 = E4M3((gs * bmax) / 6), b4 = E4M3((gs * bmax) / 4) (reference._nvfp4_choose).
FP4C_INLINE uint32_t nvfp4_b6(float gs, uint32_t bmax) { return e4m3_encode((gs * bits_as<float>(bmax)) / 6.0f); }
FP4C_INLINE uint32_t nvfp4_b4(float gs, uint32_t bmax) { return e4m3_encode((gs * bits_as<float>(bmax)) / 4.0f); }

// A rule's signature: (tile, context, input weights of the block's elements or null) -> each block's
// scale byte and element multiplier r. The rules without a search ignore the weights.
template <int BS>
using ChooseFn = void (*)(const Tile<BS>&, const Ctx&, uint8_t* byte, float* r, const float* c);

// NVFP4 max: b6.
FP4C_CLONES void choose_nvfp4_max(const Tile<16>& t, const Ctx& c, uint8_t* byte, float* r, const float*) {
  for (int lane = 0; lane < L; ++lane) {
    const uint32_t b6 = nvfp4_b6(c.gs, t.bmax[lane]);
    byte[lane] = uint8_t(b6);
    r[lane] = c.r[b6];
  }
}

// NVFP4 4over6: b4 when its error is strictly lower than b6's.
FP4C_CLONES void choose_nvfp4_4over6(const Tile<16>& t, const Ctx& c, uint8_t* byte, float* r, const float* w) {
  alignas(64) uint32_t b6[L], b4[L];
  alignas(64) float r6[L], d6[L], r4[L], d4[L], e6[L], e4[L];
  for (int lane = 0; lane < L; ++lane) {
    b6[lane] = nvfp4_b6(c.gs, t.bmax[lane]);
    b4[lane] = nvfp4_b4(c.gs, t.bmax[lane]);
  }
  for (int lane = 0; lane < L; ++lane) {
    r6[lane] = c.r[b6[lane]], d6[lane] = c.d[b6[lane]];
    r4[lane] = c.r[b4[lane]], d4[lane] = c.d[b4[lane]];
  }
  block_error<16, false>(t, r6, d6, w, e6);
  block_error<16, false>(t, r4, d4, w, e4);
  for (int lane = 0; lane < L; ++lane) {
    const bool four = e4[lane] < e6[lane];  // ties keep the /6 scale
    byte[lane] = uint8_t(four ? b4[lane] : b6[lane]);
    r[lane] = four ? r4[lane] : r6[lane];
  }
}

// NVFP4 mse / wmse: the lowest (weighted) error among b6, b4 and b6 - 1 (byte 0 stays 0); among
// equal errors the larger byte.
template <bool WEIGHTED>
FP4C_INLINE void nvfp4_mse(const Tile<16>& t, const Ctx& c, uint8_t* byte, float* r, const float* w) {
  alignas(64) uint32_t b6[L], b4[L], best[L], cand[L];
  alignas(64) float rr[L], dd[L], err[L], best_err[L];
  for (int lane = 0; lane < L; ++lane) {
    b6[lane] = nvfp4_b6(c.gs, t.bmax[lane]);
    b4[lane] = nvfp4_b4(c.gs, t.bmax[lane]);
    best[lane] = b6[lane];
  }
  for (int lane = 0; lane < L; ++lane) rr[lane] = c.r[best[lane]], dd[lane] = c.d[best[lane]];
  block_error<16, WEIGHTED>(t, rr, dd, w, best_err);
  for (int k = 0; k < 2; ++k) {  // b4, then b6 - 1: the winner does not depend on this order
    for (int lane = 0; lane < L; ++lane) cand[lane] = k == 0 ? b4[lane] : (b6[lane] > 0 ? b6[lane] - 1 : 0);
    for (int lane = 0; lane < L; ++lane) rr[lane] = c.r[cand[lane]], dd[lane] = c.d[cand[lane]];
    block_error<16, WEIGHTED>(t, rr, dd, w, err);
    for (int lane = 0; lane < L; ++lane) {
      const bool take = err[lane] < best_err[lane] || (err[lane] == best_err[lane] && cand[lane] > best[lane]);
      best[lane] = take ? cand[lane] : best[lane];
      best_err[lane] = take ? err[lane] : best_err[lane];
    }
  }
  for (int lane = 0; lane < L; ++lane) {
    byte[lane] = uint8_t(best[lane]);
    r[lane] = c.r[best[lane]];
  }
}

FP4C_CLONES void choose_nvfp4_mse(const Tile<16>& t, const Ctx& c, uint8_t* byte, float* r, const float* w) {
  nvfp4_mse<false>(t, c, byte, r, w);
}
FP4C_CLONES void choose_nvfp4_wmse(const Tile<16>& t, const Ctx& c, uint8_t* byte, float* r, const float* w) {
  nvfp4_mse<true>(t, c, byte, r, w);
}

// reference.e8m0_encode_from_bmax (MXFP4 floor rule): clamp(exponent_field(bmax) - 2, 0, 254).
FP4C_INLINE uint32_t mxfp4_floor_exp(uint32_t bmax) {
  const int e = int(bmax >> 23) - 2;
  return uint32_t(e < 0 ? 0 : (e > 254 ? 254 : e));
}

// MXFP4 floor.
FP4C_CLONES void choose_mxfp4_floor(const Tile<32>& t, const Ctx&, uint8_t* byte, float* r, const float*) {
  for (int lane = 0; lane < L; ++lane) {
    const uint32_t e = mxfp4_floor_exp(t.bmax[lane]);
    byte[lane] = uint8_t(e);
    r[lane] = pow2i(127 - int(e));
  }
}

// MXFP4 rceil: e + 1 (at most 254) when bmax * 2^(127 - e) > 6.
FP4C_CLONES void choose_mxfp4_rceil(const Tile<32>& t, const Ctx&, uint8_t* byte, float* r, const float*) {
  for (int lane = 0; lane < L; ++lane) {
    uint32_t e = mxfp4_floor_exp(t.bmax[lane]);
    if (bits_as<float>(t.bmax[lane]) * pow2i(127 - int(e)) > 6.0f) e = e < 254 ? e + 1 : 254;
    byte[lane] = uint8_t(e);
    r[lane] = pow2i(127 - int(e));
  }
}

// MXFP4 mse / wmse: e + 1 (at most 254) when its (weighted) error is strictly lower than e's.
template <bool WEIGHTED>
FP4C_INLINE void mxfp4_mse(const Tile<32>& t, const Ctx&, uint8_t* byte, float* r, const float* w) {
  alignas(64) uint32_t e[L], up[L];
  alignas(64) float r0[L], d0[L], r1[L], d1[L], e0[L], e1[L];
  for (int lane = 0; lane < L; ++lane) {
    e[lane] = mxfp4_floor_exp(t.bmax[lane]);
    up[lane] = e[lane] < 254 ? e[lane] + 1 : 254;
    r0[lane] = pow2i(127 - int(e[lane])), d0[lane] = pow2i(int(e[lane]) - 127);
    r1[lane] = pow2i(127 - int(up[lane])), d1[lane] = pow2i(int(up[lane]) - 127);
  }
  block_error<32, WEIGHTED>(t, r0, d0, w, e0);
  block_error<32, WEIGHTED>(t, r1, d1, w, e1);
  for (int lane = 0; lane < L; ++lane) {
    const bool u = e1[lane] < e0[lane];  // ties keep the floor exponent
    byte[lane] = uint8_t(u ? up[lane] : e[lane]);
    r[lane] = u ? r1[lane] : r0[lane];
  }
}

FP4C_CLONES void choose_mxfp4_mse(const Tile<32>& t, const Ctx& c, uint8_t* byte, float* r, const float* w) {
  mxfp4_mse<false>(t, c, byte, r, w);
}
FP4C_CLONES void choose_mxfp4_wmse(const Tile<32>& t, const Ctx& c, uint8_t* byte, float* r, const float* w) {
  mxfp4_mse<true>(t, c, byte, r, w);
}

// The rules in fp4convert.reference.SCALE_RULES' order (the rule code is the index). A new rule: its
// choose_* function above, one entry here, and its name in reference.py / scheme.py.
constexpr ChooseFn<16> NVFP4_RULES[] = {choose_nvfp4_max, choose_nvfp4_4over6, choose_nvfp4_mse, choose_nvfp4_wmse};
constexpr ChooseFn<32> MXFP4_RULES[] = {choose_mxfp4_floor, choose_mxfp4_rceil, choose_mxfp4_mse, choose_mxfp4_wmse};
constexpr int N_NVFP4_RULES = int(sizeof(NVFP4_RULES) / sizeof(NVFP4_RULES[0]));
constexpr int N_MXFP4_RULES = int(sizeof(MXFP4_RULES) / sizeof(MXFP4_RULES[0]));

// ------------------------------------------------------------------------------------------------
// The scale rules and the encode as explicit vectors (the default path)
// ------------------------------------------------------------------------------------------------
//
// A vector holds one value per block: N of a tile's L = 16 lanes (GCC's generic vectors), the tile
// taken in L / N parts. N is the target's register width, so every operation (the selects of the
// comparisons included) maps to one instruction: 16 lanes (one zmm register) for x86-64-v4, 8 (ymm)
// for x86-64-v3, 4 (xmm) for the baseline and for other architectures (NEON); on x86-64 the library
// holds the three and picks one at load from the CPU (step_table), as the target_clones functions
// do. Each lane runs the scalar code's IEEE operations in the scalar code's order, so the bytes are
// the scalar path's and do not depend on N (tests/kernels/test_cpu_simd.py builds each width and the scalar
// path alone and compares them with the reference). What the vector form changes beside the width:
//  - every per-block step is a vector step too (the E4M3 encode of b6 / b4, the candidates' r = gs / sf
//    and d = sf / gs as vector divisions: the same IEEE divisions as the per-matrix table);
//  - one pass per candidate gives both its (weighted) error and its codes: the index comes from the
//    rounded value's bits (e2m1_index), so the winner's codes are selected lane by lane, not encoded
//    again; the signs are added once, from y = v * r of the chosen multiplier as in encode();
//  - a full tile's codes go out as whole vectors (lanes interleaved with shuffles).
// FP4C_SCALAR_RULES builds the per-lane path instead (choose_* then encode; the tests' yardstick).

template <int N>
struct Vec {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef uint32_t U __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
};

#define FP4C_VEC_TYPES                                  \
  typedef typename Vec<N>::F VF __attribute__((unused)); \
  typedef typename Vec<N>::U VU __attribute__((unused)); \
  typedef typename Vec<N>::I VI __attribute__((unused))

template <int N, class T, class P>
FP4C_INLINE T vload(const P* p) {
  T v;
  memcpy(&v, p, sizeof v);
  return v;
}

// e4m3_encode, lane by lane (signed compares: every operand is small and non-negative, and the
// unsigned ones have no instruction before AVX-512).
template <int N>
FP4C_INLINE typename Vec<N>::U e4m3_encode_v(typename Vec<N>::F s) {
  FP4C_VEC_TYPES;
  s = s != s ? VF{} : s;
  s = s > 448.0f ? VF{} + 448.0f : s;
  const VU b = (VU)s;
  const VU exp = (b >> 23) & 0xFFu;
  const VU keep = (b & 0x7FFFFFu) >> 20, rest = b & 0xFFFFFu;
  const VU up = (rest + 0x7FFFFu + (keep & 1u)) >> 20;  // rest above half, or a tie and keep odd
  const VU normal = (((exp - 120u) << 3) | keep) + up;
  const VF t = s * 512.0f;
  const VI sub = __builtin_convertvector((t + 8388608.0f) - 8388608.0f, VI);
  const VI code = (VI)exp >= 121 ? (VI)normal : sub;
  return (VU)(code > 0x7E ? VI{} + 0x7E : code);
}

// e4m3_decode for bytes 0..0x7E, lane by lane: float(m) * 2^-9, or float(8 + m) * 2^(e - 10).
template <int N>
FP4C_INLINE typename Vec<N>::F e4m3_decode_v(typename Vec<N>::U c) {
  FP4C_VEC_TYPES;
  const VU e = (c >> 3) & 0xFu, m = c & 7u;
  const VF sub = __builtin_convertvector((VI)m, VF) * 0x1p-9f;
  const VF nrm = __builtin_convertvector((VI)(m + 8u), VF) * (VF)((e + 117u) << 23);
  return (VI)e == 0 ? sub : nrm;
}

// nvfp4_context's (r, d) of candidate bytes c (0..0x7E): the same divisions, lane by lane.
template <int N>
FP4C_INLINE void nvfp4_rd(typename Vec<N>::U c, float gs, typename Vec<N>::F& r, typename Vec<N>::F& d) {
  FP4C_VEC_TYPES;
  const VF sf = e4m3_decode_v<N>(c);
  const VF q = gs / sf;
  r = sf > 0.0f ? (q > FLT_MAX_F ? VF{} + FLT_MAX_F : q) : VF{};
  d = sf / gs;
}

// pow2i lane by lane, for k in [-127, 127].
template <int N>
FP4C_INLINE typename Vec<N>::F pow2i_v(typename Vec<N>::I k) {
  FP4C_VEC_TYPES;
  return k >= -126 ? (VF)((VU)(k + 127) << 23) : (VF)(VU{} + 0x00400000u);
}

// e2m1_value and e2m1_index on bits, for y = a * r >= +0 as an integer yb (scalar or vector: the self
// test runs the same expressions on every fp32 value). min6: min(y, 6) on the bits (equal to the float
// select for every y but NaN, whose matrix is flagged). magic: c * 2^22 with c the exponent bits of
// max(y', 1) (c = 2^e, e = 0, 1, 2); t = y' + c 2^22 rounds y' to E2M1's grid, q = t - c 2^22.
// index298: the index without e2m1_index's multiply by 2^-126, whose result for 0.5 is subnormal (a
// microcode assist per element on Intel CPUs): t's significand ends in m = 2q / c, idx = m + 2e (c = 1:
// 2q; c = 2: q + 2; c = 4: q / 2 + 4), and cb >> 22 = 2 (149 + e), so bits(t) - cb + (cb >> 22) = idx + 298.
template <class I>
FP4C_INLINE I e2m1_min6_bits(I yb) {
  return yb > 0x40C00000 ? I{} + 0x40C00000 : yb;
}
template <class I>
FP4C_INLINE I e2m1_magic_bits(I yb) {
  const I big = yb > 0x3F800000 ? yb : I{} + 0x3F800000;
  return (big & 0x7F800000) + (22 << 23);
}
template <class U>
FP4C_INLINE U e2m1_index298(U tbits, U cb) {
  return tbits - cb + (cb >> 22);
}

// One candidate (multiplier r, step d) on lanes [o, o + N): its block error (error_term summed in
// element order, lane by lane) and its codes without signs, eight to a word (element i at bits
// 4 (i % 8) of word i / 8). The index of a grid value q is bits(q * 2^-126) >> 22 (e2m1_index), whose
// only set bits are idx << 22: one shift moves it to its nibble.
template <int N, int BS, bool WEIGHTED>
FP4C_INLINE typename Vec<N>::F score(const Tile<BS>& t, int o, typename Vec<N>::F r, typename Vec<N>::F d,
                                     typename Vec<N>::U* w) {
  FP4C_VEC_TYPES;
  VF err = VF{};
#pragma GCC unroll 32
  for (int i = 0; i < BS; ++i) {
    const VF a = (VF)(vload<N, VU>(&t.v[i][o]) & 0x7FFFFFFFu);
    // e2m1_value on the bits of y = a * r >= +0 (ordered as integers): y' = min(y, 6), then the
    // exponent bits of max(y', 1) plus 22 (c * 2^22); one integer min, max, and, add. Equal to the
    // float selects for every y but NaN (a NaN y comes from a NaN or Inf element: its matrix is flagged).
    const VI yb = e2m1_min6_bits((VI)(a * r));
    const VI cb = e2m1_magic_bits(yb);
    const VF t = (VF)yb + (VF)cb;
    const VF q = t - (VF)cb;
    const VU idx = e2m1_index298((VU)t, (VU)cb);  // idx + 298, the 298s taken out once per word
    const int s = 4 * (i % 8);  // a constant once unrolled
    w[i / 8] = i % 8 == 0 ? idx : (w[i / 8] + (idx << s));
    VF e = q * d - a;
    if (WEIGHTED) e = e * a;
    const VF sq = e * e;
    err = i == 0 ? sq : err + sq;
  }
  for (int k = 0; k < BS / 8; ++k) w[k] -= 298u * 0x11111111u;
  return err;
}

// Words k of lanes interleaved: lo = (a[0], b[0], a[1], b[1], ...) over the first N / 2 lanes, hi the rest.
template <int N>
FP4C_INLINE void interleave(typename Vec<N>::U a, typename Vec<N>::U b, typename Vec<N>::U& lo, typename Vec<N>::U& hi) {
  FP4C_VEC_TYPES;
  if constexpr (N == 16) {
    lo = __builtin_shuffle(a, b, VU{0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23});
    hi = __builtin_shuffle(a, b, VU{8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31});
  } else if constexpr (N == 8) {
    lo = __builtin_shuffle(a, b, VU{0, 8, 1, 9, 2, 10, 3, 11});
    hi = __builtin_shuffle(a, b, VU{4, 12, 5, 13, 6, 14, 7, 15});
  } else {
    static_assert(N == 4, "vector width");
    lo = __builtin_shuffle(a, b, VU{0, 4, 1, 5});
    hi = __builtin_shuffle(a, b, VU{2, 6, 3, 7});
  }
}

// The sign bits of y = v * r (encode's code sign) into lanes [o, o + N)'s codes, then the codes of
// the lanes below n out (block lane at out + lane * BS / 2).
template <int N, int BS>
FP4C_INLINE void finish_codes(const Tile<BS>& t, int o, typename Vec<N>::F r, typename Vec<N>::U* w, uint8_t* out,
                              int n) {
  FP4C_VEC_TYPES;
#pragma GCC unroll 32
  for (int i = 0; i < BS; ++i) w[i / 8] |= (((VU)(vload<N, VF>(&t.v[i][o]) * r) >> 31) << (4 * (i % 8) + 3));
  constexpr int W = BS / 8;  // words per block
  if (o + N <= n) {
    uint8_t* dst = out + o * (BS / 2);
    if constexpr (W == 2) {
      VU lo, hi;
      interleave<N>(w[0], w[1], lo, hi);
      memcpy(dst, &lo, sizeof lo);
      memcpy(dst + sizeof lo, &hi, sizeof hi);
    } else {  // a 4 x N transpose: (w0, w2) and (w1, w3) pairs, then the pairs interleaved
      VU a0, a1, b0, b1, o0, o1, o2, o3;
      interleave<N>(w[0], w[2], a0, a1);
      interleave<N>(w[1], w[3], b0, b1);
      interleave<N>(a0, b0, o0, o1);
      interleave<N>(a1, b1, o2, o3);
      memcpy(dst, &o0, sizeof o0);
      memcpy(dst + sizeof o0, &o1, sizeof o1);
      memcpy(dst + 2 * sizeof o0, &o2, sizeof o2);
      memcpy(dst + 3 * sizeof o0, &o3, sizeof o3);
    }
    return;
  }
  uint32_t ws[W][N];
  for (int k = 0; k < W; ++k) memcpy(ws[k], &w[k], sizeof w[k]);
  for (int lane = o; lane < n; ++lane)
    for (int k = 0; k < W; ++k) memcpy(out + lane * (BS / 2) + 4 * k, &ws[k][lane - o], 4);
}

template <int N>
FP4C_INLINE void store_bytes(typename Vec<N>::U b, uint8_t* byte) {
  uint32_t tmp[N];
  memcpy(tmp, &b, sizeof b);
  for (int lane = 0; lane < N; ++lane) byte[lane] = uint8_t(tmp[lane]);
}

// NVFP4, every rule (choose_nvfp4_* and encode), lanes [o, o + N).
template <int N, int RULE>
FP4C_INLINE void nvfp4_part(const Tile<16>& t, const Ctx& c, int o, uint8_t* byte, uint8_t* out, int n) {
  FP4C_VEC_TYPES;
  const VF gb = c.gs * (VF)vload<N, VU>(&t.bmax[o]);
  const VU b6 = e4m3_encode_v<N>(gb / 6.0f);
  VF r, d;
  nvfp4_rd<N>(b6, c.gs, r, d);
  VU w[2];
  VU best = b6;
  if constexpr (RULE == 0) {
    score<N, 16, false>(t, o, r, d, w);  // only the codes are kept
  } else {
    constexpr bool WEIGHTED = RULE == 3;
    const VU b4 = e4m3_encode_v<N>(gb / 4.0f);
    VF r4, d4;
    nvfp4_rd<N>(b4, c.gs, r4, d4);
    VU w4[2];
    VF best_err = score<N, 16, WEIGHTED>(t, o, r, d, w);
    const VF err4 = score<N, 16, WEIGHTED>(t, o, r4, d4, w4);
    if constexpr (RULE == 1) {
      const VI four = err4 < best_err;  // ties keep the /6 scale
      best = four ? b4 : best, r = four ? r4 : r;
      w[0] = four ? w4[0] : w[0], w[1] = four ? w4[1] : w[1];
    } else {
      // mse / wmse: b6, then b4, then b6 - 1; among equal errors the larger byte. E4M3 encoding is
      // monotone, so b6 - 1 <= b6 <= b4: a tie goes to b4 (b4 == b6 is one candidate either way), and
      // b6 - 1 wins only with a strictly lower error (b6 - 1 == b6 only for byte 0).
      VI take = err4 <= best_err;
      best = take ? b4 : best, best_err = take ? err4 : best_err, r = take ? r4 : r;
      w[0] = take ? w4[0] : w[0], w[1] = take ? w4[1] : w[1];
      const VU bm = (VI)b6 > 0 ? b6 - 1u : VU{};
      VF rm, dm;
      nvfp4_rd<N>(bm, c.gs, rm, dm);
      const VF errm = score<N, 16, WEIGHTED>(t, o, rm, dm, w4);
      take = errm < best_err;
      best = take ? bm : best, r = take ? rm : r;
      w[0] = take ? w4[0] : w[0], w[1] = take ? w4[1] : w[1];
    }
  }
  finish_codes<N, 16>(t, o, r, w, out, n);
  store_bytes<N>(best, byte + o);
}

// MXFP4, every rule (choose_mxfp4_* and encode), lanes [o, o + N).
template <int N, int RULE>
FP4C_INLINE void mxfp4_part(const Tile<32>& t, const Ctx&, int o, uint8_t* byte, uint8_t* out, int n) {
  FP4C_VEC_TYPES;
  const VU bmax = vload<N, VU>(&t.bmax[o]);
  VI e = (VI)(bmax >> 23) - 2;  // mxfp4_floor_exp
  e = e < 0 ? VI{} : (e > 254 ? VI{} + 254 : e);
  VF r = pow2i_v<N>(127 - e);
  VU w[4];
  if constexpr (RULE == 0 || RULE == 1) {
    if constexpr (RULE == 1) {  // rceil: e + 1 (at most 254) when bmax * 2^(127 - e) > 6
      const VI up = ((VF)bmax * r) > 6.0f;
      e = up ? (e < 254 ? e + 1 : VI{} + 254) : e;
      r = pow2i_v<N>(127 - e);
    }
    score<N, 32, false>(t, o, r, VF{}, w);  // only the codes are kept
  } else {
    constexpr bool WEIGHTED = RULE == 3;
    const VI e1 = e < 254 ? e + 1 : VI{} + 254;
    const VF r1 = pow2i_v<N>(127 - e1);
    VU w1[4];
    const VF err0 = score<N, 32, WEIGHTED>(t, o, r, pow2i_v<N>(e - 127), w);
    const VF err1 = score<N, 32, WEIGHTED>(t, o, r1, pow2i_v<N>(e1 - 127), w1);
    const VI u = err1 < err0;  // ties keep the floor exponent
    e = u ? e1 : e, r = u ? r1 : r;
    for (int k = 0; k < 4; ++k) w[k] = u ? w1[k] : w[k];
  }
  finish_codes<N, 32>(t, o, r, w, out, n);
  store_bytes<N>((VU)e, byte + o);
}

template <int BS>
using StepFn = void (*)(const Tile<BS>&, const Ctx&, uint8_t* byte, uint8_t* out, int n);

template <int N, int RULE>
FP4C_INLINE void nvfp4_step(const Tile<16>& t, const Ctx& c, uint8_t* byte, uint8_t* out, int n) {
  for (int o = 0; o < L; o += N) nvfp4_part<N, RULE>(t, c, o, byte, out, n);
}
template <int N, int RULE>
FP4C_INLINE void mxfp4_step(const Tile<32>& t, const Ctx& c, uint8_t* byte, uint8_t* out, int n) {
  for (int o = 0; o < L; o += N) mxfp4_part<N, RULE>(t, c, o, byte, out, n);
}

// The step functions of one width, compiled for one target (ATTR), and their tables.
#define FP4C_STEPS(SUFFIX, ATTR, N)                                                                                \
  ATTR void nvfp4_max_##SUFFIX(const Tile<16>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {                \
    nvfp4_step<N, 0>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  ATTR void nvfp4_4over6_##SUFFIX(const Tile<16>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {             \
    nvfp4_step<N, 1>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  ATTR void nvfp4_mse_##SUFFIX(const Tile<16>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {                \
    nvfp4_step<N, 2>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  ATTR void nvfp4_wmse_##SUFFIX(const Tile<16>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {               \
    nvfp4_step<N, 3>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  ATTR void mxfp4_floor_##SUFFIX(const Tile<32>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {              \
    mxfp4_step<N, 0>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  ATTR void mxfp4_rceil_##SUFFIX(const Tile<32>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {              \
    mxfp4_step<N, 1>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  ATTR void mxfp4_mse_##SUFFIX(const Tile<32>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {                \
    mxfp4_step<N, 2>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  ATTR void mxfp4_wmse_##SUFFIX(const Tile<32>& t, const Ctx& c, uint8_t* b, uint8_t* o, int n) {               \
    mxfp4_step<N, 3>(t, c, b, o, n);                                                                               \
  }                                                                                                                \
  constexpr StepFn<16> NVFP4_STEPS_##SUFFIX[] = {nvfp4_max_##SUFFIX, nvfp4_4over6_##SUFFIX, nvfp4_mse_##SUFFIX,   \
                                                 nvfp4_wmse_##SUFFIX};                                            \
  constexpr StepFn<32> MXFP4_STEPS_##SUFFIX[] = {mxfp4_floor_##SUFFIX, mxfp4_rceil_##SUFFIX, mxfp4_mse_##SUFFIX,  \
                                                 mxfp4_wmse_##SUFFIX};

// FP4C_VEC_WIDTH (4, 8 or 16) forces one width (the tests build each); otherwise, where the library
// has clones, the three x86-64 levels, else the width of the build's own target.
#if defined(FP4C_VEC_WIDTH)
FP4C_STEPS(one, , FP4C_VEC_WIDTH)
#define FP4C_STEP_SETS 0
#elif FP4C_X86 && defined(__GNUC__) && !defined(__clang__) && !defined(FP4C_NO_CLONES)
FP4C_STEPS(v4, __attribute__((target("arch=x86-64-v4"))), 16)
FP4C_STEPS(v3, __attribute__((target("arch=x86-64-v3"))), 8)
FP4C_STEPS(v1, , 4)
#define FP4C_STEP_SETS 1
#elif defined(__AVX512F__) && defined(__AVX512BW__)
FP4C_STEPS(one, , 16)
#define FP4C_STEP_SETS 0
#elif defined(__AVX2__)
FP4C_STEPS(one, , 8)
#define FP4C_STEP_SETS 0
#else
FP4C_STEPS(one, , 4)
#define FP4C_STEP_SETS 0
#endif

// The width in use: 16, 8 or 4 lanes (the CPU's x86-64 level, checked once).
int step_width() {
#if FP4C_STEP_SETS
  static const int w = __builtin_cpu_supports("x86-64-v4") ? 16 : __builtin_cpu_supports("x86-64-v3") ? 8 : 4;
  return w;
#elif defined(FP4C_VEC_WIDTH)
  return FP4C_VEC_WIDTH;
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return 16;
#elif defined(__AVX2__)
  return 8;
#else
  return 4;
#endif
}

StepFn<16> nvfp4_step_fn(int rule) {
#if FP4C_STEP_SETS
  const int w = step_width();
  return w == 16 ? NVFP4_STEPS_v4[rule] : w == 8 ? NVFP4_STEPS_v3[rule] : NVFP4_STEPS_v1[rule];
#else
  return NVFP4_STEPS_one[rule];
#endif
}
StepFn<32> mxfp4_step_fn(int rule) {
#if FP4C_STEP_SETS
  const int w = step_width();
  return w == 16 ? MXFP4_STEPS_v4[rule] : w == 8 ? MXFP4_STEPS_v3[rule] : MXFP4_STEPS_v1[rule];
#else
  return MXFP4_STEPS_one[rule];
#endif
}



// ------------------------------------------------------------------------------------------------
// The per-tile stages every rule shares, compiled per target
// ------------------------------------------------------------------------------------------------

// Widen n blocks from block0 on, rotate them if asked, and take their maxima.
template <int BS>
FP4C_INLINE void prepare_tile(Tile<BS>& t, const void* x, int dtype, int rotate, int64_t block0, int n) {
  load<BS>(t, x, dtype, block0, n);
  if (rotate) had16<BS>(t);
  block_max<BS>(t);
}
FP4C_CLONES void prepare16(Tile<16>& t, const void* x, int dtype, int rotate, int64_t block0, int n) {
  prepare_tile<16>(t, x, dtype, rotate, block0, n);
}
FP4C_CLONES void prepare32(Tile<32>& t, const void* x, int dtype, int rotate, int64_t block0, int n) {
  prepare_tile<32>(t, x, dtype, rotate, block0, n);
}
FP4C_CLONES void encode16(const Tile<16>& t, const float* r, uint8_t* out, int n) { encode<16>(t, r, out, n); }
FP4C_CLONES void encode32(const Tile<32>& t, const float* r, uint8_t* out, int n) { encode<32>(t, r, out, n); }

FP4C_INLINE void prepare(Tile<16>& t, const void* x, int dtype, int rotate, int64_t block0, int n) {
  prepare16(t, x, dtype, rotate, block0, n);
}
FP4C_INLINE void prepare(Tile<32>& t, const void* x, int dtype, int rotate, int64_t block0, int n) {
  prepare32(t, x, dtype, rotate, block0, n);
}
FP4C_INLINE void encode_tile(const Tile<16>& t, const float* r, uint8_t* out, int n) { encode16(t, r, out, n); }
FP4C_INLINE void encode_tile(const Tile<32>& t, const float* r, uint8_t* out, int n) { encode32(t, r, out, n); }

// ------------------------------------------------------------------------------------------------
// Jobs: a range of consecutive blocks of one matrix
// ------------------------------------------------------------------------------------------------

struct Problem {
  const void* x;
  int dtype, scheme, rule, rotate, swizzle;
  int64_t batch, m, k;
  const float* gs;
  uint8_t* packed;
  uint8_t* scale;
};

// Where block (row, col) of matrix b goes in the scale output: linear [B, M, nb], or the 128x4
// layout of fp4convert/swizzle.py ([B, Mp, nbp], zero padding written by the caller).
FP4C_INLINE int64_t scale_index(const Problem& p, int64_t b, int64_t row, int64_t col, int64_t nb) {
  if (!p.swizzle) return (b * p.m + row) * nb + col;
  const int64_t mp = (p.m + 127) / 128 * 128, nbp = (nb + 3) / 4 * 4;
  return b * mp * nbp + (row / 128) * (nbp / 4 * 512) + (col / 4) * 512 + (row % 32) * 16 + ((row % 128) / 32) * 4 +
         (col % 4);
}

// Quantize blocks [g0, g1) of matrix b with the rule `choose`; returns whether any block was non-finite.
template <int BS>
bool quantize_blocks(const Problem& p, const Ctx& ctx, ChooseFn<BS> choose, StepFn<BS> step, int64_t b, int64_t g0,
                     int64_t g1) {
  const int64_t nb = p.k / BS;
  const int64_t base = b * p.m * nb;  // the matrix's first block
  Tile<BS> t;
  alignas(64) uint8_t byte[L];
  uint32_t worst = 0;
  for (int64_t g = g0; g < g1; g += L) {
    const int n = int(std::min<int64_t>(L, g1 - g));
    prepare(t, p.x, p.dtype, p.rotate, base + g, n);
    for (int lane = 0; lane < n; ++lane) worst = std::max(worst, t.bmax[lane]);
#ifdef FP4C_SCALAR_RULES
    (void)step;
    alignas(64) float r[L];
    choose(t, ctx, byte, r, nullptr);
    encode_tile(t, r, p.packed + (base + g) * (BS / 2), n);
#else
    (void)choose;
    step(t, ctx, byte, p.packed + (base + g) * (BS / 2), n);
#endif
    if (!p.swizzle) {
      memcpy(p.scale + base + g, byte, size_t(n));
    } else {
      for (int lane = 0; lane < n; ++lane) {
        const int64_t gi = g + lane;
        p.scale[scale_index(p, b, gi / nb, gi % nb, nb)] = byte[lane];
      }
    }
  }
  return worst >= 0x7F800000u;
}

// Max |v| bits over blocks [g0, g1) of 16 elements of matrix b, after the rotation.
uint32_t amax_rotated(const Problem& p, int64_t b, int64_t g0, int64_t g1) {
  const int64_t base = b * p.m * (p.k / 16);
  Tile<16> t;
  uint32_t worst = 0;
  for (int64_t g = g0; g < g1; g += L) {
    const int n = int(std::min<int64_t>(L, g1 - g));
    prepare(t, p.x, p.dtype, 1, base + g, n);
    for (int lane = 0; lane < n; ++lane) worst = std::max(worst, t.bmax[lane]);
  }
  return worst;
}

// Unrotated amax on the input's own bits: |x| ordered as unsigned integers (0x7FFF masks the sign).
template <class T, uint32_t MASK>
FP4C_INLINE uint32_t max_abs_bits(const T* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = uint32_t(x[i]) & MASK;
    m = a > m ? a : m;
  }
  return m;
}

bool quantize_job(const Problem& p, const Ctx& ctx, int64_t b, int64_t g0, int64_t g1) {
  if (p.scheme == NVFP4) return quantize_blocks<16>(p, ctx, NVFP4_RULES[p.rule], nvfp4_step_fn(p.rule), b, g0, g1);
  return quantize_blocks<32>(p, ctx, MXFP4_RULES[p.rule], mxfp4_step_fn(p.rule), b, g0, g1);
}

bool has_rule(int scheme, int rule) {
  return rule >= 0 && ((scheme == NVFP4 && rule < N_NVFP4_RULES) || (scheme == MXFP4 && rule < N_MXFP4_RULES));
}

// Unrotated: a max over the input's bits, one pass; rotated: the tiles' block maxima.
FP4C_CLONES uint32_t amax_job(const Problem& p, int64_t b, int64_t e0, int64_t e1) {
  // [e0, e1): elements of matrix b (whole blocks of 16 when rotated)
  const int64_t off = b * p.m * p.k;
  if (p.rotate) return amax_rotated(p, b, e0 / 16, e1 / 16);
  if (p.dtype == DT_F32) {
    return max_abs_bits<uint32_t, 0x7FFFFFFFu>(static_cast<const uint32_t*>(p.x) + off + e0, e1 - e0);
  }
  const uint32_t h = max_abs_bits<uint16_t, 0x7FFFu>(static_cast<const uint16_t*>(p.x) + off + e0, e1 - e0);
  return p.dtype == DT_BF16 ? h << 16 : f16_abs_bits_to_f32_bits(h);
}

// Mismatches of the fast E2M1 paths (the per-lane one and the vector path's integer form, value and
// index) against the predicate sum over the n bit patterns from u0 on (NaNs skipped: a NaN is flagged,
// its bytes never written).
FP4C_CLONES int64_t e2m1_mismatches(uint32_t u0, uint32_t n) {
  int64_t bad = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t u = u0 + i;
    const float y = bits_as<float>(u);
    const uint32_t fast = e2m1_index(e2m1_value(__builtin_fabsf(y))) | ((u >> 28) & 8u);
    // the vector path's form (score): the same templates on one lane
    const int32_t yb = e2m1_min6_bits(int32_t(u & 0x7FFFFFFFu));
    const int32_t cb = e2m1_magic_bits(yb);
    const float t = bits_as<float>(yb) + bits_as<float>(cb);
    const uint32_t vec = (e2m1_index298(bits_as<uint32_t>(t), uint32_t(cb)) - 298u) | ((u >> 28) & 8u);
    const bool value_ok = t - bits_as<float>(cb) == e2m1_value(__builtin_fabsf(y));
    bad += (y == y) & ((fast != e2m1_spec(y)) | (vec != e2m1_spec(y)) | !value_ok);
  }
  return bad;
}

// ------------------------------------------------------------------------------------------------
// Threads
// ------------------------------------------------------------------------------------------------

// IEEE arithmetic for this thread while alive: round to nearest, no FTZ / DAZ (the x86 defaults),
// whatever the caller (or a library it loaded) set; restored on exit.
struct IeeeMode {
#if FP4C_X86
  unsigned saved;
  IeeeMode() : saved(_mm_getcsr()) { _mm_setcsr(0x1F80u); }
  ~IeeeMode() { _mm_setcsr(saved); }
#endif
};

// The library's worker threads, started on first need and kept: a converter calls the kernel a few
// thousand times (a 64-expert MoE: two calls per expert matrix), and starting 15 threads per call cost
// more than the work of a small matrix. One parallel call at a time uses them (a second caller waits
// for the first to finish; a one-thread call never touches the pool, so callers running one thread
// each, like the pipeline's Python pool, still run side by side). Never destroyed (its threads outlive
// static destructors); a fork's child gets a fresh, empty pool (the parent's threads do not exist there).
struct Pool {
  std::mutex call;  // one parallel call at a time
  std::mutex m;
  std::condition_variable wake, done;
  int size = 0;      // detached worker threads started
  uint64_t gen = 0;  // one per parallel call
  int wanted = 0;    // workers taking part in the current call (indices 0..wanted-1)
  int finished = 0;
  const std::function<void()>* task = nullptr;
};

std::atomic<Pool*> the_pool{nullptr};

void pool_after_fork_in_child() { the_pool.store(new Pool); }

Pool* pool() {
  static const bool registered = [] {
    the_pool.store(new Pool);
    pthread_atfork(nullptr, nullptr, pool_after_fork_in_child);
    return true;
  }();
  (void)registered;
  return the_pool.load();
}

void pool_worker(Pool* p, int index) {
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lk(p->m);
  for (;;) {
    p->wake.wait(lk, [&] { return p->gen != seen; });
    seen = p->gen;
    if (index < p->wanted) {
      const std::function<void()>* task = p->task;
      lk.unlock();
      (*task)();
      lk.lock();
      if (++p->finished == p->wanted) p->done.notify_one();
    }
  }
}

// f() on n threads (the caller's included) and wait for all of them.
void run_on_threads(int n, const std::function<void()>& f) {
  if (n <= 1) {
    f();
    return;
  }
  Pool* p = pool();
  std::lock_guard<std::mutex> one(p->call);
  {
    std::lock_guard<std::mutex> lk(p->m);
    while (p->size < n - 1) {
      try {
        std::thread(pool_worker, p, p->size).detach();
      } catch (...) {  // no more threads (a resource limit): the others take the work
        break;
      }
      ++p->size;
    }
    p->task = &f;
    p->wanted = std::min(n - 1, p->size);
    p->finished = 0;
    ++p->gen;
  }
  p->wake.notify_all();
  f();
  std::unique_lock<std::mutex> lk(p->m);
  p->done.wait(lk, [&] { return p->finished == p->wanted; });
  p->task = nullptr;
}

// Run body(job) for job in [0, jobs) on `threads` threads (the caller's included), jobs taken in
// order from a shared counter so an unevenly loaded machine stays balanced.
template <class Body>
void parallel_jobs(int64_t jobs, int threads, const Body& body) {
  std::atomic<int64_t> next(0);
  const std::function<void()> worker = [&]() {
    IeeeMode mode;
    for (int64_t j = next.fetch_add(1, std::memory_order_relaxed); j < jobs;
         j = next.fetch_add(1, std::memory_order_relaxed))
      body(j);
  };
  run_on_threads(int(std::max<int64_t>(1, std::min<int64_t>(threads, jobs))), worker);
}

// Blocks per job for a matrix of nblk blocks of BS elements: about JOB_ELEMS elements, whole tiles.
int64_t blocks_per_job(int bs) { return std::max<int64_t>(L, JOB_ELEMS / bs / L * L); }

bool valid(const void* x, int dtype, int rotate, int64_t batch, int64_t m, int64_t k) {
  return (x != nullptr || batch * m * k == 0) && dtype >= 0 && dtype <= 2 && batch >= 0 && m >= 0 && k >= 0 &&
         (rotate == 0 || rotate == 1) && (!rotate || k % 16 == 0);
}

// Helpers of fp4c_cpu_nonfinite: a vectorisable OR over (element & mask) == mask.
template <class T>
FP4C_INLINE bool any_all_ones(const unsigned char* x, int64_t n, T mask) {
  T hit = 0;
  for (int64_t i = 0; i < n; ++i) {
    T v;
    memcpy(&v, x + i * int64_t(sizeof(T)), sizeof(T));
    hit |= T((v & mask) == mask);
  }
  return hit != 0;
}

FP4C_CLONES bool nonfinite_range(const unsigned char* x, int64_t n, int dtype) {
  switch (dtype) {
    case 0: return any_all_ones<uint32_t>(x, n, 0x7F800000u);
    case 1: return any_all_ones<uint16_t>(x, n, 0x7C00u);
    case 2: return any_all_ones<uint16_t>(x, n, 0x7F80u);
    case 3: return any_all_ones<uint64_t>(x, n, 0x7FF0000000000000ull);
    case 4: return any_all_ones<uint8_t>(x, n, 0x7Fu);
    default: return any_all_ones<uint8_t>(x, n, 0x7Cu);
  }
}

// ------------------------------------------------------------------------------------------------
// GPTQ's in-batch sweep (fp4convert/numerics/gptq.py sweep_batch; csrc/fp4c_gptq.cu on a GPU)
// ------------------------------------------------------------------------------------------------
//
// The rows of a column batch are independent (every row's update reads the same factor U), so a tile
// holds L rows of the batch, transposed: wv[k * L + lane] is column k of row `lane`, and each step of
// the reference (one torch operation over the rows) is one operation across the lanes, in the
// reference's order: at a scale block's first column, every row's scale from the block's columns as
// they are then (the scalar rules' choose_* function, the input weights those columns' diag(H)); the
// column's codes E2M1(w * r) (the predicate sum: a NaN gets code 0 with its sign bit, as in the
// reference), its values q = value(code) * d, its errors e = (w - q) / U[i][i]; then the batch's later
// columns w_k = w_k - U[i][k] * e (one multiply, one subtract: the reference's two operations; no FMA
// under -ffp-contract=off), a vector loop over the lanes for each k. That update is the sweep's cost:
// N * B^2 / 2 multiply-subtracts per batch.

constexpr float E2M1_SIGNED[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct SweepProblem {
  const float* w;   // [n, b] row-major (read only)
  const float* u;   // [b, b] row-major: the batch's block of the upper factor
  const float* iw;  // [b] input weights of the search rules' error, or null
  int scheme;
  int64_t n;
  int b;
  uint8_t* codes;   // [n, b]
  uint8_t* scales;  // [n, b / bs]
  float* values;    // [n, b]
  float* errors;    // [n, b]
};

// Rows [row0, row0 + n) (n <= L; lanes >= n are zeros, computed, never stored); `buf` holds 3 * b * L
// floats. Returns whether a block was non-finite where its scale is chosen (the reference raises
// there; nothing after it is meaningful).
template <int BS>
FP4C_INLINE bool sweep_rows(const SweepProblem& p, const Ctx& ctx, ChooseFn<BS> choose, int64_t row0, int n,
                            float* buf) {
  const int b = p.b;
  float* wv = buf;          // [b][L] the row's columns as the sweep updates them
  float* qv = buf + b * L;  // [b][L] values
  float* ev = qv + b * L;   // [b][L] errors
  alignas(64) uint8_t cv[L];
  for (int lane = 0; lane < L; ++lane) {
    const float* src = p.w + (row0 + lane) * b;
    for (int k = 0; k < b; ++k) wv[k * L + lane] = lane < n ? src[k] : 0.0f;
  }
  Tile<BS> t;
  alignas(64) uint8_t byte[L];
  alignas(64) float r[L], d[L], e[L];
  for (int i = 0; i < b; ++i) {
    float* wi = wv + i * L;
    if (i % BS == 0) {
      for (int j = 0; j < BS; ++j)
        for (int lane = 0; lane < L; ++lane) t.v[j][lane] = wi[j * L + lane];
      block_max<BS>(t);
      uint32_t worst = 0;
      for (int lane = 0; lane < n; ++lane) worst = std::max(worst, t.bmax[lane]);
      if (worst >= 0x7F800000u) return true;
      choose(t, ctx, byte, r, p.iw != nullptr ? p.iw + i : nullptr);
      for (int lane = 0; lane < L; ++lane) d[lane] = p.scheme == NVFP4 ? ctx.d[byte[lane]] : pow2i(int(byte[lane]) - 127);
      for (int lane = 0; lane < n; ++lane) p.scales[(row0 + lane) * (b / BS) + i / BS] = byte[lane];
    }
    const float uii = p.u[int64_t(i) * b + i];
    for (int lane = 0; lane < L; ++lane) {
      const float x = wi[lane];
      const uint32_t code = e2m1_spec(x * r[lane]);
      const float q = E2M1_SIGNED[code] * d[lane];
      e[lane] = (x - q) / uii;
      qv[i * L + lane] = q;
      ev[i * L + lane] = e[lane];
      cv[lane] = uint8_t(code);
    }
    for (int lane = 0; lane < n; ++lane) p.codes[(row0 + lane) * b + i] = cv[lane];
    const float* ui = p.u + int64_t(i) * b;
    for (int k = i + 1; k < b; ++k) {
      const float uk = ui[k];
      float* wk = wv + k * L;
      for (int lane = 0; lane < L; ++lane) wk[lane] = wk[lane] - uk * e[lane];
    }
  }
  for (int lane = 0; lane < n; ++lane) {
    float* qo = p.values + (row0 + lane) * b;
    float* eo = p.errors + (row0 + lane) * b;
    for (int k = 0; k < b; ++k) {
      qo[k] = qv[k * L + lane];
      eo[k] = ev[k * L + lane];
    }
  }
  return false;
}

FP4C_CLONES bool sweep_rows16(const SweepProblem& p, const Ctx& ctx, int rule, int64_t row0, int n, float* buf) {
  return sweep_rows<16>(p, ctx, NVFP4_RULES[rule], row0, n, buf);
}
FP4C_CLONES bool sweep_rows32(const SweepProblem& p, const Ctx& ctx, int rule, int64_t row0, int n, float* buf) {
  return sweep_rows<32>(p, ctx, MXFP4_RULES[rule], row0, n, buf);
}

}  // namespace

extern "C" {

int fp4c_cpu_abi_version(void) { return FP4C_CPU_ABI; }

int fp4c_cpu_has_rule(int scheme, int rule) { return has_rule(scheme, rule) ? 1 : 0; }

// Lanes per vector of the scale rules' path in use (16, 8 or 4; 0: the per-lane FP4C_SCALAR_RULES build).
int fp4c_cpu_vector_width(void) {
#ifdef FP4C_SCALAR_RULES
  return 0;
#else
  return step_width();
#endif
}

// amax per matrix of a contiguous [batch, m, k] input (reference.tensor_amax): out[b] = max |x|
// (of the Had16-rotated values when rotate), as fp32; NaN and Inf propagate (a NaN wins over Inf).
int fp4c_cpu_amax(const void* x, int dtype, int rotate, int64_t batch, int64_t m, int64_t k, float* out,
                  int threads) {
  if (!valid(x, dtype, rotate, batch, m, k) || (out == nullptr && batch > 0)) return BAD_ARGUMENT;
  Problem p{x, dtype, 0, 0, rotate, 0, batch, m, k, nullptr, nullptr, nullptr};
  const int64_t per_matrix = m * k;
  const int64_t step = rotate ? blocks_per_job(16) * 16 : JOB_ELEMS;
  const int64_t jobs_per = (per_matrix + step - 1) / step;
  std::vector<uint32_t> part(size_t(batch * jobs_per), 0u);
  parallel_jobs(batch * jobs_per, threads, [&](int64_t j) {
    const int64_t b = j / jobs_per, e0 = (j % jobs_per) * step;
    part[size_t(j)] = amax_job(p, b, e0, std::min(per_matrix, e0 + step));
  });
  for (int64_t b = 0; b < batch; ++b) {
    uint32_t worst = 0;
    for (int64_t j = 0; j < jobs_per; ++j) worst = std::max(worst, part[size_t(b * jobs_per + j)]);
    out[b] = bits_as<float>(worst);
  }
  return OK;
}

// Quantize a contiguous [batch, m, k] input (reference.nvfp4_quantize / mxfp4_quantize with the
// scale rule `rule`, SCALE_RULES' index): packed [batch, m, k/2]; scale [batch, m, k/bs] (linear) or
// [batch, Mp, nbp] (swizzle: the caller zero-fills it, the padding is never written); gs [batch]
// (NVFP4: the global scale each matrix is quantized with; unused for MXFP4); nonfinite[b] = 1 when
// matrix b holds NaN/Inf (after rotation), else 0. Status NEGATIVE_SCALE (nothing written) for a
// gs < 0, UNKNOWN_RULE for a rule without a choose_* function.
int fp4c_cpu_quantize(const void* x, int dtype, int scheme, int rule, int rotate, int swizzle, int64_t batch,
                      int64_t m, int64_t k, const float* gs, uint8_t* packed, uint8_t* scale, uint8_t* nonfinite,
                      int threads) {
  if (!valid(x, dtype, rotate, batch, m, k) || (scheme != NVFP4 && scheme != MXFP4) || (nonfinite == nullptr && batch > 0))
    return BAD_ARGUMENT;
  if (!has_rule(scheme, rule)) return UNKNOWN_RULE;
  const int bs = scheme == NVFP4 ? 16 : 32;
  if (k % bs || (batch * m * k > 0 && ((scheme == NVFP4 && gs == nullptr) || packed == nullptr || scale == nullptr)))
    return BAD_ARGUMENT;
  // A negative gs (a negative group amax given by a caller) is the torch path's to refuse or not.
  for (int64_t b = 0; b < batch && scheme == NVFP4 && gs != nullptr; ++b)
    if (gs[b] < 0.0f) return NEGATIVE_SCALE;
  Problem p{x, dtype, scheme, rule, rotate, swizzle ? 1 : 0, batch, m, k, gs, packed, scale};
  const int64_t nblk = m * (k / bs);
  const int64_t step = blocks_per_job(bs);
  const int64_t jobs_per = (nblk + step - 1) / step;
  std::vector<uint8_t> bad(size_t(batch * jobs_per), 0);
  std::vector<Ctx> ctx(size_t(scheme == NVFP4 ? batch : 1));
  for (int64_t b = 0; b < batch && scheme == NVFP4 && gs != nullptr; ++b) nvfp4_context(ctx[size_t(b)], gs[b]);
  parallel_jobs(batch * jobs_per, threads, [&](int64_t j) {
    const int64_t b = j / jobs_per, g0 = (j % jobs_per) * step;
    bad[size_t(j)] = quantize_job(p, ctx[scheme == NVFP4 ? size_t(b) : 0], b, g0, std::min(nblk, g0 + step));
  });
  for (int64_t b = 0; b < batch; ++b) {
    uint8_t f = 0;
    for (int64_t j = 0; j < jobs_per; ++j) f |= bad[size_t(b * jobs_per + j)];
    nonfinite[b] = f;
  }
  return OK;
}

// reference.global_scale for n amax values: gs = 2688 / amax (one fp32 division), 1 for amax == 0,
// clamped to FLT_MAX (a NaN passes the clamp, as torch.clamp's). For callers without torch.
int fp4c_cpu_global_scale(const float* amax, float* gs, int64_t n) {
  if (n < 0 || ((amax == nullptr || gs == nullptr) && n > 0)) return BAD_ARGUMENT;
  IeeeMode mode;
  for (int64_t i = 0; i < n; ++i) {
    const float q = 2688.0f / amax[i];
    gs[i] = amax[i] == 0.0f ? 1.0f : (q > FLT_MAX_F ? FLT_MAX_F : q);
  }
  return OK;
}

// Any NaN/Inf among n elements at x (no alignment needed) of a safetensors float dtype: code 0 F32,
// 1 F16, 2 BF16, 3 F64, 4 F8_E4M3 (0x7F/0xFF are its NaN; it has no Inf), 5 F8_E5M2. The writer's check
// of kept tensors on the torch-free path. Returns 1, 0, or -1 for a bad argument.
int fp4c_cpu_nonfinite(const void* x, int64_t n, int dtype, int threads) {
  static const int width[] = {4, 2, 2, 8, 1, 1};
  if (dtype < 0 || dtype > 5 || n < 0 || (x == nullptr && n > 0)) return -1;
  const int64_t step = JOB_ELEMS * 4 / width[dtype];
  const int64_t jobs = (n + step - 1) / step;
  std::vector<uint8_t> hit(size_t(jobs), 0);
  parallel_jobs(jobs, threads, [&](int64_t j) {
    const int64_t e0 = j * step;
    hit[size_t(j)] = nonfinite_range(static_cast<const unsigned char*>(x) + e0 * width[dtype], std::min(step, n - e0),
                                     dtype);
  });
  for (uint8_t h : hit)
    if (h) return 1;
  return 0;
}

// memcpy of n bytes on `threads` threads, in the kernel's job sizes: the memory-bandwidth yardstick of
// benchmarks/cpu_kernel.py (the kernel reads 2 bytes of bf16 and writes ~0.56 per element).
int fp4c_cpu_memcpy(void* dst, const void* src, int64_t n, int threads) {
  if (n < 0 || ((dst == nullptr || src == nullptr) && n > 0)) return BAD_ARGUMENT;
  const int64_t step = JOB_ELEMS * 4;
  parallel_jobs((n + step - 1) / step, threads, [&](int64_t j) {
    const int64_t off = j * step;
    memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off, size_t(std::min(step, n - off)));
  });
  return OK;
}

// Every fp32 bit pattern except NaNs through the fast E2M1 path (e2m1_value, e2m1_index, the sign
// bit) against the predicate sum; returns the number of mismatches (0), and the first in *first.
int64_t fp4c_cpu_e2m1_selftest(int threads, uint32_t* first) {
  const int64_t jobs = 1 << 12, per = (int64_t(1) << 32) / jobs;
  std::vector<int64_t> bad(size_t(jobs), 0);
  parallel_jobs(jobs, threads, [&](int64_t j) { bad[size_t(j)] = e2m1_mismatches(uint32_t(j * per), uint32_t(per)); });
  int64_t total = 0;
  for (int64_t j = 0; j < jobs; ++j) {
    if (bad[size_t(j)] && !total && first) {
      for (uint32_t u = uint32_t(j * per);; ++u)
        if (e2m1_mismatches(u, 1)) {
          *first = u;
          break;
        }
    }
    total += bad[size_t(j)];
  }
  return total;
}

// GPTQ's sweep of one column batch (fp4convert/numerics/gptq.py sweep_batch; the same arguments as
// csrc/fp4c_gptq.cu's fp4c_gptq_sweep, with the global scale instead of the amax): w [n, b] fp32, u [b, b]
// fp32, iw [b] fp32 or null (the search rules' input weights), gs (NVFP4: reference.global_scale of the
// matrix's amax; unused for MXFP4); out: codes [n, b] uint8, scales [n, b / bs] uint8 (E4M3 / E8M0),
// values and errors [n, b] fp32. NONFINITE (outputs undefined) when a block holds NaN/Inf where its scale
// is chosen, where the reference raises. Rows are split over `threads` threads in tiles of L rows.
int fp4c_cpu_gptq_sweep(const float* w, const float* u, const float* iw, float gs, int scheme, int rule, int64_t n,
                        int b, uint8_t* codes, uint8_t* scales, float* values, float* errors, int threads) {
  if (scheme != NVFP4 && scheme != MXFP4) return BAD_ARGUMENT;
  if (!has_rule(scheme, rule)) return UNKNOWN_RULE;
  const int bs = scheme == NVFP4 ? 16 : 32;
  if (n < 0 || b <= 0 || b % bs || (n > 0 && (!w || !u || !codes || !scales || !values || !errors)))
    return BAD_ARGUMENT;
  if (scheme == NVFP4 && !(gs >= 0.0f)) return NEGATIVE_SCALE;
  Ctx ctx;
  if (scheme == NVFP4) nvfp4_context(ctx, gs);
  const SweepProblem p{w, u, iw, scheme, n, b, codes, scales, values, errors};
  const int64_t tiles = (n + L - 1) / L;
  std::atomic<bool> bad(false);
  parallel_jobs(tiles, threads, [&](int64_t j) {
    thread_local std::vector<float> buf;
    buf.resize(size_t(3) * size_t(b) * L);
    const int64_t row0 = j * L;
    const int rows = int(std::min<int64_t>(L, n - row0));
    const bool f = scheme == NVFP4 ? sweep_rows16(p, ctx, rule, row0, rows, buf.data())
                                   : sweep_rows32(p, ctx, rule, row0, rows, buf.data());
    if (f) bad.store(true, std::memory_order_relaxed);
  });
  return bad.load() ? NONFINITE : OK;
}

}  // extern "C"
