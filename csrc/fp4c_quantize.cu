// fp4convert kernels: NVFP4 / MXFP4 quantize, optionally fused with Had16, every scale rule
// (docs/numerics.md "Scale rules"), linear or 128x4-swizzled scales. The data is read once; a search rule tries its
// candidates on the block held in registers. The rule is a template parameter, so the plain rule's
// code is exactly what it was before the search rules existed.

#include "fp4c_layout.cuh"
#include "fp4c_numerics.cuh"

using namespace fp4c;

namespace {

// Blackwell's ptxas (sm_100a, sm_120a) otherwise caps a 256-thread kernel at 64 registers, and the
// search rules (three candidates' codes held at once) spill. On sm_90 the search rules without input
// weights are held to FP4C_SM90_SEARCH_CTAS CTAs per SM (3: 80 registers; their fast paths spill at
// 64): left free, ptxas schedules the unrolled chains into up to 128 registers (2 CTAs), and the
// occupancy lost can cost more time than the instructions save (BENCHMARKS.md, issue 33). The
// input-weighted variants are separate kernels (IW) held to 2 CTAs (128 registers): their weights
// would otherwise set the registers of the common kernels.
#ifndef FP4C_SM90_SEARCH_CTAS
#define FP4C_SM90_SEARCH_CTAS 3
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
#define FP4C_QUANT_BOUNDS(FMT, RULE, IW) __launch_bounds__(THREADS, (RULE) == RULE_PLAIN ? 4 : 1)
#else
#define FP4C_QUANT_BOUNDS(FMT, RULE, IW)                                                      \
  __launch_bounds__(THREADS, (RULE) == RULE_PLAIN || ((FMT) == FMT_MXFP4 && (RULE) == RULE_ALT) \
                                 ? 0                                                         \
                                 : ((IW) ? 2 : FP4C_SM90_SEARCH_CTAS))
#endif

struct QuantArgs {
  const uint8_t* x;
  uint8_t* packed;
  const float* amax;  // [B] (NVFP4): the global scale is computed from it in every thread
  float* gs_out;      // [B] (NVFP4): written by the first thread of each matrix
  int* flag;          // [B]: flag[b] set to 1 when a block of matrix b (or its given amax) holds NaN/Inf
  int64_t B;
  int64_t n;          // elements per matrix (M * K)
  int64_t groups;     // ceil(n / GROUP)
  ScaleOut so;
  const float* iw;    // input_weight fp32 [K] for the search rules' block error, or null
  int64_t K;          // row length (the column of element e is e % K)
};

// NVFP4: gs of matrix b from its amax (reference.global_scale). The first thread of the matrix
// publishes it and flags a non-finite amax (which the element blocks need not contain: a given one).
template <int FMT>
__device__ __forceinline__ float matrix_gs(const float* amax, float* gs_out, int* flag, int64_t b, bool first) {
  if constexpr (FMT != FMT_NVFP4) {
    return 0.0f;
  } else {
    const float am = amax[b];
    const float gs = nvfp4_global_scale(am);
    if (first) {
      gs_out[b] = gs;
      if (!(fabsf(am) <= FLT_MAX)) *(volatile int*)(flag + b) = 1;
    }
    return gs;
  }
}

// Whether the NVFP4 search of this kernel may take the unmasked chain at all (nvfp4_candidate_err's UM):
// software E2M1, and inputs of a 16-bit type unrotated (nvfp4_unmasked_safe reasons about their grid).
template <int DT, bool ROT>
__host__ __device__ constexpr bool unmasked_flags() {
  return !FP4C_HW_E2M1 && (DT == DT_BF16 || DT == DT_F16) && !ROT;
}

// NVFP4 search rules: the (r, d) of every E4M3 byte for this matrix's gs, in shared memory (see
// nvfp4_candidate). Returns, to every thread, whether the whole matrix may take the unmasked chain:
// unmasked_flags and nvfp4_unmasked_safe for all 128 bytes (one decision per matrix keeps every warp on
// one chain). Every thread of the CTA must call it (two barriers); a no-op (false) for other rules.
template <int FMT, int RULE, int DT, bool ROT>
__device__ __forceinline__ bool fill_candidates(float2* rd, float gs) {
  if constexpr (FMT == FMT_NVFP4 && RULE != RULE_PLAIN) {
    static_assert(THREADS >= 128, "one thread per E4M3 byte");
    __syncthreads();  // the previous matrix's table is no longer read
    bool safe = true;
    if (threadIdx.x < 128) {
      const float2 k = nvfp4_candidate(gs, threadIdx.x);
#if !FP4C_HW_E2M1
      if constexpr (unmasked_flags<DT, ROT>()) safe = nvfp4_unmasked_safe<DT == DT_BF16>(k.x, k.y);
#endif
      rd[threadIdx.x] = k;
    }
    return __syncthreads_and(safe) && unmasked_flags<DT, ROT>();
  } else {
    (void)rd;
    (void)gs;
    return false;
  }
}

// One group (raw data loaded): its two 16-element chunks (one if !full), rotated if ROT, scaled and
// encoded. Out: codes[4] (16 bytes), the scale byte(s) (NVFP4: one per chunk; MXFP4: sb[0]).
// Returns true when a block held NaN/Inf.
// iw0 / iw1: the input weights of the group's first / second 16 elements (MXFP4: iw0, all 32), read
// by the search rules only where IW (the caller tests the pointer once per group, so the unweighted
// path has no per-element test).
template <int DT, int FMT, bool ROT, int RULE, bool IW = false, bool UM = false>
__device__ __forceinline__ bool encode_group(const Raw<DT>& raw, bool full, float gs, const float2* rd,
                                             uint32_t codes[4], uint32_t sb[2], const float* iw0 = nullptr,
                                             const float* iw1 = nullptr) {
  bool bad = false;
  if constexpr (FMT == FMT_NVFP4) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      if (c == 1 && !full) break;
      float v[16];
      uint32_t mb;
      decode16<DT, RULE != RULE_PLAIN>(raw, c, v, mb);
      if constexpr (ROT) {
        butterflies16(v);
        mb = amax16_rotated(v);
      }
      bad |= mb >= 0x7F800000u;
      if constexpr (RULE == RULE_PLAIN) {
        float r = nvfp4_scale(gs, mb, sb[c]);
        if constexpr (ROT) {
          if (fold_quarter(r)) r = __fmul_rn(r, 0.25f);
          else scale16(v, 0.25f);
        }
        codes[2 * c] = encode8(v, r);
        codes[2 * c + 1] = encode8(v + 8, r);
      } else {
        if constexpr (ROT) scale16(v, 0.25f);  // the errors need v = RN(0.25 u) itself
        // bf16 without rotation: the signs from the raw words (the group's 16 words, 8 per chunk)
        uint32_t sg[2] = {0u, 0u};
        if constexpr (DT == DT_BF16 && !ROT) {
          const uint32_t* w = reinterpret_cast<const uint32_t*>(raw.q + 2 * c);
          sg[0] = signs8_raw(w);
          sg[1] = signs8_raw(w + 4);
        }
        nvfp4_block_search_iw<RULE, IW, UM>(v, gs, mb, rd, codes + 2 * c, sb[c],
                                                 c == 0 ? iw0 : iw1, DT == DT_BF16 && !ROT ? sg : nullptr);
      }
    }
  } else {
    float v[32];
    uint32_t m0, m1;
    decode16<DT, RULE != RULE_PLAIN>(raw, 0, v, m0);
    decode16<DT, RULE != RULE_PLAIN>(raw, 1, v + 16, m1);
    if constexpr (ROT) {
      butterflies16(v);
      butterflies16(v + 16);
      m0 = amax16_rotated(v);
      m1 = amax16_rotated(v + 16);
    }
    const uint32_t mb = max(m0, m1);
    bad = mb >= 0x7F800000u;
    if constexpr (RULE == RULE_MSE || RULE == RULE_WMSE) {
      if constexpr (ROT) {
        scale16(v, 0.25f);
        scale16(v + 16, 0.25f);
      }
      uint32_t sg[4] = {0u, 0u, 0u, 0u};
      if constexpr (DT == DT_BF16 && !ROT) {
#pragma unroll
        for (int w = 0; w < 4; ++w) sg[w] = signs8_raw(reinterpret_cast<const uint32_t*>(raw.q) + 4 * w);
      }
      mxfp4_block_mse_iw<RULE == RULE_WMSE, IW, unmasked_flags<DT, ROT>()>(v, mb, codes, sb[0], iw0,
                                                                           DT == DT_BF16 && !ROT ? sg : nullptr);
    } else {
      float r = mxfp4_scale(mb, sb[0]);
      if constexpr (RULE == RULE_ALT) {  // rceil: the exponent up where the block would saturate
        sb[0] = mxfp4_rceil(mb, sb[0], r);
        r = pow2i(127 - (int)sb[0]);
      }
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

// Whether the linear kernel of a rule strides over its matrix (a grid of one wave, each thread taking
// groups g0, g0 + gridDim.x * 256, ...): the NVFP4 search rules (4over6 / mse / wmse), whose per-matrix
// setup (the global scale's division, the (r, d) table with its 128 pairs of IEEE divisions) is then
// paid once per CTA and matrix instead of once per 512 groups (those rules are issue bound on sm_90).
template <int FMT, int RULE>
__host__ __device__ constexpr bool strides() {
  return FMT == FMT_NVFP4 && RULE != RULE_PLAIN;
}

// Groups per thread of a kernel that does not stride: 2 for MXFP4 mse / wmse (issue bound too, and
// measured faster this way than striding: BENCHMARKS.md, issue 33), 1 for the plain rules, whose time is
// the memory's. Also what benchmarks/sass_count.py's probe unrolls per thread (2 for every search rule).
template <int FMT, int RULE>
__host__ __device__ constexpr int groups_per_thread() {
  return strides<FMT, RULE>() || RULE == RULE_MSE || RULE == RULE_WMSE ? 2 : 1;
}

// One group g of matrix b with the linear scale layout (raw data not yet loaded; full: all 32 elements,
// else only the first 16): load, encode, store its codes and scale bytes. quantize_kernel's body, also
// compiled on its own by benchmarks/sass_count.py (with full = true) to count the hot path. IW: the
// search rules' input weights a.iw (non-null) are read.
template <int DT, int FMT, bool ROT, int RULE, bool IW, bool UM = false>
__device__ __forceinline__ void quantize_group(const QuantArgs& a, int64_t b, int64_t g, bool full, float gs,
                                               const float2* rd) {
  Raw<DT> raw;
  const uint8_t* p = a.x + (b * a.n + g * GROUP) * Elem<DT>::size;
#pragma unroll
  for (int j = 0; j < Raw<DT>::NV; ++j)
    if (j < Raw<DT>::NV / 2 || full) raw.q[j] = ldg16(p + 16 * j);
  uint32_t codes[4], sb[2];
  const float* iw0 = nullptr;
  const float* iw1 = nullptr;
  if constexpr (IW) {  // a 32-group may straddle two rows when K % 32 == 16 (NVFP4)
    iw0 = a.iw + (g * GROUP) % a.K;
    iw1 = a.iw + (g * GROUP + 16) % a.K;
  }
  if (encode_group<DT, FMT, ROT, RULE, IW, UM>(raw, full, gs, rd, codes, sb, iw0, iw1)) *(volatile int*)(a.flag + b) = 1;
  uint8_t* sp = a.so.base + b * a.so.mstride;
  if constexpr (FMT == FMT_NVFP4) {
    // (the striding search kernels store a group's two bytes at once where aligned: measured 4-5 points of
    // copy bandwidth on NVFP4 mse / wmse; the plain kernels keep their code as it was)
    if (strides<FMT, RULE>() && full && !(reinterpret_cast<uintptr_t>(sp + 2 * g) & 1)) {
      *reinterpret_cast<uint16_t*>(sp + 2 * g) = (uint16_t)(sb[0] | (sb[1] << 8));
    } else {
      sp[2 * g] = (uint8_t)sb[0];
      if (full) sp[2 * g + 1] = (uint8_t)sb[1];
    }
  } else {
    sp[g] = (uint8_t)sb[0];
  }
  store_codes(a.packed + (b * a.n + g * GROUP) / 2, full, codes);
}

// Linear scale layout: group g's scales are bytes 2g, 2g+1 (NVFP4) or g (MXFP4) of the matrix's
// row-major scale array; a matrix is a flat run of groups. One thread's groups of matrix b: from g0 in
// steps of the grid (strides) or of a CTA (groups_per_thread of them).
template <int DT, int FMT, bool ROT, int RULE, bool IW, bool UM>
__device__ __forceinline__ void quantize_groups(const QuantArgs& a, int64_t b, int64_t g0, float gs, const float2* rd) {
  if constexpr (strides<FMT, RULE>()) {
    const int64_t step = (int64_t)gridDim.x * THREADS;
#pragma unroll 1
    for (int64_t g = g0; g < a.groups; g += step)
      quantize_group<DT, FMT, ROT, RULE, IW, UM>(a, b, g, g * GROUP + GROUP <= a.n, gs, rd);
  } else {
#pragma unroll 1
    for (int k = 0; k < groups_per_thread<FMT, RULE>(); ++k) {
      const int64_t g = g0 + k * THREADS;
      if (g >= a.groups) break;
      quantize_group<DT, FMT, ROT, RULE, IW, UM>(a, b, g, g * GROUP + GROUP <= a.n, gs, rd);
    }
  }
}

template <int DT, int FMT, bool ROT, int RULE, bool IW>
__global__ void FP4C_QUANT_BOUNDS(FMT, RULE, IW) quantize_kernel(const QuantArgs a) {
  const int64_t g0 = (int64_t)blockIdx.x * THREADS * (strides<FMT, RULE>() ? 1 : groups_per_thread<FMT, RULE>()) +
                    threadIdx.x;
  constexpr bool TABLE = FMT == FMT_NVFP4 && RULE != RULE_PLAIN;
  __shared__ float2 rd[TABLE ? 128 : 1];
  if (!TABLE && g0 >= a.groups) return;  // (with a table every thread takes part in its barriers)
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const float gs = matrix_gs<FMT>(a.amax, a.gs_out, a.flag, b, g0 == 0);
    const bool um = fill_candidates<FMT, RULE, DT, ROT>(rd, gs);
    if constexpr (TABLE && unmasked_flags<DT, ROT>()) {
      if (um) {
        quantize_groups<DT, FMT, ROT, RULE, IW, true>(a, b, g0, gs, rd);
        continue;
      }
    }
    quantize_groups<DT, FMT, ROT, RULE, IW, false>(a, b, g0, gs, rd);
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
  const float* amax;
  float* gs_out;
  int* flag;
  int64_t B, M, K, nb, nbp, mstride;
  const float* iw;  // input_weight fp32 [K], or null
};

template <int DT, int FMT, bool ROT, int RULE, bool IW>
__global__ void FP4C_QUANT_BOUNDS(FMT, RULE, IW) quantize_swizzled_kernel(const TileArgs a) {
  constexpr int BS = FMT == FMT_NVFP4 ? 16 : 32;
  const int64_t tiles_k = a.nbp / 4;
  const int64_t mt = blockIdx.x / tiles_k, kt = blockIdx.x - mt * tiles_k;
  const int r = threadIdx.x >> 1;
  const int64_t m = mt * 128 + r;
  const int64_t kb0 = kt * 4 + 2 * (threadIdx.x & 1);
  const int off = (r & 31) * 16 + (r >> 5) * 4 + 2 * (threadIdx.x & 1);
  const int64_t n = a.M * a.K;
  __shared__ float2 rd[FMT == FMT_NVFP4 && RULE != RULE_PLAIN ? 128 : 1];
  for (int64_t b = blockIdx.y; b < a.B; b += gridDim.y) {
    const uint8_t* xb = a.x + b * n * Elem<DT>::size;
    const float gs = matrix_gs<FMT>(a.amax, a.gs_out, a.flag, b, blockIdx.x == 0 && threadIdx.x == 0);
    const bool um = fill_candidates<FMT, RULE, DT, ROT>(rd, gs);
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
        const float* iw0 = IW ? a.iw + kb * BS : nullptr;
        const float* iw1 = IW ? iw0 + 16 : nullptr;
        if (FMT == FMT_NVFP4 && RULE != RULE_PLAIN && unmasked_flags<DT, ROT>() && um)
          bad |= encode_group<DT, FMT, ROT, RULE, IW, true>(raw, full, gs, rd, codes, sb, iw0, iw1);
        else
          bad |= encode_group<DT, FMT, ROT, RULE, IW, false>(raw, full, gs, rd, codes, sb, iw0, iw1);
        if constexpr (FMT == FMT_NVFP4) {
          s2[0] = sb[0];
          s2[1] = full ? sb[1] : 0u;
        } else {
          s2[u] = sb[0];
        }
        store_codes(a.packed + (b * n + e) / 2, full, codes);
      }
    }
    if (bad) *(volatile int*)(a.flag + b) = 1;
    *reinterpret_cast<uint16_t*>(a.scale + b * a.mstride + (int64_t)blockIdx.x * 512 + off) =
        (uint16_t)(s2[0] | (s2[1] << 8));
  }
}

