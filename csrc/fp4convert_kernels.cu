// fp4convert CUDA kernels: amax, NVFP4 / MXFP4 quantize (optionally fused with Had16), dequantize.
//
// Numerics: SPEC.md, bit for bit with fp4convert/reference.py. Every fp32 step is one IEEE operation
// with round-to-nearest-even (__fmul_rn / __fadd_rn / __fdiv_rn / __fmaf_rn where an FMA is exact by
// construction); the library is built with -fmad=false and without fast math.
//
// Plain CUDA C++, no torch headers: extern "C" launchers take raw device pointers and a cudaStream_t,
// so nvcc alone compile-checks this file for sm_90 / sm_100a / sm_120a and Python calls it via ctypes.
//
// Work split: one thread owns GROUP = 32 consecutive elements of one matrix (two NVFP4 blocks or one
// MXFP4 block, two Had16 groups), read with 16-byte loads, its 16 bytes of codes written with one
// 16-byte store. Blocks never straddle rows (K % 16 == 0 for NVFP4, K % 32 == 0 for MXFP4), so with
// linear scales a matrix is a flat array of blocks and block i's scale is byte i. With swizzled
// scales one CTA owns one 512-byte 128x4 tile (128 rows x 4 blocks, padding included). Dequantize
// stages each warp's output through shared memory so its stores are 512 contiguous bytes.
// Measurements and the alternatives tried: benchmarks/NOTES.md, BENCHMARKS.md.

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <float.h>

#define FP4C_API extern "C" __attribute__((visibility("default")))

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

namespace {

enum : int { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum : int { FMT_NVFP4 = 0, FMT_MXFP4 = 1 };

constexpr int GROUP = 32;     // elements per thread
constexpr int THREADS = 256;  // threads per CTA

template <int DT>
struct Elem {
  static constexpr int size = DT == DT_F32 ? 4 : 2;
};

// ------------------------------------------------------------------------------------------------
// Small helpers
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint4 ldg16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint2 ldg8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

__device__ __forceinline__ void stg16(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void stg8(void* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// Per-halfword unsigned max: abs-bit patterns of bf16/fp16 order like their magnitudes, and NaN/Inf
// patterns sort above every finite one, so a max over them propagates non-finite values.
__device__ __forceinline__ uint32_t vmax_u16x2(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t d;
  asm("max.u16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  return __vmaxu2(a, b);
#endif
}

#if !FP4C_HW_E2M1
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
#endif

// fp32 -> E4M3 byte (RNE, saturating at 448, subnormals kept): the hardware conversion (sm_89+).
__device__ __forceinline__ uint32_t e4m3_from_f32(float s) {
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(0.0f), "f"(s));
  return d & 0xFFu;
}

// E4M3 byte -> fp32 (exact; every E4M3 value is an fp16 value).
__device__ __forceinline__ float f32_from_e4m3(uint32_t b) {
  uint32_t h2;
  unsigned short in = (unsigned short)b;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  return __half2float(__ushort_as_half((unsigned short)(h2 & 0xFFFFu)));
}

// Exact 2^k from exponent bits, for the k this file needs (k in [-127, 127]).
__device__ __forceinline__ float pow2i(int k) {
  return k >= -126 ? __uint_as_float((uint32_t)(k + 127) << 23) : __uint_as_float(0x00400000u);
}

// 32-bit n / d for n < 2^31 by multiply-high (Granlund-Montgomery); the host fills mult/shift.
struct FastDiv {
  uint32_t d, mult, shift;
};
__device__ __forceinline__ uint32_t fdiv(uint32_t n, const FastDiv& f) {
  return (__umulhi(n, f.mult) + n) >> f.shift;
}

// Offset of scale (m, kb) in the 128x4 layout of SPEC.md section 6.
__device__ __forceinline__ uint64_t swz_offset(uint32_t m, uint32_t kb, uint32_t nbp) {
  return (uint64_t)(m >> 7) * ((uint64_t)(nbp >> 2) * 512u) + (uint64_t)(kb >> 2) * 512u +
         (m & 31u) * 16u + ((m & 127u) >> 5) * 4u + (kb & 3u);
}

// ------------------------------------------------------------------------------------------------
// Loads: 16 elements as fp32, plus the bit pattern of max|x| (NaN/Inf propagate as large patterns)
// ------------------------------------------------------------------------------------------------

// Raw 16-byte vectors of one group (GROUP elements) and the loads that fill them.
template <int DT>
struct Raw {
  static constexpr int NV = GROUP * Elem<DT>::size / 16;  // 4 (bf16/fp16) or 8 (fp32)
  uint4 q[NV];
};

// Load group g of a matrix (only its first 16 elements when the matrix ends there).
template <int DT>
__device__ __forceinline__ void load_group(const uint8_t* xb, int64_t g, int64_t n, Raw<DT>& r) {
  constexpr int NV = Raw<DT>::NV;
  const uint8_t* p = xb + g * GROUP * Elem<DT>::size;
  const bool full = g * GROUP + GROUP <= n;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (j < NV / 2 || full) r.q[j] = ldg16(p + 16 * j);
  }
}

// 16 elements (chunk c of a group) as fp32, plus the bit pattern of max|x| (NaN/Inf propagate as
// large patterns).
template <int DT>
__device__ __forceinline__ void decode16(const Raw<DT>& r, int c, float v[16], uint32_t& amax_bits) {
  if constexpr (DT == DT_F32) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 u = r.q[4 * c + j];
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[4 * j + k] = __uint_as_float(w[k]);
        m = max(m, w[k] & 0x7FFFFFFFu);
      }
    }
    amax_bits = m;
  } else {
    const uint4 u0 = r.q[2 * c], u1 = r.q[2 * c + 1];
    const uint32_t w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
    uint32_t m = w[0] & 0x7FFF7FFFu;
#pragma unroll
    for (int i = 1; i < 8; ++i) m = vmax_u16x2(m, w[i] & 0x7FFF7FFFu);
    const uint32_t h = max(m & 0xFFFFu, m >> 16);
    if constexpr (DT == DT_BF16) {
      amax_bits = h << 16;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
      }
    } else {
      amax_bits = __float_as_uint(__half2float(__ushort_as_half((unsigned short)h)));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
      }
    }
  }
}

