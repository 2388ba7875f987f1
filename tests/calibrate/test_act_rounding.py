"""W4A4: a block's activations rounded as the engine rounds them (fp4convert/calibrate/act_rounding.py): the
hooks of the block's next run, and the Hessians of the engine-rounded inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fp4convert.calibrate.act_rounding import engine_hooks, round_hessians
from fp4convert.calibrate.stats import Observers, bf16_ceil
from fp4convert.numerics import reference as ref


@pytest.mark.parametrize("acts,rotate", [("nvfp4", None), ("nvfp4", "had16"), ("mxfp4", None)])
def test_w4a4_blocks_run_again_with_the_engine_activation_rounding(tmp_path, acts, rotate):
    """W4A4 GPTQ: a quantized block runs again with each quantized linear's input rounded as the engine
    rounds it (NVFP4 under the static scale of the amax the checkpoint records, MXFP4 dynamic; rotated
    first with had16), so the next block is calibrated on what the served model computes."""
    lin = torch.nn.Linear(64, 8, bias=False)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)) * 3
    obs = Observers(rotate=rotate, rotated_amax=rotate is not None)
    obs.add("blk.lin", x)
    seen = {}
    lin.register_forward_pre_hook(lambda _m, a: seen.__setitem__("x", a[0]))  # runs after the engine's hook
    lm = SimpleNamespace(modules={"blk.lin": lin})
    inputs = {"blk.lin": "blk.lin"}
    decisions = [SimpleNamespace(matrices=[SimpleNamespace(module="blk.lin")])]
    hooks = engine_hooks(lm, decisions, obs, inputs, acts, rotate)  # type: ignore[arg-type]
    assert len(hooks) == 1
    lin._forward_pre_hooks.move_to_end(hooks[0].id, last=False)  # the engine's rounding first
    lin(x)
    if acts == "nvfp4":
        p, s, g = ref.nvfp4_quantize(x, bf16_ceil(float(obs["blk.lin"].amax)), rotate, "max")
        want = ref.nvfp4_dequantize(p, s, g, rotate)
    else:
        p, e = ref.mxfp4_quantize(x, rotate, "floor")
        want = ref.mxfp4_dequantize(p, e, rotate)
    assert torch.equal(seen["x"], want) and not torch.equal(seen["x"], x)
    for h in hooks:
        h.remove()
    lin(x)
    assert torch.equal(seen["x"], x)
    assert engine_hooks(lm, decisions, obs, inputs, "none", rotate) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("acts,rotate", [("nvfp4", None), ("nvfp4", "had16"), ("mxfp4", None)])
def test_w4a4_hessians_are_taken_on_the_inputs_as_the_engine_rounds_them(acts, rotate):
    """W4A4 GPTQ keeps a rounded input's tokens through the block's run; once the amax is known its
    Hessian is that of the engine-rounded inputs ``X~`` and the cross term ``(X - X~)^T X~`` moves the
    target (docs/numerics.md "GPTQ"), in the domain the weights are quantized in (rotated with had16).
    Inputs the engine does not round (not kept) keep the plain Hessian."""
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    obs = Observers(hessian=True, rotate=rotate, rotated_amax=rotate is not None)
    obs.keep_tokens = {"blk.lin"}
    obs.add("blk.lin", x[:2])
    obs.add("blk.lin", x[2:])  # (two micro-batches)
    obs.add("blk.other", x)
    o = obs["blk.lin"]
    assert o.xtx is None and len(o.tokens) == 2 and obs["blk.other"].xtx is not None
    inputs = {"blk.lin": "blk.lin", "blk.other": "blk.other"}
    decisions = [SimpleNamespace(matrices=[SimpleNamespace(module="blk.lin"), SimpleNamespace(module="blk.other")])]
    round_hessians(decisions, obs, inputs, acts)  # type: ignore[arg-type]
    flat = x.reshape(-1, 64)
    xr = ref.had16(flat) if rotate else flat
    if acts == "nvfp4":
        p, s, g = ref.nvfp4_quantize(xr, bf16_ceil(float(o.amax)), None, "max")
        xq = ref.nvfp4_dequantize(p, s, g, None).to(xr.dtype)
    else:
        p, e = ref.mxfp4_quantize(xr, None, "floor")
        xq = ref.mxfp4_dequantize(p, e, None).to(xr.dtype)
    assert not torch.equal(xq, xr) and o.tokens == []
    xq, xr = xq.double(), xr.double()
    torch.testing.assert_close(o.hessian_matrix(), xq.T @ xq / 21, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o.cross_matrix(), (xr - xq).T @ xq / 21, rtol=1e-12, atol=1e-12)
    assert obs["blk.other"].cross_matrix() is None
    torch.testing.assert_close(obs["blk.other"].hessian_matrix(), xr.T @ xr / 21, rtol=1e-12, atol=1e-12)
    o.release()
    assert o.hessian_matrix() is None and o.cross_matrix() is None and o.amax is not None
