"""The CUDA backend's packaging behaviour, on any machine: no build at import, clear deferred errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fp4convert import FP4ConvertError
from fp4convert.kernels.cuda import build
from fp4convert.errors import CUDABuildError, CUDAKernelError, CUDAUnavailableError


def test_import_builds_nothing(tmp_path) -> None:
    code = "import fp4convert, fp4convert.kernels.cuda.ops as o; o.available(); print('ok')"
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


def _fake_nvcc(tmp_path, body: bytes = b"#!/bin/sh\nexit 1\n"):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir(exist_ok=True)
    nvcc.write_bytes(body)
    nvcc.chmod(0o755)
    return nvcc


def _csrc_copy(tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    for f in (*build.sources(build.source_dir())[0], *build.sources(build.source_dir())[1]):
        (src / f.name).write_bytes(f.read_bytes())
    return src


def test_sources_are_every_cu_and_cuh() -> None:
    cu, cuh = build.sources(build.source_dir())
    names = {f.name for f in cu}
    assert build.SOURCE_NAME in names and {"fp4c_quantize.cu", "fp4c_decode.cu", "fp4c_selftest.cu"} <= names
    assert {f.name for f in cuh} == {"fp4c_layout.cuh", "fp4c_numerics.cuh"}


def test_cache_key_covers_every_file_flags_and_nvcc(tmp_path) -> None:
    src = _csrc_copy(tmp_path)
    nvcc = _fake_nvcc(tmp_path)
    flags = ["-O3", "-gencode", "arch=compute_90,code=sm_90"]
    base = build.cache_key(src, flags, str(nvcc))
    assert build.cache_key(src, flags, str(nvcc)) == base
    for f in sorted(src.iterdir()):  # any source or header
        old = f.read_bytes()
        f.write_bytes(old + b"\n")
        assert build.cache_key(src, flags, str(nvcc)) != base, f.name
        f.write_bytes(old)
    (src / "fp4c_new.cu").write_text("// a new kernel file\n")
    assert build.cache_key(src, flags, str(nvcc)) != base
    (src / "fp4c_new.cu").unlink()
    assert build.cache_key(src, [*flags, "-lineinfo"], str(nvcc)) != base
    nvcc.write_bytes(nvcc.read_bytes() + b"# another toolkit\n")  # size changes: another nvcc
    assert build.cache_key(src, flags, str(nvcc)) != base


def test_cache_hit_runs_no_subprocess(tmp_path, monkeypatch) -> None:
    """A cached library is found with one stat of nvcc and a hash of the small sources: no `nvcc --version`."""
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FP4CONVERT_CSRC", str(_csrc_copy(tmp_path)))
    monkeypatch.setenv("FP4CONVERT_NVCC", str(_fake_nvcc(tmp_path)))
    tag, gencode = build.arch_flags((9, 0))
    key = build.cache_key(build.source_dir(), [*build.NVCC_FLAGS, *gencode], build.find_nvcc())
    lib = tmp_path / "cache" / f"{tag}-{key}" / build.LIB_NAME
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"cached")

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"subprocess on a cache hit: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    assert build.build_library((9, 0)) == lib


def test_failed_build_is_a_build_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FP4CONVERT_NVCC", str(_fake_nvcc(tmp_path, b"#!/bin/sh\necho broken >&2\nexit 3\n")))
    with pytest.raises(CUDABuildError, match="broken"):
        build.build_library((9, 0))
    assert not list((tmp_path / "cache").rglob("*.so"))


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
def test_build_is_cached_per_arch_and_hash(tmp_path, monkeypatch) -> None:
    """One real nvcc build for sm_90 of every file (compile only: no GPU needed), then a cache hit."""
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path))
    lib = build.build_library((9, 0))
    assert lib.is_file() and lib.parent.name.startswith("sm_90-")
    mtime = lib.stat().st_mtime_ns
    assert build.build_library((9, 0)) == lib and lib.stat().st_mtime_ns == mtime
    syms = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True).stdout
    for name in ("fp4c_abi_version", "fp4c_amax", "fp4c_quantize", "fp4c_dequantize", "fp4c_decode_fp8_block",
                 "fp4c_decode_mxfp4_blocks", "fp4c_e2m1_selftest"):
        assert f" T {name}" in syms, name
    assert "fp4c_set_tuning" not in syms


def test_scale_rule_codes() -> None:
    """The launchers' rule codes (docs/numerics.md "Scale rules" order) and the refusals, checked before any launch."""
    from fp4convert.kernels.cuda import ops

    assert [ops.scale_rule_code("nvfp4", r) for r in ("max", "4over6", "mse", "wmse")] == [0, 1, 2, 3]
    assert [ops.scale_rule_code("mxfp4", r) for r in ("floor", "rceil", "mse", "wmse")] == [0, 1, 2, 3]
    assert ops.scale_rule_code("mxfp4", 3) == 3
    for scheme, bad in (("nvfp4", "floor"), ("nvfp4", "rceil"), ("mxfp4", "max"), ("mxfp4", "4over6"), ("nvfp4", 4),
                        ("mxfp4", -1), ("nvfp4", True)):
        with pytest.raises(CUDAKernelError):
            ops.scale_rule_code(scheme, bad)
