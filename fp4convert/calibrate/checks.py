"""What the statistics stage needs and refuses, decided while planning, before anything is written.

Which modules share one activation scale (fused groups, a MoE layer's experts); whether the model can
run at all (a local folder, config.json that transformers reads and builds, weights whose shapes
agree with it, a tokenizer where text is tokenized, an architecture the block runner can run:
:func:`fp4convert.calibrate.model.structure_problem`), and every failure of transformers as one
``Error:`` line naming the folder and, where it can be told, the config.json key.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.calibrate.diagnose import WAYS_OUT, config_key, model_errors  # noqa: F401 - re-exported
from fp4convert.errors import PlanError, QuantizationError
from fp4convert.plan.types import QUANTIZE

if TYPE_CHECKING:
    from fp4convert.config import ConvertConfig
    from fp4convert.plan.calibration import CalibrationPlan
    from fp4convert.plan.planner import Plan
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|w1|w3|down_proj|w2)$")


# -- which modules share one activation scale ------------------------------------------------

def quantized_modules(plan: Plan) -> list[str]:
    """Every output module the plan quantizes (each gets an activation scale)."""
    return [m.module for d in plan.decisions if d.action == QUANTIZE for m in d.matrices]


def sharing_groups(plan: Plan) -> list[list[str]]:
    """Modules that must carry one activation scale: the plan's fused groups (q/k/v, gate/up, each
    expert's gate/up: the engines' fused GEMMs read one input scale) and, per MoE layer, all experts'
    gate/up (w13) and all experts' down (w2): vLLM reduces ``w13_input_scale``/``w2_input_scale`` to
    their max across experts, so an expert the calibration never routed to still gets a real scale."""
    modules = quantized_modules(plan)
    parent = {m: m for m in modules}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    for members in plan.all_groups().values():
        for m in members[1:]:
            union(members[0], m)
    by_layer: dict[tuple[str, str], str] = {}
    for m in modules:
        hit = _EXPERT.match(m)
        if hit:
            key = (hit.group(1), "w2" if hit.group(2) in ("down_proj", "w2") else "w13")
            union(by_layer.setdefault(key, m), m)
    out: dict[str, list[str]] = {}
    for m in modules:
        out.setdefault(find(m), []).append(m)
    return list(out.values())


def share(amax: dict[str, float], plan: Plan) -> dict[str, float]:
    """The per-module amax with every sharing group at its members' max."""
    out: dict[str, float] = {}
    for members in sharing_groups(plan):
        vals = [amax[m] for m in members if m in amax]
        if not vals:
            raise QuantizationError(f"calibration measured no input for {members[0]}; check the model runs these "
                                    "modules, or use --activation-scale constant")
        top = max(vals)
        if not top > 0:
            raise QuantizationError(f"{members[0]}: every calibration input was zero (amax 0): no activation scale "
                                    "can be derived; give more calibration data or use --activation-scale constant")
        for m in members:
            out[m] = top
    return out


# -- refusing what cannot be calibrated, before anything is written ----------------------------

