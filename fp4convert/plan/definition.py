"""Every tensor's role from the model's own definition: transformers builds the model, we read it.

Names are guesses; transformers knows. For an architecture it ships, the model is built from
``config.json`` on the ``meta`` device (no weights read, no memory for them: a 671B-parameter
DeepSeek-V3 config builds in ~0.05 s), and every checkpoint key is mapped to the parameter it loads
into with transformers' OWN key conversion (``conversion_mapping.get_model_conversion_mapping`` and
``core_model_loading.rename_source_key``: the renames and the per-expert merges its loader applies).
The parameter's module then says what the tensor is:

- ``nn.Linear`` ``weight``: a matmul weight ``[out, in]`` (the input axis is known);
- a transformers experts module (``@use_experts_implementation``: ``is_transposed``,
  ``is_concatenated``, ``has_gate``): a 3-D expert stack whose orientation and gate/up packing are
  stated by the class, or one expert's 2-D weight merged into it at load;
- everything else (``Embedding``, GPT-2 ``Conv1D``, ``Conv1d``/``Conv2d``, norms, routers, position
  tables, parameters of custom modules) is kept, with a reason that names the module class.

Through a transformers converter, the disk tensor's axes are tracked to the parameter's
(``MergeModulelist`` inserts the expert axis, ``Transpose`` swaps, ``Concatenate``/``Chunk``/``Split``/
``Interleave`` keep them), so an expert stack stored ``[E, H, 2I]`` and one stored ``[E, 2I, H]`` are
both split along their input axis; an operation this module does not know keeps the tensor.

Pure of I/O and of tensor data; importing this module imports neither torch nor transformers (the
CLI's ``--help``/``--version`` never pay for them). docs/architecture.md says where it sits.

This module is the entry point, :func:`load`: the definition is built in a child process
(``python -m fp4convert.plan.definition``) and cached on disk. What it is built from: :mod:`.model_build`
(transformers builds the model, the keys are mapped), :mod:`.role_rules` (each tensor's role from its module),
:mod:`.fp4_loading` (what transformers can load as FP4), :mod:`.parts` (the language model, routers by role);
what it says: :mod:`.roles`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.plan.model_build import build, check_config
from fp4convert.plan.roles import Definition, Role, Unknown, one_line

if TYPE_CHECKING:
    from fp4convert.storage.safetensors import TensorInfo

log = logging.getLogger(__name__)

# The modules whose code decides a definition: a change to any of them invalidates the cached ones.
BUILT_FROM = ("definition.py", "model_build.py", "role_rules.py", "fp4_loading.py", "roles.py", "parts.py", "families.py")


def cache_dir() -> Path:
    """Where definitions are cached: FP4CONVERT_DEFINITION_CACHE, else ~/.cache/fp4convert/definitions."""
    env = os.environ.get("FP4CONVERT_DEFINITION_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp4convert" / "definitions"


def _cache_key(model_config: dict, tensors: list[TensorInfo]) -> str | None:
    """What a definition depends on: the config, the tensor names and shapes, the transformers version
    and the source of the modules it is built from (:data:`BUILT_FROM`). Computed without importing
    transformers or torch."""
    try:
        version = importlib.metadata.version("transformers")
        h = hashlib.sha256()
        h.update(json.dumps(model_config, sort_keys=True, default=str).encode())
        h.update(json.dumps(sorted((t.name, list(t.shape)) for t in tensors)).encode())
        h.update(version.encode())
        for module in BUILT_FROM:
            h.update(Path(__file__).with_name(module).read_bytes())
        return h.hexdigest()
    except Exception:  # noqa: BLE001 - no cache then (odd values, no transformers metadata)
        return None


def load(model_config: dict, tensors: list[TensorInfo]) -> Definition:
    """The definition of the model ``model_config`` describes, with a role for every tensor.

    Raises :class:`Unknown` (with the reason) when transformers is not installed, does not know the
    architecture (remote code, newer than the installed version) or cannot build it from this config.
    A definition is cached on disk (:func:`cache_dir`, keyed by config, tensor names and shapes,
    transformers version and this module), so a repeated or resumed run does not import transformers
    and torch again just to plan (2-5 s; the torch-free CUDA path never imports torch otherwise).
    """
    check_config(model_config)  # cheap checks here, before a child is started or the cache read
    key = _cache_key(model_config, tensors)
    if key is not None:
        cached = _read_cache(key)
        if cached is not None:
            return cached
    d = _build_in_child(model_config, tensors)
    if key is not None:
        _write_cache(key, d)
    return d


def _build_in_child(model_config: dict, tensors: list[TensorInfo]) -> Definition:
    """Build the definition in a child process (``python -m fp4convert.plan.definition``): transformers and torch
    (2-12 s of imports, ~180 MiB) never enter the converter's process, so ``--dry-run`` and the torch-free
    CUDA path stay torch-free and the converter's memory does not carry them."""
    import subprocess
    import sys

    request = json.dumps({"config": model_config, "tensors": [[t.name, list(t.shape)] for t in tensors]},
                         default=str)
    try:
        r = subprocess.run([sys.executable, "-m", "fp4convert.plan.definition"], input=request, capture_output=True,
                           text=True, timeout=600, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unknown(f"the model definition could not be built ({type(exc).__name__}: {one_line(exc)})") from exc
    try:
        obj = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    except ValueError:
        obj = None
    if obj is None:
        tail = " ".join(r.stderr.split())[-200:]
        raise Unknown(f"the model definition could not be built (exit {r.returncode}: {tail})")
    if "unknown" in obj:
        raise Unknown(obj["unknown"])
    return _from_json(obj)


def _to_json(d: Definition) -> dict:
    return {"model_class": d.model_class, "transformers_version": d.transformers_version, "heads": list(d.heads),
            "head_on_disk": d.head_on_disk, "roles": {n: asdict(r) for n, r in d.roles.items()},
            "transformers_cannot_load": d.transformers_cannot_load, "language_model": d.language_model,
            "unbuilt": d.unbuilt}


def _from_json(obj: dict) -> Definition:
    roles = {n: Role(**{**r, "also": tuple(r.get("also") or ()),
                        "names": tuple(r["names"]) if r.get("names") else None}) for n, r in obj["roles"].items()}
    return Definition(obj["model_class"], obj["transformers_version"], roles, tuple(obj["heads"]),
                      bool(obj["head_on_disk"]), transformers_cannot_load=obj.get("transformers_cannot_load", ""),
                      language_model=obj.get("language_model"), unbuilt=obj.get("unbuilt", ""))


def _child_main() -> None:
    """``python -m fp4convert.plan.definition``: a request on stdin, the definition (or why not) as JSON on stdout."""
    import sys

    from fp4convert.storage.safetensors import TensorInfo

    req = json.loads(sys.stdin.read())
    tensors = [TensorInfo(n, "BF16", tuple(shape), "", 0, 0) for n, shape in req["tensors"]]
    try:
        out = _to_json(build(req["config"], tensors))
    except Unknown as exc:
        out = {"unknown": str(exc)}
    sys.stdout.write("\n" + json.dumps(out) + "\n")


def _read_cache(key: str) -> Definition | None:
    path = cache_dir() / f"{key}.json"
    try:
        with open(path, encoding="utf-8") as f:
            return _from_json(json.load(f))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged cache entry is rebuilt
        log.debug("definition cache %s unreadable (%s); rebuilding", path, exc)
        return None


def _write_cache(key: str, d: Definition) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        obj = _to_json(d)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, folder / f"{key}.json")
    except OSError as exc:
        log.debug("definition cache not written (%s)", exc)


if __name__ == "__main__":
    _child_main()