template <int DT, int FMT, bool ROT, int RULE, bool IW>
void launch_iw(const QuantArgs& a, const TileArgs& t, int swizzle, cudaStream_t st) {
  if (swizzle) {
    const dim3 grid((unsigned)(t.mstride / 512), (unsigned)(t.B < 65535 ? t.B : 65535));
    quantize_swizzled_kernel<DT, FMT, ROT, RULE, IW><<<grid, THREADS, 0, st>>>(t);
  } else {
    const int64_t by = a.B < 65535 ? a.B : 65535;
    constexpr int64_t per_cta = (int64_t)THREADS * (strides<FMT, RULE>() ? 1 : groups_per_thread<FMT, RULE>());
    int64_t bx = (a.groups + per_cta - 1) / per_cta;
    if constexpr (strides<FMT, RULE>()) {  // one wave: as many CTAs as the SMs hold, shared by the matrices
      static int per_sm = 0;  // (per instantiation; the same on every device of one arch)
      if (!per_sm && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, quantize_kernel<DT, FMT, ROT, RULE, IW>,
                                                                   THREADS, 0) != cudaSuccess) {
        (void)cudaGetLastError();  // (not the launch's error: a plain wave of one CTA per SM instead)
        per_sm = 1;
      }
      const int64_t wave = (int64_t)sm_count() * (per_sm > 0 ? per_sm : 1);
      const int64_t cap = wave / by > 1 ? wave / by : 1;
      bx = bx < cap ? bx : cap;
    }
    const dim3 grid((unsigned)bx, (unsigned)by);
    quantize_kernel<DT, FMT, ROT, RULE, IW><<<grid, THREADS, 0, st>>>(a);
  }
}

