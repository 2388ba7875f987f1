"""The Hub path, online for real through huggingface_hub, against a stand-in Hub on 127.0.0.1.

``tests/hubserver.py`` serves the routes huggingface_hub 2.x calls (repo info, tree listing, resolve
with HEAD metadata and an LFS redirect to a second "CDN" origin that honours Range requests) and logs
every request. ``python -m fp4convert`` runs in subprocesses with the environment a user would set
(``HF_ENDPOINT`` pointing at the stand-in, an empty ``HF_HOME``/``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``
unset, a token as for a logged-in user), because huggingface_hub reads these at import.

To keep the file fast, every CLI run happens once, all of them concurrently, in the module fixture
``runs``; each run has its own server pair, cache and output folder, so each log is that run's alone.
The tests then check what each run produced and what it asked the servers for.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert, plan_conversion

from tests import checkpoints as ck
from fp4convert.output.card import original_body, split_card

from tests.hubserver import FakeHub, hub_env

REPO = "tiny-org/tiny-llama"
COMMIT_A = hashlib.sha1(b"fp4convert test commit A").hexdigest()  # main: 3 shards + index
COMMIT_B = hashlib.sha1(b"fp4convert test commit B").hexdigest()  # tag v1.0: one file, no index
TOKEN = "hf_fp4convertTestTokenNotARealOne"  # what hub_env sets as HF_TOKEN
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
INDEX = "model.safetensors.index.json"
ARGS = ("--device", "cpu", "--max-shard-size", "6KB")
TIMEOUT_S = 120  # for all the CLI runs together


@dataclass
class Run:
    hub: FakeHub
    home: Path  # HF_HOME; the hub cache is home / "hub"
    out: Path
    rc: int
    stdout: str
    stderr: str

    @property
    def cache(self) -> Path:
        return self.home / "hub"

    def blobs(self, repo_id: str = REPO) -> set[str]:
        d = self.cache / ("models--" + repo_id.replace("/", "--")) / "blobs"
        return {p.name for p in d.iterdir()} if d.exists() else set()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub_files")
    ck.llama(root / "a", zoo=True)
    ck.llama(root / "b", layers=1, single=True, seed=3)
    return {"a": root / "a", "b": root / "b"}


# name -> (FakeHub options, quantize arguments after SRC DST)
SCENARIOS = {
    "quantize": ({}, [REPO, *ARGS, "-q"]),
    "dry_run": ({}, [REPO, *ARGS, "--dry-run", "--json"]),
    "tag": ({}, [REPO, "--revision", "v1.0", "--device", "cpu", "-q", "--json"]),
    "missing_repo": ({}, ["tiny-org/not-there", *ARGS]),
    "shard_fails": ({"fail_full_get": {SHARDS[1]: 500}}, [REPO, *ARGS, "-q"]),
    # The CDN sends same-size corrupt bytes for the second shard (its header, read by range, is true).
    "corrupt_shard": ({"corrupt_full_get": (SHARDS[1],)}, [REPO, *ARGS, "-q"]),
    # {root}: this run's folder. Shards go to a cache of our choosing and leave it once converted.
    "delete_shards": ({}, [REPO, *ARGS, "--delete-source-shards", "--cache-dir", "{root}/my_cache"]),
    # No HF_TOKEN in the environment: the token comes from --token only.
    "token_option": ({"_token": None}, [REPO, "--revision", "v1.0", "--device", "cpu", "-q", "--token", TOKEN]),
}


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory) -> dict[str, Run]:
    """Every scenario's CLI run, concurrently, each against its own FakeHub; servers stopped after."""
    root = tmp_path_factory.mktemp("hub_runs")
    results: dict[str, Run] = {}
    with contextlib.ExitStack() as stack:
        procs = {}
        for name, (options, args) in SCENARIOS.items():
            options = dict(options)
            token = options.pop("_token", TOKEN)
            hub = FakeHub(lifetime=TIMEOUT_S + 30, **options)
            hub.add(REPO, files["a"], COMMIT_A, refs=("main",))
            hub.add(REPO, files["b"], COMMIT_B, refs=("v1.0",))
            stack.enter_context(hub)
            home, out = root / name / "hf_home", root / name / "out"
            args = [a.replace("{root}", str(root / name)) for a in args]
            cmd = [sys.executable, "-m", "fp4convert", "quantize", args[0], str(out), *args[1:]]
            proc = subprocess.Popen(cmd, env=hub_env(hub.endpoint, home, token), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            stack.callback(_reap, proc)
            procs[name] = (hub, home, out, proc)
        deadline = time.monotonic() + TIMEOUT_S
        for name, (hub, home, out, proc) in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate(timeout=10)
                stderr += f"\n[test] killed after {TIMEOUT_S} s"
            results[name] = Run(hub, home, out, proc.returncode, stdout, stderr)
    return results  # the servers are stopped: every log is complete


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def header_end(path: Path) -> int:
    """Offset where a safetensors file's data starts (8-byte length + JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare_with_local(hub_out: Path, local_out: Path, commit: str, revision: str | None) -> None:
    got, want = ck.all_files(hub_out), ck.all_files(local_out)
    # The Hub repo has a .gitattributes the local folder lacks; it is copied like any metadata file.
    assert got.pop(".gitattributes") == b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    m_got, m_want = json.loads(got.pop("fp4convert.json")), json.loads(want.pop("fp4convert.json"))
    card_got, card_want = got.pop("README.md").decode(), want.pop("README.md").decode()
    assert got == want  # every shard, the index, every copied file, byte for byte
    assert m_got["files"].pop(".gitattributes")["size"] == 50
    # The model card names the Hub repo as base model (the local run names its folder); the rest is the same.
    assert split_card(card_got)[0]["base_model"] == REPO
    assert original_body(card_got) == original_body(card_want) == ck.OTHER_FILES["README.md"].strip()
    src = m_got["source"]
    assert src["type"] == "hub" and src["repo_id"] == REPO
    assert src["commit"] == commit and src["revision"] == revision
    files_got = {f: r for f, r in m_got["files"].items() if f != "README.md"}
    assert files_got == {f: r for f, r in m_want["files"].items() if f != "README.md"}
    for k in ("tensors", "summary", "groups", "scheme", "format"):
        assert m_got[k] == m_want[k], k


def assert_header_only(run: Run, files: Path, shards: list[str]) -> None:
    """Shard bytes came from ranged GETs that stay inside each shard's header, never a whole file."""
    for shard in shards:
        end = header_end(files / shard)
        reqs = run.hub.requests(file=shard)
        assert reqs, f"{shard}: never asked for"
        for r in reqs:
            assert r.method == "HEAD" or r.range is not None, (shard, r)
            assert not r.full_get, (shard, r)
            if r.method == "GET":
                assert r.status == 206 and r.server == "cdn", r
                first, last = (int(x) for x in r.range.split("=")[1].split("-"))
                assert 0 <= first <= last < end, (shard, r.range, end)
        assert sum(r.sent for r in reqs) <= end


# --- success ------------------------------------------------------------------------------------

def test_quantize_online_equals_local(runs, files, tmp_path) -> None:
    run = runs["quantize"]
    assert run.rc == 0, run.stderr
    local = tmp_path / "local_out"
    convert(files["a"], local, ConvertConfig(device="cpu", max_shard_size=6000))
    compare_with_local(run.out, local, COMMIT_A, None)
    assert (run.out / "special/chat_template.jinja").read_text() == ck.OTHER_FILES["special/chat_template.jinja"]
    assert run.hub.unrouted == [] and run.hub.errors == []


def test_each_shard_downloaded_once_in_order(runs, files) -> None:
    run = runs["quantize"]
    assert run.rc == 0, run.stderr
    hub = run.hub
    for shard in SHARDS:
        assert hub.full_gets(shard) == 1, (shard, hub.requests(file=shard))
        # Beyond the one download: the header's two ranged reads, nothing else of the data.
        extra = [r for r in hub.requests(file=shard, method="GET") if not r.full_get]
        assert all(r.range and r.status == 206 for r in extra), extra
        assert sum(r.sent for r in extra) <= header_end(files["a"] / shard)
        assert not hub.requests(server="hub", method="GET", file=shard)  # the Hub only redirects
    order = [r.file for r in sorted(hub.requests(server="cdn"), key=lambda r: r.started) if r.full_get]
    # begun in shard order; two downloads are in flight at once, so neighbours may reach the server swapped
    assert sorted(order) == SHARDS and all(abs(SHARDS.index(f) - i) <= 1 for i, f in enumerate(order)), order
    # Each non-weight file once, from the Hub itself (snapshot_download); the cache holds every shard blob.
    others = [r.file for r in hub.requests(server="hub", method="GET") if r.file]
    assert sorted(others) == sorted({*others}) and "config.json" in others and INDEX in others
    assert {sha256(files["a"] / s) for s in SHARDS} <= run.blobs()


def test_dry_run_downloads_no_shard(runs, files) -> None:
    run = runs["dry_run"]
    assert run.rc == 0, run.stderr
    _, plan, _ = plan_conversion(str(files["a"]), ConvertConfig(device="cpu", max_shard_size=6000))
    assert json.loads(run.stdout) == plan.to_json()
    assert_header_only(run, files["a"], SHARDS)
    shard_blobs = {sha256(files["a"] / s) for s in SHARDS}
    assert not shard_blobs & run.blobs()
    assert not [p for p in run.cache.rglob("*") if p.name.endswith((".safetensors", ".incomplete"))]
    assert (run.cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT_A / "config.json").exists()
    assert not run.out.exists()
    assert run.hub.unrouted == [] and run.hub.errors == []


def test_revision_tag_of_a_single_file_repo(runs, files, tmp_path) -> None:
    """No index: the weight files come from the Hub's listing (list_repo_files) at the resolved commit."""
    run = runs["tag"]
    assert run.rc == 0, run.stderr
    assert json.loads(run.stdout)["quantized"] == 7
    local = tmp_path / "local_out"
    convert(files["b"], local, ConvertConfig(device="cpu"))
    compare_with_local(run.out, local, COMMIT_B, "v1.0")
    trees = [r.path for r in run.hub.requests(server="hub") if "/tree/" in r.path]
    assert trees and all(p.endswith(f"/tree/{COMMIT_B}") for p in trees)
    assert run.hub.full_gets("model.safetensors") == 1
    assert not any(r.file in SHARDS for r in run.hub.requests())  # nothing of commit A
    assert run.hub.unrouted == [] and run.hub.errors == []


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, words", [
    ("missing_repo", ["tiny-org/not-there", "RepositoryNotFoundError"]),
    ("shard_fails", [REPO, SHARDS[1], "500"]),
])
def test_server_errors_are_clean_cli_errors(runs, name, words) -> None:
    run = runs[name]
    assert run.rc == 4, (run.rc, run.stderr)
    assert run.stderr.startswith("Error: "), run.stderr
    assert "Traceback" not in run.stderr
    for w in words:
        assert w in run.stderr, (w, run.stderr)
    if name == "missing_repo":
        assert not run.out.exists()
    assert run.hub.unrouted == [] and run.hub.errors == []


