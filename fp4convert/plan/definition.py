"""Every tensor's role from the model's own definition: transformers builds the model, we read it.

Names are guesses; transformers knows. For an architecture it ships, the model is built from
``config.json`` on the ``meta`` device (no weights read, no memory for them: a 671B-parameter
DeepSeek-V3 config builds in ~0.05 s), and every checkpoint key is mapped to the parameter it loads
into with transformers' OWN key conversion (``conversion_mapping.get_model_conversion_mapping`` and
``core_model_loading.rename_source_key``: the renames and the per-expert merges its loader applies).
The parameter's module then says what the tensor is:

- ``nn.Linear`` ``weight``: a matmul weight ``[out, in]`` (the input axis is known);
- a transformers experts module (``@use_experts_implementation``: ``is_transposed``,
  ``is_concatenated``, ``has_gate``): a 3-D expert stack whose orientation and gate/up packing are
  stated by the class, or one expert's 2-D weight merged into it at load;
- everything else (``Embedding``, GPT-2 ``Conv1D``, ``Conv1d``/``Conv2d``, norms, routers, position
  tables, parameters of custom modules) is kept, with a reason that names the module class.

Through a transformers converter, the disk tensor's axes are tracked to the parameter's
(``MergeModulelist`` inserts the expert axis, ``Transpose`` swaps, ``Concatenate``/``Chunk``/``Split``/
``Interleave`` keep them), so an expert stack stored ``[E, H, 2I]`` and one stored ``[E, 2I, H]`` are
both split along their input axis; an operation this module does not know keeps the tensor.

Pure of I/O and of tensor data; importing this module imports neither torch nor transformers (the
CLI's ``--help``/``--version`` never pay for them). docs/architecture.md says where it sits.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4convert.errors import DefinitionUnknown

if TYPE_CHECKING:
    from fp4convert.storage.safetensors import TensorInfo

log = logging.getLogger(__name__)

LINEAR, EXPERTS, KEPT = "linear", "experts", "kept"

# Modules kept by a documented rule (docs/formats.md "Which tensors are quantized"): what lies outside a
# model's language model is decided by :mod:`fp4convert.plan.parts` from the definition; multimodal projector
# classes are kept wherever they sit.
_PROJECTOR_RX = re.compile(r"MultiModal|Multimodal|Projector|Embedder|PatchMerger", re.IGNORECASE)
_ROUTER_LEAVES = {"gate", "router", "shared_expert_gate", "router_proj"}
# A router class: MixtralTopKRouter, DbrxRouter, JetMoeTopKGating (not one that merely gates something:
# MoshiGatingMLP is a gated MLP, KimiLinearForgetGate computes a forget gate with two Linears). A class named
# a gate holding the routing weight itself (not in a Linear) is one too (_GATE_CLASS_RX); a module named
# ``gate``/``router`` is one whatever its class (HunYuan's ``mlp.gate`` holds its router Linear ``wg``).
_ROUTER_CLASS_RX = re.compile(r"Router|TopK")
_GATE_CLASS_RX = re.compile(r"(Gate|Gating)$")
_EXPERT_PARAMS = {"gate_up_proj": "gate_up", "down_proj": "down", "up_proj": "up"}


@dataclass(frozen=True)
class Role:
    """What one on-disk tensor is, per the model definition.

    ``kind`` is LINEAR (a matmul weight; ``input_axis`` is its input axis ON DISK), EXPERTS (a 3-D
    stack: ``transpose`` when the disk holds ``[E, in, out]``, ``split`` of a gate/up stack, ``proj``)
    or KEPT (``why`` says why, naming the module class). ``module`` is the module as transformers
    builds it (after its key conversion), the name compressed-tensors' ``ignore`` is matched against.
    """

    kind: str
    module: str
    module_class: str
    why: str = ""
    input_axis: int | None = None
    transpose: bool = False
    split: str | None = None
    proj: str | None = None
    group: str | None = None  # shared-scale group from a transformers merge (one expert's gate + up)
    absent: bool = False  # no parameter of the model loads it (transformers drops it: MTP layers, extras)
    also: tuple[str, ...] = ()  # further modules transformers loads the tensor into (one disk tensor split in parts)
    names: tuple[str, ...] | None = None  # EXPERTS: per-expert output leaves (gate, up, down) from the definition
    tf_fp4: str = ""  # quantized: transformers cannot load any FP4 form of it (the output is for vLLM); kept: why
    # transformers cannot load it as FP4 under its checkpoint name (so it is kept for both consumers)
    dequant_route: bool = False  # transformers' compressed-tensors load routes this bf16 key through a converter
    # that dequantizes first, which drops an unquantized tensor: the tensor must be written FP4 for it to load


@dataclass
class Definition:
    """The model as transformers defines it, reduced to what the planner asks."""

    model_class: str
    transformers_version: str
    roles: dict[str, Role]
    heads: tuple[str, ...]  # output projections (lm_head, proj_out, embed_out) as transformers builds them
    head_on_disk: bool = False
    notes: list[str] = field(default_factory=list)
    # why transformers cannot load a compressed-tensors checkpoint of this model at all ("" when it can)
    transformers_cannot_load: str = ""
    # the language model's root module ("" the model itself); None: no language model beside other parts,
    # the model is quantized whole (docs/formats.md "Which tensors are quantized")
    language_model: str | None = None
    # parts transformers could not build here, and the packages that would let it ("" when none)
    unbuilt: str = ""

    @property
    def source(self) -> str:
        return f"transformers {self.transformers_version} {self.model_class}"

    def role(self, name: str) -> Role | None:
        return self.roles.get(name)


Unknown = DefinitionUnknown  # the model definition cannot be had; the message says why


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


def cache_dir() -> Path:
    """Where definitions are cached: FP4CONVERT_DEFINITION_CACHE, else ~/.cache/fp4convert/definitions."""
    env = os.environ.get("FP4CONVERT_DEFINITION_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp4convert" / "definitions"


def _cache_key(model_config: dict, tensors: list[TensorInfo]) -> str | None:
    """What a definition depends on: the config, the tensor names and shapes, the transformers version
    and this module's source. Computed without importing transformers or torch."""
    try:
        version = importlib.metadata.version("transformers")
        h = hashlib.sha256()
        h.update(json.dumps(model_config, sort_keys=True, default=str).encode())
        h.update(json.dumps(sorted((t.name, list(t.shape)) for t in tensors)).encode())
        h.update(version.encode())
        h.update(Path(__file__).read_bytes())
        h.update(Path(__file__).with_name("parts.py").read_bytes())
        return h.hexdigest()
    except Exception:  # noqa: BLE001 - no cache then (odd values, no transformers metadata)
        return None


