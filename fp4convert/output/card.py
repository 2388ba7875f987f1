"""The model card (README.md) of a converted checkpoint: what it is, how it was made, how to serve it.

People publish these folders on the Hub, where the card is the first thing a reader sees: YAML front
matter the Hub understands (``base_model`` with ``base_model_relation: quantized``, tags,
``library_name``), a section naming the tool, scheme, format, scale rule and excluded modules with
the commands that serve each format, and the source's own card kept below it. The generated part is
delimited by HTML comments, so converting or exporting an output again replaces it instead of nesting
one card inside another.

The front matter is rendered by huggingface_hub's ``ModelCard`` / ``ModelCardData`` from validated
values only: ``base_model`` comes from ``--base-model``, the Hub repo id, an HF cache snapshot's repo
or a Hub-like ``_name_or_path`` in config.json (never from the source card, which anyone can write),
and the few keys kept from the source card (license, language, tags...) are type- and
character-checked; a wrong one is dropped with a warning. The source card's text goes below our
section, with our markers defused, so it can change neither our front matter nor our section.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from fp4convert.formats import get_format
from fp4convert.numerics.scheme import Scheme, get_scheme
from fp4convert.output.describe import activations_of, describe_activations, describe_method
from fp4convert.storage.names import (
    CARD_NAME,  # noqa: F401 - re-exported (names.py states it)
    valid_repo_id,
)
from fp4convert.version import __version__

log = logging.getLogger(__name__)

START, END = "<!-- fp4convert:card-start -->", "<!-- fp4convert:card-end -->"
ORIGINAL_HEADING = "## Original model card"
PLACEHOLDER = "THIS_MODEL"  # where the card names the folder itself; push_to_hub puts the repo id there
# What passes from the source card's front matter: only what still describes the derived model (its license
# and what it does). The source's tags, datasets, model-index, widget... describe the source (or whatever
# its author wrote): a hostile `tags: [malware]` would otherwise be published by --push-to-hub.
KEEP_KEYS = ("license", "license_name", "license_link", "language", "pipeline_tag")
_FRONT = re.compile(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", re.S)
_SLUG = re.compile(r"^[a-z0-9][a-z0-9._\-]{0,63}$")
_LANG = re.compile(r"^(?:[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8})*|multilingual)$")
_LINK = re.compile(r"^[^\s<>\"'`\\]{1,300}$")
_OF = re.compile(r"^(?:Weight-only|W4A4) \S+ quantization of `([^`\n]{1,300})`", re.M)  # our section's model name
_NAME = re.compile(r"^[\w.\-:/]{1,300}$")  # a module name shown in our section as it is


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


def original_body(text: str, ours: bool = True) -> str:
    """The source's own card body. ``ours``: ``text`` is a card fp4convert generated (checked against a
    manifest), so what it kept below our section is given back; otherwise the whole body is the source's."""
    _, body = split_card(text)
    if ours and START in body and END in body:
        body = body.split(END, 1)[1].lstrip("\n")
        if body.startswith(ORIGINAL_HEADING):
            body = body[len(ORIGINAL_HEADING):].lstrip("\n")
    return body.strip("\n")


def _defuse(body: str) -> str:
    """The source's text, unable to pose as our section's markers in a later re-generation."""
    return body.replace("<!-- fp4convert:", "<!-- (quoted) fp4convert:")


def _kind(v: object) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", dict: "a mapping", list: "a list",
            str: "a string", type(None): "empty"}.get(type(v), type(v).__name__)


def _text_ok(v: object, pattern: re.Pattern | None = None, limit: int = 100) -> bool:
    if not isinstance(v, str) or not v or len(v) > limit or not v.isprintable() or "<" in v or ">" in v:
        return False
    return pattern is None or bool(pattern.match(v))


