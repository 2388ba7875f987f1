"""The backends: one module each, named as ``--backend`` names it (``_`` read as ``-``).

Each module defines ``BACKEND``, a class implementing :class:`fp4convert.quantizer.backend.Backend`; the
registry (:func:`fp4convert.quantizer.backend.backend_names`) lists this package's modules without importing
them, so adding a backend is adding a module here (and its test). Nothing else belongs in this package.

- ``cpu``: the host's cores, each matrix cut in row slices run by a thread pool (torch CPU ops);
- ``stacked``: torch on a GPU, every shape group of a batch one ``[B, M, K]`` launch (every unit
  kind, torchrun); on the CPU it runs the same scheduling, which is how the tests check it;
- ``cuda``: the GPU without torch (the kernel library through ctypes), plain 2-D weights only;
- ``cpu-native``: the CPU without torch (the compiled CPU kernel through ctypes, every shape group of
  a batch one threaded call), plain 2-D weights only: ``--device cpu``'s default where it qualifies.
"""
