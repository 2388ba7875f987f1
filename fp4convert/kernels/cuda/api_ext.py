"""The public API's optional C++ glue (``csrc/fp4c_api.cpp``): outputs and launch in one call.

A ``fp4convert.quantize`` call on a CUDA tensor syncs for its NaN/Inf check, so its host time sits
between kernels; most of that time is creating the three output tensors through torch's Python
argument parser. The glue creates them with ``at::empty`` and launches through the kernel
library's own ``fp4c_quantize`` (handed its address), so the bytes are those of the Python path.

It is built with the C++ compiler against the installed torch's headers, never at import: the
first CUDA call starts the build in a background thread (~1 min, once per torch and source
version; cached beside the kernel library) and calls take the Python path until it is ready, or
for good if it cannot be built (no compiler, no Python headers): a debug log line, nothing else.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

from fp4convert.errors import CUDABuildError
from fp4convert.kernels import jit
from fp4convert.kernels.cuda.build import source_dir

log = logging.getLogger("fp4convert.kernels.cuda")

SOURCE = "fp4c_api.cpp"
NAME = "fp4c_api"
CXX_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-w")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "thread": the background build, "module": the loaded glue (or None)


def compiler() -> list[str] | None:
    """$CXX (a command, e.g. ``ccache g++``), or c++ / g++ on PATH."""
    return jit.cxx()


def build() -> Path:
    """Path of the built glue for the installed torch, compiling it if the cache lacks it."""
    import torch
    from torch.utils import cpp_extension

    cxx = compiler()
    if cxx is None:
        raise CUDABuildError("no C++ compiler (set CXX)")
    src = source_dir() / SOURCE
    py_inc = sysconfig.get_paths()["include"]
    if not (Path(py_inc) / "Python.h").is_file():
        raise CUDABuildError(f"no Python headers at {py_inc} (install python3-dev)")
    libs = cpp_extension.library_paths()
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = [*CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={NAME}",
             "-DTORCH_API_INCLUDE_EXTENSION_H", *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{py_inc}"]
    link = [*(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch", "-ltorch_cpu",
            "-ltorch_python"]
    spec = jit.BuildSpec(lib=f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}", tag="api",
                         compiler=tuple(cxx), sources=(src,), flags=tuple(flags), link=tuple(link),
                         identity=(torch.__version__, torch.__file__, sys.version), what="public API's C++ glue",
                         error=CUDABuildError)
    return spec.build()


def load() -> ModuleType:
    """Build (or find) and import the glue now; CUDABuildError if it cannot be used."""
    from fp4convert.kernels.cuda.build import ABI_VERSION

    path = build()
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if module.abi() != ABI_VERSION:  # its launcher signature is another library's
        raise CUDABuildError(f"the API glue speaks kernel ABI {module.abi()}, the library {ABI_VERSION}")
    return module


def launcher_address(lib: ctypes.CDLL) -> int:
    """What the glue calls: this library's fp4c_quantize (a library per compute capability)."""
    return ctypes.cast(lib.fp4c_quantize, ctypes.c_void_p).value


def get() -> ModuleType | None:
    """The glue if it is ready; else None (the first call starts its build in the background; a
    failed build logs the reason and leaves the Python path for good, with the same bytes).
    ``FP4CONVERT_API_GLUE=0`` keeps the Python path (an A/B switch)."""
    if "module" in _state:
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "thread" not in _state and os.environ.get("FP4CONVERT_API_GLUE") != "0":

            def run() -> None:
                try:
                    module = load()
                except Exception as exc:  # noqa: BLE001 - optional: the Python path stays
                    log.info("fp4convert: the public API's C++ glue is unavailable, using the Python path "
                             "(same bytes, ~15 us more per call): %s", str(exc).splitlines()[0])
                    module = None
                _state["module"] = module

            t = _state["thread"] = threading.Thread(target=run, name="fp4convert-api-glue", daemon=True)
            t.start()
    return None


def wait() -> ModuleType | None:
    """Start the build if needed and wait for it (tests and benchmarks: time the steady state)."""
    get()
    t = _state.get("thread")
    if isinstance(t, threading.Thread):
        t.join()
    return _state.get("module")  # type: ignore[return-value]
