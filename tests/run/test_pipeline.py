"""The overlapped pipeline: the bytes never depend on the schedule (write-behind or not, one unit or many
per batch, the ``cpu`` backend's row slices or the ``stacked`` backend's [B, M, K] launches: the CUDA
scheduling run on the CPU), errors from the writer thread reach the caller, and a crash with writes in
flight still resumes to the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp4convert.quantizer.items as schedule
import fp4convert.run.writebehind as writebehind
import fp4convert.run.work as work
from fp4convert.kernels import cpu
from fp4convert.quantizer.backends.stacked import StackedBackend
from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.errors import NonFiniteError, OutputError
from fp4convert.plan.types import QUANTIZE

from tests import checkpoints as ck
from tests import zoo

SCHEDULES = {
    "sync": dict(backend="cpu", sync=True),  # the simple path: one unit at a time, writes inline
    "default": dict(backend="cpu", sync=False),
    "stacked-1": dict(backend="stacked", units=1, nbytes=0, sync=False),  # the CUDA scheduling, a unit a batch
    "stacked-2": dict(backend="stacked", units=2, nbytes=1 << 30, sync=False),  # ... small batches
    "stacked-64": dict(backend="stacked", units=64, nbytes=1 << 30, sync=False),  # ... a layer's experts at once
    "stacked-bytes": dict(backend="stacked", units=64, nbytes=20000, sync=True),  # ... cut by bytes
    "row-slices": dict(backend="cpu", sync=False, chunk=256),  # CPU: each matrix in slices of 1-4 rows
}


def run(src: Path, dst: Path, schedule: str, monkeypatch, **cfg) -> dict[str, bytes]:
    sched = SCHEDULES[schedule]
    with monkeypatch.context() as mp:
        if "units" in sched:
            mp.setattr(StackedBackend, "batch_units", sched["units"])
            mp.setattr(StackedBackend, "batch_bytes", sched["nbytes"])
        if sched["sync"]:
            ck.inline_writes(mp)
        if "chunk" in sched:
            mp.setattr(cpu, "CHUNK_ELEMS", sched["chunk"])
        convert(src, dst, ConvertConfig(device="cpu", backend=sched["backend"], **cfg))
    return ck.all_files(dst)


CASES = [
    ("llama-zoo", lambda p: ck.llama(p, layers=3, zoo=True), dict(max_shard_size=6000)),
    ("llama-had16", lambda p: ck.llama(p, layers=2), dict(rotate="had16", format="compressed-tensors")),
    ("llama-mxfp4", lambda p: ck.llama(p, layers=2), dict(scheme="mxfp4", max_shard_size=9000)),
    ("moe", lambda p: ck.moe(p, experts=6, layers=2), dict(max_shard_size=20000)),
    ("moe-modelopt", lambda p: ck.moe(p, experts=4, layers=2), dict(format="modelopt")),
    ("deepseek", lambda p: ck.deepseek(p), dict()),
    # Units the batched path does not run (3-D stacked experts, gate/up halves, decoded FP8/MXFP4
    # inputs) go one at a time between batches of plain units, their writes in the same ordered queue.
    ("gpt-oss-stacked", lambda p: zoo.build("gpt_oss", p), dict(max_shard_size=200000)),
    ("llama4-stacked", lambda p: zoo.build("llama4", p), dict(scheme="mxfp4")),
    ("gpt-oss-mxfp4-input", lambda p: zoo.mxfp4_variant(zoo.build("gpt_oss", p.parent / "base"), p), dict()),
    ("deepseek-fp8-input", lambda p: zoo.fp8_block_variant(zoo.build("deepseek_v3", p.parent / "base"), p),
     dict(max_shard_size=200000)),
]


@pytest.mark.parametrize("name,make,cfg", CASES, ids=[c[0] for c in CASES])
def test_every_schedule_writes_the_same_bytes(tmp_path, monkeypatch, name, make, cfg) -> None:
    src = tmp_path / "src"
    make(src)
    want = run(src, tmp_path / "stacked-64", "stacked-64", monkeypatch, **cfg)  # whole matrices per launch
    for schedule in SCHEDULES:
        if schedule != "stacked-64":
            got = run(src, tmp_path / schedule, schedule, monkeypatch, **cfg)
            assert got == want, schedule


def test_batches_keep_plan_order_and_break_at_kept_units(tmp_path) -> None:
    src = tmp_path / "src"
    ck.moe(src, experts=5, layers=2)
    _, plan, _ = plan_conversion(str(src), ConvertConfig())
    units = plan.units()
    for max_units, max_bytes in [(1, 0), (3, 1 << 30), (64, 1 << 30), (64, 10000)]:
        batches = schedule.make_batches(units, max_units, max_bytes)
        flat = [u for b in batches for u in b]
        assert flat == [u for u in units if u[0].action == QUANTIZE]  # every quantized unit once, in order
        for b in batches:
            assert len(b) <= max_units
            assert len(b) == 1 or sum(d.info.nbytes for u in b for d in u) <= max_bytes
            first, last = units.index(b[0]), units.index(b[-1])
            assert all(u[0].action == QUANTIZE for u in units[first : last + 1])  # no kept unit inside
    experts = schedule.make_batches(units, 64, 1 << 30)
    assert max(len(schedule.Batch(b).members) for b in experts) >= 15  # a layer's experts share launches
    assert any(len(g) >= 5 for b in experts for g in schedule.Batch(b).groups)


@pytest.mark.parametrize("schedule", ["default", "stacked-64"])
def test_nan_found_in_a_batch_names_the_tensor_and_leaves_no_manifest(tmp_path, monkeypatch, schedule) -> None:
    src = tmp_path / "src"
    ck.moe(src, experts=4, layers=2)
    victim = "model.layers.1.mlp.experts.2.up_proj.weight"
    ck.patch_tensor(ck.shard_with(src, victim), victim, b"\x80\x7f", at=6)  # bf16 -Inf
    with pytest.raises(NonFiniteError, match=victim.replace(".", r"\.")):
        run(src, tmp_path / "q", schedule, monkeypatch)
    assert not (tmp_path / "q" / "fp4convert.json").exists()
    assert not list((tmp_path / "q").glob("*.partial"))


def test_writer_errors_reach_the_caller(tmp_path, monkeypatch) -> None:
    src = tmp_path / "src"
    ck.llama(src)

    def full(*a, **k):  # an OS error on a DST file, raised in the writer thread
        raise OSError(28, "No space left on device", str(tmp_path / "q" / "model.safetensors.partial"))

    monkeypatch.setattr(work, "write_result", full)
    with pytest.raises(OutputError, match="no space left on the device"):
        convert(src, tmp_path / "q", ConvertConfig(device="cpu"))
    assert not list((tmp_path / "q").glob("*.partial"))


def test_crash_with_writes_in_flight_then_resume(tmp_path, monkeypatch) -> None:
    src = tmp_path / "src"
    ck.llama(src, layers=3)
    ref_dst = tmp_path / "ref"
    convert(src, ref_dst, ConvertConfig(device="cpu", max_shard_size=6000))
    dst = tmp_path / "q"
    real = work.quantize
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("simulated crash")
        return real(*a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(work, "quantize", flaky)
        with pytest.raises(RuntimeError, match="simulated crash"):  # the torch backend: unit by unit, many steps
            convert(src, dst, ConvertConfig(device="cpu", backend="cpu", max_shard_size=6000))
    finished = sorted(dst.glob("*.safetensors"))
    assert finished and not list(dst.glob("*.partial"))
    for p in finished:
        assert p.read_bytes() == (ref_dst / p.name).read_bytes()
    res = convert(src, dst, ConvertConfig(device="cpu", max_shard_size=6000, resume=True))
    assert res.reused_files == sorted(p.name for p in finished)
    assert ck.all_files(dst) == ck.all_files(ref_dst)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("units", [1, 64])
def test_cuda_pipeline_writes_the_cpu_bytes(tmp_path, monkeypatch, units) -> None:
    """Streams, pinned sets, batched [B, M, K] launches, one sync per batch: the CPU's bytes."""
    src = tmp_path / "src"
    ck.moe(src, experts=6, layers=2)
    want = run(src, tmp_path / "cpu", "default", monkeypatch, max_shard_size=20000)
    monkeypatch.setattr(StackedBackend, "batch_units", units)
    convert(src, tmp_path / "gpu", ConvertConfig(device="cuda", backend="stacked", max_shard_size=20000))
    assert ck.all_files(tmp_path / "gpu") == want


