"""The model card (README.md) of a converted checkpoint: what it is, how it was made, how to serve it.

People publish these folders on the Hub, where the card is the first thing a reader sees: YAML front
matter the Hub understands (``base_model`` with ``base_model_relation: quantized``, tags,
``library_name``), a section naming the tool, scheme, format, scale rule and excluded modules with
the commands that serve each format, and the source's own card kept below it. The generated part is
delimited by HTML comments, so converting or exporting an output again replaces it instead of nesting
one card inside another.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .scheme import get_scheme
from .version import __version__

log = logging.getLogger(__name__)

CARD_NAME = "README.md"
START, END = "<!-- fp4convert:card-start -->", "<!-- fp4convert:card-end -->"
ORIGINAL_HEADING = "## Original model card"
PLACEHOLDER = "THIS_MODEL"  # where the card names the folder itself; push_to_hub puts the repo id there
KEEP_KEYS = ("license", "license_name", "license_link", "language", "pipeline_tag", "datasets")
LIBRARY = {"fp4convert": "fp4convert", "compressed-tensors": "transformers", "modelopt": "vllm"}
_FRONT = re.compile(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", re.S)


def split_card(text: str) -> tuple[dict, str]:
    """A card's YAML front matter (as a dict; {} when absent or unreadable) and its body."""
    m = _FRONT.match(text)
    if not m:
        return {}, text
    try:
        import yaml

        meta = yaml.safe_load(m.group(1)) or {}
    except Exception as exc:  # a broken front matter must not stop a conversion
        log.debug("front matter unreadable: %s", exc)
        meta = {}
    return (meta if isinstance(meta, dict) else {}), text[m.end():]


def original_body(text: str) -> str:
    """The source's own card body: a card fp4convert generated earlier gives back what it kept."""
    _, body = split_card(text)
    if START in body and END in body:
        body = body.split(END, 1)[1].lstrip("\n")
        if body.startswith(ORIGINAL_HEADING):
            body = body[len(ORIGINAL_HEADING):].lstrip("\n")
    return body.strip("\n")


def base_model_name(source_desc: dict, original_meta: dict) -> str:
    """The Hub repo id of the source, or what an earlier card of ours named, or the local folder's name."""
    if source_desc.get("type") == "hub" and source_desc.get("repo_id"):
        return source_desc["repo_id"]
    if isinstance(original_meta.get("base_model"), str) and "fp4convert" in (original_meta.get("tags") or []):
        return original_meta["base_model"]  # exporting a native output: keep naming the real base model
    return Path(str(source_desc.get("path") or "model")).name


def _serving(fmt: str, repo: str, scheme: str, rotate: str | None) -> str:
    if fmt == "compressed-tensors":
        lines = [
            "compressed-tensors: vLLM and transformers (with `compressed-tensors` installed) read it from config.json.",
            "",
            "```bash",
            f"vllm serve {repo}",
            "```",
            "",
            "```python",
            "import torch",
            "from transformers import AutoModelForCausalLM, CompressedTensorsConfig",
            f'model = AutoModelForCausalLM.from_pretrained("{repo}", dtype=torch.bfloat16,',
            "    quantization_config=CompressedTensorsConfig(dequantize=True))",
            "```",
        ]
        if rotate:
            lines += ["", "The weights carry a Had16 rotation recorded as `transform_config`: vLLM applies it "
                          "(tensor parallel 1 only); transformers ignores it and computes wrong outputs."]
        return "\n".join(lines)
    if fmt == "modelopt":
        return "\n".join([
            "NVIDIA ModelOpt NVFP4 (`hf_quant_config.json`): vLLM, SGLang and TensorRT-LLM read it; transformers does not.",
            "",
            "```bash",
            f"vllm serve {repo} --quantization modelopt_fp4",
            "```",
            "",
            "No activation scales are stored (weight-only conversion): on Blackwell vLLM treats ModelOpt NVFP4 as "
            "W4A4; prefer the compressed-tensors format for weight-only serving.",
        ])
    return "\n".join([
        "fp4convert's native layout (block scales pre-swizzled to the 128x4 tensor-core layout, described by "
        "`fp4convert.json`). No engine loads it as is, and transformers refuses it (its config.json says "
        "`model_type: fp4convert`). Re-layout it, losslessly and without the source weights:",
        "",
        "```bash",
        f"fp4convert export {repo} out-ct --format compressed-tensors   # vLLM, transformers",
        f"fp4convert export {repo} out-mo --format modelopt             # vLLM / SGLang / TensorRT-LLM"
        + ("" if scheme == "nvfp4" else " (NVFP4 only)"),
        "```",
    ])