// The input-weighted kernels only where a search rule has input weights (the plain rules ignore them).
template <int DT, int FMT, bool ROT, int RULE>
void launch_one(const QuantArgs& a, const TileArgs& t, int swizzle, cudaStream_t st) {
  if constexpr (RULE != RULE_PLAIN && !(FMT == FMT_MXFP4 && RULE == RULE_ALT)) {
    if (a.iw) return launch_iw<DT, FMT, ROT, RULE, true>(a, t, swizzle, st);
  }
  launch_iw<DT, FMT, ROT, RULE, false>(a, t, swizzle, st);
}

template <int DT, int FMT, bool ROT>
cudaError_t launch_rule(const QuantArgs& a, const TileArgs& t, int swizzle, int rule, cudaStream_t st) {
  switch (rule) {
    case RULE_PLAIN: launch_one<DT, FMT, ROT, RULE_PLAIN>(a, t, swizzle, st); break;
    case RULE_ALT: launch_one<DT, FMT, ROT, RULE_ALT>(a, t, swizzle, st); break;
    case RULE_MSE: launch_one<DT, FMT, ROT, RULE_MSE>(a, t, swizzle, st); break;
    case RULE_WMSE: launch_one<DT, FMT, ROT, RULE_WMSE>(a, t, swizzle, st); break;
    default: return (cudaError_t)FP4C_EINVAL;
  }
  return cudaGetLastError();
}