// SPEC.md section 4: butterflies h = 1, 2, 4, 8 in this order (the * 0.25 is separate, below).
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

// Had16 = butterflies, then * 0.25. Its own inverse.
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
__device__ __forceinline__ bool fold_quarter(float r) {
  return r == 0.0f || (r >= 0x1p-122f && r < 0x1p121f);
}

// ------------------------------------------------------------------------------------------------
// E2M1
// ------------------------------------------------------------------------------------------------

#if !FP4C_HW_E2M1
// Software E2M1 magnitude (sm_90 and older), as fp32 bits 0x4B000000 + idx, from y2 = |y| / 2.
// idx = R1 + R2 + R3 with R1 = rne(min(2a, 4)), R2 = rne(clamp(a - 2, 0, 2)), R3 = rne(clamp(a/2 - 2,
// 0, 1)), a = |y|. Each clamp is a .SAT (to [0, 1]) of an exact fp32 value; each rne is the magic
// add of 2^23 (ulp 1) and is exact with ties to even because the running sum it lands on is even
// whenever the new term is non-zero (R1 = 4 once a > 2, R1 + R2 = 6 once a > 4). This equals
// SPEC.md's predicate sum on every fp32 input (checked exhaustively by fp4c_e2m1_selftest).
// Seven FP32-pipe operations, no compares: the predicate sum costs ~14 ALU-pipe ones.
__device__ __forceinline__ uint32_t e2m1_mag_sw(float y2) {
  const float u1 = __saturatef(y2);
  float t = __fmaf_rn(u1, 4.0f, 8388608.0f);
  const float u2 = __saturatef(__fadd_rn(y2, -1.0f));
  t = __fmaf_rn(u2, 2.0f, t);
  const float u3 = __saturatef(__fadd_rn(y2, -2.0f));
  t = __fadd_rn(t, u3);
  return __float_as_uint(t);
}
#endif

// SPEC.md's predicate sum, as written there (the self test compares the fast paths with it).
__device__ __forceinline__ uint32_t e2m1_spec(float y) {
  const float a = fabsf(y);
  const uint32_t idx = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                       (a >= 3.5f) + (a > 5.0f);
  return idx | ((__float_as_uint(y) >> 28) & 8u);
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
#endif

// Eight values v (pre-scale) and the block multiplier r -> eight packed codes. The code's sign is
// the sign bit of y = v * r, which is v's because r >= 0.
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
  // Sign bits: replicate each value's sign into a byte (prmt sign mode), odd elements in H, even in
  // L, then interleave nibbles and keep bit 3 of each.
  const uint32_t* b = reinterpret_cast<const uint32_t*>(v);
  const uint32_t l = prmt(prmt(b[0], b[2], 0xFBu), prmt(b[4], b[6], 0xFBu), 0x5410u);
  const uint32_t hh = prmt(prmt(b[1], b[3], 0xFBu), prmt(b[5], b[7], 0xFBu), 0x5410u);
  const uint32_t s = (hh & 0xF0F0F0F0u) | (l & 0x0F0F0F0Fu);
  return acc | (s & 0x88888888u);
#endif
}

// ------------------------------------------------------------------------------------------------
// Scales
// ------------------------------------------------------------------------------------------------

// NVFP4: s = (gs * bmax) / 6 -> E4M3 byte; r = gs / sf (0 for sf == 0), clamped to FLT_MAX.
__device__ __forceinline__ float nvfp4_scale(float gs, uint32_t bmax_bits, uint32_t& byte) {
  const float s = __fdiv_rn(__fmul_rn(gs, __uint_as_float(bmax_bits)), 6.0f);
  byte = e4m3_from_f32(s);
  const float sf = f32_from_e4m3(byte);
  return sf > 0.0f ? fminf(__fdiv_rn(gs, sf), FLT_MAX) : 0.0f;
}

// MXFP4: e = clamp(exponent_field(bmax) - 2, 0, 254); multiplier 2^(127 - e) from bits.
__device__ __forceinline__ float mxfp4_scale(uint32_t bmax_bits, uint32_t& byte) {
  const int field = (int)((bmax_bits >> 23) & 0xFFu);
  const int e = min(max(field - 2, 0), 254);
  byte = (uint32_t)e;
  return pow2i(127 - e);
}

