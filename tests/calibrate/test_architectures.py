"""The block runner on the architecture classes the calibration sweep (benchmarks/calibration_sweep.py)
found it failing on, each fixed for its class rather than for the model type:

- the repeated blocks are the list holding the most weights outside embedding tables (MarkupLM's 50
  xpath embedding tables outweighed its encoder layers);
- tied parameters are one tensor (ProphetNet's decoder reads the word embeddings its parent holds);
- a block's output is carried in the form the block returns it (RWKV's ``(hidden, state, attentions)``,
  SqueezeBERT's ``{"feature_map": ...}``), and a block that uses a state computed by the block before
  it is refused naming it;
- a sub-model whose first parameter is a tower's (never loaded) still says it is on the run's device
  (Idefics3 moves its token embeddings to ``self.device``);
- buffers made from parameters (I-BERT's ``weight_integer``) are loaded from the checkpoint with their
  block and released with it; integer buffers (position ids, DeepSeek-V4's token-to-expert table) are
  read as they are, not refused as non-float weights;
- a list of lists is not the blocks (Evolla's).

Encoder-decoders are refused before anything is written, naming why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4convert import calibrate
from fp4convert.calibrate.capture import block_calls, block_output, run_block
from fp4convert.source.open import open_source
from tests import tiny_configs
from tests.calibrate.test_runner import _cli, compare


def _tiny(model_type: str, tmp_path: Path) -> Path:
    out = tiny_configs.build(model_type, tmp_path)
    if not out.ok:
        pytest.skip(f"{model_type}: tiny build failed ({out.error})")
    return Path(out.path)


@pytest.mark.parametrize("model_type", ["markuplm", "prophetnet", "rwkv", "idefics3", "mra", "evolla"])
def test_runner_statistics_equal_the_whole_model(tmp_path, model_type):
    """Embedding lists beside the layers, tied embeddings, tuple-of-state outputs, a VLM whose tower
    stays on meta, integer buffers in the checkpoint (MRA's I64 position ids), a list of lists beside
    the layers (Evolla): the runner's statistics equal the whole model's (amax torch.equal)."""
    amax = compare(_tiny(model_type, tmp_path), vocab=tiny_configs.VOCAB)
    assert amax


@pytest.mark.parametrize("model_type,blocks", [("ibert", "encoder.layer"), ("squeezebert", "encoder.layers")])
def test_runner_runs_and_releases_every_block(tmp_path, model_type, blocks):
    """I-BERT (buffers made from parameters, loaded from the checkpoint) and SqueezeBERT (blocks return a
    dict): the run goes through every block and releases what it loaded, buffers included."""
    lm = calibrate.LayerwiseModel(open_source(str(_tiny(model_type, tmp_path))), torch.device("cpu"))
    assert lm.layers_name == blocks
    lm.observe(torch.randint(3, tiny_configs.VOCAB, (3, 12), generator=torch.Generator().manual_seed(0)),
               calibrate.Observers(), micro_batch=2, progress=False)
    assert lm.loaded == 0 and lm.peak_loaded > 0
    left = [n for n, b in lm.model.named_buffers() if n in lm._meta_buffers and b.device.type != "meta"]
    assert left == []


def test_meta_buffers_are_loaded_with_their_block(tmp_path):
    lm = calibrate.LayerwiseModel(open_source(str(_tiny("ibert", tmp_path))), torch.device("cpu"))
    inside = sorted(n for n in lm._meta_buffers if n.startswith(lm.layers_name + ".0."))
    assert inside  # weight_integer / bias_integer: zeros_like(weight) at build, saved in the checkpoint
    lm.load_block(0)
    bufs = dict(lm.model.named_buffers())
    assert all(bufs[n].device.type == "cpu" for n in inside)
    lm.free_block(0)
    bufs = dict(lm.model.named_buffers())
    assert all(bufs[n].device.type == "meta" for n in inside) and lm.loaded == 0


def test_tied_parameters_load_and_free_as_one(tmp_path):
    lm = calibrate.LayerwiseModel(open_source(str(_tiny("prophetnet", tmp_path))), torch.device("cpu"))
    group = lm.tied.get("prophetnet.decoder.word_embeddings.weight")
    assert group and "prophetnet.word_embeddings.weight" in group
    lm.load_outside()
    params = dict(lm.model.named_parameters(remove_duplicate=False))
    assert len({id(params[n]) for n in group}) == 1 and params[next(iter(group))].device.type == "cpu"
    lm.free_outside()
    params = dict(lm.model.named_parameters(remove_duplicate=False))
    assert all(params[n].device.type == "meta" for n in group) and lm.loaded == 0


def test_tied_parameters_both_in_the_checkpoint_stay_apart(tmp_path):
    """As transformers loads it: when the checkpoint holds both tied names, each loads its own tensor."""
    from safetensors.torch import load_file, save_file

    src = _tiny("prophetnet", tmp_path)
    f = next(src.glob("*.safetensors"))
    t = load_file(str(f))
    t["prophetnet.decoder.word_embeddings.weight"] = t["prophetnet.word_embeddings.weight"] * 2
    save_file(t, str(f), metadata={"format": "pt"})
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    assert "prophetnet.decoder.word_embeddings.weight" not in lm.tied
    lm.load_outside()
    params = dict(lm.model.named_parameters(remove_duplicate=False))
    dec, top = params["prophetnet.decoder.word_embeddings.weight"], params["prophetnet.word_embeddings.weight"]
    assert torch.equal(dec, top.float() * 2)
    lm.free_outside()
    assert lm.loaded == 0


# -- the recorder, on toy models: what the model's code between the blocks gets ----------------------

class _Lin(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


class _DictBlock(_Lin):
    def forward(self, h, mask):
        return {"feature_map": self.lin(h) * mask, "attention_score": None}


class _DictModel(torch.nn.Module):
    """Calls ``layer.forward`` itself and reads the dict (as SqueezeBERT's encoder)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_DictBlock() for _ in range(n))

    def forward(self, h):
        mask = torch.ones_like(h)
        for layer in self.layers:
            h = layer.forward(h, mask)["feature_map"]
        return h


class _StateBlock(_Lin):
    def forward(self, h, state=None):
        s = self.lin(h) if state is None else state + self.lin(h)
        return h + s, s


class _StateModel(torch.nn.Module):
    """Each block takes the state the block before it computed (a recurrent model's carried state)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_StateBlock() for _ in range(n))

    def forward(self, h):
        state = None
        for layer in self.layers:
            h, state = layer(h, state=state)
        return h


def test_recorder_returns_the_blocks_own_form():
    model = _DictModel().to("meta")  # weights not loaded, as while the calls are recorded
    h = torch.randn(2, 5, 4)
    calls = block_calls(model, list(model.layers), lambda k: model(h), 1)
    assert [len(c) for c in calls] == [1, 1, 1]
    for args, _kw in (c[0] for c in calls):
        assert torch.equal(args[0], h) and args[1].device.type == "cpu"
    real = _DictModel()
    assert torch.equal(block_output(real.layers[0](h, torch.ones_like(h))), real.layers[0].lin(h))


def test_a_state_carried_between_blocks_is_refused_naming_it():
    """The state block 0 computes is recorded on meta for block 1 (the recorder cannot compute it); block 1
    uses it, and that is a refusal naming it, not a device error."""
    model = _StateModel().to("meta")
    h = torch.randn(2, 5, 4)
    calls = block_calls(model, list(model.layers), lambda k: model(h), 1)
    (args, kw), = calls[1]
    assert kw["state"].device.type == "meta" and args[0].device.type == "cpu"
    real = _StateModel()
    out = run_block(real.layers[0], 0, *calls[0][0])  # block 0 takes no carried state: it runs
    assert torch.equal(block_output(out), real.layers[0](h)[0])
    with pytest.raises(calibrate.PlanError, match=r"block 1 \(_StateBlock\) uses state, computed by the block before"):
        run_block(real.layers[1], 1, args, kw)


# -- encoder-decoders: refused while planning, before anything is written ---------------------------------

def test_an_encoder_decoder_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    src = _tiny("t5", tmp_path / "build")

    def no_run(*a, **kw):
        raise AssertionError("the model ran")

    monkeypatch.setattr(calibrate.LayerwiseModel, "__init__", no_run)
    dst = tmp_path / "out"
    r = _cli(src, dst, "--input-weights", "random", "--calibration-samples", 2, "--calibration-seq-len", 8)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "encoder-decoder" in errors[0] and "T5ForConditionalGeneration" in errors[0], errors[0]
    assert "the model ran" not in r.output and not dst.exists()


# -- self-generated samples: the cost said up front, progress shown -------------------------------------

def test_self_generation_says_its_cost_and_offers_the_smaller_setting(caplog):
    import logging

    from fp4convert.calibrate import samples as smp

    share = 0.75
    assert smp.cost(0.5, 128, 512, 128, share) == pytest.approx((0.5 * 511, 0.5 * 511 * share))
    assert smp.cost(0.5, 32, 256, 128, share) == pytest.approx((0.5 / 4 * 255, 0.5 / 4 * 255 * share))
    assert smp.smaller(128, 512) == (64, 256) and smp.smaller(1, 2) == (1, 2)
    with caplog.at_level(logging.INFO, logger="fp4convert.calibrate.samples"):
        smp.tell_cost(0.5, 128, 512, "cpu", share)  # about 4 + 3 min: slow, a smaller setting is offered
    slow = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(slow) == 1, caplog.text
    msg = slow[0].getMessage()
    assert "128 samples x 512 tokens on cpu, 256 tokens/s measured" in msg, msg
    assert "about 4 min to generate them, then at most 3 min" in msg, msg
    gen, run = smp.cost(0.5, 64, 256, 128, share)
    assert f"--calibration-samples 64 --calibration-seq-len 256 takes about {gen:.0f} s and at most {run:.0f} s" \
        in msg, msg
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp4convert.calibrate.samples"):
        smp.tell_cost(0.01, 16, 64, "cpu", share)  # seconds: said, nothing offered
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "--calibration-samples" not in caplog.text


def test_calibration_progress_lines_on_a_log(monkeypatch, capsys, caplog):
    """Not a terminal, status lines shown (the CLI without --quiet): a line every interval with the
    count, the rate and the time left; nothing with --quiet (errors only)."""
    import logging
    import time

    from fp4convert.calibrate.progress import PROGRESS_ENV, progress_bar

    monkeypatch.setenv(PROGRESS_ENV, "0")  # a line at every update
    caplog.set_level(logging.INFO, logger="fp4convert.calibrate.progress")
    bar = progress_bar(40, "calibrate: generating 4 samples x 11 tokens", True, unit="token")
    for _ in range(10):
        time.sleep(0.002)
        bar.update(4)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("calibrate: generating 4 samples x 11 tokens: 40 of 40 tokens (100%)")
    assert "36 of 40 tokens (90%)" in lines[8] and "s left" in lines[8] and "left" not in lines[-1], lines
    monkeypatch.setenv(PROGRESS_ENV, "1000")  # no line before the interval: the last one at the end
    bar = progress_bar(3, "calibrate: blocks", True)
    bar.update(1)
    bar.update(2)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("calibrate: blocks: 3 of 3 blocks (100%)"), lines
    caplog.set_level(logging.ERROR, logger="fp4convert.calibrate.progress")  # --quiet
    bar = progress_bar(3, "calibrate: blocks", True)
    bar.update(3)
    bar.close()
    assert capsys.readouterr().err == ""


def test_self_generated_w4a4_says_the_cost_and_shows_progress(tmp_path, monkeypatch):
    from fp4convert.calibrate.progress import PROGRESS_ENV
    from tests import zoo
    from tests.calibrate.test_calibrate import add_tokenizer

    monkeypatch.setenv(PROGRESS_ENV, "0")
    src = add_tokenizer(zoo.build("llama", tmp_path / "llama"))
    r = _cli(src, tmp_path / "out", "--format", "compressed-tensors", "--activations", "nvfp4",
             "--calibration-samples", 3, "--calibration-seq-len", 9)
    assert r.exit_code == 0, r.output
    assert "self-generated calibration (3 samples x 9 tokens on cpu" in r.output, r.output
    assert "calibrate: generating 3 samples x 9 tokens: 24 of 24 tokens (100%)" in r.output, r.output
    assert "calibrate: blocks: " in r.output and "blocks (100%)" in r.output, r.output
