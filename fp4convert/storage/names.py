"""The names of the files fp4convert writes into an output folder (and reads back from one), stated once.

Every module that writes, finds, lists, cleans up or uploads one of these files imports its name from
here: the planner names the shards, the writer the control files, the formats their config files,
``inspect`` / ``export`` / ``push`` read them back. Imports nothing.
"""

from __future__ import annotations

import re

# The output's data: safetensors shards and their index (the names transformers and the engines expect).
SINGLE_SHARD = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_PATTERN = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")

# fp4convert's own files: the manifest (written last: its presence means "finished"), the progress
# record of an interrupted run (one per part, see below, while the parts run), and the lock.
MANIFEST_NAME = "fp4convert.json"
PROGRESS_NAME = ".fp4convert-progress.json"
LOCK_NAME = ".fp4convert.lock"  # flock'd by the run writing the folder (holds its pid)
OWN_FILES = (MANIFEST_NAME, PROGRESS_NAME, LOCK_NAME)  # their presence marks a folder as an fp4convert output
PART_RECORD = re.compile(r"^" + re.escape(PROGRESS_NAME[: -len(".json")]) + r"\.rank\d+\.json$")

# Files a format or the model card writes beside the shards.
CONFIG_NAME = "config.json"
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt
CARD_NAME = "README.md"
FORMAT_FILES = (CONFIG_NAME, HF_QUANT_CONFIG, CARD_NAME)

PARTIAL = ".partial"  # every file is written under NAME.partial and renamed into place when complete


def shard_names(n: int) -> list[str]:
    """The names of an output cut into ``n`` shards (one: ``model.safetensors``)."""
    return [SINGLE_SHARD] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def part_record(part: int) -> str:
    """The progress record of one part of a run (a torchrun rank or a lane): each part keeps its own
    (no write race); the run merges them into :data:`PROGRESS_NAME` before it finishes."""
    return PROGRESS_NAME.replace(".json", f".rank{part}.json")

REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]{0,95}/)?[A-Za-z0-9][\w.\-]{0,95}$")


def valid_repo_id(value: object) -> str | None:
    """``value`` if it is a Hub model id (``org/name`` or a legacy ``name``), else None."""
    if not isinstance(value, str) or not REPO_ID.match(value) or "--" in value or ".." in value:
        return None
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(value)
    except Exception:  # HFValidationError: not a repo id
        return None
    return value