def kept_metadata(meta: dict) -> dict:
    """The source card's front-matter values worth keeping, each validated (type, characters, length).

    A value of the wrong type (``tags: 5``) or with characters no such value has (newlines, HTML) is
    dropped with a warning, never an error: a conversion does not fail over a card."""
    out: dict = {}
    checks = {"license": lambda v: _text_ok(v, _SLUG, 64), "license_name": lambda v: _text_ok(v, _SLUG, 64),
              "license_link": lambda v: _text_ok(v, _LINK, 300), "pipeline_tag": lambda v: _text_ok(v, _SLUG, 64)}
    lists = {"language": lambda v: _text_ok(v, _LANG, 20)}
    for key in KEEP_KEYS:
        if key not in meta or meta[key] is None:
            continue
        v = meta[key]
        if key in checks:
            if checks[key](v):
                out[key] = v
            else:
                log.warning("warning: the source's %s sets %s to %s the Hub does not accept there; not kept",
                            CARD_NAME, key, "a value" if isinstance(v, str) else _kind(v))
            continue
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list):
            log.warning("warning: the source's %s sets %s to %s, not a list of strings; not kept", CARD_NAME, key,
                        _kind(v))
            continue
        good = [x for x in items if lists[key](x)]
        if len(good) < len(items):
            log.warning("warning: the source's %s: %d of the %s values are not valid; dropped", CARD_NAME,
                        len(items) - len(good), key)
        if good:
            out[key] = list(dict.fromkeys(good))
    return out


def hub_like_name(config: dict) -> str | None:
    """config.json's ``_name_or_path`` when it is a Hub id of the form org/name (not a local path)."""
    v = config.get("_name_or_path") if isinstance(config, dict) else None
    if isinstance(v, str) and v.count("/") == 1 and not v.startswith((".", "/", "~")):
        return valid_repo_id(v)
    return None


def cache_repo_id(root: Path) -> str | None:
    """The repo id of an HF cache snapshot folder (``.../models--org--name/snapshots/<commit>``)."""
    repo_dir = root.parent.parent
    if root.parent.name != "snapshots" or not repo_dir.name.startswith("models--"):
        return None
    parts = repo_dir.name[len("models--"):].split("--")
    return valid_repo_id("/".join(parts)) if len(parts) in (1, 2) else None


def default_base_model(source_desc: dict, root: Path | None, config: dict, own_meta: dict | None = None
                       ) -> str | None:
    """The base model a card names when ``--base-model`` is not given: the Hub repo id, the base model our
    own earlier card named (``own_meta``: a card checked against its manifest, when exporting), an HF cache
    snapshot's repo, or a Hub-like ``_name_or_path``; None (omitted) rather than a folder name like ``model``."""
    if source_desc.get("type") == "hub" and valid_repo_id(source_desc.get("repo_id")):
        return source_desc["repo_id"]
    if own_meta and valid_repo_id(own_meta.get("base_model")):
        return own_meta["base_model"]
    if root is not None and cache_repo_id(root):
        return cache_repo_id(root)
    return hub_like_name(config)


def own_card(text: str | None, manifest: dict | None) -> bool:
    """Is ``text`` the card an fp4convert manifest lists (its sha256 recorded there), i.e. ours?"""
    if not text or not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return False
    rec = manifest["files"].get(CARD_NAME)
    return isinstance(rec, dict) and rec.get("sha256") == hashlib.sha256(text.encode()).hexdigest()


AUTO_CLASSES = (  # architecture suffix -> the transformers Auto class that loads it
    ("ForCausalLM", "AutoModelForCausalLM"), ("ForMaskedLM", "AutoModelForMaskedLM"),
    ("ForSequenceClassification", "AutoModelForSequenceClassification"),
    ("ForTokenClassification", "AutoModelForTokenClassification"),
    ("ForQuestionAnswering", "AutoModelForQuestionAnswering"),
    ("ForImageClassification", "AutoModelForImageClassification"),
    ("ForImageTextToText", "AutoModelForImageTextToText"), ("ForVision2Seq", "AutoModelForImageTextToText"),
    ("ForSpeechSeq2Seq", "AutoModelForSpeechSeq2Seq"),
)


