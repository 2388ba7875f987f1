// fp4convert kernels: GPTQ's in-batch sweep (docs/numerics.md "GPTQ"), bit for bit
// fp4convert/numerics/gptq.py sweep_batch on the same inputs.
//
// One thread per row: the rows of a column batch are independent (every row's update reads the same
// factor U), so a thread walks its row's B columns in order, holding them in shared memory (column
// major: consecutive threads, consecutive banks). At each scale block's first column it picks the
// block's scale with the data-free kernels' own rule code (fp4c_numerics.cuh) from the values as they
// are then; each column is encoded E2M1(w * r), its value q = value * d, its error e = (w - q) / U[i][i]
// and the later columns of the batch become w_k - e * U[i][k] (one IEEE multiply, one subtract: the
// reference's two torch operations). The lazy update of the columns after the batch is a matmul the
// caller runs (torch), as the reference does.

#include "fp4c_layout.cuh"
#include "fp4c_numerics.cuh"

using namespace fp4c;

namespace {

struct SweepArgs {
  const float* w;     // [N, B] fp32, row-major (read only)
  const float* u;     // [B, B] fp32, row-major: the batch's block of U
  const float* iw;    // [B] fp32 input weights of the search rules' error, or null
  const float* amax;  // [1] fp32 (NVFP4): the matrix's (fused group's) amax; gs = 2688 / amax
  int64_t N;
  int B;
  uint8_t* codes;     // [N, B] E2M1 codes, one per byte
  uint8_t* scales;    // [N, B / bs] scale bytes (E4M3 / E8M0)
  float* values;      // [N, B] value(code) * d
  float* errors;      // [N, B] (w - q) / U[i][i]
};

// NVFP4: the scale byte of one block of 16 (v: the row's values as the sweep reaches the block).
template <int RULE>
__device__ __forceinline__ uint32_t nvfp4_byte(const float v[16], float gs, const float2* rd, const float* c) {
  uint32_t mb = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) mb = max(mb, __float_as_uint(fabsf(v[j])));
  uint32_t byte;
  if constexpr (RULE == RULE_PLAIN) {
    (void)nvfp4_scale(gs, mb, byte);
  } else {
    uint32_t codes[2];
    nvfp4_block_search<RULE>(v, gs, mb, rd, codes, byte, c);
  }
  return byte;
}

// MXFP4: the E8M0 exponent of one block of 32.
template <int RULE>
__device__ __forceinline__ uint32_t mxfp4_byte(const float v[32], const float* c) {
  uint32_t mb = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) mb = max(mb, __float_as_uint(fabsf(v[j])));
  uint32_t e;
  if constexpr (RULE == RULE_MSE || RULE == RULE_WMSE) {
    uint32_t codes[4];
    mxfp4_block_mse<RULE == RULE_WMSE>(v, mb, codes, e, c);
  } else {
    const float r = mxfp4_scale(mb, e);
    if constexpr (RULE == RULE_ALT) e = mxfp4_rceil(mb, e, r);
  }
  return e;
}

// reference.e2m1_decode of one code (sign bit 3): from the code's exponent and mantissa bits, no table
// (an indexed table lands in local memory): 0 / 0.5 for exponent 0, else 2^(e - 1) * (1 + m / 2).
__device__ __forceinline__ float e2m1_decode1(uint32_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const uint32_t bits = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3F000000u : 0u);
  return __uint_as_float(bits | ((code & 8u) << 28));
}

