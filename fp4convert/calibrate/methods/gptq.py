"""``--method gptq``: GPTQ on the block-by-block runner, sequentially (docs/numerics.md "GPTQ"): its settings
(:class:`GPTQSettings`, with their command-line options), its pass (:class:`GPTQ`) and its record.

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from fp4convert import timing
from fp4convert.calibrate import act_rounding
from fp4convert.calibrate.methods import Option
from fp4convert.calibrate.sharing import exchange, merged, owner_ranks
from fp4convert.calibrate.stats import Observers
from fp4convert.calibrate.steps import block_decisions, input_names, steps
from fp4convert.calibrate.store import Store
from fp4convert.calibrate.tail import HEAD, outside_names
from fp4convert.errors import ConfigError
from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    import torch

    from fp4convert.calibrate.experts import ExpertStack
    from fp4convert.calibrate.layerwise import LayerwiseModel, Visit
    from fp4convert.calibrate.resume import Checkpoint
    from fp4convert.config import ConvertConfig, Recipe
    from fp4convert.plan.planner import Plan
    from fp4convert.plan.types import Decision

log = logging.getLogger(__name__)

DAMP = 0.01  # (mirrors fp4convert/numerics/gptq.py DAMP and BLOCK, which import torch)
BLOCK = 128
SMOOTH = 0.5  # W4A4's default smoothing strength (NVFP4 activations; BENCHMARKS.md "W4A4 GPTQ with smoothing")
EXPERT_POLICY = ("each expert's Hessians from the tokens the router sent it; from every calibration token when it was sent "
                 "fewer than its input width (the experts listed under all_tokens)")


@dataclass(frozen=True)
class GPTQSettings:
    """GPTQ's settings (fp4convert.config.MethodSettings). None: the default for the recipe (:meth:`resolved`)."""

    name: ClassVar[str] = "gptq"
    damp: float = DAMP  # dampening, a fraction of the Hessian's mean diagonal
    block: int = BLOCK  # columns per lazy batch update
    act_order: bool | None = None  # None: on (measured: BENCHMARKS.md "GPTQ")
    true_sequential: bool | None = None  # None: on for weight-only, no rotation (measured)
    # W4A4: SmoothQuant's migration strength (0: off); the norm-fed inputs divided per channel by
    # s = amax_x^a / amax_w^(1-a), folded into the norm's weight (docs/numerics.md "GPTQ", smoothing)
    smooth: float | None = None  # None: SMOOTH for NVFP4 W4A4 without a rotation (measured)

    options: ClassVar[tuple[Option, ...]] = (
        Option("act_order", "--act-order/--no-act-order", bool,
               "--method gptq: quantize the scale blocks with the largest input energy first "
               "[default: on; measured: SmolLM2-135M NVFP4 KL 0.049 with, 0.066 without]."),
        Option("true_sequential", "--true-sequential/--no-true-sequential", bool,
               "--method gptq: within each block, calibrate each linear on the outputs of the block's linears "
               "quantized before it (q/k/v, then o, then gate/up, then down: the block runs once more per step) "
               "[default: on without --activations and --rotate; measured: Gemma 3 270M NVFP4 KL 0.102 with, 0.119 "
               "without; off otherwise: SmolLM2-135M NVFP4 W4A4 0.215 with, 0.206 without, Gemma 3 MXFP4 --rotate "
               "had16 0.184 with, 0.177 without]."),
        Option("smooth", "--smooth", float,
               "W4A4 GPTQ: SmoothQuant's migration strength; each norm-fed input (q/k/v's, gate/up's) is divided per "
               "channel by amax_x^a / amax_w^(1-a), folded into the norm's weight, the linears' columns multiplied by "
               "it; 0 turns it off [default: 0.5 with --activations nvfp4 and no rotation, else 0; measured: NVFP4 "
               "W4A4 KL SmolLM2-135M 0.180 with, 0.206 without; Gemma 3 270M 0.325 with, 0.376 without].",
               low=0.0, high=1.0, high_open=True),
        Option("damp", "--gptq-damp", float,
               f"--method gptq: dampening, a fraction of the Hessian's mean diagonal [default: {DAMP}].",
               low=0.0, low_open=True, high=10.0),
        Option("block", "--gptq-block", int,
               f"--method gptq: columns per lazy batch update (a multiple of 32) [default: {BLOCK}].", low=32),
    )

    def check(self, recipe: Recipe) -> None:
        """The settings a recipe cannot have (ConfigError, naming the option)."""
        if self.smooth and recipe.activations == "none":
            raise ConfigError("--smooth applies to W4A4 GPTQ only (--method gptq with --activations): it moves the "
                              "activations' rounding error into the weights, which GPTQ then compensates")
        if self.smooth is not None and not (isinstance(self.smooth, (int, float)) and 0.0 <= self.smooth < 1.0):
            raise ConfigError(f"--smooth {self.smooth!r}: give a migration strength in [0, 1), e.g. 0.5")
        if self.smooth and recipe.kept_dtype != "source":
            raise ConfigError("--smooth writes the norms it changes in their own dtype; drop --kept-dtype")
        if self.smooth and recipe.rotate not in (None, "none"):
            raise ConfigError("--smooth with --rotate: the rotation mixes the channels the smoothing scales; drop one")
        if not (isinstance(self.damp, (int, float)) and 0.0 < self.damp <= 10.0):
            raise ConfigError(f"--gptq-damp {self.damp!r}: give a fraction of the Hessian's mean diagonal in (0, 10]")
        if not isinstance(self.block, int) or self.block < 32 or self.block % 32:
            raise ConfigError(f"--gptq-block {self.block!r}: give a multiple of 32 (both schemes' blocks), e.g. 128")

    def resolved(self, recipe: Recipe) -> GPTQSettings:
        """The settings in effect for ``recipe``: act-order on; true-sequential on for weight-only GPTQ
        without a rotation (measured, BENCHMARKS.md "Calibrated accuracy, 2026-11-29": NVFP4A16 KL Gemma 3
        270M 0.119 -> 0.102, SmolLM2-135M 0.0494 -> 0.0491; worse with --rotate had16, MXFP4A16 0.177 ->
        0.184 and 0.073 -> 0.075, and with W4A4, SmolLM2 0.206 -> 0.215); smoothing SMOOTH for NVFP4
        activations without a rotation (measured, "W4A4 GPTQ with smoothing": NVFP4 W4A4 KL SmolLM2-135M
        0.206 -> 0.180, Gemma 3 270M 0.376 -> 0.325), else 0 (MXFP4 activations: not measured)."""
        plain = recipe.rotate in (None, "none")
        return replace(
            self,
            act_order=True if self.act_order is None else self.act_order,
            true_sequential=(recipe.activations == "none" and plain) if self.true_sequential is None
            else self.true_sequential,
            smooth=float(self.smooth) if self.smooth is not None else
            SMOOTH if recipe.activations == "nvfp4" and plain and recipe.kept_dtype == "source" else 0.0)

    def identity(self) -> dict:
        """The settings that decide the bytes (resolved): the manifest's and --resume's record."""
        out: dict = {"damp": self.damp, "block": self.block, "act_order": self.act_order,
                     "true_sequential": self.true_sequential}
        if self.smooth:
            out["smooth"] = self.smooth
        return out