struct ScaleOut {
  uint8_t* base;      // scale bytes of matrix 0
  uint64_t mstride;   // bytes per matrix
  int swizzle;
  FastDiv nb;         // blocks per row
  uint32_t nbp;       // padded blocks per row
};

__device__ __forceinline__ uint32_t load_scale(const uint8_t* base, const ScaleOut& so, uint64_t b,
                                               uint32_t bi) {
  const uint8_t* p = base + b * so.mstride;
  if (!so.swizzle) return p[bi];
  const uint32_t m = fdiv(bi, so.nb);
  const uint32_t kb = bi - m * so.nb.d;
  return p[swz_offset(m, kb, so.nbp)];
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

struct QuantArgs {
  const uint8_t* x;
  uint8_t* packed;
  const float* gs;  // [B] (NVFP4) or null
  int* flag;        // set to 1 when a block holds NaN/Inf
  int64_t B;
  int64_t n;        // elements per matrix (M * K)
  int64_t groups;   // ceil(n / GROUP)
  ScaleOut so;
};

// One group (raw data loaded): its two 16-element chunks (one if !full), rotated if ROT, scaled and
// encoded. Out: codes[4] (16 bytes), the scale byte(s) (NVFP4: one per chunk; MXFP4: sb[0]).
// Returns true when a block held NaN/Inf.
template <int DT, int FMT, bool ROT>
__device__ __forceinline__ bool encode_group(const Raw<DT>& raw, bool full, float gs, uint32_t codes[4],
                                             uint32_t sb[2]) {
  bool bad = false;
  if constexpr (FMT == FMT_NVFP4) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (c == 1 && !full) break;
      float v[16];
      uint32_t mb;
      decode16<DT>(raw, c, v, mb);
      if constexpr (ROT) {
        butterflies16(v);
        mb = amax16_rotated(v);
      }
      bad |= mb >= 0x7F800000u;
      float r = nvfp4_scale(gs, mb, sb[c]);
      if constexpr (ROT) {
        if (fold_quarter(r)) r = __fmul_rn(r, 0.25f);
        else scale16(v, 0.25f);
      }
      codes[2 * c] = encode8(v, r);
      codes[2 * c + 1] = encode8(v + 8, r);
    }
  } else {
    float v[32];
    uint32_t m0, m1;
    decode16<DT>(raw, 0, v, m0);
    decode16<DT>(raw, 1, v + 16, m1);
    if constexpr (ROT) {
      butterflies16(v);
      butterflies16(v + 16);
      m0 = amax16_rotated(v);
      m1 = amax16_rotated(v + 16);
    }
    const uint32_t mb = max(m0, m1);
    bad = mb >= 0x7F800000u;
    float r = mxfp4_scale(mb, sb[0]);
    if constexpr (ROT) {
      if (fold_quarter(r)) {
        r = __fmul_rn(r, 0.25f);
      } else {
        scale16(v, 0.25f);
        scale16(v + 16, 0.25f);
      }
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) codes[w] = encode8(v + 8 * w, r);
  }
  return bad;
}

__device__ __forceinline__ void store_codes(uint8_t* op, bool full, const uint32_t codes[4]) {
  if (full && ((reinterpret_cast<uintptr_t>(op) & 15) == 0)) {
    stg16(op, make_uint4(codes[0], codes[1], codes[2], codes[3]));
  } else {
    stg8(op, make_uint2(codes[0], codes[1]));
    if (full) stg8(op + 8, make_uint2(codes[2], codes[3]));
  }
}

// Linear scale layout: a matrix is a flat run of groups; group g's scales are bytes 2g, 2g+1
// (NVFP4) or g (MXFP4) of the matrix's scale row-major array.
template <int DT, int FMT, bool ROT>
__device__ __forceinline__ void quantize_linear_group(const QuantArgs& a, int64_t b, int64_t g, const Raw<DT>& raw,
                                                      float gs) {
  const bool full = g * GROUP + GROUP <= a.n;  // else only the first 16 (NVFP4, n % 32 == 16)
  uint32_t codes[4], sb[2];
  if (encode_group<DT, FMT, ROT>(raw, full, gs, codes, sb)) *(volatile int*)a.flag = 1;
  uint8_t* sp = a.so.base + b * a.so.mstride;
  if constexpr (FMT == FMT_NVFP4) {
    sp[2 * g] = (uint8_t)sb[0];
    if (full) sp[2 * g + 1] = (uint8_t)sb[1];
  } else {
    sp[g] = (uint8_t)sb[0];
  }
  store_codes(a.packed + (b * a.n + g * GROUP) / 2, full, codes);
}

// Mode 0 (default): one group per thread, a CTA per 256 groups; the hardware block scheduler
// balances the tail. Mode 1: a persistent grid-stride loop that loads the next group before
// computing the current one (measured slower on the H100: see benchmarks/NOTES.md).
template <int DT, int FMT, bool ROT>
__global__ void __launch_bounds__(THREADS) quantize_kernel(const QuantArgs a) {
  const int64_t g = (int64_t)blockIdx.x * THREADS + threadIdx.x;
  if (g >= a.groups) return;
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const float gs = FMT == FMT_NVFP4 ? a.gs[b] : 0.0f;
    Raw<DT> raw;
    load_group<DT>(a.x + b * a.n * Elem<DT>::size, g, a.n, raw);
    quantize_linear_group<DT, FMT, ROT>(a, b, g, raw, gs);
  }
}

