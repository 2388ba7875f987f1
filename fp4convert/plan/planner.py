"""Planning: decide, from the model's definition, names, shapes and dtypes, what happens to every tensor.

Pure: nothing here reads tensor data, so ``--dry-run`` and validation cost only the headers. What a
tensor IS comes from transformers' own definition of the model (:mod:`fp4convert.plan.definition`): a tensor
is quantized only when it is positively a matmul weight with a known input axis. When transformers
does not know the architecture, name rules (:mod:`fp4convert.plan.name_roles`) decide, the plan says so
in a warning, and a tensor whose role they cannot establish is kept (what is known of each tensor, and why
it is kept by default: :mod:`fp4convert.plan.knowledge`). docs/formats.md says what is quantized by default
and which layers share a global scale; a fused group is quantized whole or not at all.

This module makes the :class:`Plan`: every decision, the fused groups, the output shards.
"""

from __future__ import annotations

import fnmatch
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from fp4convert.config import ConvertConfig
from fp4convert.errors import PlanError
from fp4convert.formats import input_weights, quantized_tensor_names
from fp4convert.formats.base import Decode, OutputFormat, OutputInfo
from fp4convert.plan import families as arch
from fp4convert.plan import name_roles
from fp4convert.plan.calibration import CalibrationPlan
from fp4convert.plan.collisions import check_part_names
from fp4convert.plan.knowledge import UNKNOWN_ROLE, Knowledge, default_reason, fused_group, mtp_layers
from fp4convert.plan.types import KEEP, QUANTIZE, Decision, Matrix
from fp4convert.storage.safetensors import OutEntry, TensorInfo


