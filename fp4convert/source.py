"""Where a checkpoint comes from: a local folder or a Hugging Face Hub repo.

Planning reads only safetensors headers. Shard data is fetched when the converter reaches it, one
shard at a time, through ``huggingface_hub`` (token, cache, offline mode and endpoint from its usual
environment variables).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SourceError
from .manifest import MANIFEST_NAME
from .safetensors_io import TensorInfo, parse_header, read_header

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
WEIGHT_PATTERNS = ["*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.h5", "*.msgpack", "*.gguf",
                   "*.onnx", "*.tflite", "*.ot"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """huggingface_hub's multi-line messages (and signed URLs) folded into one short line."""
    text = " ".join(str(exc).split())
    text = re.sub(r"(https?://[^\s?]+)\?\S+", r"\1?...", text)  # drop signed query strings
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


@dataclass
class Source:
    """A checkpoint's weight files and other files, resolved to local paths on demand."""

    label: str  # what the user typed
    root: Path  # local folder holding the non-weight files
    weight_files: list[str]  # safetensors files, relative names, in index order
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    token: str | None = None  # Hub token for gated/private repos (None: huggingface_hub's own login)
    cache_dir: str | None = None  # Hub cache folder (None: HF_HUB_CACHE)
    _header_cache: dict[str, tuple[list[TensorInfo], dict[str, str]]] = field(default_factory=dict, repr=False)

    @property
    def is_hub(self) -> bool:
        return self.repo_id is not None

    def describe(self) -> dict[str, str | None]:
        if self.is_hub:
            return {"type": "hub", "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}
        return {"type": "local", "path": str(self.root)}

    def config(self) -> dict:
        path = self.root / "config.json"
        if not path.exists():
            return {}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}: not valid JSON ({exc})") from exc

    def other_files(self) -> list[Path]:
        """Every file that is not a weight file or weight index (config, tokenizer, README...)."""
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if not p.is_file() or rel.startswith(".") or "/." in rel:
                continue
            if rel in self.weight_files or rel.endswith((".safetensors", ".safetensors.index.json")):
                continue
            if rel.endswith(PICKLE_SUFFIXES) or rel in ("pytorch_model.bin.index.json", MANIFEST_NAME):
                continue
            out.append(p)
        return out

    def local_path(self, file: str) -> Path:
        """A weight file as a local path: downloaded (or taken from the cache) on first use."""
        if not self.is_hub:
            return self.root / file
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(self.repo_id, file, revision=self.commit or self.revision,
                                        local_files_only=_offline(), token=self.token, cache_dir=self.cache_dir))
        except Exception as exc:  # huggingface_hub raises many types; all mean "cannot fetch"
            raise SourceError(f"{self.repo_id}: cannot fetch {file} ({_one_line(exc)})") from exc

    def header(self, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
        """A weight file's header; from the Hub by HTTP range requests when online (no shard download)."""
        if file not in self._header_cache:
            self._header_cache[file] = self._read_header(file)
        return self._header_cache[file]

    def _read_header(self, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
        if self.is_hub and not _offline():
            remote = _remote_header(self.repo_id, file, self.commit or self.revision, self.token)
            if remote is not None:
                return remote
        path = self.local_path(file)
        if not path.exists():
            raise SourceError(f"{file} is listed in the checkpoint but missing at {path}")
        return read_header(path, file)

    def tensors(self) -> list[TensorInfo]:
        """Every tensor of every weight file, in file order then offset order."""
        seen: dict[str, str] = {}
        out = []
        for file in self.weight_files:
            infos, _ = self.header(file)
            for info in infos:
                if info.name in seen:
                    raise SourceError(f"tensor {info.name!r} appears in both {seen[info.name]} and {file}")
                seen[info.name] = file
                out.append(info)
        return out


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _remote_header(repo_id: str, file: str, revision: str | None, token: str | None = None
                   ) -> tuple[list[TensorInfo], dict[str, str]] | None:
    """Header bytes by range request; None when that fails (the caller downloads instead)."""
    import struct
    from urllib.parse import urlsplit

    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    try:
        url = hf_hub_url(repo_id, file, revision=revision)
        meta = get_hf_file_metadata(url, token=token)
        headers = build_hf_headers(token=token)
        if urlsplit(meta.location).netloc != urlsplit(url).netloc:
            headers.pop("authorization", None)  # a signed CDN URL: the token stays on the Hub (as in hf_hub_download)
        first = _range(meta.location, headers, 0, 7)
        if first is None:
            return None
        (n,) = struct.unpack("<Q", first)
        body = _range(meta.location, headers, 8, 7 + n)
        if body is None:
            return None
        return parse_header(body, file, n)
    except Exception as exc:  # any failure falls back to the plain download path
        log.debug("range read of %s failed (%s); downloading instead", file, exc)
        return None


def _range(url: str, headers: dict, start: int, end: int) -> bytes | None:
    """Bytes start..end of ``url``; None unless the server answers 206 with exactly those (a server that
    ignores Range would send the whole shard: stop before reading it)."""
    from huggingface_hub.utils import get_session

    with get_session().stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end}"}, timeout=30) as r:
        if r.status_code != 206:
            return None
        data = r.read()
    return data if len(data) == end - start + 1 else None


def _weight_files_in(root: Path, label: str) -> list[str]:
    index = root / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SourceError(f"{index}: not a valid safetensors index ({exc})") from exc
        return sorted(set(weight_map.values()))  # shard order, not the (name-sorted) map's order
    files = sorted(p.relative_to(root).as_posix() for p in root.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise SourceError(
            f"{label} has only pickle weights ({', '.join(pickles[:3])}); fp4convert reads safetensors only, "
            "because unpickling runs arbitrary code. Convert them to safetensors first."
        )
    raise SourceError(f"{label}: no *.safetensors weights found")


def open_source(src: str, revision: str | None = None, *, token: str | None = None,
                cache_dir: str | None = None) -> Source:
    """A local folder if ``src`` is one, else a Hub repo id (``token``, ``cache_dir``: Hub only)."""
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SourceError(f"{src} is a file; give the checkpoint folder that holds it")
        if revision:
            raise SourceError("--revision applies to Hub repos, not to a local folder")
        root = path.resolve()
        return Source(src, root, _weight_files_in(root, src))
    if not _REPO_ID.match(src):
        raise SourceError(f"{src}: no such folder, and not a Hub repo id of the form org/name")
    return _open_hub(src, revision, token, cache_dir)


def _open_hub(repo_id: str, revision: str | None, token: str | None = None, cache_dir: str | None = None) -> Source:
    from huggingface_hub import snapshot_download

    try:
        # Everything but the weights now (small files); weights shard by shard later.
        # local_files_only when offline: huggingface_hub 1.x would otherwise try to list a commit's tree.
        root = Path(snapshot_download(repo_id, revision=revision, ignore_patterns=WEIGHT_PATTERNS,
                                      local_files_only=_offline(), token=token, cache_dir=cache_dir))
    except Exception as exc:
        hint = " (HF_HUB_OFFLINE is set and the repo is not in the cache)" if _offline() else ""
        raise SourceError(f"{repo_id}: cannot open on the Hub{hint}: {_one_line(exc)}") from exc
    commit = root.name  # snapshots/<commit>
    if (root / INDEX_NAME).exists():
        files = _weight_files_in(root, repo_id)
    else:
        files = _hub_listing(repo_id, commit, root, token)
    return Source(repo_id, root, files, repo_id=repo_id, revision=revision, commit=commit, token=token,
                  cache_dir=cache_dir)


def _hub_listing(repo_id: str, commit: str, snapshot: Path, token: str | None = None) -> list[str]:
    """Weight files of a repo with no index: ask the Hub, or (offline) list the cached snapshot."""
    names: list[str] = []
    if not _offline():
        from huggingface_hub import HfApi

        try:
            names = HfApi(token=token).list_repo_files(repo_id, revision=commit)
        except Exception as exc:
            log.debug("listing %s failed: %s", repo_id, exc)
    if not names:
        names = sorted(p.name for p in snapshot.iterdir())
    st = [n for n in names if n.endswith(".safetensors") and "/" not in n]
    if st:
        return sorted(st)
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise SourceError(
            f"{repo_id} has only pickle weights ({', '.join(pickles[:3])}); fp4convert reads safetensors only, "
            "because unpickling runs arbitrary code. Convert them to safetensors first."
        )
    raise SourceError(f"{repo_id}: no *.safetensors weights found")
