"""The public API's C++ glue (fp4convert/kernels/cuda/api_ext.py, csrc/fp4c_api.cpp), built with the C++ compiler
against the installed torch. On the CPU it is driven with a stand-in launcher (a ctypes callback) to
check what it allocates and what it hands the launcher; on a GPU the public API's bytes through it
are compared with the reference in tests/kernels/test_cuda_kernels.py."""

from __future__ import annotations

import ctypes
import sysconfig
from pathlib import Path

import pytest
import torch

from fp4convert.kernels.cuda import api_ext

pytestmark = pytest.mark.skipif(
    api_ext.compiler() is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
    reason="needs a C++ compiler and the Python headers")

LAUNCHER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                            ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    import os

    old = os.environ.get("FP4CONVERT_CACHE_DIR")
    os.environ["FP4CONVERT_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    calls: list[tuple] = []

    def fake(x, dt, fmt, rot, swz, rule, b, m, k, amax, gs, packed, scale, flag, stream):
        calls.append((x, dt, fmt, rot, swz, rule, b, m, k, amax, gs, packed, scale, flag, stream))
        ctypes.memset(packed, 0xAB, b * m * k // 2)
        if gs:
            for i in range(b):  # gs = amax + 1, read through the pointer it was given
                ctypes.c_float.from_address(gs + 4 * i).value = ctypes.c_float.from_address(amax + 4 * i).value + 1
        return 7 if rule == 2 else 0

    cb = LAUNCHER(fake)
    try:
        module = api_ext.load()
        path = api_ext.build()
        assert api_ext.build() == path  # cached: the second call finds it
        yield module, ctypes.cast(cb, ctypes.c_void_p).value, calls
    finally:
        if old is None:
            os.environ.pop("FP4CONVERT_CACHE_DIR", None)
        else:
            os.environ["FP4CONVERT_CACHE_DIR"] = old


def test_glue_allocates_the_outputs_and_hands_the_launcher_their_addresses(glue) -> None:
    module, launcher, calls = glue
    x = torch.randn(2, 3, 32, 64).to(torch.bfloat16)
    amax = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    code, packed, scale, gs = module.quantize(launcher, x, amax, 2, 0, 1, 1, 0, 128, 4, 0x1000, 0x2000)
    assert code == 0 and module.abi() == 4
    assert packed.shape == (2, 3, 32, 32) and packed.dtype == torch.uint8 and bool((packed == 0xAB).all())
    assert scale.shape == (2, 3, 128, 4) and scale.dtype == torch.float8_e4m3fn
    assert gs.shape == (2, 3) and torch.equal(gs, amax + 1)
    c = calls[-1]
    assert c[0] == x.data_ptr() and c[1:9] == (2, 0, 1, 1, 0, 6, 32, 64)
    assert (c[9], c[10], c[11], c[12]) == (amax.data_ptr(), gs.data_ptr(), packed.data_ptr(), scale.data_ptr())
    assert (c[13], c[14]) == (0x1000, 0x2000)
    # MXFP4: no amax, no gs, uint8 scales; the launcher's error code comes back as it is
    code, packed, scale, gs = module.quantize(launcher, x[0, 0], None, 2, 1, 0, 0, 2, 32, 2, 0, 0)
    assert code == 7 and gs is None and scale.dtype == torch.uint8 and scale.shape == (32, 2)
    assert calls[-1][6:9] == (1, 32, 64) and calls[-1][9] is None and calls[-1][10] is None
    with pytest.raises(RuntimeError, match="amax per matrix"):
        module.quantize(launcher, x, amax[0], 2, 0, 0, 0, 0, 32, 4, 0, 0)
    with pytest.raises(RuntimeError, match="no launcher"):
        module.quantize(0, x, amax, 2, 0, 0, 0, 0, 32, 4, 0, 0)


def test_glue_off_switch_and_failed_build_leave_the_python_path(tmp_path, monkeypatch, caplog) -> None:
    """FP4CONVERT_API_GLUE=0: no build at all; a compiler that fails: one log line, then None for good."""
    import logging

    monkeypatch.setattr(api_ext, "_state", {})
    monkeypatch.setenv("FP4CONVERT_API_GLUE", "0")
    assert api_ext.get() is None and api_ext.wait() is None and "thread" not in api_ext._state
    monkeypatch.delenv("FP4CONVERT_API_GLUE")
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false --not-a-compiler")  # a command with arguments, which fails
    with caplog.at_level(logging.INFO, logger="fp4convert.kernels.cuda"):
        assert api_ext.wait() is None
    assert api_ext._state["module"] is None and api_ext.get() is None
    assert any("C++ glue is unavailable" in r.message for r in caplog.records)


def test_the_package_ships_every_source_the_lazy_builds_need() -> None:
    """pyproject's package-data globs cover every file in csrc/ that a build reads (a wheel without
    fp4c_api.cpp would silently lose the glue)."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fp4convert.kernels.cuda"]
    needed = [p for p in (root / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".cpp")]
    assert any(p.name == api_ext.SOURCE for p in needed)
    for p in needed:
        assert any(fnmatch.fnmatch(f"csrc/{p.name}", g) for g in globs), p.name
