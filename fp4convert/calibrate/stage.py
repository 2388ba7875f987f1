"""The statistics stage of a conversion: what W4A4 and ``--input-weights`` need, measured before
anything is written, by the block-by-block runner (:mod:`fp4convert.calibrate.layerwise`) for any
architecture it runs.

W4A4 NVFP4 engines quantize every linear's input per 16-block under a static per-tensor global scale
read from the checkpoint (docs/formats.md "W4A4"); that scale comes from the input's amax on
calibration tokens, rounded up to bf16 precision (at most 0.4% larger) so last-bit GEMM differences
between devices rarely reach the stored scale. The input-weighted scale rules use each input's
per-channel mean square. The result is kept (:mod:`fp4convert.calibrate.keep`) so ``--resume`` after
an interruption does not run the model again.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert import timing
from fp4convert.calibrate.checks import model_errors, quantized_modules, share
from fp4convert.calibrate.layerwise import MICRO_BATCH, LayerwiseModel
from fp4convert.calibrate.samples import file_tokens, generate, random_tokens, tokenizer_digest
from fp4convert.calibrate.stats import Observers, Statistics, bf16_ceil
from fp4convert.calibrate.tail import HEAD, blind_spots, refusal
from fp4convert.errors import PlanError, QuantizationError
from fp4convert.plan.types import QUANTIZE
from fp4convert.quantizer.backend import InputWeight

if TYPE_CHECKING:
    import torch

    from fp4convert.config import ConvertConfig
    from fp4convert.plan.calibration import CalibrationPlan, Samples
    from fp4convert.plan.planner import Plan
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)
_EXPERT_INDEX = re.compile(r"\.(\d+)\.[^.]+$")


def layerwise_amax(lm: LayerwiseModel, tokens: torch.Tensor, wanted: set[str] | None = None,
                   micro_batch: int = MICRO_BATCH,
                   mean_square: dict[str, torch.Tensor] | None = None,
                   rotate: str | None = None, rotated_amax: bool = False,
                   outside: set[str] | None = None, checkpoint: Path | None = None) -> dict[str, torch.Tensor]:
    """The fp32 amax of every observed input, by the runner's names (a linear's module name; expert
    stacks ``{path}:in`` / ``{path}:down:{e}``), block by block; also ``lm_head`` (the head's input)
    when ``wanted`` or ``outside`` names it. ``outside``: the runner names outside the blocks to observe
    (:func:`~fp4convert.calibrate.tail.blind_spots`; None: none). Raw fp32 maxima (no rounding).

    ``mean_square`` (a dict to fill): each input's per-channel mean square E[x_j^2] over every
    calibration token (fp64 sums, rounded to bf16 at the end), the ``input_weight`` that makes the
    weight scale rules' block error track the layer's output error (reference.block_error).
    ``rotate`` ("had16"): the mean squares are those of the rotated inputs ``x H``; the amax stays
    that of the plain inputs unless ``rotated_amax`` (W4A4 with a rotation: the engine quantizes x H).
    ``checkpoint``: where the pass keeps its progress as blocks finish (and finds an interrupted one's).
    """
    from fp4convert.calibrate.resume import PassCheckpoint

    obs = Observers(squares=mean_square is not None, rotate=rotate, rotated_amax=rotated_amax)
    head = bool(wanted and HEAD in wanted) or bool(outside and HEAD in outside)
    kept = PassCheckpoint(checkpoint, obs, lm.device) if checkpoint is not None else None
    lm.observe(tokens, obs, head=head, micro_batch=micro_batch, outside=outside or (), checkpoint=kept)
    obs.gather(lm.group)  # (torchrun: every rank's amax and sums)
    if mean_square is not None:
        mean_square.update(obs.mean_squares())
    return obs.amax()


def plan_inputs(lm: LayerwiseModel, plan: Plan) -> dict[str, str]:
    """plan module -> the runner's name of the input it multiplies (see :func:`layerwise_amax`): a
    linear's module; a 3-D expert stack's ``:in`` for gate/up and ``:down:{e}`` for expert ``e``'s
    down projection (the plan names experts ``...experts.{e}.{proj}``); ``lm_head`` for the head."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from fp4convert.calibrate.capture import is_expert_stack

    out: dict[str, str] = {}
    for d in plan.decisions:
        if d.action != QUANTIZE:
            continue
        got = lm.keymap.get(d.info.name)
        if got is None:
            continue
        path, _, leaf = got[0].rpartition(".")
        mod = lm.modules.get(path)
        for m in d.matrices:
            if path in lm.heads:
                out[m.module] = "lm_head"
            elif isinstance(mod, (torch.nn.Linear, Conv1D)) and leaf == "weight":
                out[m.module] = path
            elif mod is not None and is_expert_stack(mod):
                if leaf.startswith("down"):
                    hit = _EXPERT_INDEX.search(m.module)
                    if hit:
                        out[m.module] = f"{path}:down:{int(hit.group(1))}"
                else:
                    out[m.module] = f"{path}:in"
    return out


def statistics(source: Source, plan: Plan, config: ConvertConfig, device, group=None) -> Statistics:
    """Run what the plan's calibration (:attr:`Plan.calibration`, :class:`~fp4convert.plan.calibration.CalibrationPlan`)
    asks, before anything is written: the activation calibration of W4A4 NVFP4 (the mean squares are
    recorded in the same pass when the input weights come from it), a calibrated method's pass and, for
    ``--input-weights random``, a pass over seeded random token ids. ``group``: this process's place in a torchrun
    job (:class:`fp4convert.run.distributed.World`): the ranks share the calibration tokens by chunks and the
    method's sweeps by matrices, and end with every rank's statistics (the bytes of one process)."""
    from fp4convert.calibrate.checks import plan_calibration

    cal = plan.calibration if plan.calibration is not None else plan_calibration(source, config)
    out = Statistics()
    modules = quantized_modules(plan)
    if cal.amax == "constant":
        from fp4convert.formats.base import CONSTANT_AMAX

        out.amax = {m: CONSTANT_AMAX for m in modules}
        out.calibration = {"method": "constant", "amax": CONSTANT_AMAX}
    if not cal.runs_model:
        return out

    from fp4convert.calibrate import resume

    key = resume.key(source, cal, modules, None if device is None else str(device))
    if key is not None and group is not None and group.distributed:
        key = f"{key}.rank{group.rank}-of-{group.size}"  # (each rank keeps its own share's progress)
    if config.resume:
        kept = resume.load(key)
        if kept is not None:
            return kept
    if not config.resume:  # (a pass an earlier run left unfinished is not continued without --resume)
        for where in (resume.pass_dir(key), resume.pass_dir(key, "random")):
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)
    try:
        measured = _measure(source, plan, config, cal, device, out, modules, key, group)
    except KeyboardInterrupt:
        from fp4convert.errors import Interrupted

        if key is None:
            raise Interrupted("interrupted during calibration, before anything was written (a Hub source's "
                              "calibration is not kept); run the same command again") from None
        raise Interrupted("interrupted during calibration, before anything was written; the blocks it finished are "
                          "kept: run the same command with --resume to continue from them") from None
    resume.save(key, measured)
    for where in (resume.pass_dir(key), resume.pass_dir(key, "random")):
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)
    return measured