@dataclass
class Plan:
    """Every decision in processing order (fused groups adjacent) and the output shards."""

    decisions: list[Decision]
    groups: dict[str, list[str]]  # group id -> member tensor names
    shards: list[tuple[str, list[OutEntry]]]  # output file -> its tensors, in write order
    config: ConvertConfig
    warnings: list[str] = field(default_factory=list)
    knowledge: Knowledge | None = None  # where the roles came from (the model definition or name rules)
    # what the conversion measures on the model before writing (fp4convert.calibrate.plan_calibration; set while
    # planning, by plan_conversion): every later stage reads it
    calibration: CalibrationPlan | None = None

    @property
    def by_name(self) -> dict[str, Decision]:
        return {d.name: d for d in self.decisions}

    def units(self) -> list[list[Decision]]:
        """Work units: a fused group, or a single tensor."""
        out: list[list[Decision]] = []
        seen: set[str] = set()
        by_name = self.by_name
        for d in self.decisions:
            if d.name in seen:
                continue
            members = [by_name[n] for n in self.groups[d.group]] if d.group and d.action == QUANTIZE else [d]
            seen.update(m.name for m in members)
            out.append(members)
        return out

    def shard_of(self) -> dict[str, str]:
        return {e.name: f for f, entries in self.shards for e in entries}

    def summary(self) -> dict:
        q = [d for d in self.decisions if d.action == QUANTIZE]
        params_in = sum(d.info.numel for d in self.decisions)
        bytes_in = sum(d.read_bytes for d in self.decisions)
        bytes_out = sum(e.nbytes for _, entries in self.shards for e in entries)
        q_params = sum(d.info.numel for d in q)
        q_bytes = sum(e.nbytes for d in q for e in d.outputs)
        return {
            "tensors": len(self.decisions),
            "quantized": len(q),
            "kept": len(self.decisions) - len(q),
            "fused_groups": len({d.group for d in q if d.group} | {m.group for d in q for m in d.matrices if m.group}),
            "params": params_in,
            "quantized_params": q_params,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "shards_out": len(self.shards),
            "bits_per_param_quantized": round(8 * q_bytes / q_params, 4) if q_params else None,
            "bits_per_param": round(8 * bytes_out / params_in, 4) if params_in else None,
        }

    def kept_modules(self, model_config: dict | None = None) -> tuple[str, ...]:
        """Modules engines must not treat as FP4, spelled as loaders see them (compressed-tensors'
        ``ignore``, ModelOpt's ``exclude_modules``).

        Every kept 2-D weight (and each expert of a kept stacked tensor), in both the on-disk spelling
        and the one transformers builds after its key conversion (from the model definition when there
        is one), plus an output head with no tensor on disk (a tied ``lm_head``, Whisper's ``proj_out``),
        which is a Linear module at load time.
        """
        cfg = model_config or {}
        know = self.knowledge or Knowledge(cfg, None, "")
        mods: list[str] = []
        for d in self.decisions:
            if d.action != KEEP:
                continue
            layout = know.layout(d.name, d.info.shape)
            if layout is not None:
                mods += [n for m in layout.matrices for n in arch.ignore_names(m.module, cfg)]
            elif d.name.endswith(".weight") and len(d.info.shape) == 2 or know.is_kept_matmul(d.name):
                mods += know.loaded_names(d.module, d.name)
            elif know.custom_module(d.name):
                mods.append(know.custom_module(d.name))
        mods += know.missing_heads(self.decisions)
        return tuple(sorted(dict.fromkeys(mods)))

    def output_info(self, model_config: dict | None = None) -> OutputInfo:
        """What the output format needs to write its config files."""
        c = self.config
        return OutputInfo(c.scheme, c.rotate, c.rule, self.kept_modules(model_config), model_config or {})

    def to_json(self) -> dict:
        return {
            "settings": self.config.identity(),
            "planned_from": self.knowledge.describe() if self.knowledge else None,
            **({"calibration": self.calibration.to_json()} if self.calibration and self.calibration.runs_model else {}),
            "summary": self.summary(),
            "warnings": self.warnings,
            "tensors": [
                {
                    "name": d.name,
                    "action": d.action,
                    "reason": d.reason,
                    "group": d.group,
                    "dtype": d.info.dtype,
                    "shape": list(d.info.shape),
                    "outputs": [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape)} for e in d.outputs],
                    **({"matrices": [m.to_json() for m in d.matrices]} if len(d.matrices) > 1 else {}),
                    **({"decode": d.decode.to_json()} if d.decode else {}),
                }
                for d in self.decisions
            ],
            "groups": self.all_groups(),
        }

    def all_groups(self) -> dict[str, list[str]]:
        """Every shared-global-scale group of quantized matrices: id -> output modules."""
        out: dict[str, list[str]] = {}
        for d in self.decisions:
            if d.action != QUANTIZE:
                continue
            for m in d.matrices:
                g = m.group or d.group
                if g:
                    out.setdefault(g, []).append(m.module)
        return out


def matches(pattern: str, name: str) -> bool:
    """A user pattern: ``re:REGEX`` (searched) or a glob, against the tensor or its module name."""
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    if pattern.startswith("re:"):
        rx = re.compile(pattern[3:])
        return bool(rx.search(name) or rx.search(module))
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(module, pattern)