template <int DT, int FMT, bool ROT>
__global__ void __launch_bounds__(THREADS) quantize_persistent_kernel(const QuantArgs a) {
  constexpr int NV = Raw<DT>::NV;
  const int64_t stride = (int64_t)gridDim.x * THREADS;
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const uint8_t* xb = a.x + b * a.n * Elem<DT>::size;
    const float gs = FMT == FMT_NVFP4 ? a.gs[b] : 0.0f;
    int64_t g = (int64_t)blockIdx.x * THREADS + threadIdx.x;
    Raw<DT> cur;
    if (g < a.groups) load_group<DT>(xb, g, a.n, cur);
    while (g < a.groups) {
      const int64_t gn = g + stride;
      Raw<DT> nxt;
      if (gn < a.groups) load_group<DT>(xb, gn, a.n, nxt);
      quantize_linear_group<DT, FMT, ROT>(a, b, g, cur, gs);
#pragma unroll
      for (int j = 0; j < NV; ++j) cur.q[j] = nxt.q[j];
      g = gn;
    }
  }
}

// Swizzled scale layout: one CTA per 512-byte tile of the 128x4 layout (128 rows x 4 blocks), so
// each tile is written whole by one CTA (full sectors, no read-modify-write in L2) and the padding
// (rows >= M, blocks >= nb) is written as zeros by the threads that own it: no memset, no tail
// logic. Thread t owns row t/2 of the tile and blocks 2(t%2), 2(t%2)+1 (NVFP4: one 32-element
// group; MXFP4: two groups), i.e. 2 scale bytes at one 2-byte-aligned offset.
struct TileArgs {
  const uint8_t* x;
  uint8_t* packed;
  uint8_t* scale;
  const float* gs;
  int* flag;
  int64_t B, M, K, nb, nbp, mstride;
};

template <int DT, int FMT, bool ROT>
__global__ void __launch_bounds__(THREADS) quantize_swizzled_kernel(const TileArgs a) {
  constexpr int BS = FMT == FMT_NVFP4 ? 16 : 32;
  const int64_t tiles_k = a.nbp / 4;
  const int64_t mt = blockIdx.x / tiles_k, kt = blockIdx.x - mt * tiles_k;
  const int r = threadIdx.x >> 1;
  const int64_t m = mt * 128 + r;
  const int64_t kb0 = kt * 4 + 2 * (threadIdx.x & 1);
  const int off = (r & 31) * 16 + (r >> 5) * 4 + 2 * (threadIdx.x & 1);
  const int64_t n = a.M * a.K;
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const uint8_t* xb = a.x + b * n * Elem<DT>::size;
    const float gs = FMT == FMT_NVFP4 ? a.gs[b] : 0.0f;
    uint32_t s2[2] = {0, 0};
    bool bad = false;
    constexpr int NG = FMT == FMT_NVFP4 ? 1 : 2;  // groups per thread
#pragma unroll
    for (int u = 0; u < NG; ++u) {
      const int64_t kb = kb0 + u;
      if (m < a.M && kb < a.nb) {
        const int64_t e = m * a.K + kb * BS;  // first element of the group
        const bool full = FMT == FMT_MXFP4 || kb + 1 < a.nb;
        Raw<DT> raw;
        const uint8_t* p = xb + e * Elem<DT>::size;
#pragma unroll
        for (int j = 0; j < Raw<DT>::NV; ++j)
          if (j < Raw<DT>::NV / 2 || full) raw.q[j] = ldg16(p + 16 * j);
        uint32_t codes[4], sb[2] = {0, 0};
        bad |= encode_group<DT, FMT, ROT>(raw, full, gs, codes, sb);
        if constexpr (FMT == FMT_NVFP4) {
          s2[0] = sb[0];
          s2[1] = full ? sb[1] : 0u;
        } else {
          s2[u] = sb[0];
        }
        store_codes(a.packed + (b * n + e) / 2, full, codes);
      }
    }
    if (bad) *(volatile int*)a.flag = 1;
    *reinterpret_cast<uint16_t*>(a.scale + b * a.mstride + (int64_t)blockIdx.x * 512 + off) =
        (uint16_t)(s2[0] | (s2[1] << 8));
  }
}

struct DequantArgs {
  const uint8_t* packed;
  const uint8_t* scale;
  const float* gs;
  uint8_t* out;
  int64_t B;
  int64_t n;
  int64_t groups;
  ScaleOut so;  // layout of the scales being read (base unused)
};

