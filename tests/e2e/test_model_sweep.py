"""The architecture sweep: every model_type of the installed transformers, converted and checked.

Each case builds a tiny random checkpoint of one architecture (tests/tiny_configs.py: the config
class's defaults shrunk, ``save_pretrained`` in bf16, so the names on disk are the checkpoint names
users download), converts it with ``convert(..., ConvertConfig(device="cpu",
format="compressed-tensors"))`` and checks the result against the model transformers itself loads
from the bf16 source:

a. every quantized matrix is a matmul weight quantized along its input axis: its loaded module is an
   ``nn.Linear`` whose ``weight`` has the on-disk ``[out, in]`` shape (so the blocks run along
   ``in``), a GPT-2 ``Conv1D`` (``[in, out]`` on disk) written as its transpose, or a transformers
   experts module (``is_transposed``) whose parameter's input size is the matrix's ``K``; the module
   is found with transformers' own key conversion, and ``modeldef``'s mapping must agree with it;
   A disk tensor that transformers chunks into several Linears at load (a fused ``qkv_proj``) must be
   blocked along their common input axis;
b. no embedding, convolution, norm, router or position table is quantized;
c. at least 95% of the loaded model's linear parameters (``nn.Linear`` and ``Conv1D`` weights, 3-D
   expert stacks) are quantized, outside the documented keep rules (docs/formats.md: the output head,
   what lies outside a multimodal model's language model, multimodal projectors, routers, in-features
   that are not a multiple of the block size);
e. a model with a language model beside other parts (VLMs, audio LMs, omni models, Whisper): the
   language model the plan names contains the decoder transformers exposes (``get_decoder()``); no
   quantized weight lies outside it (every module built from a vision/audio/... sub-config, every
   encoder ``get_encoder()`` returns for another modality, every connector stays unquantized) unless in
   a text sub-model of its own; every linear inside it is quantized or kept by a documented rule (c);
   routers (a Linear whose output its holder's forward feeds to a top-k/softmax, ``modelparts.
   routing_linears``) are never quantized;
d. transformers loads the output (compressed-tensors, ``dequantize=True``) with no missing,
   unexpected or mismatched keys beyond those of loading the bf16 source the same way.

Architectures whose tiny config cannot be built (a sub-config with no model class of its own, a
missing optional library, a config whose defaults its own validators refuse once shrunk, ...) are
skipped with the reason. A fast default subset of diverse families runs in every ``pytest`` run;
the long tail is marked ``slow`` and runs when selected (``pytest -m slow tests/e2e/test_model_sweep.py``)
or with ``FP4CONVERT_SWEEP=all``. ``python tests/e2e/test_model_sweep.py`` runs every architecture and
writes benchmarks/results/model_sweep.json (counts and per-type outcomes).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

try:
    from tests import tiny_configs  # noqa: E402
except ImportError:  # run as a script: this checkout's fp4convert, not an installed one
    sys.path[:0] = [str(Path(__file__).parents[2]), str(Path(__file__).parents[1])]
    import tiny_configs  # type: ignore[no-redef]  # noqa: E402

from tests.checkpoints import definitions_in_process  # noqa: E402

BLOCK = 16  # NVFP4, the default scheme
SHARE = 0.95

# Diverse families run by default: dense decoders, GPT-2 Conv1D, tied heads, MoE (per-expert and
# stacked, MLA), encoders, encoder-decoders, speech, vision-language.
FAST = ("llama", "gpt2", "gpt_neox", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "granitemoe",
        "bert", "t5", "bart", "whisper", "gemma3", "qwen2_vl", "llava", "phi3")

# Architectures that fail an assertion (known findings not fixed yet): strict xfail with the reason, so the
# suite stays green and a fix shows up as an XPASS to remove here. None today: every architecture the sweep
# builds passes (docs/formats.md "Which tensors are quantized" says which keep rules and transformers limits apply).
XFAIL: dict[str, str] = {}

_TOWER_RX = re.compile(r"vision|visual|audio|speech|image|video|siglip|clip|patch_embed", re.I)
_PROJECTOR_RX = re.compile(r"multi_?modal|projector|embedder|merger|connector|adapter|resampler|mm_", re.I)
_ROUTER_LEAVES = {"gate", "router", "shared_expert_gate", "gating", "moe_gate", "expert_gate"}


def _root() -> Path:
    root = os.environ.get("FP4CONVERT_SWEEP_DIR")
    if root:
        return Path(root)
    import tempfile

    return Path(tempfile.mkdtemp(prefix="fp4c_sweep_"))


def _headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from every safetensors file's header."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            hdr = json.loads(fh.read(n))
        out.update({k: (v["dtype"], v["shape"]) for k, v in hdr.items() if k != "__metadata__"})
    return out


def _load(cls, path: Path, **kw):
    return cls.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True, **kw)


def _ancestors(name: str, modules: dict) -> list[tuple[str, nn.Module]]:
    parts = name.split(".")
    return [(p, modules[p]) for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in modules]


def _tower_like(path: str, mod: nn.Module, base: str) -> bool:
    """A vision/audio tower by its class or its name; the base model never is (Higgs-Audio-V2's language
    model is a HiggsAudioV2Model)."""
    return path != base and bool(_TOWER_RX.search(type(mod).__name__) or _TOWER_RX.search(path.rpartition(".")[2]))


def _in_tower(name: str, modules: dict, base: str = "") -> bool:
    return any(_tower_like(p, m, base) for p, m in _ancestors(name, modules))


def _kept_by_rule(name: str, mod: nn.Module, modules: dict, heads: set[int], in_size: int,
                  towers: bool = True, base: str = "") -> str | None:
    """The documented keep rule a linear falls under (None: it should be quantized). ``towers``: whether the
    model has a language model beside its vision/audio towers (else the tower rule does not apply)."""
    if id(mod) in heads:
        return "output head"
    for path, m in _ancestors(name, modules):
        leaf = path.rpartition(".")[2]
        cname = type(m).__name__
        if towers and _tower_like(path, m, base):
            return "vision/audio tower"
        if _PROJECTOR_RX.search(cname) or _PROJECTOR_RX.search(leaf):
            return "multimodal projector"
        if "Router" in cname or "Gate" in cname:
            return "router"
    if _is_router(name, mod, modules):
        return "router"
    if in_size % BLOCK:
        return f"in-features {in_size} not a multiple of {BLOCK}"
    return None


def _is_router(name: str, mod: nn.Module, modules: dict) -> bool:
    """A MoE router: a module (or one inside a module) whose class or name says it routes tokens."""
    for path, m in _ancestors(name, modules):
        cname, leaf = type(m).__name__, path.rpartition(".")[2]
        if any(w in cname for w in ("Router", "TopK")) or "router" in leaf.lower() or leaf in _ROUTER_LEAVES:
            return True
    return False


def _split_targets(target: str, pattern: str | None, converters: list, params: dict) -> list[str]:
    """The parameters one disk tensor is split into at load (a converter with one source and several
    targets, e.g. a fused ``qkv_proj`` chunked into ``q_proj``/``k_proj``/``v_proj``); [] otherwise."""
    conv = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
    if conv is None or len(conv.source_patterns) != 1 or len(conv.target_patterns) < 2:
        return []
    first = next((t for t in conv.target_patterns if t in target), None)
    if first is None:
        return []
    return [target.replace(first, t) for t in conv.target_patterns if target.replace(first, t) in params]


def _merged(pattern: str | None, converters: list) -> bool:
    """Whether a disk tensor is one of several a converter joins into one parameter (a dense merge)."""
    conv = next((c for c in converters if pattern is not None and pattern in c.source_patterns), None)
    return conv is not None and len(conv.source_patterns) > 1 and len(conv.target_patterns) == 1 \
        and type(conv.operations[0]).__name__ == "Concatenate"


def _forbidden(mod: nn.Module, name: str, modules: dict) -> str | None:
    """Why module ``mod`` must never be quantized (assertion b), or None."""
    cname = type(mod).__name__
    if isinstance(mod, nn.Embedding) or "Embedding" in cname:
        return f"embedding ({cname})"
    if isinstance(mod, nn.modules.conv._ConvNd):
        return f"convolution ({cname})"
    if "Norm" in cname or isinstance(mod, (nn.LayerNorm, nn.GroupNorm)):
        return f"norm ({cname})"
    if _is_router(name, mod, modules):
        return f"router ({cname})"
    if re.search(r"position|relative_attention_bias|rel_pos", name, re.I) and not isinstance(mod, nn.Linear):
        return f"position table ({cname})"
    return None


_CT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_global_scale", ".weight_zero_point", ".weight_shape",
                ".weight")


def _module_key(key: str) -> str:
    """The module of a checkpoint key (the key less its weight or compressed-tensors suffix)."""
    return next((key[: -len(s)] for s in _CT_SUFFIXES if key.endswith(s)), key)


class _CtLoader:
    """transformers' own compressed-tensors loading (``CompressedTensorsConfig(dequantize=True)``) of ``cls``:
    the model its quantizer builds (``_convert_model_for_quantization``: Llama 4's experts become per-expert
    Linears) and the key conversions it loads with (``update_weight_conversions``: the dequantize operation
    in front of the model's ``.weight`` converters, then its general converter ``<module>.weight_packed`` ...
    -> ``<module>.weight``)."""

    def __init__(self, cls, model, qc: dict) -> None:
        from transformers import CompressedTensorsConfig
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
        from transformers.quantizers import AutoHfQuantizer

        q = AutoHfQuantizer.from_config(CompressedTensorsConfig.from_dict({**qc, "dequantize": True}),
                                        pre_quantized=True)
        q.validate_environment()
        self.dequant = q.get_load_operations()["dequantize"]
        self.serialized = set(q.serialized_names["weight"])
        from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION

        self.swapped = any(type(m).__name__ in MODULES_TO_PATCH_FOR_QUANTIZATION for m in model.modules())
        self.model = model  # the loaded bf16 model, unless the quantizer swaps modules: then a meta copy, swapped
        if self.swapped:
            with torch.device("meta"):
                self.model = cls(copy.deepcopy(model.config))
            q._convert_model_for_quantization(self.model)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.modules = dict(self.model.named_modules(remove_duplicate=False))
        plain = get_model_conversion_mapping(self.model)
        self.plain = ([c for c in plain if not isinstance(c, WeightConverter)],
                      [c for c in plain if isinstance(c, WeightConverter)])
        self.broken = ""
        try:
            conv = get_model_conversion_mapping(self.model, hf_quantizer=q)
        except ValueError as exc:  # its quantizer makes a converter WeightConverter refuses (many-to-many)
            self.broken = f"building the load's conversions raises {tiny_configs._first_line(exc)}"
            conv = plain
        self.renamings = [c for c in conv if not isinstance(c, WeightConverter)]
        self.converters = [c for c in conv if isinstance(c, WeightConverter)]

    def whole_unloadable(self, out_keys) -> str:
        """Why transformers loads no compressed-tensors checkpoint of this model with these keys ("" when it may):
        its conversions cannot be built, or an output key goes through a converter the dequantize operation
        precedes whose result cannot load: that operation keeps only the ``weight_packed`` keys it is given
        (integrations/compressed_tensors.py ``CompressedTensorsDequantize.convert``: an unquantized tensor is
        dropped and the conversion after it has nothing), and stacks FP4 ones per expert (a dense merge or
        split after it gets stacks, not rows)."""
        if self.broken:
            return self.broken
        for key in sorted(out_keys):
            _, conv = self._rename(key, fp4=True)
            ops = list(getattr(conv, "operations", ()))
            if conv is None or set(conv.source_patterns) == self.serialized or \
                    not any(isinstance(o, self.dequant) for o in ops):
                continue
            rest = [type(o).__name__ for o in ops if not isinstance(o, self.dequant)]
            if not key.endswith(_CT_SUFFIXES[:-1]):
                return f"{key} (unquantized) goes through a dequantizing converter, which drops it"
            if key.endswith(".weight_packed") and rest[:1] != ["MergeModulelist"]:
                return f"{key} goes through a dequantizing converter followed by {rest}, not a per-expert merge"
        return ""

    def _rename(self, key: str, fp4: bool = False) -> tuple[str, object]:
        from transformers.core_model_loading import rename_source_key

        ren, cvt = (self.renamings, self.converters) if fp4 else self.plain
        target, pattern = rename_source_key(key, ren, cvt, self.model.base_model_prefix, self.params)
        return target, next((c for c in cvt if pattern is not None and pattern in c.source_patterns), None)

    def linear(self, out_module: str) -> nn.Module | None:
        """The nn.Linear (of the swapped model) an output module loads into, when modules were swapped."""
        if not self.swapped:
            return None
        target, _ = self._rename(f"{out_module}.weight")
        mod = self.modules.get(target.rpartition(".")[0])
        return mod if isinstance(mod, nn.Linear) and target.endswith(".weight") else None

    def _dequantizing_merges(self) -> list:
        return [c for c in self.converters if any(isinstance(o, self.dequant) for o in c.operations)
                and set(c.source_patterns) != self.serialized]

    def no_fp4_form(self, target: str, mod: nn.Module, p) -> str:
        """Why no FP4 form of parameter ``target`` can load in transformers ("" when one can). Its loader
        dequantizes only through (1) its general converter, whose compressed-tensors decompression reads one
        2-D ``[rows, cols]`` tensor with blocks along ``cols`` into the parameter as stored, and (2) the
        model's own converters of ``.weight`` keys, which the dequantize operation precedes (per-expert merges)."""
        if self.broken or any(target.endswith(t) for c in self._dequantizing_merges() for t in c.target_patterns):
            return ""
        from transformers.pytorch_utils import Conv1D

        if isinstance(mod, Conv1D):
            return "Conv1D holds [in, out]: a dequantized tensor fills it as stored, blocks along the output axis"
        if p.dim() != 2:
            return f"{p.dim()}-D parameter: compressed-tensors decompresses 2-D tensors, and no per-expert merge targets it"
        return ""

    def kept_rule(self, pname: str, mod: nn.Module, p, disk_key: str | None, cfg: dict) -> str | None:
        """The keep rules that depend on transformers' loader (docs/formats.md "Which tensors are quantized")."""
        from fp4convert.plan import families as arch

        if self.broken:
            return None
        if isinstance(mod, nn.Linear) and disk_key is not None:  # written as <disk name less .weight>.weight_packed
            module = disk_key[: -len(".weight")] if disk_key.endswith(".weight") else disk_key
            target, conv = self._rename(f"{module}.weight_packed", fp4=True)
            ops = list(getattr(conv, "operations", ()))
            rest = [type(o).__name__ for o in ops if not isinstance(o, self.dequant)]
            if target != pname or not any(isinstance(o, self.dequant) for o in ops) or rest[:1] not in ([], ["MergeModulelist"]):
                return "transformers cannot load it in FP4 under its checkpoint name"
        if p.dim() == 3 and self.no_fp4_form(pname, mod, p):
            if not hasattr(mod, "is_transposed"):
                return "custom expert module: no stated layout, no FP4 load path"
            if arch.quantized_experts_unread(cfg):
                return "experts no consumer loads in FP4"
        return None