def make_plan(
    tensors: list[TensorInfo], config: ConvertConfig, fmt: OutputFormat, model_config: dict | None = None
) -> Plan:
    """Decide every tensor, group the fused layers, and lay out the output shards."""
    model_config = model_config or {}
    fmt.check(config.scheme, config.rotate)
    # Quantized inputs (FP8, gpt-oss MXFP4) become the fp32 weights they encode; FP4 inputs are refused.
    sources, decodes = input_weights(tensors, model_config)
    # Processing (and output) order: source shard by shard, by name within a shard, so the output does
    # not depend on how a writer laid tensors out in a file (an FP8 checkpoint and its fp32-dequantized
    # twin give the same bytes). safetensors' own writer orders by dtype, then name: for one-dtype
    # shards this is the file order.
    shard_rank = {f: i for i, f in enumerate(dict.fromkeys(t.file for t in sources))}
    sources = sorted(sources, key=lambda t: (shard_rank[t.file], t.name))
    quantized = quantized_tensor_names(sources)
    qc = model_config.get("quantization_config")
    if quantized or (qc and not decodes):
        what = f"{quantized[0]} and {len(quantized) - 1} more" if quantized else \
            f"quantization_config: {qc.get('quant_method', '?') if isinstance(qc, dict) else qc}"
        raise PlanError(f"the source is already quantized ({what}); fp4convert needs a bf16/fp16/fp32 checkpoint "
                        "or an FP8 / MXFP4 one it can decode exactly")
    mtp = mtp_layers(model_config)
    knowledge = Knowledge.of(model_config, sources)

    reasons, ignored = _reasons(sources, config, knowledge, mtp)  # 1. per-tensor decision
    groups, group_warnings = _fused_groups(sources, reasons, ignored, model_config, knowledge)  # 2. fused groups
    decisions = _decisions(sources, reasons, groups, decodes, config, fmt, model_config, knowledge)  # 3. in order

    check_collisions(decisions)
    check_part_names(decisions, fmt)  # a kept tensor named like a part of a quantized one (issue 34)
    plan = Plan(decisions, {g: m for g, m in groups.items()}, layout_shards(decisions, config.max_shard_size), config,
                knowledge=knowledge)
    plan.warnings += _plan_notes(decisions, knowledge, fmt.transformers_loads) + group_warnings
    if not any(d.action == QUANTIZE for d in decisions):
        plan.warnings.insert(0, "no tensor is quantized: check --only / --ignore and the checkpoint's layer names")
    return plan


def _reasons(
    sources: list[TensorInfo], config: ConvertConfig, knowledge: Knowledge, mtp: tuple[int, int] | None
) -> tuple[dict[str, str | None], dict[str, str]]:
    """1. Per-tensor decision: why each tensor is kept (None: quantized), and the --ignore pattern each matched."""
    reasons: dict[str, str | None] = {}
    ignored: dict[str, str] = {}
    for info in sources:
        reason = default_reason(info, config.scheme, knowledge, mtp)
        hit = next((p for p in config.ignore if matches(p, info.name)), None)
        if hit is not None:
            reason = f"matched --ignore {hit}"
            ignored[info.name] = hit
        elif config.only and reason is None and not any(matches(p, info.name) for p in config.only):
            reason = "not matched by --only"
        reasons[info.name] = reason
    return reasons, ignored


def _fused_groups(
    sources: list[TensorInfo],
    reasons: dict[str, str | None],
    ignored: dict[str, str],
    model_config: dict,
    knowledge: Knowledge,
) -> tuple[dict[str, list[str]], list[str]]:
    """2. Fused groups (from the architecture's packed mappings): whole or not at all.

    Updates ``reasons`` (a group with a kept member is kept whole); returns the groups and their warnings.
    """
    by_name = {i.name: i for i in sources}
    groups: dict[str, list[str]] = OrderedDict()
    for info in sources:
        g = fused_group(info.name, model_config, knowledge)
        if g:
            groups.setdefault(g, []).append(info.name)
    groups = OrderedDict((g, m) for g, m in groups.items() if len(m) > 1)
    group_warnings: list[str] = []
    unfused: list[str] = []
    for g, members in groups.items():
        blocked = [m for m in members if reasons[m] is not None]
        if blocked and len(blocked) < len(members):
            why = f"fused group {g} stays whole: {blocked[0]} is kept ({reasons[blocked[0]]})"
            for m in members:
                if reasons[m] is None:
                    reasons[m] = why
            hits = [m for m in blocked if m in ignored]
            if hits:
                group_warnings.append(f"--ignore {ignored[hits[0]]} matched {len(hits)} of the {len(members)} members "
                                      f"of fused group {g}: the whole group is kept unquantized (engines load it as one "
                                      "weight)")
        elif not blocked and len({_in_features(by_name[m], knowledge) for m in members}) > 1:
            # No engine fuses matrices of different in-features (cross-attention's k/v read the encoder's
            # states, MobileBERT's bottleneck): each keeps its own global scale.
            unfused.append(g)
            group_warnings.append(f"{g}: members have different in-features, so no engine fuses them; each is "
                                  "quantized with its own global scale")

    for g in unfused:
        del groups[g]
    return groups, group_warnings


