"""Reading quantized checkpoints back: recognise the format, check it, and compare with a source.

Default checks read headers and the tiny global-scale tensors only, so they are fast on a 100 GB
checkpoint; ``check_files`` also reads the data (checksums, every block scale); ``verify``
dequantizes every weight and compares it with the source model.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

import torch

from .formats.base import QuantizedModule
from .layout import CheckpointLayout, load_quantized, read_global, read_layout
from .manifest import MANIFEST_NAME, file_digest
from .plan import fused_group
from .safetensors_io import read_tensor
from .scheme import get_scheme
from .source import Source, open_source
from .swizzle import padded_shape
from .tensor import dequantize


def _check_shapes(m: QuantizedModule) -> list[str]:
    out = []
    *lead, rows, half = m.packed.shape
    bs = get_scheme(m.scheme).block_size
    k = half * 2
    if k % bs:
        return [f"{m.module}: K={k} is not a multiple of the {m.scheme} block size {bs}"]
    nb = k // bs
    want = (*lead, *padded_shape(rows, nb)) if m.swizzled else (*lead, rows, nb)
    if m.scale.shape != want:
        out.append(f"{m.module}: scale shape {list(m.scale.shape)}, expected {list(want)} for {m.scheme}")
    if get_scheme(m.scheme).global_scale:
        if m.global_ is None:
            out.append(f"{m.module}: NVFP4 weight without a global scale")
        elif m.global_.dtype != "F32":
            out.append(f"{m.module}: global scale is {m.global_.dtype}, engines expect F32")
    return out


def inspect_checkpoint(path_or_repo: str, *, check_files: bool = False, verify: str | None = None,
                       revision: str | None = None) -> dict:
    """Everything ``fp4convert inspect`` reports, as a dict (``ok`` is False when a check failed)."""
    source = open_source(path_or_repo, revision)
    layout = read_layout(source)
    problems = list(layout.problems)
    globals_: dict[str, float] = {}
    for m in layout.modules.values():
        problems += _check_shapes(m)
        if get_scheme(m.scheme).global_scale and m.global_ is not None and m.global_.dtype == "F32":
            g = read_global(source, layout, m)
            bad = ~torch.isfinite(g) | (g <= 0)
            if bool(bad.any()):
                problems.append(f"{m.module}: global scale {g.flatten()[:4].tolist()} is not finite and positive")
            globals_[m.module] = g.flatten()[0].item() if g.numel() == 1 else float("nan")

    # Fused groups must share one global scale (docs/numerics.md#fused-groups-share-one-global-scale).
    groups: dict[str, list[str]] = defaultdict(list)
    for name in list(layout.modules) + [t.name[: -len(".weight")] for t in layout.kept if t.name.endswith(".weight")]:
        g = fused_group(name + ".weight")
        if g:
            groups[g].append(name)
    for g, members in sorted(groups.items()):
        q = [m for m in members if m in layout.modules]
        if q and len(q) != len(members):
            problems.append(f"fused group {g} is partly quantized: {sorted(set(members) - set(q))} kept")
        vals = {globals_.get(m) for m in q if m in globals_}
        if len(vals) > 1:
            problems.append(f"fused group {g} has {len(vals)} different global scales (engines need one)")

    manifest = layout.manifest
    if manifest:
        problems += _check_against_manifest(manifest, layout)
    checksums = _check_files(source, manifest, layout, problems, full=check_files)
    report = _summary(source, layout, globals_, groups)
    report["checks"] = {
        "problems": problems,
        "block_scales_checked": check_files,
        "checksums": checksums,
    }
    if verify:
        report["verify"] = verify_against(source, layout, verify)
    report["ok"] = not problems
    return report


def _check_against_manifest(manifest: dict, layout: CheckpointLayout) -> list[str]:
    """Every tensor the manifest promises is on disk with its dtype and shape, and nothing else is."""
    out = []
    promised = {}
    for rec in manifest.get("tensors", {}).values():
        promised.update(rec.get("outputs", {}))
    for name, want in sorted(promised.items()):
        got = layout.tensors.get(name)
        if got is None:
            out.append(f"{name}: listed in {MANIFEST_NAME} but not in any shard")
        elif got.dtype != want["dtype"] or list(got.shape) != want["shape"]:
            out.append(f"{name}: {got.dtype} {list(got.shape)} on disk, manifest says {want['dtype']} {want['shape']}")
    extra = sorted(set(layout.tensors) - set(promised))
    if extra:
        out.append(f"{len(extra)} tensor(s) not in {MANIFEST_NAME}, e.g. {extra[0]}")
    return out


def _check_files(source: Source, manifest: dict | None, layout: CheckpointLayout, problems: list[str],
                 full: bool) -> str:
    if full:
        for m in layout.modules.values():
            s = read_tensor(source.local_path(m.scale.file), m.scale)
            if get_scheme(m.scheme).scale_encoding == "e4m3":
                b = s.view(torch.uint8)
                if bool(((b & 0x7F) == 0x7F).any()):
                    problems.append(f"{m.module}: block scale is NaN (0x7F)")
                if bool((b & 0x80).any()):
                    problems.append(f"{m.module}: negative block scale")
            elif bool((s == 0xFF).any()):
                problems.append(f"{m.module}: E8M0 block scale 0xFF is NaN")
    if manifest is None or source.is_hub:
        return "no manifest" if manifest is None else "not checked (Hub source)"
    for rel, rec in sorted(manifest.get("files", {}).items()):
        p = source.root / rel
        if not p.exists():
            problems.append(f"{rel}: listed in {MANIFEST_NAME} but missing")
        elif p.stat().st_size != rec["size"]:
            problems.append(f"{rel}: size {p.stat().st_size}, manifest says {rec['size']}")
        elif full and file_digest(p) != rec["sha256"]:
            problems.append(f"{rel}: sha256 differs from {MANIFEST_NAME}")
    return "sha256 verified" if full else "sizes verified (sha256 with --check-files)"


_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def _summary(source: Source, layout: CheckpointLayout, globals_: dict[str, float], groups: dict) -> dict:
    q_params = sum(math.prod(m.shape) for m in layout.modules.values())
    kept_params = sum(t.numel for t in layout.kept)
    q_bytes = sum(t.nbytes for m in layout.modules.values() for t in (m.packed, m.scale, m.global_) if t)
    kept_bytes = sum(t.nbytes for t in layout.kept)
    layers: dict[str, dict] = defaultdict(lambda: {"quantized": 0, "kept": 0, "bytes": 0})
    for m in layout.modules.values():
        key = (_LAYER.match(m.module + ".") or [None, "(other)"])[1]
        layers[key]["quantized"] += 1
        layers[key]["bytes"] += sum(t.nbytes for t in (m.packed, m.scale, m.global_) if t)
    for t in layout.kept:
        key = (_LAYER.match(t.name) or [None, "(other)"])[1]
        layers[key]["kept"] += 1
        layers[key]["bytes"] += t.nbytes
    return {
        "path": source.label,
        "format": layout.format,
        "scheme": layout.scheme,
        "rotate": layout.rotate,
        "quantized": len(layout.modules),
        "kept": len(layout.kept),
        "fused_groups": len(groups),
        "bytes": q_bytes + kept_bytes,
        "params": q_params + kept_params,
        "bits_per_param_quantized": round(8 * q_bytes / q_params, 4) if q_params else None,
        "bits_per_param": round(8 * (q_bytes + kept_bytes) / (q_params + kept_params), 4) if q_params + kept_params else None,
        "layers": dict(sorted(layers.items(), key=lambda kv: _natural(kv[0]))),
        "global_scales": globals_,
    }


def _natural(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def verify_against(source: Source, layout: CheckpointLayout, src: str) -> dict:
    """Dequantize every quantized weight and compare it with the original (relative error, SNR)."""
    original = open_source(src)
    orig = {t.name: t for t in original.tensors()}
    out = {}
    for m in layout.modules.values():
        info = orig.get(m.module + ".weight")
        if info is None:
            out[m.module] = {"error": "not in the source checkpoint"}
            continue
        x = read_tensor(original.local_path(info.file), info).to(torch.float32)
        w = dequantize(load_quantized(source, layout, m), torch.float32)
        if w.shape != x.shape:
            out[m.module] = {"error": f"shape {list(w.shape)} vs source {list(x.shape)}"}
            continue
        err = (w - x).norm().item()
        ref = x.norm().item()
        out[m.module] = {
            "rel_error": err / ref if ref else 0.0,
            "snr_db": 20 * math.log10(ref / err) if err and ref else math.inf,
        }
    return out
