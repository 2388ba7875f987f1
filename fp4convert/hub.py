"""The Hugging Face Hub as a destination (push) and the HF cache of a Hub source (cleanup).

Pushing goes through ``huggingface_hub`` (``create_repo`` then ``upload_folder``): with ``hf_xet``
installed it uploads in resumable batches; without it, one commit whose LFS objects are uploaded
first. Either way an upload that was interrupted resumes by running the same push again: the Hub
answers "already stored" for what it has (LFS batch / Xet dedupe) and unchanged files are left out
of the commit, so only what is missing travels.

``ShardReleaser`` removes each source shard of a Hub conversion from the HF cache once the work loop
has used its last tensor, so a 400 GB conversion needs disk for one source shard plus the output.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from .errors import ConfigError, OutputError, PushError
from .manifest import MANIFEST_NAME, PROGRESS_NAME, file_digest
from .modelcard import CARD_NAME, PLACEHOLDER, build_card
from .plan import Plan
from .source import Source, one_line

log = logging.getLogger(__name__)

IGNORE_ON_PUSH = [PROGRESS_NAME, "*.partial", ".cache/**"]


def disable_hub_progress_bars() -> None:
    """huggingface_hub's own tqdm bars (downloads, uploads) off: for --quiet and for piped output."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is imported
    if "huggingface_hub" not in sys.modules:
        return  # a local conversion never imports it (0.1-0.2 s of start-up)
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        pass


def retarget_card(folder: Path, repo_id: str) -> None:
    """Name the Hub repo in the model card's commands, and keep the manifest's checksum of it true."""
    manifest_path = folder / MANIFEST_NAME
    card = folder / CARD_NAME
    if not card.is_file() or not manifest_path.is_file():
        return
    text = card.read_text(errors="replace")
    if PLACEHOLDER not in text:
        return
    manifest = json.loads(manifest_path.read_text())
    new = build_card(manifest, text, repo_hint=repo_id)
    tmp = card.with_name(card.name + ".partial")
    tmp.write_text(new)
    os.replace(tmp, card)
    if CARD_NAME in manifest.get("files", {}):
        manifest["files"][CARD_NAME] = {"sha256": file_digest(card), "size": card.stat().st_size}
        tmp = manifest_path.with_name(manifest_path.name + ".partial")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, manifest_path)


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
                revision: str | None = None, commit_message: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload a finished output folder; returns the commit URL."""
    folder = Path(folder)
    if not (folder / MANIFEST_NAME).is_file():
        raise OutputError(f"{folder}: no {MANIFEST_NAME}, so the conversion did not finish; nothing pushed")
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    except Exception as exc:  # huggingface_hub raises many types; all mean "cannot create"
        raise PushError(f"{repo_id}: cannot create the repo on the Hub ({one_line(exc)})") from exc
    retarget_card(folder, repo_id)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    message = commit_message or (f"fp4convert {manifest.get('producer', {}).get('version', '')}: "
                                 f"{manifest.get('scheme')} {manifest.get('format')}").strip()
    log.info("uploading %s to %s", folder, repo_id)
    try:
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                                 commit_message=message, ignore_patterns=IGNORE_ON_PUSH)
    except Exception as exc:
        raise PushError(f"{repo_id}: upload failed ({one_line(exc)}); run the same command again to upload "
                        "only what is missing") from exc
    return str(getattr(info, "commit_url", info))


class ShardReleaser:
    """A progress callback that also deletes each cached Hub shard after its last work unit.

    ``writer.write_outputs`` calls progress once per work unit, in ``plan.units()`` order (skipped
    units included), which is what lets this know when a shard has been used for the last time.
    """

    def __init__(self, source: Source, plan: Plan, inner=None) -> None:
        if not source.is_hub:
            raise ConfigError("--delete-source-shards applies to Hub sources (it cleans the HF cache); "
                              "fp4convert never deletes a local folder's files")
        self.source, self.inner = source, inner
        self.units = plan.units()
        self.last: dict[str, int] = {}
        for i, unit in enumerate(self.units):
            for d in unit:
                self.last[d.info.file] = i
        self.position = 0
        self.deleted: list[str] = []

    def __call__(self, n: int) -> None:
        if self.inner is not None:
            self.inner(n)
        i = self.position
        self.position += 1
        if i >= len(self.units):
            return
        for f in sorted({d.info.file for d in self.units[i]}):
            if self.last.get(f) == i:
                self.release(f)

    def release(self, file: str) -> None:
        """Remove one shard (its blob and its snapshot link) from the HF cache, if it is there."""
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(self.source.repo_id, file, cache_dir=self.source.cache_dir,
                                        revision=self.source.commit)
        if not isinstance(cached, str):
            return
        link = Path(cached)
        blob = link.resolve()
        for p in {link, blob}:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        self.deleted.append(file)
        log.info("removed %s from the HF cache", file)
