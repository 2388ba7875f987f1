"""A block's routed experts run and quantized a group at a time (fp4convert/calibrate/experts.py, the GPTQ pass's
expert groups in fp4convert/calibrate/methods/gptq.py; issue 42 items 1 and 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from fp4convert import calibrate
from fp4convert.calibrate import experts as ex
from fp4convert.cli.main import main
from fp4convert.source.open import open_source
from tests import zoo
from tests.calibrate.test_calibrate import TEXT, add_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f: add_tokenizer(zoo.build(f, root / f)) for f in ("qwen3_moe", "deepseek_v3", "mixtral")}


def _moe_block(lm) -> int:
    """The first block with a streamed expert stack (DeepSeek-V3's first blocks are dense), left loaded."""
    for i in range(len(lm.layers)):
        lm.load_block(i, stream=True)
        if lm.stacks.get(i):
            return i
        lm.free_block(i)
    raise AssertionError("no streamed expert stack")


def _cuda() -> bool:
    return torch.cuda.is_available()


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
@pytest.mark.parametrize("group", [1, 2, None])
@pytest.mark.parametrize("device", DEVICES)
def test_the_streamed_forward_is_the_module_s_own_bit_for_bit(models, family, group, device):
    """The stack's canonical eager forward with its weights read a group at a time gives the module's own outputs
    bit for bit, whatever the group size (None: the whole stack at once), for a routing that leaves some
    experts unused; the stack's tensors are materialized only a group at a time."""
    lm = calibrate.LayerwiseModel(open_source(str(models[family])), torch.device(device))
    i = _moe_block(lm)
    (stack,) = lm.stacks[i].values()
    assert ex.streamable(stack.module) and stack.module.forward == stack.forward
    n = stack.experts
    if group is not None:
        stack.group = group
    h = stack.module._parameters["gate_up_proj"].shape[2]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, h, generator=g).to(device)
    k = min(2, n)
    idx = torch.stack([torch.randperm(n - 1, generator=g)[:k] for _ in range(37)]).to(device)  # expert n-1 never chosen
    w = torch.rand(37, k, generator=g).to(device)
    streamed = stack.forward(x, idx, w)
    assert stack.peak_bytes <= 4 * stack.group * (stack.module._parameters["gate_up_proj"][0].numel()
                                                  + stack.module._parameters["down_proj"][0].numel())
    lm.free_block(i)
    assert not lm.stacks and "forward" not in stack.module.__dict__
    lm.load_block(i)
    own = stack.module(x, idx, w)
    assert torch.equal(streamed, own)
    lm.free_block(i)


def test_a_quantized_expert_dequantizes_to_what_its_sweep_made():
    """A quantized expert is kept as its stored bytes; dequantized again they are exactly the sweep's values
    (what the block ran on right after the sweep), for both schemes, with and without the rotation."""
    from fp4convert.numerics import gptq
    from fp4convert.numerics import reference as ref

    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    x = torch.randn(200, 64, generator=g)
    for scheme in ("nvfp4", "mxfp4"):
        for rotate in (None, "had16"):
            wr = ref.had16(w) if rotate else w
            xr = ref.had16(x) if rotate else x
            res = gptq.quantize(wr, gptq.prepare(xr.T @ xr / 200), scheme)
            amax = float(wr.abs().amax()) if scheme == "nvfp4" else None
            got = ex.dequantized(ex.Quantized(res.packed, res.scale.view(torch.uint8), amax), scheme, rotate)
            want = ref.inverse_had16(res.dequantized) if rotate else res.dequantized
            assert torch.equal(got, want), (scheme, rotate)


