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

import math
import os
import re
from collections import defaultdict

import torch

from fp4convert.checkpoint.layout import (
    CheckpointLayout,
    find_modules,
    load_quantized,
    manifest_disagreements,
    module_shape_problems,
    read_global,
    read_layout,
)
from fp4convert.config import human_bytes
from fp4convert.errors import SourceError
from fp4convert.formats import all_formats, get_format, quantized_tensor_names
from fp4convert.formats.base import read_json
from fp4convert.kernels.tensor import dequantize
from fp4convert.numerics.scheme import get_scheme
from fp4convert.numerics.swizzle import padded_shape
from fp4convert.output.describe import activations_of, describe_activations
from fp4convert.output.manifest import MANIFEST_NAME, PROGRESS_NAME
from fp4convert.plan.planner import fused_group
from fp4convert.run.progress import progress_bar
from fp4convert.source.open import open_source
from fp4convert.source.source import Source
from fp4convert.storage import checksum
from fp4convert.storage.reads import open_regular, read_regular_file, read_tensor

# --verify fails when any layer's relative error ||w - x|| / ||x|| exceeds this. Measured (1024x1024,
# bf16): NVFP4 0.088-0.102 and MXFP4 0.114-0.145 on Gaussian, Laplace, Student-t(3) and outlier-laden
# weights, with or without had16; the example checkpoint's worst layer: 0.0875 (NVFP4), 0.1126 (MXFP4 had16,
# README, tests/test_readme_figures.py). A wrong
# source of the same shapes gives ~1.4 (independent weights: sqrt 2), zeroed weights 1.0. 0.25 is 1.7x
# the worst MXFP4 figure and 4x below a wrong source.
DEFAULT_MAX_ERROR = 0.25

OK, FAILED, NOT_QUANTIZED = "ok", "failed", "not quantized"
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
                       revision: str | None = None, max_error: float = DEFAULT_MAX_ERROR,
                       verify_revision: str | None = None, token: str | None = None, progress: bool = False) -> dict:
    """Everything ``fp4convert inspect`` reports, as a dict (``ok`` is True only for a sound quantized checkpoint).

    ``progress``: show the progress (:mod:`fp4convert.run.progress`) of the long parts (the sha256 of
    --check-files, the layers of --verify), in bytes, their totals added as they become known."""
    with progress_bar(0, "inspect", progress) as bar:
        return _report(path_or_repo, check_files=check_files, verify=verify, revision=revision, max_error=max_error,
                       verify_revision=verify_revision, token=token, progress=bar if progress else None)