def load(model_config: dict, tensors: list[TensorInfo]) -> Definition:
    """The definition of the model ``model_config`` describes, with a role for every tensor.

    Raises :class:`Unknown` (with the reason) when transformers is not installed, does not know the
    architecture (remote code, newer than the installed version) or cannot build it from this config.
    A definition is cached on disk (:func:`cache_dir`, keyed by config, tensor names and shapes,
    transformers version and this module), so a repeated or resumed run does not import transformers
    and torch again just to plan (2-5 s; the torch-free CUDA path never imports torch otherwise).
    """
    _check_config(model_config)  # cheap checks here, before a child is started or the cache read
    key = _cache_key(model_config, tensors)
    if key is not None:
        cached = _read_cache(key)
        if cached is not None:
            return cached
    d = _build_in_child(model_config, tensors)
    if key is not None:
        _write_cache(key, d)
    return d


def _build_in_child(model_config: dict, tensors: list[TensorInfo]) -> Definition:
    """Build the definition in a child process (``python -m fp4convert.plan.definition``): transformers and torch
    (2-12 s of imports, ~180 MiB) never enter the converter's process, so ``--dry-run`` and the torch-free
    CUDA path stay torch-free and the converter's memory does not carry them."""
    import subprocess
    import sys

    request = json.dumps({"config": model_config, "tensors": [[t.name, list(t.shape)] for t in tensors]},
                         default=str)
    try:
        r = subprocess.run([sys.executable, "-m", "fp4convert.plan.definition"], input=request, capture_output=True,
                           text=True, timeout=600, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unknown(f"the model definition could not be built ({type(exc).__name__}: {_one_line(exc)})") from exc
    try:
        obj = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    except ValueError:
        obj = None
    if obj is None:
        tail = " ".join(r.stderr.split())[-200:]
        raise Unknown(f"the model definition could not be built (exit {r.returncode}: {tail})")
    if "unknown" in obj:
        raise Unknown(obj["unknown"])
    return _from_json(obj)


def _to_json(d: Definition) -> dict:
    return {"model_class": d.model_class, "transformers_version": d.transformers_version, "heads": list(d.heads),
            "head_on_disk": d.head_on_disk, "roles": {n: asdict(r) for n, r in d.roles.items()},
            "transformers_cannot_load": d.transformers_cannot_load, "language_model": d.language_model,
            "unbuilt": d.unbuilt}


def _from_json(obj: dict) -> Definition:
    roles = {n: Role(**{**r, "also": tuple(r.get("also") or ()),
                        "names": tuple(r["names"]) if r.get("names") else None}) for n, r in obj["roles"].items()}
    return Definition(obj["model_class"], obj["transformers_version"], roles, tuple(obj["heads"]),
                      bool(obj["head_on_disk"]), transformers_cannot_load=obj.get("transformers_cannot_load", ""),
                      language_model=obj.get("language_model"), unbuilt=obj.get("unbuilt", ""))


def _child_main() -> None:
    """``python -m fp4convert.plan.definition``: a request on stdin, the definition (or why not) as JSON on stdout."""
    import sys

    from fp4convert.storage.safetensors import TensorInfo

    req = json.loads(sys.stdin.read())
    tensors = [TensorInfo(n, "BF16", tuple(shape), "", 0, 0) for n, shape in req["tensors"]]
    try:
        out = _to_json(_load(req["config"], tensors))
    except Unknown as exc:
        out = {"unknown": str(exc)}
    sys.stdout.write("\n" + json.dumps(out) + "\n")


def _read_cache(key: str) -> Definition | None:
    path = cache_dir() / f"{key}.json"
    try:
        with open(path, encoding="utf-8") as f:
            return _from_json(json.load(f))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged cache entry is rebuilt
        log.debug("definition cache %s unreadable (%s); rebuilding", path, exc)
        return None


def _write_cache(key: str, d: Definition) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        obj = _to_json(d)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, folder / f"{key}.json")
    except OSError as exc:
        log.debug("definition cache not written (%s)", exc)


