"""The manifest ``fp4convert.json``: every decision with its reason, the settings, and checksums.

It is written last, so its presence means the conversion finished. It holds no timestamps: the
same input and settings give a byte-identical manifest, like every other output file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import CheckpointFormatError
from fp4convert.numerics.scheme import get_scheme
from fp4convert.storage.checksum import file_sha256
from fp4convert.storage.names import LOCK_NAME, MANIFEST_NAME, PROGRESS_NAME  # noqa: F401 - re-exported (names.py states them)
from fp4convert.version import producer

if TYPE_CHECKING:
    from fp4convert.formats.base import OutputFormat
    from fp4convert.plan.planner import Plan
    from fp4convert.source.source import Source

# Identity keys kept in the progress record only: the manifest of a copied or touched source stays the same.
PROGRESS_ONLY = ("source_mtimes", "source_sha256")
MANIFEST_VERSION = 2  # 2: weight shards recorded with chunked_sha256 (docs/formats.md); 1: sha256 only


def build_manifest(plan: Plan, fmt: OutputFormat, source: Source, identity: dict, state: dict, dst: Path,
                   written: list[str], calibration: dict | None = None, method: dict | None = None) -> dict:
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
        files[rel] = {"sha256": file_sha256(p), "size": p.stat().st_size}
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
    out.update(activation_section(fmt, calibration))
    if method is not None:  # a calibrated method (--method): how its pass went (its settings are in "settings")
        out["method"] = method
    return out


def manifest_text(manifest: dict) -> str:
    """The manifest as written: sorted keys, one line per entry of its per-tensor and per-file maps.

    ``json.dumps(..., indent=2)`` runs the pure-Python encoder (indenting disables the C one): 0.1-0.5 s
    for a MoE's thousands of records, at the very end of a run, on its critical path. Each entry here is
    encoded by the C encoder on its own line, which keeps the file readable and diffable by tensor."""
    def one(v: object) -> str:
        return json.dumps(v, sort_keys=True)

    lines = []
    for key in sorted(manifest):
        v = manifest[key]
        if isinstance(v, dict) and v:
            inner = ",\n".join(f"    {one(k)}: {one(v[k])}" for k in sorted(v))
            lines.append(f"  {one(key)}: {{\n{inner}\n  }}")
        else:
            lines.append(f"  {one(key)}: {one(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def activation_section(fmt: OutputFormat, calibration: dict | None = None) -> dict:
    """W4A4: the activation quantization and its calibration ({} for weight-only outputs)."""
    acts = fmt.activations
    if acts == "none":
        return {}
    return {"activations": {"scheme": acts, "input_scale_suffix": fmt.input_suffix if acts == "nvfp4" else None,
                            "calibration": calibration}}


# ---------------------------------------------------------------------------------------------
# The manifest's schema: every field inspect, export and --resume read, with its type
# ---------------------------------------------------------------------------------------------
#
# A spec is a Python type (``str``, ``int``: not bool, ``float``: any finite JSON number, ``bool``,
# ``dict``: any object, ``list``: any array), a tuple of allowed constant values, or one of the
# small classes below. Keys not named are allowed (newer fp4convert versions may add some).

class _Opt:
    """The value may also be null."""

    def __init__(self, spec: object) -> None:
        self.spec = spec


class _ListOf:
    def __init__(self, spec: object, min_value: int | None = None) -> None:
        self.spec, self.min_value = spec, min_value


class _MapOf:
    """An object whose keys are free (tensor or file names) and whose values all follow ``spec``."""

    def __init__(self, spec: object, key_check=None) -> None:
        self.spec, self.key_check = spec, key_check


class _Obj:
    """An object with named fields: ``{key: spec}`` required, ``{key: _Missing(spec)}`` optional."""

    def __init__(self, fields: dict[str, object]) -> None:
        self.fields = fields


class _Missing:
    def __init__(self, spec: object) -> None:
        self.spec = spec


class _Scales:
    """A global scale or amax record: a finite number, or (stacked experts) nested lists of them."""


def _ragged(v: list) -> bool:
    """Whether nested lists (of numbers) are not one rectangular array: items of mixed depth or length."""
    shapes = {(type(x) is list, len(x) if type(x) is list else 0) for x in v}
    if len(shapes) > 1:
        return True
    return any(_ragged(x) for x in v if type(x) is list)


def _relative_file(name: str) -> str | None:
    if not name or name.startswith("/") or "\\" in name or "\0" in name or ".." in name.split("/") \
            or any(p in ("", ".") for p in name.split("/")):
        return "is not a plain relative path inside the folder"
    return None


_SHAPE = _ListOf(int, min_value=0)
_OUTPUT = _Obj({"dtype": str, "shape": _SHAPE, "file": _Missing(str)})
_MATRIX = _Obj({"amax": _Missing(_Scales()), "global_scale": _Missing(_Scales())})
_TENSOR = _Obj({
    "action": ("quantize", "keep"),
    "reason": str,
    "group": _Missing(_Opt(str)),
    "dtype": str,
    "shape": _SHAPE,
    "source_file": str,
    "outputs": _MapOf(_OUTPUT),
    "global_scale": _Missing(_Scales()),
    "amax": _Missing(_Scales()),
    "matrices": _Missing(_MapOf(_MATRIX)),
})
_FILE = "file"  # size and a checksum: fp4convert.storage.checksum.record_problem
_SOURCE_RECORD = _Obj({"type": _Missing(_Opt(str)), "files": _Missing(_MapOf(dict))})
SCHEMA = _Obj({
    "manifest_version": (MANIFEST_VERSION,),  # another version's fields may mean other things: not guessed
    "producer": _Obj({"name": ("fp4convert",), "version": _Missing(_Opt(str))}),
    "format": "format",
    "scheme": "scheme",
    "rotate": _Missing(_Opt(("had16",))),
    "scale_rule": _Missing(_Opt(str)),
    "block_size": _Missing(_Opt(int)),
    "settings": dict,
    "identity": _Missing(_Obj({"source": _Missing(_Opt(_SOURCE_RECORD)),
                               "exported_from": _Missing(_Opt(_Obj({"source": _Missing(_Opt(_SOURCE_RECORD))})))})),
    "source": _Missing(dict),
    "summary": _Missing(dict),
    "groups": _Missing(_MapOf(_ListOf(str))),
    "tensors": _MapOf(_TENSOR),
    "files": _MapOf(_FILE, key_check=_relative_file),
    "activations": _Missing(_Opt(_Obj({"scheme": _Missing(_Opt(str)), "input_scale_suffix": _Missing(_Opt(str)),
                                       "calibration": _Missing(_Opt(dict))}))),  # W4A4 (activation_section)
    "method": _Missing(_Opt(_Obj({"method": str}))),  # a calibrated method (build_manifest)
})

_KIND = {str: "a string", int: "an integer", float: "a number", bool: "true/false", dict: "an object", list: "an array"}


def _json_kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true/false"
    return {str: "a string", int: "an integer", float: "a number", dict: "an object", list: "an array"}.get(
        type(v), type(v).__name__)


MAX_INT = (1 << 63) - 1  # the largest count, size or shape a manifest may hold (int64, as torch and the OS take)


def _finite(v: object) -> bool:
    """A JSON number a float holds finitely: a 400-digit integer is an int to Python's json but no float
    (float() of it raises OverflowError), and NaN/Infinity tokens are floats but not finite."""
    if type(v) not in (int, float):
        return False
    try:
        return math.isfinite(float(v))  # type: ignore[arg-type]
    except OverflowError:
        return False


def _check(v: object, spec: object, where: str) -> str | None:
    """Why ``v`` does not follow ``spec`` (None when it does); ``where`` names the field."""
    if isinstance(spec, _Opt):
        return None if v is None else _check(v, spec.spec, where)
    if spec is int:
        if type(v) is int and abs(v) > MAX_INT:  # shapes, sizes, block sizes: an int64 holds them
            return f"{where} is an integer of {len(str(abs(v)))} digits, too large for a count or size"
        return None if type(v) is int else f"{where} is {_json_kind(v)}, not an integer"
    if spec is float:
        ok = _finite(v)
        return None if ok else f"{where} is {_json_kind(v)}, not a finite number"
    if spec in (str, bool, dict, list):
        return None if type(v) is spec else f"{where} is {_json_kind(v)}, not {_KIND[spec]}"
    if spec == "size":
        return None if type(v) is int and 0 <= v <= MAX_INT else f"{where} is {_json_kind(v)}, not a size in bytes"
    if spec == "file":
        from fp4convert.storage.checksum import record_problem

        size = v.get("size") if isinstance(v, dict) else None
        if type(size) is int and not 0 <= size <= MAX_INT:
            return f"{where}.'size' is {'an integer too large for' if size > 0 else 'negative, not'} a size in bytes"

        return None if (why := record_problem(v)) is None else f"{where} {why}"
    if spec in ("format", "scheme"):
        from fp4convert.formats import OUTPUT_FORMATS
        from fp4convert.numerics.scheme import SCHEMES

        known = OUTPUT_FORMATS if spec == "format" else SCHEMES
        return None if isinstance(v, str) and v in known else \
            f"{where} is {v!r:.40}, not one of {', '.join(known)}"
    if isinstance(spec, tuple):
        ok = isinstance(v, (str, int)) and not isinstance(v, bool) and v in spec
        return None if ok else f"{where} is {v!r:.40}, not one of {list(spec)}"
    if isinstance(spec, _Scales):
        if type(v) in (int, float):
            return None if _finite(v) else f"{where} is not a finite number a float can hold"
        if isinstance(v, list) and len(json.dumps(v)) < 1 << 24:
            why = next((w for i, x in enumerate(v) if (w := _check(x, spec, f"{where}[{i}]"))), None)
            if why is None and _ragged(v):  # readers make one tensor of it (a ragged list was a TypeError, exit 1)
                return f"{where} is a nested list of uneven lengths or depths, not an array of numbers"
            return why
        return f"{where} is {_json_kind(v)}, not a number"
    if isinstance(spec, _ListOf):
        if not isinstance(v, list):
            return f"{where} is {_json_kind(v)}, not an array"
        for i, x in enumerate(v):
            if (why := _check(x, spec.spec, f"{where}[{i}]")):
                return why
            if spec.min_value is not None and x < spec.min_value:
                return f"{where}[{i}] is {x}, below {spec.min_value}"
        return None
    if isinstance(spec, _MapOf):
        if not isinstance(v, dict):
            return f"{where} is {_json_kind(v)}, not an object"
        for k, x in v.items():
            at = f"{where}[{k!r:.80}]"
            if spec.key_check and (why := spec.key_check(k)):
                return f"{at} {why}"
            if (why := _check(x, spec.spec, at)):
                return why
        return None
    if isinstance(spec, _Obj):
        if not isinstance(v, dict):
            return f"{where} is {_json_kind(v)}, not an object"
        for k, sub in spec.fields.items():
            at = f"{where}.{k!r}" if where else repr(k)
            if k not in v:
                if isinstance(sub, _Missing):
                    continue
                return f"{at} is missing"
            if (why := _check(v[k], sub.spec if isinstance(sub, _Missing) else sub, at)):
                return why
        return None
    raise TypeError(f"unknown schema spec {spec!r}")  # a bug in SCHEMA, not in the manifest


def manifest_problem(m: object) -> str | None:
    """Why ``m`` is not a well-formed fp4convert manifest (None when it is): checked against
    :data:`SCHEMA` before anything trusts what it lists (inspect and export read it, --overwrite deletes
    the files it names). The answer is one line naming the field, e.g. "the manifest's
    files['model.safetensors'].sha256 is an integer, not a string"."""
    if not isinstance(m, dict):
        return "the manifest is not a JSON object"
    made_by = m.get("producer")
    if not isinstance(made_by, dict) or made_by.get("name") != "fp4convert":
        return "the manifest was not written by fp4convert (producer.name)"
    why = _check(m, SCHEMA, "")
    return None if why is None else f"the manifest is malformed: {why}"


