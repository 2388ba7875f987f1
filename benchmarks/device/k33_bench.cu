// Issue 33: the quantize kernels' time on one GPU, without Python, so that variants of csrc/ built with
// different -D flags (or from different trees: -I) compare side by side in one device call.
//
// Includes the library's own fp4c_quantize.cu and calls its launcher (fp4c_quantize), as the package does.
// Input: 16384 x 16384 bf16 (torch.randn-like normals from a counter hash, fixed seed), 512 MiB, larger than
// L2, so repeated launches read DRAM. Times each rule with CUDA events (median of REPS launches) beside a
// device-to-device copy of the same input (read + write), and prints, per rule, the median ms, the % of the
// copy's bandwidth (docs/numerics.md's bytes: input + codes + scales, as benchmarks/kernel_speed.py counts them)
// and a 64-bit FNV-1a hash of every output byte (codes, scales, global scale), so that variants can be
// checked for identical bytes. The bytes themselves are the reference's by tests/kernels/test_cuda_kernels.py.
//
//   nvcc -O3 -std=c++17 -fmad=false -lineinfo -arch=sm_90 -I csrc -o k33 benchmarks/device/k33_bench.cu
//   ./k33 [reps] [rows] [amax] (rows: a comma list of fmt:rule[:rot], default the search rules and max;
//                               amax: a given NVFP4 global amax instead of the data's)
#include "fp4c_quantize.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));          \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

__device__ __forceinline__ uint32_t mix32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return (uint32_t)x;
}

// Box-Muller normals, rounded to bf16 (RN), two per counter.
__global__ void fill_normal(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  const int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
  if (i >= n) return;
  const uint32_t a = mix32(seed * 0x9E3779B97F4A7C15ull + (uint64_t)i);
  const uint32_t b = mix32((seed + 1) * 0xD1B54A32D192ED03ull + (uint64_t)i);
  const float u1 = ((a >> 8) + 1) * (1.0f / 16777217.0f), u2 = (b >> 8) * (1.0f / 16777216.0f);
  const float rr = sqrtf(-2.0f * logf(u1));
  x[i] = __float2bfloat16_rn(rr * cospif(2.0f * u2));
  if (i + 1 < n) x[i + 1] = __float2bfloat16_rn(rr * sinpif(2.0f * u2));
}

__global__ void absmax(const __nv_bfloat16* x, int64_t n, unsigned* out) {
  unsigned m = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    m = max(m, (unsigned)(__bfloat16_as_ushort(x[i]) & 0x7FFFu));
  for (int o = 16; o; o >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if ((threadIdx.x & 31) == 0) atomicMax(out, m << 16);
}

static uint64_t fnv(const std::vector<uint8_t>& v, uint64_t h = 1469598103934665603ull) {
  for (uint8_t c : v) h = (h ^ c) * 1099511628211ull;
  return h;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 30;
  std::string rows = argc > 2 ? argv[2] : "0:0,0:1,0:2,0:3,1:0,1:2,1:3,0:1:1";
  const int64_t M = 16384, K = 16384, n = M * K;
  __nv_bfloat16* x;
  uint8_t *packed, *scale, *copy;
  float *amax, *gs;
  unsigned* amax_bits;
  int* flag;
  CK(cudaMalloc(&x, n * 2));
  CK(cudaMalloc(&copy, n * 2));
  CK(cudaMalloc(&packed, n / 2));
  CK(cudaMalloc(&scale, n / 16));
  CK(cudaMalloc(&amax, 4));
  CK(cudaMalloc(&gs, 4));
  CK(cudaMalloc(&amax_bits, 4));
  CK(cudaMalloc(&flag, 4));
  fill_normal<<<(unsigned)((n / 2 + 255) / 256), 256>>>(x, n, 1234);
  CK(cudaMemset(amax_bits, 0, 4));
  absmax<<<1024, 256>>>(x, n, amax_bits);
  CK(cudaMemcpy(amax, amax_bits, 4, cudaMemcpyDeviceToDevice));
  if (argc > 3 && atof(argv[3]) > 0) {  // a given global amax (>= the data's): another gs, another byte table
    const float given = (float)atof(argv[3]);
    CK(cudaMemcpy(amax, &given, 4, cudaMemcpyHostToDevice));
  }
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timeit = [&](auto&& fn) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      CK(cudaEventRecord(e0));
      fn();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const float copy_ms = timeit([&] { CK(cudaMemcpyAsync(copy, x, n * 2, cudaMemcpyDeviceToDevice)); });
  const double copy_bw = 4.0 * n / copy_ms / 1e6;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  float amax_host;
  CK(cudaMemcpy(&amax_host, amax, 4, cudaMemcpyDeviceToHost));
  printf("{\"device\": \"%s\", \"amax\": %.9g, \"copy_ms\": %.4f, \"copy_GBs\": %.1f, \"rows\": [\n", prop.name,
         amax_host, copy_ms, copy_bw);
  size_t pos = 0;
  bool first = true;
  while (pos < rows.size()) {
    size_t end = rows.find(',', pos);
    if (end == std::string::npos) end = rows.size();
    const std::string row = rows.substr(pos, end - pos);
    pos = end + 1;
    int fmt = 0, rule = 0, rot = 0;
    sscanf(row.c_str(), "%d:%d:%d", &fmt, &rule, &rot);
    auto launch = [&] {
      int rc = fp4c_quantize(x, DT_BF16, fmt, rot, 0, rule, 1, M, K, fmt == 0 ? amax : nullptr,
                             fmt == 0 ? gs : nullptr, packed, scale, flag, nullptr);
      if (rc) {
        fprintf(stderr, "fp4c_quantize: %d\n", rc);
        exit(1);
      }
    };
    CK(cudaMemset(packed, 0, n / 2));
    CK(cudaMemset(scale, 0, n / 16));
    CK(cudaMemset(flag, 0, 4));
    const float ms = timeit(launch);
    CK(cudaDeviceSynchronize());
    const int64_t nscale = n / (fmt == 0 ? 16 : 32);
    std::vector<uint8_t> hp(n / 2), hs(nscale), hg(4), hf(4);
    CK(cudaMemcpy(hp.data(), packed, n / 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hs.data(), scale, nscale, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hg.data(), gs, 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hf.data(), flag, 4, cudaMemcpyDeviceToHost));
    const uint64_t h = fnv(hf, fnv(hg, fnv(hs, fnv(hp))));
    const double bytes = 2.0 * n + n / 2.0 + (double)nscale;
    printf("%s  {\"row\": \"%s\", \"ms\": %.4f, \"pct_copy\": %.1f, \"hash\": \"%016llx\"}", first ? "" : ",\n",
           row.c_str(), ms, 100.0 * (bytes / ms / 1e6) / copy_bw, (unsigned long long)h);
    first = false;
  }
  printf("\n]}\n");
  return 0;
}