def _check_config(model_config: dict) -> None:
    if not model_config:
        raise Unknown("the source has no config.json")
    mt = model_config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise Unknown("config.json has no model_type")
    archs = model_config.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise Unknown(f"config.json architectures={archs!r} is not a list of class names")
    check_sizes(model_config)


def _load(model_config: dict, tensors: list[TensorInfo]) -> Definition:
    """Build the definition here (in the child process of :func:`_build_in_child`)."""
    _check_config(model_config)
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
        raise Unknown(f"transformers cannot read this config.json ({type(exc).__name__}: {_one_line(exc)})") from exc
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
                             f"an optional package ({_one_line(exc)})")) from exc2
        unbuilt = {p: f"{b.unbuilt[id(m)][0]}, which transformers cannot build without {b.unbuilt[id(m)][1]} "
                      f"(pip install {b.unbuilt[id(m)][1].replace(', ', ' ')})"
                   for p, m in model.named_modules() if id(m) in b.unbuilt}
    except Exception as exc:  # noqa: BLE001
        raise Unknown(f"transformers cannot build {cls.__name__} from this config.json "
                      f"({type(exc).__name__}: {_one_line(exc)})") from exc
    return _definition(model, tensors, transformers.__version__, model_config, unbuilt)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


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


def _definition(model, tensors: list[TensorInfo], version: str, model_config: dict | None = None,
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
                      f"({type(exc).__name__}: {_one_line(exc)})") from exc
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
    facts = _ModelFacts(heads, mparts, routers, nn, Conv1D, None, model_config)
    # The model transformers builds to load OUR compressed-tensors output, and the key routing of that load
    # (before ``model`` is patched in place: ``params`` and ``modules`` above keep the bf16 model's objects).
    fp4 = _Fp4Loader.build(model, version)
    facts = replace(facts, fp4=fp4)
    for info, target, pattern in mapped:
        name = info.name
        path, _, leaf = target.rpartition(".")
        mod = modules.get(path)
        cname = type(mod).__name__ if mod is not None else "-"
        converter = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
        axes = (_disk_axes(converter, tuple(info.shape), tuple(params[target].shape)) if converter is not None
                else list(range(len(info.shape))))
        parts = path.split(".")
        ancestors = [(a, type(modules[a]).__name__) for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                     if a in modules]
        role = _role(_TensorFacts(name, path, leaf, mod, cname, info, params[target], axes, converter,
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


def _whole_model_unloadable(fp4: _Fp4Loader | None, roles: dict[str, Role]) -> str:
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


class _Fp4Loader:
    """How transformers loads our compressed-tensors FP4 output (``CompressedTensorsConfig(dequantize=True)``).

    Built from transformers' own loader: the compressed-tensors quantizer swaps the modules it swaps for a
    quantized checkpoint (``quantizers/base.py`` ``MODULES_TO_PATCH_FOR_QUANTIZATION``: Llama 4's experts become
    per-expert Linears) and extends the model's key conversions for the FP4 tensors
    (``update_weight_conversions``: a dequantize operation in front of every converter whose sources are
    ``.weight`` keys, then its general converter of ``<module>.weight_packed/_scale/_global_scale`` into
    ``<module>.weight``). :meth:`route` follows one written FP4 module through that routing, without data.
    """

    def __init__(self, model, version: str, renamings, converters, dequant, params, modules, broken: str = "") -> None:
        self.model, self.version = model, version
        self.renamings, self.converters, self.dequant = renamings, converters, dequant
        self.params, self.modules = params, modules
        self.broken = broken  # why transformers' quantizer cannot even build the load's conversions

    @classmethod
    def build(cls, model, version: str) -> _Fp4Loader | None:
        from types import SimpleNamespace

        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter
            from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
            from transformers.utils.quantization_config import QuantizationMethod

            q = object.__new__(CompressedTensorsHfQuantizer)  # its __init__ needs compressed-tensors; routing does not
            q.pre_quantized, q.use_fp8_kernel = True, False
            q.quantization_config = SimpleNamespace(dequantize=True, quant_method=QuantizationMethod.COMPRESSED_TENSORS)
            q._convert_model_for_quantization(model)
            dequant = q.get_load_operations()["dequantize"]
        except Exception as exc:  # noqa: BLE001 - another transformers: no routing check, as before
            log.debug("transformers' compressed-tensors loading not modelled (%s)", exc)
            return None
        try:
            conversions = get_model_conversion_mapping(model, hf_quantizer=q)
        except ValueError as exc:  # WeightConverter refuses the many-to-many converter its quantizer makes
            return cls(model, version, [], [], dequant, {}, {}, broken=(
                f"transformers {version} fails building the key conversions of any compressed-tensors checkpoint "
                f"of this model ({_one_line(exc)[:120]})"))
        except Exception as exc:  # noqa: BLE001 - another transformers: no routing check, as before
            log.debug("transformers' compressed-tensors loading not modelled (%s)", exc)
            return None
        params = dict(model.named_parameters(remove_duplicate=False))
        params.update(dict(model.named_buffers(remove_duplicate=False)))
        return cls(model, version, [c for c in conversions if not isinstance(c, WeightConverter)],
                   [c for c in conversions if isinstance(c, WeightConverter)], dequant, params,
                   dict(model.named_modules(remove_duplicate=False)))

    def dequantizes_first(self, key: str) -> bool:
        """Whether the load routes the checkpoint key ``key`` through a converter that dequantizes first."""
        from transformers.core_model_loading import rename_source_key

        if self.broken:
            return False
        _, pattern = rename_source_key(key, self.renamings, self.converters, self.model.base_model_prefix, self.params)
        conv = next((c for c in self.converters if pattern is not None and pattern in c.source_patterns), None)
        return conv is not None and any(isinstance(o, self.dequant) for o in conv.operations) \
            and pattern not in ("weight",)  # the general converter's own ``weight`` pattern passes weights through

    def route(self, module: str, shape: tuple[int, int]) -> str:
        """Why transformers cannot load the FP4 matrix ``shape`` ([N, K], blocks along K) written as ``module``;
        "" when it loads it (into an ``[N, K]`` parameter, or one expert of a merged stack)."""
        from transformers.core_model_loading import rename_source_key

        if self.broken:
            return self.broken
        key = f"{module}.weight_packed"
        target, pattern = rename_source_key(key, self.renamings, self.converters, self.model.base_model_prefix,
                                            self.params)
        conv = next((c for c in self.converters if pattern is not None and pattern in c.source_patterns), None)
        ops = [type(o).__name__ for o in getattr(conv, "operations", ())]
        v = f"transformers {self.version}"
        if conv is None or not any(isinstance(o, self.dequant) for o in conv.operations):
            return (f"{v} converts {module} at load ({', '.join(ops)}) before dequantizing anything, which packed FP4 "
                    "tensors cannot pass" if conv is not None else f"{v} reads {key} as no quantized weight")
        if target not in self.params:
            return (f"{v} routes {key} to {target}, which is not a parameter of the model (its compressed-tensors "
                    "loader dequantizes <module>.weight_packed into <module>.weight, and per-expert tensors only "
                    "through a per-expert merge of its conversion mapping)")
        rest = [o for o in conv.operations if not isinstance(o, self.dequant)]
        p = self.params[target]
        if rest:
            if type(rest[0]).__name__ != "MergeModulelist" or p.dim() != 3:
                return (f"{v} converts {module} at load ({', '.join(ops)}); its compressed-tensors dequantization "
                        "runs in front of per-expert merges only")
            return ""
        if p.dim() != 2:
            return f"{v} dequantizes 2-D tensors only, and {target} is {p.dim()}-D"
        import torch.nn as nn

        mod = self.modules.get(target.rpartition(".")[0])
        if not isinstance(mod, nn.Linear):  # GPT-2's Conv1D holds [in, out]: a square one would load transposed
            return (f"{v} dequantizes into {target} as stored, and blocks run along its last axis, which for "
                    f"{type(mod).__name__} is not the input axis")
        if tuple(p.shape) != tuple(shape):
            return (f"{v} dequantizes into {target} as stored, {list(p.shape)}, and blocks run along its last axis, "
                    f"which is not the input axis of this [N, K]={list(shape)} matrix")
        return ""

    def expert_linears(self, path: str):
        """The per-expert (gate, up, down) Linears transformers puts at ``path`` to load a quantized checkpoint
        (``SequentialLlama4TextExperts``), as (leaf names, expert 0's Linears); None when it keeps the stack."""
        import torch.nn as nn

        first = self.modules.get(f"{path}.0") if not self.broken else None
        if first is None:
            return None
        found = [(n, m) for n, m in first.named_children() if isinstance(m, nn.Linear)]
        leaves = {n for n, _ in found}
        names = next((t for t in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")) if set(t) <= leaves), None)
        if names is None:
            return None
        lin = dict(found)
        return names, tuple(lin[n] for n in names)


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


def _disk_axes(converter, disk_shape: tuple[int, ...], param_shape: tuple[int, ...]) -> list | None:
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


@dataclass(frozen=True, eq=False)
class _TensorFacts:
    """One on-disk tensor and the parameter it loads into (what :func:`_role` decides from)."""

    name: str  # on disk
    path: str  # the module, as transformers builds it
    leaf: str  # the parameter's name in that module
    mod: Any
    cname: str
    info: Any  # TensorInfo
    param: Any
    axes: list | None  # the disk axis of each parameter axis (``_disk_axes``)
    converter: Any
    ancestors: tuple[tuple[str, str], ...]  # (path, class) of every enclosing module, outermost first


@dataclass(frozen=True, eq=False)
class _ModelFacts:
    """What :func:`_role` needs to know of the whole model."""

    heads: tuple[str, ...]
    parts: Any  # modelparts.Parts: the language model and what lies outside it
    routers: dict[str, str]  # Linear path -> why its output routes (modelparts.routing_linears)
    nn: Any
    Conv1D: Any
    fp4: _Fp4Loader | None
    model_config: dict | None


def _role(t: _TensorFacts, mf: _ModelFacts) -> Role:
    name, path, leaf, mod, cname, info, param = t.name, t.path, t.leaf, t.mod, t.cname, t.info, t.param
    axes, converter, ancestors = t.axes, t.converter, t.ancestors
    heads, nn, Conv1D, fp4, model_config = mf.heads, mf.nn, mf.Conv1D, mf.fp4, mf.model_config

    def kept(why: str) -> Role:
        return Role(KEPT, path, cname, why)

    if leaf.endswith("bias") or leaf in ("e_score_correction_bias",):
        return kept(f"bias of {cname}")
    if path in heads:
        return kept(f"output projection ({cname} {path}: kept like the embeddings it is often tied to)")
    outside = mf.parts.outside(path)
    if outside is not None:
        return kept(outside)
    if isinstance(mod, nn.Embedding) or "Embedding" in cname:
        return kept(f"embedding ({cname})")
    if isinstance(mod, Conv1D):
        if leaf != "weight" or len(info.shape) != 2 or axes != [0, 1]:
            return kept(f"{leaf} of Conv1D")
        # GPT-2 style: x @ W with W [in, out]. Quantized along its input axis (axis 0 on disk) and written
        # [out, in], the layout vLLM's GPT-2 loader reads for weight_packed (it transposes only ``.weight``).
        # transformers dequantizes into the parameter as stored ([in, out], blocks along out): it cannot load
        # any FP4 form of a Conv1D blocked along its input axis, so this output is for vLLM (the run says so).
        why = fp4.route(_disk_module(name), (info.shape[1], info.shape[0])) if fp4 is not None else ""
        return Role(LINEAR, path, cname, input_axis=0, tf_fp4=why)
    if isinstance(mod, nn.modules.conv._ConvNd):
        return kept(f"convolution ({cname})")
    if "Norm" in cname or "norm" in leaf.lower() or isinstance(mod, (nn.LayerNorm, nn.GroupNorm)):
        return kept(f"normalization ({cname})")
    router = next((c for _, c in reversed(ancestors) if _ROUTER_CLASS_RX.search(c)), None)
    if router is None and not isinstance(mod, nn.Linear) and _GATE_CLASS_RX.search(cname) and param.dim() == 2:
        router = cname
    if router is None:  # a module named like a router (HunYuan's ``mlp.gate`` holds its Linear ``wg``)
        router = next((f"{c} {a.rpartition('.')[2]}" for a, c in reversed(ancestors)
                       if a.rpartition(".")[2] in _ROUTER_LEAVES), None)
    if router is not None:
        return kept(f"MoE router ({router})")
    if path in mf.routers:  # by role: its output feeds a routing decision (Gemma 3n's altup.modality_router)
        return kept(f"router ({cname} {path}; {mf.routers[path]})")
    # a projector class in a model without a language model beside other parts (with one, what lies outside it
    # was decided above, and Phi4MultimodalDecoderLayer is inside it)
    projector = next((c for _, c in ancestors if _PROJECTOR_RX.search(c)), None) \
        if mf.parts.language_model is None else None
    if projector is not None:
        return kept(f"multimodal projector/embedder ({projector}: engines build it unquantized)")
    if axes is None:
        return kept(f"{leaf} of {cname}: loaded through a transformers conversion this planner does not model")
    if isinstance(mod, nn.Linear) and leaf == "weight" and param.dim() == 2:
        disk_in = axes[1]
        if not isinstance(disk_in, int) or len(info.shape) != 2:
            return kept(f"{leaf} of {cname}: its input axis on disk is not known")
        if disk_in != 1:
            return kept(f"{cname} weight stored [in, out] on disk: quantizing it would block the wrong axis")
        why = fp4.route(_disk_module(name), tuple(info.shape)) if fp4 is not None else ""
        if why:  # an nn.Linear both consumers load as bf16, but transformers not as FP4 under this name
            return replace(kept(f"{cname} weight that transformers cannot load in FP4 ({why}); kept so that both "
                                "transformers and vLLM load it"), tf_fp4=why)
        return Role(LINEAR, path, cname, input_axis=1)
    proj = _EXPERT_PARAMS.get(leaf)
    stated = hasattr(mod, "is_transposed")
    swapped = fp4.expert_linears(path) if fp4 is not None and proj is not None and param.dim() == 3 else None
    if proj is not None and (stated or swapped is not None) and param.dim() == 3:
        split = None
        if stated:
            t_in = 1 if mod.is_transposed else 2
            disk_in = axes[t_in]
            if proj == "gate_up" and getattr(mod, "has_gate", True):
                split = "concatenated" if getattr(mod, "is_concatenated", True) else "interleaved"
            names = None
        else:  # transformers swaps the stack for per-expert Linears to load a quantized checkpoint (Llama 4)
            assert swapped is not None  # not stated: the condition above holds through the swap
            names, lins = swapped
            disk_in = _swapped_input_axis(proj, tuple(info.shape), lins)
            if disk_in is None:
                return kept(f"{leaf} of {cname}: its shape matches no orientation of the per-expert Linears "
                            "transformers loads a quantized checkpoint into")
            if proj == "gate_up":
                split = _family_split(model_config)
                if split is None:
                    return kept(f"{leaf} of {cname}: how gate and up are packed is stated neither by the class "
                                "nor by the family table")
        if "E" in axes:  # one expert's 2-D weight, merged into the stack at load
            if len(info.shape) != 2 or disk_in != 1:
                return kept(f"one expert's {leaf} of {cname} with its input axis not last on disk")
            group = None
            if converter is not None and len(converter.source_patterns) > 1:
                m = re.search(r"(^|\.)experts\.(\d+)\.", name)
                if m:
                    members = ",".join(p.rpartition("*.")[2].removesuffix(".weight") for p in converter.source_patterns)
                    group = f"{name[:m.end() - 1]}.{{{members}}}"
            why = fp4.route(_disk_module(name), tuple(info.shape)) if fp4 is not None else ""
            return Role(LINEAR, path, cname, input_axis=1, group=group, tf_fp4=why)
        if len(info.shape) != 3 or axes[0] != 0 or disk_in not in (1, 2):
            return kept(f"{leaf} of {cname}: the expert axis or input axis on disk is not known")
        from fp4convert.plan import families as arch

        if arch.quantized_experts_unread(model_config):  # kept, with its layout (per-expert names for ignore)
            return Role(KEPT, path, cname, f"{leaf} of {cname}: {arch.quantized_experts_unread(model_config)}",
                        input_axis=disk_in, transpose=disk_in == 1, split=split, proj=proj, names=names)
        why = ""
        if fp4 is not None:
            gate, up, down = names or arch.expert_names(model_config)
            e, a, b = info.shape
            n, k = (b, a) if disk_in == 1 else (a, b)
            probe = {"gate_up": (gate, n // 2), "up": (up, n), "down": (down, n)}[proj]
            why = fp4.route(f"{path}.0.{probe[0]}", (probe[1], k))
        return Role(EXPERTS, path, cname, input_axis=disk_in, transpose=disk_in == 1, split=split, proj=proj,
                    names=names, tf_fp4=why)
    if param.dim() in (2, 3):
        return kept(f"{leaf} of {cname} ({param.dim()}-D parameter of a custom module: its matmul layout is not "
                    "stated by the definition)")
    return kept(f"{leaf} of {cname} ({param.dim()}-D)")


def _disk_module(name: str) -> str:
    """The module an on-disk weight's FP4 tensors are written under (the plan's rule: the name less ``.weight``)."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _swapped_input_axis(proj: str, shape: tuple[int, ...], lins) -> int | None:
    """The input axis of a 3-D stack ``[E, a, b]`` on disk, from the per-expert Linears it loads into
    (gate, up, down): the axis of size ``in_features`` whose other axis is the right ``out_features``
    (gate/up: twice a half); None when the shapes leave it open (a square stack)."""
    if len(shape) != 3:
        return None
    gate, _, down = lins
    lin = down if proj == "down" else gate
    out = lin.out_features * (2 if proj == "gate_up" else 1)
    fits = [ax for ax in (1, 2) if shape[ax] == lin.in_features and shape[3 - ax] == out]
    return fits[0] if len(fits) == 1 else None


def _family_split(model_config: dict | None) -> str | None:
    """How gate and up are packed in a stack whose class does not say (the family table)."""
    from fp4convert.plan import families as arch

    return arch.gate_up_packing(model_config)


if __name__ == "__main__":
    _child_main()
