"""Building the model definition with transformers: the model on ``meta``, every checkpoint key mapped.

:func:`build` runs in the definition's child process (:mod:`fp4convert.plan.definition` starts it and caches
the answer): transformers builds the model class from ``config.json`` on the ``meta`` device, every on-disk
tensor is mapped to the parameter it loads into with transformers' own key conversion, and
:func:`fp4convert.plan.role_rules.decide` gives its role. :func:`check_config` (cheap, no transformers) runs
in the converter's process too, before a child is started.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from fp4convert.plan.fp4_loading import Fp4Loader
from fp4convert.plan.role_rules import ModelFacts, TensorFacts, decide
from fp4convert.plan.roles import KEPT, LINEAR, Definition, Role, Unknown, one_line

if TYPE_CHECKING:
    from fp4convert.storage.safetensors import TensorInfo

log = logging.getLogger(__name__)


def _bounded_int(cfg: dict, key: str, hi: int) -> None:
    v = cfg.get(key)
    values = list(v.values()) if isinstance(v, dict) else [v]  # LXMERT: {"language": 9, "vision": 5, ...}
    for x in values:
        if x is not None and (not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= hi):
            raise Unknown(f"config.json {key}={v!r} is not an integer in [0, {hi}]")


def check_sizes(cfg: dict) -> None:
    """Refuse absurd sizes before transformers allocates per layer or per expert (even on meta, a
    module per layer costs memory: ``num_hidden_layers: 10**10`` would exhaust the machine)."""
    for c in (cfg, cfg.get("text_config"), cfg.get("vision_config"), cfg.get("audio_config")):
        if isinstance(c, dict):
            for key in ("num_hidden_layers", "num_layers", "n_layer", "num_local_experts", "num_experts",
                        "n_routed_experts", "moe_num_experts", "num_nextn_predict_layers", "encoder_layers",
                        "decoder_layers", "num_decoder_layers"):
                _bounded_int(c, key, 4096)  # 92,523 layers: 211 s, 4 GB on meta (issue 34)


def check_config(model_config: dict) -> None:
    """The cheap checks of config.json, before a child is started or the cache read (and again in the child)."""
    if not model_config:
        raise Unknown("the source has no config.json")
    mt = model_config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise Unknown("config.json has no model_type")
    archs = model_config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise Unknown(f"config.json architectures={archs!r} is not a list of class names")
    check_sizes(model_config)


def build(model_config: dict, tensors: list[TensorInfo]) -> Definition:
    """Build the definition here (in the child process :func:`fp4convert.plan.definition.load` starts)."""
    check_config(model_config)
    mt = model_config["model_type"]
    archs = model_config.get("architectures")
    try:
        import torch
        import transformers
        from transformers import CONFIG_MAPPING
    except ImportError as exc:  # pragma: no cover - transformers is a dependency; kept for broken installs
        raise Unknown(f"transformers cannot be imported ({exc})") from exc
    if mt not in CONFIG_MAPPING:
        remote = " (the checkpoint ships its own code: auto_map)" if "auto_map" in model_config else ""
        raise Unknown(f"transformers {transformers.__version__} does not know model_type {mt!r}{remote}")
    try:
        cls_cfg = CONFIG_MAPPING[mt]
        decode = getattr(cls_cfg, "_decode_special_floats", None)  # {"__float__": "Infinity"}, as from_pretrained reads it
        config = cls_cfg.from_dict(decode(dict(model_config)) if decode else dict(model_config))
    except Exception as exc:  # noqa: BLE001 - any failure means: no definition, say why
        raise Unknown(f"transformers cannot read this config.json ({type(exc).__name__}: {one_line(exc)})") from exc
    cls = _model_class(transformers, config, archs or [])
    if cls is None:
        raise Unknown(f"transformers {transformers.__version__} has no model class for {archs or mt}")
    from fp4convert.plan import parts as modelparts

    unbuilt: dict[str, str] = {}
    try:
        with torch.device("meta"):
            model = cls(config)
    except ImportError as exc:  # an optional package of one part is missing (Gemma 3n's timm vision tower)
        # build what can be built: the parts whose package is missing become empty placeholders
        try:
            with torch.device("meta"), modelparts.build_without_unbuildable_parts() as b:
                model = cls(config)
        except Exception as exc2:  # noqa: BLE001
            need = modelparts.missing_packages(exc2) or modelparts.missing_packages(exc)
            raise Unknown(f"transformers cannot build {cls.__name__} from this config.json without "
                          + (f"{', '.join(need)} (pip install {' '.join(need)})" if need else
                             f"an optional package ({one_line(exc)})")) from exc2
        unbuilt = {p: f"{b.unbuilt[id(m)][0]}, which transformers cannot build without {b.unbuilt[id(m)][1]} "
                      f"(pip install {b.unbuilt[id(m)][1].replace(', ', ' ')})"
                   for p, m in model.named_modules() if id(m) in b.unbuilt}
    except Exception as exc:  # noqa: BLE001
        raise Unknown(f"transformers cannot build {cls.__name__} from this config.json "
                      f"({type(exc).__name__}: {one_line(exc)})") from exc
    return definition_of(model, tensors, transformers.__version__, model_config, unbuilt)


def _model_class(transformers, config, archs: list[str]):
    from transformers import PreTrainedModel

    for a in archs:
        c = getattr(transformers, a, None)
        if isinstance(c, type) and issubclass(c, PreTrainedModel):
            return c
    for auto in ("MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_MAPPING"):
        mapping = getattr(transformers, auto, None)
        try:
            return mapping[type(config)] if mapping is not None else None
        except KeyError:
            continue
    return None


def definition_of(model, tensors: list[TensorInfo], version: str, model_config: dict | None = None,
                unbuilt: dict[str, str] | None = None) -> Definition:
    import torch.nn as nn
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key
    from transformers.pytorch_utils import Conv1D

    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    modules = dict(model.named_modules(remove_duplicate=False))
    from fp4convert.plan import parts as modelparts

    unbuilt = unbuilt or {}
    try:
        mparts = modelparts.find_parts(model, modules, unbuilt)
    except Exception as exc:  # noqa: BLE001 - say why, rather than plan a multimodal model wrongly
        raise Unknown(f"the language model of {type(model).__name__} could not be found from its definition "
                      f"({type(exc).__name__}: {one_line(exc)})") from exc
    heads = _heads(model, modules)

    mapped = []  # (info, target, pattern) for every tensor a parameter of the model loads
    roles: dict[str, Role] = {}
    for info in tensors:
        target, pattern = rename_source_key(info.name, renamings, converters, model.base_model_prefix, params)
        gap = next((p for p in unbuilt if target.startswith(p + ".")), None)
        if target not in params and gap is not None:  # a part transformers could not build here
            roles[info.name] = Role(KEPT, _module_of(target), "-", f"{mparts.outside(gap) or gap}; not built here: "
                                    f"{unbuilt[gap]}")
        elif target not in params:
            roles[info.name] = Role(KEPT, _module_of(target), "-", f"not a parameter of {type(model).__name__} "
                                    "(transformers ignores it when loading)", absent=True)
        else:
            mapped.append((info, target, pattern))
    if mparts.language_model is not None and not all(_matmul_in_language_model(mapped, modules, mparts, heads, nn,
                                                                             Conv1D, inside) for inside in (True, False)):
        # nothing but encoders and heads (a CTC speech encoder): the model itself, quantized whole; or nothing to
        # keep outside the language model (T5, T5Gemma: text encoders are part of it): the same, said as before
        mparts = modelparts.Parts(None, classes=mparts.classes)
    try:
        routers = modelparts.routing_linears(modules)
    except Exception as exc:  # noqa: BLE001 - the name and class rules for routers still apply
        log.warning("routers by role not found for %s (%s): name and class rules only", type(model).__name__, exc)
        routers = {}
    facts = ModelFacts(heads, mparts, routers, nn, Conv1D, None, model_config)
    # The model transformers builds to load OUR compressed-tensors output, and the key routing of that load
    # (before ``model`` is patched in place: ``params`` and ``modules`` above keep the bf16 model's objects).
    fp4 = Fp4Loader.build(model, version)
    facts = replace(facts, fp4=fp4)
    for info, target, pattern in mapped:
        name = info.name
        path, _, leaf = target.rpartition(".")
        mod = modules.get(path)
        cname = type(mod).__name__ if mod is not None else "-"
        converter = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
        axes = (disk_axes(converter, tuple(info.shape), tuple(params[target].shape)) if converter is not None
                else list(range(len(info.shape))))
        parts = path.split(".")
        ancestors = [(a, type(modules[a]).__name__) for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                     if a in modules]
        role = decide(TensorFacts(name, path, leaf, mod, cname, info, params[target], axes, converter,
                                  tuple(ancestors)), facts)
        if converter is not None and len(converter.target_patterns) > 1 and pattern is not None:
            first = converter.target_patterns[0]
            also = tuple(_module_of(target.replace(first, t, 1)) for t in converter.target_patterns[1:] if first in target)
            role = replace(role, also=tuple(m for m in also if m != role.module))
        if fp4 is not None and fp4.dequantizes_first(name):
            role = replace(role, dequant_route=True)
        roles[name] = role
    whole = _whole_model_unloadable(fp4, roles)
    if whole:  # transformers reads no compressed-tensors checkpoint of this model: write what vLLM reads
        roles = {n: (replace(r, kind=LINEAR, why="", tf_fp4=whole) if r.kind == KEPT and r.tf_fp4 else
                     replace(r, tf_fp4=r.tf_fp4 or whole) if r.kind != KEPT else r) for n, r in roles.items()}
    # a head counts as on disk only through its weight (a tied head's bias or norm on disk builds no weight)
    on_disk = {r.module for n, r in roles.items() if n.endswith("weight")}
    unbuilt_note = "; ".join(f"{p} ({why})" for p, why in unbuilt.items())
    return Definition(type(model).__name__, version, roles, heads, head_on_disk=any(h in on_disk for h in heads),
                      transformers_cannot_load=whole, language_model=mparts.language_model, unbuilt=unbuilt_note)


def _whole_model_unloadable(fp4: Fp4Loader | None, roles: dict[str, Role]) -> str:
    """Why transformers cannot load a compressed-tensors checkpoint of this model, whatever it quantizes.

    Its quantizer fails building the load's conversions (a ``.weight`` converter with several targets becomes
    many-to-many once the FP4 companions join: ``WeightConverter`` raises), or a tensor routed through a
    dequantizing converter has no form that loads: its dequantization keeps only ``weight_packed`` tensors
    (an unquantized one is dropped and the conversion after it fails), and it stacks FP4 ones for a
    per-expert merge, which a dense merge or split cannot take."""
    if fp4 is None:
        return ""
    if fp4.broken:
        return fp4.broken
    for name, r in roles.items():
        if not r.dequant_route or r.absent:
            continue
        if r.kind == KEPT and not r.tf_fp4:
            return (f"transformers {fp4.version} routes {name} through a converter that dequantizes first, which "
                    f"drops it unquantized, and it cannot be FP4 ({r.why})")
        if r.kind == KEPT and r.tf_fp4:
            return (f"transformers {fp4.version} can load {name} neither unquantized (its dequantizing converter "
                    f"drops it) nor as FP4 ({r.tf_fp4})")
    return ""


def _matmul_in_language_model(mapped, modules: dict, parts, heads: tuple[str, ...], nn, Conv1D,
                              inside: bool = True) -> bool:
    """Whether some matmul weight on disk lies inside (``inside``) or outside the language model (an output
    head counts as neither).

    Parts are kept beside a language model (engines build them unquantized); a checkpoint that holds nothing
    else (GraniteSpeech5ForCTC: an audio encoder and a CTC head tied to it) is that model itself, and its
    matmul weights are quantized like any model's."""
    for _, target, _ in mapped:
        path = target.rpartition(".")[0]
        if path in heads or (parts.outside(path) is None) != inside:
            continue
        mod = modules.get(path)
        if isinstance(mod, (nn.Linear, Conv1D)) or hasattr(mod, "is_transposed"):
            return True
    return False


