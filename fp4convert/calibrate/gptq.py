"""``--method gptq``: GPTQ on the block-by-block runner, sequentially (docs/numerics.md "GPTQ").

For each block of the model (:meth:`~fp4convert.calibrate.runner.LayerwiseModel.blocks`): the block runs
on the calibration samples with every linear input's Hessian ``X^T X / n`` observed (inputs shared by
q/k/v or gate/up observed once; a 3-D expert stack's gate/up input from every token, each expert's
down input from every token sent through that expert); then every quantized matrix of the block is
quantized by GPTQ (:mod:`fp4convert.numerics.gptq`; the in-batch sweep on the CUDA kernel on a GPU),
each fused group's global scale fixed from its weights before the sweep; the block is loaded again with
the dequantized result and runs again, so the next block is calibrated on the outputs of the blocks
already quantized. Everything runs on the run's device.

The quantized matrices (the bytes the data-free quantizer would return for them: codes, linear block
scales, global scale) go to a :class:`~fp4convert.calibrate.store.Store` on disk, one file per block;
the quantize stage writes them instead of quantizing those units again (:mod:`fp4convert.run.work`).
A matrix the pass never saw an input of (outside the blocks, or a linear the forward did not call) is
left to the data-free quantizer, and listed in the record.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fp4convert.calibrate.stats import Observers
from fp4convert.calibrate.store import Store
from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.runner import LayerwiseModel
    from fp4convert.config import ConvertConfig
    from fp4convert.plan.planner import Plan
    from fp4convert.plan.types import Decision, Matrix

log = logging.getLogger(__name__)


def matrix_view(t: torch.Tensor, m: Matrix) -> torch.Tensor:
    """The ``[N, K]`` matrix ``m`` of its on-disk tensor ``t``, as a view (writes go into ``t``): expert
    ``m.expert`` of a 3-D stack, transposed where the checkpoint stores in-features first, rows ``m.rows``."""
    v = t if m.expert is None else t[m.expert]
    if m.transpose:
        v = v.transpose(-1, -2)
    if m.rows is not None:
        v = v[m.rows[0]:m.rows[1]:m.rows[2]]
    return v


def block_decisions(lm: LayerwiseModel, plan: Plan) -> dict[int, list[Decision]]:
    """Block index -> the plan's quantized decisions whose tensor loads into that block."""
    out: dict[int, list[Decision]] = {}
    head = lm.layers_name + "."
    for d in plan.decisions:
        if d.action != QUANTIZE:
            continue
        got = lm.keymap.get(d.info.name)
        if got is None or not got[0].startswith(head):
            continue
        index = got[0][len(head):].split(".", 1)[0]
        if index.isdigit():
            out.setdefault(int(index), []).append(d)
    return out


class GPTQ:
    """The GPTQ pass of one conversion: settings, the plan's view of the runner, and what it made."""

    def __init__(self, lm: LayerwiseModel, plan: Plan, config: ConvertConfig, inputs: dict[str, str],
                 store: Store) -> None:
        from fp4convert.numerics.scheme import SCHEMES

        self.lm, self.plan, self.config, self.inputs, self.store = lm, plan, config, inputs, store
        self.scheme = SCHEMES[config.scheme]
        self.rule = config.rule
        self.by_block = block_decisions(lm, plan)
        self.damped: dict[str, float] = {}  # module -> the dampening that factorized, where above --gptq-damp
        self.unseen: list[str] = []  # quantized matrices of the blocks whose input the pass never saw

    def sweep_fn(self):
        """The in-batch sweep: the CUDA kernel on a GPU (same bytes as the reference there), else the reference."""
        from fp4convert.numerics import gptq

        if self.lm.device.type == "cuda" and self.config.gptq_block <= 384:  # (the kernel's shared memory)
            from fp4convert.kernels.cuda.ops import gptq_sweep

            return gptq_sweep
        return gptq.sweep_batch

    def run(self, tokens: torch.Tensor, observers: Observers, head: bool, micro_batch: int, progress: bool) -> None:
        """The sequential pass over every block (observers must keep Hessians)."""
        for visit in self.lm.blocks(tokens, observers, head=head, micro_batch=micro_batch, progress=progress,
                                    desc="gptq: blocks"):
            decisions = self.by_block.get(visit.index, [])
            if decisions:
                replaced = self.quantize_block(visit.index, decisions, observers)
                self.lm.reload_block(visit, replaced)
            names = [n for n in list(observers) if n.startswith(visit.prefix)]
            for n in names:  # the W4A4 amax stays; the Hessians of a quantized block are not needed again
                o = observers[n]
                o.xtx = None

    def quantize_block(self, index: int, decisions: list[Decision], observers: Observers) -> dict[str, torch.Tensor]:
        """GPTQ of every quantized matrix of block ``index``; returns the on-disk tensors with their
        quantized matrices dequantized (what the block is loaded with next) and keeps the bytes."""
        import torch

        from fp4convert.numerics import gptq
        from fp4convert.numerics import reference as ref

        rotate = self.config.rotate
        disk = {d.info.name: self.lm.read_fp32(d.info.name) for d in decisions}
        mats: list[tuple[Decision, Matrix, torch.Tensor]] = []
        for d in decisions:
            for m in d.matrices:
                w = matrix_view(disk[d.info.name], m)
                mats.append((d, m, ref.had16(w) if rotate == "had16" else w.clone()))
        # each fused group's amax, from the weights before any sweep (docs/numerics.md "The global scale")
        amax: dict[str, torch.Tensor] = {}
        for d, m, w in mats:
            key = m.group or d.group or m.module
            a = w.abs().amax()
            amax[key] = a if key not in amax else torch.maximum(amax[key], a)
        prepared: dict[int, gptq.Prepared] = {}
        sweep = self.sweep_fn()
        made = []
        for d, m, w in mats:
            obs = observers.get(self.inputs.get(m.module, ""))
            h = obs.hessian_matrix() if obs is not None else None
            if h is None:
                self.unseen.append(m.module)
                continue
            p = prepared.get(id(obs))
            if p is None:
                p = prepared[id(obs)] = gptq.prepare(
                    h, self.config.gptq_damp, self.scheme.block_size if self.config.act_order else None)
            if p.damp != self.config.gptq_damp:
                self.damped[m.module] = p.damp
            group_amax = amax[m.group or d.group or m.module]
            try:
                res = gptq.quantize(w, p, self.scheme.name, self.rule,
                                    group_amax if self.scheme.global_scale else None,
                                    self.config.gptq_block, sweep)
            except Exception as exc:
                raise type(exc)(f"{m.module} (GPTQ, block {index}): {exc}") from exc
            made.append((m.module, res, group_amax))
            deq = ref.inverse_had16(res.dequantized) if rotate == "had16" else res.dequantized
            matrix_view(disk[d.info.name], m).copy_(deq)
        self.store.add_block(index, [(name, res.packed, res.scale, res.gs, a if self.scheme.global_scale else None)
                                     for name, res, a in made])
        return disk

    def record(self) -> dict:
        """What the manifest says of the pass (its settings come from the recipe's identity)."""
        return {"method": "gptq", "scale_rule": self.rule, "damp": self.config.gptq_damp,
                "block": self.config.gptq_block, "act_order": self.config.act_order,
                "device": "cuda" if self.lm.device.type == "cuda" else "cpu",
                "quantized": len(self.store.index), "damp_raised": dict(sorted(self.damped.items())),
                "rtn": sorted(self.unseen), "sha256": self.store.digest()}

