"""The ``cpu-native`` backend (fp4convert.quantizer.backends.cpu_native): the reference's bytes batch by batch, the torch
``cpu`` backend's bytes file by file, which runs take it by default, that such a run never imports torch, the
fallback to torch without a C++ compiler, and its NaN/Inf answers (the refusal, the kept tensors' scan)."""

from __future__ import annotations

import ctypes
import json
import logging
import os

import pytest
import torch

from fp4convert.kernels import cpu_lib as cpu_kernel, jit
from fp4convert.numerics import reference as ref
from fp4convert.quantizer.backend import IN_USE, Context, Settings
from fp4convert.quantizer.backends.cpu_native import CpuNativeBackend
from fp4convert.config import ConvertConfig
from fp4convert.quantizer.choice import choose_backend
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.run.distributed import World
from fp4convert.errors import ConfigError, NonFiniteError
from fp4convert.quantizer.items import Batch, grouped_offsets, make_items
from fp4convert.numerics.scheme import get_scheme
from fp4convert.numerics.swizzle import swizzle_scales

from tests import checkpoints as ck
from tests.oracle import fresh_seed, random_weight

pytestmark = pytest.mark.skipif(jit.cxx() is None, reason="no C++ compiler: the CPU kernel cannot be built here")

RULES = [(s, r) for s in ("nvfp4", "mxfp4") for r in get_scheme(s).scale_rules]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_llama(path, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The test Llama (fused q/k/v and gate/up groups, every layer one shape group per projection) with
    oracle.random_weight's values: many binades, exact ties, a zero block; one layer's q_proj tiny
    (subnormal block scales) so its fused group's amax is the others'."""
    cfg = ck.llama_config(64, 3)
    t = ck.llama_tensors(cfg, 0, dtype)
    for i, (name, x) in enumerate(t.items()):
        if x.dim() == 2:
            t[name] = random_weight(*x.shape, seed + i).to(dtype)
    t["model.layers.1.self_attn.q_proj.weight"] = (t["model.layers.1.self_attn.q_proj.weight"].float() * 1e-30).to(dtype)
    ck.write(path, t, cfg)
    return t


@pytest.mark.parametrize("scheme,rule", RULES)
@pytest.mark.parametrize("dtype,rotate,swizzle", [(torch.bfloat16, None, True), (torch.float16, "had16", False),
                                                  (torch.float32, "had16", True)])
def test_batches_are_the_references_bytes(tmp_path, scheme, rule, dtype, rotate, swizzle) -> None:
    """Every matrix of every batch (several shape groups, several members each) as reference.py
    quantizes it with its fused group's amax; scales linear or swizzled (padding zero)."""
    t = random_llama(tmp_path / "m", dtype, fresh_seed())
    _, plan, _ = plan_conversion(str(tmp_path / "m"), ConvertConfig(device="cpu", scheme=scheme, rotate=rotate, scale_rule=rule))
    settings = Settings(get_scheme(scheme), rotate, swizzle, rule)
    be = CpuNativeBackend.open(Context(settings, "cpu", World()))
    items = make_items(list(plan.units()), 5, 1 << 30)
    assert all(isinstance(it, Batch) for it in items) and any(len(it.groups) < len(it.members) for it in items)
    checked = 0
    for item in items:
        assert isinstance(item, Batch)
        reads = item.reads()
        offsets, total = grouped_offsets(reads)
        buf = be.host_buffer(total)
        for info, off in zip(reads, offsets):
            buf.view(off, info.nbytes)[:] = _raw(t[info.name])
        staged = be.stage(item, (buf, list(zip(offsets, reads))))
        assert staged.inputs_free is IN_USE  # the kernel reads the buffer in place ...
        pending = be.quantize(staged)
        assert pending.inputs_free is None  # ... and is done with it once both passes ran
        result = pending.result()
        assert result.refused == [False] * len(item.members)
        for i, ((d, _), out) in enumerate(zip(item.matrices, result.matrices)):
            assert out is not None
            x = t[d.name]
            if scheme == "nvfp4":
                ga = max(ref.tensor_amax(t[u.name], rotate) for u in item.units[item.unit_of[i]])
                want_p, want_s, want_gs = ref.nvfp4_quantize(x, ga, rotate, rule)
                assert out.amax == float(ga) and out.gs == float(want_gs)
            else:
                want_p, want_s = ref.mxfp4_quantize(x, rotate, rule)
                assert out.amax is None and out.gs is None
            if swizzle:
                want_s = swizzle_scales(want_s[None])[0]
            assert bytes(out.packed) == _raw(want_p), d.name
            assert bytes(out.scale) == _raw(want_s.view(torch.uint8)), d.name
            checked += 1
    be.close()
    assert checked == sum(len(it.members) for it in items) > 20


@pytest.mark.parametrize("fmt,scheme,rotate,rule", [
    ("compressed-tensors", "nvfp4", None, None), ("compressed-tensors", "mxfp4", "had16", "rceil"),
    ("modelopt", "nvfp4", None, "wmse"), ("fp4convert", "nvfp4", "had16", "mse"), ("fp4convert", "mxfp4", None, None),
])
def test_writes_the_torch_backends_bytes(tmp_path, fmt, scheme, rotate, rule) -> None:
    """Every output file byte-identical to the torch ``cpu`` backend's, with fused q/k/v groups split across
    shards, kept tensors of every kind (llama zoo), two lanes and one."""
    src = tmp_path / "src"
    ck.llama(src, zoo=True, layers=3)
    kw = dict(device="cpu", format=fmt, scheme=scheme, rotate=rotate, scale_rule=rule, max_shard_size=6000)
    want = convert(src, tmp_path / "torch", ConvertConfig(**kw, backend="cpu"))
    assert "quantize_kernel" not in want.stages_s
    fast = convert(src, tmp_path / "native", ConvertConfig(**kw))  # the default for --device cpu
    assert "quantize_kernel" in fast.stages_s and fast.counts["lanes"] == CpuNativeBackend.auto_lanes
    one = convert(src, tmp_path / "native1", ConvertConfig(**kw, lanes=1, backend="cpu-native"))
    assert one.counts["lanes"] == 1 and "quantize_kernel" in one.stages_s
    assert ck.all_files(tmp_path / "native") == ck.all_files(tmp_path / "torch") == ck.all_files(tmp_path / "native1")


def test_which_runs_take_it(tmp_path, monkeypatch) -> None:
    from tests import zoo

    ck.definitions_in_process(monkeypatch)  # no planner child per model (1-2 s each)
    src = tmp_path / "m"
    ck.llama(src, zoo=True)
    for device, want in (("cpu", "cpu-native"), ("cuda", "cuda"), ("auto", "cuda")):
        config = ConvertConfig(device=device)
        _, plan, _ = plan_conversion(str(src), config)
        assert choose_backend(config, World(), plan) == want, device
    assert CpuNativeBackend.supports(plan)
    config = ConvertConfig(device="cpu")
    assert choose_backend(ConvertConfig(device="cpu", backend="cpu"), World(), plan) == "cpu"  # by name
    # 3-D stacked experts: the torch backend (supports() is the cuda backend's, whose test has more cases)
    _, p2, _ = plan_conversion(str(zoo.build("gpt_oss", tmp_path / "g")), config)
    assert not CpuNativeBackend.supports(p2) and choose_backend(config, World(), p2) is None
    # --input-weights: the CPU kernel has no weighted search, so the torch backend; by name, refused up front
    weighted = ConvertConfig(device="cpu", input_weights="random")
    _, p3, _ = plan_conversion(str(src), weighted)
    assert not CpuNativeBackend.supports(p3) and choose_backend(weighted, World(), p3) is None
    with pytest.raises(ConfigError, match="no input-weighted search"):
        choose_backend(ConvertConfig(device="cpu", input_weights="random", backend="cpu-native"), World(), p3)
    with pytest.raises(ConfigError, match="cpu-native runs in one process on the CPU"):
        CpuNativeBackend.open(Context(Settings(get_scheme("nvfp4"), None, False, "max"), "cuda:0", World()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert choose_backend(config, World.from_env(), plan) is None  # torchrun: torch's


def test_cli_run_never_imports_torch(tmp_path) -> None:
    src = tmp_path / "src"
    ck.llama(src, zoo=True)
    proc, stack = ck.cli_watching_torch(tmp_path, "quantize", src, tmp_path / "q", "--device", "cpu", "--json",
                                        env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert stack == "", stack
    assert "quantize_kernel" in json.loads(proc.stdout[proc.stdout.index("{"):])["stages_s"]
    convert(src, tmp_path / "torch", ConvertConfig(device="cpu", backend="cpu"))
    assert ck.all_files(tmp_path / "q") == ck.all_files(tmp_path / "torch")


def test_without_a_compiler_the_torch_backend_runs_after_one_warning(tmp_path, monkeypatch, caplog) -> None:
    src = tmp_path / "src"
    ck.llama(src)
    want = convert(src, tmp_path / "want", ConvertConfig(device="cpu", scale_rule="max"))  # "max": a quick torch path
    assert "quantize_kernel" in want.stages_s
    monkeypatch.setattr(cpu_kernel, "_state", {})  # as in a fresh process ...
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))  # ... with no compiler
    monkeypatch.setenv("FP4CONVERT_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="fp4convert"):
        got = convert(src, tmp_path / "got", ConvertConfig(device="cpu", scale_rule="max"))
    assert "quantize_kernel" not in got.stages_s
    warned = [r for r in caplog.records if "compiled CPU kernel is unavailable" in r.getMessage()]
    assert len(warned) == 1 and "no-such-c++" in warned[0].getMessage()
    assert ck.all_files(tmp_path / "got") == ck.all_files(tmp_path / "want")
    with pytest.raises(ConfigError, match="needs the compiled CPU kernel"):  # asked for by name: an error
        convert(src, tmp_path / "named", ConvertConfig(device="cpu", backend="cpu-native"))


def test_nan_is_refused_and_a_kept_nan_is_flagged(tmp_path) -> None:
    src = tmp_path / "nan"
    bad = ck.nan_checkpoint(src)
    for scheme in ("nvfp4", "mxfp4"):  # refused by pass 1's amax, by pass 2's flags
        with pytest.raises(NonFiniteError, match="down_proj"):
            convert(src, tmp_path / f"q-{scheme}", ConvertConfig(device="cpu", scheme=scheme))
    res = convert(src, tmp_path / "k", ConvertConfig(device="cpu", ignore=("*.down_proj",)))
    assert "quantize_kernel" in res.stages_s
    assert any(bad in w and "NaN or Inf" in w for w in res.to_json()["warnings"])
    assert json.loads((tmp_path / "k" / "fp4convert.json").read_text())["tensors"][bad]["nonfinite"] is True


@pytest.mark.parametrize("dtype,tdt", [("F16", torch.float16), ("BF16", torch.bfloat16), ("F8_E4M3", torch.float8_e4m3fn),
                                       ("F8_E5M2", torch.float8_e5m2), ("F32", torch.float32), ("F64", torch.float64)])
def test_kept_tensor_scan_agrees_with_isfinite(dtype, tdt) -> None:
    """The kernel's scan of kept tensors' bytes: every 8/16-bit pattern alone, and one bad value at the
    start, middle or end of a long run (across the scan's jobs), unaligned, writable or not."""
    be = CpuNativeBackend.open(Context(Settings(get_scheme("nvfp4"), None, False, "max"), "cpu", World()))
    width = torch.finfo(tdt).bits
    k = width // 8
    if width <= 16:
        pats = torch.arange(2**width, dtype=torch.int32).to(torch.int16 if width == 16 else torch.uint8)
        finite = torch.isfinite(pats.view(tdt).float()).tolist()
        raw = pats.numpy().tobytes()
        for i, ok in enumerate(finite):
            assert be.nonfinite(dtype, memoryview(bytearray(raw[i * k : (i + 1) * k]))) is (not ok), (dtype, i)
    good = torch.randn(300007).to(tdt)
    good = torch.where(torch.isfinite(good.float()), good, torch.zeros_like(good))
    raw = good.view(torch.uint8).numpy().tobytes()
    assert be.nonfinite(dtype, memoryview(bytearray(b"\0" + raw))[1:]) is False  # unaligned
    bad = torch.tensor([float("nan")]).to(tdt).view(torch.uint8).numpy().tobytes()
    for pos in (0, 150000, 300006):
        y = bytearray(raw)
        y[pos * k : (pos + 1) * k] = bad
        assert be.nonfinite(dtype, memoryview(y)) is True, pos
        assert be.nonfinite(dtype, memoryview(bytes(y))) is True  # read-only bytes too
    assert be.nonfinite("I32", memoryview(bytearray(b"\xff" * 8))) is False


def test_global_scale_is_the_references() -> None:
    lib = cpu_kernel.get()
    amax = torch.tensor([0.0, 1e-40, 2.5, 3.0, 7.9e-36, 3.4e38, float("nan"), float("inf"), 1e-45], dtype=torch.float32)
    gs = torch.empty_like(amax)
    assert lib.fp4c_cpu_global_scale(ctypes.c_void_p(amax.data_ptr()), ctypes.c_void_p(gs.data_ptr()), amax.numel()) == 0
    want = ref.global_scale(amax)
    same = (gs.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(gs) & torch.isnan(want))
    assert bool(same.all()), (gs, want)
