"""A calibrated run under torchrun spreads its work over the ranks (issue 42 item 3): each rank runs its own chunks of
the calibration samples through every block (fp4convert/calibrate/layerwise.py ``share``), the ranks' statistics are
added chunk by chunk in one order (fp4convert/calibrate/stats.py ``Observer.parts``, ``Observers.gather``), each rank
sweeps its share of the matrices (fp4convert/calibrate/methods/gptq.py ``owner_ranks``) and gets the others' bytes;
the output equals one process's byte for byte. Real processes: torchrun with 2 gloo ranks on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import checkpoints as ck
from tests.calibrate.test_calibrate import TEXT, add_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 64  # 8 micro-batches, 2 chunks: one a rank


def _env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def _model(path: Path, family: str) -> Path:
    import transformers as tf

    torch.manual_seed(7)
    if family == "llama":
        cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
        model = tf.Qwen3MoeForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(str(path))
    return add_tokenizer(path)


def _args(src: Path, dst: Path, text: Path, *extra) -> list[str]:
    return ["quantize", str(src), str(dst), "--device", "cpu", "--calibration-data", str(text), "--calibration-samples",
            str(SAMPLES), "--calibration-seq-len", "16", "--max-shard-size", "20kB", "--json", *extra]


def _one(args: list[str], tmp_path: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "fp4convert", *args], capture_output=True, text=True, timeout=900,
                       env={**_env(), "FP4CONVERT_CALIBRATION_CACHE": str(tmp_path / "cache-one")}, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def _two(args: list[str], tmp_path: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "fp4convert", *args], capture_output=True, text=True, timeout=900,
                       env={**_env(), "FP4CONVERT_CALIBRATION_CACHE": str(tmp_path / "cache-two")}, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"):])


ROWS = {
    "gptq-dense": ("llama", ("--method", "gptq")),
    "gptq-moe": ("moe", ("--method", "gptq")),
    "gptq-w4a4": ("llama", ("--method", "gptq", "--activations", "nvfp4", "--format", "compressed-tensors")),
    "w4a4": ("moe", ("--activations", "nvfp4", "--format", "compressed-tensors")),
}


@pytest.mark.slow
@pytest.mark.parametrize("row", list(ROWS))
def test_two_ranks_share_the_calibration_and_write_one_process_bytes(tmp_path, row):
    """2 gloo ranks: each runs half of the calibration micro-batches (its --json counts them), and every output file
    (shards, manifest, config) equals the one-process run's."""
    family, extra = ROWS[row]
    src = _model(tmp_path / "src", family)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 3)
    one = _one(_args(src, tmp_path / "one", text, *extra), tmp_path)
    two = _two(_args(src, tmp_path / "two", text, *extra), tmp_path)
    assert one["counts"]["calibrate_micro_batches"] == 8 and two["counts"]["calibrate_micro_batches"] == 4
    a, b = ck.all_files(tmp_path / "one"), ck.all_files(tmp_path / "two")
    assert a.keys() == b.keys() and [f for f in a if a[f] != b[f]] == []


def test_too_few_samples_for_the_ranks_are_refused_before_the_model_runs(tmp_path):
    """Every rank runs whole chunks of calibration samples: fewer chunks than ranks is refused, naming what to give."""
    src = _model(tmp_path / "src", "llama")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    args = _args(src, tmp_path / "out", text, "--method", "gptq")
    args[args.index("--calibration-samples") + 1] = "8"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "fp4convert", *args], capture_output=True, text=True, timeout=600, env=_env(), cwd=ROOT)
    assert p.returncode != 0 and "--calibration-samples 64 or more" in p.stderr, p.stderr[-2000:]
