"""The torch-free CPU backend (fp4convert.cpu_direct): the torch pipeline's bytes, without torch.

convert.py does not route --device cpu to it yet (its wiring is the run loop owner's: two lines, see
cpu_direct's docstring), so these tests wire it in with monkeypatch exactly as proposed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fp4convert import convert as convert_mod
from fp4convert import cpu_direct, cpu_kernel, direct, jit
from fp4convert.config import ConvertConfig
from fp4convert.convert import convert, plan_conversion
from fp4convert.distributed import World

from . import checkpoints as ck

pytestmark = pytest.mark.skipif(jit.cxx() is None, reason="no C++ compiler: the CPU kernel cannot be built here")


def wire(monkeypatch) -> None:
    """The proposed convert.py wiring: a CPU device gets cpu_direct's runtime, lanes its backend."""
    real = convert_mod._direct_runtime

    def runtime(config, world, plan):
        return cpu_direct.runtime(config, world, plan) if config.device == "cpu" else real(config, world, plan)

    monkeypatch.setattr(convert_mod, "_direct_runtime", runtime)
    real_backend = direct.DirectBackend
    monkeypatch.setattr(direct, "DirectBackend",
                        lambda rt: rt.backend() if isinstance(rt, cpu_direct.CpuRuntime) else real_backend(rt))


@pytest.mark.parametrize("fmt,scheme,rotate,rule", [
    ("compressed-tensors", "nvfp4", None, None), ("compressed-tensors", "nvfp4", "had16", "mse"),
    ("compressed-tensors", "mxfp4", None, None), ("compressed-tensors", "mxfp4", "had16", "rceil"),
    ("modelopt", "nvfp4", None, "wmse"), ("fp4convert", "nvfp4", "had16", "max"), ("fp4convert", "mxfp4", None, "floor"),
])
def test_writes_the_torch_pipelines_bytes(tmp_path, monkeypatch, fmt, scheme, rotate, rule) -> None:
    """Every output file byte-identical to the torch pipeline's, with fused q/k/v groups split across
    shards, kept tensors of every kind (llama zoo), several lanes and one."""
    src = tmp_path / "src"
    ck.llama(src, zoo=True, layers=3)
    kw = dict(device="cpu", format=fmt, scheme=scheme, rotate=rotate, scale_rule=rule, max_shard_size=6000)
    want = convert(src, tmp_path / "torch", ConvertConfig(**kw))
    assert "quantize_kernel" not in want.stages_s
    wire(monkeypatch)
    fast = convert(src, tmp_path / "direct", ConvertConfig(**kw))
    assert "quantize_kernel" in fast.stages_s  # the CPU direct backend ran
    assert fast.counts["lanes"] > 1
    convert(src, tmp_path / "direct1", ConvertConfig(**kw, lanes=1))
    assert ck.all_files(tmp_path / "direct") == ck.all_files(tmp_path / "torch") == ck.all_files(tmp_path / "direct1")


def test_which_runs_qualify(tmp_path, monkeypatch) -> None:
    from . import zoo

    src = tmp_path / "m"
    ck.llama(src, zoo=True)
    for device, want in (("cpu", True), ("cuda", False), ("auto", False)):
        config = ConvertConfig(device=device)
        _, plan, _ = plan_conversion(str(src), config)
        assert (cpu_direct.runtime(config, World(), plan) is not None) is want, device
    config = ConvertConfig(device="cpu")
    _, plan, _ = plan_conversion(str(src), config)
    monkeypatch.setenv("FP4CONVERT_TORCH_PIPELINE", "1")
    assert cpu_direct.runtime(config, World(), plan) is None
    monkeypatch.delenv("FP4CONVERT_TORCH_PIPELINE")
    monkeypatch.setenv("FP4CONVERT_CPU_KERNEL", "0")  # no kernel: the torch pipeline
    assert cpu_direct.runtime(config, World(), plan) is None
    monkeypatch.delenv("FP4CONVERT_CPU_KERNEL")
    stacked = zoo.build("gpt_oss", tmp_path / "g")  # 3-D stacked experts: the torch pipeline
    _, plan, _ = plan_conversion(str(stacked), config)
    assert cpu_direct.runtime(config, World(), plan) is None


