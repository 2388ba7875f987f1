"""Which of a source's files are copied into the output, and why not: one rule for a local folder and a Hub repo.

A file is copied unless it is a weight file of another format (pickles, ONNX, ...), a hidden or cache file,
or has a name no checkpoint file can have; the Hub download skips a subset of what the rule refuses
(:func:`hub_ignore_patterns`), never a file it would copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fp4convert.errors import OutsideSourceError
from fp4convert.source.paths import check_relative
from fp4convert.storage.names import OWN_FILES

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".hdf5", ".keras",
                   ".msgpack", ".gguf", ".ggml", ".onnx", ".onnx_data", ".onnx.data", ".tflite", ".ot", ".npz",
                   ".npy", ".pb", ".nemo", ".mlmodel")
# Folders that hold another framework's export (with its own config copies): skipped whole.
WEIGHT_DIRS = ("onnx", "openvino", "flax", "tf", "tensorflow", "coreml", "tflite")
SKIP_DIRS = ("__pycache__",)  # hidden folders (.git, .cache, ...) are skipped too
KEEP_HIDDEN = (".gitattributes",)  # the only dot-files copied (top level): LFS rules for a Hub upload


ODD_NAME = "its name has characters a checkpoint file name cannot have (rename it to copy it)"


def odd_name(rel: str) -> bool:
    """A name :func:`check_relative` refuses (tabs, newlines, ...): such a file is not copied, decided
    with the plan, rather than refused when the run opens it after the shards are written."""
    try:
        check_relative(rel, "file")
    except OutsideSourceError:
        return True
    return False


@dataclass(frozen=True)
class CopyDecision:
    """One file (or folder, ending in '/') of the source and whether it goes into the output."""

    path: str  # relative to the checkpoint root, '/' separated
    copy: bool
    reason: str


def copy_rule(rel: str, skip_dirs: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether the non-weight file (or, ending in '/', the folder) ``rel`` is copied, and why. Pure.

    Copied: configs, tokenizer files, chat templates, generation/processor configs, licences, README,
    custom code, images, ``.gitattributes`` -- anything that is not one of: a weight file of any format
    or its index, a folder of another framework's export, fp4convert's own files, a hidden file or
    folder, a folder in ``skip_dirs`` (nested fp4convert outputs, the destination; folder -> reason), or
    a name no checkpoint file can have (a tab, a newline: refused when opened, so decided here).
    """
    is_dir = rel.endswith("/")
    parts = rel.rstrip("/").split("/")
    dirs, leaf = (parts, "") if is_dir else (parts[:-1], parts[-1])
    for i in range(len(dirs)):
        d = "/".join(dirs[: i + 1])
        if skip_dirs and d in skip_dirs:
            return False, skip_dirs[d]
        low = dirs[i].lower()
        if dirs[i].startswith("."):
            return False, f"hidden folder {dirs[i]}/"
        if low in SKIP_DIRS:
            return False, f"cache folder {dirs[i]}/"
        if low in WEIGHT_DIRS:
            return False, f"folder {dirs[i]}/ holds another framework's weights"
    if is_dir:
        return (False, ODD_NAME) if odd_name(rel.rstrip("/")) else (True, "folder searched")
    low = leaf.lower()
    if leaf in OWN_FILES or low.endswith(".partial"):
        return False, "fp4convert's own file"
    if leaf.startswith("."):
        if rel in KEEP_HIDDEN:
            return True, "repository metadata"
        return False, "hidden file"
    if low.endswith(".safetensors"):
        return False, "weight file (the output has its own)"
    if low.endswith(".index.json") and low[: -len(".index.json")].endswith(WEIGHT_SUFFIXES):
        return False, "weight index (the output has its own)" if low.endswith(".safetensors.index.json") \
            else "index of another weight format"
    for s in WEIGHT_SUFFIXES:
        if low.endswith(s):
            return False, f"another weight format ({s})"
    return (False, ODD_NAME) if odd_name(rel) else (True, "not a weight file")


def hub_ignore_patterns() -> list[str]:
    """``snapshot_download`` ignore patterns: only files :func:`copy_rule` refuses (weights first).

    fnmatch's ``*`` crosses '/', so ``*.bin`` covers every folder; folder rules name the top level and
    any depth. A file these miss is downloaded (it is small) and then judged by :func:`copy_rule`.
    """
    pats = ["*" + s for s in WEIGHT_SUFFIXES]
    pats += ["*" + s + ".index.json" for s in WEIGHT_SUFFIXES if s != ".safetensors"]
    for d in (*WEIGHT_DIRS, *SKIP_DIRS, ".git", ".cache"):
        pats += [f"{d}/*", f"*/{d}/*"]
    return pats


# ---------------------------------------------------------------------------------------------
# JSON files of the checkpoint
# ---------------------------------------------------------------------------------------------
