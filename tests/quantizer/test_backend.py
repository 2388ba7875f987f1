"""The backend seam (fp4convert.quantizer.backend): the group amax, the two passes' order, the refusal, the registry."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from fp4convert.quantizer.backend import (
    Result,
    auto_backends,
    backend_facts,
    backend_names,
    get_backend,
    refuse_nonfinite,
    two_passes,
    unit_amax,
)
from fp4convert.config import ConvertConfig
from fp4convert.quantizer.choice import choose_backend
from fp4convert.run.convert import plan_conversion
from fp4convert.run.distributed import World
from fp4convert.errors import ConfigError, NonFiniteError
from fp4convert.quantizer.items import Batch

from tests import checkpoints as ck


def test_unit_amax_is_the_max_over_each_fused_group(tmp_path) -> None:
    src = tmp_path / "m"
    ck.llama(src)
    _, plan, _ = plan_conversion(str(src), ConvertConfig())
    units = [u for u in plan.units() if u[0].action == "quantize"]
    batch = Batch(units)
    seed = int(torch.randint(0, 2**31, ()).item())
    amax = torch.rand(len(batch.members), generator=torch.Generator().manual_seed(seed)).tolist()
    got = unit_amax(amax, batch.keys)
    start = 0
    for u in units:
        assert got[start : start + len(u)] == [max(amax[start : start + len(u)])] * len(u), seed
        start += len(u)
    assert any(len(u) == 3 for u in units)  # q/k/v share one scale: the case this covers


def test_unit_amax_keys_none_and_nan() -> None:
    """Key None: a matrix's own amax; a NaN anywhere in a group makes the group's NaN, wherever it sits."""
    assert unit_amax([1.0, 5.0, 2.0], [None, None, None]) == [1.0, 5.0, 2.0]
    for pos in range(3):
        vals = [1.0, 3.0, 2.0]
        vals[pos] = float("nan")
        got = unit_amax(vals + [7.0], ["g", "g", "g", None])
        assert all(math.isnan(v) for v in got[:3]) and got[3] == 7.0, pos


class _Item:
    def __init__(self, names: list[str], keys: list) -> None:
        from types import SimpleNamespace

        self.matrices = [(SimpleNamespace(name=n, info=SimpleNamespace(file="f.safetensors")), None) for n in names]
        self.keys = keys


def test_two_passes_refuses_before_pass_2_and_frees_the_inputs() -> None:
    from fp4convert.numerics.scheme import MXFP4, NVFP4
    from fp4convert.quantizer.backend import Pending, Settings

    item = _Item(["a", "b"], [0, 0])
    calls: list = []
    s = Settings(NVFP4, None, False, "max")
    later = Pending(Result([], []), inputs_free=object())  # type: ignore[arg-type]  # an event
    refused = two_passes(item, s, lambda: [1.0, float("inf")], lambda ga: calls.append(ga) or later)
    result = refused.result()
    # refused after pass 1: no pass 2, and the inputs are free now (pass 1 is done with them)
    assert calls == [] and refused.inputs_free is None and result.refused == [False, True]
    with pytest.raises(NonFiniteError, match=r"^b \(in f\.safetensors\) holds NaN or Inf"):
        refuse_nonfinite(item, result.refused, None)
    assert two_passes(item, s, lambda: [1.0, 3.0], lambda ga: calls.append(ga) or later) is later
    assert calls == [[3.0, 3.0]]  # pass 2 gets each matrix's group amax, and its Pending is returned as is
    two_passes(item, Settings(MXFP4, None, False, "floor"), lambda: 1 / 0, lambda ga: calls.append(ga) or later)
    assert calls[-1] is None  # no global scale: no pass 1


def test_registry_lists_the_backend_modules_without_importing_them() -> None:
    assert backend_names() == ["cpu", "cpu-native", "cuda", "stacked"]
    assert get_backend("cpu").name == "cpu" and backend_facts("stacked").devices == ("cuda", "cpu")
    with pytest.raises(ConfigError, match="unknown backend 'gguf'"):
        get_backend("gguf")
    with pytest.raises(ConfigError, match="--backend 'nope': choose one of cpu, cpu-native, cuda, stacked"):
        choose_backend(ConvertConfig(backend="nope"), World(), None)
    with pytest.raises(ConfigError, match="--backend 'No Such' is not a backend name"):
        ConvertConfig(backend="No Such")
    code = ("import sys; from fp4convert.quantizer.backend import backend_facts, backend_names; "
            "[backend_facts(n) for n in backend_names()]; print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_the_table_lists_exactly_the_backend_modules() -> None:
    """BACKENDS (the facts table) and the modules of fp4convert/quantizer/backends/ name the same backends, and
    each module's class carries its row's name."""
    import pkgutil

    from fp4convert.quantizer import backends

    modules = sorted(m.name for m in pkgutil.iter_modules(backends.__path__) if not m.name.startswith("_"))
    assert sorted(f.module for f in backends.BACKENDS.values()) == modules
    for name in backend_names():
        assert get_backend(name).name == name


@pytest.mark.parametrize("name", backend_names())
def test_needs_torch_says_whether_the_module_imports_torch(name: str) -> None:
    """The row's ``needs_torch`` is what the run relies on to open a backend before torch is imported: a
    torch-free backend's module must import no torch, and a torch one's does."""
    code = (f"import sys; from fp4convert.quantizer.backend import get_backend; get_backend({name!r}); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(backend_facts(name).needs_torch)


def test_automatic_choice_by_rank_and_kind() -> None:
    """Without --backend: the torch-free backends for a device, before torch; torch's once the device is
    known, best rank first (``cpu`` before ``stacked`` on the CPU)."""
    assert [f.name for f in auto_backends("cuda", needs_torch=False)] == ["cuda"]
    assert [f.name for f in auto_backends("cpu", needs_torch=False)] == ["cpu-native"]
    assert [f.name for f in auto_backends("cuda", needs_torch=True)] == ["stacked"]
    assert [f.name for f in auto_backends("cpu", needs_torch=True)] == ["cpu", "stacked"]


@pytest.mark.parametrize("backend", ["cpu", "cpu-native"])
def test_a_matrix_whose_global_scale_saturates_is_named_in_a_warning(tmp_path, backend) -> None:
    """Weights made only of tiny values (amax below 2688 / FLT_MAX): NVFP4's global scale saturates and
    the blocks decode to zeros. The run still converts (the bytes are the contract's), but says which
    tensor and what to do; a normal matrix next to it is not named."""
    from click.testing import CliRunner

    from fp4convert.cli.main import main

    cfg = ck.llama_config(layers=1)
    t = ck.llama_tensors(cfg)
    tiny = "model.layers.0.mlp.down_proj.weight"
    t[tiny] = (t[tiny].float() * 1e-39).to(torch.bfloat16)  # bf16 subnormals
    assert 0 < t[tiny].float().abs().max().item() < 2688.0 / 3.4028234663852886e38
    src = tmp_path / "src"
    ck.write(src, t, cfg)
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "q"), "--device", "cpu", "--backend", backend])
    assert r.exit_code == 0, r.output
    lines = [x for x in r.output.splitlines() if "global scale saturates" in x]
    assert len(lines) == 1 and tiny in lines[0] and "--ignore" in lines[0], r.output
