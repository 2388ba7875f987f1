"""How transformers loads our compressed-tensors FP4 output, modelled without data (:class:`Fp4Loader`).

Asked by the role rules (:mod:`fp4convert.plan.role_rules`) for every tensor the plan would write in FP4:
whether transformers can load it under its checkpoint name, and why not. Runs in the definition's child
process (torch and transformers are imported by the caller's code paths, inside the methods).
"""

from __future__ import annotations

import logging

from fp4convert.plan.roles import one_line

log = logging.getLogger(__name__)


class Fp4Loader:
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
    def build(cls, model, version: str) -> Fp4Loader | None:
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
                f"of this model ({one_line(exc)[:120]})"))
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