def _decisions(
    sources: list[TensorInfo],
    reasons: dict[str, str | None],
    groups: dict[str, list[str]],
    decodes: dict[str, Decode],
    config: ConvertConfig,
    fmt: OutputFormat,
    model_config: dict,
    knowledge: Knowledge,
) -> list[Decision]:
    """3. Decisions in processing order: a group is processed at its first member."""
    by_name = {i.name: i for i in sources}
    decisions: list[Decision] = []
    done: set[str] = set()
    for info in sources:
        if info.name in done:
            continue
        g = fused_group(info.name, model_config, knowledge)
        g = g if g in groups else None
        unit = groups[g] if g and reasons[info.name] is None else [info.name]
        for name in unit:
            i = by_name[name]
            done.add(name)
            decode = decodes.get(name)
            kept = reasons[name]
            if kept is None:
                decisions.append(_quantize_decision(i, g, groups, decode, config, fmt, knowledge))
            else:
                reason = kept + (f"; written decoded ({i.dtype}) from {decode.describe()}" if decode else "")
                out = OutEntry(name, config.kept_output_dtype(i.dtype), i.shape)  # --kept-dtype bf16: F32/F64 -> BF16
                decisions.append(Decision(name, KEEP, reason, i, g, (out,), (), decode))
    return decisions


def _quantize_decision(
    i: TensorInfo,
    g: str | None,
    groups: dict[str, list[str]],
    decode: Decode | None,
    config: ConvertConfig,
    fmt: OutputFormat,
    knowledge: Knowledge,
) -> Decision:
    """The decision to quantize ``i`` (in fused group ``g`` or none): its matrices, outputs and why."""
    name = i.name
    matrices = _matrices(i, g, knowledge)
    layout = knowledge.layout(name, i.shape)
    what = name_roles.describe_layout(layout) if layout is not None else knowledge.describe_weight(name, i.shape)
    if any(m.transpose and m.expert is None for m in matrices):
        what = ("Conv1D weight stored [in, out] (GPT-2 style): quantized along its input axis and "
                "written [out, in], as vLLM's GPT-2 loader reads it")
    reason = what + (f", fused group of {len(groups[g])} sharing one global scale" if g else "")
    if len(matrices) > 1:
        reason += f"; {len(matrices)} matrices, gate and up of each expert sharing one global scale" \
            if any(m.group for m in matrices) else f"; {len(matrices)} matrices"
    if decode:
        reason += f"; decoded from {decode.describe()}"
    outputs = tuple(e for m in matrices for e in fmt.entries(m.module, m.shape, config.scheme, config.rotate))
    return Decision(name, QUANTIZE, reason, i, g, outputs, matrices, decode)


def _in_features(info: TensorInfo, knowledge: Knowledge) -> int | tuple:
    """A fused member's in-features (its input axis on disk; the trailing dims for anything else)."""
    if len(info.shape) == 2:
        return info.shape[knowledge.input_axis(info.name)]
    return tuple(info.shape[1:])