def _report(path_or_repo: str, *, check_files: bool = False, verify: str | None = None,
            revision: str | None = None, max_error: float = DEFAULT_MAX_ERROR,
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
    engine = _check_engine_config(source, layout) if layout.quantized else []
    problems += engine
    problems += check_activation_scales(source, layout) if layout.quantized else []
    checksums = _check_files(source, manifest, layout, problems, full=check_files, progress=progress)
    report = _summary(source, layout, globals_, groups)
    report["warnings"] = []
    serving = get_format(layout.format).serving_warning(layout.rotate) if layout.format else None
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
        v = verify_against(source, layout, verify, max_error=max_error, revision=verify_revision, token=token,
                           progress=progress)
        report["verify"] = v
        problems += v["problems"]
    if not layout.quantized:
        report["verdict"] = NOT_QUANTIZED
    else:
        report["verdict"] = FAILED if problems else OK
    report["ok"] = report["verdict"] == OK
    return report


def check_activation_scales(source: Source, layout: CheckpointLayout) -> list[str]:
    """W4A4 (docs/formats.md "W4A4"): every quantized layer has a finite positive activation scale, and
    the members of each fused group (q/k/v, gate/up; per MoE layer all experts' w13, all experts' w2)
    share it. W4A4 is what the checkpoint declares: compressed-tensors NVFP4 ``input_activations``
    (``dynamic: local``), a ModelOpt ``config.json`` group with ``input_activations``, a manifest
    ``activations`` section, or any stored activation scale. A weight-only ModelOpt file (no input
    scale at all) is not judged here. A W4A4 layer without a scale is a problem (FAILED)."""
    import re

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
        if len({values[m] for m in members}) > 1:
            problems.append(f"fused group {g} has {len({values[m] for m in members})} different activation scales "
                            "(engines take one; members must share it)")
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
    if layout.format and get_format(layout.format).described_by_manifest and not hints:
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
        _add_total(progress, sum(rec["size"] for rec in listed.values()))
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


def _add_total(progress, n: int) -> None:
    if progress is not None:
        progress.total = (progress.total or 0) + n
        if hasattr(progress, "refresh"):
            progress.refresh()


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
# Engine configs against the tensors
# ---------------------------------------------------------------------------------------------

def _kept_2d(layout: CheckpointLayout) -> list[str]:
    """Kept 2-D float weights an engine would take for Linear layers; a rotated compressed-tensors
    module's own transform (``<module>.had16_input.weight``, 16x16) is part of that module, not one."""
    transforms = {f"{m}.{layout.rotate}_input" for m in layout.modules} if layout.rotate else set()
    return sorted(n for n in (t.name[: -len(".weight")] for t in layout.kept
                              if t.name.endswith(".weight") and len(t.shape) == 2 and t.dtype in ("BF16", "F16", "F32"))
                  if n not in transforms)


def _bad_patterns(ignore: list, key: str, regex: bool) -> list[str]:
    """Entries of an ignore list that are not strings, or (compressed-tensors) ``re:`` patterns that do
    not compile: engines would fail to load the config."""
    out = []
    for i, p in enumerate(ignore):
        if not isinstance(p, str):
            out.append(f"{key}[{i}] is {_kind(p)}, not a module name or pattern")
        elif regex and p.startswith("re:"):
            try:
                re.compile(p[3:])
            except (re.error, RecursionError, OverflowError) as exc:
                out.append(f"{key}[{i}] {p[:60]!r}: the regular expression does not compile ({exc})")
    return out


def _ignore_agrees(ignore: object, layout: CheckpointLayout, match, key: str, regex: bool = False) -> list[str]:
    out = []
    if not isinstance(ignore, list):
        return [f"{key} is {_kind(ignore)}, not a list"]
    bad = _bad_patterns(ignore, key, regex)
    if bad:
        return bad
    missing = [m for m in _kept_2d(layout) if not any(match(p, m) for p in ignore)]
    if missing:
        out.append(f"{key} misses {len(missing)} kept 2-D weight(s), e.g. {missing[0]}: an engine would load it as FP4")
    wrong = sorted(m for m in layout.modules if any(match(p, m) for p in ignore))
    if wrong:
        out.append(f"{key} names {len(wrong)} quantized weight(s), e.g. {wrong[0]}: an engine would load it unquantized")
    return out


def _kind(v: object) -> str:
    if v is None:
        return "null"
    return {bool: "true/false", str: "a string", int: "an integer", float: "a number", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def _check_engine_config(source: Source, layout: CheckpointLayout) -> list[str]:
    """The engine config files against the tensors (each format checks its own: ``OutputFormat.config_problems``),
    then the modules its config keeps out of FP4 against the kept weights. Every value is type-checked before
    use: a value of the wrong type is a finding (one line naming the key), never an exception."""
    fmt = get_format(layout.format)
    scheme = get_scheme(layout.scheme) if layout.scheme else None
    out, excluded = fmt.config_problems(source.root, source.config(), scheme, layout.modules)
    if excluded is not None:
        out += _ignore_agrees(excluded.patterns, layout, excluded.match, excluded.key, regex=excluded.regex)
    return out


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
        "layers": dict(sorted(layers.items(), key=lambda kv: _natural(kv[0]))),
        "global_scales": globals_,
    }


def _input_weights(manifest: dict | None) -> dict | None:
    rec = ((manifest or {}).get("identity") or {}).get("input_weights")
    if not isinstance(rec, dict):
        return None
    keep = ("source", "samples", "seq_len", "seed", "data", "rotated", "weighted", "unweighted", "sha256")
    return {k: rec[k] for k in keep if k in rec}


def _describe_input_weights(w: dict) -> str:
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


def _natural(s: str) -> list:
    # numbers compare by length, then digits: int() of a 5000-digit layer number in a crafted tensor name
    # raises ValueError (Python's int-string limit), and a plain int would not compare with the other parts
    return [(len(t.lstrip("0")), t.lstrip("0")) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", s))]


# ---------------------------------------------------------------------------------------------
# --verify
# ---------------------------------------------------------------------------------------------

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
    _add_total(progress, sum(orig[m + ".weight"].nbytes for m in layout.modules if m + ".weight" in orig))
    for m in layout.modules.values():
        info = orig.get(m.module + ".weight")
        if info is None:
            missing.append(m.module)
            layers[m.module] = {"error": "not in the source checkpoint"}
            continue
        x = read_tensor(original.local_path(info.file), info).to(torch.float32)
        if progress is not None:
            progress.update(info.nbytes)
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


def _snr(ref2: float, err2: float) -> float:
    if err2 == 0:
        return math.inf
    if ref2 == 0:
        return -math.inf
    return 10 * math.log10(ref2 / err2)


# ---------------------------------------------------------------------------------------------
# Text and pictures
# ---------------------------------------------------------------------------------------------


def render(r: dict) -> list[str]:
    """The report as the lines ``fp4convert inspect`` prints."""
    lines = []
    if r["verdict"] == NOT_QUANTIZED:
        lines.append(f"{r['path']}: not quantized (no FP4 weights; {r['kept']} tensors, {human_bytes(r['bytes'])}, "
                     f"{r['params']:,} params, {r['bits_per_param']} bits/param)")
    else:
        lines.append(f"{r['path']}: format {r['format']}, scheme {r['scheme']}, rotation {r['rotate'] or 'none'}"
                     + (f", scale rule {r['scale_rule']}" if r.get("scale_rule") else ""))
        lines.append(f"  activations: {describe_activations(r.get('activations'))}")
        if r.get("input_weights"):
            lines.append(f"  input weights: {_describe_input_weights(r['input_weights'])}")
        acts = f", {r['activation_scales']} activation scales" if r.get("activation_scales") else ""
        lines.append(
            f"  {r['quantized']} quantized weights{acts}, {r['kept']} kept tensors, {r['fused_groups']} fused groups; "
            f"{human_bytes(r['bytes'])}, {r['params']:,} params, {r['bits_per_param']} bits/param "
            f"({r['bits_per_param_quantized']} in quantized layers)")
    lines.append(f"  {'layer':<28} {'quantized':>9} {'kept':>5} {'size':>10}")
    for name, row in r["layers"].items():
        lines.append(f"  {name:<28} {row['quantized']:>9} {row['kept']:>5} {human_bytes(row['bytes']):>10}")
    c = r["checks"]
    for note in c.get("notes", []):
        lines.append(f"  note: {note}")
    if r["verdict"] != NOT_QUANTIZED:
        lines.append(f"  manifest: {c['manifest']}; engine config: {c['engine_config']}")
        lines.append(f"  files: {c['checksums']}; block scales "
                     f"{'checked' if c['block_scales_checked'] else 'not read (use --check-files)'}")
    v = r.get("verify")
    if v:
        lines.append(f"  verify against {v['source']} (source fingerprint: {v['fingerprint']}):")
        for m, e in v["layers"].items():
            if "error" in e:
                lines.append(f"    {m}: {e['error']}")
            else:
                flag = "  > max-error" if e["rel_error"] > v["max_error"] else ""
                lines.append(f"    {m:<44} rel.err {e['rel_error']:.4f}  SNR {e['snr_db']:.1f} dB{flag}")
        o = v["overall"]
        if o:
            lines.append(f"    overall: mean rel.err {o['mean_rel_error']:.4f}, worst {o['worst_rel_error']:.4f} "
                         f"({o['worst_layer']}), SNR {o['snr_db']:.1f} dB over {o['layers']} layers; "
                         f"threshold {v['max_error']}")
    problems = c["problems"]
    if problems:
        lines.append(f"  {len(problems)} problem(s):")
        lines += [f"    - {p}" for p in problems]
    for w in r.get("warnings", []):
        lines.append(f"  warning: {w}")
    if r["verdict"] == OK:
        lines.append("  verdict: OK" + (" (verified against the source)" if v else "")
                     + (f", with {len(r['warnings'])} warning(s) above" if r.get("warnings") else ""))
    elif r["verdict"] == NOT_QUANTIZED:
        lines.append("  verdict: NOT QUANTIZED (nothing to check; inspect expects an FP4 checkpoint)")
    else:
        lines.append(f"  verdict: FAILED ({len(problems)} problem(s))")
    return lines


def render_errors(r: dict) -> list[str]:
    """What ``inspect --quiet`` prints (errors only): nothing for a sound checkpoint, else one ``Error:``
    line with the verdict and the problems below it."""
    if r["verdict"] == OK:
        return []
    if r["verdict"] == NOT_QUANTIZED:
        return [f"Error: {r['path']}: not quantized (no FP4 weights; inspect expects an FP4 checkpoint)"]
    problems = r["checks"]["problems"]
    return [f"Error: {r['path']}: inspect found {len(problems)} problem(s):", *(f"  - {p}" for p in problems)]


def write_plot(report: dict, path: str) -> str:
    """A per-layer error chart of ``--verify``: PNG through matplotlib if installed, else a standalone SVG/HTML."""
    v = report.get("verify") or {}
    rows = [(m, e["rel_error"]) for m, e in v.get("layers", {}).items() if "rel_error" in e]
    if not rows:
        raise ValueError("--plot needs --verify with at least one compared layer")
    if path.endswith(".png"):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            path = path[: -len(".png")] + ".html"
        else:
            fig, ax = plt.subplots(figsize=(10, max(3, 0.18 * len(rows))))
            ax.barh([m for m, _ in rows][::-1], [e for _, e in rows][::-1])
            ax.axvline(v["max_error"], color="red", linestyle="--", label=f"max-error {v['max_error']}")
            ax.set_xlabel("relative error ||w - x|| / ||x||")
            ax.legend()
            fig.tight_layout()
            fig.savefig(path)
            plt.close(fig)
            return path
    width, bar_h, label_w = 900, 14, 420
    scale = (width - label_w - 60) / max(max(e for _, e in rows), v["max_error"])
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{(len(rows) + 2) * bar_h + 20}" '
           'font-family="monospace" font-size="11">']
    for i, (m, e) in enumerate(rows):
        y = 10 + i * bar_h
        color = "#c0392b" if e > v["max_error"] else "#2e86c1"
        svg.append(f'<text x="0" y="{y + 10}">{m}</text><rect x="{label_w}" y="{y}" width="{e * scale:.1f}" '
                   f'height="{bar_h - 3}" fill="{color}"/><text x="{label_w + e * scale + 4:.1f}" y="{y + 10}">{e:.4f}</text>')
    x = label_w + v["max_error"] * scale
    svg.append(f'<line x1="{x:.1f}" y1="5" x2="{x:.1f}" y2="{(len(rows) + 1) * bar_h}" stroke="red" stroke-dasharray="4"/>')
    svg.append("</svg>")
    o = v.get("overall") or {}
    html = (f"<!doctype html><meta charset='utf-8'><title>fp4convert verify: {report['path']}</title>"
            f"<h3>{report['path']}: {report['scheme']} ({report['format']}) against {v['source']}</h3>"
            f"<p>mean rel.err {o.get('mean_rel_error', 0):.4f}, worst {o.get('worst_rel_error', 0):.4f} "
            f"({o.get('worst_layer')}), SNR {o.get('snr_db', 0):.1f} dB; threshold {v['max_error']} (dashed)</p>"
            + "".join(svg))
    with open(path, "w") as fh:
        fh.write(html)
    return path