def test_nan_is_refused_and_a_kept_nan_is_flagged(tmp_path, monkeypatch) -> None:
    wire(monkeypatch)
    src = tmp_path / "nan"
    bad = ck.nan_checkpoint(src)
    from fp4convert.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="down_proj"):
        convert(src, tmp_path / "q", ConvertConfig(device="cpu"))
    res = convert(src, tmp_path / "k", ConvertConfig(device="cpu", ignore=("*.down_proj",)))
    assert "quantize_kernel" in res.stages_s
    assert any(bad in w and "NaN or Inf" in w for w in res.to_json()["warnings"])
    assert json.loads((tmp_path / "k" / "fp4convert.json").read_text())["tensors"][bad]["nonfinite"] is True


@pytest.mark.parametrize("dtype,tdt", [("F16", torch.float16), ("BF16", torch.bfloat16), ("F8_E4M3", torch.float8_e4m3fn),
                                       ("F8_E5M2", torch.float8_e5m2), ("F32", torch.float32), ("F64", torch.float64)])
def test_host_scan_agrees_with_isfinite(dtype, tdt) -> None:
    """The kernel's scan of kept tensors' bytes: every 8/16-bit pattern alone, and one bad value at the
    start, middle or end of a long run (across the scan's jobs), unaligned."""
    rt = cpu_direct.CpuRuntime(cpu_kernel.get(), threads=3)
    width = torch.finfo(tdt).bits
    k = width // 8
    if width <= 16:
        pats = torch.arange(2**width, dtype=torch.int32).to(torch.int16 if width == 16 else torch.uint8)
        finite = torch.isfinite(pats.view(tdt).float()).tolist()
        raw = pats.numpy().tobytes()
        for i, ok in enumerate(finite):
            assert rt.host_check(dtype, memoryview(bytearray(raw[i * k : (i + 1) * k]))) is (not ok), (dtype, i)
    good = torch.randn(300007).to(tdt)
    good = torch.where(torch.isfinite(good.float()), good, torch.zeros_like(good))
    raw = good.view(torch.uint8).numpy().tobytes()
    assert rt.host_check(dtype, memoryview(bytearray(b"\0" + raw))[1:]) is False  # unaligned
    bad = torch.tensor([float("nan")]).to(tdt).view(torch.uint8).numpy().tobytes()
    for pos in (0, 150000, 300006):
        y = bytearray(raw)
        y[pos * k : (pos + 1) * k] = bad
        assert rt.host_check(dtype, memoryview(y)) is True, pos
        assert rt.host_check(dtype, memoryview(bytes(y))) is True  # read-only bytes too
    assert rt.host_check("I32", memoryview(bytearray(b"\xff" * 8))) is False


def test_global_scale_is_the_references() -> None:
    import ctypes

    from fp4convert import reference as ref

    lib = cpu_kernel.get()
    amax = torch.tensor([0.0, 1e-40, 2.5, 3.0, 7.9e-36, 3.4e38, float("nan"), float("inf"), 1e-45], dtype=torch.float32)
    gs = torch.empty_like(amax)
    assert lib.fp4c_cpu_global_scale(ctypes.c_void_p(amax.data_ptr()), ctypes.c_void_p(gs.data_ptr()), amax.numel()) == 0
    want = ref.global_scale(amax)
    same = (gs.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(gs) & torch.isnan(want))
    assert bool(same.all()), (gs, want)


def test_the_cli_run_never_imports_torch(tmp_path) -> None:
    """The wired CPU run, in a fresh process: no torch module is ever imported, and the bytes are the
    torch pipeline's."""
    src = tmp_path / "src"
    ck.llama(src, zoo=True)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        import builtins
        real_import = builtins.__import__
        def watch(name, *a, **k):
            if name == "torch" or name.startswith("torch."):
                import traceback
                raise SystemExit("torch imported:\\n" + "".join(traceback.format_stack()))
            return real_import(name, *a, **k)
        builtins.__import__ = watch
        from fp4convert import convert as c, cpu_direct, direct
        real = c._direct_runtime
        c._direct_runtime = lambda config, world, plan: (cpu_direct.runtime(config, world, plan)
                                                         if config.device == "cpu" else real(config, world, plan))
        real_backend = direct.DirectBackend
        direct.DirectBackend = lambda rt: rt.backend() if isinstance(rt, cpu_direct.CpuRuntime) else real_backend(rt)
        from fp4convert.cli import main
        main(["quantize", {str(src)!r}, {str(tmp_path / 'q')!r}, "--device", "cpu", "--json"], prog_name="fp4convert")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "quantize_kernel" in json.loads(proc.stdout[proc.stdout.index("{"):])["stages_s"]
    convert(src, tmp_path / "torch", ConvertConfig(device="cpu"))
    assert ck.all_files(tmp_path / "q") == ck.all_files(tmp_path / "torch")