template <int DT, int FMT>
cudaError_t launch_dt(const QuantArgs& a, const TileArgs& t, int rotate, int swizzle, int rule, cudaStream_t st) {
  return rotate ? launch_rule<DT, FMT, true>(a, t, swizzle, rule, st)
                : launch_rule<DT, FMT, false>(a, t, swizzle, rule, st);
}

}  // namespace

// x: [B, M, K]; packed: [B, M, K/2]; scale: [B, M, K/bs] or [B, Mp, nbp]. NVFP4: amax fp32 [B] in,
// gs fp32 [B] out (gs = 2688 / amax, 1 for 0, clamped to FLT_MAX); MXFP4: both null. scale_rule:
// 0 max / floor, 1 4over6 / rceil, 2 mse, 3 wmse. flag: int32 [B], zeroed by the caller (one memset for a
// batch of launches, or a store into a mapped pinned flag); flag[b] is set to 1 if a block of matrix
// b or its given amax holds NaN/Inf. One kernel launch.
// fp4c_quantize_iw: the same with input_weight (fp32 [K] on the device, finite and >= 0, checked by
// the caller; null = fp4c_quantize): each search rule's block error weighted per input channel,
// reference.nvfp4_quantize / mxfp4_quantize's input_weight. The plain rules ignore it.
FP4C_API int fp4c_quantize_iw(const void* x, int dtype, int fmt, int rotate, int swizzle, int scale_rule, int64_t B,
                              int64_t M, int64_t K, const float* amax, float* gs, uint8_t* packed, uint8_t* scale,
                              int* flag, const float* input_weight, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  const int bs = fmt == FMT_NVFP4 ? 16 : 32;
  if (B <= 0 || M < 0 || K < 0 || K % bs || (fmt != FMT_NVFP4 && fmt != FMT_MXFP4) ||
      (fmt == FMT_NVFP4 && (!amax || !gs)) || scale_rule < 0 || scale_rule > 3)
    return FP4C_EINVAL;
  const int64_t n = M * K;
  const int64_t nb = K / bs;
  if (!flag) return FP4C_EINVAL;
  if (n == 0) return cudaSuccess;
  if (swizzle && M * nb >= (1ll << 31)) return FP4C_EINVAL;
  QuantArgs a;
  a.x = (const uint8_t*)x;
  a.packed = packed;
  a.amax = amax;
  a.gs_out = gs;
  a.flag = flag;
  a.B = B;
  a.n = n;
  a.groups = (n + GROUP - 1) / GROUP;
  a.so = make_scale_layout(scale, M, nb, swizzle);
  a.iw = input_weight;
  a.K = K;
  TileArgs t;
  t.iw = input_weight;
  t.x = a.x;
  t.packed = packed;
  t.scale = scale;
  t.amax = amax;
  t.gs_out = gs;
  t.flag = flag;
  t.B = B;
  t.M = M;
  t.K = K;
  t.nb = nb;
  t.nbp = a.so.nbp;
  t.mstride = (int64_t)a.so.mstride;
  if (swizzle && t.mstride / 512 >= (1ll << 31)) return FP4C_EINVAL;
#define FP4C_Q(DT)                                                                                 \
  return fmt == FMT_NVFP4 ? launch_dt<DT, FMT_NVFP4>(a, t, rotate, swizzle, scale_rule, st)       \
                          : launch_dt<DT, FMT_MXFP4>(a, t, rotate, swizzle, scale_rule, st);
  switch (dtype) {
    case DT_F32: FP4C_Q(DT_F32);
    case DT_F16: FP4C_Q(DT_F16);
    case DT_BF16: FP4C_Q(DT_BF16);
    default: return FP4C_EINVAL;
  }
#undef FP4C_Q
}

FP4C_API int fp4c_quantize(const void* x, int dtype, int fmt, int rotate, int swizzle, int scale_rule, int64_t B,
                           int64_t M, int64_t K, const float* amax, float* gs, uint8_t* packed, uint8_t* scale,
                           int* flag, void* stream) {
  return fp4c_quantize_iw(x, dtype, fmt, rotate, swizzle, scale_rule, B, M, K, amax, gs, packed, scale, flag,
                          nullptr, stream);
}