def portable_description(source: Source) -> dict:
    """The source as a published folder may name it: a local source by its folder name, never its path."""
    desc = source.describe()
    if desc.get("type") == "local":
        desc = {**desc, "path": source.root.name}
    return desc


MAX_MANIFEST = 1 << 30  # bytes; a manifest lists every tensor (~1 kB each), far below this


def load_manifest(root: Path, roots: tuple[str, ...] | None = None) -> dict | None:
    """The manifest of a finished conversion in ``root``, or None; a damaged one is an error naming it.

    The file must be a regular file (a FIFO would hang the read) and, when ``roots`` is given, resolve
    inside one of them (a symlink out of the checkpoint is not followed). The content must follow
    :data:`SCHEMA`: every reader may then index the fields it uses without further checks.
    """
    import os

    from fp4convert.storage.reads import read_regular_file
    from fp4convert.storage.strict_json import loads_bounded

    path = root / MANIFEST_NAME
    if not os.path.lexists(path):
        return None
    if roots is not None:
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
            raise CheckpointFormatError(f"{path}: a symlink to {real}, outside the checkpoint folder; not read")
    try:
        raw = read_regular_file(path, MAX_MANIFEST)
    except OSError as exc:
        raise CheckpointFormatError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        m = loads_bounded(raw)  # Python's json, nesting bounded (a deep list is a ValueError, not a RecursionError)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointFormatError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:100]}); the manifest is "
                                    "damaged: re-create the checkpoint, or remove the file") from exc
    if not isinstance(m, dict):
        raise CheckpointFormatError(f"{path}: not a manifest (a JSON {type(m).__name__}, not an object)")
    why = manifest_problem(m)
    if why:
        raise CheckpointFormatError(f"{path}: {why}; re-create the checkpoint with fp4convert, or remove the file")
    return m