def _ct_loader(cls, model, qc: dict) -> _CtLoader:
    return _CtLoader(cls, model, qc)


def check(model_type: str, root: Path) -> dict:
    """Build, convert and check one architecture; the record says what happened (never raises)."""
    t0 = time.perf_counter()
    rec: dict = {"model_type": model_type, "status": "", "failures": {}}
    built = tiny_configs.build(model_type, root / "build")
    rec.update(model_class=built.model_class, kind=built.kind, build_s=built.seconds)
    if not built.ok:
        rec.update(status="skipped", reason=f"tiny config not buildable: {built.error}")
        return rec
    try:
        return _check(built, root, rec, t0)
    except _Skip as exc:
        rec.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - an error while checking is a failure, recorded with its message
        rec["failures"].setdefault("error while checking", []).append(tiny_configs._first_line(exc))
        rec.update(status="failed")
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    return rec


class _Skip(Exception):
    pass


def _check(built, root: Path, rec: dict, t0: float) -> dict:
    from transformers import CompressedTensorsConfig, PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key
    from transformers.pytorch_utils import Conv1D

    from fp4convert.plan import definition as modeldef
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert, plan_conversion
    from fp4convert.plan.types import QUANTIZE

    src = Path(built.path)
    cfg_json = json.loads((src / "config.json").read_text())
    cls = getattr(transformers, (cfg_json.get("architectures") or [built.model_class])[0])
    try:
        model, src_info = _load(cls, src)
    except Exception as exc:  # noqa: BLE001 - transformers cannot load its own save: not ours to test
        raise _Skip(f"transformers cannot load the bf16 source it saved: {tiny_configs._first_line(exc)}") from exc
    failures: dict[str, list[str]] = rec["failures"]

    def fail(what: str, item: str) -> None:
        failures.setdefault(what, []).append(item)

    dst = root / "out" / built.model_type
    config = ConvertConfig(device="cpu", format="compressed-tensors", overwrite=True)
    try:
        planned = plan_conversion(src, config)
        convert(src, dst, config, plan=planned)
    except Exception as exc:  # noqa: BLE001 - a refusal is a finding, recorded with its message
        fail("convert", tiny_configs._first_line(exc))
        rec.update(status="failed", seconds=round(time.perf_counter() - t0, 2))
        return rec
    _, plan, _ = planned
    out = _headers(dst)
    src_hdr = _headers(src)
    quantized = {k[: -len(".weight_packed")]: v[1] for k, v in out.items() if k.endswith(".weight_packed")}
    matrices = {m.module: (d.name, m) for d in plan.decisions if d.action == QUANTIZE for m in d.matrices}
    if set(quantized) != set(matrices):
        fail("a: output FP4 modules differ from the plan's", str(sorted(set(quantized) ^ set(matrices))[:5]))

    infos = [d.info for d in plan.decisions]
    try:
        definition = modeldef.load(cfg_json, infos)
    except modeldef.Unknown as exc:  # transformers knows this architecture: the planner should too
        fail("a: no model definition for an architecture transformers loads (planned by name rules)", str(exc))
        definition = None
    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    conv = get_model_conversion_mapping(model)
    renamings = [c for c in conv if not isinstance(c, WeightConverter)]
    converters = [c for c in conv if isinstance(c, WeightConverter)]
    ct = _ct_loader(cls, model, json.loads((dst / "config.json").read_text()).get("quantization_config") or {})

    q_params: dict[str, int] = {}  # loaded parameter -> quantized elements
    unloadable: dict[str, str] = {}  # source tensor -> why transformers cannot load any FP4 form of its parameter
    for mod_out, (src_name, m) in sorted(matrices.items()):
        if mod_out not in quantized:
            continue
        n, k = quantized[mod_out][0], quantized[mod_out][1] * 2
        target, pattern = rename_source_key(src_name, renamings, converters, model.base_model_prefix, params)
        module = target.rpartition(".")[0]
        split = _split_targets(target, pattern, converters, params)
        swapped = ct.linear(mod_out)  # a per-expert Linear the compressed-tensors load swaps in (Llama 4's experts)
        if swapped is not None and (target not in params or params[target].dim() == 3):
            if tuple(swapped.weight.shape) != (n, k):
                fail("a: expert matrix not the [out, in] of the Linear transformers loads it into",
                     f"{mod_out} from {src_name}: [N, K]=[{n}, {k}], Linear {list(swapped.weight.shape)}")
            q_params[f"{mod_out}.weight"] = n * k
            continue
        if target not in params or module not in modules:
            fail("a: quantized tensor not a parameter of the loaded model", f"{src_name} -> {target}")
            continue
        role = definition.role(src_name) if definition is not None else None
        if definition is not None and (role is None or role.module != module):
            fail("a: modeldef maps it to another module than transformers' key conversion",
                 f"{src_name}: {role.module if role else None} vs {target}")
        lm = modules[module]
        why = _forbidden(lm, module, modules)
        if why:
            fail("b: quantized a module that must stay unquantized", f"{src_name} ({why})")
            continue
        p = params[target]
        disk = tuple(src_hdr[src_name][1])
        no_fp4 = ct.no_fp4_form(target, lm, p)
        if no_fp4:
            unloadable[src_name] = no_fp4
        if isinstance(lm, nn.Linear) and split:  # one disk tensor chunked into several Linears at load
            outs = [params[t].shape[0] for t in split]
            if any(params[t].dim() != 2 or params[t].shape[1] != disk[1] for t in split) or sum(outs) != disk[0] \
                    or k != disk[1]:
                fail("a: fused Linear weight not quantized along its input axis",
                     f"{src_name}: [N, K]=[{n}, {k}] of {list(disk)}, loaded as {split}")
            for t in split:
                q_params[t] = q_params.get(t, 0) + params[t].numel() * n // disk[0]
        elif isinstance(lm, nn.Linear) and _merged(pattern, converters) and tuple(lm.weight.shape) != disk:
            # one of several disk tensors concatenated into one Linear at load (rows of its [out, in])
            if target.rpartition(".")[2] != "weight" or p.shape[1] != disk[1] or disk[0] > p.shape[0] \
                    or (n, k) != disk:
                fail("a: merged Linear part not quantized along its input axis",
                     f"{src_name}: [N, K]=[{n}, {k}] of {list(disk)}, loaded into {target} {list(p.shape)}")
            q_params[target] = q_params.get(target, 0) + n * k
        elif isinstance(lm, nn.Linear):
            if target.rpartition(".")[2] != "weight" or tuple(lm.weight.shape) != disk:
                fail("a: Linear weight shape differs from the on-disk [out, in]",
                     f"{src_name}: disk {list(disk)}, loaded {list(lm.weight.shape)}")
            elif k != disk[1] or (m.rows is None and n != disk[0]) or n > disk[0]:
                fail("a: not quantized along the Linear's input axis", f"{src_name}: [N, K]=[{n}, {k}] of {list(disk)}")
            q_params[target] = q_params.get(target, 0) + n * k
        elif isinstance(lm, Conv1D):  # GPT-2 style, [in, out] on disk: [N, K] must be its transpose
            if target.rpartition(".")[2] != "weight" or tuple(lm.weight.shape) != disk or (n, k) != disk[::-1]:
                fail("a: Conv1D not quantized along its input axis (its weight is [in, out])",
                     f"{src_name}: [N, K]=[{n}, {k}] of {list(disk)}")
            q_params[target] = q_params.get(target, 0) + n * k
        elif hasattr(lm, "is_transposed") and p.dim() == 3:
            k_in, n_out = (p.shape[1], p.shape[2]) if lm.is_transposed else (p.shape[2], p.shape[1])
            if k != k_in or n not in (n_out, n_out // 2):
                fail("a: expert matrix not blocked along the expert's input axis",
                     f"{mod_out} from {src_name}: [N, K]=[{n}, {k}], {target} {list(p.shape)} "
                     f"is_transposed={lm.is_transposed}")
            q_params[target] = q_params.get(target, 0) + n * k
        else:
            fail("a: quantized tensor is neither an nn.Linear weight nor an experts stack",
                 f"{src_name} ({type(lm).__name__}.{target.rpartition('.')[2]} {list(p.shape)})")

    # c. share of linear parameters quantized, outside the documented keep rules, in the model transformers
    # builds to load the output (Llama 4's experts are per-expert Linears there)
    on_disk: dict[str, str] = {}  # loaded parameter -> the disk tensor it loads from
    for key in src_hdr:
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, params)
        for t in [target, *_split_targets(target, pattern, converters, params)]:
            on_disk.setdefault(t, key)
    c_model = ct.model if ct.swapped else model
    c_modules = dict(c_model.named_modules(remove_duplicate=False))
    c_params = dict(c_model.named_parameters(remove_duplicate=False))
    heads = set()
    embeddings = {id(m.weight) for m in c_modules.values() if isinstance(m, nn.Embedding)}
    for m in c_modules.values():
        if isinstance(m, PreTrainedModel):
            try:
                head = m.get_output_embeddings()
            except Exception:  # noqa: BLE001 - models without a head may raise
                head = None
            if head is not None:
                heads.add(id(head))
        if isinstance(m, nn.Linear) and id(m.weight) in embeddings:  # tied to an embedding: the output head
            heads.add(id(m))
    cands = []  # (parameter name, parameter, its module's name and module, input size)
    for name, mod in c_modules.items():
        if isinstance(mod, nn.Linear):
            cands += [(f"{name}.weight", mod.weight, name, mod, mod.in_features)]
        elif isinstance(mod, Conv1D):
            cands += [(f"{name}.weight", mod.weight, name, mod, mod.weight.shape[0])]
        elif hasattr(mod, "is_transposed") or type(mod).__name__.endswith("Experts"):
            tr = getattr(mod, "is_transposed", False)
            cands += [(f"{name}.{pn}", p, name, mod, p.shape[1] if tr else p.shape[2])
                      for pn, p in mod.named_parameters(recurse=False) if p.dim() == 3]
    # A weight tied to another (GraniteSpeech5's ctc_head is its encoder's ``out``) counts once, under the
    # name its tensor has on disk.
    cands.sort(key=lambda c: c[0] not in on_disk)
    seen_ids: set[int] = set()
    unique = []
    for c in cands:
        if c[0] in c_params and id(c[1]) not in seen_ids:
            seen_ids.add(id(c[1]))
            unique.append(c)
    # A multimodal model's language model is quantized, the rest kept (docs/formats.md); a model with no language
    # model beside other parts (an encoder, a dual encoder, a CTC speech model) is quantized whole.
    base = c_model.base_model_prefix
    lm_root = definition.language_model if definition is not None else None
    by_disk = plan.by_name
    missing_in_source = set(map(str, src_info.get("missing_keys") or ()))
    eligible: dict[str, int] = {}
    kept_by_rule: dict[str, int] = {}
    for pname, p, name, mod, in_size in unique:
        if pname in missing_in_source:  # transformers does not load it from the bf16 source either
            continue
        disk = by_disk.get(on_disk.get(pname, ""))
        outside = lm_root is not None and disk is not None and "outside the language model" in disk.reason
        rule = ("outside the language model" if outside else None) \
            or _kept_by_rule(name, mod, c_modules, heads, int(in_size), False, base) \
            or ct.kept_rule(pname, mod, p, on_disk.get(pname), cfg_json)
        (kept_by_rule if rule else eligible)[pname] = p.numel()
    total = sum(eligible.values())
    done = sum(min(q_params.get(n, 0), v) for n, v in eligible.items())
    share = done / total if total else 1.0
    rec.update(linear_params=total, quantized_params=done, share=round(share, 4),
               kept_by_rule_params=sum(kept_by_rule.values()))
    if share < SHARE:
        missing = sorted((v, n) for n, v in eligible.items() if q_params.get(n, 0) < v)[::-1]
        fail(f"c: {share:.1%} of linear parameters quantized (< {SHARE:.0%})",
             ", ".join(n for _, n in missing[:8]))

    # e. the language model of a multimodal model, checked against transformers' own accessors
    _check_language_model(model, definition, lm_root, q_params, matrices, plan, fail, rec)

    # d. transformers loads the output with no more missing/unexpected/mismatched keys than the source, except
    # the parameters no FP4 form of which it can load (shown by ``_CtLoader.no_fp4_form`` from its loader);
    # the run must say so for each of those.
    excused_params = {rename_source_key(s, renamings, converters, model.base_model_prefix, params)[0]
                      for s in unloadable}
    excused_modules = {mod for mod, (s, _) in matrices.items() if s in unloadable}
    excused_modules |= {_module_key(rename_source_key(f"{mod}.weight", renamings, converters, model.base_model_prefix,
                                                      params)[0]) for mod in excused_modules}
    rec["transformers_cannot_load"] = sorted(unloadable)
    whole = ct.whole_unloadable(out)
    if whole:  # no compressed-tensors checkpoint of this model loads in transformers: the run must say so, and
        # the output must indeed not load (else the reason above is wrong)
        rec["transformers_cannot_load_model"] = whole
        if not any(w.startswith("transformers cannot load this compressed-tensors output at all") for w in plan.warnings):
            fail("d: transformers cannot load any compressed-tensors checkpoint of it, and the run does not say so",
                 whole)
        try:
            _, q_info = _load(cls, dst, quantization_config=CompressedTensorsConfig(dequantize=True))
        except Exception:  # noqa: BLE001 - the expected outcome
            pass
        else:
            extra = {k for key in ("missing_keys", "unexpected_keys", "mismatched_keys")
                     for k in set(map(str, q_info.get(key) or ())) - set(map(str, src_info.get(key) or ()))}
            if not extra:
                fail("d: shown unloadable in transformers, yet it loads", whole)
        rec.update(status="failed" if failures else "passed", quantized=len(quantized),
                   seconds=round(time.perf_counter() - t0, 2))
        return rec
    if unloadable:
        know = plan.knowledge
        silent = [s for s in unloadable if know is None or not know.transformers_cannot_load(s)]
        if silent or not any(w.startswith(f"transformers cannot load {len(unloadable)} quantized") for w in plan.warnings):
            fail("d: quantized tensors transformers cannot load, not named in the run's warning",
                 ", ".join(silent[:8] or sorted(unloadable)[:8]))
    try:
        _, q_info = _load(cls, dst, quantization_config=CompressedTensorsConfig(dequantize=True),
                          ignore_mismatched_sizes=bool(unloadable))
    except Exception as exc:  # noqa: BLE001 - a refusal to load is the finding
        fail("d: transformers cannot load the output", tiny_configs._first_line(exc))
    else:
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            got = {(x[0] if isinstance(x, tuple) else x) for x in (q_info.get(key) or ())}
            base = {(x[0] if isinstance(x, tuple) else x) for x in (src_info.get(key) or ())}
            extra = sorted(str(x) for x in got - base
                           if not (str(x) in excused_params or _module_key(str(x)) in excused_modules))
            if extra:
                fail(f"d: {key} loading the output", ", ".join(extra[:8]))
    rec.update(status="failed" if failures else "passed", quantized=len(quantized),
               seconds=round(time.perf_counter() - t0, 2))
    return rec