def _measure(source: Source, plan: Plan, config: ConvertConfig, cal: CalibrationPlan, device, out: Statistics,
             modules: list[str], key: str | None, group=None) -> Statistics:
    """The passes of ``cal`` on the model built from ``source`` (see :func:`statistics`); each keeps its progress
    under the resume cache's ``key`` as its blocks finish (``--resume`` continues it)."""
    import torch

    from fp4convert.calibrate import resume

    what, other = cal.words()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    root = Path(source.root)
    with model_errors(root, source.config(), "build the model of", other):
        lm = LayerwiseModel(source, dev, other, group=group)
    inputs = plan_inputs(lm, plan)

    def by_module(stats: dict) -> dict:
        """The runner's statistics under the plan's module names."""
        return {m: stats[n] for m, n in inputs.items() if n in stats}

    def running():
        """The forward's failures the plan-time check cannot see, as the same refusal."""
        return model_errors(root, source.config(), "run the model of", other)

    amax_pass = cal.amax == "calibrate"
    from fp4convert.calibrate.estimate import plan_lines

    for line in plan_lines(cal, plan, dev):  # (what will happen, and a rough time, before the long work)
        log.info("calibration: %s", line)
    with running():  # before any sample is made or any block runs: what no pass can observe
        blind, outside = blind_spots(lm, lm._forward, plan, inputs)
    if blind and amax_pass:
        raise refusal(blind, "activation calibration", other)

    mean_square: dict[str, torch.Tensor] = {}
    described: dict = {}
    if cal.samples is not None:
        tokens, data_record = _tokens(lm, root, cal.samples, running, what, other)
        if cal.method is not None:
            with running():
                raw = by_module(_method_pass(lm, plan, config, cal, tokens, inputs, set(modules), key, out))
        else:
            with running():
                raw = by_module(layerwise_amax(lm, tokens, set(modules),
                                               mean_square=mean_square if cal.input_weights == "calibration" else None,
                                               rotate=cal.rotate, rotated_amax=bool(cal.rotate) and cal.activations != "none",
                                               outside=outside, checkpoint=resume.pass_dir(key)))
        calibrated = {"data": data_record, "samples": int(tokens.shape[0]), "seq_len": int(tokens.shape[1]),
                      "seed": cal.samples.seed, "tokenizer_sha256": tokenizer_digest(root)}
        if amax_pass:
            out.amax, out.calibration = _activation_record(raw, modules, plan, calibrated)
        if out.method_record is not None:
            out.method_record["calibration"] = calibrated
        described = {"source": "calibration", **calibrated}
    if cal.random is not None:
        r = cal.random
        tokens = random_tokens(r.vocab or 1, r.count, r.seq_len, r.seed)
        with running():
            layerwise_amax(lm, tokens, set(modules), mean_square=mean_square, rotate=cal.rotate, outside=outside,
                           checkpoint=resume.pass_dir(key, "random"))
        described = {"source": "random", "samples": r.count, "seq_len": r.seq_len, "seed": r.seed, "vocab_size": r.vocab}
    if cal.input_weights != "none":
        out.input_weights, out.input_weight_record = input_weights_for(plan, by_module(mean_square), described,
                                                                       cal.rotate)
    return out


