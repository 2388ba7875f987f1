"""Checkpoints written by other tools' own code, for the tests of quantized sources (issue 44).

- :func:`int4_variant`: a checkpoint's linear / expert weights as compressed-tensors ``pack-quantized`` INT4,
  every byte made by compressed-tensors itself: its ``calculate_qparams`` (min-max scales, zero points),
  its ``PackedQuantizationCompressor.compress`` (quantize and pack) and its ``ModelCompressor.update_config``
  (config.json's ``quantization_config``). Returns the exact fp32 twin, decoded by compressed-tensors'
  own ``decompress`` run with the scale widened to fp32 (its decompression computes ``(q - z) * scale`` in
  the scale's dtype: in fp32 that product is exact).
- :func:`nvfp4_variant`: a checkpoint's weights as compressed-tensors ``nvfp4-pack-quantized`` (or
  ``mxfp4-pack-quantized``), quantized and packed by compressed-tensors' own compressors, scales from its
  own ``generate_gparam`` / ``calculate_qparams``, with an ``ignore`` list naming the kept linears and,
  for W4A4, its ``input_global_scale`` per linear. This is what llm-compressor writes.

Both need compressed-tensors (tests import this module after ``pytest.importorskip``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests import zoo

Pick = Callable[[str, tuple[int, ...]], bool]


def default_pick(name: str, shape: tuple[int, ...]) -> bool:
    """Every 2-D linear weight except embeddings, norms, routers and the head (what a ``Linear`` target with
    the usual ignore list quantizes)."""
    leaf = name.lower()
    return (name.endswith(".weight") and len(shape) == 2 and "embed" not in leaf and "norm" not in leaf
            and "lm_head" not in leaf and not name.endswith(("mlp.gate.weight", "router.weight")))


def experts_only(name: str, shape: tuple[int, ...]) -> bool:
    """Routed experts only, as Kimi-K2-Thinking ships INT4 (attention, shared experts and dense MLPs in bf16)."""
    return default_pick(name, shape) and ".experts." in name


def _copy_other_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())


def _write_config(src: Path, dst: Path, qconfig) -> None:
    """config.json as compressed-tensors writes it (``ModelCompressor.update_config``), over ``src``'s."""
    from compressed_tensors.compressors import ModelCompressor

    cfg = zoo.read_config(src)
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    ModelCompressor(quantization_config=qconfig).update_config(str(dst))


def _ignored(tensors: dict[str, torch.Tensor], pick: Pick) -> list[str]:
    """The modules of the 2-D weights left unquantized: compressed-tensors' ``ignore``."""
    return sorted(n[: -len(".weight")] for n, t in tensors.items()
                  if n.endswith(".weight") and t.dim() == 2 and not pick(n, tuple(t.shape)))


def int4_variant(src: Path, dst: Path, *, strategy: str = "group", group_size: int | None = 32,
                 symmetric: bool = True, pick: Pick = default_pick, scale_dtype: torch.dtype = torch.bfloat16
                 ) -> dict[str, torch.Tensor]:
    """Write ``src`` as compressed-tensors pack-quantized INT4 into ``dst``; returns its exact fp32 twin (the
    INT4 weights' exact values, every other tensor unchanged)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", strategy=strategy,
                            group_size=group_size if strategy == "group" else None, symmetric=symmetric)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    tensors = zoo.read_tensors(src)
    for name, t in tensors.items():
        if not pick(name, tuple(t.shape)):
            out[name] = exact[name] = t
            continue
        w = t.float()
        if strategy == "group":
            blocks = w.reshape(w.shape[0], -1, group_size)
            lo, hi = blocks.amin(-1), blocks.amax(-1)
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zp = calculate_qparams(lo, hi, args)
        state = {"weight": t, "weight_scale": scale.to(scale_dtype)}
        if not symmetric:
            state["weight_zero_point"] = zp.to(torch.int8)
        packed = PackedQuantizationCompressor.compress(state, scheme)
        module = name[: -len("weight")]
        for k, v in packed.items():
            out[module + k] = v.contiguous()
        wide = dict(packed, weight_scale=packed["weight_scale"].float())
        exact[name] = PackedQuantizationCompressor.decompress(wide, scheme)["weight"]
        assert exact[name].dtype == torch.float32
    _copy_other_files(src, dst)
    save_file(out, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                 quantization_status="compressed", ignore=_ignored(tensors, pick))
    _write_config(src, Path(dst), qconfig)
    return exact


def nvfp4_variant(src: Path, dst: Path, *, scheme: str = "nvfp4", pick: Pick = default_pick,
                  w4a4: bool = False, shared: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """Write ``src`` as compressed-tensors ``{scheme}-pack-quantized`` into ``dst`` with compressed-tensors'
    own code; returns the tensors written. ``shared``: fused groups (group id -> member weight names) whose
    members share one global scale (their max amax, as llm-compressor fuses q/k/v and gate/up); every other
    quantized weight has its own. ``w4a4``: compressed-tensors' W4A4 preset, with an ``input_global_scale``
    per linear from a made-up activation amax (shared by the members of each fused group)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    preset = preset_name_to_scheme(scheme.upper() if w4a4 else f"{scheme.upper()}A16", ["Linear"])
    args = preset.weights
    fmt = f"{scheme}-pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors = zoo.read_tensors(src)
    member_of = {m: g for g, members in (shared or {}).items() for m in members}
    group_amax: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in member_of:
            a = t.float().abs().amax()
            g = member_of[name]
            group_amax[g] = torch.maximum(group_amax.get(g, a), a)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not pick(name, tuple(t.shape)):
            out[name] = t
            continue
        w = t.float()
        blocks = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        state: dict[str, torch.Tensor] = {"weight": t}
        gs = None
        if scheme == "nvfp4":
            amax = group_amax.get(member_of.get(name, ""), w.abs().amax())
            gs = generate_gparam(-amax.reshape(1), amax.reshape(1))
            state["weight_global_scale"] = gs
        scale, _ = calculate_qparams(lo, hi, args, global_scale=gs)
        state["weight_scale"] = scale
        if w4a4 and scheme == "nvfp4":
            act = 4.0 + sum(map(ord, member_of.get(name, name))) % 7  # any positive amax, shared per fused group
            state["input_global_scale"] = generate_gparam(torch.tensor([-act]), torch.tensor([act]))
        module = name[: -len("weight")]
        for k, v in compressor.compress(state, preset).items():
            out[module + k] = v.contiguous()
    _copy_other_files(src, dst)
    save_file(out, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    qconfig = QuantizationConfig(config_groups={"group_0": preset}, format=fmt, quantization_status="compressed",
                                 ignore=_ignored(tensors, pick))
    _write_config(src, Path(dst), qconfig)
    return out
