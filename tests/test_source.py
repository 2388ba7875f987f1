"""The Hub path, offline for real through huggingface_hub: a pre-filled HF cache and HF_HUB_OFFLINE=1.

The cache has the layout huggingface_hub itself writes (``models--org--name/{refs/main, blobs/<hash>,
snapshots/<commit>/<file>}``); snapshot entries are relative symlinks to blobs (the normal layout) or,
for the second repo, plain files (what the cache holds where symlinks are unavailable). The main test
runs ``python -m fp4convert`` in a subprocess with the environment variables a user would set; the
smaller cases run in process with huggingface_hub's constants patched the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4convert.config import ConvertConfig
from fp4convert.convert import convert
from fp4convert.errors import SourceError
from fp4convert.source import open_source

from . import checkpoints as ck

COMMIT_A = "0123456789abcdef0123456789abcdef01234567"
COMMIT_B = "fedcba9876543210fedcba9876543210fedcba98"
REPO = "tiny-org/tiny-llama"


def add_to_cache(cache: Path, repo_id: str, files: Path, commit: str, *, symlinks: bool = True,
                 ref: str | None = "main") -> Path:
    """Put every file of folder ``files`` into the HF cache as revision ``commit`` (and refs/<ref>)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for p in sorted(files.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(files)
        data = p.read_bytes()
        if p.suffix == ".safetensors":  # LFS files: blob named by sha256; others: git blob sha1
            blob = hashlib.sha256(data).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        target = snap / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if symlinks:
            target.symlink_to(os.path.relpath(repo / "blobs" / blob, target.parent))
        else:
            target.write_bytes(data)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    """A cache with REPO at two commits: A (3 shards, symlinks; refs/main) and B (single file, plain files)."""
    root = tmp_path_factory.mktemp("hub")
    a, b = root / "a", root / "b"
    ck.llama(a, zoo=True)
    ck.llama(b, layers=1, single=True, seed=3)
    cache = root / "cache"
    add_to_cache(cache, REPO, a, COMMIT_A)
    add_to_cache(cache, REPO, b, COMMIT_B, symlinks=False, ref=None)
    return {"root": root, "cache": cache, "a": a, "b": b}


def offline_env(hub: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub["cache"]), HF_HOME=str(hub["root"] / "hf_home"),
               HF_HUB_DISABLE_TELEMETRY="1", HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there
    return env


def cli(hub: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp4convert", *map(str, args)], env=offline_env(hub),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def offline(hub, monkeypatch):
    """In process: what HF_HUB_OFFLINE=1 HF_HUB_CACHE=... do, on the already imported huggingface_hub."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    return hub


def compare_with_local(hub_out: Path, local_out: Path, commit: str, revision: str | None) -> None:
    got, want = ck.all_files(hub_out), ck.all_files(local_out)
    from fp4convert.modelcard import original_body, split_card

    m_got, m_want = json.loads(got.pop("fp4convert.json")), json.loads(want.pop("fp4convert.json"))
    card_got, card_want = got.pop("README.md").decode(), want.pop("README.md").decode()
    assert got == want  # every shard, the index, every copied file
    # The model card names the Hub repo as base model (the local run: its folder); the source card is kept.
    assert split_card(card_got)[0]["base_model"] == REPO and original_body(card_got) == original_body(card_want)
    assert m_got["source"]["type"] == "hub" and m_got["source"]["repo_id"] == REPO
    assert m_got["source"]["commit"] == commit and m_got["source"]["revision"] == revision
    for k in ("tensors", "summary", "groups", "scheme", "format"):
        assert m_got[k] == m_want[k], k
    assert {f: r for f, r in m_got["files"].items() if f != "README.md"} == \
        {f: r for f, r in m_want["files"].items() if f != "README.md"}


def test_quantize_from_the_hub_cache_offline(hub, tmp_path) -> None:
    out = tmp_path / "hub_out"
    r = cli(hub, "quantize", REPO, out, "--device", "cpu", "--max-shard-size", "6KB", "-q")
    assert r.returncode == 0, r.stderr
    local = tmp_path / "local_out"
    convert(hub["a"], local, ConvertConfig(device="cpu", max_shard_size=6000))
    compare_with_local(out, local, COMMIT_A, None)
    # The Hub repo's own files came along (symlinks resolved into real files).
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert (out / "special/chat_template.jinja").read_text() == ck.OTHER_FILES["special/chat_template.jinja"]


def test_revision_commit_hash_plain_file_cache(hub, tmp_path) -> None:
    out = tmp_path / "hub_out"
    r = cli(hub, "quantize", REPO, out, "--revision", COMMIT_B, "--device", "cpu", "-q", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["quantized"] == 7
    local = tmp_path / "local_out"
    convert(hub["b"], local, ConvertConfig(device="cpu"))
    compare_with_local(out, local, COMMIT_B, COMMIT_B)


def test_unknown_repo_offline_is_a_clean_error(hub, tmp_path) -> None:
    r = cli(hub, "quantize", "tiny-org/not-cached", tmp_path / "o")
    assert r.returncode == 4, r.stderr
    assert "tiny-org/not-cached" in r.stderr and "HF_HUB_OFFLINE" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") <= 2
    assert not (tmp_path / "o").exists()


# --- in process, same cache ---------------------------------------------------------------------

def test_open_source_resolves_refs_and_commits(offline) -> None:
    s = open_source(REPO)
    assert s.is_hub and s.commit == COMMIT_A and s.revision is None
    assert s.weight_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert s.describe() == {"type": "hub", "repo_id": REPO, "revision": None, "commit": COMMIT_A}
    names = {t.name for t in s.tensors()}
    assert "model.layers.0.self_attn.v_proj.weight" in names and len(names) == 25
    b = open_source(REPO, COMMIT_B)
    assert b.commit == COMMIT_B and b.weight_files == ["model.safetensors"]


def test_unknown_revision_offline(offline) -> None:
    with pytest.raises(SourceError, match="HF_HUB_OFFLINE"):
        open_source(REPO, "1" * 40)


def test_shards_fetched_one_at_a_time(offline, tmp_path, monkeypatch) -> None:
    """Planning needs headers only; the data of each shard is fetched when the writer reaches it."""
    s = open_source(REPO)
    calls: list[str] = []
    real = s.local_path
    monkeypatch.setattr(s, "local_path", lambda f: (calls.append(f), real(f))[1])
    convert(s, tmp_path / "o", ConvertConfig(device="cpu"))
    first = [calls.index(f) for f in s.weight_files]
    assert first == sorted(first)  # shards in order


def test_pickle_only_repo_refused_with_reason(offline, tmp_path) -> None:
    files = tmp_path / "pkl"
    ck.pickle_only(files)
    add_to_cache(Path(offline["cache"]), "tiny-org/pickled", files, "ab" * 20)
    from fp4convert.convert import plan_conversion

    with pytest.raises(SourceError, match="only pickle weights.*safetensors"):
        plan_conversion("tiny-org/pickled", ConvertConfig(device="cpu"))


def test_inspect_a_hub_checkpoint(offline, tmp_path) -> None:
    from fp4convert.inspect import inspect_checkpoint

    out = tmp_path / "q"
    convert(offline["a"], out, ConvertConfig(device="cpu"))
    add_to_cache(Path(offline["cache"]), "tiny-org/tiny-llama-nvfp4", out, "cd" * 20)
    r = inspect_checkpoint("tiny-org/tiny-llama-nvfp4")
    assert r["ok"] and r["format"] == "fp4convert" and r["quantized"] == 14
