"""Torch helpers of the torch backends (:mod:`fp4convert.quantizer.backends.cpu`, :mod:`fp4convert.quantizer.backends.stacked`).

An item's inputs arrive as one host buffer (:mod:`fp4convert.run.readahead`); here they become tensors,
a :class:`~fp4convert.quantizer.items.Complex` unit's weights become launch groups of 2-D matrices (a
quantized input decoded to the fp32 weight it encodes, stacked experts sliced per expert and per
gate/up half, in-features-first layouts transposed), and a kept tensor's bytes are scanned for NaN/Inf
and, with ``--kept-dtype bf16``, rounded to BF16 (the writer imports this module for that alone).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from fp4convert import timing
from fp4convert.errors import FP4ConvertError, kept_overflow_error
from fp4convert.storage.safetensors import DTYPES, tensor_memoryview

if TYPE_CHECKING:
    from fp4convert.formats.base import Decode
    from fp4convert.plan.types import Decision, Matrix
    from fp4convert.quantizer.backend import Inputs
    from fp4convert.quantizer.items import Complex


class TensorBuffer:
    """A host buffer backed by a torch uint8 tensor (pinned for a GPU), with the reader's interface."""

    def __init__(self, n: int, pinned: bool) -> None:
        with timing.timed("pin_alloc" if pinned else "host_alloc"):
            self.tensor = torch.empty(max(n, 1 << 20), dtype=torch.uint8, pin_memory=pinned)
        self.size = self.tensor.numel()
        if pinned:
            timing.count("pinned_MB", self.size / 2**20)

    def view(self, offset: int, n: int) -> memoryview:
        return tensor_memoryview(self.tensor[offset : offset + n])


def tensors(inputs: Inputs) -> list[torch.Tensor]:
    """The tensors an item's inputs hold, in read order (views of the buffer: no copy)."""
    buf, items = inputs
    base = getattr(buf, "tensor", None)
    out = []
    for off, info in items:
        raw = base[off : off + info.nbytes] if base is not None else torch.frombuffer(buf.view(off, info.nbytes),
                                                                                     dtype=torch.uint8)
        out.append(raw.view(DTYPES[info.dtype]).reshape(info.shape))
    return out


