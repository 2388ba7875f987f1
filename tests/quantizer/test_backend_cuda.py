"""The ``cuda`` backend (fp4convert.quantizer.backends.cuda, fp4convert.kernels.cuda.runtime): which runs take it, the bytes
it writes (the ``stacked`` backend's and the CPU's, on the GPU), its error answers, and the host pieces
it has instead of torch (the kept tensors' NaN/Inf scan, pinned size classes, its launch bookkeeping)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct

import pytest
import torch

from fp4convert.numerics import reference as ref
from fp4convert.quantizer.backend import IN_USE, Settings
from fp4convert.quantizer.backends.cuda import CudaBackend
from fp4convert.config import ConvertConfig
from fp4convert.quantizer.choice import choose_backend
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.run.distributed import World
from fp4convert.formats import get_format
from fp4convert.quantizer.items import Batch

AUTO_LANES = CudaBackend.auto_lanes

from tests import checkpoints as ck

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("amax", [1e-30, 0.37, 3.0e38])
def test_modelopt_global_float_is_the_fp32_reciprocal(amax) -> None:
    """1/gs on a Python float, packed to fp32, equals torch's fp32 division (one rounding)."""
    gs = ref.global_scale(torch.tensor([amax], dtype=torch.float32))[0]
    f = get_format("modelopt")
    assert struct.pack("<f", f.global_float(float(gs))) == _bytes((1.0 / gs).reshape(1))


@pytest.mark.parametrize("case,device,want", [
    ("llama", "auto", True), ("llama", "cuda", True), ("llama", "cuda:1", True), ("llama", "cpu", False),
    ("gpt_oss", "cuda", False),  # 3-D stacked experts: the torch pipeline
    ("fp8", "cuda", False),  # an FP8 input to decode: the torch pipeline
])
def test_which_runs_are_torch_free(tmp_path, monkeypatch, case, device, want) -> None:
    from tests import zoo

    if case == "llama":
        src = tmp_path / "m"
        ck.llama(src, zoo=True)
    elif case == "fp8":
        zoo.fp8_block_variant(zoo.build("deepseek_v3", tmp_path / "bf16"), tmp_path / "m", block=(128, 128))
        src = tmp_path / "m"
    else:
        src = zoo.build(case, tmp_path / "m")
    config = ConvertConfig(device=device)
    _, plan, _ = plan_conversion(str(src), config)
    assert (choose_backend(config, World(), plan) == "cuda") is want
    assert CudaBackend.supports(plan) is (case == "llama")
    assert choose_backend(ConvertConfig(device=device, backend="stacked"), World(), plan) == "stacked"  # by name
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert choose_backend(config, World.from_env(), plan) is None  # torchrun: torch's


# --- on the GPU ----------------------------------------------------------------------------------