def plan_calibration(source: Source, config: ConvertConfig) -> CalibrationPlan:
    """The conversion's :class:`~fp4convert.plan.calibration.CalibrationPlan`, decided once while planning; a
    model run that cannot happen is refused here (exit 2, the reason), before anything is written. The
    activation calibration of W4A4, the input weights' pass (``--input-weights``) and a calibrated method
    have the same needs; random token ids need no tokenizer. The calibration file is read once here (its
    sha256 and its texts checked)."""
    from fp4convert.plan.calibration import CalibrationPlan

    amax = "none" if config.activations != "nvfp4" else config.activation_scale
    method = config.method_settings
    if method is not None:
        from fp4convert.calibrate.methods import get_method

        get_method(method.name)  # an unknown name: ConfigError, before anything runs
    iw = config.input_weight_source
    text = amax == "calibrate" or iw == "calibration" or method is not None
    bare = CalibrationPlan(amax, iw, method, None, None, config.rotate, config.activations, config.scheme, config.rule)
    if not bare.runs_model:
        return bare
    what, other = bare.words()
    if source.is_hub:
        raise PlanError(f"{what} runs the model from a local folder: download the checkpoint first "
                        f"(huggingface-cli download), {other}")
    root = Path(source.root)
    cfg = source.config()
    if not cfg:
        raise PlanError(f"{root}: no config.json; {what} needs the model definition ({other})")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise PlanError(f"{what} needs transformers (pip install transformers), {other}") from None
    if text and not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise PlanError(f"{root}: no tokenizer (tokenizer.json / tokenizer.model / vocab.json); {what} needs one "
                        f"to tokenize or generate its samples ({other})")
    vocab = vocab_size(root, config_vocab(cfg)) if iw == "random" else None
    samples = _samples(config) if text else None
    random = None
    if vocab is not None:
        from fp4convert.plan.calibration import RANDOM, Samples

        count, seq_len = config.random_shape
        random = Samples(RANDOM, count, seq_len, config.calibration_seed, vocab=vocab)
    check_definition(source, cfg, other, vocab, self_generated=text and config.calibration_data is None)
    return CalibrationPlan(amax, iw, method, samples, random, config.rotate, config.activations, config.scheme, config.rule)


def _samples(config: ConvertConfig):
    """The calibration samples of a text pass: the file (read once: its texts checked, its sha256 kept) or
    the model's own generations."""
    import hashlib

    from fp4convert.plan.calibration import FILE, SELF_GENERATED, Samples

    count, seq_len = config.calibration_shape
    if config.calibration_data is None:
        return Samples(SELF_GENERATED, count, seq_len, config.calibration_seed)
    path = Path(config.calibration_data)
    from fp4convert.calibrate.samples import read_texts

    read_texts(path)  # missing, not a regular file, empty, binary, not UTF-8, broken JSON lines
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Samples(FILE, count, seq_len, config.calibration_seed, path=str(path), sha256=digest)


def config_vocab(cfg: dict) -> object:
    """config.json's vocab_size: top level, else the text model's (``text_config``: VLMs, audio LMs)."""
    if "vocab_size" in cfg:
        return cfg["vocab_size"]
    text = cfg.get("text_config")
    return text.get("vocab_size") if isinstance(text, dict) else None


def vocab_size(root: Path, value: object) -> int:
    """config.json's vocab_size as the bound of random token ids: a positive int (``true`` is a bool to
    JSON, not 1, and ``128.0`` is no int: transformers would refuse either)."""
    if value is None:
        raise PlanError(f"{root}: config.json has no vocab_size; --input-weights random draws token ids below it; "
                        "fix config.json, or use --input-weights none")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{root}: config.json vocab_size={value!r} is not a positive integer; --input-weights random "
                        "draws token ids below it; fix config.json (vocab_size), or use --input-weights none")
    return value


