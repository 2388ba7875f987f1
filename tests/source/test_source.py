"""Opening sources. First the Hub path, offline for real through huggingface_hub: a pre-filled HF cache
and HF_HUB_OFFLINE=1; then containment, the index cross-check, config checks, the copy rule (local,
offline cache and online Hub give the same list) and mistyped local paths.

The cache has the layout huggingface_hub itself writes (``models--org--name/{refs/main, blobs/<hash>,
snapshots/<commit>/<file>}``); snapshot entries are relative symlinks to blobs (the normal layout) or,
for the second repo, plain files (what the cache holds where symlinks are unavailable). The main test
runs ``python -m fp4convert`` in a subprocess with the environment variables a user would set; the
smaller cases run in process with huggingface_hub's constants patched the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert
from fp4convert.storage.safetensors import CheckpointFormatError
from fp4convert.source.source import CheckpointIndexError, OutsideSourceError, SourceError
from fp4convert.source.copying import copy_rule, hub_ignore_patterns
from fp4convert.source.open import open_source

from tests import checkpoints as ck

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
    from fp4convert.output.card import original_body, split_card

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


def test_dry_run_from_the_hub_cache_without_torch(hub, tmp_path) -> None:
    """Planning a Hub repo from the HF cache (and refusing an unknown revision) needs no torch."""
    r, torch_stack = ck.cli_watching_torch(tmp_path, "quantize", REPO, tmp_path / "q", "--dry-run", "--json",
                                           env=offline_env(hub))
    assert r.returncode == 0, r.stderr
    assert not torch_stack, torch_stack
    assert json.loads(r.stdout)["summary"]["quantized"] == 14
    r, torch_stack = ck.cli_watching_torch(tmp_path, "quantize", REPO, tmp_path / "q", "--dry-run",
                                           "--revision", "no-such-branch", env=offline_env(hub))
    assert r.returncode == 4 and f"{REPO}@no-such-branch" in r.stderr and "this revision" in r.stderr, r.stderr
    assert not torch_stack, torch_stack
    assert not (tmp_path / "q").exists()


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
    from fp4convert.run.convert import plan_conversion

    with pytest.raises(SourceError, match="only pickle weights.*safetensors"):
        plan_conversion("tiny-org/pickled", ConvertConfig(device="cpu"))


def test_inspect_a_hub_checkpoint(offline, tmp_path) -> None:
    from fp4convert.checkpoint.inspect import inspect_checkpoint

    out = tmp_path / "q"
    convert(offline["a"], out, ConvertConfig(device="cpu"))
    add_to_cache(Path(offline["cache"]), "tiny-org/tiny-llama-nvfp4", out, "cd" * 20)
    r = inspect_checkpoint("tiny-org/tiny-llama-nvfp4")
    assert r["ok"] and r["format"] == "fp4convert" and r["quantized"] == 14


# =================================================================================================
# Containment, index cross-check, config checks, the copy rule and mistyped paths (issues 11, 12)
# =================================================================================================

INDEX = "model.safetensors.index.json"


@pytest.fixture
def three(tmp_path) -> Path:
    """A fresh 3-shard Llama (with index) in tmp_path/src."""
    ck.llama(tmp_path / "src", layers=1)
    return tmp_path / "src"


def edit_index(src: Path, fn) -> None:
    idx = json.loads((src / INDEX).read_text())
    fn(idx["weight_map"])
    (src / INDEX).write_text(json.dumps(idx))


def one_line_error(exc_info, *words: str) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and exc_info.value.exit_code == 4, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


# --- containment --------------------------------------------------------------------------------

@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "ABS", "../../etc/passwd",
                                   "sub/../../outside/model.safetensors", "./model-00001-of-00003.safetensors",
                                   "a\\..\\x.safetensors"])
def test_index_entries_leaving_the_folder_are_refused(three, entry, tmp_path) -> None:
    outside = tmp_path / "outside"
    ck.llama(outside, layers=1, single=True, seed=9)  # a valid checkpoint an attacker would pull in
    entry = str(outside / "model.safetensors") if entry == "ABS" else entry
    edit_index(three, lambda wm: wm.__setitem__("model.norm.weight", entry))
    with pytest.raises(OutsideSourceError) as e:
        open_source(str(three))
    one_line_error(e, "model.norm.weight")
    assert "root:" not in str(e.value)  # nothing read from the target


def test_weight_symlink_out_of_the_folder_is_refused(tmp_path) -> None:
    other = tmp_path / "other"
    ck.llama(other, layers=1, single=True)
    src = tmp_path / "src"
    ck.llama(src, layers=1, single=True)
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to(other / "model.safetensors")
    with pytest.raises(OutsideSourceError) as e:
        open_source(str(src))
    one_line_error(e, "model.safetensors", "outside the checkpoint folder", "cp -L")


def test_symlinks_inside_the_folder_are_fine(three) -> None:
    (three / "blobs").mkdir()
    for f in list(three.glob("*.safetensors")):
        f.rename(three / "blobs" / f.name)
        f.symlink_to(Path("blobs") / f.name)
    (three / "tok.json").symlink_to("tokenizer.json")
    s = open_source(str(three))
    assert len(s.tensors()) == 12
    assert three / "tok.json" in s.other_files()


def test_index_and_config_symlinked_outside_are_refused(three, tmp_path) -> None:
    (tmp_path / "evil.json").write_text('{"weight_map": {}}')
    (three / "config.json").unlink()
    (three / "config.json").symlink_to(tmp_path / "evil.json")
    with pytest.raises(OutsideSourceError, match="config.json"):
        open_source(str(three)).config()
    (three / INDEX).unlink()
    (three / INDEX).symlink_to(tmp_path / "evil.json")
    with pytest.raises(OutsideSourceError, match="weight index"):
        open_source(str(three))


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("name", ["tab\there.json", "new\nline.txt", "sub\tdir/notes.txt"])
def test_a_file_name_no_checkpoint_can_hold_is_skipped_when_planned(name, three, tmp_path) -> None:
    """A non-weight file named with a tab or newline is not copied, with a warning, decided with the
    plan: it was refused when the run opened it, after the shards were written, on every --resume too."""
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert

    (three / name).parent.mkdir(parents=True, exist_ok=True)
    (three / name).write_text("{}")
    handler = ListHandler()
    logger = logging.getLogger("fp4convert.source")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        convert(str(three), tmp_path / "out", ConvertConfig(device="cpu"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    top = name.split("/")[0]
    assert not (tmp_path / "out" / top).exists()
    assert (tmp_path / "out" / "config.json").exists()
    assert [m for m in handler.lines if "not copying" in m and "cannot have" in m and repr(top)[1:-1] in m]
    plan = {d.path.rstrip("/"): d for d in open_source(str(three)).file_plan()}
    assert not plan[top].copy


def test_non_weight_symlink_outside_is_skipped_with_a_warning(three, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("do not publish")
    (three / "tokenizer.model").symlink_to(secret)
    (three / "linked_dir").symlink_to(tmp_path, target_is_directory=True)
    s = open_source(str(three))
    handler = ListHandler()  # on the logger itself: the CLI's setup may stop propagation to pytest's
    logger = logging.getLogger("fp4convert.source")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # an earlier --quiet CLI run in this process may have raised the parent's level
    try:
        files = s.other_files()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert three / "tokenizer.model" not in files
    assert not [p for p in files if "linked_dir" in str(p)]
    assert [m for m in handler.lines if "tokenizer.model" in m and "outside the checkpoint folder" in m]
    plan = {d.path: d for d in s.file_plan()}
    assert not plan["linked_dir/"].copy and "symlinked folder" in plan["linked_dir/"].reason


def test_converting_never_copies_an_outside_file(three, tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("do not publish")
    (three / "notes.txt").symlink_to(secret)
    out = tmp_path / "out"
    convert(str(three), out, ConvertConfig(device="cpu"))
    assert not (out / "notes.txt").exists()
    assert all(b"do not publish" not in p.read_bytes() for p in out.rglob("*") if p.is_file())


def test_hub_snapshot_symlink_out_of_the_repo_cache(offline, tmp_path) -> None:
    """Snapshot entries may point into the repo's own blobs, nowhere else."""
    cache = Path(offline["cache"])
    files = tmp_path / "f"
    ck.llama(files, layers=1, single=True)
    snap = add_to_cache(cache, "tiny-org/escape", files, "ee" * 20)
    secret = tmp_path / "secret.txt"
    secret.write_text("x")
    (snap / "tokenizer.json").unlink()
    (snap / "tokenizer.json").symlink_to(secret)
    s = open_source("tiny-org/escape")
    rel = {p.relative_to(s.root).as_posix() for p in s.other_files()}
    assert "tokenizer.json" not in rel and "config.json" in rel  # config.json -> ../../blobs/...: fine
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(files / "model.safetensors")
    with pytest.raises(OutsideSourceError, match="outside the repo's cache folder"):
        s.local_path("model.safetensors")