template <int FMT, int RULE>
__global__ void gptq_sweep_kernel(const SweepArgs a) {
  constexpr int BS = FMT == FMT_NVFP4 ? 16 : 32;
  extern __shared__ float wv[];  // [B][blockDim.x]
  __shared__ float2 rd[FMT == FMT_NVFP4 && RULE != RULE_PLAIN ? 128 : 1];
  const int t = threadIdx.x, T = blockDim.x, B = a.B;
  const int64_t row = (int64_t)blockIdx.x * T + t;
  float gs = 0.0f;
  if constexpr (FMT == FMT_NVFP4) {
    gs = nvfp4_global_scale(a.amax[0]);
    if constexpr (RULE != RULE_PLAIN) {
      for (int b = t; b < 128; b += T) rd[b] = nvfp4_candidate(gs, (uint32_t)b);
      __syncthreads();
    }
  }
  if (row >= a.N) return;
  for (int k = 0; k < B; ++k) wv[k * T + t] = a.w[row * B + k];
  float r = 0.0f, d = 0.0f;
  for (int i = 0; i < B; ++i) {
    if (i % BS == 0) {
      float v[BS];
#pragma unroll
      for (int j = 0; j < BS; ++j) v[j] = wv[(i + j) * T + t];
      const float* c = (RULE != RULE_PLAIN && a.iw) ? a.iw + i : nullptr;
      uint32_t byte;
      if constexpr (FMT == FMT_NVFP4) {
        byte = nvfp4_byte<RULE>(v, gs, rd, c);
        nvfp4_candidate(gs, byte, r, d);
      } else {
        byte = mxfp4_byte<RULE>(v, c);
        r = pow2i(127 - (int)byte);
        d = pow2i((int)byte - 127);
      }
      a.scales[row * (B / BS) + i / BS] = (uint8_t)byte;
    }
    const float x = wv[i * T + t];
    const uint32_t code = e2m1_spec(__fmul_rn(x, r));
    const float q = __fmul_rn(e2m1_decode1(code), d);
    const float e = __fdiv_rn(__fsub_rn(x, q), a.u[i * B + i]);
    const float* ui = a.u + (int64_t)i * B;
    for (int k = i + 1; k < B; ++k) wv[k * T + t] = __fsub_rn(wv[k * T + t], __fmul_rn(e, ui[k]));
    a.codes[row * B + i] = (uint8_t)code;
    a.values[row * B + i] = q;
    a.errors[row * B + i] = e;
  }
}

template <int FMT>
cudaError_t launch_rule(const SweepArgs& a, int rule, int threads, cudaStream_t st) {
  const dim3 grid((unsigned)((a.N + threads - 1) / threads));
  const size_t shared = (size_t)a.B * threads * sizeof(float);
  switch (rule) {
    case RULE_PLAIN: gptq_sweep_kernel<FMT, RULE_PLAIN><<<grid, threads, shared, st>>>(a); break;
    case RULE_ALT: gptq_sweep_kernel<FMT, RULE_ALT><<<grid, threads, shared, st>>>(a); break;
    case RULE_MSE: gptq_sweep_kernel<FMT, RULE_MSE><<<grid, threads, shared, st>>>(a); break;
    case RULE_WMSE: gptq_sweep_kernel<FMT, RULE_WMSE><<<grid, threads, shared, st>>>(a); break;
    default: return (cudaError_t)FP4C_EINVAL;
  }
  return cudaGetLastError();
}

}  // namespace

// GPTQ's sweep of one column batch: w [N, B] fp32, u [B, B] fp32 (the batch's block of the upper
// factor), iw [B] fp32 or null, amax [1] fp32 (NVFP4; null for MXFP4); out: codes [N, B] uint8, scales
// [N, B / bs] uint8, values and errors [N, B] fp32. B: a multiple of the scheme's block, at most 384
// (the batch's rows live in 48 KB of shared memory). One kernel launch.
FP4C_API int fp4c_gptq_sweep(const float* w, const float* u, const float* iw, const float* amax, int fmt, int rule,
                             int64_t N, int B, uint8_t* codes, uint8_t* scales, float* values, float* errors,
                             void* stream) {
  const int bs = fmt == FMT_NVFP4 ? 16 : 32;
  if ((fmt != FMT_NVFP4 && fmt != FMT_MXFP4) || rule < 0 || rule > 3 || N < 0 || B <= 0 || B % bs || B > 384 ||
      (fmt == FMT_NVFP4 && !amax) || !w || !u || !codes || !scales || !values || !errors)
    return FP4C_EINVAL;
  if (N == 0) return cudaSuccess;
  SweepArgs a;
  a.w = w;
  a.u = u;
  a.iw = iw;
  a.amax = amax;
  a.N = N;
  a.B = B;
  a.codes = codes;
  a.scales = scales;
  a.values = values;
  a.errors = errors;
  const int threads = B <= 192 ? 64 : 32;  // B * threads * 4 bytes of shared memory <= 48 KB
  cudaStream_t st = (cudaStream_t)stream;
  return fmt == FMT_NVFP4 ? launch_rule<FMT_NVFP4>(a, rule, threads, st) : launch_rule<FMT_MXFP4>(a, rule, threads, st);
}