def auto_class(config: dict) -> str:
    """The Auto class a usage snippet should name, from config.json's ``architectures``: AutoModel for
    BERT-like encoders and anything unknown, AutoModelForCausalLM for ``*ForCausalLM``,
    AutoModelForImageTextToText for vision-language ``*ForConditionalGeneration``..."""
    archs = config.get("architectures") if isinstance(config, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    for suffix, cls in AUTO_CLASSES:
        if arch.endswith(suffix):
            return cls
    if arch.endswith("ForConditionalGeneration"):
        if "vision_config" in config or "image_token_index" in config or "image_token_id" in config:
            return "AutoModelForImageTextToText"
        if "whisper" in arch.lower() or "speech" in arch.lower():
            return "AutoModelForSpeechSeq2Seq"
        if config.get("is_encoder_decoder"):
            return "AutoModelForSeq2SeqLM"
        return "AutoModelForImageTextToText"
    return "AutoModel"


def _name(s: str) -> str:
    """A module or folder name as our section shows it: as it is when plain, else with odd characters
    replaced (a tensor name is any string; it must not inject Markdown or HTML)."""
    return s if _NAME.match(s) else re.sub(r"[^\w.\-:/]", "?", s)[:300] or "?"


def _serving(fmt: str, repo: str, scheme: str, rotate: str | None, auto: str = "AutoModelForCausalLM",
             activations: dict | None = None) -> str:
    """The format's own serving text (fp4convert/formats: each format states which engines read it)."""
    from fp4convert.formats import get_format

    return get_format(fmt).serving_text(repo, scheme, rotate, auto, activations)


def kept_modules(manifest: dict) -> list[str]:
    """2-D weights the manifest says were kept (what engines must not treat as FP4)."""
    return sorted(n[: -len(".weight")] for n, rec in manifest.get("tensors", {}).items()
                  if rec.get("action") == "keep" and n.endswith(".weight") and len(rec.get("shape", ())) == 2)


_AUTO = object()  # build_card's base_model: derive it from the manifest's source


def preload() -> None:
    """Import huggingface_hub's card classes on a daemon thread now: the import costs 0.3-2 s (yaml,
    jinja2, the repocard module) and the card is built at the very end of a run, on its critical path.
    Called when a run starts (the import is then overlapped with planning and converting); idempotent."""
    import sys
    import threading

    if "huggingface_hub.repocard" in sys.modules:
        return

    def _load() -> None:
        try:
            from huggingface_hub import ModelCard, ModelCardData  # noqa: F401
        except Exception:  # the card's own import reports it, at the end, where it is needed
            pass

    threading.Thread(target=_load, name="fp4convert-card-import", daemon=True).start()


def build_card(manifest: dict, original: str | None, repo_hint: str | None = None, *, base_model=_AUTO,
               config: dict | None = None, original_is_ours: bool = False, origin: dict | None = None) -> str:
    """The README.md text for an output folder, from its manifest (and the source's card, kept below).

    ``base_model``: validated repo id or None (omitted); by default the manifest's Hub source.
    ``config``: the model's config.json (the usage snippet's Auto class). ``original_is_ours``: the card
    is one fp4convert generated (checked against its manifest): only then is our old section dropped
    from it. ``origin``: the model the weights come from, when not the manifest's source (exporting a
    native output: its own manifest's source). Nothing from ``original`` reaches the front matter
    unvalidated, nor our section at all."""
    fmt, scheme, rotate = manifest["format"], manifest["scheme"], manifest.get("rotate")
    source_desc = origin if isinstance(origin, dict) else manifest.get("source", {})
    summary = manifest.get("summary", {})
    meta_in, _ = split_card(original or "")
    if base_model is _AUTO:
        base_model = default_base_model(source_desc, None, config or {}, meta_in if original_is_ours else None)
    base = valid_repo_id(base_model)
    s = get_scheme(scheme)
    rule = (manifest.get("settings") or {}).get("scale_rule") or s.default_rule
    kept_meta = kept_metadata(meta_in)
    activations = activations_of(manifest)
    tags = ["fp4convert", scheme, "fp4", fmt, "quantized", *(["w4a4"] if activations else [])]
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(base_model=base, library_name=get_format(fmt).card_library, tags=tags,
                         base_model_relation="quantized" if base else None, **kept_meta)
    scale_desc = _scale_text(s)
    excluded = _excluded_text(manifest)
    repo = valid_repo_id(repo_hint) or PLACEHOLDER
    folder = _name(str(source_desc.get("path") or "model").rsplit("/", 1)[-1])
    named = _OF.search(original or "") if original_is_ours and origin is None else None
    if named:  # re-rendering our own card (push): keep naming the model it named
        folder = _name(named.group(1))
    title = (base or folder).rsplit("/", 1)[-1]
    what = f"[{base}](https://huggingface.co/{base})" if base else f"`{folder}`"
    verify = base or "SRC"
    bf16 = (manifest.get("settings") or {}).get("kept_dtype") == "bf16"
    kept_note = ", fp32 and fp64 stored as bf16" if bf16 else ""
    body = [
        START,
        f"# {title} {scheme.upper()} ({fmt})",
        "",
        f"{'W4A4' if activations else 'Weight-only'} {scheme.upper()} quantization of {what}, made with fp4convert "
        f"{_name(str((manifest.get('producer') or {}).get('version', __version__)))}: {_name_text(describe_method(manifest))}"
        f"; {_name_text(describe_activations(activations))}.",
        "",
        "| | |",
        "|---|---|",
        f"| scheme | {scheme.upper()}: E2M1 values, {scale_desc} |",
        f"| format | {fmt} |",
        f"| scale rule | {_name(str(rule))} |",
        f"| rotation | {rotate or 'none'} |",
        f"| activations | {_name_text(describe_activations(activations))} |",
        f"| weight scales | {_name_text(describe_method(manifest))} |",
        f"| quantized tensors | {_num(summary.get('quantized'))} of {_num(summary.get('tensors'))} "
        f"({_num(summary.get('bits_per_param_quantized'))} bits/param in quantized layers, "
        f"{_num(summary.get('bits_per_param'))} overall) |",
        f"| excluded modules (kept in the source dtype{kept_note}) | {excluded} |",
        "",
        "Embeddings, norms, routers and other tensors that are not linear weights keep their source dtype"
        f"{kept_note}. "
        "`fp4convert.json` records every tensor's decision and reason, the settings and each file's sha256; "
        f"`fp4convert inspect {repo} --verify {verify}` recomputes the error against the source.",
        "",
        "## Serving",
        "",
        _serving(fmt, repo, scheme, rotate, auto_class(config or {}), activations),
        END,
    ]
    text = "\n" + "\n".join(body) + "\n"
    kept_body = _defuse(original_body(original, ours=original_is_ours)) if original else ""
    if kept_body:
        text += f"\n{ORIGINAL_HEADING}\n\n{kept_body}\n"
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n{text}")
    return str(card)


def _scale_text(s: Scheme) -> str:
    """What a scheme's scales are, in the card's table."""
    if s.global_scale:
        return f"an E4M3 scale per {s.block_size} weights and an fp32 global scale per matrix"
    return f"a power-of-two (UE8M0) scale per {s.block_size} weights"


def _excluded_text(manifest: dict) -> str:
    """The kept 2-D weights as the card lists them (the first 40, then a count)."""
    kept = kept_modules(manifest)
    excluded = ", ".join(f"`{_name(m)}`" for m in kept[:40]) or "none"
    if len(kept) > 40:
        excluded += f" and {len(kept) - 40} more (see `fp4convert.json`)"
    return excluded


def _name_text(s: str) -> str:
    """A sentence of ours built from manifest values (a data file's name among them): no Markdown/HTML
    specials (a hand-edited manifest must not inject links or tags into the card)."""
    return re.sub(r"[<>`\[\]|\n\r]", "?", s)[:400]


def _num(v: object) -> str:
    return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"