class GPTQ:
    """The GPTQ pass of one conversion: settings, the plan's view of the runner, and what it made."""

    name = GPTQSettings.name
    Settings = GPTQSettings
    hessian = True
    squares = False
    # inspect --verify: a layer fails when its error exceeds round-to-nearest's on the same weights by more than
    # this factor (W4A4 -> budget): about 1.4x over the worst layer measured at the defaults (benchmarks/
    # verify_budget.py; docs/numerics.md "What inspect --verify accepts of a GPTQ checkpoint")
    RATIO_BUDGET = {False: 2.5, True: 5.0}

    def __init__(self, lm: LayerwiseModel, plan: Plan, config: ConvertConfig, settings: GPTQSettings,
                 inputs: dict[str, str], store: Store) -> None:
        from fp4convert.numerics.scheme import SCHEMES

        self.lm, self.plan, self.config, self.inputs, self.store = lm, plan, config, inputs, store
        self.settings = settings
        self.scheme = SCHEMES[config.scheme]
        self.rule = config.rule
        self.by_block = block_decisions(lm, plan)
        in_blocks = {id(d) for ds in self.by_block.values() for d in ds}
        self.outside = [d for d in plan.decisions if d.action == QUANTIZE and id(d) not in in_blocks]
        self.damped: dict[str, float] = {}  # module -> the dampening that factorized, where above --gptq-damp
        self._unseen: list[str] = []  # quantized matrices whose input the pass never saw
        self.smoothed: dict[str, dict] = {}  # norm weight --smooth changed -> its readers, its form
        self.experts: dict[str, dict] = {}  # streamed stack -> the tokens routed to each expert, the policy applied

    @property
    def unseen(self) -> list[str]:
        return self._unseen

    def sweep_fn(self):
        """The in-batch sweep: the device's kernel (same bytes as the reference there), else the reference."""
        from fp4convert.kernels.gptq import sweep_for

        return sweep_for(self.lm.device, self.settings.block)

    def state(self) -> dict:
        return {"damped": self.damped, "unseen": self._unseen, "smoothed": self.smoothed, "experts": self.experts}

    def restore(self, state: dict) -> None:
        self.damped, self._unseen = dict(state.get("damped", {})), list(state.get("unseen", []))
        self.smoothed, self.experts = dict(state.get("smoothed", {})), dict(state.get("experts", {}))

    def clock(self, tokens: torch.Tensor):
        """The blocks' time estimate (:class:`~fp4convert.calibrate.estimate.BlockClock`)."""
        from fp4convert.calibrate.estimate import BlockClock, block_work

        return BlockClock(block_work(self.plan, int(tokens.numel())), len(self.lm.layers), "gptq")

    def run(self, tokens: torch.Tensor, observers: Observers, head: bool, micro_batch: int, progress: bool,
            checkpoint: Checkpoint | None = None) -> None:
        """The sequential pass over every block, then the linears outside the blocks (observers must keep
        Hessians)."""
        outside = outside_names(self.lm, [self.inputs[m.module] for d in self.outside for m in d.matrices
                                          if m.module in self.inputs])
        tail = False
        hooks: list = []
        observers.keep_tokens = act_rounding.rounded_inputs(self.lm, self.plan, self.inputs, self.config.activations)
        try:
            for visit in self.lm.blocks(tokens, observers, head=head or HEAD in outside, micro_batch=micro_batch,
                                        progress=progress, desc=f"{self.name}: blocks", outside=outside, keep_reads=True,
                                        stream_experts=True, checkpoint=checkpoint, clock=self.clock(tokens)):
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
                self._drop_hessians(observers, visit.prefix)
        finally:
            for h in hooks:
                h.remove()
        if not tail:
            self._unseen += [m.module for d in self.outside for m in d.matrices]

    def quantize_visit(self, visit: Visit, decisions: list[Decision], observers: Observers) -> list:
        """GPTQ of a visited block's quantized matrices, then the block reloaded with them dequantized; with
        true-sequential, one step per input in the order the block first fed them (:meth:`steps`), the
        block run again before each step after the first so its inputs come from the linears quantized
        before it. Returns the W4A4 hooks (:func:`~fp4convert.calibrate.act_rounding.engine_hooks`) of every step."""
        streamed = {k: st for st in visit.stacks.values() for ks in st.keys.values() for k in ks}
        experts = [d for d in decisions if d.info.name in streamed]
        decisions = [d for d in decisions if d.info.name not in streamed]
        order = steps(visit.prefix, decisions, observers, self.inputs) if self.settings.true_sequential else [decisions]
        smoothed: dict[str, torch.Tensor] = {}
        if self.settings.smooth:
            from fp4convert.calibrate.smooth import smooth_block

            with timing.timed("gptq_smooth"):
                smoothed, record = smooth_block(self.lm, visit, decisions, observers, self.inputs, self.settings.smooth,
                                                self.lm.group)
            self.smoothed.update(record)
        read = dict(visit.reads)  # the block's tensors as read (smoothed): the reloads take them, not the disk again
        replaced: dict[str, torch.Tensor] = {}
        made: list = []
        hooks: list = []
        acts = self.config.activations
        for k, step in enumerate(order):
            if k:
                names = input_names(visit.prefix, step, observers, self.inputs)
                observers.drop(names)
                assert visit.again is not None  # (every block visit has it; the tail visit has no steps)
                with timing.timed("gptq_again"):
                    visit.again(names, outputs=False)
            names = input_names(visit.prefix, step, observers, self.inputs)
            observers.gather(self.lm.group, names, sums=False)  # (the amax: W4A4 rounds by every rank's)
            act_rounding.round_hessians(step, observers, self.inputs, acts)
            observers.gather(self.lm.group, names)  # (every rank's sums, added chunk by chunk)
            disk, got = self.sweep(visit.index, step, observers, read)
            replaced.update(disk)
            made += got
            with timing.timed("gptq_reload"):
                self.lm.reload_block(visit, {**read, **replaced})
            hooks += act_rounding.engine_hooks(self.lm, step, observers, self.inputs, acts, self.config.rotate)
        self.keep(visit.index, made, smoothed)
        if experts:
            if self.settings.true_sequential and made:
                assert visit.again is not None
                with timing.timed("gptq_again"):
                    visit.again(list(visit.stacks), outputs=False)  # (the stacks' inputs recorded again: the linears
                    # before them quantized)
            for stack in visit.stacks.values():
                with timing.timed("gptq_experts"):
                    self.quantize_stack(visit, stack, [d for d in experts if streamed[d.info.name] is stack], observers)
        return hooks

    def quantize_outside(self, index: int, observers: Observers) -> None:
        """GPTQ of the quantized matrices outside the blocks whose every input was observed (stored as
        group ``index``); the others are left to round-to-nearest (:attr:`unseen`)."""
        observers.gather(self.lm.group, sorted({self.inputs.get(m.module, "") for d in self.outside for m in d.matrices} - {""}))

        def seen(d: Decision) -> bool:
            return all((o := observers.get(self.inputs.get(m.module, ""))) is not None
                       and o.xtx is not None and o.count > 0 for m in d.matrices)

        ready = [d for d in self.outside if seen(d)]
        self._unseen += [m.module for d in self.outside if not seen(d) for m in d.matrices]
        if ready:
            self.quantize_block(index, ready, observers)

    @staticmethod
    def _drop_hessians(observers: Observers, prefix: str) -> None:
        for n in [n for n in list(observers) if n.startswith(prefix)]:
            observers[n].release()  # the W4A4 amax stays; the Hessians of a quantized block are not needed again

    def quantize_block(self, index: int, decisions: list[Decision], observers: Observers) -> dict[str, torch.Tensor]:
        """GPTQ of every quantized matrix of block ``index``; returns the on-disk tensors with their
        quantized matrices dequantized (what the block is loaded with next) and keeps the bytes."""
        disk, made = self.sweep(index, decisions, observers, {})
        self.keep(index, made)
        return disk

    def keep(self, index: int, made: list, changed: dict[str, torch.Tensor] | None = None, part: int = 0) -> None:
        """The bytes of block ``index``'s matrices (:meth:`sweep`'s; ``part``: an expert group's) and the
        unquantized tensors it changed, into the store."""
        with timing.timed("gptq_store"):
            self.store.add_block(index, [(name, res.packed, res.scale, res.gs, a if self.scheme.global_scale else None)
                                         for name, res, a in made], changed, why=f"{self.name} smoothing", part=part)

    def sweep(self, index: int, decisions: list[Decision], observers: Observers, reads: dict[str, torch.Tensor]
              ) -> tuple[dict[str, torch.Tensor], list]:
        """GPTQ of these quantized matrices of block ``index`` (``reads``: the block's tensors as read, the
        others are read now): the on-disk tensors with them dequantized, and (module, result, group amax) of
        each."""
        disk = {d.info.name: reads[d.info.name].clone() if d.info.name in reads else self.lm.read_fp32(d.info.name)
                for d in decisions}
        mats = self.targets(decisions, lambda d, m: observers.get(self.inputs.get(m.module, "")), disk)
        return disk, self.quantize_targets(index, mats, disk)

    def targets(self, decisions: list[Decision], observer_of, disk: dict[str, torch.Tensor]) -> list:
        """(decision, matrix, the weights the sweep starts from, the prepared Hessian) of every matrix of these
        decisions whose input was observed (``observer_of(d, m)``: its Observer or None); the others are left
        to round-to-nearest (:attr:`unseen`)."""
        from fp4convert.numerics import gptq
        from fp4convert.numerics import reference as ref

        prepared: dict[int, gptq.Prepared] = {}
        mats: list = []
        for d in decisions:
            for m in d.matrices:
                obs = observer_of(d, m)
                h = obs.hessian_matrix() if obs is not None else None
                if obs is None or h is None:
                    self._unseen.append(m.module)
                    continue
                p = prepared.get(id(obs))
                if p is None:
                    with timing.timed("gptq_prepare"):
                        p = prepared[id(obs)] = gptq.prepare(
                            h, self.settings.damp, self.scheme.block_size if self.settings.act_order else None,
                            obs.cross_matrix())
                if p.damp != self.settings.damp:
                    self.damped[m.module] = p.damp
                w = m.view(disk[d.info.name])
                mats.append((d, m, gptq.target(ref.had16(w) if self.config.rotate == "had16" else w, p), p))
        return mats

    def quantize_targets(self, index: int, mats: list, disk: dict[str, torch.Tensor]) -> list:
        """The sweep of :meth:`targets`' matrices, each fused group's global scale fixed first from its weights
        before any sweep (docs/numerics.md "The global scale"); their dequantized values written into ``disk``.
        Returns (module, result, group amax) of each."""
        import torch

        from fp4convert.numerics import gptq
        from fp4convert.numerics import reference as ref

        amax: dict[str, torch.Tensor] = {}
        for d, m, w, _p in mats:
            key = m.group or d.group or m.module
            a = w.abs().amax()
            amax[key] = a if key not in amax else torch.maximum(amax[key], a)
        sweep = self.sweep_fn()
        owners = owner_ranks(mats, self.lm.group)
        results = {}
        for i, (d, m, w, p) in enumerate(mats):
            if owners[i] != owners.rank:
                continue  # (another torchrun rank sweeps it)
            try:
                with timing.timed("gptq_sweep"):
                    results[i] = gptq.quantize(w, p, self.scheme.name, self.rule,
                                               amax[m.group or d.group or m.module] if self.scheme.global_scale else None,
                                               self.settings.block, sweep)
            except Exception as exc:
                raise type(exc)(f"{m.module} (GPTQ, block {index}): {exc}") from exc
        group = self.lm.group
        if group is not None and group.distributed:  # (every rank takes part in the exchange, even one that swept all)
            results.update(exchange(group, results, mats, amax, self.scheme.name, self.scheme.global_scale))
        made = []
        for i, (d, m, w, p) in enumerate(mats):
            res, group_amax = results[i], amax[m.group or d.group or m.module]
            made.append((m.module, res, group_amax))
            deq = ref.inverse_had16(res.dequantized) if self.config.rotate == "had16" else res.dequantized
            m.view(disk[d.info.name]).copy_(deq)
        return made

    def quantize_stack(self, visit: Visit, stack: ExpertStack, decisions: list[Decision], observers: Observers) -> None:
        """GPTQ of a streamed expert stack's experts, a group at a time (docs/numerics.md "GPTQ", "Experts"): each
        expert's Hessians from the tokens the router sent it (:func:`~fp4convert.calibrate.experts.expert_inputs`:
        from every token when it was sent fewer than its input width, the stated policy), gate/up first, then
        down on the gate/up's outputs (quantized ones with true-sequential); each group's bytes stored as it is
        done, its Hessians and fp32 weights released before the next."""
        from fp4convert.calibrate import experts as ex
        from fp4convert.calibrate.experts import down_observers, expert_index, expert_inputs, input_observers

        counts = stack.counts()
        group = self.lm.group
        if group is not None and group.distributed:
            counts = [sum(c) for c in zip(*group.gather(counts))]
        width = int(stack.calls[0][1].shape[-1]) if stack.calls else 0
        few = {e for e, c in enumerate(counts) if c < ex.FEW_TOKENS * width}
        self.experts[stack.path] = {"routed_tokens": counts, "all_tokens": sorted(few)}
        w4a4 = self.config.activations != "none"
        if w4a4:
            for _c, x, _i, _w in stack.calls:
                observers.note(f"{stack.path}:in", x)
        by_expert: dict[int, list[Decision]] = {}
        for d in decisions:
            by_expert.setdefault(expert_index(d.info.name) or 0, []).append(d)
        group = ex.sweep_group(stack, self.lm.device)
        for part, first in enumerate(range(0, stack.experts, group), start=1):
            last = min(first + group, stack.experts)
            inputs = expert_inputs(stack, first, last, few)
            mine = [d for e in range(first, last) for d in by_expert.get(e, [])]
            down = [d for d in mine if stack.targets[d.info.name].endswith("down_proj")]
            gate_up = [d for d in mine if d not in down]
            note = observers.note if w4a4 else None
            rotate = self.config.rotate
            if not self.settings.true_sequential:  # (down on the gate/up as they were)
                down_obs = down_observers(stack, first, last, inputs, rotate, note)
            made = self.sweep_experts(visit.index, gate_up, merged(self.lm.group, input_observers(inputs, rotate), rotate), stack)
            if self.settings.true_sequential:  # (down on the quantized gate/up's outputs)
                down_obs = down_observers(stack, first, last, inputs, rotate, note)
            made += self.sweep_experts(visit.index, down, merged(self.lm.group, down_obs, rotate), stack)
            self.keep(visit.index, made, part=part)
            del inputs, down_obs
            stack.release()
        visit.reloaded = True  # (the block runs again: its experts now read their quantized weights)

    def sweep_experts(self, index: int, decisions: list[Decision], observers: dict, stack: ExpertStack) -> list:
        """GPTQ of these experts' matrices (``observers``: expert -> the Observer of its matrices' input); their
        bytes kept by the stack for its next forwards."""
        import torch

        from fp4convert.calibrate.experts import Quantized, expert_index

        disk = {d.info.name: stack.tensor(d.info.name) for d in decisions}
        mats = self.targets(decisions, lambda d, m: observers.get(expert_index(d.info.name) or 0), disk)
        made = self.quantize_targets(index, mats, disk)
        for (d, _m, _w, _p), (_module, res, amax) in zip(mats, made):
            stack.quantized[d.info.name] = Quantized(res.packed, res.scale.view(torch.uint8),
                                                     float(amax) if self.scheme.global_scale else None)
        return made

    def record(self) -> dict:
        """What the manifest says of the pass (its settings are also in the recipe's identity); the
        statistics stage adds ``calibration`` (the data, samples, length, seed, tokenizer)."""
        device = "cuda" if self.lm.device.type == "cuda" else "cpu"
        s = self.settings
        order = (", act-order" if s.act_order else "") + (", true-sequential" if s.true_sequential else "") + \
            (f", inputs smoothed into their norms (SmoothQuant, alpha {s.smooth})" if s.smooth else "")
        w4a4 = ", against the served layer's outputs on the activations as the engine rounds them" \
            if self.config.activations != "none" else ""
        return {"method": self.name, "scale_rule": self.rule, "damp": s.damp,
                "block": s.block, "act_order": s.act_order,
                "true_sequential": s.true_sequential, "device": device,
                "target": "engine-rounded inputs" if self.config.activations != "none" else "inputs",
                **({"smooth": s.smooth, "smoothed": dict(sorted(self.smoothed.items()))} if s.smooth else {}),
                "quantized": len(self.store.index), "damp_raised": dict(sorted(self.damped.items())),
                "rtn": sorted(self._unseen),
                **({"experts": {"policy": EXPERT_POLICY, **dict(sorted(self.experts.items()))}} if self.experts else {}),
                "description": f"GPTQ (each column's rounding error compensated on calibration tokens{w4a4}; "
                               f"dampening {s.damp}{order}; run on {device})"}


METHOD = GPTQ

