"""``--resume`` continues a calibrated run where it stopped (issue 45 item 3): a pass keeps its progress as its blocks
finish (fp4convert/calibrate/resume.py ``PassCheckpoint``: the hidden states entering the next block, the observers'
statistics, the method's state, the store's finished blocks), so a Ctrl-C in block k resumes at block k with the bytes
of an uninterrupted run, for GPTQ (dense and streamed MoE), W4A4 calibration and ``--input-weights``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp4convert.calibrate import layerwise
from fp4convert.cli.main import main
from tests import checkpoints as ck
from tests.calibrate.test_calibrate import TEXT, add_tokenizer

LAYERS = 4


def _model(path: Path, family: str) -> Path:
    import transformers as tf

    torch.manual_seed(3)
    if family == "llama":
        cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
        model = tf.Qwen3MoeForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(str(path))
    return add_tokenizer(path)


def _run(src: Path, dst: Path, text: Path, *extra):
    return CliRunner().invoke(main, ["quantize", str(src), str(dst), "--device", "cpu", "--calibration-data", str(text),
                                     "--calibration-samples", "4", "--calibration-seq-len", "32", "-q",
                                     "--max-shard-size", "40kB", *extra])


def loading(mp, stop_at: int | None = None) -> list[int]:
    """Patch the block loader through ``mp``: a Ctrl-C when block ``stop_at`` loads, and the list of the blocks
    loaded (returned; filled as the run goes)."""
    real = layerwise.LayerwiseModel.load_block
    loaded: list[int] = []

    def load(self, i, *a, **kw):
        if i == stop_at:
            raise KeyboardInterrupt
        loaded.append(i)
        return real(self, i, *a, **kw)

    mp.setattr(layerwise.LayerwiseModel, "load_block", load)
    return loaded


ROWS = {
    "gptq": ("llama", ("--method", "gptq")),
    "gptq-moe": ("qwen3_moe", ("--method", "gptq")),
    "gptq-w4a4": ("llama", ("--method", "gptq", "--activations", "nvfp4", "--format", "compressed-tensors")),
    "w4a4": ("llama", ("--activations", "nvfp4", "--format", "compressed-tensors")),
    "input-weights": ("llama", ("--input-weights", "calibration")),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_an_interrupted_calibration_resumes_at_the_block_it_stopped_in(tmp_path, monkeypatch, row):
    """A Ctrl-C while block 2 of 4 loads: the run stops (exit 130, saying the finished blocks are kept), nothing is in
    DST; the same command with --resume loads only blocks 2 and 3 and writes the bytes of an uninterrupted run."""
    family, extra = ROWS[row]
    src = _model(tmp_path / "src", family)
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with monkeypatch.context() as mp:  # (its own result cache: the resume below must not find a finished pass)
        mp.setenv("FP4CONVERT_CALIBRATION_CACHE", str(tmp_path / "other-cache"))
        r = _run(src, tmp_path / "whole", text, *extra)
    assert r.exit_code == 0, r.output

    with monkeypatch.context() as mp:
        loading(mp, stop_at=2)
        r = _run(src, tmp_path / "out", text, *extra)
    assert r.exit_code == 130 and "--resume" in r.output and "kept" in r.output, r.output
    assert not any((tmp_path / "out").glob("*.safetensors"))
    with monkeypatch.context() as mp:
        loaded = loading(mp)
        r = _run(src, tmp_path / "out", text, *extra, "--resume")
    assert r.exit_code == 0, r.output
    assert loaded and min(loaded) == 2, loaded  # blocks 0 and 1 were not run again
    assert ck.all_files(tmp_path / "out") == ck.all_files(tmp_path / "whole")


def test_without_resume_an_interrupted_pass_starts_over(tmp_path, monkeypatch):
    """The kept progress is for --resume only: the same command without it runs every block again."""
    src = _model(tmp_path / "src", "llama")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with monkeypatch.context() as mp:
        loading(mp, stop_at=2)
        assert _run(src, tmp_path / "out", text, "--method", "gptq").exit_code == 130
    with monkeypatch.context() as mp:
        loaded = loading(mp)
        r = _run(src, tmp_path / "out", text, "--method", "gptq", "--overwrite")
    assert r.exit_code == 0, r.output
    assert min(loaded) == 0
