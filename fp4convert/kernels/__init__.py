"""The compiled kernels and the one tensor API over them: CPU (``csrc/fp4c_cpu.cpp``) and CUDA (``csrc/*.cu``).

Each library is built lazily on first use, cached per arch and source hash (:mod:`.jit`); a missing
compiler or GPU is a clear error when it is needed, never at import. :mod:`.tensor` is the public
quantize / dequantize API (``fp4convert.quantize``), dispatching to whichever fits the tensor's device.
"""
