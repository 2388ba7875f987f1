// fp4convert kernels: the library's own entry points (ABI version, device, error strings).
//
// Plain CUDA C++, no torch headers: extern "C" launchers take raw device pointers and a cudaStream_t,
// so nvcc alone compile-checks every file for sm_90 / sm_100a / sm_120a and Python calls them via
// ctypes (fp4convert/cuda/build.py compiles all csrc/*.cu into one shared library).
//   fp4c_layout.cuh    memory: element types, loads/stores, the 128x4 scale layout, grid helpers
//   fp4c_numerics.cuh  docs/numerics.md arithmetic, mirroring fp4convert/reference.py
//   fp4c_amax.cu, fp4c_quantize.cu, fp4c_dequantize.cu, fp4c_decode.cu, fp4c_selftest.cu: kernels
// Measurements and the alternatives tried: benchmarks/NOTES.md, BENCHMARKS.md.

#include "fp4c_layout.cuh"

// 2: split sources; fp4c_quantize takes amax (gs computed inside, returned) and a scale rule; input
// decode launchers; no tuning switches. 3: the runtime calls of fp4c_runtime.cu (torch-free path).
FP4C_API int fp4c_abi_version() { return 4; }

// The launchers run on the calling thread's current device of this library's own CUDA runtime;
// the caller makes it the tensors' device first.
FP4C_API int fp4c_set_device(int device) { return cudaSetDevice(device); }

FP4C_API const char* fp4c_error_string(int code) {
  if (code == FP4C_EINVAL) return "fp4convert kernel launcher: invalid argument";
  return cudaGetErrorString((cudaError_t)code);
}
