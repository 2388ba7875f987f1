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
- a list of lists is not the blocks (Evolla's);
- a block the forward runs several times over gets every call (ALBERT's shared layer groups), and a
  forward that runs a block again after a later one is refused naming it (HRM's cycles);
- loaded weights carry the definition's ``requires_grad`` (matmul reads it: Longformer's last bits).

Encoder-decoders are refused before anything is written, naming why; so are self-generated samples of a
model that cannot generate (an encoder).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fp4convert import calibrate
from fp4convert.calibrate.capture import block_calls, block_output, repeats, run_block
from fp4convert.source.open import open_source
from tests import tiny_configs
from tests.calibrate.test_layerwise import _cli, compare


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


# -- a block run several times per forward, a recurrence over the blocks, a flag matmul reads ------------

def _saved(model, path: Path) -> Path:
    model.save_pretrained(str(path))
    return path


def _albert(tmp_path: Path, layers: int, groups: int, inner: int) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.AlbertConfig(vocab_size=tiny_configs.VOCAB, embedding_size=16, hidden_size=32, intermediate_size=64,
                          num_attention_heads=4, num_hidden_layers=layers, num_hidden_groups=groups,
                          inner_group_num=inner, hidden_act="gelu")
    return _saved(tf.AlbertModel(cfg).eval(), tmp_path / f"albert{layers}x{groups}x{inner}")


@pytest.mark.parametrize("layers,groups,inner", [(3, 1, 1), (4, 2, 2)])
def test_a_shared_block_runs_as_often_as_the_forward_calls_it(tmp_path, layers, groups, inner):
    """ALBERT runs its ``num_hidden_groups`` shared layer groups ``num_hidden_layers`` times in all (each
    group's calls one after the other): the runner runs each group's every call, each on the one before's
    output, and its statistics equal the whole model's (amax torch.equal, every call's tokens counted)."""
    src = _albert(tmp_path, layers, groups, inner)
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    assert lm.layers_name == "encoder.albert_layer_groups" and len(lm.layers) == groups
    tokens = torch.randint(3, tiny_configs.VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    obs = calibrate.Observers(squares=True)
    lm.observe(tokens, obs, micro_batch=2, progress=False)
    query = f"encoder.albert_layer_groups.{groups - 1}.albert_layers.{inner - 1}.attention.query"
    assert obs[query].count == tokens.numel() * layers // groups  # every call of the last group
    assert compare(src, vocab=tiny_configs.VOCAB)


def test_the_sweeps_albert_and_longformer_equal_the_whole_model(tmp_path):
    """The sweep's tiny ALBERT (one shared group) and Longformer (its input padded to the attention window,
    attention on transposed inputs) against whole-model hooks: the blocks, and the linears outside them
    (ALBERT's embedding projection and pooler, Longformer's pooler) on the last call's outputs."""
    from tests.calibrate.test_tail import compare_outside

    for model_type, outside in (("albert", {"encoder.embedding_hidden_mapping_in", "pooler"}),
                                ("longformer", {"pooler.dense"})):
        src = _tiny(model_type, tmp_path / model_type)
        assert compare(src, vocab=tiny_configs.VOCAB)
        assert outside <= set(compare_outside(src, vocab=tiny_configs.VOCAB))


def test_loaded_parameters_keep_the_definitions_requires_grad(tmp_path):
    """matmul folds a transposed 3-D input into one 2-D matmul only when the weight needs no gradient (it
    reads the flag under no_grad too): the runner's weights carry the flag the definition gives them, as
    transformers loads them, so a block computes the same bits as in the whole model (Longformer's
    attention projections take the transposed hidden states)."""
    lm = calibrate.LayerwiseModel(open_source(str(_tiny("longformer", tmp_path))), torch.device("cpu"))
    want = {n: p.requires_grad for n, p in lm.layers[0].named_parameters()}
    lm.load_block(0)
    got = {n: (p.requires_grad, p.device.type) for n, p in lm.layers[0].named_parameters()}
    assert got == {n: (g, "cpu") for n, g in want.items()} and any(want.values())
    lm.free_block(0)
    assert {n: p.requires_grad for n, p in lm.layers[0].named_parameters()} == want and lm.loaded == 0


def _hrm(tmp_path: Path, l_cycles: int) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.HrmTextConfig(vocab_size=tiny_configs.VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=8, num_layers_per_stack=2, H_cycles=2, L_cycles=l_cycles,
                           L_bp_cycles=[1], num_hidden_layers=2 * 2 * (l_cycles + 1))
    return _saved(tf.HrmTextForCausalLM(cfg).eval(), tmp_path / f"hrm{l_cycles}")


@pytest.mark.parametrize("l_cycles", [1, 2])
def test_a_recurrence_over_the_blocks_is_refused_naming_it(tmp_path, l_cycles):
    """HRM runs its low-level stack (the blocks found) in cycles, its high-level stack between them, both
    streams summed at every cycle: block 0 runs again after the last block, which a block-by-block run
    cannot do. Refused before any block runs, whether the stack runs twice in a row (``L_cycles`` 2) or
    only after the other stack (``L_cycles`` 1)."""
    src = _hrm(tmp_path, l_cycles)
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))

    def no_run(*a, **kw):
        raise AssertionError("a block ran")

    lm.run_layer = no_run  # type: ignore[method-assign]
    with pytest.raises(calibrate.PlanError) as got:
        lm.observe(torch.randint(3, tiny_configs.VOCAB, (2, 8)), calibrate.Observers(), progress=False)
    msg = str(got.value)
    assert "HrmTextForCausalLM (blocks model.L_module.layers)" in msg and "\n" not in msg, msg
    assert "runs block 0 (HrmTextDecoderLayer) again after block 1 (a recurrence over its blocks)" in msg, msg
    assert lm.loaded == 0


def test_a_recurrence_is_refused_before_samples_are_generated(tmp_path, monkeypatch):
    """End to end: W4A4 with self-generated samples of HRM stops at the stand-in forward that looks for the
    linears outside the blocks (the high-level stack), before any sample is made, any block runs or
    anything is written."""
    from fp4convert.calibrate import stage
    from tests.calibrate.test_calibrate import add_tokenizer

    src = add_tokenizer(_hrm(tmp_path, 1))

    def no_run(*a, **kw):
        raise AssertionError("the model ran")

    monkeypatch.setattr(stage, "generate", no_run)
    monkeypatch.setattr(calibrate.LayerwiseModel, "run_layer", no_run)
    dst = tmp_path / "out"
    r = _cli(src, dst, "--format", "compressed-tensors", "--activations", "nvfp4", "--calibration-samples", 2,
             "--calibration-seq-len", 8)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "again after block 1 (a recurrence over its blocks)" in errors[0], errors[0]
    assert errors[0].endswith("or use --activation-scale constant"), errors[0]
    assert "the model ran" not in r.output and not dst.exists()


class _Repeated(torch.nn.Module):
    """One block run ``times`` times (as ALBERT's shared group), ``between`` a weighted module run between
    two of its calls, or a recurrence over two blocks (``cycles``)."""

    def __init__(self, times: int = 3, between: bool = False, cycles: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_DictBlock(), _DictBlock()] if cycles else [_DictBlock()])
        self.mix = torch.nn.Linear(4, 4)
        self.times, self.between, self.cycles = times, between, cycles

    def forward(self, h):
        mask = torch.ones_like(h)
        order = [0, 1, 0, 1] if self.cycles else [0] * self.times
        for j, i in enumerate(order):
            if self.between and j:
                h = self.mix(h)
            h = self.layers[i](h, mask)["feature_map"]
        return self.mix(h)