def _under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def _other_modality_modules(model) -> dict[str, str]:
    """path -> sub-config key of every module built from a sub-config of another modality (its ``config`` is
    ``config.<key>`` for a key naming vision/audio/image/video/speech), and the encoders transformers'
    ``get_encoder(modality)`` returns."""
    from transformers import PretrainedConfig

    top = model.config
    keys = {id(getattr(top, k)): k for k in (getattr(top, "sub_configs", None) or {})
            if re.search(r"vision|visual|audio|image|video|speech", k) and isinstance(getattr(top, k, None),
                                                                                         PretrainedConfig)}
    out = {p: keys[id(m.config)] for p, m in model.named_modules()
           if p and isinstance(getattr(m, "config", None), PretrainedConfig) and id(m.config) in keys}
    inv = {id(m): p for p, m in model.named_modules()}
    for modality in ("image", "audio"):
        try:
            enc = model.get_encoder(modality=modality)
        except Exception:  # noqa: BLE001
            continue
        if enc is not model and enc is not getattr(model, "base_model", None) and inv.get(id(enc)):
            out.setdefault(inv[id(enc)], f"get_encoder({modality!r})")
    return out


def _check_language_model(model, definition, lm_root, q_params: dict, matrices: dict, plan, fail, rec: dict) -> None:
    """Assertion e (see the module docstring)."""
    from fp4convert.plan import parts as modelparts

    modules = dict(model.named_modules(remove_duplicate=False))
    routers = modelparts.routing_linears(modules)
    role = definition.role if definition is not None else (lambda _n: None)
    for mod_out, (src_name, _m) in matrices.items():
        r = role(src_name)
        if r is not None and r.module in routers:
            fail("e: a router (its output feeds a routing decision) is quantized", f"{src_name}: {routers[r.module]}")
    rec["language_model"] = lm_root
    if lm_root is None:
        return
    if lm_root and lm_root not in modules:
        fail("e: the language model is not a module of the model", lm_root)
        return
    inv = {id(m): p for p, m in modules.items()}
    try:
        dec = inv.get(id(model.get_decoder()))
    except Exception:  # noqa: BLE001
        dec = None
    if dec is not None and not _under(dec, lm_root):
        fail("e: the language model does not contain transformers' get_decoder()", f"{lm_root} vs {dec}")
    others = {p: k for p, k in _other_modality_modules(model).items() if not _under(lm_root, p)}
    text_subs = [p for p, m in modules.items() if p and modelparts._token_input(m) and not _under(p, lm_root)
                 and not any(_under(p, o) for o in others)]
    for p in q_params:
        path = p.rpartition(".")[0]
        other = next((o for o in others if _under(path, o)), None)
        if other is not None:
            fail("e: quantized inside a part of another modality", f"{p} in {other} ({others[other]})")
        elif not _under(path, lm_root) and not any(_under(path, t) for t in text_subs):
            fail("e: quantized outside the language model", f"{p} (language model {lm_root or '(the model)'})")
    for d in plan.decisions:
        if d.action == "keep" and "outside the language model" in d.reason and role(d.name) is not None \
                and role(d.name).module_class != "-" and role(d.name).module_class not in d.reason:
            fail("e: a module kept outside the language model without its class in the reason", d.name)


