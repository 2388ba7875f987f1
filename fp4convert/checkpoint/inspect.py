"""Reading quantized checkpoints back: recognise the format, check it, and give a verdict.

Default checks read headers, config files and the tiny global-scale tensors only, so they are fast on
a 100 GB checkpoint: tensor shapes and dtypes against the scheme, fused groups sharing one global
scale, the engine config (compressed-tensors / ModelOpt / native ``quantization_config``) against the
tensors, and the manifest against the files (every file listed, sizes, recorded scales and settings).
``check_files`` also reads the data (sha256 of every file, every block scale); ``verify`` dequantizes
every weight and compares it with the source model (per-layer and overall error, a threshold), after
checking that the source is the one the manifest names.

The verdict is ``ok`` (every check passed), ``failed`` (the report lists why) or ``not quantized``
(no FP4 weights at all); only ``ok`` exits 0 in the CLI.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict

import torch

from fp4convert.checkpoint.engine_config import check_engine_config
from fp4convert.checkpoint.layout import (
    CheckpointLayout,
    find_modules,
    manifest_disagreements,
    module_shape_problems,
    read_global,
    read_layout,
)
from fp4convert.checkpoint.verify import FAILED, NOT_QUANTIZED, OK, add_total, natural_key, verify_against
from fp4convert.formats import OUTPUT_FORMATS, all_formats, get_format, quantized_tensor_names
from fp4convert.formats.base import read_json
from fp4convert.numerics.scheme import get_scheme
from fp4convert.numerics.swizzle import padded_shape
from fp4convert.output.describe import activations_of
from fp4convert.output.manifest import MANIFEST_NAME, PROGRESS_NAME
from fp4convert.plan.knowledge import fused_group
from fp4convert.run.progress import progress_bar
from fp4convert.source.open import open_source
from fp4convert.source.source import Source
from fp4convert.storage import checksum
from fp4convert.storage.reads import open_regular, read_regular_file, read_tensor

# --verify fails when any layer's relative error ||w - x|| / ||x|| exceeds this. Measured (1024x1024,
# bf16): NVFP4 0.088-0.102 and MXFP4 0.114-0.145 on Gaussian, Laplace, Student-t(3) and outlier-laden
# weights, with or without had16; the example checkpoint's worst layer: 0.0875 (NVFP4), 0.1126 (MXFP4 had16,
# README, tests/docs/test_readme_figures.py). A wrong
# source of the same shapes gives ~1.4 (independent weights: sqrt 2), zeroed weights 1.0. 0.25 is 1.7x
# the worst MXFP4 figure and 4x below a wrong source.

CARD_MARKER = "<!-- fp4convert:card-start -->"


# ---------------------------------------------------------------------------------------------
# Layout (with a fallback for quantized tensors whose folder says nothing about its format)
# ---------------------------------------------------------------------------------------------

def _guess_layout(source: Source, layout: CheckpointLayout) -> CheckpointLayout | None:
    """FP4 tensors in a folder with no manifest and no quantization config: find the format by names."""
    if not quantized_tensor_names(list(layout.tensors.values())):
        return None
    best = None
    for fmt in all_formats():
        modules, problems = find_modules(fmt, layout.tensors, None)
        if not modules:
            continue
        if any(o.name != fmt.name and (o.packed_suffix, o.scale_suffix) == (fmt.packed_suffix, fmt.scale_suffix)
               for o in all_formats()):  # another format writes the same names: the scale layout tells
            m = next(iter(modules.values()))
            nb = m.shape[-1] // get_scheme(m.scheme).block_size
            swizzled = tuple(m.scale.shape[-2:]) == padded_shape(m.shape[-2], nb) != (m.shape[-2], nb)
            if swizzled != fmt.swizzled:
                continue
        if best is None or len(modules) > len(best[1]):
            best = (fmt, modules, problems)
    if best is None:
        return None
    fmt, modules, problems = best
    used = {t.name for m in modules.values() for t in m.tensors}
    schemes = {m.scheme for m in modules.values()}
    return CheckpointLayout(fmt.name, schemes.pop() if len(schemes) == 1 else None, None, modules,
                            [t for n, t in layout.tensors.items() if n not in used], layout.tensors, None,
                            [*layout.problems, *problems])


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------

def inspect_checkpoint(path_or_repo: str, *, check_files: bool = False, verify: str | None = None,
                       revision: str | None = None, max_error: float | None = None, max_ratio: float | None = None,
                       verify_revision: str | None = None, token: str | None = None, progress: bool = False) -> dict:
    """Everything ``fp4convert inspect`` reports, as a dict (``ok`` is True only for a sound quantized checkpoint).

    ``progress``: show the progress (:mod:`fp4convert.run.progress`) of the long parts (the sha256 of
    --check-files, the layers of --verify), in bytes, their totals added as they become known."""
    with progress_bar(0, "inspect", progress) as bar:
        return _report(path_or_repo, check_files=check_files, verify=verify, revision=revision, max_error=max_error,
                       max_ratio=max_ratio, verify_revision=verify_revision, token=token,
                       progress=bar if progress else None)


def _report(path_or_repo: str, *, check_files: bool = False, verify: str | None = None,
            revision: str | None = None, max_error: float | None = None, max_ratio: float | None = None,
            verify_revision: str | None = None, token: str | None = None, progress=None) -> dict:
    """:func:`inspect_checkpoint`'s report; ``progress``: an object with ``total`` and ``update(n)`` (the
    display) that the long parts advance in bytes; their totals are added to ``total`` when known."""
    source = open_source(path_or_repo, revision, token=token)
    manifest_errors: list[str] = []
    layout = read_layout(source, manifest_errors=manifest_errors)
    notes: list[str] = []
    if not layout.quantized:
        guessed = _guess_layout(source, layout)
        if guessed is not None:
            notes.append(f"no {MANIFEST_NAME} and no quantization config: format {guessed.format} recognised "
                         "from the tensor names and scale shapes")
            layout = guessed
    problems = [*manifest_errors, *layout.problems]
    globals_: dict[str, float] = {}
    stored: dict[str, torch.Tensor] = {}  # the global tensors as stored (ModelOpt: 1/gs)
    for m in layout.modules.values():
        problems += module_shape_problems(m)
        if get_scheme(m.scheme).global_scale and m.global_ is not None and m.global_.dtype == "F32":
            g = read_global(source, layout, m)
            bad = ~torch.isfinite(g) | (g <= 0)
            if bool(bad.any()):
                problems.append(f"{m.module}: global scale {g.flatten()[:4].tolist()} is not finite and positive")
            globals_[m.module] = g.flatten()[0].item() if g.numel() == 1 else float("nan")
            stored[m.module] = read_tensor(source.local_path(m.global_.file), m.global_).flatten()

    # Fused groups must share one global scale (docs/numerics.md#fused-groups-share-one-global-scale).
    groups: dict[str, list[str]] = defaultdict(list)
    for name in list(layout.modules) + [t.name[: -len(".weight")] for t in layout.kept if t.name.endswith(".weight")]:
        g = fused_group(name + ".weight")
        if g:
            groups[g].append(name)
    if layout.quantized:
        for g, members in sorted(groups.items()):
            q = [m for m in members if m in layout.modules]
            if q and len(q) != len(members):
                problems.append(f"fused group {g} is partly quantized: {sorted(set(members) - set(q))} kept")
            vals = {globals_.get(m) for m in q if m in globals_}
            if len(vals) > 1:
                problems.append(f"fused group {g} has {len(vals)} different global scales (engines need one)")

    manifest = layout.manifest
    manifest_state = "malformed (see the problems)" if manifest_errors else _manifest_state(source, layout)
    if manifest_state.startswith("missing"):
        problems.append(f"{MANIFEST_NAME} is {manifest_state}")
    if manifest:
        problems += _check_against_manifest(manifest, layout, stored)
    engine = check_engine_config(source, layout) if layout.quantized else []
    problems += engine
    problems += quantized_routers(source, layout)
    act_warnings: list[str] = []
    problems += check_activation_scales(source, layout, act_warnings) if layout.quantized else []
    checksums = _check_files(source, manifest, layout, problems, full=check_files, progress=progress)
    report = _summary(source, layout, globals_, groups)
    report["warnings"] = act_warnings
    serving = get_format(layout.format).serving_warning(layout.rotate) if layout.format in OUTPUT_FORMATS else None
    if serving:  # e.g. transformers ignores compressed-tensors' transform_config (the issue 23 campaign: cosine ~0)
        report["warnings"].append(serving)
    report["checks"] = {
        "problems": problems,
        "notes": notes,
        "manifest": manifest_state,
        "engine_config": ("agrees with the tensors" if not engine else f"{len(engine)} disagreement(s)")
        if layout.quantized else "n/a",
        "block_scales_checked": check_files and layout.quantized,
        "checksums": checksums,
    }
    if verify:
        v = verify_against(source, layout, verify, max_error=max_error, max_ratio=max_ratio, revision=verify_revision,
                           token=token, progress=progress)
        report["verify"] = v
        problems += v["problems"]
    if not layout.quantized:
        report["verdict"] = NOT_QUANTIZED
    else:
        report["verdict"] = FAILED if problems else OK
    report["ok"] = report["verdict"] == OK
    return report


def quantized_routers(source: Source, layout: CheckpointLayout) -> list[str]:
    """MoE routers stored in FP4: vLLM and SGLang build routers unquantized and fail to load them ("Tried to
    load weights of size [E, H] to a parameter of size [E, H/2]"); they belong in the ignore list."""
    from fp4convert.plan.name_roles import role_of

    cfg = source.config()
    return [f"{m}: a MoE router stored in FP4 ({', '.join(t.name for t in q.tensors)}); engines load routers "
            "unquantized and refuse it: keep it in higher precision and list it in the ignore list"
            for m, q in sorted(layout.modules.items()) if role_of(m + ".weight", q.shape, cfg) == "router"]


def check_activation_scales(source: Source, layout: CheckpointLayout, warnings: list[str] | None = None) -> list[str]:
    """W4A4 (docs/formats.md "W4A4"): every quantized layer has a finite positive activation scale, and
    the members of each fused group (q/k/v, gate/up; per MoE layer all experts' w13, all experts' w2)
    share it. W4A4 is what the checkpoint declares: compressed-tensors NVFP4 ``input_activations``
    (``dynamic: local``), a ModelOpt ``config.json`` group with ``input_activations``, a manifest
    ``activations`` section, or any stored activation scale. A weight-only ModelOpt file (no input
    scale at all) is not judged here. A W4A4 layer without a scale is a problem (FAILED).

    fp4convert writes one value per MoE layer's w13 and w2; other tools calibrate each expert on its own
    tokens, and the engines reduce them (vLLM's FlashInfer MoE takes their max): in a checkpoint fp4convert
    did not write (no manifest), experts that differ are a warning (``warnings``), not a problem."""
    import re

    if layout.format not in OUTPUT_FORMATS:
        return []  # an unquantized checkpoint: no activation scales to check
    fmt = get_format(layout.format)
    suffix = getattr(fmt, "input_suffix", "")
    if not suffix:
        return []
    qc = source.config().get("quantization_config") or {}
    groups = qc.get("config_groups") if isinstance(qc, dict) else None  # wrong types are reported elsewhere
    acts = [g.get("input_activations") for g in (groups.values() if isinstance(groups, dict) else ())
            if isinstance(g, dict)]
    declared = any(isinstance(a, dict) and a.get("num_bits") == 4 and a.get("dynamic") in ("local", False)
                   for a in acts)
    m_acts = (layout.manifest or {}).get("activations") or {}
    declared = declared or m_acts.get("scheme") == "nvfp4"
    scales = {n[: -len(suffix)]: t for n, t in layout.tensors.items() if n.endswith(suffix)}
    if not declared and not scales:
        return []
    problems: list[str] = []
    values: dict[str, float] = {}
    for module, m in sorted(layout.modules.items()):
        if m.scheme != "nvfp4":
            continue
        t = scales.get(module)
        if t is None:
            problems.append(f"{module}: W4A4 layer without an activation scale ({module + suffix}); engines would "
                            "run it with an uninitialised scale")
            continue
        if t.dtype != "F32":
            problems.append(f"{module + suffix}: dtype {t.dtype}, engines read F32")
            continue
        v = read_tensor(source.local_path(t.file), t).flatten()
        if v.numel() == 0 or not bool((torch.isfinite(v) & (v > 0)).all()):
            problems.append(f"{module + suffix}: activation scale {v[:4].tolist()} is not finite and positive")
            continue
        if bool((v != v[0]).any()):
            problems.append(f"{module + suffix}: differs across its experts (engines use one value)")
        values[module] = v[0].item()
    share: dict[str, list[str]] = defaultdict(list)
    expert = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|w1|w3|down_proj|w2)$")
    for module in values:
        hit = expert.match(module)
        g = (f"{hit.group(1)}:{'w2' if hit.group(2) in ('down_proj', 'w2') else 'w13'}" if hit
             else fused_group(module + ".weight"))
        if g:
            share[g].append(module)
    for g, members in sorted(share.items()):
        n = len({values[m] for m in members})
        if n > 1 and g.endswith((":w13", ":w2")) and layout.manifest is None:
            if warnings is not None:
                warnings.append(f"the experts of {g} have {n} different activation scales (e.g. "
                                f"{sorted(members)[0] + suffix}); the engines use one per layer (vLLM's FlashInfer "
                                "MoE takes their max)")
        elif n > 1:
            problems.append(f"fused group {g} has {n} different activation scales (engines take one; members must "
                            "share it)")
    return problems


