"""A tiny stand-in for the Hugging Face Hub on 127.0.0.1, for tests of the online path.

It serves the few routes ``huggingface_hub`` 2.x calls to open and download a model repo, with the
headers it relies on, the way huggingface.co answers them:

* ``GET /api/models/{repo}[/revision/{rev}]`` (``repo_info``): ``id``, ``sha`` (the resolved commit)
  and ``siblings``;
* ``GET /api/models/{repo}/tree/{rev}?recursive=...`` (``list_repo_tree``, used by
  ``snapshot_download`` and ``list_repo_files``): files with ``oid``/``size``, and ``lfs``
  (sha256, size, pointer size) for LFS files, plus folder entries;
* ``HEAD|GET /{repo}/resolve/{rev}/{path}`` (``get_hf_file_metadata`` / ``hf_hub_download``): a plain
  file is served directly (``ETag`` = git blob sha1, ``X-Repo-Commit``, ``Content-Length``); an LFS
  file (``*.safetensors``) answers ``302`` to a signed URL on a second server, the "CDN", with
  ``X-Linked-Etag`` (sha256), ``X-Linked-Size`` and ``X-Repo-Commit``;
* the CDN serves blobs with ``Range`` support (``206`` + ``Content-Range``), like S3/CloudFront.

Errors carry the ``X-Error-Code`` header huggingface_hub maps to its exceptions (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``). Hub and CDN listen on two loopback ports, so they are two
origins (huggingface_hub strips the token when it follows a redirect off the Hub).

Every request is logged (:class:`Request`), so a test can say exactly what was fetched. Both servers
run in daemon threads, stop on :meth:`FakeHub.stop` (or leaving the ``with`` block) and, whatever
happens, after ``lifetime`` seconds.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors",)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class HubFile:
    path: str
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
                f"size {len(self.data)}\n").encode()

    @property
    def oid(self) -> str:  # the git blob id: of the LFS pointer for LFS files
        return git_blob_sha1(self.pointer if self.lfs else self.data)


@dataclass
class Repo:
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # commit -> path -> file
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit

    def resolve(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


@dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    server: str  # "hub" or "cdn"
    method: str
    path: str  # unquoted, no query
    file: str | None  # the repo file it was about (resolve and CDN requests)
    range: str | None  # the Range header, if any
    status: int
    sent: int  # body bytes sent
    auth: bool  # an Authorization header came with it

    @property
    def full_get(self) -> bool:
        """A GET that returned a whole file body (ranged answers are 206)."""
        return self.method == "GET" and self.status == 200 and self.file is not None


HUB_HOST, CDN_HOST = "127.0.0.1", "127.0.0.2"  # both loopback


class FakeHub:
    """Hub + CDN on two free loopback ports; ``with FakeHub() as hub: ... hub.endpoint``."""

    def __init__(self, *, lifetime: float = 120.0, fail_full_get: dict[str, int] | None = None,
                 fail_api: int | None = None, honor_range: bool = True) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[Request] = []
        self.unrouted: list[str] = []  # requests for routes this stand-in does not know
        self.errors: list[str] = []  # exceptions in the server itself (client hang-ups excluded)
        self.fail_full_get = dict(fail_full_get or {})  # file -> status for a whole-file CDN GET
        self.fail_api = fail_api  # status for every /api call (the Hub is down)
        self.honor_range = honor_range  # False: the CDN answers 200 + the whole file, as some servers do
        self.lifetime = lifetime
        self._lock = threading.Lock()
        self._blobs: dict[str, HubFile] = {}  # sha256 -> file (for the CDN)
        self._servers: list[_Server] = []
        self._threads: list[threading.Thread] = []
        self._timer: threading.Timer | None = None
        self._stopped = False

    # --- content ------------------------------------------------------------------------------

    def add(self, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> str:
        """Publish every file of ``folder`` as ``commit`` of ``repo_id`` (plus a .gitattributes)."""
        files = {".gitattributes": HubFile(".gitattributes", b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
                                           False)}
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                rel = p.relative_to(folder).as_posix()
                files[rel] = HubFile(rel, p.read_bytes(), rel.endswith(LFS_SUFFIXES))
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[commit] = files
        for ref in refs:
            repo.refs[ref] = commit
        for f in files.values():
            if f.lfs:
                self._blobs[f.sha256] = f
        return commit

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FakeHub:
        # The CDN gets a host of its own (127.0.0.2 is loopback too): huggingface_hub 1.x follows a
        # redirect to the same hostname whatever the port, as it would never happen on the real Hub.
        self._servers = [self._serve("hub", HUB_HOST), self._serve("cdn", CDN_HOST)]
        self.hub_url = "http://%s:%d" % (HUB_HOST, self._servers[0].server_address[1])
        self.cdn_url = "http://%s:%d" % (CDN_HOST, self._servers[1].server_address[1])
        self._timer = threading.Timer(self.lifetime, self.stop)  # bounded lifetime, whatever the test does
        self._timer.daemon = True
        self._timer.start()
        return self

    @property
    def endpoint(self) -> str:
        return self.hub_url

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        for s in self._servers:
            s.shutdown()
            s.server_close()
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _serve(self, name: str, host: str) -> _Server:
        hub = self

        class Handler(_Handler):
            server_name = name
            fake = hub

        server = _Server((host, 0), Handler)
        server.fake = hub
        t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                             name=f"fakehub-{name}")
        t.start()
        self._threads.append(t)
        return server

    # --- the log ------------------------------------------------------------------------------

    def record(self, r: Request) -> None:
        with self._lock:
            self.log.append(r)

    def requests(self, *, server: str | None = None, method: str | None = None,
                 file: str | None = None) -> list[Request]:
        with self._lock:
            log = list(self.log)
        return [r for r in log if (server is None or r.server == server) and (method is None or r.method == method)
                and (file is None or r.file == file)]

    def full_gets(self, file: str) -> int:
        return sum(r.full_get for r in self.requests(file=file))

    def summary(self) -> dict[str, int]:
        """Counts by "server METHOD kind" (kind: api, weights, other file, or the HTTP status on errors)."""
        out: dict[str, int] = {}
        for r in self.requests():
            kind = ("api" if r.path.startswith("/api/") else "weights" if r.file and r.file.endswith(LFS_SUFFIXES)
                    else "file" if r.file else "?")
            key = f"{r.server} {r.method} {kind}" + (" range" if r.range else "") + (
                f" {r.status}" if r.status >= 400 else "")
            out[key] = out.get(key, 0) + 1
        return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeHub

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up early (it had what it needed) is no error; keep stderr quiet."""
        import sys

        exc = sys.exc_info()[1]
        if not isinstance(exc, (ConnectionError, TimeoutError)):
            self.fake.errors.append(repr(exc))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 15  # idle keep-alive connections end by themselves
    server_name = "hub"
    fake: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    # --- plumbing -----------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        self._file: str | None = None
        url = urlsplit(self.path)
        self._path = unquote(url.path)
        self._query = parse_qs(url.query)
        try:
            if self.server_name == "cdn":
                self._cdn(method)
            else:
                self._hub(method)
        except Exception as exc:  # a bug here must show up as a failure, not a hang
            self.fake.errors.append(repr(exc))
            self._send(500, json.dumps({"error": repr(exc)}).encode(), method)

    def _send(self, status: int, body: bytes, method: str, headers: dict[str, str] | None = None,
              content_type: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        sent = 0
        if method == "GET" and body:
            try:
                self.wfile.write(body)
                sent = len(body)
            except ConnectionError:  # the client hung up (e.g. it wanted a range and got the whole file)
                self.close_connection = True
        self.fake.record(Request(self.server_name, method, self._path, self._file, self.headers.get("Range"), status,
                                 sent, "authorization" in {k.lower() for k in self.headers}))

    def _json(self, obj, method: str, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(obj).encode(), method, headers, "application/json")

    def _error(self, status: int, code: str | None, message: str, method: str,
               headers: dict[str, str] | None = None) -> None:
        h = dict(headers or {})
        if code:
            h["X-Error-Code"] = code
        h["X-Error-Message"] = message
        self._send(status, json.dumps({"error": message}).encode(), method, h, "application/json")

    # --- Hub ----------------------------------------------------------------------------------

    def _hub(self, method: str) -> None:
        parts = self._path.strip("/").split("/")
        if parts[0] == "api":
            if self.fake.fail_api:
                return self._error(self.fake.fail_api, None, "the Hub is down", method)
            if len(parts) >= 4 and parts[1] == "models":
                repo_id, rest = "/".join(parts[2:4]), parts[4:]
                if not rest:
                    return self._repo_info(repo_id, "main", method)
                if rest[0] == "revision" and len(rest) == 2:
                    return self._repo_info(repo_id, rest[1], method)
                if rest[0] == "tree" and len(rest) >= 2:
                    return self._tree(repo_id, rest[1], "/".join(rest[2:]), method)
        elif len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), method)
        self.fake.unrouted.append(f"{method} {self.path}")
        self._error(404, None, f"no route {self._path}", method)

    def _lookup(self, repo_id: str, rev: str, method: str) -> tuple[str, dict[str, HubFile]] | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", method)
            return None
        commit = repo.resolve(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", method)
            return None
        return commit, repo.commits[commit]

    def _repo_info(self, repo_id: str, rev: str, method: str) -> None:
        found = self._lookup(repo_id, rev, method)
        if found:
            commit, files = found
            self._json({"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
                        "sha": commit, "private": False, "gated": False, "disabled": False, "tags": [],
                        "lastModified": "2026-01-01T00:00:00.000Z",
                        "siblings": [{"rfilename": p} for p in sorted(files)]}, method)

    def _tree(self, repo_id: str, rev: str, under: str, method: str) -> None:
        found = self._lookup(repo_id, rev, method)
        if not found:
            return
        _, files = found
        recursive = self._query.get("recursive", ["false"])[0].lower() == "true"
        prefix = under.strip("/") + "/" if under.strip("/") else ""
        entries, folders = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if "/" in rest:
                top = prefix + rest.split("/")[0]
                if top not in folders:
                    folders.add(top)
                    entries.append({"type": "directory", "oid": git_blob_sha1(top.encode()), "size": 0,
                                    "path": top})
                if not recursive:
                    continue
            f = files[path]
            e = {"type": "file", "oid": f.oid, "size": len(f.data), "path": path}
            if f.lfs:
                e["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}
            entries.append(e)
        self._json(entries, method)

    def _resolve(self, repo_id: str, rev: str, path: str, method: str) -> None:
        found = self._lookup(repo_id, rev, method)
        if not found:
            return
        commit, files = found
        self._file = path
        f = files.get(path)
        if f is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", method,
                               {"X-Repo-Commit": commit})
        if not f.lfs:
            return self._send(200, f.data, method, {"ETag": f'"{f.oid}"', "X-Repo-Commit": commit,
                                                     "Accept-Ranges": "bytes"})
        signed = (f"{self.fake.cdn_url}/repos/{quote(repo_id)}/{f.sha256}"
                  f"?filename={quote(path, safe='')}&Expires=9999999999&Signature=fake")
        self._send(302, b"", method, {"Location": signed, "ETag": f'"{f.oid}"', "X-Repo-Commit": commit,
                                      "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(len(f.data))})

    # --- CDN ----------------------------------------------------------------------------------

    def _cdn(self, method: str) -> None:
        f = self.fake._blobs.get(self._path.rsplit("/", 1)[-1])
        if f is None or "Signature" not in self._query:
            self.fake.unrouted.append(f"cdn {method} {self.path}")
            return self._send(403, b"AccessDenied", method)
        self._file = f.path
        headers = {"ETag": f'"{f.sha256}"', "Accept-Ranges": "bytes"}
        rng = self.headers.get("Range") if self.fake.honor_range else None
        if rng is None:
            status = self.fake.fail_full_get.get(f.path)
            if status:
                return self._send(status, b"injected failure", method)
            return self._send(200, f.data, method, headers)
        size = len(f.data)
        try:
            unit, spec = rng.split("=", 1)
            start_s, end_s = spec.split(",")[0].strip().split("-")
            if unit.strip() != "bytes":
                raise ValueError(rng)
            if start_s == "":  # suffix range: the last N bytes
                start, end = max(size - int(end_s), 0), size - 1
            else:
                start, end = int(start_s), min(int(end_s) if end_s else size - 1, size - 1)
        except ValueError:
            return self._send(400, b"bad Range", method)
        if start >= size or start > end:
            return self._send(416, b"", method, {"Content-Range": f"bytes */{size}"})
        self._send(206, f.data[start:end + 1], method, {**headers, "Content-Range": f"bytes {start}-{end}/{size}"})
