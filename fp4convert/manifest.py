"""The manifest ``fp4convert.json``: every decision with its reason, the settings, and checksums.

It is written last, so its presence means the conversion finished. It holds no timestamps: the
same input and settings give a byte-identical manifest, like every other output file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .scheme import get_scheme
from .version import __version__

if TYPE_CHECKING:
    from .formats.base import OutputFormat
    from .plan import Plan
    from .source import Source

MANIFEST_NAME = "fp4convert.json"
PROGRESS_NAME = ".fp4convert-progress.json"
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
    return {
        "manifest_version": MANIFEST_VERSION,
        "producer": {"name": "fp4convert", "version": __version__},
        "format": fmt.name,
        "scheme": cfg.scheme,
        "rotate": cfg.rotate,
        "block_size": scheme.block_size,
        "scale_layout": "128x4" if fmt.swizzled else "linear",
        "scale_dtype": "float8_e4m3fn" if scheme.scale_encoding == "e4m3" else "e8m0",
        "global_scale": "encode scale gs = 2688 / amax; w = e2m1 * scale / gs" if scheme.global_scale else None,
        "settings": cfg.identity(),
        "source": {**portable_description(source), "weight_files": list(source.weight_files)},
        "identity": {k: v for k, v in identity.items() if k != "source_mtimes"},
        "summary": plan.summary(),
        "groups": {g: m for g, m in plan.groups.items()},
        "tensors": tensors,
        "files": files,
    }


def portable_description(source: Source) -> dict:
    """The source as a published folder may name it: a local source by its folder name, never its path."""
    desc = source.describe()
    if desc.get("type") == "local":
        desc = {**desc, "path": source.root.name}
    return desc


def load_manifest(root: Path) -> dict | None:
    """The manifest of a finished conversion in ``root``, or None."""
    path = root / MANIFEST_NAME
    if not path.exists():
        return None
    return json.loads(path.read_text())