def test_shard_failure_stops_at_that_shard(runs) -> None:
    """The first shard was fetched, the failing second one once (no retry storm), the third at most once:
    the prefetch's second connection may have begun it before the failure; nothing starts after it."""
    hub = runs["shard_fails"].hub
    assert hub.full_gets(SHARDS[0]) == 1
    assert [r.status for r in hub.requests(server="cdn", file=SHARDS[1]) if r.range is None] == [500]
    assert hub.full_gets(SHARDS[2]) <= 1
    assert not list(runs["shard_fails"].out.glob("*.partial"))


# --- the token ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["quantize", "dry_run", "tag", "token_option"])
def test_token_goes_to_the_hub_only(runs, name) -> None:
    """The user's token authenticates Hub calls but never reaches the CDN origin of a signed URL
    (huggingface_hub drops it there itself; S3-style signed URLs reject requests that carry one)."""
    run = runs[name]
    assert run.rc == 0, run.stderr
    hub_reqs, cdn_reqs = run.hub.requests(server="hub"), run.hub.requests(server="cdn")
    assert hub_reqs and all(r.auth for r in hub_reqs)
    leaked = [(r.method, r.file, r.range) for r in cdn_reqs if r.auth]
    assert not leaked, f"token sent to the CDN: {leaked}"


