"""``--method gptq``: GPTQ on the block-by-block runner, sequentially (docs/numerics.md "GPTQ").

For each block of the model (:meth:`~fp4convert.calibrate.layerwise.LayerwiseModel.blocks`): the block runs
on the calibration samples with every linear input's Hessian ``X^T X / n`` observed (inputs shared by
q/k/v or gate/up observed once; a 3-D expert stack's gate/up input from every token, each expert's
down input from every token sent through that expert); then every quantized matrix of the block is
quantized by GPTQ (:mod:`fp4convert.numerics.gptq`; the in-batch sweep on the device's kernel),
each fused group's global scale fixed from its weights before the sweep; the block is loaded again with
the dequantized result and runs again, so the next block is calibrated on the outputs of the blocks
already quantized. With true-sequential (``--true-sequential``), the block's matrices are quantized one
input at a time in the order its forward feeds them (q/k/v, o, gate/up, down in a Llama block), the block
run again before each step on the same inputs, so each linear is calibrated on the outputs of the block's
linears quantized before it, as the earlier blocks' already are. Everything runs on the run's device.

The quantized matrices (the bytes the data-free quantizer would return for them: codes, linear block
scales, global scale) go to a :class:`~fp4convert.calibrate.store.Store` on disk, one file per block;
the quantize stage writes them instead of quantizing those units again (:mod:`fp4convert.run.work`).
The quantized linears outside the blocks (a pooler, a projection, a quantized head) get their Hessians from
the runner's pass after the last block (:mod:`fp4convert.calibrate.tail`: the model's own forward on the
last block's outputs, the blocks already quantized) and are quantized together as one more group. A
matrix the pass never saw an input of (a linear the forward did not call, one in a tower, one the run
cannot observe) is left to the data-free quantizer, and listed in the record.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.calibrate.stats import Observers
from fp4convert.calibrate.store import Store
from fp4convert.calibrate.tail import HEAD, outside_names
from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.layerwise import LayerwiseModel, Visit
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

    name = "gptq"
    hessian = True
    squares = False

    def __init__(self, lm: LayerwiseModel, plan: Plan, config: ConvertConfig, inputs: dict[str, str],
                 store: Store) -> None:
        from fp4convert.numerics.scheme import SCHEMES

        self.lm, self.plan, self.config, self.inputs, self.store = lm, plan, config, inputs, store
        self.scheme = SCHEMES[config.scheme]
        self.rule = config.rule
        self.by_block = block_decisions(lm, plan)
        in_blocks = {id(d) for ds in self.by_block.values() for d in ds}
        self.outside = [d for d in plan.decisions if d.action == QUANTIZE and id(d) not in in_blocks]
        self.damped: dict[str, float] = {}  # module -> the dampening that factorized, where above --gptq-damp
        self._unseen: list[str] = []  # quantized matrices whose input the pass never saw
        self.smoothed: dict[str, dict] = {}  # norm weight --smooth changed -> its readers, its form

    @property
    def unseen(self) -> list[str]:
        return self._unseen

    def sweep_fn(self):
        """The in-batch sweep: the device's kernel (same bytes as the reference there), else the reference."""
        from fp4convert.kernels.gptq import sweep_for

        return sweep_for(self.lm.device, self.config.gptq_block)

    def run(self, tokens: torch.Tensor, observers: Observers, head: bool, micro_batch: int, progress: bool) -> None:
        """The sequential pass over every block, then the linears outside the blocks (observers must keep
        Hessians)."""
        outside = outside_names(self.lm, [self.inputs[m.module] for d in self.outside for m in d.matrices
                                          if m.module in self.inputs])
        tail = False
        hooks: list = []
        observers.keep = self.rounded_inputs()
        self.lm.keep_block_reads = True  # the block's weights as read, for the sweep (no second read)
        try:
            for visit in self.lm.blocks(tokens, observers, head=head or HEAD in outside, micro_batch=micro_batch,
                                        progress=progress, desc="gptq: blocks", outside=outside):
                if visit.tail:
                    tail = True
                    self.quantize_outside(visit.index, observers)
                    self._drop_hessians(observers, visit.prefix)
                    continue
                for h in hooks:
                    h.remove()  # (the previous block's, run again by now)
                hooks = []
                decisions = self.by_block.get(visit.index, [])
                if decisions:
                    hooks = self.quantize_visit(visit, decisions, observers)
                self.lm.kept = {}
                self._drop_hessians(observers, visit.prefix)
        finally:
            for h in hooks:
                h.remove()
            self.lm.keep_block_reads = False
            self.lm.kept = {}
        if not tail:
            self._unseen += [m.module for d in self.outside for m in d.matrices]

    def quantize_visit(self, visit: Visit, decisions: list[Decision], observers: Observers) -> list:
        """GPTQ of a visited block's quantized matrices, then the block reloaded with them dequantized; with
        true-sequential, one step per input in the order the block first fed them (:meth:`steps`), the
        block run again before each step after the first so its inputs come from the linears quantized
        before it. Returns the W4A4 hooks (:meth:`engine_activations`) of every step."""
        steps = self.steps(visit.prefix, decisions, observers) if self.config.gptq_true_sequential else [decisions]
        smoothed = self.smooth(visit, decisions, observers) if self.config.gptq_smooth else {}
        read = dict(self.lm.kept)  # the block's tensors as read (smoothed): the reloads take them, not the disk again
        replaced: dict[str, torch.Tensor] = {}
        made: list = []
        hooks: list = []
        for k, step in enumerate(steps):
            if k:
                names = self.input_names(visit.prefix, step, observers)
                observers.drop(names)
                assert visit.again is not None  # (every block visit has it; the tail visit has no steps)
                with timing.timed("gptq_again"):
                    visit.again(names)
            self.asymmetric(step, observers)
            disk, got = self.sweep(visit.index, step, observers)
            replaced.update(disk)
            made += got
            with timing.timed("gptq_reload"):
                self.lm.reload_block(visit, {**read, **replaced})
            hooks += self.engine_activations(step, observers)
        self.keep(visit.index, made, smoothed)
        return hooks

    def smooth(self, visit: Visit, decisions: list[Decision], observers: Observers) -> dict[str, torch.Tensor]:
        """W4A4 smoothing of the block's norm-fed inputs (:mod:`~fp4convert.calibrate.smooth`): the
        norm weights and the linears' columns changed in :attr:`LayerwiseModel.kept` (what the sweep and
        the reloads read), the kept input tokens divided by the factors (their amax with them). Kept only
        if the block, run again, gives the same outputs (within 1e-3 of their largest): a norm output read
        by anything else (a residual, an expert stack) would change them. Returns the changed norm
        weights (checkpoint name -> tensor in its dtype) for the output."""
        import torch

        from fp4convert.calibrate.smooth import fold, scales
        from fp4convert.storage.safetensors import torch_dtypes

        kept = self.lm.kept
        block = self.lm.layers[visit.index]
        modules = dict(block.named_modules())
        readers: dict[str, list[tuple[Decision, Matrix]]] = {}
        for d in decisions:
            for m in d.matrices:
                readers.setdefault(self.inputs.get(m.module, ""), []).append((d, m))
        by_norm: dict[str, list[str]] = {}
        for name, norm in visit.fed.items():
            by_norm.setdefault(norm, []).append(name)
        changed: dict[str, torch.Tensor] = {}  # checkpoint name -> fp32 tensor the block loads
        out: dict[str, torch.Tensor] = {}  # the norm weights in their dtype
        tokens: list[tuple] = []
        record: dict[str, dict] = {}
        for norm, names in sorted(by_norm.items()):
            key = self.lm.disk_of.get(norm + ".weight")
            obs = {id(o): o for n in names if (o := observers.get(n)) is not None}
            if key is None or key not in kept or any(n not in readers for n in names) or len(obs) != 1:
                continue  # (a reader not quantized here, or inputs observed apart: left as it is)
            o = next(iter(obs.values()))
            if not o.kept:
                continue
            mats = [dm for n in names for dm in readers[n]]
            x_amax = torch.stack([t.abs().amax(0) for t in o.kept]).amax(0)
            w_amax = torch.stack([matrix_view(kept[d.info.name], m).abs().amax(0) for d, m in mats]).amax(0)
            dtype = torch_dtypes()[self.lm.infos[key].dtype]
            got = fold(modules[norm[len(visit.prefix):]], kept[key], scales(x_amax, w_amax, self.config.gptq_smooth), dtype)
            if got is None:
                continue
            new, eff, offset = got
            record[key] = {"readers": sorted({m.module for _, m in mats}), "offset": offset}
            changed[key] = new
            out[key] = new.to(dtype).cpu()
            for d, m in mats:
                t = changed.setdefault(d.info.name, kept[d.info.name].clone())
                matrix_view(t, m).mul_(eff.to(t.device))
            tokens.append((o, eff))
        if not changed:
            return {}
        with timing.timed("gptq_smooth"):
            assert visit.again is not None  # (every block visit has it, as in quantize_visit)
            before = visit.outputs  # (the block's first run, the weights as read)
            self.lm.reload_block(visit, {**kept, **changed})
            after = visit.again([])
        worst = max((float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(after, before)),
                    default=0.0)
        if worst > 1e-3:
            log.warning("%s: smoothing changes the block's outputs by %.2g of their largest (a norm's output is "
                        "read by more than the quantized linears); not smoothed", visit.prefix[:-1], worst)
            self.lm.reload_block(visit, dict(kept))
            return {}
        kept.update(changed)
        for o, eff in tokens:
            o.kept = [t / eff.to(t.device, t.dtype) for t in o.kept]
            o.amax = torch.stack([t.abs().amax() for t in o.kept]).amax().float()
        self.smoothed.update(record)
        return out

    def steps(self, prefix: str, decisions: list[Decision], observers: Observers) -> list[list[Decision]]:
        """True-sequential steps: the decisions grouped by what their input feeds, in the order the block's
        forward first fed it (the observers' insertion order): q/k/v, o, gate/up, down in a Llama block.
        An input is known by the matrices it feeds, their names with the numbers inside the block made
        wildcards, so every expert's down projection is one step (not one run of the block per expert).
        A fused group (one global scale) stays in its first member's step; a matrix whose input was never
        seen goes to the first step (its round-to-nearest fallback needs no input)."""
        first: dict[int, int] = {}
        for pos, (n, o) in enumerate(observers.items()):
            if n.startswith(prefix):
                first.setdefault(id(o), pos)

        def wild(module: str) -> str:
            return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", module[len(prefix):] if module.startswith(prefix) else module)

        def observer(m: Matrix):
            return observers.get(self.inputs.get(m.module, ""))

        feeds: dict[int, set[str]] = {}
        for d in decisions:
            for m in d.matrices:
                if (o := observer(m)) is not None:
                    feeds.setdefault(id(o), set()).add(wild(m.module))
        at_kind: dict[frozenset, int] = {}
        for oid, kinds in feeds.items():
            key = frozenset(kinds)
            at_kind[key] = min(at_kind.get(key, first.get(oid, -1)), first.get(oid, -1))

        def position(m: Matrix) -> int:
            o = observer(m)
            return at_kind[frozenset(feeds[id(o)])] if o is not None else -1

        group_at: dict[str, int] = {}
        for d in decisions:
            for m in d.matrices:
                g = m.group or d.group or m.module
                group_at[g] = min(group_at.get(g, position(m)), position(m))
        at: dict[int, list[Decision]] = {}
        for d in decisions:
            at.setdefault(min(group_at[m.group or d.group or m.module] for m in d.matrices), []).append(d)
        return [at[k] for k in sorted(at)]

    def input_names(self, prefix: str, step: list[Decision], observers: Observers) -> set[str]:
        """Every name under which the block observed the inputs of ``step`` (shared inputs have several)."""
        objs = {id(o) for d in step for m in d.matrices
                if (o := observers.get(self.inputs.get(m.module, ""))) is not None}
        return {n for n, o in observers.items() if n.startswith(prefix) and id(o) in objs}

    def quantize_outside(self, index: int, observers: Observers) -> None:
        """GPTQ of the quantized matrices outside the blocks whose every input was observed (stored as
        group ``index``); the others are left to round-to-nearest (:attr:`unseen`)."""
        def seen(d: Decision) -> bool:
            return all((o := observers.get(self.inputs.get(m.module, ""))) is not None
                       and o.xtx is not None and o.count > 0 for m in d.matrices)

        ready = [d for d in self.outside if seen(d)]
        self._unseen += [m.module for d in self.outside if not seen(d) for m in d.matrices]
        if ready:
            self.quantize_block(index, ready, observers)

    def rounded_inputs(self) -> set[str]:
        """W4A4: the inputs the engine rounds (the quantized plain linears'), whose tokens the
        observers keep for :meth:`asymmetric`; none without ``--activations``."""
        import torch

        if self.config.activations == "none":
            return set()
        names = {self.inputs.get(m.module, "") for d in self.plan.decisions if d.action == QUANTIZE
                 for m in d.matrices}
        return {n for n in names if n and isinstance(self.lm.modules.get(n), torch.nn.Linear)}

    def rounder(self, amax: float, rotate: str | None = None):
        """The engine's activation rounding of one input under its recorded amax (``amax`` already
        bf16): NVFP4 under that static scale, MXFP4 dynamic. ``rotate`` None: in the domain the
        statistics are in (rotated already with had16); "had16": of the plain input, rotated first and
        back after (what the block's second run feeds its linears)."""
        from fp4convert.numerics import reference as ref

        acts = self.config.activations

        def rounded(x):
            if acts == "nvfp4":
                p, s, g = ref.nvfp4_quantize(x, amax, rotate, "max")
                y = ref.nvfp4_dequantize(p, s, g, rotate)
            else:
                p, e = ref.mxfp4_quantize(x, rotate, "floor")
                y = ref.mxfp4_dequantize(p, e, rotate)
            return y.to(x.dtype)
        return rounded

    def asymmetric(self, decisions: list[Decision], observers: Observers) -> None:
        """W4A4: each kept input's Hessian and cross term from its tokens rounded as the engine rounds
        them (docs/numerics.md "GPTQ"): GPTQ then minimises the served layer's output error."""
        from fp4convert.calibrate.stats import bf16_ceil

        done: set[int] = set()
        for d in decisions:
            for m in d.matrices:
                obs = observers.get(self.inputs.get(m.module, ""))
                if obs is None or id(obs) in done or not obs.kept:
                    continue
                done.add(id(obs))
                if obs.amax is None or not float(obs.amax) > 0:
                    obs.asymmetric(None)  # (all zeros: nothing to round)
                    continue
                with timing.timed("gptq_asymmetric"):
                    obs.asymmetric(self.rounder(bf16_ceil(float(obs.amax))))

    def engine_activations(self, decisions: list[Decision], observers: Observers) -> list:
        """W4A4: forward pre-hooks that quantize the inputs of the block's quantized linears as the engine
        will (NVFP4 under the static scale the checkpoint records, from the amax just measured; MXFP4
        dynamic; rotated first with had16), for the block's second run: the next block is then
        calibrated on what the served model computes, activation rounding included. Linears only (an
        expert stack's inputs are not rounded here)."""
        import torch

        from fp4convert.calibrate.stats import bf16_ceil

        if self.config.activations == "none":
            return []
        hooks = []
        done: set[str] = set()
        for d in decisions:
            for m in d.matrices:
                name = self.inputs.get(m.module, "")
                obs = observers.get(name)
                module = self.lm.modules.get(name)
                if (name in done or obs is None or obs.amax is None or not float(obs.amax) > 0
                        or not isinstance(module, torch.nn.Linear)):
                    continue  # (an input never seen, or all zeros: left as it is)
                done.add(name)
                rounded = self.rounder(bf16_ceil(float(obs.amax)), self.config.rotate)

                def engine(_m, args, _r=rounded):
                    return (_r(args[0]), *args[1:])

                hooks.append(module.register_forward_pre_hook(engine))
        return hooks

    @staticmethod
    def _drop_hessians(observers: Observers, prefix: str) -> None:
        for n in [n for n in list(observers) if n.startswith(prefix)]:
            observers[n].release()  # the W4A4 amax stays; the Hessians of a quantized block are not needed again

    def quantize_block(self, index: int, decisions: list[Decision], observers: Observers) -> dict[str, torch.Tensor]:
        """GPTQ of every quantized matrix of block ``index``; returns the on-disk tensors with their
        quantized matrices dequantized (what the block is loaded with next) and keeps the bytes."""
        disk, made = self.sweep(index, decisions, observers)
        self.keep(index, made)
        return disk

    def keep(self, index: int, made: list, kept: dict[str, torch.Tensor] | None = None) -> None:
        """The bytes of block ``index``'s matrices (:meth:`sweep`'s) and the kept tensors it changed, into
        the store."""
        with timing.timed("gptq_store"):
            self.store.add_block(index, [(name, res.packed, res.scale, res.gs, a if self.scheme.global_scale else None)
                                         for name, res, a in made], kept)

    def sweep(self, index: int, decisions: list[Decision], observers: Observers) -> tuple[dict[str, torch.Tensor], list]:
        """GPTQ of these quantized matrices of block ``index``: the on-disk tensors with them dequantized,
        and (module, result, group amax) of each."""
        import torch

        from fp4convert.numerics import gptq
        from fp4convert.numerics import reference as ref

        rotate = self.config.rotate
        kept = self.lm.kept
        disk = {d.info.name: kept[d.info.name].clone() if d.info.name in kept else self.lm.read_fp32(d.info.name)
                for d in decisions}
        prepared: dict[int, gptq.Prepared] = {}
        mats: list[tuple[Decision, Matrix, torch.Tensor, gptq.Prepared]] = []
        for d in decisions:
            for m in d.matrices:
                obs = observers.get(self.inputs.get(m.module, ""))
                h = obs.hessian_matrix() if obs is not None else None
                if obs is None or h is None:
                    self._unseen.append(m.module)
                    continue
                p = prepared.get(id(obs))
                if p is None:
                    with timing.timed("gptq_prepare"):
                        p = prepared[id(obs)] = gptq.prepare(
                            h, self.config.gptq_damp, self.scheme.block_size if self.config.gptq_act_order else None,
                            obs.cross_matrix())
                if p.damp != self.config.gptq_damp:
                    self.damped[m.module] = p.damp
                w = matrix_view(disk[d.info.name], m)
                mats.append((d, m, gptq.target(ref.had16(w) if rotate == "had16" else w, p), p))
        # each fused group's amax, from the weights before any sweep (docs/numerics.md "The global scale")
        amax: dict[str, torch.Tensor] = {}
        for d, m, w, _p in mats:
            key = m.group or d.group or m.module
            a = w.abs().amax()
            amax[key] = a if key not in amax else torch.maximum(amax[key], a)
        sweep = self.sweep_fn()
        made = []
        for d, m, w, p in mats:
            group_amax = amax[m.group or d.group or m.module]
            try:
                with timing.timed("gptq_sweep"):
                    res = gptq.quantize(w, p, self.scheme.name, self.rule,
                                        group_amax if self.scheme.global_scale else None,
                                        self.config.gptq_block, sweep)
            except Exception as exc:
                raise type(exc)(f"{m.module} (GPTQ, block {index}): {exc}") from exc
            made.append((m.module, res, group_amax))
            deq = ref.inverse_had16(res.dequantized) if rotate == "had16" else res.dequantized
            matrix_view(disk[d.info.name], m).copy_(deq)
        return disk, made

    def record(self) -> dict:
        """What the manifest says of the pass (its settings are also in the recipe's identity); the
        statistics stage adds ``calibration`` (the data, samples, length, seed, tokenizer)."""
        device = "cuda" if self.lm.device.type == "cuda" else "cpu"
        order = (", act-order" if self.config.gptq_act_order else "") + \
            (", true-sequential" if self.config.gptq_true_sequential else "") + \
            (f", inputs smoothed into their norms (SmoothQuant, alpha {self.config.gptq_smooth})"
             if self.config.gptq_smooth else "")
        w4a4 = ", against the served layer's outputs on the activations as the engine rounds them" \
            if self.config.activations != "none" else ""
        return {"method": "gptq", "scale_rule": self.rule, "damp": self.config.gptq_damp,
                "block": self.config.gptq_block, "act_order": self.config.gptq_act_order,
                "true_sequential": self.config.gptq_true_sequential, "device": device,
                "target": "engine-rounded inputs" if self.config.activations != "none" else "inputs",
                **({"smooth": self.config.gptq_smooth, "smoothed": dict(sorted(self.smoothed.items()))}
                   if self.config.gptq_smooth else {}),
                "quantized": len(self.store.index), "damp_raised": dict(sorted(self.damped.items())),
                "rtn": sorted(self._unseen),
                "description": f"GPTQ (each column's rounding error compensated on calibration tokens{w4a4}; "
                               f"dampening {self.config.gptq_damp}{order}; run on {device})"}


METHOD = GPTQ