// Eight codes -> fp32 values * d, exact (w = RN(value(code) * d)).
// Fast path (d < 2^120): an E2M1 code (s, e, m) placed in an E4M3 byte as s<<7 | e<<3 | m<<2 has
// exactly value(code) / 64 for all 16 codes (the subnormal e = 0 case included), so the hardware
// E4M3 -> f16x2 conversion decodes two codes per instruction and RN(e4m3 * (64 d)) = RN(value * d)
// (64 d exact below 2^120). Slow path (per block, only for amax > ~8e36): the codes' magnitude bits
// at fp32 bits 22..24 form value(code) * 2^-126 (subnormal or tiny), then * 2^126 (exact), then * d.
__device__ __forceinline__ void decode8(uint32_t w, float d, float* o) {
  if (d < 0x1p120f) {
    const float d64 = __fmul_rn(d, 64.0f);
    const uint32_t lo = ((w & 0x07070707u) << 2) | ((w << 4) & 0x80808080u);  // elements 0, 2, 4, 6
    const uint32_t hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);         // elements 1, 3, 5, 7
    const uint32_t p[2] = {__byte_perm(lo, hi, 0x5140), __byte_perm(lo, hi, 0x7362)};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t h2;
      const unsigned short in = (unsigned short)(p[k >> 1] >> (16 * (k & 1)));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
      o[2 * k] = __fmul_rn(f.x, d64);
      o[2 * k + 1] = __fmul_rn(f.y, d64);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t q = (w >> (4 * i)) & 0xFu;
    const uint32_t bits = ((q & 7u) << 22) | ((q & 8u) << 28);
    o[i] = __fmul_rn(__fmul_rn(__uint_as_float(bits), 0x1p126f), d);
  }
}

// 16 fp32 values -> 16 elements of the output dtype, as 16-byte vectors q[0..16*ES/16).
template <int DT>
__device__ __forceinline__ void pack16(const float v[16], uint4* q) {
  if constexpr (DT == DT_F32) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      q[j] = make_uint4(__float_as_uint(v[4 * j]), __float_as_uint(v[4 * j + 1]), __float_as_uint(v[4 * j + 2]),
                        __float_as_uint(v[4 * j + 3]));
  } else {
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (DT == DT_BF16) {
        const __nv_bfloat162 t = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&t);
      } else {
        const __half2 t = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&t);
      }
    }
    q[0] = make_uint4(w[0], w[1], w[2], w[3]);
    q[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// Dequantize: each thread decodes one group (32 elements, 16 bytes of codes, coalesced loads); the
// warp then stores its 32 groups through shared memory so that every store instruction writes 512
// contiguous bytes (a thread's own 64-byte run would be 16-byte pieces 64 bytes apart, which halves
// the write rate). The staging index is XOR-swizzled so both sides are free of bank conflicts.
template <int DT, int FMT, bool ROT>
__global__ void __launch_bounds__(THREADS) dequantize_kernel(const DequantArgs a) {
  constexpr int ES = Elem<DT>::size;
  constexpr int NV = GROUP * ES / 16;  // 16-byte output vectors per group: 4 or 8
  constexpr int EPV = 16 / ES;         // elements per vector
  __shared__ uint4 stage[THREADS / 32][32 * NV];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* st = stage[warp];
  const int64_t stride = (int64_t)gridDim.x * THREADS;
  auto phys = [](int t, int c) { return t * NV + (c ^ (NV == 4 ? ((t >> 1) & 3) : (t & 7))); };
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const float gs = FMT == FMT_NVFP4 ? a.gs[b] : 0.0f;
    uint8_t* ob = a.out + b * a.n * ES;
    for (int64_t gw = (int64_t)blockIdx.x * THREADS + warp * 32; gw < a.groups; gw += stride) {
      const int64_t g = gw + lane;
      if (g < a.groups) {
        const bool full = g * GROUP + GROUP <= a.n;
        const uint8_t* pp = a.packed + (b * a.n + g * GROUP) / 2;
        uint32_t w[4];
        if (full && ((reinterpret_cast<uintptr_t>(pp) & 15) == 0)) {
          const uint4 u = ldg16(pp);
          w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
        } else {
          const uint2 u = ldg8(pp);
          w[0] = u.x; w[1] = u.y;
          w[2] = w[3] = 0;
          if (full) {
            const uint2 t = ldg8(pp + 8);
            w[2] = t.x; w[3] = t.y;
          }
        }
        float d[2];
        if constexpr (FMT == FMT_NVFP4) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const uint32_t sb = (c == 1 && !full) ? 0u : load_scale(a.scale, a.so, b, (uint32_t)(2 * g + c));
            d[c] = __fdiv_rn(f32_from_e4m3(sb), gs);
          }
        } else {
          const uint32_t e = load_scale(a.scale, a.so, b, (uint32_t)g);
          d[0] = d[1] = pow2i((int)e - 127);
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float v[16];
          decode8(w[2 * c], d[c], v);
          decode8(w[2 * c + 1], d[c], v + 8);
          if constexpr (ROT) had16(v);
          uint4 q[NV / 2];
          pack16<DT>(v, q);
#pragma unroll
          for (int j = 0; j < NV / 2; ++j) st[phys(lane, c * NV / 2 + j)] = q[j];
        }
      }
      __syncwarp();
      const int64_t e0 = gw * GROUP;  // first element of this warp's tile
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int u = lane + 32 * j;
        const int64_t e = e0 + (int64_t)u * EPV;
        if (e < a.n) stg16(ob + e * ES, st[phys(u / NV, u % NV)]);
      }
      __syncwarp();
    }
  }
}