# --- index cross-check ---------------------------------------------------------------------------

def test_tensor_in_index_but_in_no_shard(three) -> None:
    edit_index(three, lambda wm: wm.__setitem__("model.ghost.weight", "model-00001-of-00003.safetensors"))
    with pytest.raises(CheckpointIndexError) as e:
        open_source(str(three)).tensors()
    one_line_error(e, "'model.ghost.weight'", "model-00001-of-00003.safetensors", "does not hold it")


def test_tensor_in_a_shard_but_not_in_the_index(three) -> None:
    edit_index(three, lambda wm: wm.pop("model.norm.weight"))
    with pytest.raises(CheckpointIndexError) as e:
        open_source(str(three)).tensors()
    one_line_error(e, "'model.norm.weight'", "does not list")


def test_tensor_in_another_shard_than_the_index_says(three) -> None:
    edit_index(three, lambda wm: wm.__setitem__("model.norm.weight", "model-00001-of-00003.safetensors"))
    s = open_source(str(three))
    with pytest.raises(CheckpointIndexError) as e:
        s.tensors()
    one_line_error(e, "'model.norm.weight'", "but it is in model-00003-of-00003.safetensors")
    # inspect's way: every disagreement as a finding, nothing raised.
    assert len(s.tensors(check_index=False)) == 12
    probs = s.index_problems()
    assert len(probs) == 1 and "model.norm.weight" in probs[0]