def _module_of(param_name: str) -> str:
    return param_name.rpartition(".")[0] if "." in param_name else param_name


def _heads(model, modules: dict) -> tuple[str, ...]:
    """The output projections (tied or not) by module name: what transformers calls the LM head."""
    try:
        head = model.get_output_embeddings()
    except Exception:  # noqa: BLE001 - models without a head (encoders) may raise
        head = None
    if head is None:
        return ()
    return tuple(p for p, m in modules.items() if m is head)


def disk_axes(converter, disk_shape: tuple[int, ...], param_shape: tuple[int, ...]) -> list | None:
    """For each axis of the parameter, the disk tensor's axis it comes from ("E": the expert axis a merge
    adds); None when an operation's effect on axes is not known here."""
    axes: list = list(range(len(disk_shape)))
    for i, op in enumerate(converter.operations):
        kind = type(op).__name__
        if kind == "MergeModulelist":
            axes.insert(getattr(op, "dim", 0), "E")
        elif kind == "Transpose":
            # check_dims: transformers transposes only when the tensor does not already have the parameter's
            # shape (Qwen3-VL-MoE accepts its releases' [E, H, 2I] and its own saves' [E, 2I, H])
            if getattr(op, "check_dims", False) and i == 0 and tuple(disk_shape) == tuple(param_shape):
                continue
            a, b = op.dim0, op.dim1
            axes[a], axes[b] = axes[b], axes[a]
        elif kind in ("Concatenate", "Chunk", "Split", "Interleave"):
            continue
        else:
            return None
    return axes
