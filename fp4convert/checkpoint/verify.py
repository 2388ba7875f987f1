"""``inspect --verify SRC``: every dequantized weight against the source it was converted from, after checking
that SRC is that source (its fingerprint and structure against the manifest's record)."""

from __future__ import annotations

import math

import torch

from fp4convert.checkpoint.layout import CheckpointLayout, load_quantized
from fp4convert.errors import SourceError
from fp4convert.kernels.tensor import dequantize
from fp4convert.source.open import open_source
from fp4convert.source.source import Source
from fp4convert.storage.reads import read_tensor

DEFAULT_MAX_ERROR = 0.25
OK, FAILED, NOT_QUANTIZED = "ok", "failed", "not quantized"


def add_total(progress, n: int) -> None:
    if progress is not None:
        progress.total = (progress.total or 0) + n
        if hasattr(progress, "refresh"):
            progress.refresh()



def _fingerprint_check(manifest: dict | None, original: Source) -> tuple[str, list[str]]:
    """Is ``original`` the checkpoint the manifest was made from? (status, problems)"""
    from fp4convert.output.record import source_fingerprint

    if manifest is None:
        return "not checked (no manifest)", []
    identity = manifest.get("identity") or {}
    recorded = (identity.get("exported_from") or {}).get("source") or identity.get("source") or {}
    if recorded.get("type") == "hub" and original.is_hub:
        got = source_fingerprint(original)
        diffs = [f"{k} {got.get(k)!r}, the manifest names {recorded.get(k)!r}" for k in ("repo_id", "commit")
                 if got.get(k) != recorded.get(k)]
        return ("matches (repo id and commit)", []) if not diffs else (
            "differs", [f"--verify source is not the converted one: {'; '.join(diffs)}"])
    if recorded.get("type") == "local" and not original.is_hub and "files" in recorded:
        got = source_fingerprint(original)["files"]
        want = recorded["files"]
        diffs = []
        for f in sorted(set(want) | set(got)):
            if f not in got:
                diffs.append(f"{f} is missing")
            elif f not in want:
                diffs.append(f"{f} was not in the converted source")
            elif got[f] != want[f]:
                what = "size" if got[f].get("size") != want[f].get("size") else "header"
                diffs.append(f"{f}: {what} differs")
        if diffs:
            return "differs", [f"--verify source does not match the manifest's source fingerprint: {'; '.join(diffs[:3])}"
                               + (f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else "")]
        return "matches (file sizes and header hashes)", []
    return "not comparable (one is a Hub repo, the other a folder): tensor names, shapes and dtypes checked", []


def _structure_check(manifest: dict | None, orig: dict) -> list[str]:
    """The manifest's record of every source tensor (dtype, shape) against the --verify source's headers."""
    if manifest is None:
        return []
    diffs = []
    for name, rec in sorted(manifest.get("tensors", {}).items()):
        info = orig.get(name)
        if info is None:
            diffs.append(f"{name} is missing")
        elif info.dtype != rec.get("dtype") or list(info.shape) != rec.get("shape"):
            diffs.append(f"{name} is {info.dtype} {list(info.shape)}, was {rec.get('dtype')} {rec.get('shape')}")
    extra = sorted(set(orig) - set(manifest.get("tensors", {})))
    if extra:
        diffs.append(f"{len(extra)} tensor(s) the converted source did not have, e.g. {extra[0]}")
    if not diffs:
        return []
    return [f"--verify source differs from the converted one: {'; '.join(diffs[:3])}"
            + (f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else "")]


