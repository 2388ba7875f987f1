"""``inspect --verify SRC``: every dequantized weight against the source it was converted from, after checking
that SRC is that source (its fingerprint and structure against the manifest's record), judged by a criterion
that fits how the weights were rounded (:class:`Criterion`).

Every layer's relative error ``||w - x|| / ||x||`` is measured beside the error of round-to-nearest on the
same weights (``rtn_rel_error``: the data-free quantizer run here on the source, with the checkpoint's
scheme, rotation, scale rule and fused-group global scale), and their ratio ``vs_rtn``. Round-to-nearest
output is judged by the error itself (``--max-error``); a calibrated method (GPTQ) trades weight error for
output error by design, so its output is judged by the ratio (``--max-ratio``, a budget per method
measured on real models: docs/numerics.md "What inspect --verify accepts of a GPTQ checkpoint").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from fp4convert.checkpoint.layout import CheckpointLayout, load_quantized
from fp4convert.errors import SourceError
from fp4convert.kernels.tensor import dequantize
from fp4convert.source.open import open_source
from fp4convert.source.source import Source
from fp4convert.storage.reads import read_tensor

if TYPE_CHECKING:
    from fp4convert.kernels.tensor import Rotation

DEFAULT_MAX_ERROR = 0.25  # round-to-nearest: the measurements behind it are in checkpoint/inspect.py
# A calibrated method's layer fails when its error exceeds round-to-nearest's on the same weights by more than its
# method's budget (the method module's ``RATIO_BUDGET``, fp4convert/calibrate/methods/; docs/numerics.md "What
# inspect --verify accepts of a GPTQ checkpoint"); a method this version does not know gets the largest one.
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


@dataclass(frozen=True)
class Criterion:
    """How ``--verify`` judges each layer: ``max_error`` (the relative error itself) and/or ``max_ratio``
    (the relative error over round-to-nearest's on the same weights); None: not judged that way."""

    method: str  # "rtn" (data-free, or unknown: no manifest) or the calibrated method's name
    w4a4: bool
    max_error: float | None
    max_ratio: float | None

    def describe(self) -> str:
        parts = []
        if self.max_error is not None:
            parts.append(f"rel.err <= {self.max_error:g}")
        if self.max_ratio is not None:
            parts.append(f"rel.err <= {self.max_ratio:g} x round-to-nearest's")
        return " and ".join(parts)

    def over(self, layer: dict) -> list[str]:
        """The limits a measured layer exceeds ("max-error", "max-ratio"; [] when it passes)."""
        return [name for name, limit, value in (("max-error", self.max_error, layer["rel_error"]),
                                                ("max-ratio", self.max_ratio, layer["vs_rtn"]))
                if limit is not None and value > limit]

    def problems(self, measured: dict[str, dict]) -> list[str]:
        """One line per limit some layers exceed, naming the worst of them."""
        out = []
        for name, key in (("max-error", "rel_error"), ("max-ratio", "vs_rtn")):
            over = sorted((k for k, v in measured.items() if name in self.over(v)), key=lambda k: -measured[k][key])
            if not over:
                continue
            w = measured[over[0]]
            limit = self.max_error if name == "max-error" else self.max_ratio
            why = "" if name == "max-error" else f" (x round-to-nearest's error on the same weights; {self.method} output)"
            out.append(f"{len(over)} layer(s) exceed --{name} {limit:g}{why}: worst {over[0]} rel.err "
                       f"{w['rel_error']:.4f}, {w['vs_rtn']:.2f} x round-to-nearest's {w['rtn_rel_error']:.4f}")
        return out


def criterion(manifest: dict | None, max_error: float | None = None, max_ratio: float | None = None) -> Criterion:
    """The criterion for a checkpoint: what was asked (``max_error`` / ``max_ratio``, either or both), else
    the method's own: round-to-nearest by its error (``DEFAULT_MAX_ERROR``), a calibrated method by its
    ratio budget (:func:`ratio_budget`)."""
    from fp4convert.config import RTN

    rec = (manifest or {}).get("method")
    calibrated = isinstance(rec, dict) and isinstance(rec.get("method"), str)
    method = rec["method"] if calibrated and rec is not None else RTN
    w4a4 = isinstance((manifest or {}).get("activations"), dict)
    if max_error is not None or max_ratio is not None:
        return Criterion(method, w4a4, max_error, max_ratio)
    if not calibrated:
        return Criterion(method, w4a4, DEFAULT_MAX_ERROR, None)
    return Criterion(method, w4a4, None, ratio_budget(method, w4a4))


def ratio_budget(method: str, w4a4: bool) -> float:
    """A calibrated method's verify budget (its module's ``RATIO_BUDGET``: W4A4 -> the factor over round-to-nearest's
    error); a method this version does not know gets the largest budget any method has."""
    from fp4convert.calibrate.methods import get_method, method_names

    budgets = {n: getattr(get_method(n), "RATIO_BUDGET", {}) for n in method_names()}
    own = budgets.get(method, {})
    return own.get(w4a4, max((b for bs in budgets.values() for b in bs.values()), default=DEFAULT_RATIO))


DEFAULT_RATIO = 5.0  # (a method that states no budget at all)


def natural_key(s: str) -> list:
    """Numbers in a name compare as numbers (layers.2 before layers.10); by length, then digits: int() of a
    5000-digit layer number in a crafted tensor name raises ValueError (Python's int-string limit)."""
    return [(len(t.lstrip("0")), t.lstrip("0")) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", s))]


def verify_against(source: Source, layout: CheckpointLayout, src: str, *, max_error: float | None = None,
                   max_ratio: float | None = None, revision: str | None = None, token: str | None = None,
                   progress=None) -> dict:
    """Dequantize every quantized weight and compare it with the original: per layer and overall.

    Fails (``problems``) when SRC is not the source the manifest names, when a quantized weight is
    missing from SRC or has another shape, or when a layer fails the :func:`criterion`.
    """
    judge = criterion(layout.manifest, max_error, max_ratio)
    base = {"source": src, "method": judge.method, "criterion": judge.describe(), "max_error": judge.max_error,
            "max_ratio": judge.max_ratio}
    try:
        original = open_source(src, revision, token=token)
    except SourceError as exc:
        return {**base, "layers": {}, "overall": None, "fingerprint": "n/a", "problems": [f"--verify: {exc}"],
                "passed": False}
    orig = {t.name: t for t in original.tensors()}
    fingerprint, problems = _fingerprint_check(layout.manifest, original)
    problems += _structure_check(layout.manifest, orig)
    add_total(progress, sum(orig[m + ".weight"].nbytes for m in layout.modules if m + ".weight" in orig))
    layers, sums = _compare(source, layout, original, orig, progress, problems)
    layers = dict(sorted(layers.items(), key=lambda kv: natural_key(kv[0])))
    missing = [m for m, e in layers.items() if e.get("error") == NOT_IN_SOURCE]
    if missing:
        problems.append(f"{len(missing)} quantized weight(s) not in the --verify source, e.g. {missing[0]}")
    measured = {k: v for k, v in layers.items() if "rel_error" in v}
    overall = _overall(measured, *sums) if measured else None
    if measured:
        problems += judge.problems(measured)
    elif layout.modules:
        problems.append("--verify compared no layer")
    return {**base, "fingerprint": fingerprint, "layers": layers, "overall": overall, "problems": problems,
            "passed": not problems}


NOT_IN_SOURCE = "not in the source checkpoint"


def _overall(measured: dict[str, dict], sum_err2: float, sum_ref2: float) -> dict:
    worst = max(measured, key=lambda k: measured[k]["rel_error"])
    worst_ratio = max(measured, key=lambda k: measured[k]["vs_rtn"])
    return {
        "layers": len(measured),
        "mean_rel_error": sum(v["rel_error"] for v in measured.values()) / len(measured),
        "worst_layer": worst,
        "worst_rel_error": measured[worst]["rel_error"],
        "worst_vs_rtn_layer": worst_ratio,
        "worst_vs_rtn": measured[worst_ratio]["vs_rtn"],
        "snr_db": _snr(sum_ref2, sum_err2),
    }


def _compare(source: Source, layout: CheckpointLayout, original: Source, orig: dict, progress,
             problems: list[str]) -> tuple[dict[str, dict], tuple[float, float]]:
    """Every quantized module against the source, a fused group at a time (its members' round-to-nearest
    shares one global scale, as the conversion's did): {module: its figures or error}, (sum err^2, sum x^2)."""
    carried = _smoothing_factors(layout.manifest, original, orig, source)
    rule = _rtn_rule(layout)
    layers: dict[str, dict] = {}
    sums = [0.0, 0.0]
    for members in _fused(layout):
        xs: dict[str, torch.Tensor] = {}
        for m in members:
            info = orig.get(m + ".weight")
            if info is None:
                layers[m] = {"error": NOT_IN_SOURCE}
                continue
            x = read_tensor(original.local_path(info.file), info).to(torch.float32)
            if progress is not None:
                progress.update(info.nbytes)
            xs[m] = x * carried[m] if m in carried else x  # (--smooth: the columns carry the factor their norm gave up)
        group_amax = _group_amax(xs, layout)
        for m, x in xs.items():
            w = dequantize(load_quantized(source, layout, layout.modules[m]), torch.float32)
            if w.shape != x.shape:
                layers[m] = {"error": f"shape {list(w.shape)} vs source {list(x.shape)}"}
                problems.append(f"{m}: dequantized shape {list(w.shape)}, source {list(x.shape)}")
                continue
            rtn = _round_to_nearest(x, layout, layout.modules[m].scheme, rule, group_amax.get(m))
            err2, ref2 = _sq(w - x), _sq(x)
            sums[0] += err2
            sums[1] += ref2
            rel, rtn_rel = _rel(err2, ref2), _rel(_sq(rtn - x), ref2)
            layers[m] = {"rel_error": rel, "snr_db": _snr(ref2, err2), "rtn_rel_error": rtn_rel,
                         "vs_rtn": rel / rtn_rel if rtn_rel else (1.0 if rel == 0 else math.inf)}
    return layers, (sums[0], sums[1])


def _sq(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


def _rel(err2: float, ref2: float) -> float:
    return math.sqrt(err2 / ref2) if ref2 else (0.0 if err2 == 0 else math.inf)


def _fused(layout: CheckpointLayout) -> list[list[str]]:
    """The quantized modules, grouped as they share a global scale: the manifest's ``groups`` (what the
    conversion fused), else the names' fused groups; every other module on its own."""
    of: dict[str, str] = {}
    groups = (layout.manifest or {}).get("groups")
    if isinstance(groups, dict):
        for g, names in groups.items():
            for n in names if isinstance(names, list) else ():
                if isinstance(n, str) and n.endswith(".weight"):
                    of[n[: -len(".weight")]] = str(g)
    else:
        from fp4convert.plan.knowledge import fused_group

        for m in layout.modules:
            g = fused_group(m + ".weight")
            if g:
                of[m] = g
    out: dict[str, list[str]] = {}
    for m in layout.modules:
        out.setdefault(of.get(m, "\0" + m), []).append(m)
    return list(out.values())


def _group_amax(xs: dict[str, torch.Tensor], layout: CheckpointLayout) -> dict[str, torch.Tensor]:
    """NVFP4: each member's global-scale amax, the max over the members of its fused group (of the rotated
    values with a rotation), per matrix; {} for a scheme without a global scale."""
    from fp4convert.kernels.tensor import amax
    from fp4convert.numerics.scheme import get_scheme

    rotate = cast("Rotation | None", layout.rotate)
    own = {m: amax(x, rotate=rotate) for m, x in xs.items()
           if get_scheme(layout.modules[m].scheme).global_scale and x.dim() >= 2}
    lead = {tuple(a.shape) for a in own.values()}
    if len(lead) != 1:  # (members of other leading shapes: each keeps its own)
        return own
    shared = torch.stack(list(own.values())).amax(0)
    return {m: shared for m in own}


def _rtn_rule(layout: CheckpointLayout) -> str | None:
    """The scale rule round-to-nearest runs with here: the checkpoint's (unweighted: input weights measured
    on data are not at hand), None (the scheme's default) when nothing records one."""
    m = layout.manifest or {}
    rule = (m.get("settings") or {}).get("scale_rule") or m.get("scale_rule")
    return rule if isinstance(rule, str) else None


def _round_to_nearest(x: torch.Tensor, layout: CheckpointLayout, scheme: str, rule: str | None,
                      group_amax: torch.Tensor | None) -> torch.Tensor:
    """What the data-free quantizer makes of ``x``, dequantized (the same bytes a data-free conversion
    with these settings writes)."""
    from fp4convert.kernels.tensor import quantize
    from fp4convert.numerics.scheme import get_scheme

    s = get_scheme(scheme)
    rule = rule if rule in s.scale_rules else None
    q = quantize(x, s, rotate=cast("Rotation | None", layout.rotate), global_amax=group_amax, scale_rule=rule)
    return dequantize(q, torch.float32)


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
