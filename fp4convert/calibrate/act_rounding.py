"""W4A4: a block's activations rounded as the engine will round them (docs/formats.md "W4A4").

A W4A4 checkpoint is served with every quantized linear's input quantized too: NVFP4 per 16 values under
the static global scale the checkpoint records (from the input's calibrated amax), MXFP4 dynamically per
32. A calibrated method that targets the served layer (GPTQ with ``--activations``) needs that rounding
in three places, each here:

- :func:`rounded_inputs`: which inputs the engine rounds (the quantized plain linears' own inputs), whose
  tokens the observers hold until the block has run (:attr:`Observer.keep_tokens`);
- :func:`round_hessians`: each held input's Hessian and cross term from its tokens rounded as the engine
  rounds them (:meth:`Observer.asymmetric`), so the method minimises the served layer's output error;
- :func:`engine_hooks`: forward pre-hooks rounding the inputs in the block's next run, so the next block is
  calibrated on what the served model computes, activation rounding included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.calibrate.stats import bf16_ceil
from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from fp4convert.calibrate.layerwise import LayerwiseModel
    from fp4convert.calibrate.stats import Observers
    from fp4convert.plan.planner import Plan
    from fp4convert.plan.types import Decision


def rounder(activations: str, amax: float, rotate: str | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The engine's activation rounding of one input under its recorded amax (``amax`` already bf16):
    NVFP4 under that static scale, MXFP4 dynamic. ``rotate`` None: in the domain the statistics are in
    (rotated already with had16); "had16": of the plain input, rotated first and back after (what the
    block's next run feeds its linears)."""
    from fp4convert.numerics import reference as ref

    def rounded(x):
        if activations == "nvfp4":
            p, s, g = ref.nvfp4_quantize(x, amax, rotate, "max")
            y = ref.nvfp4_dequantize(p, s, g, rotate)
        else:
            p, e = ref.mxfp4_quantize(x, rotate, "floor")
            y = ref.mxfp4_dequantize(p, e, rotate)
        return y.to(x.dtype)
    return rounded


def rounded_inputs(lm: LayerwiseModel, plan: Plan, inputs: dict[str, str], activations: str) -> set[str]:
    """The inputs the engine rounds (the quantized plain linears'): their tokens are held by the observers;
    none without activations."""
    import torch

    if activations == "none":
        return set()
    names = {inputs.get(m.module, "") for d in plan.decisions if d.action == QUANTIZE for m in d.matrices}
    return {n for n in names if n and isinstance(lm.modules.get(n), torch.nn.Linear)}


def round_hessians(decisions: list[Decision], observers: Observers, inputs: dict[str, str], activations: str) -> None:
    """Each held input of these decisions: its Hessian and cross term from its tokens rounded as the engine
    rounds them (docs/numerics.md "GPTQ", W4A4), in the domain the statistics are in."""
    done: set[int] = set()
    for d in decisions:
        for m in d.matrices:
            obs = observers.get(inputs.get(m.module, ""))
            if obs is None or id(obs) in done or not obs.tokens:
                continue
            done.add(id(obs))
            if obs.amax is None or not float(obs.amax) > 0:
                obs.asymmetric(None)  # (all zeros: nothing to round)
                continue
            with timing.timed("calibrate_act_rounding"):
                obs.asymmetric(rounder(activations, bf16_ceil(float(obs.amax))))


def engine_hooks(lm: LayerwiseModel, decisions: list[Decision], observers: Observers, inputs: dict[str, str],
                 activations: str, rotate: str | None) -> list:
    """Forward pre-hooks that quantize the inputs of these decisions' linears as the engine will (NVFP4 under
    the static scale the checkpoint records, from the amax just measured; MXFP4 dynamic; rotated first with
    had16), for the block's next run. Linears only (an expert stack's inputs are not rounded here)."""
    import torch

    if activations == "none":
        return []
    hooks = []
    done: set[str] = set()
    for d in decisions:
        for m in d.matrices:
            name = inputs.get(m.module, "")
            obs = observers.get(name)
            module = lm.modules.get(name)
            if (name in done or obs is None or obs.amax is None or not float(obs.amax) > 0
                    or not isinstance(module, torch.nn.Linear)):
                continue  # (an input never seen, or all zeros: left as it is)
            done.add(name)
            rounded = rounder(activations, bf16_ceil(float(obs.amax)), rotate)

            def engine(_m, args, _r=rounded):
                return (_r(args[0]), *args[1:])

            hooks.append(module.register_forward_pre_hook(engine))
    return hooks
