"""Issue 12's matrix, destination and run side: every bad situation gets one line, its exit code, a DST
in a known state and an untouched SRC (the input side, malformed files and indexes, is in
tests/storage/test_safetensors_io.py and tests/source/test_source.py).

One test per case (the ids name them). Each case runs the command line, asserts the exit code, a
single ``Error:`` line with no traceback, and what DST holds afterwards; the wrapper asserts that the
shared source folder is byte-for-byte unchanged. Cases that need a real process (a kill, a signal, a
file-size limit, two runs at once) use the ``cli_procs`` fixture.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pathlib
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import fp4convert.run.work as work
from fp4convert.cli.main import main
from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert
from fp4convert.output.shards import ShardFile

from tests import checkpoints as ck

ARGS = ("--device", "cpu", "--max-shard-size", "6KB", "-q")
# Cases that stop a run part-way need it to take many steps: the torch `cpu` backend quantizes this small
# model unit by unit, while the default `cpu-native` takes it in one 64 MB batch (one quantize step, one
# write job). The runs after the stop (resume, overwrite) use the default backend: the bytes are the same.
UNIT_BY_UNIT = ("--backend", "cpu")
PROGRESS, MANIFEST, LOCK = ".fp4convert-progress.json", "fp4convert.json", ".fp4convert.lock"
ROOT = os.geteuid() == 0


@dataclass
class Ctx:
    tmp: Path
    src: Path
    ref: Path
    mp: pytest.MonkeyPatch
    request: pytest.FixtureRequest

    @property
    def procs(self):
        return self.request.getfixturevalue("cli_procs")

    def copy_src(self) -> Path:
        p = self.tmp / "src_copy"
        shutil.copytree(self.src, p)
        return p


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def quantize(c: Ctx, dst: Path, *extra, src: Path | None = None):
    return run("quantize", src or c.src, dst, *ARGS, *extra)


def one_line(text: str, code: int, *words: str) -> str:
    assert "Traceback" not in text, text
    errors = [ln for ln in text.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, text
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


def expect(r, code: int, *words: str) -> str:
    assert r.exit_code == code, (r.exit_code, r.output)
    if code == 0:
        assert "Error:" not in r.output and "Traceback" not in r.output, r.output
        return ""
    return one_line(r.stderr, code, *words)


def interrupted(c: Ctx, dst: Path, *extra, src: Path | None = None) -> None:
    """An in-process run stopped by Ctrl-C once a shard is finished: exit 130, DST resumable."""
    real = work.quantize
    calls: list[int] = []

    def stop(*a, **k):
        calls.append(1)
        if len(calls) == 4:  # (6 KB shards: the first ones are handed to the writer by now; under load the
            deadline = time.monotonic() + 30  # quantize calls can outrun it, and the run would end unstopped)
            while not list(dst.glob("*.safetensors")) and time.monotonic() < deadline:
                time.sleep(0.01)
        if list(dst.glob("*.safetensors")):
            raise KeyboardInterrupt
        return real(*a, **k)

    with c.mp.context() as m:
        m.setattr(work, "quantize", stop)
        expect(quantize(c, dst, *extra, *UNIT_BY_UNIT, src=src), 130, "interrupted", "--resume")
    assert (dst / PROGRESS).exists() and not (dst / MANIFEST).exists()


def finished(c: Ctx, dst: Path, *extra) -> None:
    expect(quantize(c, dst, *extra), 0)


def same_as_ref(c: Ctx, dst: Path) -> None:
    assert ck.all_files(dst) == ck.all_files(c.ref)


def resume_completes(c: Ctx, dst: Path) -> None:
    expect(quantize(c, dst, "--resume"), 0)
    same_as_ref(c, dst)


def oserror(code: int, path: Path | str | None = None) -> OSError:
    return OSError(code, os.strerror(code), None if path is None else str(path))


CASES: dict[str, Callable[[Ctx], None]] = {}


def case(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    CASES[fn.__name__] = fn
    return fn


# --- containment: where DST may be --------------------------------------------------------------

@case
def dst_inside_src(c: Ctx) -> None:
    dst = c.src / "out"
    expect(quantize(c, dst), 5, "inside the source folder")
    assert not dst.exists()


@case
def dst_deep_inside_src(c: Ctx) -> None:
    expect(quantize(c, c.src / "special" / "a" / "b"), 5, "inside the source folder")
    assert not (c.src / "special" / "a").exists()


@case
def dst_is_src(c: Ctx) -> None:
    expect(quantize(c, c.src, "--overwrite"), 5, "is the source folder")


@case
def src_inside_dst(c: Ctx) -> None:
    outer = c.tmp / "outer"
    src = outer / "model"
    shutil.copytree(c.src, src)
    before = ck.tree(outer)
    expect(quantize(c, outer, "--overwrite", src=src), 5, "inside the destination")
    assert ck.tree(outer) == before


@case
def dst_symlink_into_src(c: Ctx) -> None:
    link = c.tmp / "link"
    link.symlink_to(c.src / "special", target_is_directory=True)
    expect(quantize(c, link, "--overwrite"), 5, "inside the source folder")


@case
def dst_parent_symlink_into_src(c: Ctx) -> None:
    link = c.tmp / "link"
    link.symlink_to(c.src, target_is_directory=True)
    expect(quantize(c, link / "out"), 5, "inside the source folder")
    assert not (c.src / "out").exists()


@case
def dst_is_a_file(c: Ctx) -> None:
    f = c.tmp / "afile"
    f.write_text("keep")
    r = quantize(c, f)
    assert r.exit_code == 2 and "Traceback" not in r.output  # click: DST must be a folder path
    assert f.read_text() == "keep"


@case
def dst_parent_is_a_file(c: Ctx) -> None:
    f = c.tmp / "afile"
    f.write_text("keep")
    expect(quantize(c, f / "out"), 5, "is a file, not a folder")
    assert f.read_text() == "keep"


@case
def dst_dangling_symlink(c: Ctx) -> None:
    link = c.tmp / "dangling"
    link.symlink_to(c.tmp / "nowhere")
    expect(quantize(c, link), 5, "symlink", "does not exist")
    assert link.is_symlink() and not (c.tmp / "nowhere").exists()


@case
def dst_symlink_to_empty_folder(c: Ctx) -> None:
    (c.tmp / "real").mkdir()
    link = c.tmp / "link"
    link.symlink_to(c.tmp / "real", target_is_directory=True)
    finished(c, link)
    assert ck.all_files(c.tmp / "real") == ck.all_files(c.ref)


@case
def dst_parent_permission_denied(c: Ctx) -> None:
    parent = c.tmp / "ro"
    parent.mkdir()
    dst = parent / "out"
    if ROOT:  # root ignores modes: simulate the refusal where it happens
        real = pathlib.Path.mkdir

        def mkdir(self, *a, **k):
            if self == dst:
                raise PermissionError(errno.EACCES, "Permission denied", str(self))
            return real(self, *a, **k)

        c.mp.setattr(pathlib.Path, "mkdir", mkdir)
    else:
        parent.chmod(0o555)
    try:
        expect(quantize(c, dst), 5, "Permission denied", "choose a folder you can write to")
    finally:
        parent.chmod(0o755)
    assert not dst.exists()


@case
def dst_not_writable(c: Ctx) -> None:
    dst = c.tmp / "ro"
    dst.mkdir()
    if ROOT:
        real = os.open

        def deny(path, *a, **k):
            if str(path).startswith(str(dst)):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, *a, **k)

        c.mp.setattr(os, "open", deny)
    else:
        dst.chmod(0o555)
    try:
        expect(quantize(c, dst), 5, "Permission denied")
    finally:
        dst.chmod(0o755)
    assert list(dst.iterdir()) == []


@case
def dst_not_empty_without_flags(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    expect(quantize(c, dst), 5, "not empty", "--overwrite", "--resume")
    assert ck.tree(dst) == {"notes.txt": ck.tree(dst)["notes.txt"]}


@case
def finished_dst_without_flags(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    before = ck.tree(dst)
    expect(quantize(c, dst), 5, "not empty")
    assert ck.tree(dst) == before


# --- --overwrite removes only what this tool wrote ---------------------------------------------

@case
def overwrite_keeps_user_lora(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    (dst / "my_lora.safetensors").write_bytes(b"user weights")
    before = ck.tree(dst)
    expect(quantize(c, dst, "--overwrite"), 5, "did not write", "my_lora.safetensors", "remove them")
    assert ck.tree(dst) == before


@case
def overwrite_user_safetensors_no_manifest(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"someone's model")
    (dst / "adapter.safetensors").write_bytes(b"x")
    expect(quantize(c, dst, "--overwrite"), 5, "adapter.safetensors", "model.safetensors")
    assert (dst / "model.safetensors").read_bytes() == b"someone's model"


@case
def overwrite_keeps_unrelated_user_file(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    finished(c, dst, "--overwrite", "--scheme", "mxfp4")
    finished(c, dst, "--overwrite")
    assert (dst / "notes.txt").read_text() == "mine"
    files = ck.all_files(dst)
    del files["notes.txt"]
    assert files == ck.all_files(c.ref)


@case
def overwrite_user_config_collides(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "config.json").write_text('{"mine": true}')
    expect(quantize(c, dst, "--overwrite"), 5, "config.json")
    assert (dst / "config.json").read_text() == '{"mine": true}'


@case
def overwrite_foreign_manifest(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "my_lora.safetensors").write_bytes(b"user weights")
    foreign = {"producer": {"name": "sometool"}, "files": {"my_lora.safetensors": {"sha256": "0" * 64, "size": 12}}}
    (dst / MANIFEST).write_text(json.dumps(foreign))
    before = ck.tree(dst)
    expect(quantize(c, dst, "--overwrite"), 5, "my_lora.safetensors")
    assert ck.tree(dst) == before


@case
def overwrite_edited_manifest_lists_user_weights(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    (dst / "my_lora.safetensors").write_bytes(b"user weights")
    m = json.loads((dst / MANIFEST).read_text())
    m["files"]["my_lora.safetensors"] = {"sha256": "0" * 64, "size": 12}
    (dst / MANIFEST).write_text(json.dumps(m))
    expect(quantize(c, dst, "--overwrite"), 5, "my_lora.safetensors")
    assert (dst / "my_lora.safetensors").read_bytes() == b"user weights"


@case
def overwrite_edited_manifest_lists_user_note(c: Ctx) -> None:
    """A listed file whose bytes are not what the manifest records is not ours: kept (it is in no one's way)."""
    dst = c.tmp / "q"
    finished(c, dst)
    (dst / "notes.txt").write_text("mine")
    m = json.loads((dst / MANIFEST).read_text())
    m["files"]["notes.txt"] = {"sha256": "0" * 64, "size": 4}
    (dst / MANIFEST).write_text(json.dumps(m))
    finished(c, dst, "--overwrite")
    assert (dst / "notes.txt").read_text() == "mine"


@case
def overwrite_manifest_path_escape(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    outside = c.tmp / "outside.txt"
    outside.write_text("precious")
    m = json.loads((dst / MANIFEST).read_text())
    m["files"]["../outside.txt"] = {"sha256": "0" * 64, "size": 8}
    (dst / MANIFEST).write_text(json.dumps(m))
    expect(quantize(c, dst, "--overwrite"), 5, MANIFEST)
    assert outside.read_text() == "precious"


@case
def overwrite_truncated_manifest(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    raw = (dst / MANIFEST).read_bytes()
    (dst / MANIFEST).write_bytes(raw[: len(raw) // 2])
    before = ck.tree(dst)
    expect(quantize(c, dst, "--overwrite"), 5, "not valid JSON", "did not write")
    assert ck.tree(dst) == before


@case
def overwrite_truncated_progress(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    raw = (dst / PROGRESS).read_bytes()
    (dst / PROGRESS).write_bytes(raw[:40])
    before = ck.tree(dst)
    expect(quantize(c, dst, "--overwrite"), 5, PROGRESS, "not valid JSON")
    assert ck.tree(dst) == before


@case
def overwrite_after_interruption(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    finished(c, dst, "--overwrite")
    same_as_ref(c, dst)


@case
def overwrite_folder_where_shard_goes(c: Ctx) -> None:
    dst = c.tmp / "q"
    (dst / "model-00001-of-00016.safetensors").mkdir(parents=True)
    expect(quantize(c, dst, "--overwrite"), 5, "model-00001-of-00016.safetensors")
    assert (dst / "model-00001-of-00016.safetensors").is_dir()


@case
def resume_folder_where_shard_goes(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    for p in dst.glob("*.safetensors"):
        p.unlink()
    (dst / "model-00001-of-00016.safetensors").mkdir()
    expect(quantize(c, dst, "--resume"), 5, "model-00001-of-00016.safetensors")


@case
def overwrite_folder_where_copied_file_goes(c: Ctx) -> None:
    dst = c.tmp / "q"
    (dst / "README.md").mkdir(parents=True)
    expect(quantize(c, dst, "--overwrite"), 5, "README.md")


@case
def overwrite_file_where_subfolder_goes(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "special").write_text("a file, not a folder")
    expect(quantize(c, dst, "--overwrite"), 5, "special")
    assert (dst / "special").read_text() == "a file, not a folder"


@case
def overwrite_symlink_where_shard_goes(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    target = c.tmp / "precious.bin"
    target.write_bytes(b"precious")
    (dst / "model-00001-of-00016.safetensors").symlink_to(target)
    expect(quantize(c, dst, "--overwrite"), 5, "model-00001-of-00016.safetensors")
    assert target.read_bytes() == b"precious"


# --- --resume -----------------------------------------------------------------------------------

@case
def resume_truncated_progress(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    (dst / PROGRESS).write_text('{"identity": {"settings"')
    before = ck.tree(dst)
    expect(quantize(c, dst, "--resume"), 5, PROGRESS, "not valid JSON")
    assert ck.tree(dst) == before


@case
def resume_progress_not_an_object(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    (dst / PROGRESS).write_text("[1, 2, 3]")
    expect(quantize(c, dst, "--resume"), 5, PROGRESS, "not an fp4convert progress record")


@case
def resume_progress_bad_file_record(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    state = json.loads((dst / PROGRESS).read_text())
    state["files"] = {f: "sha" for f in state["files"]}
    (dst / PROGRESS).write_text(json.dumps(state))
    expect(quantize(c, dst, "--resume"), 5, PROGRESS, "malformed")


@case
def resume_truncated_manifest(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    (dst / MANIFEST).write_text('{"manifest_version": 1, "fil')
    expect(quantize(c, dst, "--resume"), 5, MANIFEST, "not valid JSON")


@case
def resume_manifest_files_a_list(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    m = json.loads((dst / MANIFEST).read_text())
    m["files"] = list(m["files"])
    (dst / MANIFEST).write_text(json.dumps(m))
    expect(quantize(c, dst, "--resume"), 5, MANIFEST, "'files'")


@case
def resume_other_scheme_names_both_values(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    expect(quantize(c, dst, "--resume", "--scheme", "mxfp4"), 5, "other settings", "scheme was 'nvfp4', now 'mxfp4'")


@case
def resume_other_shard_size_names_both_values(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    expect(run("quantize", c.src, dst, "--device", "cpu", "--max-shard-size", "7KB", "-q", "--resume"), 5,
           "max_shard_size was 6000, now 7000")


@case
def resume_other_ignore(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    expect(quantize(c, dst, "--resume", "--ignore", "lm_head"), 5, "ignore was [], now ['lm_head']")


def _change_values(shard: Path, keep_mtime: bool) -> None:
    """Same header, other values (every tensor reversed), optionally with the old modification time."""
    st = shard.stat()
    tensors = {k: v.flip(0).contiguous() for k, v in load_file(shard).items()}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    if keep_mtime:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


@case
def resume_source_values_changed_same_header(c: Ctx) -> None:
    src = c.copy_src()
    dst = c.tmp / "q"
    interrupted(c, dst, src=src)
    _change_values(src / "model-00001-of-00003.safetensors", keep_mtime=True)
    before = ck.tree(dst)
    expect(quantize(c, dst, "--resume", src=src), 5, "another source", "model-00001-of-00003.safetensors",
           "sampled content")
    assert ck.tree(dst) == before


@case
def resume_finished_dst_source_values_changed(c: Ctx) -> None:
    src = c.copy_src()
    dst = c.tmp / "q"
    expect(quantize(c, dst, src=src), 0)
    _change_values(src / "model-00003-of-00003.safetensors", keep_mtime=True)
    expect(quantize(c, dst, "--resume", src=src), 5, "model-00003-of-00003.safetensors")


@case
def resume_source_touched(c: Ctx) -> None:
    src = c.copy_src()
    dst = c.tmp / "q"
    interrupted(c, dst, src=src)
    os.utime(src / "model-00002-of-00003.safetensors", ns=(1, 1))
    expect(quantize(c, dst, "--resume", src=src), 5, "model-00002-of-00003.safetensors", "modified since",
           "--verify-source")


@case
def resume_source_touched_verify_source(c: Ctx) -> None:
    src = c.copy_src()
    dst = c.tmp / "q"
    interrupted(c, dst, "--verify-source", src=src)
    os.utime(src / "model-00002-of-00003.safetensors", ns=(1, 1))  # same bytes: full hashes say so
    expect(quantize(c, dst, "--resume", "--verify-source", src=src), 0)
    expected = ck.all_files(c.ref)
    got = ck.all_files(dst)
    m_got, m_ref = json.loads(got.pop(MANIFEST)), json.loads(expected.pop(MANIFEST))
    # The model card names the source folder (a copy here): equal but for that name.
    cards = [d.pop("README.md").replace(m["source"]["path"].encode(), b"SRC") for d, m in ((got, m_got), (expected, m_ref))]
    assert got == expected and cards[0] == cards[1]
    assert m_got["identity"]["source"]["files"] == m_ref["identity"]["source"]["files"]


@case
def resume_verify_source_without_recorded_hashes(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    expect(quantize(c, dst, "--resume", "--verify-source"), 5, "no full source hashes", "--overwrite")


@case
def resume_verify_source_values_changed(c: Ctx) -> None:
    src = c.copy_src()
    dst = c.tmp / "q"
    interrupted(c, dst, "--verify-source", src=src)
    _change_values(src / "model-00002-of-00003.safetensors", keep_mtime=True)
    expect(quantize(c, dst, "--resume", "--verify-source", src=src), 5, "model-00002-of-00003.safetensors")


@case
def resume_source_shard_removed(c: Ctx) -> None:
    src = c.tmp / "src_one"
    ck.llama(src, zoo=True)
    dst = c.tmp / "q"
    interrupted(c, dst, src=src)
    ck.llama(src, zoo=True, single=True)
    for f in src.glob("model-0000*"):
        f.unlink()
    (src / "model.safetensors.index.json").unlink()
    expect(quantize(c, dst, "--resume", src=src), 5, "another source", "weight files")


@case
def resume_user_safetensors_no_record(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "my_lora.safetensors").write_bytes(b"x")
    expect(quantize(c, dst, "--resume"), 5, "my_lora.safetensors", "did not write")


@case
def resume_after_interruption(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    resume_completes(c, dst)


@case
def resume_recorded_shard_not_yet_renamed(c: Ctx) -> None:
    """Killed between 'finishing X (sha256)' in the record and X's rename: --resume takes X.partial."""
    dst = c.tmp / "q"
    interrupted(c, dst)
    state = json.loads((dst / PROGRESS).read_text())
    last = sorted(state["files"])[-1]
    os.replace(dst / last, dst / (last + ".partial"))
    r = quantize(c, dst, "--resume")
    expect(r, 0)
    same_as_ref(c, dst)


@case
def resume_into_missing_dst(c: Ctx) -> None:
    resume_completes(c, c.tmp / "new")


# --- disk full, file-size limit, other OS errors during the run --------------------------------

@case
def disk_full_precheck(c: Ctx) -> None:
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    c.mp.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    dst = c.tmp / "q"
    line = expect(quantize(c, dst), 5, "KB for the output, only 1.00 KB free")
    assert "0.00 GB" not in line and not dst.exists()


@case
def disk_full_precheck_counts_headers_and_files(c: Ctx) -> None:
    from collections import namedtuple

    ref_bytes = sum(len(b) for b in ck.all_files(c.ref).values())
    usage = namedtuple("usage", "total used free")
    c.mp.setattr(shutil, "disk_usage", lambda p: usage(10**9, 0, ref_bytes))  # enough for the tensors alone
    expect(quantize(c, c.tmp / "q"), 5, "free")


@case
def disk_full_mid_shard_then_resume(c: Ctx) -> None:
    dst = c.tmp / "q"
    real = ShardFile.write

    def full(self, name, data, at=0):
        if self.name == "model-00004-of-00016.safetensors":
            raise oserror(errno.ENOSPC)
        return real(self, name, data, at)

    with c.mp.context() as m:
        m.setattr(ShardFile, "write", full)
        expect(quantize(c, dst, *UNIT_BY_UNIT), 5, "no space left", "model-00004-of-00016.safetensors", "--resume")
    assert not list(dst.glob("*.partial")) and (dst / PROGRESS).exists()
    # The shards before the full one were all written when its first write failed (writes start in plan
    # order): they are finished; a later one may be too (its writes ran beside the failing one).
    finished = sorted(p.name for p in dst.glob("*.safetensors"))
    assert finished[:3] == [f"model-0000{i}-of-00016.safetensors" for i in (1, 2, 3)]
    assert "model-00004-of-00016.safetensors" not in finished
    resume_completes(c, dst)


@case
def disk_full_first_shard_leaves_nothing(c: Ctx) -> None:
    dst = c.tmp / "q"
    c.mp.setattr(ShardFile, "write", lambda self, name, data, at=0: (_ for _ in ()).throw(oserror(errno.ENOSPC)))
    expect(quantize(c, dst), 5, "no space left")
    assert not dst.exists()  # created by the run, left empty: removed


@case
def disk_full_keeps_preexisting_empty_dst(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    c.mp.setattr(ShardFile, "write", lambda self, name, data, at=0: (_ for _ in ()).throw(oserror(errno.ENOSPC)))
    expect(quantize(c, dst), 5, "no space left")
    assert dst.is_dir() and list(dst.iterdir()) == []


@case
def disk_full_writing_progress_then_resume(c: Ctx) -> None:
    import fp4convert.output.record as record

    dst = c.tmp / "q"
    real = record.atomic_write
    calls = {"n": 0}

    def full(path, text):
        calls["n"] += 1
        if calls["n"] == 5:
            raise oserror(errno.ENOSPC, str(path) + ".partial")
        return real(path, text)

    with c.mp.context() as m:
        m.setattr(record, "atomic_write", full)
        expect(quantize(c, dst, *UNIT_BY_UNIT), 5, "no space left", PROGRESS)
    assert not (dst / (PROGRESS + ".partial")).exists()
    resume_completes(c, dst)


@case
def disk_full_copying_other_files_then_resume(c: Ctx) -> None:
    import fp4convert.output.files as files
    import fp4convert.output.finish as finish

    dst = c.tmp / "q"
    real = finish._copy_file

    def full(src, target, *rest):
        if target.name.startswith("tokenizer"):
            raise files.output_error(oserror(errno.ENOSPC), target)
        return real(src, target, *rest)

    with c.mp.context() as m:
        m.setattr(finish, "_copy_file", full)
        expect(quantize(c, dst), 5, "no space left", "tokenizer")
    assert not (dst / MANIFEST).exists() and (dst / PROGRESS).exists()
    resume_completes(c, dst)


@case
def disk_quota_exceeded(c: Ctx) -> None:
    c.mp.setattr(ShardFile, "write", lambda self, name, data, at=0: (_ for _ in ()).throw(oserror(errno.EDQUOT)))
    expect(quantize(c, c.tmp / "q"), 5, "no space left", "EDQUOT")


@case
def file_size_limit_real_process(c: Ctx) -> None:
    """ulimit -f in a real process: EFBIG (SIGXFSZ is ignored by Python) at the ~20 KB manifest, the largest
    file (the shards are <= 12.5 KB); then --resume."""
    dst = c.tmp / "q"
    code, log = c.procs.run("quantize", c.src, dst, *ARGS, fsize=16_000)
    assert code == 5, log
    one_line(log, 5, "file too large", "ulimit -f")
    assert (dst / PROGRESS).exists() and not (dst / MANIFEST).exists()
    resume_completes(c, dst)


@case
def rename_across_filesystems(c: Ctx) -> None:
    real = os.replace

    def exdev(a, b, *k, **kw):
        if str(b).endswith(".safetensors"):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(a), None, str(b))
        return real(a, b, *k, **kw)

    c.mp.setattr(os, "replace", exdev)
    expect(quantize(c, c.tmp / "q"), 5, "EXDEV")


@case
def io_error_writing_shard(c: Ctx) -> None:
    c.mp.setattr(ShardFile, "write", lambda self, name, data, at=0: (_ for _ in ()).throw(oserror(errno.EIO)))
    expect(quantize(c, c.tmp / "q"), 5, "Input/output error", "EIO")


@case
def io_error_reading_source(c: Ctx) -> None:
    import fp4convert.storage.reads as sio

    bad = c.src / "model-00002-of-00003.safetensors"
    real = sio.read_many

    def eio(items, threads=1):
        for path, _, _ in items:
            if Path(path) == bad:
                raise oserror(errno.EIO, path)
        return real(items, threads)

    c.mp.setattr(sio, "read_many", eio)
    dst = c.tmp / "q"
    expect(quantize(c, dst), 4, "model-00002-of-00003.safetensors", "cannot read")


@case
def source_unreadable_while_copying(c: Ctx) -> None:
    real_open = os.open

    def deny(path, *a, **k):  # only the writer's open of a kept tensor's source file (the reader's still works)
        if sys._getframe(1).f_globals.get("__name__") == "fp4convert.output.shards" \
                and str(path).endswith("model-00003-of-00003.safetensors") and Path(path).is_relative_to(c.src):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **k)

    c.mp.setattr(os, "open", deny)
    expect(quantize(c, c.tmp / "q"), 4, "model-00003-of-00003.safetensors", "Permission denied")


@case
def user_partial_file_survives_a_failed_finish(c: Ctx) -> None:
    import fp4convert.output.files as files
    import fp4convert.output.finish as finish

    dst = c.tmp / "q"
    dst.mkdir()
    (dst / "draft.partial").write_text("mine")
    with c.mp.context() as m:
        full = files.output_error(oserror(errno.ENOSPC), dst / "README.md")
        m.setattr(finish, "_copy_file", lambda *a: (_ for _ in ()).throw(full))
        expect(quantize(c, dst, "--overwrite"), 5, "no space left")
    assert (dst / "draft.partial").read_text() == "mine"


@case
def killed_between_manifest_and_record_removal(c: Ctx) -> None:
    dst = c.tmp / "q"
    finished(c, dst)
    state = {"identity": json.loads((dst / MANIFEST).read_text())["identity"], "files": {}, "tensors": {}}
    (dst / PROGRESS).write_text(json.dumps(state))  # identity without the record-only keys: mtimes unknown
    resume_completes(c, dst)


@case
def lock_path_is_a_folder(c: Ctx) -> None:
    dst = c.tmp / "q"
    (dst / LOCK).mkdir(parents=True)
    expect(quantize(c, dst, "--resume"), 5, LOCK)


@case
def progress_record_is_a_folder(c: Ctx) -> None:
    dst = c.tmp / "q"
    (dst / PROGRESS).mkdir(parents=True)
    expect(quantize(c, dst, "--resume"), 5, PROGRESS, "not a file")


@case
def read_only_filesystem(c: Ctx) -> None:
    c.mp.setattr(ShardFile, "__init__", lambda self, dst, name, *a, **k: (_ for _ in ()).throw(
        OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst / name) + ".partial")))
    expect(quantize(c, c.tmp / "q"), 5, "Read-only file system", "choose a folder you can write to")


@case
def disk_full_creating_the_lock(c: Ctx) -> None:
    real = os.open

    def full(path, *a, **k):
        if str(path).endswith(LOCK):
            raise oserror(errno.ENOSPC, path)
        return real(path, *a, **k)

    c.mp.setattr(os, "open", full)
    dst = c.tmp / "q"
    expect(quantize(c, dst), 5, "no space left", LOCK)
    assert not dst.exists()


# --- locking ----------------------------------------------------------------------------------

@case
def lock_held_by_another_process(c: Ctx) -> None:
    dst = c.tmp / "q"
    dst.mkdir()
    fd = os.open(dst / LOCK, os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        expect(quantize(c, dst, "--resume"), 5, "in use by another fp4convert run", "pid 4242")
        assert sorted(p.name for p in dst.iterdir()) == [LOCK]
    finally:
        os.close(fd)
    resume_completes(c, dst)


@case
def stale_lock_file_from_a_killed_run(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    (dst / LOCK).write_text("999999\n")  # its holder is gone: the kernel released the flock
    resume_completes(c, dst)


@case
def two_concurrent_runs(c: Ctx) -> None:
    dst = c.tmp / "q"
    slow = {"FP4CONVERT_TEST_DELAY": "0.02"}
    first, _ = c.procs.start("quantize", c.src, dst, *ARGS, *UNIT_BY_UNIT, env=slow)
    deadline = time.monotonic() + 30
    while not (dst / PROGRESS).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    code, log = c.procs.run("quantize", c.src, dst, "--resume", *ARGS)
    assert code == 5, log
    one_line(log, 5, "in use by another fp4convert run", f"pid {first}")
    assert c.procs.wait(first) == 0
    same_as_ref(c, dst)


# --- interruption and the error boundary --------------------------------------------------------

@case
def ctrl_c_in_process(c: Ctx) -> None:
    dst = c.tmp / "q"
    interrupted(c, dst)
    assert not list(dst.glob("*.partial")) and not (dst / LOCK).exists()


def _signal_real_process_then_resume(c: Ctx, sig: int) -> None:
    """A real converter process, signalled after its second shard: exit 130, one line, resumable."""
    dst = c.tmp / "q"
    pid, log = c.procs.start("quantize", c.src, dst, *ARGS, env={"FP4CONVERT_TEST_DELAY": "0.02"})
    deadline = time.monotonic() + 30
    while len(list(dst.glob("*.safetensors"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(pid, sig)
    assert c.procs.wait(pid) == 130
    one_line(log.read_text(), 130, "interrupted", "--resume")
    resume_completes(c, dst)


@case
def ctrl_c_real_process_then_resume(c: Ctx) -> None:
    _signal_real_process_then_resume(c, signal.SIGINT)


@case
def ctrl_c_at_the_first_quantized_tensor(c: Ctx) -> None:
    dst = c.tmp / "q"
    with c.mp.context() as m:
        m.setattr(work, "quantize", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        expect(quantize(c, dst), 130, "interrupted", "--resume")
    assert not list(dst.glob("*.partial")) and not (dst / LOCK).exists()
    resume_completes(c, dst)


@case
def ctrl_c_while_checking_the_destination(c: Ctx) -> None:
    import fp4convert.output.destination as destination

    dst = c.tmp / "q"
    c.mp.setattr(destination, "_check_space", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    expect(quantize(c, dst), 130, "interrupted")
    assert not dst.exists()


@case
def ctrl_c_while_finishing(c: Ctx) -> None:
    import fp4convert.output.finish as finish

    dst = c.tmp / "q"
    real = finish._copy_file
    with c.mp.context() as m:
        m.setattr(finish, "_copy_file", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        expect(quantize(c, dst), 130, "interrupted", "--resume")
    assert not list(dst.rglob("*.partial")) and real
    resume_completes(c, dst)


@case
def sigterm_real_process_then_resume(c: Ctx) -> None:
    _signal_real_process_then_resume(c, signal.SIGTERM)


@case
def internal_error_one_line(c: Ctx) -> None:
    c.mp.setattr(work, "quantize", lambda *a, **k: (_ for _ in ()).throw(ZeroDivisionError("boom")))
    expect(quantize(c, c.tmp / "q"), 1, "internal error", "ZeroDivisionError", "--debug")


@case
def debug_shows_the_traceback(c: Ctx) -> None:
    c.mp.setattr(work, "quantize", lambda *a, **k: (_ for _ in ()).throw(ZeroDivisionError("boom")))
    r = quantize(c, c.tmp / "q", "--debug")
    assert r.exit_code == 1 and "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr


@case
def debug_with_a_library_error(c: Ctx) -> None:
    r = quantize(c, c.src / "out", "--debug")
    assert r.exit_code == 5 and "Traceback" in r.stderr and "Error: " in r.stderr


# --- failed runs leave no trace; NaN in kept tensors ---------------------------------------------

@case
def failed_run_removes_the_dst_it_created(c: Ctx) -> None:
    src = c.tmp / "nan"
    bad = ck.nan_checkpoint(src)
    dst = c.tmp / "new" / "deeper" / "q"
    expect(run("quantize", src, dst, "--device", "cpu", "-q"), 3, bad, "NaN")
    assert not (c.tmp / "new").exists()


@case
def failed_run_keeps_a_preexisting_empty_dst(c: Ctx) -> None:
    src = c.tmp / "nan"
    ck.nan_checkpoint(src)
    dst = c.tmp / "q"
    dst.mkdir()
    expect(run("quantize", src, dst, "--device", "cpu", "-q"), 3)
    assert dst.is_dir() and list(dst.iterdir()) == []


@case
def nan_in_a_kept_tensor_is_a_warning(c: Ctx) -> None:
    src = c.tmp / "nan"
    bad = ck.nan_checkpoint(src, "model.layers.0.mlp.down_proj.weight")
    dst = c.tmp / "q"
    r = run("quantize", src, dst, "--device", "cpu", "--ignore", "*.down_proj", "--json")
    assert r.exit_code == 0, r.output
    assert any(bad in w and "NaN or Inf" in w for w in json.loads(r.stdout)["warnings"])
    assert json.loads((dst / MANIFEST).read_text())["tensors"][bad]["nonfinite"] is True
    r = run("quantize", src, c.tmp / "q2", "--device", "cpu", "--ignore", "*.down_proj")
    assert r.exit_code == 0 and f"warning: {bad}" in r.stderr


@case
def inf_in_a_kept_norm_is_a_warning(c: Ctx) -> None:
    src = c.tmp / "inf"
    t = ck.llama(src, layers=1, single=True)
    t["model.norm.weight"][0] = float("inf")
    save_file({k: v.contiguous() for k, v in t.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    r = run("quantize", src, c.tmp / "q", "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    assert [w for w in json.loads(r.stdout)["warnings"] if "model.norm.weight" in w]


# --- export ------------------------------------------------------------------------------------

def _native(c: Ctx) -> Path:
    dst = c.tmp / "native"
    shutil.copytree(c.ref, dst)
    return dst


@case
def export_corrupted_native_shard(c: Ctx) -> None:
    native = _native(c)
    shard = native / "model-00002-of-00016.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x40
    shard.write_bytes(bytes(raw))
    out = c.tmp / "ct"
    expect(run("export", native, out, "--format", "compressed-tensors", "-q"), 4,
           "model-00002-of-00016.safetensors", "sha256 differs", "corrupted")
    assert not out.exists()


@case
def export_native_shard_grown(c: Ctx) -> None:
    native = _native(c)
    shard = native / "model-00005-of-00016.safetensors"
    shard.write_bytes(shard.read_bytes() + b"\0" * 8)  # the header still reads: only the size tells
    expect(run("export", native, c.tmp / "ct", "--format", "compressed-tensors", "-q"), 4,
           "model-00005-of-00016.safetensors")


@case
def export_shard_missing_from_manifest(c: Ctx) -> None:
    native = _native(c)
    m = json.loads((native / MANIFEST).read_text())
    del m["files"]["model-00003-of-00016.safetensors"]
    (native / MANIFEST).write_text(json.dumps(m))
    expect(run("export", native, c.tmp / "ct", "--format", "compressed-tensors", "-q"), 4,
           "model-00003-of-00016.safetensors", "not listed")


@case
def export_truncated_native_manifest(c: Ctx) -> None:
    native = _native(c)
    (native / MANIFEST).write_text('{"format": "fp4convert", "sch')
    expect(run("export", native, c.tmp / "ct", "--format", "compressed-tensors", "-q"), 4, MANIFEST, "not valid JSON")


@case
def export_manifest_tensors_malformed(c: Ctx) -> None:
    native = _native(c)
    m = json.loads((native / MANIFEST).read_text())
    next(iter(m["tensors"].values()))["shape"] = "big"
    (native / MANIFEST).write_text(json.dumps(m))
    expect(run("export", native, c.tmp / "ct", "--format", "compressed-tensors", "-q"), 4, MANIFEST, "malformed")


@case
def export_into_its_source(c: Ctx) -> None:
    native = _native(c)
    expect(run("export", native, native / "ct", "--format", "compressed-tensors", "-q"), 5, "inside the source")
    assert not (native / "ct").exists()


@case
def export_then_resume_after_interruption(c: Ctx) -> None:
    native = _native(c)
    import fp4convert.checkpoint.export as export_mod

    real = export_mod.load_quantized
    out = c.tmp / "ct"

    def stop(*a, **k):
        if list(out.glob("*.safetensors")):
            raise KeyboardInterrupt
        return real(*a, **k)

    with c.mp.context() as m:
        m.setattr(export_mod, "load_quantized", stop)
        expect(run("export", native, out, "--format", "compressed-tensors", "-q", "--max-shard-size", "6KB"), 130)
    expect(run("export", native, out, "--format", "compressed-tensors", "-q", "--max-shard-size", "6KB", "--resume"), 0)
    fresh = c.tmp / "ct2"
    expect(run("export", native, fresh, "--format", "compressed-tensors", "-q", "--max-shard-size", "6KB"), 0)
    assert ck.all_files(out) == ck.all_files(fresh)


# --- the test runner --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("llama")
    ck.llama(p, zoo=True)
    return p


@pytest.fixture(scope="module")
def ref(src, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("ref") / "q"
    convert(src, dst, ConvertConfig(device="cpu", max_shard_size=6000))
    return dst


@pytest.mark.parametrize("name", list(CASES))
def test_case(name, src, ref, tmp_path, monkeypatch, request) -> None:
    before = ck.tree(src)
    CASES[name](Ctx(tmp_path, src, ref, monkeypatch, request))
    monkeypatch.undo()
    assert ck.tree(src) == before, "the source folder changed"


def test_matrix_size() -> None:
    assert len(CASES) >= 90
