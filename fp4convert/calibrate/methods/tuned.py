"""``--method tuned``: tuned rounding (the SignRound family) on the block-by-block runner (docs/numerics.md
"Tuned rounding"): its settings (:class:`TunedSettings`, with their command-line options), its pass
(:class:`Tuned`) and its record.

For each block of the model, in order, on the outputs of the blocks already quantized: the target is the block's
outputs with its weights as read (:attr:`Visit.outputs`); the start is GPTQ's bytes (the default: ``--method gptq``'s
pass at its weight-only defaults, run by :class:`~fp4convert.calibrate.methods.gptq.GPTQ` itself) or round-to-
nearest's (``--tuned-start-rtn``); signed gradient descent moves per-weight rounding offsets (and, with
``--tuned-scale-lr``, per-block scale bytes) through the stand-in :func:`fp4convert.numerics.tuned.fake_quantize`
(its values are the weights the bytes decode to), the best step kept; the guard keeps the start unless the tuned
weights' loss on every sample is lower (so no block ends above its start's calibration loss); the final bytes come
from :func:`fp4convert.numerics.tuned.quantize` (the contract's encoder) and the block is loaded with their decode.

GPTQ's work (Hessians, the sweep, true-sequential, the linears outside the blocks) is :class:`GPTQ`'s, inherited:
this module adds the tuning after it. Weight-only: ``--activations`` and ``--rotate`` are refused (the stand-in
neither rounds activations nor rotates), and so are MoE expert stacks and torchrun (one process tunes every
sample). A matrix whose tensor does not load as one block parameter (a tensor transformers' converters merge)
keeps its start, as does a block the forward runs several times per sample; both are listed in the record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from fp4convert import timing
from fp4convert.calibrate.methods import Option
from fp4convert.calibrate.methods.gptq import GPTQ, GPTQSettings
from fp4convert.errors import ConfigError, QuantizationError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from fp4convert.calibrate.layerwise import LayerwiseModel, Visit
    from fp4convert.calibrate.resume import Checkpoint
    from fp4convert.calibrate.stats import Observers
    from fp4convert.calibrate.store import Store
    from fp4convert.config import ConvertConfig, Recipe
    from fp4convert.numerics.tuned import Start
    from fp4convert.plan.planner import Plan
    from fp4convert.plan.types import Decision, Matrix

log = logging.getLogger(__name__)

# The defaults, measured on SmolLM2-135M MXFP4A16's first 4 blocks from GPTQ's start (their summed calibration loss,
# GPTQ's 0.073; benchmarks/results/cpu2_20261207_tuned_defaults_smollm2-135m_mxfp4_4blocks.json): 50 steps of 4 samples
# at rate 0.02 (AutoRound's 1 / iters) 0.070, 0.005 0.060, 0.002 0.057, 0.001 0.056, 0.0005 0.058; 8 samples at 0.005
# 0.056; 100 steps at 0.002 0.058 (no better than 50); from round-to-nearest's start (50 steps, 0.02) 0.102
ITERS = 50  # signed-gradient steps per block
BATCH = 4  # calibration samples per step
LR = 0.001  # the offsets' rate in E2M1 grid steps (from GPTQ's start, far below AutoRound's 1 / iters)


def start_gptq() -> GPTQSettings:
    """The GPTQ settings of the start: ``--method gptq``'s defaults resolved for a weight-only recipe without a
    rotation (the only recipes ``--method tuned`` takes)."""
    return GPTQSettings(act_order=True, true_sequential=True, smooth=0.0)


@dataclass(frozen=True)
class TunedSettings:
    """Tuned rounding's settings (fp4convert.config.MethodSettings). None: the default for the recipe (:meth:`resolved`)."""

    name: ClassVar[str] = "tuned"
    iters: int = ITERS  # steps per block (0: the start's bytes)
    lr: float = LR  # offsets' rate in E2M1 grid steps, decaying linearly to 0
    scale_lr: float = 0.0  # scale moves' rate in octaves (0: the start's scale bytes stay)
    batch: int = BATCH  # samples per step
    from_gptq: bool | None = None  # None: on (start from GPTQ's bytes); off: from round-to-nearest's
    seed: int = 0  # the samples' order (a CPU generator, per block)

    options: ClassVar[tuple[Option, ...]] = (
        Option("iters", "--tuned-iters", int,
               f"--method tuned: signed-gradient steps per block; 0 keeps the start's bytes [default: {ITERS}; measured].",
               low=0),
        Option("lr", "--tuned-lr", float,
               "--method tuned: the rounding offsets' learning rate in E2M1 grid steps, decaying linearly to 0 "
               f"(an offset travels at most lr * (iters + 1) / 2) [default: {LR}; measured].", low=0.0, low_open=True,
               high=1.0),
        Option("scale_lr", "--tuned-scale-lr", float,
               "--method tuned: the block scales' learning rate in octaves (scales move by whole bytes: one E8M0 "
               "exponent, or an eighth of an octave in E4M3); 0 keeps the start's scales [default: 0].",
               low=0.0, high=1.0),
        Option("batch", "--tuned-batch", int,
               f"--method tuned: calibration samples per step [default: {BATCH}; measured].", low=1),
        Option("from_gptq", "--tuned-start-gptq/--tuned-start-rtn", bool,
               "--method tuned: start each block from GPTQ's bytes (then the tuned block's calibration loss is never "
               "above GPTQ's) or from round-to-nearest's [default: GPTQ]."),
        Option("seed", "--tuned-seed", int, "--method tuned: the seed of the samples' order [default: 0].", low=0),
    )

    def check(self, recipe: Recipe) -> None:
        """The settings and recipes tuned rounding cannot take (ConfigError, naming the option)."""
        if recipe.activations != "none":
            raise ConfigError(f"--method tuned is weight-only: its stand-in does not round activations, so it cannot "
                              f"tune for --activations {recipe.activations}; use --method gptq (W4A4 GPTQ)")
        if recipe.rotate not in (None, "none"):
            raise ConfigError(f"--method tuned does not tune rotated weights (--rotate {recipe.rotate}); drop "
                              "--rotate, or use --method gptq (MR-GPTQ with --rotate had16)")
        if not isinstance(self.iters, int) or self.iters < 0:
            raise ConfigError(f"--tuned-iters {self.iters!r}: give the steps per block, 0 or more (e.g. {ITERS})")
        if not (isinstance(self.lr, (int, float)) and 0.0 < self.lr <= 1.0):
            raise ConfigError(f"--tuned-lr {self.lr!r}: give a rate in (0, 1] grid steps, e.g. 0.005")
        if not (isinstance(self.scale_lr, (int, float)) and 0.0 <= self.scale_lr <= 1.0):
            raise ConfigError(f"--tuned-scale-lr {self.scale_lr!r}: give a rate in [0, 1] octaves (0: scales stay)")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ConfigError(f"--tuned-batch {self.batch!r}: give the samples per step, 1 or more (e.g. {BATCH})")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"--tuned-seed {self.seed!r}: give a seed, 0 or more")

    def resolved(self, recipe: Recipe) -> TunedSettings:
        """The settings in effect: the GPTQ start unless asked otherwise; the rates as floats."""
        return replace(self, lr=float(self.lr), scale_lr=float(self.scale_lr),
                       from_gptq=True if self.from_gptq is None else self.from_gptq)

    def identity(self) -> dict:
        """The settings that decide the bytes (resolved): the manifest's and --resume's record."""
        out: dict = {"iters": self.iters, "lr": self.lr, "scale_lr": self.scale_lr, "batch": self.batch,
                     "seed": self.seed, "start": "gptq" if self.from_gptq else "rtn"}
        if self.from_gptq:
            out["gptq"] = start_gptq().identity()
        return out