def _tokens(lm: LayerwiseModel, root: Path, samples: Samples, running, what: str, other: str
            ) -> tuple[torch.Tensor, dict[str, object]]:
    """The calibration samples' token ids (the file's, or the model's own generations) and their record."""
    import transformers as tf

    from fp4convert.plan.calibration import FILE

    try:
        tok = tf.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure is the same refusal, with its reason
        raise PlanError(f"{root}: the tokenizer does not load ({type(exc).__name__}: {exc}); {what} needs it "
                        f"to tokenize or generate its samples ({other})") from None
    if samples.kind == FILE:
        assert samples.path is not None
        data = Path(samples.path)
        tokens = file_tokens(tok, data, samples.count, samples.seq_len)
        return tokens, {"source": "file", "name": data.name, "sha256": samples.sha256}
    with running(), timing.timed("calibrate_generate"):
        tokens = generate(lm, tok, samples.count, samples.seq_len, samples.seed)
    return tokens, {"source": "self-generated", "start_token": int(tokens[0, 0])}


def _method_pass(lm: LayerwiseModel, plan: Plan, config: ConvertConfig, cal: CalibrationPlan, tokens: torch.Tensor,
                 inputs: dict[str, str], wanted: set[str], key: str | None, out: Statistics) -> dict[str, torch.Tensor]:
    """The calibrated method's pass over every block (``--method``, :mod:`fp4convert.calibrate.methods`):
    the matrices it quantizes go to a store (``out.store``); the inputs' amax, taken in the same pass (W4A4), is
    returned by runner name. Its progress is kept as blocks finish (an interrupted pass's store, observers and
    method state, :class:`~fp4convert.calibrate.resume.PassCheckpoint`); ``--resume`` continues from them."""
    from fp4convert.calibrate import resume
    from fp4convert.calibrate.methods import get_method
    from fp4convert.calibrate.store import Store, memory_budget

    assert cal.method is not None
    cls = get_method(cal.method.name)
    where = resume.store_dir(key)
    store = Store.resume(where, memory=memory_budget()) if config.resume else Store.create(where, memory=memory_budget())
    obs = Observers(squares=cls.squares, hessian=cls.hessian, rotate=cal.rotate,
                    rotated_amax=bool(cal.rotate) and cal.activations != "none")
    method = cls(lm, plan, config, cal.method, inputs, store)
    checkpoint = resume.PassCheckpoint(resume.pass_dir(key), obs, lm.device, method.state, method.restore, store)
    try:
        method.run(tokens, obs, head="lm_head" in wanted, micro_batch=MICRO_BATCH, progress=True, checkpoint=checkpoint)
        with timing.timed("calibrate_store_wait"):  # (the block files still being written after the last block)
            store.finish()
    except BaseException:
        if key is None:
            store.remove()  # (a pass that cannot be kept: a Hub source's)
        raise
    obs.gather(lm.group, sums=False)  # (torchrun: the amax W4A4 records are every rank's)
    out.store, out.method_record = store, {**method.record(), "numerics": numerics(lm.device)}
    if method.unseen:
        log.warning("%d quantized matrices (e.g. %s) had no observed input: rounded to nearest "
                    "(data-free) instead of %s", len(method.unseen), method.unseen[0], cls.name)
    log.info("%s: %d matrices quantized", cls.name, len(store.index))
    return obs.amax()