# --- pytest ------------------------------------------------------------------------------------------


def _cases() -> list:
    out = []
    for mt in tiny_configs.model_types():
        marks = [] if mt in FAST else [pytest.mark.slow]
        if mt in XFAIL:
            marks.append(pytest.mark.xfail(reason=XFAIL[mt], strict=True))
        out.append(pytest.param(mt, marks=marks, id=mt))
    return out


@pytest.fixture(scope="module")
def sweep_root(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        definitions_in_process(mp)
        yield tmp_path_factory.mktemp("sweep")


def _long_tail_selected(config) -> bool:
    expr = config.getoption("markexpr") or ""
    return os.environ.get("FP4CONVERT_SWEEP") == "all" or ("slow" in expr and "not slow" not in expr)


@pytest.mark.parametrize("model_type", _cases())
def test_architecture(model_type: str, sweep_root: Path, request) -> None:
    if model_type not in FAST and not _long_tail_selected(request.config):
        pytest.skip("long tail of the sweep: run with -m slow or FP4CONVERT_SWEEP=all")
    rec = check(model_type, sweep_root)
    if rec["status"] == "skipped":
        pytest.skip(rec["reason"])
    assert not rec["failures"], json.dumps(rec["failures"], indent=1)


def test_fast_subset_builds(sweep_root: Path) -> None:
    """The default subset is real: every family in it builds (a skipped case would hide a regression)."""
    for mt in FAST:
        o = tiny_configs.build(mt, sweep_root / "build")
        assert o.ok, (mt, o.error)


# --- python tests/e2e/test_model_sweep.py: every architecture, a summary and a JSON record --------------


def _run_workers(types: list[str], root: Path, jobs: int) -> list[dict]:
    """Check ``types`` in ``jobs`` worker processes; a worker that dies (a crash inside transformers or
    torch) is recorded as a failure of the type it was on and restarted on the rest of its share."""
    import subprocess
    import tempfile

    shares = [types[i::jobs] for i in range(jobs)]
    recs: list[dict] = []

    def start(share: list[str]):
        err = tempfile.TemporaryFile("w+")
        return subprocess.Popen([sys.executable, __file__, "--root", str(root), "--part", "1", *share],
                                stdout=subprocess.PIPE, stderr=err, text=True), err

    import threading

    def drive(share: list[str]) -> None:
        while share:
            proc, err = start(share)
            current = None
            for line in proc.stdout:
                msg = json.loads(line)
                if "start" in msg:
                    current = msg["start"]
                else:
                    recs.append(msg)
                    share.remove(msg["model_type"])
                    current = None
            code = proc.wait()
            if current is not None:
                err.seek(0)
                tail = err.read().strip().splitlines()[-1:] or [""]
                recs.append({"model_type": current, "status": "failed", "kind": "", "seconds": None,
                             "failures": {"worker process died": [f"exit {code}: {tail[0][:200]}"]}})
                share.remove(current)

    threads = [threading.Thread(target=drive, args=(sh,)) for sh in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return recs


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("types", nargs="*", help="model_types (default: all)")
    ap.add_argument("--root", type=Path, default=None, help="build/output folder (default: a temp dir)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes side by side")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a worker
    ap.add_argument("--json", type=Path, default=None,
                    help="where to write the record (default: benchmarks/results/model_sweep.json for a full sweep)")
    args = ap.parse_args(argv)
    root = args.root or _root()
    types = args.types or tiny_configs.model_types()
    t0 = time.perf_counter()
    if args.part:  # a worker: check the types it is given, a "start" line then the record for each
        os.environ.setdefault("FP4CONVERT_DEFINITION_CACHE", str(root / "definitions"))
        definitions_in_process(pytest.MonkeyPatch())
        for mt in types:
            print(json.dumps({"start": mt}), flush=True)
            print(json.dumps(check(mt, root)), flush=True)
        return 0
    recs = _run_workers(types, root, args.jobs)
    recs.sort(key=lambda r: r["model_type"])
    for rec in recs:
        if rec["status"] != "passed":
            print(json.dumps({k: rec.get(k) for k in ("model_type", "status", "reason", "failures")}))
    counts = {s: sum(r["status"] == s for r in recs) for s in ("passed", "failed", "skipped")}
    kinds: dict[str, int] = {}
    for r in recs:
        if r["status"] != "skipped":
            kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    summary = {"transformers": transformers.__version__, "model_types": len(recs), **counts,
               "swept": counts["passed"] + counts["failed"], "swept_by_kind": kinds, "jobs": args.jobs,
               # outputs (or some of their quantized tensors) that transformers cannot load, shown from its loader
               # and said by the run: for vLLM only (docs/formats.md "Which tensors are quantized")
               "transformers_cannot_load_output": sorted(r["model_type"] for r in recs
                                                         if r.get("transformers_cannot_load_model")),
               "transformers_cannot_load_some_tensors": sorted(r["model_type"] for r in recs
                                                               if r.get("transformers_cannot_load")
                                                               and not r.get("transformers_cannot_load_model")),
               "seconds": round(time.perf_counter() - t0, 1), "cpus": os.cpu_count(),
               "outcomes": {r["model_type"]: r for r in recs}}
    print(f"sweep: {len(recs)} model types, {summary['swept']} swept ({counts['passed']} passed, "
          f"{counts['failed']} failed), {counts['skipped']} skipped, {summary['seconds']} s with {args.jobs} jobs")
    out = args.json or (None if args.types else Path(__file__).parents[2] / "benchmarks/results/model_sweep.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