def kept_modules(manifest: dict) -> list[str]:
    """2-D weights the manifest says were kept (what engines must not treat as FP4)."""
    return sorted(n[: -len(".weight")] for n, rec in manifest.get("tensors", {}).items()
                  if rec.get("action") == "keep" and n.endswith(".weight") and len(rec.get("shape", ())) == 2)


def build_card(manifest: dict, original: str | None, repo_hint: str | None = None) -> str:
    """The README.md text for an output folder, from its manifest (and the source's card, kept below)."""
    fmt, scheme, rotate = manifest["format"], manifest["scheme"], manifest.get("rotate")
    source_desc = manifest.get("source", {})
    summary = manifest.get("summary", {})
    meta_in, _ = split_card(original or "")
    base = base_model_name(source_desc, meta_in)
    s = get_scheme(scheme)
    rule = (manifest.get("settings") or {}).get("scale_rule") or s.default_rule
    meta: dict = {"base_model": base, "base_model_relation": "quantized",
                  "library_name": LIBRARY.get(fmt, "fp4convert"),
                  "tags": list(dict.fromkeys(["fp4convert", scheme, "fp4", fmt, "quantized"]))}
    for k in KEEP_KEYS:
        if k in meta_in:
            meta[k] = meta_in[k]
    import yaml

    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).strip()
    if s.global_scale:
        scale_desc = f"an E4M3 scale per {s.block_size} weights and an fp32 global scale per matrix"
    else:
        scale_desc = f"a power-of-two (UE8M0) scale per {s.block_size} weights"
    kept = kept_modules(manifest)
    excluded = ", ".join(f"`{m}`" for m in kept[:40]) or "none"
    if len(kept) > 40:
        excluded += f" and {len(kept) - 40} more (see `fp4convert.json`)"
    repo = repo_hint or PLACEHOLDER
    base_link = f"[{base}](https://huggingface.co/{base})" if source_desc.get("type") == "hub" else f"`{base}`"
    body = [
        START,
        f"# {base.rsplit('/', 1)[-1]} {scheme.upper()} ({fmt})",
        "",
        f"Weight-only {scheme.upper()} quantization of {base_link}, made with fp4convert "
        f"{(manifest.get('producer') or {}).get('version', __version__)} (data-free: no calibration set).",
        "",
        "| | |",
        "|---|---|",
        f"| scheme | {scheme.upper()}: E2M1 values, {scale_desc} |",
        f"| format | {fmt} |",
        f"| scale rule | {rule} |",
        f"| rotation | {rotate or 'none'} |",
        f"| quantized tensors | {summary.get('quantized')} of {summary.get('tensors')} "
        f"({summary.get('bits_per_param_quantized')} bits/param in quantized layers, "
        f"{summary.get('bits_per_param')} overall) |",
        f"| excluded modules (kept in the source dtype) | {excluded} |",
        "",
        "Embeddings, norms, routers and other tensors that are not linear weights keep their source dtype. "
        "`fp4convert.json` records every tensor's decision and reason, the settings and each file's sha256; "
        f"`fp4convert inspect {repo} --verify {base}` recomputes the error against the source.",
        "",
        "## Serving",
        "",
        _serving(fmt, repo, scheme, rotate),
        END,
    ]
    out = f"---\n{front}\n---\n\n" + "\n".join(body) + "\n"
    kept_body = original_body(original) if original else ""
    if kept_body:
        out += f"\n{ORIGINAL_HEADING}\n\n{kept_body}\n"
    return out


def write_card(dst: Path, text: str) -> str:
    """Write README.md atomically; returns its name (for the manifest's file list)."""
    import os

    path = dst / CARD_NAME
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    os.replace(tmp, path)
    return CARD_NAME