# --- cache options ------------------------------------------------------------------------------

def test_delete_source_shards_and_cache_dir(runs, files, tmp_path) -> None:
    """Every shard is fetched once into --cache-dir and removed from it once converted (before the
    output's last shard is written, not at the end); the output is the same; the default cache is unused."""
    run = runs["delete_shards"]
    assert run.rc == 0, run.stderr
    local = tmp_path / "local_out"
    convert(files["a"], local, ConvertConfig(device="cpu", max_shard_size=6000))
    compare_with_local(run.out, local, COMMIT_A, None)
    cache = run.home.parent / "my_cache"
    repo_dir = cache / "models--tiny-org--tiny-llama"
    assert (repo_dir / "snapshots" / COMMIT_A / "config.json").exists()  # small files stay
    shard_blobs = {sha256(files["a"] / s) for s in SHARDS}
    assert not shard_blobs & {p.name for p in (repo_dir / "blobs").iterdir()}
    assert not [p for p in (repo_dir / "snapshots").rglob("*.safetensors")]
    assert not (run.cache / "models--tiny-org--tiny-llama").exists()  # HF_HUB_CACHE untouched
    for shard in SHARDS:
        assert run.hub.full_gets(shard) == 1
    lines = run.stderr.splitlines()
    removed = [i for i, ln in enumerate(lines) if ln.startswith("removed ") and "from the HF cache" in ln]
    wrote = [i for i, ln in enumerate(lines) if ln.startswith("wrote model-")]
    assert len(removed) == len(SHARDS) and removed[0] < wrote[-1], run.stderr