@dataclass
class _Param:
    """A block parameter made of quantized matrices: its block-relative name, and each matrix's (module, the values
    it starts from [N, K], its start) in the parameter's row order (transposed back where the checkpoint is)."""

    name: str
    transpose: bool
    mats: list[tuple[str, torch.Tensor, Start]]


class Tuned(GPTQ):
    """The tuned-rounding pass of one conversion: GPTQ's pass (the start) with each block's tuning after it."""

    name = TunedSettings.name
    Settings = TunedSettings  # type: ignore[assignment]
    hessian = True  # (the GPTQ start's; run() keeps none with --tuned-start-rtn)
    squares = False

    def __init__(self, lm: LayerwiseModel, plan: Plan, config: ConvertConfig, settings: TunedSettings,
                 inputs: dict[str, str], store: Store) -> None:
        from fp4convert.calibrate.capture import is_expert_stack

        super().__init__(lm, plan, config, start_gptq(), inputs, store)
        self.tuning = settings
        stacks = [n for n, m in lm.model.named_modules() if is_expert_stack(m)]
        if stacks:
            raise ConfigError(f"{lm.root}: --method tuned tunes dense blocks; this model has MoE expert stacks "
                              f"({stacks[0]}): use --method gptq")
        if lm.group is not None and lm.group.distributed:
            raise ConfigError("--method tuned runs in one process (each block is tuned on every calibration sample); "
                              "run it without torchrun")
        self.blocks_done: dict[str, dict] = {}  # block index -> what its tuning did
        self._pending: list | None = None  # a visited block's GPTQ bytes, held back while it is tuned
        self._sources: dict[str, tuple[torch.Tensor, Start]] = {}  # module -> GPTQ's start (values, scale bytes)
        self._sweep: Callable | None = None

    def state(self) -> dict:
        return {**super().state(), "tuned": self.blocks_done}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.blocks_done = dict(state.get("tuned", {}))

    def clock(self, tokens: torch.Tensor):
        """The blocks' time estimate: GPTQ's arithmetic (GPTQ start) and the tuning's, each step 3x a forward on
        ``batch`` samples, and three forwards on every sample (the calls again, the start's and the kept losses)."""
        from fp4convert.calibrate.estimate import BlockClock, block_work

        n, seq = int(tokens.shape[0]), int(tokens.shape[1])
        s = self.tuning
        work = block_work(self.plan, n * seq) if s.from_gptq else {}
        for i, decisions in self.by_block.items():
            mnk = sum(m.shape[0] * m.shape[1] for d in decisions for m in d.matrices)
            work[i] = work.get(i, 0.0) + mnk * (6.0 * min(s.batch, n) * seq * s.iters + 3 * 2.0 * n * seq)
        return BlockClock(work, len(self.lm.layers), self.name)

    def run(self, tokens: torch.Tensor, observers: Observers, head: bool, micro_batch: int, progress: bool,
            checkpoint: Checkpoint | None = None) -> None:
        if not self.tuning.from_gptq:
            observers.hessian = False  # (no GPTQ: no Hessians to keep)
        super().run(tokens, observers, head, micro_batch, progress, checkpoint)

    def quantize_outside(self, index: int, observers: Observers) -> None:
        """The linears outside the blocks keep the start: GPTQ's, or the data-free quantizer's (no block to tune on)."""
        if self.tuning.from_gptq:
            super().quantize_outside(index, observers)

    def sweep_fn(self):  # (GPTQ's, recording while quantize_targets runs)
        return self._sweep if self._sweep is not None else super().sweep_fn()

    def keep(self, index: int, made: list, changed: dict[str, torch.Tensor] | None = None, part: int = 0) -> None:
        if self._pending is None:
            super().keep(index, made, changed, part)
        else:
            self._pending += made  # (a block's GPTQ start: its bytes are stored once it is tuned)

    def quantize_targets(self, index: int, mats: list, disk: dict[str, torch.Tensor]) -> list:
        """GPTQ's sweep of these matrices, recording the values each column was rounded from: with GPTQ's scale
        bytes and no offset they round to GPTQ's codes (checked), so tuning offsets them as it offsets the weights of
        a round-to-nearest start."""
        import torch

        cols: list[torch.Tensor] = []
        inner = super().sweep_fn()

        def recording(w1, u1, scheme, rule, amax, iw):
            c, b, vals, errs = inner(w1, u1, scheme, rule, amax, iw)
            cols.append(vals + errs * torch.diagonal(u1)[None, :])  # (the column before its rounding, to a rounding)
            return c, b, vals, errs

        self._sweep = recording
        try:
            made = super().quantize_targets(index, mats, disk)
        finally:
            self._sweep = None
        at = 0
        for (_d, _m, w, p), (module, res, _a) in zip(mats, made):
            got, width = [], 0
            while width < w.shape[1]:
                got.append(cols[at])
                width, at = width + cols[at].shape[1], at + 1
            src = torch.cat(got, 1)
            self._sources[module] = _gptq_source(src if p.perm is None else src[:, torch.argsort(p.perm)], res,
                                                 self.scheme.name, module)
        return made

    def quantize_visit(self, visit: Visit, decisions: list[Decision], observers: Observers) -> list:
        """The block's start (GPTQ's pass, its bytes held back, or round-to-nearest's), its tuning, its bytes into the
        store and the block loaded with their decode."""
        import torch

        t0, calls, hooks = time.perf_counter(), self._calls(visit), []
        if self.tuning.from_gptq:
            made, self._pending, self._sources = [], [], {}
            try:
                hooks = super().quantize_visit(visit, decisions, observers)
                made = self._pending
            finally:
                self._pending = None
            starts = {module: self._sources.pop(module) for module, _res, _a in made}
        else:
            made, starts = self._rtn_starts(visit, decisions)
        params, fixed = self._params(visit, decisions, starts, calls)
        rec: dict = {"matrices": len(made), **({"start_kept": sorted(fixed)} if fixed else {})}
        with timing.timed("tuned_tune"), torch.enable_grad():
            final = self._tune(visit, params, calls, rec) if params and self.tuning.iters else {}
        made = [(module, final.get(module, res), a) for module, res, a in made]
        super().keep(visit.index, made)
        if final or not self.tuning.from_gptq:  # (GPTQ's pass left the block loaded with its start)
            with timing.timed("tuned_reload"):
                self._reload(visit, decisions, made)
        self.blocks_done[str(visit.index)] = rec  # (no time in it: the manifest's bytes do not depend on the clock)
        log.info("tuned: block %d took %.2f s: %s", visit.index, time.perf_counter() - t0, rec)
        return hooks

    def _calls(self, visit: Visit) -> list:
        """The block's recorded calls (args, kwargs: the hidden states the quantized stream gave it), one per
        micro-batch and call, taken from one more run of the block observing nothing."""
        got: list = []
        block = self.lm.layers[visit.index]
        hook = block.register_forward_pre_hook(lambda _m, a, kw: got.append((a, kw)), with_kwargs=True)
        try:
            assert visit.again is not None  # (every block visit has it)
            with timing.timed("tuned_again"):
                visit.again([], outputs=False)
        finally:
            hook.remove()
        return got

    def _rtn_starts(self, visit: Visit, decisions: list[Decision]) -> tuple[list, dict]:
        """Round-to-nearest's start of the block's matrices (the recipe's scale rule, each fused group's amax):
        ((module, its bytes, group amax) each, module -> (weights, start))."""
        import torch

        from fp4convert.numerics import tuned

        weights = {m.module: (d, m, m.view(visit.reads[d.info.name] if d.info.name in visit.reads
                                           else self.lm.read_fp32(d.info.name)).to(torch.float32))
                   for d in decisions for m in d.matrices}
        amax: dict[str, torch.Tensor] = {}
        for d, m, w in weights.values():
            key = m.group or d.group or m.module
            amax[key] = w.abs().amax() if key not in amax else torch.maximum(amax[key], w.abs().amax())
        made, starts = [], {}
        for module, (d, m, w) in weights.items():
            a = amax[m.group or d.group or m.module]
            s = tuned.start(w, self.scheme.name, self.rule, a if self.scheme.global_scale else None)
            starts[module] = (w, s)
            made.append((module, tuned.quantize(w, s), a))
        return made, starts

    def _params(self, visit: Visit, decisions: list[Decision], starts: dict, calls: list) -> tuple[list[_Param], list]:
        """The block parameters tuning can replace (each made of its quantized matrices, whole), and the modules that
        keep their start (their tensor merged by a converter, cut otherwise, or the block run more than once a sample)."""
        params: list[_Param] = []
        fixed: list[str] = []
        repeated = len(calls) != len(visit.outputs)
        for d in decisions:
            mats = [m for m in d.matrices if m.module in starts]
            target, pattern = self.lm.keymap.get(d.info.name, ("", None))
            order = _row_order(mats, d.info.shape)
            if repeated or pattern is not None or not target.startswith(visit.prefix) or order is None \
                    or len(mats) != len(d.matrices):
                fixed += [m.module for m in mats]
                continue
            params.append(_Param(target[len(visit.prefix):], mats[0].transpose,
                                 [(m.module, *starts[m.module]) for m in order]))
        return params, fixed

    def _tune(self, visit: Visit, params: list[_Param], calls: list, rec: dict) -> dict:
        """The signed-gradient loop of one block (the module's steps 3-5): module -> its tuned bytes where the tuned
        weights are kept (empty where the start is)."""
        import torch

        from fp4convert.numerics import tuned

        s = self.tuning
        dev = self.lm.device
        v = {mod: torch.zeros_like(w, requires_grad=True) for p in params for mod, w, _s in p.mats}
        t = {mod: torch.zeros(st.scale.shape, device=dev, requires_grad=True)
             for p in params for mod, _w, st in p.mats} if s.scale_lr else None
        ys = visit.outputs
        samples = [(k, j) for k, y in enumerate(ys) for j in range(int(y.shape[0]))]
        with torch.no_grad():
            base = self._loss(visit, params, calls, {mod: torch.zeros_like(x) for mod, x in v.items()}, None,
                              list(range(len(samples))), samples, per_sample=True)
        start_loss = float(base.mean())
        rec["start_loss"] = start_loss
        gen = torch.Generator().manual_seed(s.seed * 1_000_003 + visit.index)
        best: tuple[float, int, dict | None, dict | None] = (1.0, -1, None, None)  # (score, step, v, t): the start
        order: list[int] = []
        for i in range(s.iters if start_loss > 0 else 0):
            if len(order) < min(s.batch, len(samples)):
                order = torch.randperm(len(samples), generator=gen).tolist()
            idx, order = order[:s.batch], order[s.batch:]
            loss = self._loss(visit, params, calls, v, t, idx, samples)
            score = float(loss.detach()) / float(base[idx].mean())
            if score < best[0]:
                best = (score, i, {k: x.detach().clone() for k, x in v.items()},
                        {k: x.detach().clone() for k, x in t.items()} if t else None)
            grads = torch.autograd.grad(loss, [*v.values(), *(t.values() if t else ())], allow_unused=True)
            for x, g in zip(v.values(), grads):
                tuned.signed_step(x, g, tuned.learning_rate(s.lr, i, s.iters), tuned.OFFSET_LIMIT)
            for x, g in zip((t or {}).values(), grads[len(v):]):
                tuned.signed_step(x, g, tuned.learning_rate(s.scale_lr, i, s.iters), tuned.SCALE_LIMIT)
        return self._guard(visit, params, calls, samples, best, rec)

    def _guard(self, visit: Visit, params: list[_Param], calls: list, samples: list, best: tuple, rec: dict) -> dict:
        """The kept step's loss on every sample against the start's: its bytes where strictly lower, else none."""
        import torch

        from fp4convert.numerics import tuned

        _score, step, kv, kt = best
        rec["best_step"] = step
        if kv is None:
            rec["kept"] = "start"
            return {}
        with torch.no_grad():
            loss = float(self._loss(visit, params, calls, kv, kt, list(range(len(samples))), samples,
                                    per_sample=True).mean())
        rec["tuned_loss"] = loss
        if not loss < rec["start_loss"]:
            rec["kept"] = "start"
            return {}
        rec["kept"] = "tuned"
        out, moved = {}, 0
        for p in params:
            for mod, w, st in p.mats:
                out[mod] = tuned.quantize(w, st, kv[mod], None if kt is None else kt[mod])
                moved += int((out[mod].scale.view(torch.uint8) != st.scale).sum())
        rec["scales_moved"] = moved
        return out

    def _loss(self, visit: Visit, params: list[_Param], calls: list, v: dict, t: dict | None, idx: list[int],
              samples: list, per_sample: bool = False) -> torch.Tensor:
        """The block's output error against its target on samples ``idx`` (indices into ``samples``: (micro-batch,
        position) each) with the stand-in weights of (v, t): the mean squared error, or (``per_sample``, ``idx`` in
        ascending order) each sample's."""
        import torch
        from torch.func import functional_call

        from fp4convert.calibrate.capture import block_output
        from fp4convert.numerics import tuned

        weights = {}
        for p in params:
            parts = [tuned.fake_quantize(w, st, v[mod], None if t is None else t[mod]) for mod, w, st in p.mats]
            full = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
            weights[p.name] = full.T if p.transpose else full
        block = self.lm.layers[visit.index]
        picks: dict[int, list[int]] = {}
        for n in idx:
            k, j = samples[n]
            picks.setdefault(k, []).append(j)
        errs, total, count = [], None, 0
        for k, js in picks.items():
            args, kw = calls[k]
            y = visit.outputs[k]
            if len(js) != y.shape[0]:
                args, kw, y = *_take((args, kw), js, int(y.shape[0])), y[js]
            se = (block_output(functional_call(block, weights, args, kw)) - y) ** 2
            if per_sample:
                errs.append(se.reshape(se.shape[0], -1).mean(1))
            else:
                total = se.sum() if total is None else total + se.sum()
                count += se.numel()
        if per_sample:
            return torch.cat(errs)
        assert total is not None
        return total / count

    def _reload(self, visit: Visit, decisions: list[Decision], made: list) -> None:
        """The block loaded again with its matrices' final bytes decoded (the next block's inputs come from it)."""
        res = {module: r for module, r, _a in made}
        replaced = {}
        for d in decisions:
            base = visit.reads[d.info.name] if d.info.name in visit.reads else self.lm.read_fp32(d.info.name)
            t = base.clone()
            for m in d.matrices:
                if m.module in res:
                    m.view(t).copy_(res[m.module].dequantized)
            replaced[d.info.name] = t
        self.lm.reload_block(visit, {**visit.reads, **replaced})

    def record(self) -> dict:
        """What the manifest says of the pass: GPTQ's record of the start (with the GPTQ start), the tuning's settings
        and what each block kept."""
        s = self.tuning
        device = "cuda" if self.lm.device.type == "cuda" else "cpu"
        kept = sum(1 for r in self.blocks_done.values() if r.get("kept") == "tuned")
        start = {k: v for k, v in super().record().items() if k not in ("method", "description")} if s.from_gptq \
            else {"scale_rule": self.rule, "device": device, "quantized": len(self.store.index), "rtn": sorted(self._unseen)}
        return {"method": self.name, **start, "start": "gptq" if s.from_gptq else "rtn", "iters": s.iters, "lr": s.lr,
                "scale_lr": s.scale_lr, "batch": s.batch, "seed": s.seed, "blocks_tuned": kept,
                "blocks": dict(sorted(self.blocks_done.items(), key=lambda kv: int(kv[0]))),
                "description": f"tuned rounding (signed-gradient rounding offsets{' and scale moves' if s.scale_lr else ''} "
                               f"matching each block's outputs on calibration tokens, {s.iters} steps a block, from "
                               f"{'GPTQ' if s.from_gptq else 'round-to-nearest'}; tuned weights kept in {kept} of "
                               f"{len(self.blocks_done)} blocks; run on {device})"}