// amax: grid (X, min(B, 65535)); each CTA reduces its slice of one matrix and does one atomicMax
// on the fp32 bit pattern (non-negative floats order like their bits; NaN sorts above Inf).
template <int DT, bool ROT>
__global__ void __launch_bounds__(THREADS) amax_kernel(const uint8_t* x, int64_t B, int64_t n,
                                                       uint32_t* out) {
  constexpr int ES = Elem<DT>::size;
  __shared__ uint32_t red[THREADS / 32];
  for (int64_t b = blockIdx.y; b < B; b += gridDim.y) {
    const uint8_t* xb = x + b * n * ES;
    uint32_t m = 0;
    if constexpr (!ROT) {
      // Coalesced: 16-byte vectors, four in flight per thread.
      const int64_t nvec = n * ES / 16;
      const int64_t stride = (int64_t)gridDim.x * THREADS;
      int64_t i = (int64_t)blockIdx.x * THREADS + threadIdx.x;
      for (; i + 3 * stride < nvec; i += 4 * stride) {
        uint4 u[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) u[j] = ldg16(xb + 16 * (i + j * stride));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t w[4] = {u[j].x, u[j].y, u[j].z, u[j].w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if constexpr (DT == DT_F32) m = max(m, w[k] & 0x7FFFFFFFu);
            else m = vmax_u16x2(m, w[k] & 0x7FFF7FFFu);
          }
        }
      }
      for (; i < nvec; i += stride) {
        const uint4 u = ldg16(xb + 16 * i);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (DT == DT_F32) m = max(m, w[k] & 0x7FFFFFFFu);
          else m = vmax_u16x2(m, w[k] & 0x7FFF7FFFu);
        }
      }
      if constexpr (DT == DT_BF16) {
        m = max(m & 0xFFFFu, m >> 16) << 16;
      } else if constexpr (DT == DT_F16) {
        m = __float_as_uint(__half2float(__ushort_as_half((unsigned short)max(m & 0xFFFFu, m >> 16))));
      }
    } else {
      // Had16 needs 16 consecutive elements per thread: two groups of 16 per iteration.
      const int64_t nchunk = n / 16;
      const int64_t stride = (int64_t)gridDim.x * THREADS;
      for (int64_t c = ((int64_t)blockIdx.x * THREADS + threadIdx.x) * 2; c < nchunk; c += 2 * stride) {
        Raw<DT> raw;
        load_group<DT>(xb, c / 2, n, raw);
        float v[16];
        uint32_t dummy;
        decode16<DT>(raw, 0, v, dummy);
        butterflies16(v);
        m = max(m, amax16_rotated(v));
        if (c + 1 < nchunk) {
          decode16<DT>(raw, 1, v, dummy);
          butterflies16(v);
          m = max(m, amax16_rotated(v));
        }
      }
    }
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t t = red[0];
#pragma unroll
      for (int i = 1; i < THREADS / 32; ++i) t = max(t, red[i]);
      atomicMax(out + b, t);
    }
    __syncthreads();
  }
}

// Exhaustive check of the E2M1 path this target compiles (software or hardware) against SPEC.md's
// predicate sum, over fp32 bit patterns [start, start + count) (NaN patterns skipped).
__global__ void e2m1_selftest_kernel(uint64_t start, uint64_t count,
                                     unsigned long long* mismatches) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride * 8) {
    float v[8];
    uint32_t want = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint64_t j = i + k * stride;
      uint32_t bits = (uint32_t)(start + (j < count ? j : 0));
      if ((bits & 0x7FFFFFFFu) > 0x7F800000u) bits = 0;  // NaN: not an input
      v[k] = __uint_as_float(bits);
      want |= e2m1_spec(v[k]) << (4 * k);
    }
    const uint32_t got = encode8(v, 1.0f);
    bad += got != want;
  }
  if (bad) atomicAdd(mismatches, bad);
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

FastDiv make_fastdiv(uint32_t d) {
  FastDiv f;
  f.d = d;
  uint32_t s = 0;
  while ((1ull << s) < d) ++s;
  f.shift = s;
  f.mult = (uint32_t)(((1ull << 32) * ((1ull << s) - d)) / d + 1);
  return f;
}

int sm_count() {
  static int count = 0;
  if (!count) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
    if (count <= 0) count = 132;
  }
  return count;
}

// Tuning switches, for A/B runs of the benchmark (fp4c_set_tuning); the defaults are the winners.
int g_tune[4] = {0, 0, 0, 0};
enum : int { TUNE_QUANT_PERSISTENT = 0, TUNE_UNBALANCED_GRID = 1, TUNE_PERSISTENT_GRID = 3 };

