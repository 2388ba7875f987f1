"""The manifest ``fp4convert.json``: every decision with its reason, the settings, and checksums.

It is written last, so its presence means the conversion finished. It holds no timestamps: the
same input and settings give a byte-identical manifest, like every other output file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import CheckpointFormatError
from .scheme import get_scheme
from .version import producer

if TYPE_CHECKING:
    from .formats.base import OutputFormat
    from .plan import Plan
    from .source import Source

MANIFEST_NAME = "fp4convert.json"
PROGRESS_NAME = ".fp4convert-progress.json"
LOCK_NAME = ".fp4convert.lock"  # flock'd by the run writing the folder (holds its pid)
# Identity keys kept in the progress record only: the manifest of a copied or touched source stays the same.
PROGRESS_ONLY = ("source_mtimes", "source_sha256")
MANIFEST_VERSION = 1


def file_digest(path: Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def build_manifest(plan: Plan, fmt: OutputFormat, source: Source, identity: dict, state: dict, dst: Path,
                   written: list[str]) -> dict:
    """The manifest of a finished conversion.

    ``state`` holds the shards' checksums and scales; ``written`` names the other files this run wrote
    (only those are listed, so files a user keeps in DST are never claimed, nor removed by --overwrite).
    """
    cfg = plan.config
    scheme = get_scheme(cfg.scheme)
    shard_of = plan.shard_of()
    tensors = {}
    for d in plan.decisions:
        rec = {
            "action": d.action,
            "reason": d.reason,
            "group": d.group,
            "dtype": d.info.dtype,
            "shape": list(d.info.shape),
            "source_file": d.info.file,
            "outputs": {e.name: {"dtype": e.dtype, "shape": list(e.shape), "file": shard_of[e.name]} for e in d.outputs},
        }
        rec.update(state["tensors"].get(d.name, {}))
        tensors[d.name] = rec
    shards = {f for f, _ in plan.shards}
    files = {f: rec for f, rec in state["files"].items() if f in shards}
    for rel in sorted(set(written) - set(files)):
        p = dst / rel
        files[rel] = {"sha256": file_digest(p), "size": p.stat().st_size}
    out = {
        "manifest_version": MANIFEST_VERSION,
        "producer": producer(),
        "format": fmt.name,
        "scheme": cfg.scheme,
        "rotate": cfg.rotate,
        "scale_rule": cfg.rule,
        "block_size": scheme.block_size,
        "scale_layout": "128x4" if fmt.swizzled else "linear",
        "scale_dtype": "float8_e4m3fn" if scheme.scale_encoding == "e4m3" else "e8m0",
        "global_scale": "encode scale gs = 2688 / amax; w = e2m1 * scale / gs" if scheme.global_scale else None,
        "settings": cfg.identity(),
        "source": {**portable_description(source), "weight_files": list(source.weight_files)},
        "identity": {k: v for k, v in identity.items() if k not in PROGRESS_ONLY},
        "summary": plan.summary(),
        "groups": {g: m for g, m in plan.groups.items()},
        "tensors": tensors,
        "files": files,
    }
    out.update(activation_section(fmt))
    return out


def activation_section(fmt: OutputFormat) -> dict:
    """W4A4: the activation quantization and its calibration ({} for weight-only outputs)."""
    acts = getattr(fmt, "activations", "none")
    if acts == "none":
        return {}
    return {"activations": {"scheme": acts, "input_scale_suffix": fmt.input_suffix if acts == "nvfp4" else None,
                            "calibration": getattr(fmt, "calibration", None)}}


def manifest_problem(m: object) -> str | None:
    """Why ``m`` is not a well-formed fp4convert manifest (None when it is): checked before anything
    trusts what it lists (export reads it, --overwrite deletes the files it names)."""
    if not isinstance(m, dict):
        return "the manifest is not a JSON object"
    made_by = m.get("producer")
    if not isinstance(made_by, dict) or made_by.get("name") != "fp4convert":
        return "the manifest was not written by fp4convert (producer.name)"
    if not isinstance(m.get("manifest_version"), int):
        return "the manifest has no integer manifest_version"
    for key in ("format", "scheme"):
        if not isinstance(m.get(key), str):
            return f"the manifest's {key!r} is not a string"
    files, tensors = m.get("files"), m.get("tensors")
    if not isinstance(files, dict):
        return "the manifest's 'files' is not an object"
    for name, rec in files.items():
        if (not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str) or type(rec.get("size")) is not int
                or name.startswith("/") or ".." in name.split("/")):
            return f"the manifest's record of file {name!r} is malformed"
    if not isinstance(tensors, dict):
        return "the manifest's 'tensors' is not an object"
    for name, rec in tensors.items():
        if (not isinstance(rec, dict) or rec.get("action") not in ("quantize", "keep")
                or not isinstance(rec.get("dtype"), str) or not isinstance(rec.get("source_file"), str)
                or not isinstance(rec.get("shape"), list) or not all(type(d) is int and d >= 0 for d in rec["shape"])
                or not isinstance(rec.get("outputs"), dict) or not isinstance(rec.get("reason"), str)):
            return f"the manifest's record of tensor {name!r} is malformed"
    if not isinstance(m.get("groups", {}), dict):
        return "the manifest's 'groups' is not an object"
    return None


def portable_description(source: Source) -> dict:
    """The source as a published folder may name it: a local source by its folder name, never its path."""
    desc = source.describe()
    if desc.get("type") == "local":
        desc = {**desc, "path": source.root.name}
    return desc


def load_manifest(root: Path) -> dict | None:
    """The manifest of a finished conversion in ``root``, or None; a damaged one is an error naming it."""
    path = root / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read ({exc.strerror})") from exc
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointFormatError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:100]}); the manifest is "
                                    "damaged: re-create the checkpoint, or remove the file") from exc
    if not isinstance(m, dict):
        raise CheckpointFormatError(f"{path}: not a manifest (a JSON {type(m).__name__}, not an object)")
    return m
