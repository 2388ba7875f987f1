// fp4convert kernels: decode quantized source checkpoints to fp32 (docs/numerics.md "Quantized inputs"),
// bit for bit with reference.fp8_block_dequantize / fp8_scaled_dequantize /
// mxfp4_blocks_dequantize. The quantizer then takes the fp32 result.
//   fp8_block: w[i, j] = fp32(e4m3[i, j]) * scale_inv[i / bm, j / bn], one fp32 multiply; edge blocks
//     partial; batched over leading dims (each matrix its own scale_inv, or one broadcast to all).
//     fp8_scaled (per tensor / per row) is the same kernel with (bm, bn) = (M, N) / (1, N).
//   mxfp4_blocks (gpt-oss): element 32 g + 2 j is the low nibble of blocks[g, j], 32 g + 2 j + 1 the
//     high one; w = value(code) * 2^(scale - 127) in fp32 (255 is NaN).
// Both write 16 contiguous bytes per thread, 512 per warp instruction.

#include "fp4c_layout.cuh"
#include "fp4c_numerics.cuh"

using namespace fp4c;

namespace {

struct Fp8BlockArgs {
  const uint8_t* w;   // e4m3 [B, M, N]
  const float* s;     // scale_inv [B or 1, ceil(M / bm), ceil(N / bn)]
  float* out;         // [B, M, N]
  int64_t B, n;       // matrices, elements per matrix (M * N < 2^31 - 4)
  int64_t N;
  FastDiv div_n, div_bm, div_bn;
  int64_t s_mstride;  // scale_inv elements per matrix; 0 = one scale_inv for every matrix
  int64_t s_cols;     // ceil(N / bn)
};

// VEC: four elements per thread (N % 4 == 0: they share a row; one 4-byte load, one 16-byte store);
// else one element per thread.
template <bool VEC>
__global__ void __launch_bounds__(THREADS) fp8_block_kernel(const Fp8BlockArgs a) {
  constexpr int PER = VEC ? 4 : 1;
  const int64_t e = ((int64_t)blockIdx.x * THREADS + threadIdx.x) * PER;
  if (e >= a.n) return;
  const uint32_t i = fdiv((uint32_t)e, a.div_n);
  const uint32_t j = (uint32_t)e - i * (uint32_t)a.N;
  const uint32_t c0 = fdiv(j, a.div_bn);
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const float* srow = a.s + b * a.s_mstride + (int64_t)fdiv(i, a.div_bm) * a.s_cols;
    const uint8_t* wp = a.w + b * a.n + e;
    float* op = a.out + b * a.n + e;
    if constexpr (VEC) {
      const uint32_t word = __ldg(reinterpret_cast<const unsigned int*>(wp));
      const float2 f01 = f32x2_from_e4m3x2(word & 0xFFFFu), f23 = f32x2_from_e4m3x2(word >> 16);
      float sc[4];
      sc[0] = __ldg(srow + c0);
      if (fdiv(j + 3, a.div_bn) == c0) {
        sc[1] = sc[2] = sc[3] = sc[0];
      } else {
#pragma unroll
        for (int k = 1; k < 4; ++k) sc[k] = __ldg(srow + fdiv(j + k, a.div_bn));
      }
      const float4 o = make_float4(__fmul_rn(f01.x, sc[0]), __fmul_rn(f01.y, sc[1]), __fmul_rn(f23.x, sc[2]),
                                   __fmul_rn(f23.y, sc[3]));
      stg16(op, make_uint4(__float_as_uint(o.x), __float_as_uint(o.y), __float_as_uint(o.z), __float_as_uint(o.w)));
    } else {
      *op = __fmul_rn(f32_from_e4m3(__ldg(wp)), __ldg(srow + c0));
    }
  }
}

// value(code) * d for four codes (two bytes, element 0 in the low nibble of the first): the code's
// magnitude bits at fp32 bits 22..24 (and its sign at 31) form value * 2^-126 exactly, * 2^126 is
// exact, then one RN multiply by d.
__device__ __forceinline__ float e2m1_times(uint32_t q, float d) {
  const uint32_t bits = ((q & 7u) << 22) | ((q & 8u) << 28);
  return __fmul_rn(__fmul_rn(__uint_as_float(bits), 0x1p126f), d);
}

// One thread per two bytes of blocks (four elements); units = groups * 8.
__global__ void __launch_bounds__(THREADS) mxfp4_blocks_kernel(const uint8_t* blocks, const uint8_t* scales,
                                                               int64_t units, float* out) {
  const int64_t stride = (int64_t)gridDim.x * THREADS;
  for (int64_t u = (int64_t)blockIdx.x * THREADS + threadIdx.x; u < units; u += stride) {
    const uint32_t s = __ldg(scales + (u >> 3));
    const float d = s == 255u ? __uint_as_float(0x7FC00000u) : pow2i((int)s - 127);
    const uint32_t two = __ldg(reinterpret_cast<const unsigned short*>(blocks) + u);
    stg16(out + 4 * u, make_uint4(__float_as_uint(e2m1_times(two, d)), __float_as_uint(e2m1_times(two >> 4, d)),
                                  __float_as_uint(e2m1_times(two >> 8, d)),
                                  __float_as_uint(e2m1_times(two >> 12, d))));
  }
}

}  // namespace

// w: e4m3 bytes [B, M, N]; scale_inv: fp32 [ceil(M/bm), ceil(N/bn)] per matrix, s_mstride elements
// apart (0: shared by all matrices); out: fp32 [B, M, N] (16-byte aligned; w 4-byte aligned).
FP4C_API int fp4c_decode_fp8_block(const uint8_t* w, const float* scale_inv, int64_t B, int64_t M, int64_t N,
                                   int64_t bm, int64_t bn, int64_t s_mstride, float* out, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (B <= 0 || M < 0 || N < 0 || bm <= 0 || bn <= 0 || s_mstride < 0 || bm >= (1ll << 31) ||
      bn >= (1ll << 31))
    return FP4C_EINVAL;
  const int64_t n = M * N;
  if (n == 0) return cudaSuccess;
  if (n >= (1ll << 31) - 4) return FP4C_EINVAL;
  Fp8BlockArgs a;
  a.w = w;
  a.s = scale_inv;
  a.out = out;
  a.B = B;
  a.n = n;
  a.N = N;
  a.div_n = make_fastdiv((uint32_t)N);
  a.div_bm = make_fastdiv((uint32_t)bm);
  a.div_bn = make_fastdiv((uint32_t)bn);
  a.s_mstride = s_mstride;
  a.s_cols = (N + bn - 1) / bn;
  const bool vec = N % 4 == 0;
  const dim3 grid = work_grid(vec ? n / 4 : n, B);
  if (vec) fp8_block_kernel<true><<<grid, THREADS, 0, st>>>(a);
  else fp8_block_kernel<false><<<grid, THREADS, 0, st>>>(a);
  return cudaGetLastError();
}

// blocks: uint8 [G, 16] (2-byte aligned); scales: uint8 [G]; out: fp32 [G * 32] (16-byte aligned).
FP4C_API int fp4c_decode_mxfp4_blocks(const uint8_t* blocks, const uint8_t* scales, int64_t groups, float* out,
                                      void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (groups < 0) return FP4C_EINVAL;
  if (groups == 0) return cudaSuccess;
  const int64_t units = groups * 8;
  int64_t ctas = (units + THREADS - 1) / THREADS;
  if (ctas > (1ll << 30)) ctas = 1ll << 30;
  mxfp4_blocks_kernel<<<(unsigned)ctas, THREADS, 0, st>>>(blocks, scales, units, out);
  return cudaGetLastError();
}
