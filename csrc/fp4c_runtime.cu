// The few CUDA runtime calls the converter's torch-free path needs (fp4convert/cuda/runtime.py):
// pinned and device buffers, streams, events, asynchronous copies; and a host-side NaN/Inf scan
// of kept tensors' bytes. The converter then never imports torch on a CUDA run of plain 2-D
// weights (torch's import alone took 4 s on the H100 machine, as long as `cp -r` of the whole
// checkpoint). Every call returns a cudaError_t (0: success); fp4c_error_string names it.

#include "fp4c_layout.cuh"

FP4C_API int fp4c_host_alloc(void** p, int64_t n) { return cudaHostAlloc(p, (size_t)n, cudaHostAllocDefault); }
FP4C_API int fp4c_host_free(void* p) { return cudaFreeHost(p); }
// A pinned buffer the kernels can also write through its host pointer (UVA), from any GPU: the public
// API's per-thread non-finite flags, which the host zeroes and reads after one stream sync (no memset
// launch, no device-to-host copy).
FP4C_API int fp4c_host_alloc_mapped(void** p, int64_t n) {
  return cudaHostAlloc(p, (size_t)n, cudaHostAllocMapped | cudaHostAllocPortable);
}
FP4C_API int fp4c_malloc(void** p, int64_t n) { return cudaMalloc(p, (size_t)n); }
FP4C_API int fp4c_free(void* p) { return cudaFree(p); }
FP4C_API int fp4c_stream_create(void** s) { return cudaStreamCreateWithFlags((cudaStream_t*)s, cudaStreamNonBlocking); }
FP4C_API int fp4c_stream_destroy(void* s) { return cudaStreamDestroy((cudaStream_t)s); }
FP4C_API int fp4c_stream_sync(void* s) { return cudaStreamSynchronize((cudaStream_t)s); }
FP4C_API int fp4c_event_create(void** e) { return cudaEventCreateWithFlags((cudaEvent_t*)e, cudaEventDisableTiming); }
FP4C_API int fp4c_event_destroy(void* e) { return cudaEventDestroy((cudaEvent_t)e); }
FP4C_API int fp4c_event_record(void* e, void* s) { return cudaEventRecord((cudaEvent_t)e, (cudaStream_t)s); }
FP4C_API int fp4c_event_sync(void* e) { return cudaEventSynchronize((cudaEvent_t)e); }

// kind: 1 host to device, 2 device to host (cudaMemcpyKind's values).
FP4C_API int fp4c_memcpy_async(void* dst, const void* src, int64_t n, int kind, void* s) {
  if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost) return FP4C_EINVAL;
  return cudaMemcpyAsync(dst, src, (size_t)n, (cudaMemcpyKind)kind, (cudaStream_t)s);
}

FP4C_API int fp4c_memset_async(void* p, int value, int64_t n, void* s) {
  return cudaMemsetAsync(p, value, (size_t)n, (cudaStream_t)s);
}

FP4C_API int fp4c_device_count(int* n) { return cudaGetDeviceCount(n); }

// Does any element hold NaN or Inf? Its exponent field is all ones. dtype: 0 F32, 1 F16, 2 BF16,
// 3 F64, 4 F8_E4M3 (only S.1111.111 is NaN; no Inf), 5 F8_E5M2. Returns 1 / 0, or -1 for a bad
// dtype. One pass that the compiler vectorizes (no early exit: the loops stay branch-free).
template <typename T>
static int any_exponent_ones(const void* p, int64_t n, T mask) {
  const T* v = (const T*)p;
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= (T)(v[i] & mask) == mask;
  return bad;
}

FP4C_API int fp4c_host_nonfinite(const void* p, int64_t n, int dtype) {
  switch (dtype) {
    case 0: return any_exponent_ones<uint32_t>(p, n, 0x7F800000u);
    case 1: return any_exponent_ones<uint16_t>(p, n, (uint16_t)0x7C00u);
    case 2: return any_exponent_ones<uint16_t>(p, n, (uint16_t)0x7F80u);
    case 3: return any_exponent_ones<uint64_t>(p, n, 0x7FF0000000000000ull);
    case 4: return any_exponent_ones<uint8_t>(p, n, (uint8_t)0x7Fu);
    case 5: return any_exponent_ones<uint8_t>(p, n, (uint8_t)0x7Cu);
    default: return -1;
  }
}