def check_definition(source: Source, cfg: dict, other: str, vocab: int | None = None,
                     self_generated: bool = False) -> None:
    """Build the config and the model (on ``meta``: no memory, ~0.1 s for 70B) as the layer-by-layer run
    will, and compare the parameters' shapes with the checkpoint's headers (no data read): a config.json
    transformers cannot read or build, or one that disagrees with the weights, is refused here, while
    planning, rather than failing mid-run (``vocab``: random ids are drawn below it, so the embedding
    must have that many rows). With ``self_generated`` (no --calibration-data) the model samples its own
    calibration text, so a model transformers cannot generate with (an encoder: no causal LM head) is
    refused too."""
    from fp4convert.calibrate.model import build_meta, structure_problem
    from fp4convert.errors import DefinitionUnknown
    from fp4convert.plan.model_build import check_sizes

    root = Path(source.root)
    try:  # absurd layer/expert counts: building them, even on meta, never ends (issue 34's campaign)
        check_sizes(cfg)
    except DefinitionUnknown as exc:
        raise PlanError(f"{root}: {exc}; the model run builds every layer: fix config.json, {other}") from None
    tcfg, model = build_meta(root, cfg, other, buffers_real=False)
    why = structure_problem(model, tcfg)
    if why is not None:
        raise PlanError(f"{root}: the layer-by-layer run cannot run this {type(model).__name__} "
                        f"(model_type {cfg.get('model_type')!r}): {why}; {other}")
    if self_generated and not _can_sample(model):
        raise PlanError(f"{root}: without --calibration-data the calibration samples are generated by the model "
                        f"itself, which needs a causal LM head to sample from; this {type(model).__name__} (model_type "
                        f"{cfg.get('model_type')!r}) has none; give --calibration-data FILE (text or JSON lines), "
                        f"{other}")
    infos = {t.name: t for t in source.tensors()}
    targets = _plain_targets(model, infos)
    emb = model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    embed_param = names.get(id(emb), "") + ".weight"
    heads = set()
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is not None and id(out_emb) in names:
        heads.add(names[id(out_emb)] + ".weight")
    embed = next((k for k, t in targets.items() if t == embed_param), embed_param)
    rows = infos[embed].shape[0] if embed in infos and infos[embed].shape else None
    if vocab is not None and rows is not None and vocab > rows:
        raise PlanError(f"{root}: config.json vocab_size {vocab} is larger than the {rows} rows of {embed}: random "
                        "token ids would have no embedding; fix config.json (vocab_size), or use --input-weights none")
    disk = {t: k for k, t in targets.items()}
    for target, param in model.named_parameters(remove_duplicate=False):  # in the model's order
        name = disk.get(target)
        if name is None:
            continue  # the run names a missing tensor itself
        info = infos[name]
        want, got = tuple(param.shape), tuple(info.shape)
        # the embedding and head may hold more rows than vocab_size (padded); token ids stay below both
        ok = got[1:] == want[1:] and got[:1] >= want[:1] if target in (embed_param, *heads) else got == want
        if not ok:
            raise PlanError(f"{root}: {name} is {list(got)} in the checkpoint but {list(want)} in the model "
                            f"config.json describes (its sizes disagree with the weights); fix config.json, {other}")


def _can_sample(model) -> bool:
    """Whether the built class samples text (transformers' ``can_generate()``: a causal LM head); the base
    class of a VLM holds the language model but no head, so the instance's own class is asked, not the
    config's generation Auto classes (fp4convert.plan.parts.generates). A class that cannot tell is let run."""
    try:
        return bool(type(model).can_generate())
    except Exception:  # noqa: BLE001 - an exotic class: the run itself says what fails
        return True


def _plain_targets(model, infos: dict) -> dict[str, str]:
    """Checkpoint key -> the parameter it loads into unchanged (renamed only; converted ones are left
    to the run, which checks their converted shapes)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name in infos:
        target, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        if target not in meta and name in meta:
            target, pattern = name, None
        if pattern is None and target in meta:
            out[name] = target
    return out


# -- the destination, before the model runs -------------------------------------------------------

def check_destination(dst: Path, source: Source, config: ConvertConfig) -> None:
    """What the writer would refuse about DST, checked read-only before the statistics stage runs the
    model (minutes to hours): DST and SRC nested, DST a file, DST not empty without ``--overwrite`` /
    ``--resume``, DST locked by a live run. The writer checks again (and locks) when it starts."""
    import fcntl
    import os

    from fp4convert.errors import OutputError
    from fp4convert.output.destination import check_paths, dst_files
    from fp4convert.storage.names import LOCK_NAME

    dst = Path(dst)
    check_paths(dst, source)
    if dst.exists() and not dst.is_dir():
        raise OutputError(f"{dst} exists and is not a folder; choose another DST")
    if not dst.is_dir():
        return
    existing = [f for f in dst_files(dst) if f != LOCK_NAME]
    if existing and not (config.overwrite or config.resume):
        raise OutputError(f"{dst} exists and is not empty; pass --overwrite to replace it or --resume to continue")
    lock = dst / LOCK_NAME
    if lock.is_file() and not lock.is_symlink():
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return  # the writer reports it with its own words
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise OutputError(f"{dst} is in use by another fp4convert run (pid {pid}, lock {lock}); wait for it "
                              "to finish or choose another DST") from None
        except OSError:
            return
        finally:
            os.close(fd)
