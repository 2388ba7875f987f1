"""compressed-tensors ``pack-quantized`` INT4 checkpoints (Kimi-K2-Thinking and later), read as inputs and
decoded exactly to fp32 before quantization (docs/formats.md "Sources").

Per quantized ``X.weight``: ``X.weight_packed`` int32 ``[..., M, ceil(K/8)]`` (eight 4-bit values a word, low
nibble first, each stored as ``q + 8``), ``X.weight_scale`` (F32/BF16/F16; ``[..., M, K/group]`` for the
``group`` strategy, ``[..., M, 1]`` for ``channel``, one element for ``tensor``), ``X.weight_zero_point`` (int32
packed along the rows, asymmetric only) and ``X.weight_shape`` (the original shape, int64). The strategy, group
size and bit width come from config.json's ``quantization_config.config_groups``; the shape is inferred from
the headers (planning reads no tensor data) and checked against ``weight_shape`` when the weight is decoded.
"""

from __future__ import annotations

import re

from fp4convert.errors import SourceError
from fp4convert.formats.base import Decode, InputFormat
from fp4convert.storage.safetensors import TensorInfo

QUANT_METHOD = "compressed-tensors"
FORMAT_NAME = "pack-quantized"
SCALE_DTYPES = ("F32", "BF16", "F16")
SHAPE_DTYPES = ("I64", "I32")
STRATEGIES = ("group", "channel", "tensor")