def test_model_card_names_the_hub_repo(runs) -> None:
    meta, body = split_card((runs["quantize"].out / "README.md").read_text())
    assert meta["base_model"] == REPO and f"(https://huggingface.co/{REPO})" in body


def test_a_corrupt_download_is_refused_against_the_hubs_sha256(runs) -> None:
    """Same size, one bit off: exit 4 naming the shard and the sha256 (huggingface_hub checks sizes only);
    no output claims to be finished, and the bad blob left the cache (a rerun downloads it again)."""
    run = runs["corrupt_shard"]
    assert run.rc == 4, (run.rc, run.stderr)
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and SHARDS[1] in last and "sha256" in last and "Traceback" not in run.stderr
    assert not (run.out / "fp4convert.json").exists() and not list(run.out.glob("*.partial"))
    # the third shard at most once: the prefetch's second connection may have begun it before the check failed
    assert run.hub.full_gets(SHARDS[1]) == 1 and run.hub.full_gets(SHARDS[2]) <= 1
    assert any("/paths-info/" in r.path for r in run.hub.requests(server="hub"))
    snap = run.cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT_A
    assert not os.path.lexists(snap / SHARDS[1])
    assert run.hub.unrouted == [] and run.hub.errors == []


def test_header_read_by_range_must_match_the_download(files, tmp_path, monkeypatch) -> None:
    """The header planned from (range reads) and the downloaded file's header must agree: exit 4 otherwise."""
    from fp4convert.errors import CheckpointFormatError
    from fp4convert.storage.reads import read_header
    from fp4convert.source.hub import HubSource as Source

    snap = tmp_path / "snap"
    snap.mkdir()
    shard = snap / SHARDS[0]
    shard.write_bytes((files["a"] / SHARDS[0]).read_bytes())
    src = Source("org/x", snap, SHARDS, repo_id="org/x", commit=COMMIT_A, roots=(str(snap),))
    monkeypatch.setattr(Source, "_hub_hashes", lambda self: {})
    infos, meta = read_header(shard, SHARDS[0])
    src._header_cache[SHARDS[0]] = (infos, meta)
    src._verify_download(SHARDS[0], shard)  # the same header: fine
    src._header_cache[SHARDS[0]] = (infos[::-1], meta)  # what a lying range answer would have planned
    with pytest.raises(CheckpointFormatError, match="header differs from the one read by range"):
        src._verify_download(SHARDS[0], shard)
    assert not shard.exists()  # out of the cache: a rerun downloads it again
