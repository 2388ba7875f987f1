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
* ``POST /api/models/{repo}/paths-info/{rev}`` (``get_paths_info``): the same entries as the tree, for
  the paths asked (the LFS sha256 a download is verified against);
* the CDN serves blobs with ``Range`` support (``206`` + ``Content-Range``), like S3/CloudFront; with
  ``corrupt_full_get`` it sends same-size corrupt bytes for a whole-file GET of the files named; with
  ``rate`` (bytes/s) every body it sends shares that bandwidth, paced in 64 KiB chunks (a link of
  that speed, for the prefetch tests and ``benchmarks/hub_prefetch.py``); ``on_full_get(file)`` is
  called as a whole-file GET begins (a test looks at the client's cache at that moment).

For uploads (``create_repo`` + ``upload_folder``, the legacy LFS path huggingface_hub takes with
``HF_HUB_DISABLE_XET=1``; 1.x and 2.x call the same routes):

* ``POST /api/validate-yaml`` (the README's front matter, checked before a commit that adds one);
* ``POST /api/repos/create`` (409 when the repo exists, which ``exist_ok=True`` accepts);
* ``POST /api/models/{repo}/preupload/{rev}``: ``uploadMode`` (lfs for ``*.safetensors``) and the remote
  ``oid`` of each path (sha256 for LFS, git blob sha1 otherwise), so unchanged files stay out of a commit;
* ``POST /{repo}.git/info/lfs/objects/batch``: an upload action (a signed ``PUT`` URL on the CDN and a
  ``verify`` URL on the Hub) only for objects the server does not hold yet, the way an interrupted upload
  resumes; ``PUT`` on the CDN checks the sha256;
* ``POST /api/models/{repo}/commit/{rev}`` (NDJSON header / file / lfsFile / deletedFile lines): a new
  commit on top of the branch; LFS objects must have been uploaded.

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
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors",)
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def hub_env(endpoint: str, home: Path, token: str | None = "hf_fp4convertTestTokenNotARealOne") -> dict:
    """The environment a user would set for this stand-in, and nothing from this machine's HF or proxy
    settings (huggingface_hub reads these at import, so CLI runs go to subprocesses)."""
    drop = ("HF_", "HUGGINGFACE_", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith(drop)}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_CACHE=str(home / "hub"),
               HF_HUB_DISABLE_XET="1", HF_HUB_ENABLE_HF_TRANSFER="0", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_ETAG_TIMEOUT="10", HF_HUB_DOWNLOAD_TIMEOUT="10",
               NO_PROXY="127.0.0.1,localhost", OMP_NUM_THREADS="1")
    if token:
        env["HF_TOKEN"] = token
    return env


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
    started: float = 0.0  # time.monotonic() when the request arrived (one clock for every process here)
    ended: float = 0.0  # ... and when its answer was sent

    @property
    def full_get(self) -> bool:
        """A GET that returned a whole file body (ranged answers are 206)."""
        return self.method == "GET" and self.status == 200 and self.file is not None


HUB_HOST, CDN_HOST = "127.0.0.1", "127.0.0.2"  # both loopback


class FakeHub:
    """Hub + CDN on two free loopback ports; ``with FakeHub() as hub: ... hub.endpoint``."""

    def __init__(self, *, lifetime: float = 120.0, fail_full_get: dict[str, int] | None = None,
                 fail_api: int | None = None, honor_range: bool = True,
                 fail_upload: dict[str, int] | None = None, corrupt_full_get: tuple[str, ...] = (),
                 rate: float | None = None, on_full_get: Callable[[str], None] | None = None) -> None:
        self.repos: dict[str, Repo] = {}
        self.private: dict[str, bool] = {}  # repos created through the API -> private flag
        self.fail_upload = dict(fail_upload or {})  # sha256 -> status for the CDN PUT of that object
        self.yaml_errors: list[str] = []  # README front matter the validate-yaml route refused
        self.uploaded: dict[str, bytes] = {}  # LFS objects PUT on the CDN (sha256 -> data), committed or not
        self.log: list[Request] = []
        self.unrouted: list[str] = []  # requests for routes this stand-in does not know
        self.errors: list[str] = []  # exceptions in the server itself (client hang-ups excluded)
        self.fail_full_get = dict(fail_full_get or {})  # file -> status for a whole-file CDN GET
        self.fail_api = fail_api  # status for every /api call (the Hub is down)
        self.honor_range = honor_range  # False: the CDN answers 200 + the whole file, as some servers do
        # files whose whole-file CDN GET sends same-size corrupt bytes (a bit flipped in the last byte);
        # ranged reads (the header) stay true, as a faulty cache node may serve them
        self.corrupt_full_get = set(corrupt_full_get)
        self.lifetime = lifetime
        self.on_full_get = on_full_get
        self._rate = rate
        self._pace_lock = threading.Lock()
        self._pace_next = 0.0  # when the shared link is free again (time.monotonic())
        self._lock = threading.Lock()
        self._blobs: dict[str, HubFile] = {}  # sha256 -> file (for the CDN)
        self._servers: list[_Server] = []
        self._threads: list[threading.Thread] = []
        self._timer: threading.Timer | None = None
        self._stopped = False

    # --- content ------------------------------------------------------------------------------

    def add(self, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> str:
        """Publish every file of ``folder`` as ``commit`` of ``repo_id`` (plus a .gitattributes)."""
        files = {".gitattributes": HubFile(".gitattributes", GITATTRIBUTES, False)}
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

    def add_commit(self, repo_id: str, commit: str, files: dict[str, HubFile], ref: str = "main") -> None:
        """A commit made through the API (the stand-in's commit route)."""
        with self._lock:
            repo = self.repos.setdefault(repo_id, Repo())
            repo.commits[commit] = files
            repo.refs[ref] = commit
            for f in files.values():
                if f.lfs:
                    self._blobs[f.sha256] = f

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        """What a branch of a repo holds now (path -> bytes)."""
        repo = self.repos[repo_id]
        return {p: f.data for p, f in repo.commits[repo.resolve(rev)].items()}

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

    def pace(self, n: int) -> None:
        """Wait for ``n`` bytes' turn on the shared link (``rate``); at once without one."""
        if not self._rate:
            return
        with self._pace_lock:
            now = time.monotonic()
            start = max(now, self._pace_next)
            self._pace_next = start + n / self._rate
            until = self._pace_next
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)

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

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _body(self) -> bytes:
        """The request body: Content-Length, or chunked transfer encoding."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # --- plumbing -----------------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        self._t0 = time.monotonic()
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
        if method != "HEAD" and body:
            try:
                view = memoryview(body)
                step = 64 << 10
                for at in range(0, len(body), step):
                    self.fake.pace(len(view[at:at + step]))
                    self.wfile.write(view[at:at + step])
                    sent = at + len(view[at:at + step])
            except ConnectionError:  # the client hung up (e.g. it wanted a range and got the whole file)
                self.close_connection = True
        self.fake.record(Request(self.server_name, method, self._path, self._file, self.headers.get("Range"), status,
                                 sent, "authorization" in {k.lower() for k in self.headers}, self._t0,
                                 time.monotonic()))

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
        if method in ("POST", "PUT"):
            body = self._body()
            if self.fake.fail_api and parts[0] == "api":
                return self._error(self.fake.fail_api, None, "the Hub is down", method)
            if method == "POST" and parts[:2] == ["api", "validate-yaml"]:
                return self._validate_yaml(json.loads(body or b"{}"), method)
            if method == "POST" and parts[:3] == ["api", "repos", "create"]:
                return self._create_repo(json.loads(body or b"{}"), method)
            if method == "POST" and len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in (
                    "preupload", "commit", "paths-info"):
                repo_id, rev = "/".join(parts[2:4]), "/".join(parts[5:])
                if parts[4] == "paths-info":
                    return self._paths_info(repo_id, rev, parse_qs(body.decode()).get("paths", []), method)
                if parts[4] == "preupload":
                    return self._preupload(repo_id, rev, json.loads(body or b"{}"), method)
                return self._commit(repo_id, rev, body, method)
            if method == "POST" and len(parts) == 6 and parts[1].endswith(".git") and parts[2:5] == ["info", "lfs", "objects"]:
                repo_id = parts[0] + "/" + parts[1][: -len(".git")]
                if parts[5] == "batch":
                    return self._lfs_batch(repo_id, json.loads(body or b"{}"), method)
                if parts[5] == "verify":
                    oid = json.loads(body or b"{}").get("oid")
                    if oid in self.fake.uploaded:
                        return self._json({"success": True}, method)
                    return self._error(404, None, f"object {oid} was not uploaded", method)
            self.fake.unrouted.append(f"{method} {self.path}")
            return self._error(404, None, f"no route {self._path}", method)
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

    def _paths_info(self, repo_id: str, rev: str, paths: list[str], method: str) -> None:
        """``get_paths_info``: the tree entries (oid, size, lfs sha256) of the paths asked for."""
        found = self._lookup(repo_id, rev, method)
        if not found:
            return
        _, files = found
        out = []
        for path in paths:
            f = files.get(path)
            if f is None:
                continue
            e = {"type": "file", "oid": f.oid, "size": len(f.data), "path": path}
            if f.lfs:
                e["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}
            out.append(e)
        self._json(out, method)

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

    # --- uploads ------------------------------------------------------------------------------

    def _validate_yaml(self, payload: dict, method: str) -> None:
        """The README front matter must be YAML mapping (the Hub also checks known keys; we check types)."""
        import yaml

        text = payload.get("content", "")
        try:
            meta = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else {}
            if not isinstance(meta, dict):
                raise ValueError("metadata is not a mapping")
            for key in ("base_model", "library_name"):
                if key in meta and not isinstance(meta[key], (str, list)):
                    raise ValueError(f"{key} must be a string")
            if not isinstance(meta.get("tags", []), list):
                raise ValueError("tags must be a list")
        except Exception as exc:
            self.fake.yaml_errors.append(str(exc))
            return self._send(400, json.dumps({"errors": [{"message": str(exc)}]}).encode(), method, None,
                              "application/json")
        self._json({"warnings": []}, method)

    def _create_repo(self, payload: dict, method: str) -> None:
        repo_id = f"{payload.get('organization')}/{payload.get('name')}"
        url = f"{self.fake.hub_url}/{repo_id}"
        if repo_id in self.fake.repos:
            # Like the Hub: 409 with the repo's url in the body (create_repo(exist_ok=True) reads it).
            return self._send(409, json.dumps({"error": "You already created this model repo", "url": url}).encode(),
                              method, {"X-Error-Message": "You already created this model repo"}, "application/json")
        repo = self.fake.repos.setdefault(repo_id, Repo())
        commit = hashlib.sha1(f"initial {repo_id}".encode()).hexdigest()
        repo.commits[commit] = {".gitattributes": HubFile(".gitattributes", GITATTRIBUTES, False)}
        repo.refs["main"] = commit
        self.fake.private[repo_id] = payload.get("visibility") == "private" or bool(payload.get("private"))
        self._json({"url": url, "name": repo_id}, method)

    def _preupload(self, repo_id: str, rev: str, payload: dict, method: str) -> None:
        found = self._lookup(repo_id, rev, method)
        if not found:
            return
        _, files = found
        out = []
        for f in payload.get("files", []):
            lfs = f["path"].endswith(LFS_SUFFIXES)
            remote = files.get(f["path"])
            oid = None if remote is None else (remote.sha256 if remote.lfs else remote.oid)
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        self._json({"files": out, "commitOid": found[0]}, method)

    def _lfs_batch(self, repo_id: str, payload: dict, method: str) -> None:
        if repo_id not in self.fake.repos:
            return self._error(404, "RepoNotFound", "Repository not found", method)
        objects = []
        for o in payload.get("objects", []):
            entry = {"oid": o["oid"], "size": o["size"]}
            if o["oid"] not in self.fake.uploaded and o["oid"] not in self.fake._blobs:
                entry["actions"] = {
                    "upload": {"href": f"{self.fake.cdn_url}/upload/{o['oid']}?Expires=9999999999&Signature=fake",
                               "header": {}},
                    "verify": {"href": f"{self.fake.hub_url}/{repo_id}.git/info/lfs/objects/verify", "header": {}},
                }
            objects.append(entry)
        self._json({"transfer": "basic", "objects": objects}, method)

    def _commit(self, repo_id: str, rev: str, body: bytes, method: str) -> None:
        import base64

        found = self._lookup(repo_id, rev, method)
        if not found:
            return
        parent, files = found
        files = dict(files)
        summary = ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
            elif key == "file":
                data = base64.b64decode(value["content"])
                files[value["path"]] = HubFile(value["path"], data, False)
            elif key == "lfsFile":
                data = self.fake.uploaded.get(value["oid"])
                if data is None and value["oid"] in self.fake._blobs:
                    data = self.fake._blobs[value["oid"]].data
                if data is None:
                    return self._error(400, None, f"LFS object {value['oid']} of {value['path']} was never uploaded",
                                       method)
                files[value["path"]] = HubFile(value["path"], data, True)
            elif key in ("deletedFile", "deletedFolder"):
                files = {p: f for p, f in files.items()
                         if p != value["path"] and not p.startswith(value["path"].rstrip("/") + "/")}
        commit = hashlib.sha1(f"{parent} {summary} {sorted((p, f.oid) for p, f in files.items())}".encode()).hexdigest()
        self.fake.add_commit(repo_id, commit, files, ref=rev)
        self._json({"commitUrl": f"{self.fake.hub_url}/{repo_id}/commit/{commit}", "commitOid": commit,
                    "success": True}, method)

    # --- CDN ----------------------------------------------------------------------------------

    def _cdn_upload(self, method: str) -> None:
        oid = self._path.rsplit("/", 1)[-1]
        self._file = oid
        body = self._body()
        if "Signature" not in self._query:
            return self._send(403, b"AccessDenied", method)
        status = self.fake.fail_upload.get(oid)
        if status:
            return self._send(status, b"injected upload failure", method)
        if hashlib.sha256(body).hexdigest() != oid:
            return self._send(400, b"sha256 mismatch", method)
        self.fake.uploaded[oid] = body
        self._send(200, b"", method, {"ETag": f'"{oid}"'})

    def _cdn(self, method: str) -> None:
        if method == "PUT" and self._path.startswith("/upload/"):
            return self._cdn_upload(method)
        f = self.fake._blobs.get(self._path.rsplit("/", 1)[-1])
        if f is None or "Signature" not in self._query:
            self.fake.unrouted.append(f"cdn {method} {self.path}")
            return self._send(403, b"AccessDenied", method)
        self._file = f.path
        headers = {"ETag": f'"{f.sha256}"', "Accept-Ranges": "bytes"}
        rng = self.headers.get("Range") if self.fake.honor_range else None
        if rng is None:
            if self.fake.on_full_get is not None:
                self.fake.on_full_get(f.path)
            status = self.fake.fail_full_get.get(f.path)
            if status:
                return self._send(status, b"injected failure", method)
            data = f.data[:-1] + bytes([f.data[-1] ^ 1]) if f.path in self.fake.corrupt_full_get else f.data
            return self._send(200, data, method, headers)
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
