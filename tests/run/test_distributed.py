"""torchrun scale-out on the CPU: the same bytes as one process, a failing rank fails the run, resume
after a rank was killed. Every test runs real processes (torchrun, or ranks started by hand with
torchrun's environment when each rank's exit code and stderr matter)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fp4convert.config import ConvertConfig
from fp4convert.run.convert import convert, plan_conversion
from fp4convert.run.distributed import World, assign

from tests import checkpoints as ck
from tests import zoo

ROOT = Path(__file__).resolve().parents[2]
SHARD_BYTES = 6000  # small output shards: 12 for the Llama, so both ranks get several
SHARD = f"{SHARD_BYTES}B"  # the CLI needs a unit


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def torchrun(*args: str, script: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    target = [str(script)] if script else ["-m", "fp4convert"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *target, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)


def reference(src: Path, dst: Path, **kw) -> Path:
    convert(src, dst, ConvertConfig(device="cpu", max_shard_size=SHARD_BYTES, **kw))
    return dst


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("dist") / "llama"
    ck.llama(src, layers=3, zoo=True)
    return src


def test_assignment_is_a_deterministic_partition(llama) -> None:
    _, plan, _ = plan_conversion(str(llama), ConvertConfig(max_shard_size=SHARD_BYTES))
    shards = {f for f, _ in plan.shards}
    for size in (1, 2, 3, 5, len(shards) + 2):
        parts = [assign(plan, World(r, size, r, size)) for r in range(size)]
        assert set().union(*parts) == shards
        assert sum(len(p) for p in parts) == len(shards)  # each shard to exactly one rank
        assert parts == [assign(plan, World(r, size, r, size)) for r in range(size)]
    assert all(assign(plan, World(r, 2, r, 2)) for r in range(2))  # both ranks have work


@pytest.mark.parametrize("fmt,scheme", [("fp4convert", "nvfp4"), ("compressed-tensors", "mxfp4")])
def test_torchrun_two_cpu_ranks_write_the_same_bytes_as_one_process(llama, tmp_path, fmt, scheme) -> None:
    ref_dst = reference(llama, tmp_path / "one", format=fmt, scheme=scheme)
    out = tmp_path / "two"
    r = torchrun("quantize", str(llama), str(out), "--device", "cpu", "--max-shard-size", SHARD, "--format", fmt,
                 "--scheme", scheme, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)  # rank 0 alone prints
    assert summary["shards_out"] == len(list(ref_dst.glob("*.safetensors"))) > 2
    assert ck.all_files(out) == ck.all_files(ref_dst)


def test_torchrun_stacked_experts_from_an_mxfp4_input(tmp_path) -> None:
    """gpt-oss as released (MXFP4 expert blocks decoded, 3-D experts split per expert, kept router/norms):
    the ranks' units that run one at a time still give one process's bytes."""
    src = tmp_path / "src"
    zoo.mxfp4_variant(zoo.build("gpt_oss", tmp_path / "base"), src)
    ref_dst = tmp_path / "one"
    convert(src, ref_dst, ConvertConfig(device="cpu", max_shard_size=40000))
    out = tmp_path / "two"
    r = torchrun("quantize", str(src), str(out), "--device", "cpu", "--max-shard-size", "40KB", "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list(ref_dst.glob("*.safetensors"))) > 2
    assert ck.all_files(out) == ck.all_files(ref_dst)


def test_torchrun_moe_and_export(tmp_path) -> None:
    src = tmp_path / "moe"
    ck.moe(src, experts=4, layers=2)
    ref_dst = reference(src, tmp_path / "one")
    out = tmp_path / "two"
    r = torchrun("quantize", str(src), str(out), "--device", "cpu", "--max-shard-size", SHARD, "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ck.all_files(out) == ck.all_files(ref_dst)
    one, two = tmp_path / "ct1", tmp_path / "ct2"
    from fp4convert.checkpoint.export import export

    export(str(ref_dst), one, ConvertConfig(format="compressed-tensors", max_shard_size=SHARD_BYTES))
    r = torchrun("export", str(ref_dst), str(two), "--format", "compressed-tensors", "--max-shard-size", SHARD, "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ck.all_files(two) == ck.all_files(one)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def by_hand(*args: str) -> list[subprocess.CompletedProcess]:
    """Two ranks started with torchrun's environment, so each one's exit code and stderr are seen."""
    port = _free_port()
    procs = []
    for rank in range(2):
        e = env() | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "fp4convert", *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT))
    out = []
    for p in procs:
        so, se = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def test_a_failing_rank_fails_the_run_on_every_rank(llama, tmp_path) -> None:
    src = tmp_path / "src"
    ck.llama(src, layers=3, zoo=True)
    _, plan, _ = plan_conversion(str(src), ConvertConfig(max_shard_size=SHARD_BYTES))
    rank1 = assign(plan, World(1, 2, 1, 2))
    shard_of = plan.shard_of()
    victim = next(d for d in plan.decisions if d.action == "quantize" and shard_of[d.outputs[0].name] in rank1)
    ck.patch_tensor(ck.shard_with(src, victim.name), victim.name, b"\xc0\x7f")  # bf16 NaN
    dst = tmp_path / "q"
    r0, r1 = by_hand("quantize", str(src), str(dst), "--device", "cpu", "--max-shard-size", SHARD, "-q")
    assert r0.returncode == r1.returncode == 3, (r0.stderr[-2000:], r1.stderr[-2000:])
    assert f"Error: rank 1 failed: {victim.name}" in r0.stderr and "NaN" in r0.stderr
    assert f"Error: {victim.name}" in r1.stderr
    assert not (dst / "fp4convert.json").exists()


def test_resume_after_a_rank_was_killed(llama, tmp_path) -> None:
    ref_dst = reference(llama, tmp_path / "one")
    dst = tmp_path / "q"
    # Rank 1 dies like kill -9 right after recording its first finished shard; torchrun then stops rank 0.
    driver = tmp_path / "die.py"
    driver.write_text(
        "import os\n"
        "import fp4convert.output.record as w\n"
        "real = w.save_progress\n"
        "def save(dst, state, *rest):\n"
        "    real(dst, state, *rest)\n"
        "    if os.environ['RANK'] == '1' and state['files']:\n"
        "        os._exit(9)\n"
        "w.save_progress = save\n"
        "from fp4convert.cli.main import main\n"
        "main(prog_name='fp4convert')\n")
    args = ("quantize", str(llama), str(dst), "--device", "cpu", "--max-shard-size", SHARD, "-q")
    r = torchrun(*args, script=driver)
    assert r.returncode != 0
    assert not (dst / "fp4convert.json").exists()
    records = sorted(p.name for p in dst.glob(".fp4convert-progress*.json"))
    assert ".fp4convert-progress.rank1.json" in records
    killed = json.loads((dst / ".fp4convert-progress.rank1.json").read_text())["files"]
    assert len(killed) == 1  # its finished shard is recorded (and identical to the one-process run)
    (name,) = killed
    # The record names a shard before its rename (issue 12): the kill may leave it as NAME.partial.
    left = dst / name if (dst / name).exists() else dst / (name + ".partial")
    assert left.read_bytes() == (ref_dst / name).read_bytes()
    mtime = left.stat().st_mtime_ns

    r = torchrun(*args, "--resume", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert name in json.loads(r.stdout)["reused_files"]
    assert (dst / name).stat().st_mtime_ns == mtime
    assert ck.all_files(dst) == ck.all_files(ref_dst)  # per-rank records merged and removed, no .partial