def _plan_notes(decisions: list[Decision], knowledge: Knowledge, transformers_loads: bool = False) -> list[str]:
    """Warnings every run repeats: roles from name rules (and what they could not place), linear layers
    kept for their in-features, a split-less expert stack kept whole, and (for a format transformers
    loads, ``OutputFormat.transformers_loads``) quantized weights transformers cannot load."""
    out = []

    def some(names: list[str]) -> str:
        return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")

    if transformers_loads:
        unloadable = [(d.name, knowledge.transformers_cannot_load(d.name)) for d in decisions if d.action == QUANTIZE]
        unloadable = [(n, why) for n, why in unloadable if why]
        whole = knowledge.definition.transformers_cannot_load if knowledge.definition is not None else ""
        dropped = [d for d in decisions if d.action == KEEP and knowledge.dequantizes_first(d.name)]
        if not whole and dropped:
            whole = (f"its compressed-tensors load routes {dropped[0].name} through a converter that dequantizes "
                     f"first and drops it unquantized (kept: {dropped[0].reason})")
        if whole:
            out.append(f"transformers cannot load this compressed-tensors output at all, so it is for vLLM: {whole}")
        elif unloadable:
            out.append(f"transformers cannot load {len(unloadable)} quantized tensor(s) of this model, so this output "
                       f"is for vLLM (whose loader reads them) and not for transformers: {unloadable[0][1]}; "
                       f"{some([n for n, _ in unloadable])}")

    if knowledge.definition is not None and knowledge.definition.unbuilt:
        out.append(f"transformers built {knowledge.definition.model_class} here without {knowledge.definition.unbuilt}; "
                   "the tensors of that part are kept (it lies outside the language model)")
    if knowledge.definition is None:
        unknown = [d.name for d in decisions if d.reason == UNKNOWN_ROLE]
        out.append(f"planned from tensor names, not from the model definition ({knowledge.why}): check the plan "
                   "(--dry-run)" + (f"; {len(unknown)} float tensor(s) of unknown role kept unquantized: "
                                     f"{some(unknown)}" if unknown else ""))
    k_kept = [d.name for d in decisions if d.action == KEEP and d.reason.startswith("in-features K=")]
    if k_kept:
        out.append(f"{len(k_kept)} matmul weight(s) kept because their in-features are not a multiple of the block "
                   f"size: {some(k_kept)}")
    stacks = [d.name for d in decisions if d.action == KEEP and ("stack" in d.reason and "cannot be split" in d.reason
                                                                 or "its matmul layout is not stated" in d.reason
                                                                 or "reads no quantized experts" in d.reason)
              and len(d.info.shape) >= 2 and not d.reason.startswith("matched --ignore")]
    if stacks:
        out.append(f"{len(stacks)} weight(s) of a custom or unsplittable module kept unquantized (listed in the "
                   f"engine config's ignore): {some(stacks)}")
    unroutable = [d for d in decisions if d.action == KEEP and "transformers cannot load in FP4" in d.reason
                  and not d.reason.startswith("matched --ignore")]
    if unroutable:
        why = unroutable[0].reason.split("(", 1)[1].rsplit(")", 1)[0] if "(" in unroutable[0].reason else ""
        out.append(f"{len(unroutable)} linear weight(s) kept unquantized because transformers cannot load them in "
                   f"FP4 under the names engines read (listed in the engine config's ignore; {why}): "
                   f"{some([d.name for d in unroutable])}")
    return out


def _matrices(info: TensorInfo, group: str | None, knowledge: Knowledge) -> tuple[Matrix, ...]:
    """The 2-D matrices a quantized tensor becomes: itself, or one per expert (and gate/up half)."""
    layout = knowledge.layout(info.name, info.shape)
    if layout is None:
        module = info.name[: -len(".weight")] if info.name.endswith(".weight") else info.name
        if len(info.shape) == 2 and knowledge.input_axis(info.name) == 0:  # [in, out] on disk: quantize W^T
            return (Matrix(module, (info.shape[1], info.shape[0]), group, transpose=True),)
        return (Matrix(module, tuple(info.shape), group),)
    return tuple(Matrix(m.module, m.shape, m.group, m.expert, (m.row_start, m.row_stop, m.row_step),
                        layout.transpose) for m in layout.matrices)


def check_collisions(decisions: list[Decision]) -> None:
    owner: dict[str, str] = {}
    for d in decisions:
        for e in d.outputs:
            if e.name in owner:
                raise PlanError(
                    f"output tensor {e.name!r} would be written for both {owner[e.name]} and {d.name}; "
                    "is the source already quantized? Exclude one with --ignore"
                )
            owner[e.name] = d.name


def layout_shards(decisions: list[Decision], max_shard: int) -> list[tuple[str, list[OutEntry]]]:
    """Cut the outputs, in processing order, into shards of at most ``max_shard`` bytes."""
    shards: list[list[OutEntry]] = [[]]
    size = 0
    for d in decisions:
        unit_bytes = sum(e.nbytes for e in d.outputs)
        if shards[-1] and size + unit_bytes > max_shard:
            shards.append([])
            size = 0
        shards[-1].extend(d.outputs)
        size += unit_bytes
    from fp4convert.storage.names import shard_names

    return list(zip(shard_names(len(shards)), shards))