// Grid for the grid-stride kernels (amax, dequantize, the A/B persistent quantize). Default: one work
// unit per thread, as many CTAs as the work needs, the hardware block scheduler balancing the tail
// (measured best: see benchmarks/NOTES.md). Persistent: at most one full wave of resident CTAs (from the
// occupancy calculator) spread over min(B, 65535) matrices; balanced, i.e. the threads trimmed so that
// every thread runs the same number of grid-stride iterations.
template <typename Kernel>
dim3 work_grid(Kernel kernel, int64_t work_per_matrix, int64_t B, bool persistent) {
  const int64_t by = B < 65535 ? B : 65535;
  int64_t bx = (work_per_matrix + THREADS - 1) / THREADS;
  if (bx < 1) bx = 1;
  if (!persistent) return dim3((unsigned)bx, (unsigned)by);
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, THREADS, 0) != cudaSuccess || per_sm < 1)
    per_sm = 1;
  const int64_t wave = (int64_t)sm_count() * per_sm;
  const int64_t cap = (wave + by - 1) / by;
  if (bx > cap) {
    bx = cap;
    if (!g_tune[TUNE_UNBALANCED_GRID]) {
      const int64_t iters = (work_per_matrix + bx * THREADS - 1) / (bx * THREADS);
      const int64_t threads = (work_per_matrix + iters - 1) / iters;
      bx = (threads + THREADS - 1) / THREADS;
    }
  }
  if (bx < 1) bx = 1;
  return dim3((unsigned)bx, (unsigned)by);
}

ScaleOut make_scale_layout(uint8_t* base, int64_t M, int64_t nb, int swizzle) {
  ScaleOut so;
  so.base = base;
  so.swizzle = swizzle;
  so.nb = make_fastdiv((uint32_t)nb);
  so.nbp = (uint32_t)((nb + 3) / 4 * 4);
  const int64_t mp = (M + 127) / 128 * 128;
  so.mstride = swizzle ? (uint64_t)(mp * so.nbp) : (uint64_t)(M * nb);
  return so;
}

template <int DT, int FMT, bool ROT>
void launch_quantize_linear(const QuantArgs& a, cudaStream_t st) {
  if (g_tune[TUNE_QUANT_PERSISTENT]) {
    const auto k = quantize_persistent_kernel<DT, FMT, ROT>;
    k<<<work_grid(k, a.groups, a.B, true), THREADS, 0, st>>>(a);
  } else {
    const dim3 grid((unsigned)((a.groups + THREADS - 1) / THREADS), (unsigned)(a.B < 65535 ? a.B : 65535));
    quantize_kernel<DT, FMT, ROT><<<grid, THREADS, 0, st>>>(a);
  }
}

template <int DT, int FMT>
cudaError_t launch_quantize_dt(const QuantArgs& a, const TileArgs& t, int rotate, int swizzle, cudaStream_t st) {
  if (swizzle) {
    const dim3 grid((unsigned)((t.mstride) / 512), (unsigned)(t.B < 65535 ? t.B : 65535));
    if (rotate) quantize_swizzled_kernel<DT, FMT, true><<<grid, THREADS, 0, st>>>(t);
    else quantize_swizzled_kernel<DT, FMT, false><<<grid, THREADS, 0, st>>>(t);
  } else {
    if (rotate) launch_quantize_linear<DT, FMT, true>(a, st);
    else launch_quantize_linear<DT, FMT, false>(a, st);
  }
  return cudaGetLastError();
}