def _manifest_state(source: Source, layout: CheckpointLayout) -> str:
    """'present', 'not expected' (a folder another tool wrote), or 'missing (...)' for an fp4convert output."""
    if layout.manifest is not None:
        return "present"
    # A Hub source's root is its snapshot of the small files: the same signs apply.
    hints = [why for why, hit in (
        ("an interrupted conversion: its progress record is there; rerun with --resume",
         (source.root / PROGRESS_NAME).exists()),
        ("config.json names fp4convert",
         (source.config().get("quantization_config") or {}).get("quant_method") == "fp4convert"),
        ("hf_quant_config.json names fp4convert as producer",
         _producer_name(read_json(source.root / "hf_quant_config.json")) == "fp4convert"),
        ("README.md is an fp4convert model card", CARD_MARKER in _small_text(source, "README.md")),
    ) if hit]
    if layout.format in OUTPUT_FORMATS and get_format(layout.format).described_by_manifest and not hints:
        hints = ["the native format is described by its manifest"]
    return f"missing ({'; '.join(hints)})" if hints else "not expected (not an fp4convert output)"


def _producer_name(obj: dict) -> object:
    p = obj.get("producer")
    return p.get("name") if isinstance(p, dict) else None


def _check_against_manifest(manifest: dict, layout: CheckpointLayout, stored: dict[str, torch.Tensor]) -> list[str]:
    """Every tensor the manifest promises is on disk as promised, and the settings match the tensors."""
    return manifest_disagreements(manifest, layout, stored)


