"""The CUDA backend's packaging behaviour, on any machine: no build at import, clear deferred errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fp4convert import FP4ConvertError
from fp4convert.cuda import build
from fp4convert.cuda.errors import CUDABuildError, CUDAKernelError, CUDAUnavailableError


def test_import_builds_nothing(tmp_path) -> None:
    code = "import fp4convert, fp4convert.cuda.ops as o; o.available(); print('ok')"
    env = {"FP4CONVERT_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "ok"
    assert not any(tmp_path.iterdir())


def test_errors_are_fp4convert_errors() -> None:
    for cls in (CUDABuildError, CUDAKernelError, CUDAUnavailableError):
        assert issubclass(cls, FP4ConvertError) and cls.__doc__


def test_missing_nvcc_is_a_clear_deferred_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FP4CONVERT_NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(CUDAUnavailableError, match="nvcc"):
        build.build_library((9, 0))


def test_arch_flags() -> None:
    assert build.arch_flags((9, 0)) == ("sm_90", ["-gencode", "arch=compute_90,code=sm_90"])
    assert build.arch_flags((10, 0))[0] == "sm_100a"
    assert build.arch_flags((12, 0))[0] == "sm_120a"


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
def test_build_is_cached_per_arch_and_hash(tmp_path, monkeypatch) -> None:
    """One real nvcc build for sm_90 (compile only: no GPU needed), then a cache hit."""
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path))
    lib = build.build_library((9, 0))
    assert lib.is_file() and lib.parent.name.startswith("sm_90-")
    mtime = lib.stat().st_mtime_ns
    assert build.build_library((9, 0)) == lib and lib.stat().st_mtime_ns == mtime
