"""A Hugging Face Hub repo as a source: shards fetched ahead and checked against the Hub's sha256, headers by range.

:class:`HubSource` is a :class:`~fp4convert.source.source.Source` whose weight files live in the HF cache:
they are downloaded (two at a time, ahead of the run, :mod:`fp4convert.source.prefetch`) and each is
checked against the Hub's sha256 on a checker thread while the next downloads; their headers are read by
HTTP range 8 at a time before any download, so planning costs no shard.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import CheckpointFormatError, FP4ConvertError, OutsideSourceError, SourceError
from fp4convert.source.paths import one_line, qname
from fp4convert.source.prefetch import AHEAD, Cancelled, Prefetcher
from fp4convert.source.source import Source, is_inside
from fp4convert.storage.reads import read_header
from fp4convert.storage.safetensors import TensorInfo, header_length, parse_header

if TYPE_CHECKING:
    from fp4convert.plan.types import Decision

log = logging.getLogger(__name__)

HEADER_CONNECTIONS = 8  # Hub header reads in flight at once (tiny range requests)


@dataclass
class HubSource(Source):
    """A Hub repo's snapshot: the small files in ``root``, the weight files fetched into the HF cache on demand."""

    _hashes: dict[str, tuple[str, str]] | None = field(default=None, repr=False)  # the Hub's per-file hashes
    _verified: set[str] = field(default_factory=set, repr=False)  # weight files checked against them
    _verify_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # guards _file_locks, _hashes
    _file_locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)  # one per file: two
    # prefetch connections hash two files at once
    _prefetcher: Prefetcher | None = field(default=None, repr=False)  # Hub: shards fetched ahead (prefetch)
    _headers_pending: threading.Event | None = field(default=None, repr=False)  # set once read_headers ends

    def describe(self) -> dict[str, str | None]:
        return {"type": "hub", "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}

    @property
    def is_hub(self) -> bool:
        return True

    def local_path(self, file: str) -> Path:
        """A weight file as a local path inside the source: downloaded (or taken from the cache) on first
        use, or waited for when :meth:`prefetch` fetches it (its error, if it failed, is raised here)."""
        if file not in self.weight_files:
            raise SourceError(f"{qname(file)} is not a weight file of {self.label}")
        prefetcher = self._prefetcher
        if prefetcher is not None:
            path = prefetcher.get(file)
            if path is not None:
                return path
        return self._fetch(file)

    def prefetch(self, units: Iterable[Iterable[Decision]], ahead: int = AHEAD) -> None:
        """Hub: fetch the weight files ``units`` read (the units a run will process, in plan order) in
        the background, ahead of :meth:`local_path` (:mod:`fp4convert.source.prefetch`); local: nothing to do.

        A fetch ahead of need starts only while the cache's filesystem keeps room for the output the
        units not yet reached will write (what the destination's pre-check counted on)."""
        order: list[str] = []
        index: dict[str, int] = {}
        out_at: list[int] = []  # output bytes of the units that cannot start before file i is reached
        for unit in units:
            last, out = 0, 0
            for d in unit:
                for t in d.reads:
                    if t.file not in index:
                        index[t.file] = len(order)
                        order.append(t.file)
                        out_at.append(0)
                    last = max(last, index[t.file])
                out += sum(e.nbytes for e in d.outputs) + (0 if d.outputs else d.info.nbytes)
            if out_at:
                out_at[last] += out
        def room(file: str, position: int) -> bool:
            return self._room_after(file, sum(out_at[position:]))

        early = self._prefetcher
        if early is not None and early.order == order and early.ahead == ahead:
            early.set_room(room)  # the early start guessed the run's order: it goes on, with the plan's room
            return
        self.stop_prefetch()  # another order (resume, --only, ...): what it fetched is in the cache
        if order:
            self._prefetcher = self._prefetcher_for(order, ahead, room)

    def prefetch_early(self, ahead: int = AHEAD) -> None:
        """Hub: start fetching the weight files in index order before the plan exists.

        Planning a Hub source (the model definition from transformers, the destination's checks) takes
        seconds in which the link would idle: on the H100 host a 1.15 GB conversion at 50 MB/s took 1.6x
        the plain download, ~11 s of it before the first byte was asked for. The run reads shards in index
        order almost always; :meth:`prefetch` keeps this prefetcher when the plan's order is the same and
        replaces it otherwise (files already fetched are then cache hits). It starts before the headers
        are read (:meth:`read_headers`; a download's check waits for its file's header, to compare them).
        Bounded as the run's own prefetch is at its start (the first file and ``ahead`` more), and the
        files after the first only once every header is known and while the cache's filesystem keeps room
        for the whole source beside them (the output's size is not known yet, and is at most the
        source's for these formats)."""
        if self._prefetcher is not None or not self.weight_files:
            return

        def room(file: str, position: int) -> bool:
            if any(f not in self._header_cache for f in self.weight_files):
                return False  # sizes unknown until the headers are read (the first file needs no room check)
            total = sum(max((t.end for t in self._header_cache[f][0]), default=0) for f in self.weight_files)
            return self._room_after(file, total)

        self._prefetcher = self._prefetcher_for(list(self.weight_files), ahead, room)

    def stop_prefetch(self) -> None:
        """Cancel the background fetches (an in-flight download stops at its next chunk; huggingface_hub
        removes its partial file) and wait for them to end. Safe to call at any time, repeatedly."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            for file in prefetcher.stop():
                self._drop_incomplete(file)

    def _room_after(self, file: str, need: int) -> bool:
        """Would downloading ``file`` leave ``need`` bytes free in the cache's filesystem?"""
        size = max((t.end for t in self._header_cache.get(file, ([], {}))[0]), default=0)
        try:
            free = shutil.disk_usage(self.roots[-1]).free  # the repo's blob store: where downloads land
        except OSError:
            return False
        return free - size >= need

    def _drop_incomplete(self, file: str) -> None:
        """Remove the temporary file of a download left stalled at stop (huggingface_hub removes it
        itself when the download ends, which a process exiting first would not wait for): it is named
        after the Hub's sha256 of the file plus a random part, so no later run would reuse it."""
        kind, sha = (self._hashes or {}).get(file, (None, None))
        if kind != "sha256" or sha is None:
            return
        for p in Path(self.roots[-1]).glob(f"{sha}*.incomplete"):
            try:
                p.unlink()
            except OSError:
                pass

    def _fetch(self, file: str, cancelled: Callable[[], bool] | None = None) -> Path:
        """Download ``file`` (or take it from the cache), check its containment and its checksum.
        ``cancelled``: polled while downloading and hashing; raises :class:`Cancelled` once true."""
        path = self._download(file, cancelled)
        self._verify_once(file, path, cancelled)
        return path

    def _prefetcher_for(self, order: list[str], ahead: int, room: Callable[[str, int], bool]) -> Prefetcher:
        """Downloads on the prefetcher's connections, checksums on its checker thread: a connection
        starts its next file while the last one is hashed, so the link does not idle for the hash. The
        Hub's checksums are asked for at once, on their own thread."""
        if self._hashes is None and not offline():  # asked now, so the first check does not wait for it
            threading.Thread(target=self._hub_hashes, name="fp4convert-hub-hashes", daemon=True).start()
        return Prefetcher(order, self._download, ahead=ahead, room=room, check=self._verify_once)

    def _download(self, file: str, cancelled: Callable[[], bool] | None = None) -> Path:
        """``file`` from the Hub (or the cache), contained in the repo's cache folder; not yet verified."""
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(self.repo_id, file, revision=self.commit or self.revision,
                                        local_files_only=offline(), token=self.token, cache_dir=self.cache_dir,
                                        tqdm_class=_cancellable_bar(cancelled) if cancelled else None))
        except Cancelled:
            raise
        except Exception as exc:  # huggingface_hub raises many types; all mean "cannot fetch"
            raise SourceError(f"{self.repo_id}: cannot fetch {file} ({one_line(exc)})") from exc
        real = os.path.realpath(path)
        if not is_inside(real, self.roots):
            raise OutsideSourceError(f"{self.repo_id}: {file} resolves to {real}, outside the repo's cache folder")
        return path

    def _verify_once(self, file: str, path: Path, cancelled: Callable[[], bool] | None = None) -> None:
        """:meth:`_verify_download` once per file, whichever thread asks first (the others wait for it)."""
        with self._verify_lock:
            lock = self._file_locks.setdefault(file, threading.Lock())
        with lock:
            if file not in self._verified:
                self._verify_download(file, path, cancelled)
                self._verified.add(file)

    def _hub_hashes(self) -> dict[str, tuple[str, str]]:
        """The Hub's own hash of each weight file at this commit: (``sha256`` of an LFS file | ``sha1`` git
        blob id, hex), from ``get_paths_info`` (one call); {} when offline or the Hub cannot answer."""
        with self._verify_lock:  # one call, whichever prefetch connection asks first; the other waits for it
            if self._hashes is None:
                self._hashes = self._ask_hub_hashes()
            return self._hashes

    def _ask_hub_hashes(self) -> dict[str, tuple[str, str]]:
        hashes: dict[str, tuple[str, str]] = {}
        if offline():
            return hashes
        from huggingface_hub import HfApi

        try:
            infos = HfApi(token=self.token).get_paths_info(self.repo_id, list(self.weight_files),
                                                          revision=self.commit or self.revision)
        except Exception as exc:  # verification then falls back to the cache's blob names
            log.warning("warning: cannot ask the Hub for the checksums of %s (%s); checking the "
                        "downloads against the cache's own records only", self.repo_id, one_line(exc))
            infos = []
        for info in infos:
            lfs = getattr(info, "lfs", None)
            if lfs is not None and getattr(lfs, "sha256", None):
                hashes[info.path] = ("sha256", str(lfs.sha256).lower())
            elif getattr(info, "blob_id", None):
                hashes[info.path] = ("sha1", str(info.blob_id).lower())
        return hashes

    def _verify_download(self, file: str, path: Path, cancelled: Callable[[], bool] | None = None) -> None:
        """A downloaded (or cached) weight file must hash to what the Hub reports for it (its LFS sha256,
        or the blob id the cache named it by when offline), and its header must be the one read by
        range when planning: a CDN serving same-size corrupt or re-laid-out bytes is exit 4, naming the
        file, before any of it is converted; the bad blob leaves the cache so a rerun fetches it again."""
        import hashlib

        kind, want = self._hub_hashes().get(file, (None, None))
        blob = os.path.basename(os.path.realpath(path))
        if want is None and re.fullmatch(r"[0-9a-f]{64}", blob):
            kind, want = "sha256", blob  # huggingface_hub names an LFS blob by the sha256 the Hub sent
        if want is not None:
            h = hashlib.sha256() if kind == "sha256" else hashlib.sha1()
            try:
                with open(path, "rb") as fh:
                    if kind == "sha1":
                        h.update(b"blob %d\0" % os.fstat(fh.fileno()).st_size)
                    while block := fh.read(16 << 20):
                        h.update(block)
                        if cancelled is not None and cancelled():
                            raise Cancelled(file)
            except OSError as exc:
                raise SourceError(f"{self.repo_id}: {file}: cannot read ({exc.strerror or exc})") from exc
            if h.hexdigest() != want:
                self._drop_from_cache(path)
                raise CheckpointFormatError(
                    f"{self.repo_id}: {file} does not match the Hub's {kind} ({want[:12]}..., the download hashes to "
                    f"{h.hexdigest()[:12]}...): a corrupt download, removed from the cache; run the same command "
                    "again to download it again")
        else:
            log.debug("%s: no Hub checksum known for %s; not verified", self.repo_id, file)
        pending = self._headers_pending  # a prefetch may finish before the range reads (read_headers) do
        while pending is not None and not pending.wait(0.5):
            if cancelled is not None and cancelled():
                raise Cancelled(file)
        remote = self._header_cache.get(file)
        if remote is not None:
            local = read_header(path, file)
            if local != remote:
                self._drop_from_cache(path)
                raise CheckpointFormatError(
                    f"{self.repo_id}: {file}: the downloaded file's header differs from the one read by range when "
                    "planning (the server sent other bytes); removed from the cache: run the same command again, "
                    "and if it repeats, the Hub's server is serving two versions of the file: try later or convert a "
                    "local copy")

    def _drop_from_cache(self, path: Path) -> None:
        """Remove a bad download (its blob and its snapshot link) from the HF cache."""
        real = Path(os.path.realpath(path))
        for p in {Path(path), real}:
            try:
                if is_inside(os.path.realpath(p.parent), self.roots):
                    p.unlink()
            except OSError:
                pass

    def _read_header(self, file: str) -> tuple[list[TensorInfo], dict[str, str]]:
        if not offline():
            remote = _remote_header(self.repo_id, file, self.commit or self.revision, self.token)
            if remote is not None:
                return remote
        path = self.local_path(file)
        if not path.exists():
            raise SourceError(f"{file} is listed in the checkpoint but missing at {path}")
        return read_header(path, file)

    def read_headers(self) -> None:
        """Hub: read every weight file's header by range, ``HEADER_CONNECTIONS`` at a time.

        Each header is three round trips (metadata, the length, the header itself): one after another
        they cost ~0.3 s a shard on a loaded machine, seconds for a model of many shards, while the link
        idles before the first download. The reads run concurrently; the results are cached in file order
        and a failure is raised for the first file (in order) that has one, as a sequential read would.
        A header the range read cannot get is left to :meth:`header` (it downloads the shard instead),
        one at a time: nothing here downloads a whole shard."""
        missing = [f for f in self.weight_files if f not in self._header_cache]
        if offline() or not missing:
            return
        rev = self.commit or self.revision
        self._headers_pending = pending = threading.Event()
        try:
            # daemon threads, not a ThreadPoolExecutor: Ctrl-C on a stalled read must not wait for its timeout
            results = _in_daemon_threads([partial(_remote_header, self.repo_id, f, rev, self.token) for f in missing],
                                         HEADER_CONNECTIONS, "fp4convert-header")
            for file, result in zip(missing, results):
                remote = result.result()  # raises a malformed header's error, first file first
                if remote is not None:
                    self._header_cache[file] = remote
            unread = [f for f in missing if f not in self._header_cache]
            if unread:
                more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
                log.warning("warning: %s: the Hub did not answer a range request for the header of %s%s; downloading "
                            "whole shards to read their headers", self.repo_id, qname(unread[0]), more)
        finally:
            pending.set()  # a download waiting to compare its header goes on
            if self._prefetcher is not None:
                self._prefetcher.wake()  # the early prefetch's room check needs every header


