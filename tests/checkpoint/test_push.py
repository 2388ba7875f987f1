"""--push-to-hub / ``fp4convert push`` end to end through huggingface_hub, against the stand-in Hub.

Runs are subprocesses (huggingface_hub reads HF_ENDPOINT at import), with the legacy LFS upload path
(``HF_HUB_DISABLE_XET=1``): create_repo, preupload, LFS batch + PUT + verify, commit. An interrupted
upload is simulated by a CDN that refuses one object; the rerun must upload only that object.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fp4convert.checkpoint.inspect import inspect_checkpoint

from tests import checkpoints as ck
from tests.hubserver import FakeHub, hub_env

REPO = "me/tiny-llama-nvfp4"


def cli(hub: FakeHub, home: Path, *args: str, token: str | None = "hf_fp4convertTestTokenNotARealOne",
        bars: bool = False):
    env = hub_env(hub.endpoint, home, token)
    if bars:  # as a user has it: huggingface_hub's progress bars on unless fp4convert turns them off
        del env["HF_HUB_DISABLE_PROGRESS_BARS"]
    return subprocess.run([sys.executable, "-m", "fp4convert", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("push") / "tiny-llama"
    ck.llama(p, zoo=True)
    return p


def local_files(folder: Path) -> dict[str, bytes]:
    return {k: v for k, v in ck.all_files(folder).items() if not k.startswith(".")}


def test_quantize_and_push(src, tmp_path) -> None:
    dst = tmp_path / "out"
    with FakeHub() as hub:
        r = cli(hub, tmp_path / "home", "quantize", src, dst, "--device", "cpu", "--max-shard-size", "6KB",
                "--push-to-hub", REPO, "--private", "-q", bars=True)
        assert r.returncode == 0, r.stderr
        assert r.stderr == "" and r.stdout == ""  # --quiet: nothing but errors, no upload bars either
        assert hub.private[REPO] is True
        remote = hub.files(REPO)
        assert remote.pop(".gitattributes")
        assert remote == local_files(dst)  # every file, byte for byte (card and manifest retargeted first)
        card = remote["README.md"].decode()
        assert f"fp4convert export {REPO} out-ct" in card and "THIS_MODEL" not in card
        assert inspect_checkpoint(str(dst), check_files=True)["ok"]  # the manifest follows the edited card
        shards = [f for f in remote if f.endswith(".safetensors")]
        assert len(shards) > 1 and len(hub.requests(server="cdn", method="PUT")) == len(shards)
        assert all(r.auth for r in hub.requests(server="hub"))
        assert not any(r.auth for r in hub.requests(server="cdn"))  # the token stays on the Hub
        assert hub.unrouted == [] and hub.errors == []


def test_interrupted_upload_resumes_with_only_what_is_missing(src, tmp_path) -> None:
    dst = tmp_path / "out"
    home = tmp_path / "home"
    with FakeHub() as hub:
        r = cli(hub, home, "quantize", src, dst, "--device", "cpu", "--max-shard-size", "6KB", "-q")
        assert r.returncode == 0, r.stderr
        shards = sorted(p for p in dst.glob("*.safetensors"))
        assert len(shards) >= 3
        oids = {hashlib.sha256(p.read_bytes()).hexdigest() for p in shards}
        lost = hashlib.sha256(shards[-1].read_bytes()).hexdigest()  # uploads go in order: the others start first
        hub.fail_upload[lost] = 403  # the CDN refuses this object: the upload stops before any commit
        r = cli(hub, home, "push", dst, REPO)
        assert r.returncode == 5, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("Error: ") and "run the same command again" in last and "Traceback" not in r.stderr
        assert shards[-1].name in last  # names the file that did not go
        assert set(hub.files(REPO)) == {".gitattributes"}  # nothing committed
        first = {r.file for r in hub.requests(server="cdn", method="PUT") if r.status == 200}
        assert first and lost not in first and first < oids  # an upload cut short: some objects are there
        n_before = len(hub.requests())
        del hub.fail_upload[lost]
        r = cli(hub, home, "push", dst, REPO)
        assert r.returncode == 0, r.stderr
        again = [r.file for r in hub.requests()[n_before:] if r.server == "cdn" and r.method == "PUT"]
        assert sorted(again) == sorted(oids - first)  # only the missing objects travelled, each once
        assert lost in again
        remote = hub.files(REPO)
        remote.pop(".gitattributes")
        assert remote == local_files(dst)
        # A third push of the unchanged folder uploads nothing and makes no commit.
        commit = hub.repos[REPO].refs["main"]
        n_before = len(hub.requests())
        r = cli(hub, home, "push", dst, REPO)
        assert r.returncode == 0, r.stderr
        assert hub.repos[REPO].refs["main"] == commit
        assert not [r for r in hub.requests()[n_before:] if r.method in ("PUT",) or "/commit/" in r.path]
        assert hub.unrouted == [] and hub.errors == []


def test_token_option_and_unfinished_folder(src, tmp_path) -> None:
    dst = tmp_path / "out"
    with FakeHub() as hub:
        r = cli(hub, tmp_path / "home", "quantize", src, dst, "--device", "cpu", "-q", "--push-to-hub", REPO,
                "--token", "hf_fromTheOption", token=None)
        assert r.returncode == 0, r.stderr
        assert hub.private[REPO] is False
        assert all(r.auth for r in hub.requests(server="hub") if r.method == "POST")
        (dst / "fp4convert.json").unlink()
        r = cli(hub, tmp_path / "home", "push", dst, "me/other")
        assert r.returncode == 5 and "did not finish" in r.stderr, r.stderr
        assert "me/other" not in hub.repos


def test_push_uploads_exactly_what_the_manifest_lists(src, tmp_path) -> None:
    """An .env, a stray file and a symlinked folder in the output stay local; a listed file that is a
    symlink (even to identical bytes) or that differs refuses the push before anything is created (exit 5)."""
    dst, home = tmp_path / "out", tmp_path / "home"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("OUTSIDE_MARKER")
    with FakeHub() as hub:
        r = cli(hub, home, "quantize", src, dst, "--device", "cpu", "-q")
        assert r.returncode == 0, r.stderr
        listed = set(json.loads((dst / "fp4convert.json").read_text())["files"]) | {"fp4convert.json"}
        (dst / ".env").write_text("HF_TOKEN=hf_ENV_MARKER\n")
        (dst / "notes.txt").write_text("mine")
        (dst / "linked").symlink_to(outside)
        r = cli(hub, home, "push", dst, REPO)
        assert r.returncode == 0, r.stderr
        remote = hub.files(REPO)
        remote.pop(".gitattributes")
        assert set(remote) == listed
        assert not any(b"MARKER" in data for data in remote.values())
        # A listed file turned into a symlink to a copy of itself: refused, nothing created.
        tok = dst / "tokenizer.json"
        copy = outside / "tokenizer.json"
        copy.write_bytes(tok.read_bytes())
        tok.unlink()
        tok.symlink_to(copy)
        r = cli(hub, home, "push", dst, "me/other")
        assert r.returncode == 5 and "tokenizer.json" in r.stderr and "symlink" in r.stderr, r.stderr
        assert "me/other" not in hub.repos
        tok.unlink()
        tok.write_bytes(copy.read_bytes()[:-1] + b" ")  # same size, other bytes
        r = cli(hub, home, "push", dst, "me/other")
        assert r.returncode == 5 and "tokenizer.json" in r.stderr and "differs" in r.stderr, r.stderr
        assert "me/other" not in hub.repos and "Traceback" not in r.stderr
        assert hub.unrouted == [] and hub.errors == []