def _check_files(source: Source, manifest: dict | None, layout: CheckpointLayout, problems: list[str],
                 full: bool, progress=None) -> str:
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
    if manifest is None:
        return "no manifest"
    if source.is_hub:
        return "not checked (Hub source)"
    bad = 0
    listed = manifest.get("files", {})
    if full:
        add_total(progress, sum(rec["size"] for rec in listed.values()))
    for rel, rec in sorted(listed.items()):
        # Only a relative path resolving to a regular file inside the folder is stat'ed or read (the
        # manifest schema already refused absolute paths and '..'; symlinks out are refused here).
        why = _not_inside(source, rel)
        if why:
            problems.append(f"{rel}: listed in {MANIFEST_NAME} but {why}; not read")
            bad += 1
            continue
        p = source.root / rel
        try:
            fd = open_regular(p)
        except FileNotFoundError:
            problems.append(f"{rel}: listed in {MANIFEST_NAME} but missing")
            bad += 1
            continue
        except OSError as exc:
            problems.append(f"{rel}: listed in {MANIFEST_NAME} but cannot be read ({exc.strerror or exc})")
            bad += 1
            continue
        with open(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != rec["size"]:
                problems.append(f"{rel}: size {size}, manifest says {rec['size']}")
                bad += 1
            elif full and not checksum.matches(f, rec, progress):
                problems.append(f"{rel}: sha256 differs from {MANIFEST_NAME}")
                bad += 1
    for rel in _walk(source.root):
        if rel not in listed and rel != MANIFEST_NAME and not _hidden(rel):
            problems.append(f"{rel}: not listed in {MANIFEST_NAME} (added after the conversion?)")
            bad += 1
    what = "sha256" if full else "size"
    if bad:
        return f"{bad} of {len(listed)} file(s) fail the {what} check"
    return "sha256 verified" if full else "sizes verified (sha256 with --check-files)"


def _not_inside(source: Source, rel: str) -> str | None:
    """Why ``rel`` is not a file inside the checkpoint folder (None when it is, or does not exist)."""
    p = source.root / rel
    if not os.path.lexists(p):
        return None
    real = os.path.realpath(p)
    if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in source.roots):
        return "it resolves outside the checkpoint folder"
    return None


