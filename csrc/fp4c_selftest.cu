// fp4convert kernels: the exhaustive self test of this target's E2M1 path (software on sm_90,
// hardware cvt on sm_100a / sm_120a) against docs/numerics.md's predicate sum, codes and values.

#include "fp4c_layout.cuh"
#include "fp4c_numerics.cuh"

using namespace fp4c;

namespace {

// Over fp32 bit patterns [start, start + count) (NaN patterns skipped), eight at a time: encode8's
// codes = the predicate sum's; the search rules' codes and block error with r = d = 1 = those from
// reference.E2M1_VALUES, with the clamp, and without it where every |v| < 7 (compared where finite:
// a huge input's square overflows and would hide a wrong value, and its batch neighbours are
// within ~1/32 octave); on the software path also the scaled fast paths and div6_rn (see below;
// benchmarks/device/check_sm90_numerics.cpp proves the same identities on the CPU).
__global__ void e2m1_selftest_kernel(uint64_t start, uint64_t count, unsigned long long* mismatches) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  unsigned long long bad = 0;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride * 8) {
    float v[8];
    uint32_t want = 0;
    float want_err = 0.0f, vmax = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint64_t j = i + k * stride;
      uint32_t bits = (uint32_t)(start + (j < count ? j : 0));
      if ((bits & 0x7FFFFFFFu) > 0x7F800000u) bits = 0;  // NaN: not an input
      v[k] = __uint_as_float(bits);
      vmax = fmaxf(vmax, fabsf(v[k]));
      const uint32_t code = e2m1_spec(v[k]);
      want |= code << (4 * k);
      const float e = __fsub_rn(__fmul_rn(e2m1_value_spec(code & 7u), 1.0f), fabsf(v[k]));
      want_err = __fadd_rn(want_err, __fmul_rn(e, e));
    }
    const uint32_t got = encode8(v, 1.0f);
    // The search rules' block error and packed codes, with the clamp and (where every |v| < 7)
    // without it.
    uint32_t k, k_unclamped = want;
    const float err = block_err_codes<8, true>(v, 1.0f, 1.0f, &k);
    float err_unclamped = want_err;
    if (vmax < 7.0f) {
      err_unclamped = block_err_codes<8, false>(v, 1.0f, 1.0f, &k_unclamped);
      k_unclamped |= search_signs8(v);
    }
    const bool check_err = fabsf(want_err) <= FLT_MAX;
    bad += (got != want) + ((k | search_signs8(v)) != want) + (k_unclamped != want) +
           (check_err && __float_as_uint(err) != __float_as_uint(want_err)) +
           (check_err && __float_as_uint(err_unclamped) != __float_as_uint(want_err));
#if !FP4C_HW_E2M1
    // The scaled fast paths (r = d = 1, so rs = 2^-104 and dd = 2^126): NVFP4's block error and codes
    // where every |v| < 7; per element, MXFP4's chain of e (clamped at 6) and of e + 1 (the code of v / 2)
    // where |v| < 8 (also from the unmasked m where v has at most 11 significant bits), NVFP4's unmasked
    // chain off its four exceptions, and div6_rn against the IEEE division on the same bit patterns.
    if (vmax < 7.0f) {
      uint32_t ks;
      const float errs = block_err_codes_scaled<8, false, false>(v, 0x1p-104f, 0x1p126f, &ks, nullptr);
      bad += ((ks | search_signs8(v)) != want) + (__float_as_uint(errs) != __float_as_uint(want_err));
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float a = fabsf(v[j]);
      if (a < 8.0f) {
        const float ys = __fmul_rn(a, 0x1p-104f), cs = e2m1_cs(ys);
        const float p0 = fminf(e2m1_p_from_cs(ys, cs), 0x1.8p-124f);
        const float p1 = e2m1_p_half_from_cs(ys, cs);
        bad += (__float_as_uint(p0) != (e2m1_spec(a) << 22)) +
               (__float_as_uint(p1) != (e2m1_spec(__fmul_rn(a, 0.5f)) << 22));
        const uint32_t ab = __float_as_uint(a);
        if ((ab & 0x1FFFu) == 0) {  // <= 11 significant bits (a bf16/fp16 input scaled by 2^k): unmasked m
          const float m = fmaxf(ys, 0x1p-104f);
          bad += (__float_as_uint(fminf(e2m1_p_from_cs(ys, m), 0x1.8p-124f)) != (e2m1_spec(a) << 22)) +
                 (__float_as_uint(e2m1_p_half_from_cs(ys, m)) != (e2m1_spec(__fmul_rn(a, 0.5f)) << 22));
        }
        // NVFP4's unmasked chain, off its four listed exceptions
        if (a < 7.0f && ab != 0x3FFFFFFDu && ab != 0x3FFFFFFFu && ab != 0x407FFFFDu && ab != 0x407FFFFFu)
          bad += __float_as_uint(e2m1_p_unmasked(ys)) != (e2m1_spec(a) << 22);
      }
      if (v[j] >= 6.0f * 0x1p-126f && v[j] <= FLT_MAX)
        bad += __float_as_uint(div6_rn(v[j])) != __float_as_uint(__fdiv_rn(v[j], 6.0f));
    }
#endif
  }
  if (bad) atomicAdd(mismatches, bad);
}

}  // namespace

// Mismatch count of this target's E2M1 paths against docs/numerics.md's predicate sum over all 2^32 fp32 bit
// patterns (NaNs skipped); `mismatches` is a device counter the caller zeroes.
FP4C_API int fp4c_e2m1_selftest(unsigned long long* mismatches, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  e2m1_selftest_kernel<<<sm_count() * 8, THREADS, 0, st>>>(0, 1ull << 32, mismatches);
  return cudaGetLastError();
}
