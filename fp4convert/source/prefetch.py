"""Hub shards fetched ahead of the conversion, so that downloading and converting overlap.

Without this, a Hub shard is downloaded when the read-ahead first needs one of its tensors: the
network idles while a shard converts and the converter idles while the next shard downloads. A
:class:`Prefetcher` fetches the shards a run will read on background threads (``connections`` at
once), in the order the run first reads them, and at most ``ahead`` shards beyond the one the run has
reached:

* **Bounded disk.** A shard beyond the one in use is on disk early, so with ``--delete-source-shards``
  (each shard leaves the HF cache after its last use) the cache holds at most ``ahead`` shards more
  than it would without prefetching. A fetch ahead of need never starts when it would leave the
  cache's filesystem less free space than the output still needs (``room``): the destination's
  pre-check counted that space for the output. Such a shard is fetched when it is needed, as before.
* **Two downloads at a time, started in order.** One connection does not fill a link: on the project's
  machine, downloading 294 MB one file after another with ``hf_hub_download`` took 1.16x what
  ``snapshot_download``'s 8 connections took over the same paced link, and two files at a time matched
  it (BENCHMARKS.md, Hub). More than two would only delay the shard needed first. Within one file
  huggingface_hub parallelises by itself where it can (``hf_xet`` for Xet-backed repos;
  ``HF_XET_HIGH_PERFORMANCE=1`` raises its concurrency).
* **Checksums off the connections.** With ``check``, a downloaded file is checked (hashed against the
  Hub) on one checker thread while its connection starts the next download: hashed on the connection's
  own thread, both connections sat idle between files and the link with them.
* **Errors where the shard is needed.** A failed fetch is raised by :meth:`Prefetcher.get` in the
  thread that asks for that shard (the same one-line error naming the file, the same exit code as a
  fetch on demand); nothing after a failed shard starts, and a later one in flight is cancelled.
* **Cancellation.** :meth:`Prefetcher.stop` makes an in-flight download raise at its next chunk
  (huggingface_hub then deletes its own temporary ``*.incomplete`` file) and joins the thread.

Imports nothing heavy; the fetch itself is the caller's (:meth:`fp4convert.source.source.Source.prefetch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from fp4convert.errors import Cancelled

log = logging.getLogger(__name__)

AHEAD = 2  # shards fetched beyond the one the run has reached
CONNECTIONS = 2  # downloads in flight at once
JOIN_S = 5.0  # how long stop() waits for the downloads to notice (a stalled one only would at its timeout)


class Prefetcher:
    """Fetches ``order`` (file names, first use first, no repeats) ahead of :meth:`get`.

    ``fetch(file, cancelled)``: the file's local path after download (and checks, without ``check``);
    it should raise :class:`Cancelled` soon after ``cancelled()`` turns true. ``check(file, path,
    cancelled)``: raises if the downloaded file is bad (run on the checker thread; a file is handed to
    :meth:`get` only once checked). ``room(file, position)``: may a fetch ahead of need start now
    (position: the index in ``order`` the run has reached)?
    """

    def __init__(self, order: Sequence[str], fetch: Callable[[str, Callable[[], bool]], Path], *,
                 ahead: int = AHEAD, room: Callable[[str, int], bool] | None = None,
                 connections: int = CONNECTIONS,
                 check: Callable[[str, Path, Callable[[], bool]], None] | None = None) -> None:
        self.order = list(order)
        self.index = {f: i for i, f in enumerate(self.order)}
        self.ahead = ahead
        self._fetch, self._room, self._check = fetch, room, check
        self._cv = threading.Condition()
        self._position = 0  # the furthest file (index) asked for: the run's position
        self._started = 0  # files whose fetch has begun (a prefix of order)
        self._to_check: deque[tuple[int, str, Path]] = deque()  # downloaded, waiting for the checker
        self._fetching: set[str] = set()  # files whose download is in flight
        self._done: dict[str, Path] = {}
        self._failed: tuple[str, BaseException] | None = None
        self._stop = False
        n = max(1, min(connections, len(self.order)))
        self._downloading = n  # download threads not returned yet
        self._running = n + (check is not None)  # threads not returned yet
        self._ended = False  # every thread has returned
        self._threads = [threading.Thread(target=self._run, args=(self._fetch_all, True), name="fp4convert-prefetch",
                                          daemon=True) for _ in range(n)]
        if check is not None:
            self._threads.append(threading.Thread(target=self._run, args=(self._check_all, False),
                                                  name="fp4convert-prefetch-check", daemon=True))
        for t in self._threads:
            t.start()

    # --- the consumer's side -------------------------------------------------------------------

    def get(self, file: str) -> Path | None:
        """``file``'s path once fetched (waiting for it); None when it is not in the order (the caller
        fetches it itself). Raises the fetch's error for a file that failed or comes after one that
        did, and :class:`Cancelled` once stopped (a reader waiting here ends instead of downloading)."""
        i = self.index.get(file)
        if i is None:
            return None
        with self._cv:
            if i > self._position:
                self._position = i
                self._cv.notify_all()
            waited = False
            while True:
                if file in self._done:
                    if waited:
                        log.debug("prefetch: the run waited for %s", file)
                    return self._done[file]
                if self._failed is not None:
                    failed, exc = self._failed
                    if failed == file or self.index[failed] < i:
                        raise exc  # a shard before this one failed: the run stops there
                if self._stop:
                    raise Cancelled(f"{file}: not fetched, the run is stopping")
                if self._ended:  # pragma: no cover - the thread ends early only on a failure or a stop
                    return None
                waited = True
                self._cv.wait(timeout=0.5)

    def set_room(self, room: Callable[[str, int], bool] | None) -> None:
        """Replace the room check (a prefetch started before the plan was known gets the plan's)."""
        with self._cv:
            self._room = room
            self._cv.notify_all()

    def wake(self) -> None:
        """Look at the room check again now (what it depends on changed), not at the next poll."""
        with self._cv:
            self._cv.notify_all()

    def stop(self) -> list[str]:
        """Cancel what is in flight and wait for the threads to end, at most ``JOIN_S`` in all
        (idempotent). A download looks for cancellation when data arrives: one whose connection stalls
        would keep Ctrl-C waiting for huggingface_hub's timeouts and retries (a minute), so it is left
        to end with the process (daemon thread). Returns the files still downloading then."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        deadline = time.monotonic() + JOIN_S
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._cv:
            stuck = sorted(self._fetching) if any(t.is_alive() for t in self._threads) else []
        if stuck:  # the caller removes their partial files (Source.stop_prefetch)
            log.debug("prefetch: the download of %s did not stop within %.0f s; left to end with the process",
                      ", ".join(stuck), JOIN_S)
        return stuck

    def _cancelled(self, i: int) -> bool:
        """Stop fetching file ``i``: the run stops, or a file before it failed (the run stops there)."""
        failed = self._failed
        return self._stop or (failed is not None and self.index[failed[0]] < i)

    # --- the threads ---------------------------------------------------------------------------

    def _may_start(self, i: int) -> bool:
        if i <= self._position:
            return True  # needed now: fetched whatever the room
        if i > self._position + self.ahead:
            return False
        return self._room is None or self._room(self.order[i], self._position)

    def _run(self, work: Callable[[], None], downloads: bool) -> None:
        try:
            work()
        finally:
            with self._cv:
                self._running -= 1
                self._downloading -= downloads
                if self._running == 0:
                    self._ended = True
                self._cv.notify_all()

    def _fail(self, i: int, file: str, exc: BaseException) -> None:
        """Record a failed file (the earliest failure in order wins: the run stops there)."""
        with self._cv:
            if self._failed is None or self.index[self._failed[0]] > i:
                self._failed = (file, exc)
            self._cv.notify_all()

    def _fetch_all(self) -> None:
        """Claim the next file in order once the window allows it, fetch it, repeat."""
        while True:
            with self._cv:
                # room() can turn true without a notification (a shard released, the output's files
                # closed): look again every second.
                while (not self._stop and self._failed is None and self._started < len(self.order)
                       and not self._may_start(self._started)):
                    self._cv.wait(timeout=1.0)
                if self._stop or self._failed is not None or self._started >= len(self.order):
                    return
                i = self._started
                self._started = i + 1
            file = self.order[i]
            log.debug("prefetch: fetching %s (%d of %d; the run is at %d)", file, i + 1, len(self.order),
                      self._position + 1)
            with self._cv:
                self._fetching.add(file)
            try:
                path = self._fetch(file, partial(self._cancelled, i))
            except Cancelled:
                return
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer's thread by get()
                self._fail(i, file, exc)
                return
            finally:
                with self._cv:
                    self._fetching.discard(file)
            log.debug("prefetch: %s fetched", file)
            with self._cv:
                if self._check is None:
                    self._done[file] = path
                else:
                    self._to_check.append((i, file, path))
                self._cv.notify_all()

    def _check_all(self) -> None:
        """Check downloaded files as they arrive, until the downloads have ended and none is left."""
        assert self._check is not None
        while True:
            with self._cv:
                while not self._stop and not self._to_check and self._downloading > 0:
                    self._cv.wait(timeout=1.0)
                if self._stop or not self._to_check:
                    return
                i, file, path = self._to_check.popleft()
            if self._cancelled(i):
                continue  # a file before it failed: the run stops there
            try:
                self._check(file, path, partial(self._cancelled, i))
            except Cancelled:
                continue
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer's thread by get()
                self._fail(i, file, exc)
                continue
            log.debug("prefetch: %s checked", file)
            with self._cv:
                self._done[file] = path
                self._cv.notify_all()