template <int DT, int FMT>
cudaError_t launch_dequantize_dt(const DequantArgs& a, int rotate, cudaStream_t st) {
  if (rotate) {
    const auto k = dequantize_kernel<DT, FMT, true>;
    k<<<work_grid(k, a.groups, a.B, g_tune[TUNE_PERSISTENT_GRID]), THREADS, 0, st>>>(a);
  } else {
    const auto k = dequantize_kernel<DT, FMT, false>;
    k<<<work_grid(k, a.groups, a.B, g_tune[TUNE_PERSISTENT_GRID]), THREADS, 0, st>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

// Error codes beyond cudaError_t: bad arguments.
#define FP4C_EINVAL 100000

FP4C_API int fp4c_abi_version() { return 1; }

// The launchers run on the calling thread's current device of this library's own CUDA runtime;
// the caller makes it the tensors' device first.
FP4C_API int fp4c_set_device(int device) { return cudaSetDevice(device); }

// A/B switches for benchmarks (key: 0 persistent linear quantize, 1 unbalanced persistent grids,
// 3 persistent (one-wave) grids for amax / dequantize instead of one work unit per thread).
FP4C_API int fp4c_set_tuning(int key, int value) {
  if (key < 0 || key >= 4) return FP4C_EINVAL;
  g_tune[key] = value;
  return 0;
}

FP4C_API const char* fp4c_error_string(int code) {
  if (code == FP4C_EINVAL) return "fp4convert kernel launcher: invalid argument";
  return cudaGetErrorString((cudaError_t)code);
}

// x: [B, n] contiguous; out: uint32 [B] (fp32 bit patterns), zeroed here.
FP4C_API int fp4c_amax(const void* x, int dtype, int rotate, int64_t B, int64_t n, uint32_t* out,
                       void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (B <= 0 || n < 0 || n % 16) return FP4C_EINVAL;
  cudaError_t err = cudaMemsetAsync(out, 0, B * sizeof(uint32_t), st);
  if (err != cudaSuccess || n == 0) return err;
  const int64_t work = rotate ? (n / 32 + 1) : (n * (dtype == DT_F32 ? 4 : 2) / 16 / 4 + 1);
  const uint8_t* xp = (const uint8_t*)x;
#define FP4C_AMAX(DT)                                                                   \
  if (rotate) {                                                                         \
    const auto k = amax_kernel<DT, true>;                                               \
    k<<<work_grid(k, work, B, g_tune[TUNE_PERSISTENT_GRID]), THREADS, 0, st>>>(xp, B, n, out);                  \
  } else {                                                                              \
    const auto k = amax_kernel<DT, false>;                                              \
    k<<<work_grid(k, work, B, g_tune[TUNE_PERSISTENT_GRID]), THREADS, 0, st>>>(xp, B, n, out);                  \
  }
  switch (dtype) {
    case DT_F32: FP4C_AMAX(DT_F32); break;
    case DT_F16: FP4C_AMAX(DT_F16); break;
    case DT_BF16: FP4C_AMAX(DT_BF16); break;
    default: return FP4C_EINVAL;
  }
#undef FP4C_AMAX
  return cudaGetLastError();
}

// x: [B, M, K]; packed: [B, M, K/2]; scale: [B, M, K/bs] or [B, Mp, nbp]; gs: fp32 [B] (NVFP4);
// flag: int32, zeroed here, set to 1 if any block holds NaN/Inf.
FP4C_API int fp4c_quantize(const void* x, int dtype, int fmt, int rotate, int swizzle, int64_t B,
                           int64_t M, int64_t K, const float* gs, uint8_t* packed, uint8_t* scale,
                           int* flag, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  const int bs = fmt == FMT_NVFP4 ? 16 : 32;
  if (B <= 0 || M < 0 || K < 0 || K % bs || (fmt == FMT_NVFP4 && !gs)) return FP4C_EINVAL;
  const int64_t n = M * K;
  const int64_t nb = K / bs;
  cudaError_t err = cudaMemsetAsync(flag, 0, sizeof(int), st);  // cheaper than a fill kernel
  if (err != cudaSuccess || n == 0) return err;
  if (swizzle && M * nb >= (1ll << 31)) return FP4C_EINVAL;
  QuantArgs a;
  a.x = (const uint8_t*)x;
  a.packed = packed;
  a.gs = gs;
  a.flag = flag;
  a.B = B;
  a.n = n;
  a.groups = (n + GROUP - 1) / GROUP;
  a.so = make_scale_layout(scale, M, nb, swizzle);
  TileArgs t;
  t.x = a.x;
  t.packed = packed;
  t.scale = scale;
  t.gs = gs;
  t.flag = flag;
  t.B = B;
  t.M = M;
  t.K = K;
  t.nb = nb;
  t.nbp = a.so.nbp;
  t.mstride = (int64_t)a.so.mstride;
  if (swizzle && t.mstride / 512 >= (1ll << 31)) return FP4C_EINVAL;
#define FP4C_Q(DT)                                                                       \
  return fmt == FMT_NVFP4 ? launch_quantize_dt<DT, FMT_NVFP4>(a, t, rotate, swizzle, st) \
                          : launch_quantize_dt<DT, FMT_MXFP4>(a, t, rotate, swizzle, st);
  switch (dtype) {
    case DT_F32: FP4C_Q(DT_F32);
    case DT_F16: FP4C_Q(DT_F16);
    case DT_BF16: FP4C_Q(DT_BF16);
    default: return FP4C_EINVAL;
  }
#undef FP4C_Q
}

// packed: [B, M, K/2]; scale as written by fp4c_quantize; out: [B, M, K] of out_dtype.
FP4C_API int fp4c_dequantize(const uint8_t* packed, const uint8_t* scale, const float* gs, int fmt,
                             int rotate, int swizzle, int64_t B, int64_t M, int64_t K, void* out,
                             int out_dtype, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  const int bs = fmt == FMT_NVFP4 ? 16 : 32;
  if (B <= 0 || M < 0 || K < 0 || K % bs || (fmt == FMT_NVFP4 && !gs)) return FP4C_EINVAL;
  const int64_t n = M * K;
  const int64_t nb = K / bs;
  if (n == 0) return cudaSuccess;
  if (swizzle && M * nb >= (1ll << 31)) return FP4C_EINVAL;
  DequantArgs a;
  a.packed = packed;
  a.scale = scale;
  a.gs = gs;
  a.out = (uint8_t*)out;
  a.B = B;
  a.n = n;
  a.groups = (n + GROUP - 1) / GROUP;
  a.so = make_scale_layout(nullptr, M, nb, swizzle);
#define FP4C_D(DT)                                                                       \
  return fmt == FMT_NVFP4 ? launch_dequantize_dt<DT, FMT_NVFP4>(a, rotate, st)          \
                          : launch_dequantize_dt<DT, FMT_MXFP4>(a, rotate, st);
  switch (out_dtype) {
    case DT_F32: FP4C_D(DT_F32);
    case DT_F16: FP4C_D(DT_F16);
    case DT_BF16: FP4C_D(DT_BF16);
    default: return FP4C_EINVAL;
  }
#undef FP4C_D
}

// Mismatch count of this target's E2M1 path against SPEC.md's predicate sum over all 2^32 fp32 bit
// patterns (NaNs skipped); `mismatches` is a device counter the caller zeroes.
FP4C_API int fp4c_e2m1_selftest(unsigned long long* mismatches, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  e2m1_selftest_kernel<<<sm_count() * 8, THREADS, 0, st>>>(0, 1ull << 32, mismatches);
  return cudaGetLastError();
}