def int_groups(config: dict) -> list[tuple[str, dict, list]]:
    """(group name, its ``weights`` args, its ``targets``) of every integer weight scheme in config.json's
    compressed-tensors ``quantization_config``; [] when there is none (values of the wrong type count as none)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return []
    groups = qc.get("config_groups")
    out = []
    for name, g in (groups.items() if isinstance(groups, dict) else ()):
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict) and w.get("type") == "int":
            targets = g.get("targets") if isinstance(g.get("targets"), list) else []
            out.append((str(name), w, targets))
    return out


def _matches(target: object, module: str) -> int:
    """How a compressed-tensors target names ``module``: 2 by its name or a ``re:`` pattern, 1 by a class name
    (``Linear``: any module holding packed weights), 0 not at all."""
    if not isinstance(target, str):
        return 0
    if target.startswith("re:"):
        try:
            return 2 if re.match(target[3:], module) else 0
        except re.error:
            return 0
    if target == module:
        return 2
    return 1 if "." not in target else 0


def weight_args(module: str, groups: list[tuple[str, dict, list]]) -> tuple[str, dict] | None:
    """The config group that describes ``module``'s weights: one naming it (or a pattern matching it) before
    one that targets a class; None when no group targets it."""
    best = None
    for name, args, targets in groups:
        rank = max((_matches(t, module) for t in targets), default=0)
        if rank and (best is None or rank > best[0]):
            best = (rank, name, args)
    return None if best is None else (best[1], best[2])


class PackQuantizedInput(InputFormat):
    name = "int4-pack-quantized"

    def decodes(self, tensors: dict[str, TensorInfo], config: dict) -> dict[str, tuple[TensorInfo, Decode]]:
        groups = int_groups(config)
        out: dict[str, tuple[TensorInfo, Decode]] = {}
        for name, packed in tensors.items():
            if not name.endswith(".weight_packed") or packed.dtype != "I32":
                continue
            module = name[: -len("_packed")]  # "X.weight"
            found = self._decode(module, packed, tensors, groups)
            if found is not None:
                out[module] = found
        return out

    def _decode(self, weight: str, packed: TensorInfo, tensors: dict[str, TensorInfo],
                groups: list[tuple[str, dict, list]]) -> tuple[TensorInfo, Decode] | None:
        """One INT4 weight's planner-facing TensorInfo and Decode; refuses (SourceError, exit 4) what it
        cannot decode exactly, naming the tensor."""
        scale = tensors.get(weight + "_scale")
        if scale is None or scale.dtype not in SCALE_DTYPES:
            return None  # not compressed-tensors INT4 (an FP4 module's packed codes are U8)
        where = f"{packed.name} ({packed.file})"
        module = weight[: -len(".weight")]
        found = weight_args(module, groups)
        if found is None:
            raise SourceError(f"{where}: int32 packed weights, but config.json's quantization_config has no integer "
                              "config group targeting this module; add the compressed-tensors quantization_config "
                              "the checkpoint was written with")
        gname, args = found
        bits, strategy, size = args.get("num_bits"), args.get("strategy"), args.get("group_size")
        key = f"quantization_config.config_groups.{gname}.weights"
        if bits != 4:
            raise SourceError(f"{where}: {key}.num_bits is {bits!r}; fp4convert decodes 4-bit pack-quantized weights "
                              "only")
        if strategy not in STRATEGIES:
            raise SourceError(f"{where}: {key}.strategy is {strategy!r:.40}; fp4convert decodes the "
                              f"{', '.join(STRATEGIES)} strategies of pack-quantized INT4")
        if len(packed.shape) < 2 or len(scale.shape) < 1:
            raise SourceError(f"{where}: shape {list(packed.shape)} is not [..., rows, words]")
        *lead, rows, words = packed.shape
        zp = tensors.get(weight + "_zero_point")
        symmetric = args.get("symmetric", True) is not False
        if symmetric == (zp is not None) or (zp is not None and zp.dtype != "I32"):
            raise SourceError(f"{where}: {key}.symmetric is {symmetric}, but "
                              + (f"{weight}_zero_point is {zp.dtype}, not the int32 packing of an asymmetric one"
                                 if zp is not None and not symmetric else
                                 f"{weight}_zero_point is {'present' if zp is not None else 'missing'}"))
        group, cols = self._row_length(where, key, strategy, size, scale, (*lead, rows), words, zp)
        shape_t = tensors.get(weight + "_shape")
        inputs = (packed, scale) + ((zp,) if zp is not None else ())
        if shape_t is not None:
            if shape_t.dtype not in SHAPE_DTYPES or tuple(shape_t.shape) != (len(packed.shape),):
                raise SourceError(f"{shape_t.name}: {shape_t.dtype} {list(shape_t.shape)} is not the "
                                  f"{len(packed.shape)}-element shape of {weight}")
            inputs += (shape_t,)
        logical = TensorInfo(weight, "F32", (*lead, rows, cols), packed.file, packed.begin, packed.end)
        return logical, Decode("int4_pack", inputs, group=group, cols=cols, zero_point=zp is not None)

    @staticmethod
    def _row_length(where: str, key: str, strategy: str, size: object, scale: TensorInfo, rows: tuple[int, ...],
                    words: int, zp: TensorInfo | None) -> tuple[int | None, int]:
        """(weights per scale or None, the row length K) from the headers: a group's K is exact (groups x size);
        a channel's or tensor's is 8 x words, checked against ``weight_shape`` when decoded."""
        if strategy == "tensor":
            if scale.numel != 1 or zp is not None:
                raise SourceError(f"{where}: the tensor strategy needs one symmetric scale, not {scale.name} "
                                  f"{list(scale.shape)}" + (" with a zero point" if zp is not None else ""))
            return None, 8 * words
        if tuple(scale.shape[:-1]) != rows:
            raise SourceError(f"{scale.name}: shape {list(scale.shape)} does not give one row of scales per weight "
                              f"row ({list(rows)})")
        n = scale.shape[-1]
        if zp is not None and tuple(zp.shape) != (*rows[:-1], -(-rows[-1] // 8), n):
            raise SourceError(f"{zp.name}: shape {list(zp.shape)} is not the row-packed zero point of {n} group(s) "
                              f"of {rows[-1]} rows")
        if strategy == "channel":
            if n != 1:
                raise SourceError(f"{scale.name}: {n} scales per row for the channel strategy")
            return None, 8 * words
        if type(size) is not int or size <= 0:
            raise SourceError(f"{where}: {key}.group_size is {size!r:.40}, not a positive integer")
        cols = n * size
        if -(-cols // 8) != words:
            raise SourceError(f"{where}: {n} groups of {size} weights need {-(-cols // 8)} int32 words per row, "
                              f"the packed weight has {words}")
        return size, cols


FORMAT = PackQuantizedInput()
