"""What a calibration says it will take (fp4convert/calibrate/estimate.py; issue 45 item 2): the plan in words
with a rough time before anything runs, and after the first block the blocks' total, within 1.5x of what they
took."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp4convert.calibrate import estimate
from fp4convert.cli.main import main
from tests.calibrate.test_calibrate import TEXT, add_tokenizer


def _llama(path: Path, layers: int) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    return add_tokenizer(path)


@pytest.mark.slow
def test_the_blocks_estimate_after_the_first_block_is_within_1_5x(tmp_path, monkeypatch, caplog):
    clocks: list[estimate.BlockClock] = []
    real = estimate.BlockClock.__init__

    def keep(self, *a, **kw):
        real(self, *a, **kw)
        clocks.append(self)

    monkeypatch.setattr(estimate.BlockClock, "__init__", keep)
    src = _llama(tmp_path / "m", 8)
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    caplog.set_level(logging.INFO, logger="fp4convert")
    r = CliRunner().invoke(main, ["quantize", str(src), str(tmp_path / "out"), "--device", "cpu", "--method", "gptq",
                                  "--calibration-data", str(text), "--calibration-samples", "8",
                                  "--calibration-seq-len", "128"])
    assert r.exit_code == 0, r.output
    (clock,) = clocks
    assert clock.told is not None and clock.actual > 0
    assert 1 / 1.5 <= clock.told / clock.actual <= 1.5, (clock.told, clock.actual)
    said = [rec.getMessage() for rec in caplog.records if rec.name == "fp4convert.calibrate.estimate"]
    assert any("block 1 of 8 took" in s and "in all" in s for s in said), said
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("calibration: ")]
    assert any("8 blocks, 56 quantized matrices, 1,024 calibration tokens a block" in x for x in lines), lines
    assert any("rough time for the blocks" in x for x in lines), lines


def test_block_work_weighs_each_block_by_its_arithmetic():
    """The estimate's weights: equal for blocks of one shape; an MoE block's experts by the share of tokens routed
    to them."""
    from types import SimpleNamespace as N

    from fp4convert.plan.types import QUANTIZE

    def dec(name, n, k):
        return N(name=name, action=QUANTIZE, matrices=[N(shape=(n, k))])

    plan = N(decisions=[dec("model.layers.0.mlp.down_proj.weight", 64, 128), dec("model.layers.1.mlp.down_proj.weight", 64, 128),
                        *[dec(f"model.layers.2.mlp.experts.{e}.down_proj.weight", 64, 128) for e in range(16)]])
    work = estimate.block_work(plan, 1000)  # type: ignore[arg-type]
    assert work[0] == work[1] > 0
    one = 1000 * (estimate.PASSES * 2 * 64 * 128 + 2 * 128 * 128) + 2 * 64 * 128 * 128
    assert work[0] == one
    assert work[2] == 16 * (1000 * 8 / 16 * (estimate.PASSES * 2 * 64 * 128 + 2 * 128 * 128) + 2 * 64 * 128 * 128)
