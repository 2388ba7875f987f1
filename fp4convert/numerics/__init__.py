"""The numerics contract in code: the FP4 schemes and their scale rules, the pure-PyTorch reference, the swizzle.

docs/numerics.md is the contract; :mod:`.reference` is its executable form and imports no compiled code.
Every other path (the CPU and CUDA kernels) is tested against it byte for byte. This layer imports only
:mod:`fp4convert.errors`.
"""