def _small_text(source: Source, rel: str, limit: int = 16 << 20) -> str:
    """A small file of the folder as text ("" when absent, outside the folder, special or unreadable)."""
    if not os.path.lexists(source.root / rel) or _not_inside(source, rel):
        return ""
    try:
        return read_regular_file(source.root / rel, limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _walk(root) -> list[str]:
    """Every entry under ``root`` that is not a folder (symlinks included, never followed), relative."""
    out = []
    for d, dirs, files in os.walk(root, followlinks=False):
        rel_d = os.path.relpath(d, root)
        for name in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            out.append(name if rel_d == "." else f"{rel_d}/{name}".replace(os.sep, "/"))
    return sorted(out)


def _hidden(rel: str) -> bool:
    return rel.startswith(".") or "/." in rel


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


def _activation_scales(layout: CheckpointLayout) -> dict[str, object]:
    """The W4A4 activation scales among the kept tensors (the format names them: its ``input_suffix``),
    by module: part of a quantized module, not kept tensors."""
    suffix = get_format(layout.format).input_suffix if layout.quantized else ""
    if not suffix:
        return {}
    return {t.name: t for t in layout.kept if t.name.endswith(suffix) and t.name[: -len(suffix)] in layout.modules}


def _summary(source: Source, layout: CheckpointLayout, globals_: dict[str, float], groups: dict) -> dict:
    acts = _activation_scales(layout)
    kept_list = [t for t in layout.kept if t.name not in acts]
    q_params = sum(math.prod(m.shape) for m in layout.modules.values())
    kept_params = sum(t.numel for t in kept_list)
    q_bytes = sum(t.nbytes for m in layout.modules.values() for t in (m.packed, m.scale, m.global_) if t) + \
        sum(t.nbytes for t in acts.values())  # type: ignore[attr-defined]
    kept_bytes = sum(t.nbytes for t in kept_list)
    layers: dict[str, dict] = defaultdict(lambda: {"quantized": 0, "kept": 0, "bytes": 0})
    for m in layout.modules.values():
        key = (_LAYER.match(m.module + ".") or [None, "(other)"])[1]
        layers[key]["quantized"] += 1
        layers[key]["bytes"] += sum(t.nbytes for t in (m.packed, m.scale, m.global_) if t)
    for t in layout.kept:
        key = (_LAYER.match(t.name) or [None, "(other)"])[1]
        layers[key]["kept" if t.name not in acts else "quantized"] += 0 if t.name in acts else 1
        layers[key]["bytes"] += t.nbytes
    activations = activations_of(layout.manifest)
    if activations is None and acts:  # no manifest: the stored scales say W4A4 (their calibration is unknown)
        activations = {"scheme": "nvfp4", "scales": "stored", "calibration": None}
    return {
        "path": source.label,
        "format": layout.format,
        "scheme": layout.scheme,
        "rotate": layout.rotate,
        # The block-scale rule the error below was achieved with (recorded by fp4convert; None if unknown).
        "scale_rule": (layout.manifest or {}).get("scale_rule") or ((layout.manifest or {}).get("settings") or {}).get(
            "scale_rule"),
        # Input-weighted scale rules: what the weights were measured on (the manifest's identity; None: unweighted).
        "input_weights": _input_weights(layout.manifest),
        "method": _method(layout.manifest),
        # W4A4 (None: weight-only): the activations' scheme, how their scales were had, the calibration.
        "activations": activations if layout.quantized else None,
        "quantized": len(layout.modules),
        "kept": len(kept_list),  # tensors left unquantized (activation scales are part of the quantized layers)
        "activation_scales": len(acts),
        "fused_groups": len(groups),
        "bytes": q_bytes + kept_bytes,
        "params": q_params + kept_params,
        "bits_per_param_quantized": round(8 * q_bytes / q_params, 4) if q_params else None,
        "bits_per_param": round(8 * (q_bytes + kept_bytes) / (q_params + kept_params), 4) if q_params + kept_params else None,
        "layers": dict(sorted(layers.items(), key=lambda kv: natural_key(kv[0]))),
        "global_scales": globals_,
    }


def _method(manifest: dict | None) -> dict | None:
    """A calibrated method's manifest record, as the report shows it (None: round-to-nearest)."""
    rec = (manifest or {}).get("method")
    if not isinstance(rec, dict) or not isinstance(rec.get("method"), str):
        return None
    # any method's record: its scalars and the calibration as they are; another list or mapping as it is when short
    # enough to read, else by its number of entries (every smoothed norm of a model, say)
    return {k: v if not isinstance(v, (dict, list)) or k == "calibration" or len(json.dumps(v)) <= 400
            else f"{len(v)} entries" for k, v in rec.items()}


def _input_weights(manifest: dict | None) -> dict | None:
    rec = ((manifest or {}).get("identity") or {}).get("input_weights")
    if not isinstance(rec, dict):
        return None
    keep = ("source", "samples", "seq_len", "seed", "data", "rotated", "weighted", "unweighted", "sha256")
    return {k: rec[k] for k in keep if k in rec}


def describe_input_weights(w: dict) -> str:
    src = w.get("source")
    tokens = f"{w.get('samples')} x {w.get('seq_len')} tokens"
    if src == "random":
        what = f"random token ids ({tokens}, seed {w.get('seed')})"
    else:
        data = w.get("data") if isinstance(w.get("data"), dict) else {}
        what = (f"calibration {data.get('name') or data.get('source') or '?'} ({tokens}"
                + (f", seed {w.get('seed')}" if data.get("source") == "self-generated" else "") + ")")
    unweighted = w.get("unweighted") or []
    return (f"per-channel input mean squares on {what}; {w.get('weighted')} matrices weighted"
            + (f", {len(unweighted)} unweighted" if unweighted else "")
            + (f"; sha256 {str(w['sha256'])[:12]}" if w.get("sha256") else ""))
