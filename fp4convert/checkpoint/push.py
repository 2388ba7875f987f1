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

import errno
import json
import logging
import os
import sys
from pathlib import Path

from fp4convert.errors import ConfigError, OutputError, PushError, SourceError
from fp4convert.output.card import PLACEHOLDER, build_card
from fp4convert.output.manifest import MANIFEST_NAME, PROGRESS_NAME, manifest_text
from fp4convert.plan.planner import Plan
from fp4convert.source.paths import check_relative, one_line
from fp4convert.source.source import Source
from fp4convert.storage.checksum import file_sha256, matches, record_problem
from fp4convert.storage.names import CARD_NAME

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


def _open_in(folder: Path, rel: str) -> int:
    """A read-only descriptor of folder/``rel``: real folders down to it, the file itself no symlink and regular."""
    import stat

    from fp4convert.output.files import dst_dir

    parent, _, leaf = rel.rpartition("/")
    try:
        with dst_dir(folder, parent) as dfd:
            fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OutputError as exc:
        raise PushError(f"{exc}; nothing pushed") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PushError(f"{folder / rel} is a symlink; fp4convert pushes only the files it wrote, never a "
                            "symlink's target: nothing pushed (re-create the output)") from None
        raise PushError(f"{folder / rel}: cannot read ({exc.strerror or exc}); nothing pushed") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PushError(f"{folder / rel} is not a regular file; nothing pushed")
    os.set_blocking(fd, True)
    return fd


def _read_small(folder: Path, rel: str, limit: int = 1 << 30) -> bytes:
    with os.fdopen(_open_in(folder, rel), "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise PushError(f"{folder / rel} is too large for what it should be; nothing pushed")
    return data


def load_push_manifest(folder: Path) -> dict:
    """The manifest of a finished output, read contained, with a well-formed file list."""
    if not os.path.lexists(folder / MANIFEST_NAME):
        raise OutputError(f"{folder}: no {MANIFEST_NAME}, so the conversion did not finish; nothing pushed")
    try:
        manifest = json.loads(_read_small(folder, MANIFEST_NAME))
    except (ValueError, RecursionError) as exc:
        raise PushError(f"{folder / MANIFEST_NAME} is not valid JSON ({str(exc)[:80]}); nothing pushed") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise PushError(f"{folder / MANIFEST_NAME} has no file list; nothing pushed (re-create the output)")
    for name, rec in files.items():
        try:
            check_relative(name, f"{MANIFEST_NAME}: file")
        except SourceError as exc:
            raise PushError(f"{exc}; nothing pushed") from None
        if name == MANIFEST_NAME or record_problem(rec):
            raise PushError(f"{folder / MANIFEST_NAME}: the record of {name!r} is malformed; nothing pushed")
    return manifest


def verify_listed_files(folder: Path, manifest: dict) -> list[str]:
    """Every file the manifest lists: a regular file inside ``folder`` (no symlink on the way) whose size
    and sha256 are the recorded ones. Returns the names; a file that differs is a PushError naming it."""
    names = sorted(manifest["files"])
    for name in names:
        rec = manifest["files"][name]
        with os.fdopen(_open_in(folder, name), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != rec["size"]:
                raise PushError(f"{folder / name} differs from {MANIFEST_NAME} (size {size}, recorded "
                                f"{rec['size']}); nothing pushed: re-create the output or restore the file")
            same = matches(fh, rec)
        if not same:
            raise PushError(f"{folder / name} differs from {MANIFEST_NAME} (sha256); nothing pushed: re-create the "
                            "output or restore the file")
    return names


def retarget_card(folder: Path, repo_id: str) -> None:
    """Name the Hub repo in the model card's commands, and keep the manifest's checksum of it true.

    The card must be the one the manifest lists (ours); it is re-rendered from the manifest with the
    base model our card named, and both files are rewritten contained (:func:`writer.write_new`)."""
    from fp4convert.output.card import build_card, own_card, split_card, valid_repo_id
    from fp4convert.output.files import write_new

    manifest = load_push_manifest(folder)
    if CARD_NAME not in manifest["files"]:
        return
    text = _read_small(folder, CARD_NAME).decode("utf-8", errors="replace")
    if PLACEHOLDER not in text or not own_card(text, manifest):
        return
    config: dict = {}
    if "config.json" in manifest["files"]:
        try:
            config = json.loads(_read_small(folder, "config.json"))
        except (ValueError, RecursionError):
            config = {}
    meta, _ = split_card(text)
    new = build_card(manifest, text, repo_hint=repo_id, base_model=valid_repo_id(meta.get("base_model")),
                     config=config if isinstance(config, dict) else {}, original_is_ours=True)
    with _writing(folder):
        write_new(folder, CARD_NAME, new.encode())
        manifest["files"][CARD_NAME] = {"sha256": file_sha256(folder / CARD_NAME), "size": len(new.encode())}
        write_new(folder, MANIFEST_NAME, manifest_text(manifest).encode())


def _writing(folder: Path):
    from fp4convert.output.files import writing

    return writing(folder, resumable=False)


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None,
                revision: str | None = None, commit_message: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload a finished output folder; returns the commit URL.

    Exactly the files the manifest lists are uploaded (and the manifest): each checked first to be a
    regular file inside the folder, no symlink on the way, with the recorded size and sha256, so an
    ``.env``, a stray file or a symlink's target never goes to the Hub; a listed file that is a symlink
    or differs refuses the push (exit 5) before anything is created."""
    import glob

    folder = Path(folder)
    manifest = load_push_manifest(folder)
    names = verify_listed_files(folder, manifest)
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    except Exception as exc:  # huggingface_hub raises many types; all mean "cannot create"
        raise PushError(f"{repo_id}: cannot create the repo on the Hub ({one_line(exc)})") from exc
    retarget_card(folder, repo_id)
    manifest = load_push_manifest(folder)
    if sorted(manifest["files"]) != names:
        raise PushError(f"{folder / MANIFEST_NAME} changed during the push; nothing uploaded")
    message = commit_message or (f"fp4convert {(manifest.get('producer') or {}).get('version', '')}: "
                                 f"{manifest.get('scheme')} {manifest.get('format')}").strip()
    log.info("uploading %s to %s", folder, repo_id)
    try:
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                                 commit_message=message, ignore_patterns=IGNORE_ON_PUSH,
                                 allow_patterns=[glob.escape(n) for n in [*names, MANIFEST_NAME]])
    except Exception as exc:
        raise PushError(f"{repo_id}: upload failed ({one_line(exc)}); run the same command again to upload "
                        "only what is missing") from exc
    return str(getattr(info, "commit_url", info))


