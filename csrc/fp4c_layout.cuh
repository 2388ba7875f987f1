// fp4convert kernels, layout: what every kernel family shares about memory, independent of the
// numerics. Element types, the per-thread work unit, 16-byte loads/stores, the input -> fp32 decode of
// one group, the 128x4 swizzled scale offset (docs/formats.md "The 128x4 scale layout") and the host-side grid helpers.
//
// Work split (quantize): one thread owns GROUP = 32 consecutive elements of one matrix (two NVFP4
// blocks or one MXFP4 block, two Had16 groups), read with 16-byte loads, its 16 bytes of codes written
// with one 16-byte store. Blocks never straddle rows (K % 16 == 0 for NVFP4, K % 32 == 0 for MXFP4),
// so with linear scales a matrix is a flat array of blocks and block i's scale is byte i.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#define FP4C_API extern "C" __attribute__((visibility("default")))
// Error code beyond cudaError_t: a launcher argument is invalid.
#define FP4C_EINVAL 100000

namespace fp4c {

enum : int { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum : int { FMT_NVFP4 = 0, FMT_MXFP4 = 1 };

constexpr int GROUP = 32;     // elements per thread (quantize, dequantize)
constexpr int THREADS = 256;  // threads per CTA

template <int DT>
struct Elem {
  static constexpr int size = DT == DT_F32 ? 4 : 2;
};

// ------------------------------------------------------------------------------------------------
// Loads and stores (read-only inputs through the non-coherent path)
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

// 32-bit n / d for n < 2^31 by multiply-high (Granlund-Montgomery); the host fills mult/shift.
struct FastDiv {
  uint32_t d, mult, shift;
};
__device__ __forceinline__ uint32_t fdiv(uint32_t n, const FastDiv& f) {
  return (__umulhi(n, f.mult) + n) >> f.shift;
}

// Offset of scale (m, kb) in the 128x4 layout of docs/formats.md "The 128x4 scale layout" (nbp: padded blocks per row).
__device__ __forceinline__ uint64_t swz_offset(uint32_t m, uint32_t kb, uint32_t nbp) {
  return (uint64_t)(m >> 7) * ((uint64_t)(nbp >> 2) * 512u) + (uint64_t)(kb >> 2) * 512u +
         (m & 31u) * 16u + ((m & 127u) >> 5) * 4u + (kb & 3u);
}

// ------------------------------------------------------------------------------------------------
// One group of input: raw 16-byte vectors, then 16 elements at a time as fp32
// ------------------------------------------------------------------------------------------------

template <int DT>
struct Raw {
  static constexpr int NV = GROUP * Elem<DT>::size / 16;  // 4 (bf16/fp16) or 8 (fp32)
  uint4 q[NV];
};

// Load group g of a matrix of n elements (only its first 16 elements when the matrix ends there).
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

// max(|a|, |b|) per 16-bit half (bf16 or fp16 pairs), NaN if either is NaN, sign bits meaningless
// (xorsign): one instruction (HMNMX2) where the integer form takes a mask and a max per word.
template <int DT>
__device__ __forceinline__ uint32_t absmax_x2(uint32_t a, uint32_t b) {
  uint32_t d;
  if constexpr (DT == DT_BF16) asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 16 elements (chunk c of a group) as fp32 (exact), plus the bit pattern of max|x| (NaN/Inf
// propagate as large patterns). FAST_MAX (bf16/fp16, sm_90+): the max by absmax_x2, the same bits
// for finite data; a NaN comes out as the canonical NaN (still >= 0x7F800000, so flagged alike), which
// is why the amax kernel (whose NaN result is reported) keeps the integer form.
template <int DT, bool FAST_MAX = false>
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
    uint32_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (FAST_MAX) {
      const uint32_t m = absmax_x2<DT>(absmax_x2<DT>(absmax_x2<DT>(w[0], w[1]), absmax_x2<DT>(w[2], w[3])),
                                       absmax_x2<DT>(absmax_x2<DT>(w[4], w[5]), absmax_x2<DT>(w[6], w[7])));
      h = (absmax_x2<DT>(m, m << 16) >> 16) & 0x7FFFu;  // (bf16: shifted back below; one mask)
    } else
#endif
    {
      uint32_t m = w[0] & 0x7FFF7FFFu;
#pragma unroll
      for (int i = 1; i < 8; ++i) m = vmax_u16x2(m, w[i] & 0x7FFF7FFFu);
      h = max(m & 0xFFFFu, m >> 16);
    }
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

// ------------------------------------------------------------------------------------------------
// Scale layouts
// ------------------------------------------------------------------------------------------------

struct ScaleOut {
  uint8_t* base;      // scale bytes of matrix 0
  uint64_t mstride;   // bytes per matrix
  int swizzle;
  FastDiv nb;         // blocks per row
  uint32_t nbp;       // padded blocks per row
};

// Scale byte of block bi (row-major block index) of matrix b, in either layout.
__device__ __forceinline__ uint32_t load_scale(const uint8_t* base, const ScaleOut& so, uint64_t b,
                                               uint32_t bi) {
  const uint8_t* p = base + b * so.mstride;
  if (!so.swizzle) return p[bi];
  const uint32_t m = fdiv(bi, so.nb);
  const uint32_t kb = bi - m * so.nb.d;
  return p[swz_offset(m, kb, so.nbp)];
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

inline FastDiv make_fastdiv(uint32_t d) {
  FastDiv f;
  f.d = d;
  uint32_t s = 0;
  while ((1ull << s) < d) ++s;
  f.shift = s;
  f.mult = (uint32_t)(((1ull << 32) * ((1ull << s) - d)) / d + 1);
  return f;
}

inline int sm_count() {
  static int count = 0;
  if (!count) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
    if (count <= 0) count = 132;
  }
  return count;
}

// Grid for the grid-stride kernels (amax, dequantize): one work unit per thread, as many CTAs as
// the work needs (x), min(B, 65535) matrices (y); the hardware block scheduler balances the tail
// (measured best against persistent one-wave grids: benchmarks/NOTES.md).
inline dim3 work_grid(int64_t work_per_matrix, int64_t B) {
  const int64_t by = B < 65535 ? B : 65535;
  int64_t bx = (work_per_matrix + THREADS - 1) / THREADS;
  if (bx < 1) bx = 1;
  return dim3((unsigned)bx, (unsigned)by);
}

inline ScaleOut make_scale_layout(uint8_t* base, int64_t M, int64_t nb, int swizzle) {
  ScaleOut so;
  so.base = base;
  so.swizzle = swizzle;
  so.nb = make_fastdiv((uint32_t)nb);
  so.nbp = (uint32_t)((nb + 3) / 4 * 4);
  const int64_t mp = (M + 127) / 128 * 128;
  so.mstride = swizzle ? (uint64_t)(mp * so.nbp) : (uint64_t)(M * nb);
  return so;
}

}  // namespace fp4c
