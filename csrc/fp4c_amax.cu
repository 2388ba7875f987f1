// fp4convert kernels: amax per matrix (pass 1), of the values or of their Had16 rotation
// (reference.tensor_amax).

#include "fp4c_layout.cuh"
#include "fp4c_numerics.cuh"

using namespace fp4c;

namespace {

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

}  // namespace

// x: [B, n] contiguous; out: uint32 [B] (fp32 bit patterns), zeroed here.
FP4C_API int fp4c_amax(const void* x, int dtype, int rotate, int64_t B, int64_t n, uint32_t* out,
                       void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (B <= 0 || n < 0 || n % 16) return FP4C_EINVAL;
  cudaError_t err = cudaMemsetAsync(out, 0, B * sizeof(uint32_t), st);
  if (err != cudaSuccess || n == 0) return err;
  const int64_t work = rotate ? (n / 32 + 1) : (n * (dtype == DT_F32 ? 4 : 2) / 16 / 4 + 1);
  const uint8_t* xp = (const uint8_t*)x;
  const dim3 grid = work_grid(work, B);
#define FP4C_AMAX(DT)                                                                   \
  if (rotate) amax_kernel<DT, true><<<grid, THREADS, 0, st>>>(xp, B, n, out);           \
  else amax_kernel<DT, false><<<grid, THREADS, 0, st>>>(xp, B, n, out);
  switch (dtype) {
    case DT_F32: FP4C_AMAX(DT_F32); break;
    case DT_F16: FP4C_AMAX(DT_F16); break;
    case DT_BF16: FP4C_AMAX(DT_BF16); break;
    default: return FP4C_EINVAL;
  }
#undef FP4C_AMAX
  return cudaGetLastError();
}
