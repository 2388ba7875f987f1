// fp4convert's public-API glue (optional): the output tensors and the quantize launch in one C++ call.
// A Python call of fp4convert.quantize on a CUDA tensor spends most of its host time creating three
// output tensors (3-7 us each through torch's Python argument parser) before the launch, and that
// time is exposed between kernels because the call syncs for its NaN/Inf check. Here the outputs come
// from at::empty and the launch goes through the kernel library's own fp4c_quantize (its address is
// handed in by fp4convert/cuda/ops.py with every call), so no kernel code is compiled here: plain g++ against
// the installed torch's headers, built lazily and cached like the kernel library. Any failure to
// build leaves the Python path in place; both give the same bytes (the launcher is the same).

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace {

using Launcher = int (*)(const void* x, int dtype, int fmt, int rotate, int swizzle, int rule, int64_t B, int64_t M,
                         int64_t K, const float* amax, float* gs, uint8_t* packed, uint8_t* scale, int* flag,
                         void* stream);

// The kernel library's ABI this launcher signature belongs to (fp4convert/cuda/build.py ABI_VERSION):
// api_ext.py refuses the glue when they differ.
int kernel_abi() { return 4; }

// launcher: the address of the library's fp4c_quantize for x's GPU (a library per compute capability,
// so it comes with every call). x [..., M, K] contiguous; amax fp32 with one value per matrix (NVFP4)
// or None; scale [..., rows, cols] (rows, cols: the linear or the 128x4 layout's shape, from the
// caller). Returns (launcher code, packed uint8 [..., M, K/2], scale E4M3 (NVFP4) or uint8 (MXFP4),
// gs fp32 [...] or None).
py::tuple quantize(uintptr_t launcher, const at::Tensor& x, const c10::optional<at::Tensor>& amax, int dtype,
                   int fmt, int rotate, int swizzle, int rule, int64_t rows, int64_t cols, uintptr_t flags,
                   uintptr_t stream) {
  const auto g_launch = reinterpret_cast<Launcher>(launcher);
  TORCH_CHECK(g_launch != nullptr, "fp4c_api: no launcher");
  TORCH_CHECK(x.dim() >= 2, "fp4c_api: expected [..., M, K]");
  const auto sizes = x.sizes();
  const int64_t nd = x.dim(), m = sizes[nd - 2], k = sizes[nd - 1];
  std::vector<int64_t> lead(sizes.begin(), sizes.end() - 2);
  int64_t b = 1;
  for (int64_t d : lead) b *= d;
  const bool nvfp4 = fmt == 0;
  TORCH_CHECK(!nvfp4 || (amax.has_value() && amax->numel() == b), "fp4c_api: nvfp4 needs an amax per matrix");
  const auto u8 = x.options().dtype(at::kByte);
  std::vector<int64_t> shape(lead);
  shape.push_back(m);
  shape.push_back(k / 2);
  at::Tensor packed = at::empty(shape, u8);
  shape.resize(lead.size());
  shape.push_back(rows);
  shape.push_back(cols);
  at::Tensor scale = at::empty(shape, nvfp4 ? x.options().dtype(at::kFloat8_e4m3fn) : u8);
  at::Tensor gs;
  if (nvfp4) gs = at::empty(lead, x.options().dtype(at::kFloat));
  const int code = g_launch(x.data_ptr(), dtype, fmt, rotate, swizzle, rule, b, m, k,
                            nvfp4 ? static_cast<const float*>(amax->data_ptr()) : nullptr,
                            nvfp4 ? static_cast<float*>(gs.data_ptr()) : nullptr,
                            static_cast<uint8_t*>(packed.data_ptr()), static_cast<uint8_t*>(scale.data_ptr()),
                            reinterpret_cast<int*>(flags), reinterpret_cast<void*>(stream));
  if (nvfp4) return py::make_tuple(code, packed, scale, gs);
  return py::make_tuple(code, packed, scale, py::none());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("abi", &kernel_abi, "the kernel library ABI the launcher signature matches");
  m.def("quantize", &quantize, "outputs and the quantize launch in one call");
}