def weight_of(d: Decision, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The weight a decision works on: the tensor itself, or the exact fp32 weight a quantized input encodes
    (FP8, gpt-oss MXFP4, INT4 pack-quantized, an FP4 checkpoint's), on the tensors' device.

    ``tensors``: what ``d.reads`` names, in that order (the on-disk tensors, as read). The one place a
    decision's on-disk tensors become its weight: the quantize stage and calibration both call it."""
    if d.decode is None:
        return tensors[0]
    return decoded(d.decode, tensors, f"{d.name} (in {d.info.file})")


def decoded(decode: Decode, tensors: list[torch.Tensor], where: str) -> torch.Tensor:
    """The exact fp32 weight a quantized input encodes (``tensors``: its on-disk tensors, ``decode.inputs``
    in order), on the tensors' device: the one decode the quantize stage and the calibration both use.
    ``where`` names the tensor in an error."""
    from fp4convert.kernels.tensor import dequantize_input

    try:
        w = dequantize_input(decode.kind, tensors, **decode.arguments())
    except FP4ConvertError as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    return w.transpose(-1, -2) if decode.transpose else w


def unit_weights(item: Complex, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each member's weight (decoded where it is a quantized input), from the item's inputs in read order."""
    it = iter(inputs)
    return [weight_of(d, [next(it) for _ in d.reads]) for d in item.members]


def launch_groups(item: Complex, weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, list[int]]]:
    """A unit's matrices as launch groups ``[B, N, K]`` (every expert of one gate/up/down part in one),
    each with the indices of its matrices in ``item.matrices``."""
    out: list[tuple[torch.Tensor, list[int]]] = []
    start = 0
    for d, x in zip(item.members, weights):
        index = {id(m): start + i for i, m in enumerate(d.matrices)}
        start += len(d.matrices)
        for ms, v in _parts(d, x):
            out.append((v, [index[id(m)] for m in ms]))
    return out


def _parts(d: Decision, x: torch.Tensor) -> list[tuple[list[Matrix], torch.Tensor]]:
    if len(d.matrices) == 1 and d.matrices[0].expert is None:  # a whole 2-D weight ([in, out] on disk: W^T)
        m = d.matrices[0]
        return [(list(d.matrices), (x.transpose(-1, -2) if m.transpose else x).unsqueeze(0))]
    parts: dict[tuple, list[Matrix]] = {}
    for m in d.matrices:
        parts.setdefault((m.rows, m.transpose), []).append(m)
    out = []
    for (rows, transpose), ms in parts.items():
        v = x.transpose(-1, -2) if transpose else x
        experts = [m.expert for m in ms]
        v = v if experts == list(range(v.shape[0])) else v[experts]
        if rows is not None:
            v = v[:, rows[0]:rows[1]:rows[2]]
        out.append((ms, v))
    return out


def nonfinite_bytes(dtype: str, block: bytes | bytearray | memoryview) -> bool:
    """Does this chunk of a kept tensor's bytes hold NaN or Inf? One vectorized min/max pass: a NaN
    propagates into both, an Inf is the min or the max. (``isfinite().all()`` was 44x slower on
    bf16 and took 30% of the writer thread on a checkpoint with large kept embeddings.)"""
    if dtype in ("F64", "F32", "F16", "BF16"):
        t = torch.frombuffer(block, dtype=DTYPES[dtype]) if len(block) else None
        if t is None:
            return False
        lo, hi = torch.aminmax(t)
        return not (math.isfinite(lo.item()) and math.isfinite(hi.item()))
    if dtype in ("F8_E4M3", "F8_E5M2"):
        u = torch.frombuffer(block, dtype=torch.uint8)
        if dtype == "F8_E4M3":
            return bool(((u & 0x7F) == 0x7F).any())
        return bool(((u & 0x7C) == 0x7C).any())
    return False


def _f32_for_bf16(x: torch.Tensor) -> torch.Tensor:
    """An F32 tensor whose rounding to BF16 (nearest even) is ``x``'s own: ``x`` itself when F32; an F64
    ``x`` rounded to F32 *to odd* (truncated, the last bit set when inexact). torch converts double to
    bfloat16 through float, two roundings to nearest that can differ from one in a tie (1 + 2**-8 +
    2**-30 would give 1.0, not 1 + 2**-7); round-to-odd into F32, which carries 16 bits more than BF16
    at every exponent, makes the second rounding the correct one."""
    if x.dtype != torch.float64:
        return x
    y = x.to(torch.float32)
    back = y.to(torch.float64)
    bits = y.view(torch.int32) - (back.abs() > x.abs()).to(torch.int32)  # rounded away from zero: one step back
    bits = bits | ((back != x) & ~torch.isnan(x)).to(torch.int32)  # inexact: the odd neighbour
    return bits.view(torch.float32)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """F32 or F64 ``x`` rounded to BF16, to nearest even (NaN stays NaN; beyond BF16's range: Inf)."""
    return _f32_for_bf16(x).to(torch.bfloat16)


def kept_bytes_to_bf16(dtype: str, data: memoryview, out: memoryview) -> bool:
    """A piece of a kept F32/F64 tensor (``data``) rounded to BF16 into ``out`` (half or a quarter its
    size); True when a finite value became Inf (beyond BF16's range: the writer refuses it). The usual
    piece costs one conversion and one min/max pass over its output."""
    if not len(data):
        return False
    src = torch.frombuffer(data, dtype=DTYPES[dtype])
    dst = torch.frombuffer(out, dtype=torch.bfloat16)
    dst.copy_(_f32_for_bf16(src))
    if not nonfinite_bytes("BF16", out):
        return False
    return bool((torch.isinf(dst) & torch.isfinite(src)).any())


def kept_output(d: Decision, w: torch.Tensor) -> torch.Tensor:
    """A kept quantized input's weight (the fp32 it encodes) in its planned output dtype: BF16 with
    ``--kept-dtype bf16`` (rounded to nearest even; a finite value beyond BF16's range is refused)."""
    if d.outputs[0].dtype != "BF16" or w.dtype == torch.bfloat16:
        return w
    out = round_bf16(w)
    if bool((torch.isinf(out) & torch.isfinite(w)).any()):
        raise kept_overflow_error(d.name, d.info.file, d.info.dtype)
    return out