def numerics(device) -> dict:
    """What a calibrated method's bytes depend on besides the recipe and the source (docs/numerics.md "GPTQ",
    "What the bytes depend on"): the kind of device its float arithmetic ran on and the torch build (its
    matmuls, Cholesky and reductions). Not the thread count (tests/calibrate/test_gptq.py checks 1 and 2
    threads give the same bytes) and not the number of torchrun ranks."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        kind = f"cuda: {torch.cuda.get_device_name(dev)} (sm_{cap[0]}{cap[1]})"
    else:
        import platform

        kind = f"cpu: {platform.machine()}"
    return {"device": kind, "torch": torch.__version__}


def _activation_record(raw: dict, modules: list[str], plan: Plan, calibrated: dict) -> tuple[dict[str, float], dict]:
    measured = {m: bf16_ceil(float(v)) for m, v in raw.items()}
    missing = [m for m in modules if m not in measured]
    if missing:
        raise PlanError(f"{missing[0]}: a quantized module whose input the model's forward never showed (not an "
                        "nn.Linear, Conv1D or 3-D expert stack); "
                        "activation calibration cannot measure it (use --activation-scale constant)")
    shared = share(measured, plan)
    record = {
        "method": "calibrate",
        **calibrated,
        "amax_rounding": "bf16 ceil of the fp32 max; fused/expert groups at their max",
        "measured_amax": {m: measured[m] for m in modules},
        "amax": {m: shared[m] for m in modules},
    }
    return shared, record


def activation_amax(source: Source, plan: Plan, config: ConvertConfig, device) -> tuple[dict[str, float], dict]:
    """(module -> shared amax for every quantized module, the calibration record for the manifest)."""
    from dataclasses import replace

    from fp4convert.calibrate.checks import plan_calibration

    config = replace(config, input_weights="none")
    plan = replace(plan, calibration=plan_calibration(source, config))
    st = statistics(source, plan, config, device)
    assert st.amax is not None and st.calibration is not None
    return st.amax, st.calibration


def input_weights_for(plan: Plan, mean_square: dict, described: dict,
                      rotate: str | None = None) -> tuple[dict[str, InputWeight], dict]:
    """Each quantized matrix's input weight from the measured mean squares, and their record.

    Fused members (one group: q/k/v, gate/up, an expert's gate/up halves) share one input, so they
    share one weight: the first member's that was measured. A matrix whose input the pass never saw
    (a matrix no observed module multiplies) is quantized unweighted
    and listed in the record's ``unweighted``.
    """
    import torch

    group_of = {m: g for g, members in plan.all_groups().items() for m in members}
    groups = plan.all_groups()
    made: dict[str, InputWeight] = {}
    out: dict[str, InputWeight] = {}
    unweighted: list[str] = []
    for d in plan.decisions:
        if d.action != QUANTIZE:
            continue
        for m in d.matrices:
            g = group_of.get(m.module)
            members = groups[g] if g else [m.module]
            src = next((x for x in members if x in mean_square), None)
            if src is None:
                unweighted.append(m.module)
                continue
            w = mean_square[src]
            if w.dim() != 1 or w.numel() != m.shape[1]:
                raise QuantizationError(f"{src}: its measured input has {w.numel()} channels but {m.module} has "
                                        f"K={m.shape[1]}; use --input-weights none")
            if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                raise QuantizationError(f"{src}: the mean square of its input is not finite (the activations "
                                        "overflowed); use --input-weights none")
            if src not in made:
                made[src] = InputWeight(src, array("f", w.to(torch.float32).tolist()).tobytes())
            out[m.module] = made[src]
    if unweighted:
        log.warning("%d quantized matrices (e.g. %s) have no measured input (only nn.Linear inputs are recorded): "
                    "quantized without input weights", len(unweighted), unweighted[0])
    digest = hashlib.sha256()
    for name in sorted(out):
        digest.update(name.encode() + b"\0" + out[name].data)
    record = {**described, "rotated": rotate,
              "statistic": "per-channel mean square of each linear input (fp64 sums, rounded to bf16)",
              "weighted": len(out), "unweighted": unweighted, "sha256": digest.hexdigest()}
    return out, record