def _gptq(src: Path, dst: Path, text: Path, *extra) -> tuple[dict[str, torch.Tensor], dict]:
    r = CliRunner().invoke(main, ["quantize", str(src), str(dst), "--device", "cpu", "--method", "gptq",
                                  "--calibration-data", str(text), "--calibration-samples", "4",
                                  "--calibration-seq-len", "48", "-q", *extra], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out: dict[str, torch.Tensor] = {}
    for f in sorted(dst.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out, json.loads((dst / "fp4convert.json").read_text())


def _same(a: dict, b: dict, keys) -> list[str]:
    return [k for k in keys if not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("extra", [(), ("--no-true-sequential",), ("--activations", "nvfp4", "--format", "compressed-tensors")],
                         ids=["true-sequential", "plain", "w4a4"])
def test_streamed_groups_give_the_bytes_of_the_whole_stack_under_the_same_policy(tmp_path, models, family, extra,
                                                                               monkeypatch):
    """Every expert on every token (the policy's fallback forced for all): the streamed stack quantized two experts
    at a time writes the bytes of the stack materialized whole and observed by the all-experts taps (the path of
    stacks that cannot be streamed); the store holds one part per group."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with monkeypatch.context() as mp:
        mp.setattr(ex, "streamable", lambda module: False)
        whole, _ = _gptq(models[family], tmp_path / "whole", text, *extra)
    with monkeypatch.context() as mp:
        mp.setattr(ex, "FEW_TOKENS", 10**9)  # every expert "sent too few": its Hessians from every token
        mp.setattr(ex, "sweep_group", lambda stack, device: 2)
        streamed, m = _gptq(models[family], tmp_path / "streamed", text, *extra)
    assert whole.keys() == streamed.keys()
    assert _same(whole, streamed, whole) == []
    rec = next(iter(m["method"]["experts"].values()))
    assert rec["all_tokens"] == list(range(len(rec["routed_tokens"])))


def test_routed_experts_take_their_own_tokens_and_the_rest_every_token(tmp_path, models, monkeypatch):
    """The policy (docs/numerics.md "GPTQ", "Experts"): an expert the router sent at least its input width of
    tokens is calibrated on those tokens alone (other bytes than on every token); one sent fewer, on every token
    (the same bytes as the all-tokens run); the manifest records each expert's routed tokens and the fallbacks."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with monkeypatch.context() as mp:
        mp.setattr(ex, "FEW_TOKENS", 10**9)
        every, _ = _gptq(models["qwen3_moe"], tmp_path / "every", text)
    with monkeypatch.context() as mp:
        mp.setattr(ex, "FEW_TOKENS", 0.6)  # (the tiny model's experts are sent about its width: a threshold between)
        routed, m = _gptq(models["qwen3_moe"], tmp_path / "routed", text)
    recs = m["method"]["experts"]
    assert "policy" in recs
    layers = [r for k, r in recs.items() if k != "policy"]
    assert len(layers) == 2
    some_routed = some_every = False
    for path, rec in ((k, r) for k, r in recs.items() if k != "policy"):
        width = 64  # (the zoo's hidden size)
        for e, count in enumerate(rec["routed_tokens"]):
            keys = [k for k in every if f"{path}.{e}." in k and k.endswith(("weight_packed", "weight_scale"))]
            assert keys
            fallback = e in rec["all_tokens"]
            assert fallback == (count < 0.6 * width)
            if "layers.1." in path:
                continue  # (its inputs come from layer 0, whose routed experts differ between the two runs)
            if fallback:
                some_every = True
                assert _same(every, routed, keys) == [], (path, e)
            else:
                some_routed = True
                assert _same(every, routed, keys), (path, e)  # its own tokens: other bytes
    assert some_routed and some_every


def test_memory_is_bounded_by_the_group(tmp_path, models, monkeypatch):
    """The stack's fp32 weights are materialized a group at a time (the peak the stack counts), and the pass stores
    one file per group as it goes (the Hessians and weights of a group released before the next)."""
    from fp4convert.calibrate import store as store_mod

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    parts: list[str] = []
    real = store_mod.Store.add_block

    def spy(self, index, matrices, changed=None, why="", part=0):
        parts.append(f"{index}-{part}")
        return real(self, index, matrices, changed, why, part)

    peaks: list[int] = []
    real_free = ex.ExpertStack.release

    def watch(self):
        peaks.append(self.peak_bytes)
        return real_free(self)

    monkeypatch.setattr(store_mod.Store, "add_block", spy)
    monkeypatch.setattr(ex.ExpertStack, "release", watch)
    monkeypatch.setattr(ex, "sweep_group", lambda stack, device: 1)
    monkeypatch.setattr(ex, "GROUP_BUDGET_MAX", 1)  # the forward too: one expert at a time
    _, m = _gptq(models["deepseek_v3"], tmp_path / "out", text)
    cfg = zoo.read_config(models["deepseek_v3"])
    per_expert = 4 * 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"]
    assert peaks and max(peaks) <= per_expert
    moe_layers = [k for k in m["method"]["experts"] if k != "policy"]
    n_experts = cfg["n_routed_experts"]
    for path in moe_layers:
        index = path.split(".layers.")[1].split(".")[0]
        assert {f"{index}-{p}" for p in range(1, n_experts + 1)} <= set(parts)