def test_recorder_records_every_call_of_a_repeated_block_and_stops_at_the_head():
    model = _Repeated(times=3).to("meta")
    model.mix.to_empty(device="cpu")  # the head: loaded or not, the forward stops there
    h = torch.randn(2, 5, 4)
    calls = block_calls(model, list(model.layers), lambda k: model(h[k: k + 1]), 2, stop=[model.mix])
    assert len(calls[0]) == 6 and repeats(calls, 2) == [3]
    assert all(torch.equal(calls[0][r][0][0], h[:1]) for r in range(3))  # the recorder returns its input
    assert torch.equal(calls[0][3][0][0], h[1:])


@pytest.mark.parametrize("between,cycles,says", [
    (True, False, "runs mix between two calls of block 0 (_DictBlock)"),
    (False, True, "runs block 0 (_DictBlock) again after block 1 (a recurrence over its blocks)"),
])
def test_recorder_refuses_what_it_cannot_run_block_by_block(between, cycles, says):
    model = _Repeated(between=between, cycles=cycles).to("meta")
    model.mix.to_empty(device="cpu")
    with pytest.raises(calibrate.PlanError, match=re.escape(says)):
        block_calls(model, list(model.layers), lambda k: model(torch.randn(1, 5, 4)), 1)


# -- self-generated samples need a model that generates -------------------------------------------------

@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Path:
    from tests import zoo
    from tests.calibrate.test_calibrate import add_tokenizer

    return add_tokenizer(zoo.build("bert", tmp_path_factory.mktemp("enc") / "bert"))


SELF_GENERATED = [
    (("--format", "compressed-tensors", "--activations", "nvfp4"), "or use --activation-scale constant"),
    (("--format", "compressed-tensors", "--scheme", "mxfp4", "--activations", "mxfp4", "--method", "gptq"), "or use --method rtn"),
    (("--method", "gptq"), "or use --method rtn"),
    (("--input-weights", "calibration"), "or use --input-weights none"),
]


@pytest.mark.parametrize("opts,other", SELF_GENERATED, ids=["w4a4", "mxfp4-gptq", "gptq", "input-weights"])
def test_self_generated_samples_of_an_encoder_are_refused_before_anything_runs(encoder, tmp_path, monkeypatch, opts,
                                                                                other):
    """An encoder (BertModel: no LM head) cannot sample its own calibration text: one line naming the class
    and model type, why, and what to give, while planning (the model is never built to run, DST never made)."""
    def no_run(*a, **kw):
        raise AssertionError("the model ran")

    monkeypatch.setattr(calibrate.LayerwiseModel, "__init__", no_run)
    dst = tmp_path / "out"
    r = _cli(encoder, dst, *opts, "--calibration-samples", 2, "--calibration-seq-len", 8)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    line = errors[0]
    assert f"Error: {encoder}: without --calibration-data" in line, line
    assert "needs a causal LM head to sample from; this BertModel (model_type 'bert') has none" in line, line
    assert "give --calibration-data FILE" in line and line.endswith(other), line
    assert "the model ran" not in r.output and not dst.exists()
    dst.mkdir()  # an empty DST given: left empty
    again = _cli(encoder, dst, *opts, "--calibration-samples", 2, "--calibration-seq-len", 8)
    assert again.exit_code == 2 and line in again.output, again.output
    assert list(dst.iterdir()) == []


def test_an_encoder_with_a_calibration_file_is_calibrated(encoder, tmp_path):
    """The refusal is about self-generated samples only: the same encoder with --calibration-data runs."""
    from tests.calibrate.test_calibrate import TEXT

    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    r = _cli(encoder, tmp_path / "out", "--input-weights", "calibration", "--calibration-data", data,
             "--calibration-samples", 2, "--calibration-seq-len", 8)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