def verify_against(source: Source, layout: CheckpointLayout, src: str, *, max_error: float = DEFAULT_MAX_ERROR,
                   revision: str | None = None, token: str | None = None, progress=None) -> dict:
    """Dequantize every quantized weight and compare it with the original: per layer and overall.

    Fails (``problems``) when SRC is not the source the manifest names, when a quantized weight is
    missing from SRC or has another shape, or when a layer's relative error exceeds ``max_error``.
    """
    try:
        original = open_source(src, revision, token=token)
    except SourceError as exc:
        return {"source": src, "max_error": max_error, "layers": {}, "overall": None, "fingerprint": "n/a",
                "problems": [f"--verify: {exc}"], "passed": False}
    orig = {t.name: t for t in original.tensors()}
    fingerprint, problems = _fingerprint_check(layout.manifest, original)
    problems += _structure_check(layout.manifest, orig)
    layers: dict[str, dict] = {}
    missing: list[str] = []
    sum_err2 = sum_ref2 = 0.0
    add_total(progress, sum(orig[m + ".weight"].nbytes for m in layout.modules if m + ".weight" in orig))
    carried = _smoothing_factors(layout.manifest, original, orig, source)
    for m in layout.modules.values():
        info = orig.get(m.module + ".weight")
        if info is None:
            missing.append(m.module)
            layers[m.module] = {"error": "not in the source checkpoint"}
            continue
        x = read_tensor(original.local_path(info.file), info).to(torch.float32)
        if progress is not None:
            progress.update(info.nbytes)
        if m.module in carried:  # (--smooth: the columns carry the factor their norm gave up)
            x = x * carried[m.module]
        w = dequantize(load_quantized(source, layout, m), torch.float32)
        if w.shape != x.shape:
            layers[m.module] = {"error": f"shape {list(w.shape)} vs source {list(x.shape)}"}
            problems.append(f"{m.module}: dequantized shape {list(w.shape)}, source {list(x.shape)}")
            continue
        err2 = float((w - x).double().pow(2).sum())
        ref2 = float(x.double().pow(2).sum())
        sum_err2 += err2
        sum_ref2 += ref2
        rel = math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf)
        layers[m.module] = {"rel_error": rel, "snr_db": _snr(ref2, err2)}
    if missing:
        problems.append(f"{len(missing)} quantized weight(s) not in the --verify source, e.g. {missing[0]}")
    measured = {k: v for k, v in layers.items() if "rel_error" in v}
    overall = None
    if measured:
        worst = max(measured, key=lambda k: measured[k]["rel_error"])
        overall = {
            "layers": len(measured),
            "mean_rel_error": sum(v["rel_error"] for v in measured.values()) / len(measured),
            "worst_layer": worst,
            "worst_rel_error": measured[worst]["rel_error"],
            "snr_db": _snr(sum_ref2, sum_err2),
        }
        over = sorted((k for k, v in measured.items() if v["rel_error"] > max_error),
                      key=lambda k: -measured[k]["rel_error"])
        if over:
            problems.append(f"{len(over)} layer(s) exceed --max-error {max_error}: worst {over[0]} "
                            f"rel.err {measured[over[0]]['rel_error']:.4f}")
    elif layout.modules:
        problems.append("--verify compared no layer")
    return {"source": src, "fingerprint": fingerprint, "max_error": max_error, "layers": layers,
            "overall": overall, "problems": problems, "passed": not problems}


def _smoothing_factors(manifest: dict | None, original: Source, orig: dict, output: Source) -> dict[str, torch.Tensor]:
    """module -> the per-channel factor its columns carry (W4A4 GPTQ's ``--smooth``: the manifest's
    ``method.smoothed``, from the norm weights of the source and of the output); {} without."""
    smoothed = ((manifest or {}).get("method") or {}).get("smoothed") or {}
    if not smoothed or not isinstance(smoothed, dict):
        return {}
    from fp4convert.calibrate.smooth import factor

    out = {t.name: t for t in output.tensors()}
    got: dict[str, torch.Tensor] = {}
    for key, rec in smoothed.items():
        if key not in orig or key not in out:
            continue
        before = read_tensor(original.local_path(orig[key].file), orig[key])
        after = read_tensor(output.local_path(out[key].file), out[key])
        f = factor(before, after, bool(rec.get("offset")))
        for module in rec.get("readers", []):
            got[module] = f
    return got


def _snr(ref2: float, err2: float) -> float:
    if err2 == 0:
        return math.inf
    if ref2 == 0:
        return -math.inf
    return 10 * math.log10(ref2 / err2)