@pytest.mark.cuda
@GPU
@pytest.mark.parametrize("fmt,scheme,rotate,rule", [
    ("compressed-tensors", "nvfp4", None, None), ("compressed-tensors", "nvfp4", "had16", "mse"),
    ("compressed-tensors", "mxfp4", None, None), ("compressed-tensors", "mxfp4", "had16", "mse"),
    ("modelopt", "nvfp4", None, "4over6"), ("fp4convert", "nvfp4", "had16", None), ("fp4convert", "mxfp4", None, "rceil"),
])
def test_torch_free_path_writes_the_torch_pipelines_bytes(tmp_path, monkeypatch, fmt, scheme, rotate, rule) -> None:
    """Same checkpoint, both CUDA paths (and the CPU): every output file byte-identical, with fused
    q/k/v groups split across shards and kept tensors of every kind (llama zoo)."""
    src = tmp_path / "src"
    ck.llama(src, zoo=True, layers=3)
    kw = dict(device="cuda", format=fmt, scheme=scheme, rotate=rotate, scale_rule=rule, max_shard_size=6000)
    fast = convert(src, tmp_path / "direct", ConvertConfig(**kw))
    assert "quantize_waits_gpu" in fast.stages_s or scheme == "mxfp4"  # the direct backend ran
    assert fast.counts["lanes"] == AUTO_LANES  # several shards on their own streams and writer threads
    one = convert(src, tmp_path / "direct1", ConvertConfig(**kw, lanes=1))
    assert one.counts["lanes"] == 1
    convert(src, tmp_path / "torch", ConvertConfig(**kw, backend="stacked"))
    convert(src, tmp_path / "cpu", ConvertConfig(**{**kw, "device": "cpu"}))
    assert ck.all_files(tmp_path / "direct") == ck.all_files(tmp_path / "direct1") == ck.all_files(tmp_path / "torch") \
        == ck.all_files(tmp_path / "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_lanes_on_a_second_gpu(tmp_path) -> None:
    """--device cuda:1: every lane's thread allocates, launches and records events on GPU 1."""
    src = tmp_path / "src"
    ck.llama(src, zoo=True, layers=3)
    res = convert(src, tmp_path / "gpu1", ConvertConfig(device="cuda:1", lanes=3, max_shard_size=6000))
    assert res.counts["lanes"] == 3 and "quantize_waits_gpu" in res.stages_s
    convert(src, tmp_path / "cpu", ConvertConfig(device="cpu", max_shard_size=6000))
    assert ck.all_files(tmp_path / "gpu1") == ck.all_files(tmp_path / "cpu")


@pytest.mark.cuda
@GPU
def test_cli_on_cuda_never_imports_torch(tmp_path) -> None:
    src = tmp_path / "src"
    ck.llama(src, zoo=True)
    proc, stack = ck.cli_watching_torch(tmp_path, "quantize", src, tmp_path / "q", "--device", "cuda", "--json",
                                        env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert stack == "", stack
    convert(src, tmp_path / "cpu", ConvertConfig(device="cpu"))
    assert ck.all_files(tmp_path / "q") == ck.all_files(tmp_path / "cpu")


@pytest.mark.cuda
@GPU
def test_torch_free_path_flags_nan_in_a_kept_tensor(tmp_path) -> None:
    src = tmp_path / "nan"
    bad = ck.nan_checkpoint(src)
    res = convert(src, tmp_path / "q", ConvertConfig(device="cuda", ignore=("*.down_proj",)))
    assert "quantize_waits_gpu" in res.stages_s
    assert any(bad in w and "NaN or Inf" in w for w in res.to_json()["warnings"])
    assert json.loads((tmp_path / "q" / "fp4convert.json").read_text())["tensors"][bad]["nonfinite"] is True


@pytest.mark.cuda
@GPU
@pytest.mark.parametrize("dtype,tdt", [("F16", torch.float16), ("BF16", torch.bfloat16), ("F8_E4M3", torch.float8_e4m3fn),
                                       ("F8_E5M2", torch.float8_e5m2)])
def test_host_scan_of_every_bit_pattern(dtype, tdt) -> None:
    """The library's host scan agrees with torch.isfinite on every 8/16-bit pattern, alone and in a long run."""
    from fp4convert.kernels.cuda.runtime import Runtime

    rt = Runtime(0)
    width = torch.finfo(tdt).bits
    pats = torch.arange(2**width, dtype=torch.int32).to(torch.int16 if width == 16 else torch.uint8)
    vals = pats.view(tdt)
    finite = torch.isfinite(vals.float()).tolist()
    raw = pats.numpy().tobytes()
    k = width // 8
    for i, ok in enumerate(finite):
        assert rt.host_check(dtype, memoryview(bytearray(raw[i * k : (i + 1) * k]))) is (not ok), (dtype, i)
    good = torch.randn(10007).to(tdt)
    good = torch.where(torch.isfinite(good.float()), good, torch.zeros_like(good))
    assert rt.host_check(dtype, memoryview(bytearray(_bytes(good)))) is False
    for pos in (0, 5000, 10006):
        y = good.clone()
        y.view(torch.uint8 if k == 1 else torch.int16)[pos] = pats[[i for i, ok in enumerate(finite) if not ok][0]]
        assert rt.host_check(dtype, memoryview(bytearray(_bytes(y)))) is True
    assert rt.host_check("I32", memoryview(bytearray(b"\xff" * 8))) is False


@pytest.mark.cuda
@GPU
@pytest.mark.parametrize("dtype,tdt", [("F32", torch.float32), ("F64", torch.float64)])
def test_host_scan_wide_floats(dtype, tdt) -> None:
    from fp4convert.kernels.cuda.runtime import Runtime

    rt = Runtime(0)
    seed = int(torch.randint(0, 2**31, ()).item())
    x = torch.randn(4099, generator=torch.Generator().manual_seed(seed), dtype=tdt)
    x[0] = torch.finfo(tdt).max
    x[1] = torch.finfo(tdt).tiny / 4  # subnormal: finite
    assert rt.host_check(dtype, memoryview(bytearray(_bytes(x)))) is False, seed
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[4098] = bad
        assert rt.host_check(dtype, memoryview(bytearray(_bytes(y)))) is True, (seed, bad)


def test_pinned_size_classes() -> None:
    """Pinned buffers come in classes: small requests share the 64 KiB class, large ones waste <= 25%,
    and sizes are 64 KiB multiples (so a freed buffer fits the next similar request exactly)."""
    from fp4convert.kernels.cuda.runtime import SMALL, size_class

    assert size_class(1) == size_class(4 * 128) == SMALL
    for n in (SMALL + 1, 3 << 20, 18_500_000, 63_000_000, 64 << 20, 117 << 20, (1 << 30) + 1):
        c = size_class(n)
        assert n <= c < n * 1.25 + SMALL and c % SMALL == 0, n
        assert size_class(c) == c  # a class is its own class


# --- the cuda backend's bookkeeping on the CPU: a stand-in runtime whose "kernels" stamp each matrix ---

class _Mem:
    """Host memory standing in for device memory (ctypes buffers kept alive here)."""

    def __init__(self) -> None:
        self.keep: list = []

    def alloc(self, n: int) -> int:
        b = (ctypes.c_char * max(n, 1))()
        self.keep.append(b)
        return ctypes.addressof(b)


def _floats(ptr: int, n: int) -> list[float]:
    return list((ctypes.c_float * n).from_address(ptr))


class _StampLib:
    """amax: max |x| per matrix; quantize: every packed byte of matrix b = its tag (x[b][0] * 1000),
    every scale byte = tag + 7, gs = 2688 / amax, flag[b] = 1 for NaN/Inf: where each matrix's
    results land is then visible in the bytes."""

    def __init__(self, mem: _Mem) -> None:
        self.mem = mem

    def fp4c_malloc(self, pp, n):
        pp._obj.value = self.mem.alloc(n)
        return 0

    def fp4c_free(self, p):
        return 0

    def fp4c_amax(self, x, dt, rot, b, n, out, st):
        for i in range(b):
            v = _floats(x + 4 * n * i, n)
            (ctypes.c_float * b).from_address(out)[i] = max(abs(t) if t == t else float("nan") for t in v)
        return 0

    def fp4c_quantize_iw(self, x, dt, fmt, rot, swz, rule, b, m, k, amax, gs, packed, scale, flag, iw, st):
        assert iw is None  # these batches carry no input weights: the unweighted launch
        return self.fp4c_quantize(x, dt, fmt, rot, swz, rule, b, m, k, amax, gs, packed, scale, flag, st)

    def fp4c_quantize(self, x, dt, fmt, rot, swz, rule, b, m, k, amax, gs, packed, scale, flag, st):
        from fp4convert.numerics.swizzle import padded_shape

        rows, cols = padded_shape(m, k // (16 if fmt == 0 else 32)) if swz else (m, k // (16 if fmt == 0 else 32))
        for i in range(b):
            v = _floats(x + 4 * m * k * i, m * k)
            tag = round(v[0] * 1000) % 251
            ctypes.memset(packed + i * m * k // 2, tag, m * k // 2)
            ctypes.memset(scale + i * rows * cols, tag + 7, rows * cols)
            if amax:
                a = (ctypes.c_float * b).from_address(amax)[i]
                (ctypes.c_float * b).from_address(gs)[i] = 2688.0 / a
            if not all(math.isfinite(t) for t in v):
                (ctypes.c_int * b).from_address(flag)[i] = 1
        return 0


class _HostBuf:
    def __init__(self, mem: _Mem, n: int) -> None:
        self.size, self.ptr = n, mem.alloc(n)

    def view(self, off: int = 0, n: int | None = None) -> memoryview:
        n = self.size - off if n is None else n
        return memoryview((ctypes.c_char * n).from_address(self.ptr + off)).cast("B")


class _StampRuntime:
    def __init__(self) -> None:
        self.mem = _Mem()
        self.lib, self.stream = _StampLib(self.mem), 0
        self.pool = type("Pool", (), {"get": lambda _, n: _HostBuf(self.mem, n)})()

    def copy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n)

    def memset(self, dst, value, n):
        ctypes.memset(dst, value, n)

    def sync(self):
        pass

    def check(self, code, what=""):
        assert code == 0, what

    def event(self):
        return type("Ev", (), {"record": lambda e, st: e, "synchronize": lambda e: None})()


@pytest.mark.parametrize("scheme,swizzle", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False), ("mxfp4", True)])
def test_group_launches_keep_every_member_apart(scheme, swizzle) -> None:
    """Random batches of fused units whose shape groups interleave in member order, one with a NaN
    member now and then: each member's bytes, amax, unit amax, gs and NaN flag come back as its own."""
    import random
    from types import SimpleNamespace

    from fp4convert.quantizer.items import grouped_offsets
    from fp4convert.numerics.scheme import get_scheme

    seed = int(torch.randint(0, 2**31, ()).item())
    rng = random.Random(seed)
    sch = get_scheme(scheme)
    s = Settings(sch, None, swizzle, sch.default_rule)
    for trial in range(40):
        units, k = [], 0
        for _ in range(rng.randint(1, 6)):
            unit = []
            for _ in range(rng.randint(1, 3)):
                shape = rng.choice([(16, 32), (32, 32), (16, 64), (48, 32)])
                info = SimpleNamespace(name=f"m{k}", shape=shape, dtype="F32", file="f", nbytes=4 * shape[0] * shape[1])
                d = SimpleNamespace(name=info.name, info=info, module=info.name, group=None)
                d.matrices = (SimpleNamespace(module=info.name, group=None),)
                unit.append(d)
                k += 1
            units.append(unit)
        batch = Batch(units)
        rt = _StampRuntime()
        offsets, total = grouped_offsets(batch.reads())
        buf = _HostBuf(rt.mem, total)
        nan_at = rng.randrange(k) if rng.random() < 0.3 else None
        values = []
        for i, (d, off) in enumerate(zip(batch.members, offsets)):
            v = [rng.uniform(-1, 1) * rng.choice([1, 10, 100]) for _ in range(d.info.shape[0] * d.info.shape[1])]
            v[0] = (i + 1) / 1000  # the member's tag
            if i == nan_at:
                v[5] = float("nan")
            v = list((ctypes.c_float * len(v))(*v))  # as stored (fp32)
            values.append(v)
            (ctypes.c_float * len(v)).from_address(buf.ptr + off)[:] = v
        backend = CudaBackend(s, rt, owner=False)
        staged = backend.stage(batch, (buf, list(zip(offsets, batch.reads()))))
        assert staged.inputs_free is IN_USE  # one stream: the buffer is read until pass 1's sync (or the event)
        pending = backend.quantize(staged)
        ctx = f"seed={seed} trial={trial}"
        # NVFP4: free once quantize() returns (pass 1 synced after the copy); MXFP4: after the batch's event
        assert (pending.inputs_free is None) == (scheme == "nvfp4"), ctx
        if pending.inputs_free is not None:
            pending.inputs_free.synchronize()
        result = pending.result()
        # NVFP4 refuses a NaN member after pass 1 (its amax), MXFP4 by pass 2's block flags
        assert result.refused == [i == nan_at for i in range(k)], ctx
        if nan_at is not None:
            continue
        own = [max(abs(t) for t in v) for v in values]
        unit_of = [j for j, u in enumerate(units) for _ in u]
        for i, out in enumerate(result.matrices):
            tag = (i + 1) % 251
            assert set(bytes(out.packed)) == {tag} and set(bytes(out.scale)) == {tag + 7}, ctx
            if s.scheme.global_scale:
                want = max(own[j] for j in range(k) if unit_of[j] == unit_of[i])
                assert out.amax == pytest.approx(want, rel=1e-6), ctx
                assert out.gs == pytest.approx(2688.0 / want, rel=1e-5), ctx
            else:
                assert out.gs is None and out.amax is None, ctx
        spans = sorted((ctypes.addressof(ctypes.c_char.from_buffer(v)), ctypes.addressof(ctypes.c_char.from_buffer(v))
                        + len(v)) for o in result.matrices for v in (o.packed, o.scale))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), ctx  # no two outputs overlap