GPU_CASES = [
    ("had16-mse", lambda p: ck.llama(p, layers=2), dict(rotate="had16", scale_rule="mse")),
    ("mxfp4-rceil", lambda p: ck.moe(p, experts=4, layers=2), dict(scheme="mxfp4", scale_rule="rceil")),
    ("gpt-oss-mxfp4-input", lambda p: zoo.mxfp4_variant(zoo.build("gpt_oss", p.parent / "base"), p), dict()),
    ("deepseek-fp8-input", lambda p: zoo.fp8_block_variant(zoo.build("deepseek_v3", p.parent / "base"), p),
     dict(scale_rule="4over6")),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,make,cfg", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_pipeline_rules_and_complex_units_write_the_cpu_bytes(tmp_path, monkeypatch, name, make, cfg) -> None:
    """Scale rules reach the batched kernels (amax in, gs from the kernel); stacked experts and decoded
    inputs run between batches on the GPU: the CPU's bytes."""
    src = tmp_path / "src"
    make(src)
    want = run(src, tmp_path / "cpu", "default", monkeypatch, max_shard_size=200000, **cfg)
    convert(src, tmp_path / "gpu", ConvertConfig(device="cuda", max_shard_size=200000, **cfg))
    assert ck.all_files(tmp_path / "gpu") == want


def test_light_jobs_take_no_slot_and_run_after_the_writes_before_them() -> None:
    """Progress updates ride the writer queue (a Hub shard is deleted only after its last copy) without
    using up the write-behind depth."""
    import threading
    import time

    behind = writebehind.WriteBehind(depth=1)
    gate, order = threading.Event(), []
    behind.submit(lambda: (gate.wait(5), order.append("write 1")))  # holds the one slot while it runs
    t0 = time.monotonic()
    for i in range(5):
        behind.submit(lambda i=i: order.append(f"progress {i}"), light=True)
    waited = time.monotonic() - t0
    gate.set()
    behind.submit(lambda: order.append("write 2"))
    behind.drain(True)
    assert waited < 2, waited
    assert order == ["write 1", *(f"progress {i}" for i in range(5)), "write 2"]