def _cancellable_bar(cancelled: Callable[[], bool]) -> type:
    """huggingface_hub's own progress bar (shown or not as it decides), whose ``update`` -- called for
    every chunk a download receives -- raises :class:`Cancelled` once ``cancelled()``: the only way to
    stop an ``hf_hub_download`` from another thread (it then deletes its temporary file itself)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class CancellableBar(hf_tqdm):  # type: ignore[misc, valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            if cancelled():
                raise Cancelled("download cancelled")
            return super().update(n)

    return CancellableBar


def _in_daemon_threads(calls: list[Callable[[], object]], workers: int, name: str) -> list[Future]:
    """Run ``calls`` on up to ``workers`` daemon threads, one Future each, in order. Unlike a
    ThreadPoolExecutor's, these threads never delay the process's exit (Ctrl-C on a stalled read)."""
    todo = [(Future(), call) for call in calls]
    futures = [f for f, _ in todo]
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                future, call = todo.pop(0)
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - raised by future.result()
                future.set_exception(exc)

    for _ in range(max(1, min(workers, len(calls)))):
        threading.Thread(target=work, name=name, daemon=True).start()
    return futures


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _remote_header(repo_id: str, file: str, revision: str | None, token: str | None = None
                   ) -> tuple[list[TensorInfo], dict[str, str]] | None:
    """Header bytes by range request, validated like a local file's; None when fetching fails (the
    caller downloads instead). A malformed header raises at once (no download to find that out)."""
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
        head, total = first
        size = meta.size if meta.size is not None else total
        if size is None:
            return None
        n = header_length(head, file, size)
        body = _range(meta.location, headers, 8, 7 + n)
        if body is None:
            return None
    except Exception as exc:  # any failure to fetch falls back to the plain download path
        if isinstance(exc, FP4ConvertError):
            raise
        log.debug("range read of %s failed (%s); downloading instead", file, exc)
        return None
    return parse_header(body[0], file, size)


def _range(url: str, headers: dict, start: int, end: int) -> tuple[bytes, int | None] | None:
    """Bytes start..end of ``url`` and the total size from Content-Range; None unless the server
    answers 206 with exactly those (a server that ignores Range would send the whole shard: stop
    before reading it)."""
    from huggingface_hub.utils import get_session

    with get_session().stream("GET", url, headers={**headers, "Range": f"bytes={start}-{end}"}, timeout=30) as r:
        if r.status_code != 206:
            return None
        data = r.read()
        total = r.headers.get("Content-Range", "").rpartition("/")[2]
    if len(data) != end - start + 1:
        return None
    return data, int(total) if total.isdigit() else None
