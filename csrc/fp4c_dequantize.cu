// fp4convert kernels: dequantize NVFP4 / MXFP4 (reference.nvfp4_dequantize / mxfp4_dequantize),
// optionally undoing Had16, to fp32 / fp16 / bf16. Each warp's output is staged through shared
// memory so its stores are 512 contiguous bytes.

#include "fp4c_layout.cuh"
#include "fp4c_numerics.cuh"

using namespace fp4c;

namespace {

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

template <int DT, int FMT>
cudaError_t launch_dequantize_dt(const DequantArgs& a, int rotate, cudaStream_t st) {
  const dim3 grid = work_grid(a.groups, a.B);
  if (rotate) dequantize_kernel<DT, FMT, true><<<grid, THREADS, 0, st>>>(a);
  else dequantize_kernel<DT, FMT, false><<<grid, THREADS, 0, st>>>(a);
  return cudaGetLastError();
}

}  // namespace

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