@pytest.mark.parametrize("text, words", [
    (b'{"weight_map": {}}', "'weight_map' is empty"),
    (b'{"weight_map": ["a"]}', "'weight_map' is missing or not an object"),
    (b'{"metadata": {}}', "'weight_map' is missing or not an object"),
    (b'{"weight_map": {"w": 3}}', "maps to a number, not a file name"),
    (b'{"weight_map": {"w": null}}', "maps to a null"),
    (b'{"weight_map": {"w": "config.json"}}', "not a .safetensors file"),
    (b'[{"weight_map": {}}]', "a JSON list, not a JSON object"),
    (b'"x"', "a string, not a JSON object"),
    (b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}', "'w' appears twice"),
    (b'{"weight_map": {"\xff": "a.safetensors"}}', "not UTF-8"),
    (b'{"weight_map": ', "not valid JSON"),
    (b'{"weight_map": {"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}", "nests deeper"),
])
def test_malformed_index(three, text, words) -> None:
    (three / INDEX).write_bytes(text)
    with pytest.raises(SourceError) as e:
        open_source(str(three))
    msg = one_line_error(e, words)
    assert INDEX in msg


def test_index_listing_a_missing_file(three) -> None:
    edit_index(three, lambda wm: wm.__setitem__("model.norm.weight", "model-00009-of-00009.safetensors"))
    with pytest.raises(SourceError) as e:
        open_source(str(three))
    one_line_error(e, "model-00009-of-00009.safetensors", "missing")


def test_index_is_a_folder(three) -> None:
    (three / INDEX).unlink()
    (three / INDEX).mkdir()
    with pytest.raises(SourceError) as e:
        open_source(str(three))
    one_line_error(e, "is a folder")


# --- config.json ---------------------------------------------------------------------------------

@pytest.mark.parametrize("content, words", [
    ('["not", "an", "object"]', "a JSON list, not a JSON object"),
    (b"\xff\xfe{}", "not UTF-8"),
    ('{"quantization_config": "fp8"}', "quantization_config is a string, not a JSON object"),
    ('{"quantization_config": [1]}', "quantization_config is a JSON list"),
    ('{"a": ', "not valid JSON"),
    ("DIR", "is a folder"),
    ("BROKEN", "broken symlink"),
])
def test_malformed_config(three, content, words) -> None:
    cfg = three / "config.json"
    cfg.unlink()
    if content == "DIR":
        cfg.mkdir()
    elif content == "BROKEN":
        cfg.symlink_to(three / "nowhere.json")
    else:
        cfg.write_bytes(content if isinstance(content, bytes) else content.encode())
    s = open_source(str(three))
    with pytest.raises(SourceError) as e:
        s.config()
    one_line_error(e, "config.json", words)


def test_config_with_nan_and_null_quantization_config_is_accepted(three) -> None:
    (three / "config.json").write_text('{"x": NaN, "quantization_config": null, "big": ' + "9" * 30 + "}")
    cfg = open_source(str(three)).config()
    assert cfg["quantization_config"] is None and cfg["big"] == int("9" * 30)


# --- which files are copied ----------------------------------------------------------------------

COPY = {  # path -> copied?
    "config.json": True, "generation_config.json": True, "tokenizer.json": True, "tokenizer_config.json": True,
    "tokenizer.model": True, "special_tokens_map.json": True, "vocab.txt": True, "merges.txt": True,
    "chat_template.jinja": True, "chat_template.json": True, "processor_config.json": True,
    "preprocessor_config.json": True, "LICENSE": True, "LICENSE.txt": True, "NOTICE": True, "README.md": True,
    "USE_POLICY.md": True, ".gitattributes": True, "modeling_custom.py": True, "configuration_custom.py": True,
    "assets/figure.png": True, "special/chat_template.jinja": True, "original/params.json": True,
    # other weight formats and their indexes
    "pytorch_model.bin": False, "pytorch_model.bin.index.json": False, "model.pt": False, "model.pth": False,
    "model.ckpt": False, "weights.pkl": False, "tf_model.h5": False, "tf_model.h5.index.json": False,
    "flax_model.msgpack": False, "flax_model.msgpack.index.json": False, "model.gguf": False,
    "model.onnx": False, "model.onnx_data": False, "model.tflite": False, "rust_model.ot": False,
    "original/consolidated.00.pth": False, "training_args.bin": False, "extra.safetensors": False,
    "sub/model.safetensors": False, "model.safetensors.index.json": False,
    "onnx/config.json": False, "onnx/model.onnx": False, "openvino/openvino_model.xml": False,
    "flax/config.json": False, "tf/config.json": False, "coreml/model.mlpackage/x.json": False,
    # tool files, hidden and cache folders
    "fp4convert.json": False, ".fp4convert-progress.json": False, "model.safetensors.partial": False,
    ".git/config": False, ".cache/huggingface/download/x.metadata": False, ".DS_Store": False,
    "sub/.gitattributes": False, "__pycache__/modeling_custom.cpython-311.pyc": False,
}


def test_copy_rule_table() -> None:
    got = {p: copy_rule(p)[0] for p in COPY}
    assert got == COPY
    assert copy_rule("out/config.json", {"out": "the destination folder"}) == (False, "the destination folder")
    assert copy_rule("out/", {"out": "a nested fp4convert output"})[0] is False
    for p in COPY:
        ok, why = copy_rule(p)
        assert why and isinstance(why, str)


def test_hub_ignore_patterns_only_skip_what_the_rule_refuses() -> None:
    """The Hub download skips a subset of what copy_rule refuses (never a file it would copy)."""
    from huggingface_hub.utils import filter_repo_objects

    kept = set(filter_repo_objects(list(COPY), ignore_patterns=hub_ignore_patterns()))
    assert {p for p, c in COPY.items() if c} <= kept
    assert "pytorch_model.bin" not in kept and "onnx/config.json" not in kept and INDEX in kept
    assert "fp4convert.json" in kept  # needed to recognise a quantized repo or a nested output


def tricky_folder(root: Path) -> set[str]:
    """A checkpoint with one file of every kind; returns the paths that must be copied."""
    ck.llama(root, layers=1)
    for p in COPY:
        if p in ("model.safetensors.index.json", "config.json", "fp4convert.json", ".fp4convert-progress.json"):
            continue
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(f"contents of {p}\n")
    nested = root / "old_quantized"  # an fp4convert output left inside the source
    nested.mkdir()
    (nested / "fp4convert.json").write_text("{}")
    (nested / "config.json").write_text("{}")
    (nested / "tokenizer.json").write_text("{}")
    half = root / "half_done"  # an interrupted one
    half.mkdir()
    (half / ".fp4convert-progress.json").write_text("{}")
    (half / "README.md").write_text("x")
    return {p for p, c in COPY.items() if c} | {"tokenizer.json", "tokenizer_config.json", "README.md",
                                                "special/chat_template.jinja", "generation_config.json"}


def test_local_and_hub_cache_copy_the_same_files(offline, tmp_path) -> None:
    src = tmp_path / "src"
    want = tricky_folder(src)
    local = open_source(str(src))
    got_local = sorted(p.relative_to(local.root).as_posix() for p in local.other_files())
    assert set(got_local) == want
    add_to_cache(Path(offline["cache"]), "tiny-org/tricky", src, "aa" * 20)
    hub = open_source("tiny-org/tricky")
    got_hub = sorted(p.relative_to(hub.root).as_posix() for p in hub.other_files())
    assert got_hub == got_local
    reasons = {d.path: d.reason for d in hub.file_plan()}
    assert reasons["old_quantized/"] == "a nested fp4convert output"
    assert reasons["half_done/"] == "a nested fp4convert output"


def test_nested_outputs_and_the_destination_are_not_copied(three, tmp_path) -> None:
    """An fp4convert output inside SRC (its manifest or progress record marks it) and the folder passed
    as ``exclude`` (the destination) are skipped whole."""
    out = tmp_path / "elsewhere"
    convert(str(three), out, ConvertConfig(device="cpu"))
    shutil.copytree(out, three / "old_out")  # an output someone moved into the source folder
    (three / "new_out").mkdir()
    (three / "new_out" / "notes.txt").write_text("x")
    s = open_source(str(three))

    def tops(files: list[Path]) -> set[str]:
        return {p.relative_to(three).parts[0] for p in files}

    assert "old_out" not in tops(s.other_files())
    assert "new_out" in tops(s.other_files()) and "new_out" not in tops(s.other_files(exclude=three / "new_out"))
    (three / "old_out" / "fp4convert.json").unlink()  # without its manifest it is just a folder
    assert "old_out" in tops(s.other_files())


# --- mistyped local paths ------------------------------------------------------------------------

@pytest.fixture
def no_hub(monkeypatch):
    """Any attempt to reach the Hub fails the test."""
    import fp4convert.source.open as source_mod

    def refuse(*a, **k):
        raise AssertionError(f"sent to the Hub: {a}")

    monkeypatch.setattr(source_mod, "_open_hub", refuse)


@pytest.mark.parametrize("typed, words", [
    ("exmaples/tiny-llama", "did you mean examples/tiny-llama?"),
    ("examples/tiny-lama", "examples exists here, but not examples/tiny-lama"),
    ("./tiny-llama", "a path"),
    ("../tiny-llama", "a path"),
    ("~/surely-not-here-fp4", "a path"),
    ("/nonexistent/tiny-llama", "a path"),
    ("org/name/extra", "a path"),
    ("org/name/", "a path"),
    ("tiny-llama", "not a Hub repo id of the form org/name"),
    ("org/na me", "not a Hub repo id"),
])
def test_mistyped_local_path_is_no_such_folder(typed, words, tmp_path, monkeypatch, no_hub) -> None:
    ck.llama(tmp_path / "examples" / "tiny-llama", layers=1, single=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SourceError) as e:
        open_source(typed)
    msg = one_line_error(e, "no such folder", words)
    assert msg.startswith(typed)


def test_plausible_repo_id_still_goes_to_the_hub(tmp_path, monkeypatch) -> None:
    import fp4convert.source.open as source_mod

    ck.llama(tmp_path / "examples" / "tiny-llama", layers=1, single=True)
    monkeypatch.chdir(tmp_path)
    asked = []
    monkeypatch.setattr(source_mod, "_open_hub", lambda repo, rev, *rest: asked.append(repo))
    open_source("tiny-org/tiny-llama")
    open_source("meta-llama/Llama-3.1-8B")
    assert asked == ["tiny-org/tiny-llama", "meta-llama/Llama-3.1-8B"]


def test_cli_reports_bad_sources_in_one_line(three, tmp_path) -> None:
    """Through the CLI: exit 4, one line, no traceback, no output folder."""
    edit_index(three, lambda wm: wm.__setitem__("model.norm.weight", "../x.safetensors"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    (tmp_path / "examples").mkdir()
    for src, words in ((str(three), "'../x.safetensors' leads out of the checkpoint folder"),
                       ("exmaples/tiny-llama", "exmaples/tiny-llama: no such folder (did you mean")):
        out = tmp_path / "o"
        r = subprocess.run([sys.executable, "-m", "fp4convert", "quantize", src, str(out), "--device", "cpu"],
                           capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert r.returncode == 4, r.stderr
        assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert words in r.stderr, r.stderr
        assert not out.exists()


# --- the online Hub path (in process, against the stand-in Hub of tests/hubserver.py) -------------

@pytest.fixture
def online(tmp_path, monkeypatch):
    """A started FakeHub that huggingface_hub (already imported) talks to, with an empty cache."""
    from huggingface_hub import constants

    from tests.hubserver import FakeHub

    with FakeHub(lifetime=120) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "online-cache"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
        yield hub


def test_online_hub_copies_what_a_local_folder_copies(online, tmp_path) -> None:
    """snapshot_download's ignore patterns plus copy_rule give the local folder's list exactly."""
    src = tmp_path / "src"
    want = tricky_folder(src)
    online.add("tiny-org/tricky", src, "ab" * 20)
    hub = open_source("tiny-org/tricky")
    got = {p.relative_to(hub.root).as_posix() for p in hub.other_files()}
    assert got == want
    fetched = {r.file for r in online.requests(method="GET") if r.file}
    assert not {f for f in fetched if f.endswith((".bin", ".msgpack", ".onnx", ".h5", ".gguf", ".pth"))}
    assert "onnx/config.json" not in fetched and not any(f.startswith(".git/") for f in fetched)


def test_online_malformed_shard_refused_from_its_header(online, tmp_path) -> None:
    """The range-read header goes through the same validation; no shard is downloaded to find out."""
    src = tmp_path / "src"
    ck.llama(src, layers=1)
    shard = src / "model-00002-of-00003.safetensors"
    start, h = ck.header(shard)
    names = [k for k in h if k != "__metadata__"]
    h[names[1]]["data_offsets"] = [0, h[names[1]]["data_offsets"][1] - h[names[1]]["data_offsets"][0]]  # overlap
    raw = json.dumps(h, separators=(",", ":")).encode()
    raw += b" " * (start - 8 - len(raw))
    assert len(raw) == start - 8
    data = shard.read_bytes()
    shard.write_bytes(data[:8] + raw + data[start:])
    online.add("tiny-org/broken", src, "cd" * 20)
    s = open_source("tiny-org/broken")
    with pytest.raises(CheckpointFormatError) as e:
        s.tensors()
    one_line_error(e, "model-00002-of-00003.safetensors", "overlaps")
    assert online.full_gets("model-00002-of-00003.safetensors") == 0


def test_the_snapshot_path_hf_download_prints_is_a_source(hub, tmp_path) -> None:
    """``hf download`` prints .../models--org--name/snapshots/<commit>, whose files link into ../../blobs:
    read as a local folder, contained to that repo's cache folder; the card names the repo."""
    snap = hub["cache"] / ("models--" + REPO.replace("/", "--")) / "snapshots" / COMMIT_A
    out = tmp_path / "out"
    convert(str(snap), out, ConvertConfig(device="cpu", max_shard_size=6000))
    local = tmp_path / "local"
    convert(str(hub["a"]), local, ConvertConfig(device="cpu", max_shard_size=6000))
    got, want = ck.all_files(out), ck.all_files(local)
    assert {k: v for k, v in got.items() if k.endswith(".safetensors")} == \
        {k: v for k, v in want.items() if k.endswith(".safetensors")}
    from fp4convert.output.card import split_card

    assert split_card((out / "README.md").read_text())[0]["base_model"] == REPO
    # Still contained: a snapshot entry linking out of the repo's cache folder is refused.
    other = tmp_path / "cache" / "models--o--m"
    snap2 = other / "snapshots" / COMMIT_A
    shutil.copytree(snap, snap2, symlinks=False)
    (other / "blobs").mkdir()
    (snap2 / "model.safetensors.index.json").unlink()
    (snap2 / "model.safetensors.index.json").symlink_to(snap / "model.safetensors.index.json")
    with pytest.raises(OutsideSourceError, match="repo id"):
        open_source(str(snap2))