def _row_order(mats: list[Matrix], shape: tuple) -> list[Matrix] | None:
    """The matrices in the order their rows make the whole tensor (one whole matrix, or row slices of step 1 that tile
    it, all transposed alike), or None when they do not (expert slices, strided rows)."""
    if not mats or any(m.expert is not None for m in mats) or len({m.transpose for m in mats}) != 1:
        return None
    if len(mats) == 1 and mats[0].rows is None:
        return mats
    if any(m.rows is None or m.rows[2] != 1 for m in mats) or len(shape) != 2:
        return None
    rows = int(shape[1] if mats[0].transpose else shape[0])
    order = sorted(mats, key=lambda m: m.rows[0])  # type: ignore[index]
    bounds = [0, *(m.rows[1] for m in order)]  # type: ignore[index]
    return order if all(m.rows[0] == b for m, b in zip(order, bounds)) and bounds[-1] == rows else None  # type: ignore[index]


def _take(call: tuple, js: list[int], n: int) -> tuple:
    """A recorded call (args, kwargs) cut to samples ``js`` of its micro-batch of ``n``: every tensor of two or more
    dimensions whose first is ``n`` (hidden states, masks, position tables) indexed; the rest as recorded."""
    import torch
    from torch.utils._pytree import tree_map

    index = torch.tensor(js)

    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == n:
            return x.index_select(0, index.to(x.device))
        return x

    return tree_map(cut, call)


def _gptq_source(src: torch.Tensor, res, scheme: str, module: str) -> tuple[torch.Tensor, Start]:
    """(the values GPTQ rounded, GPTQ's scale bytes) of one matrix: with no offset they give GPTQ's codes. A value
    the recording's last-bit rounding moved across a tie is replaced by GPTQ's decode of it (which rounds back)."""
    import torch

    from fp4convert.numerics import reference as ref
    from fp4convert.numerics import tuned

    s = tuned.Start(scheme, res.scale.view(torch.uint8), res.gs)
    want = ref.unpack_nibbles(res.packed)
    src = torch.where(ref.unpack_nibbles(tuned.quantize(src, s).packed) == want, src, res.dequantized)
    if not torch.equal(tuned.quantize(src, s).packed, res.packed):
        raise QuantizationError(f"{module}: GPTQ's codes are not reproduced from its recorded values (a bug: report it)")
    return src, s


METHOD = Tuned
