"""The quantized linears outside the repeated blocks (fp4convert/calibrate/tail.py): a BERT-style pooler,
OPT's projections in and out, an LM head's dense layer.

- their statistics equal whole-model forward hooks (amax ``torch.equal``; mean squares within one bf16
  step), taken by the model's own forward on the last block's outputs with only the weights outside the
  blocks loaded (memory: the same at any depth);
- W4A4 of a BERT encoder with a pooler converts, and ``--method gptq`` quantizes the pooler too;
- what no pass can observe (a linear the forward never reaches, one in a vision tower) is refused before
  any sample is made or any block runs for W4A4, naming the tensor and the way out, and listed in the
  manifest's ``method.rtn`` by GPTQ; a model whose forward runs weights between two blocks is refused in
  every mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp4convert import calibrate
from fp4convert.calibrate import tail
from fp4convert.source.open import open_source
from tests import tiny_configs, zoo
from tests.calibrate.test_calibrate import TEXT, add_tokenizer
from tests.calibrate.test_layerwise import _cli


def _tiny(model_type: str, tmp_path: Path) -> Path:
    out = tiny_configs.build(model_type, tmp_path)
    if not out.ok:
        pytest.skip(f"{model_type}: tiny build failed ({out.error})")
    return Path(out.path)


def _bert(path: Path, layers: int) -> Path:
    """A tiny BertModel (a pooler after the encoder) of ``layers`` layers."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64)
    tf.BertModel(cfg).to(torch.bfloat16).save_pretrained(str(path))
    return path


# -- the statistics: those of the whole model -----------------------------------------------------------

def outside_reference(path: Path, tokens: torch.Tensor, micro_batch: int) -> calibrate.Observers:
    """The reference: the whole model loaded by transformers (fp32), observers hooked on every linear
    outside its blocks (not the output head, not a vision/audio tower), one forward per micro-batch (the
    blocks' own statistics: tests/calibrate/test_layerwise.py)."""
    import transformers as tf
    from transformers.pytorch_utils import Conv1D

    from fp4convert.calibrate.model import find_blocks, is_tower, model_class

    raw = json.loads((path / "config.json").read_text())
    cfg = tf.AutoConfig.from_pretrained(str(path))
    model = model_class(tf, cfg, raw.get("architectures") or []).from_pretrained(str(path), dtype=torch.float32).eval()
    obs = calibrate.Observers(squares=True)
    name, _ = find_blocks(model)
    head = model.get_output_embeddings()
    towers = [n for n, m in model.named_modules() if n and is_tower(model, m)]
    for n, m in model.named_modules():
        if any(n == p or n.startswith(p + ".") for p in [name, *towers]) or m is head:
            continue
        if isinstance(m, (torch.nn.Linear, Conv1D)):
            m.register_forward_pre_hook(lambda _m, a, _n=n: obs.add(_n, a[0]))
    with torch.no_grad():
        for s in range(0, tokens.shape[0], micro_batch):
            model(input_ids=tokens[s: s + micro_batch], use_cache=False)
    return obs


def compare_outside(path: Path, vocab: int = 100) -> dict[str, torch.Tensor]:
    """The runner's statistics of every linear outside the blocks equal the whole model's (amax
    torch.equal; mean squares within one bf16 step); every weight released."""
    tokens = torch.randint(3, vocab, (5, 24), generator=torch.Generator().manual_seed(1))
    lm = calibrate.LayerwiseModel(open_source(str(path)), torch.device("cpu"))
    outside = set(tail.outside_linears(lm))
    got = calibrate.Observers(squares=True)
    lm.observe(tokens, got, micro_batch=2, progress=False, outside=outside)
    want = outside_reference(path, tokens, micro_batch=2)
    assert {n for n in got if n in outside} == set(want) and len(want) > 0
    for n in want:
        assert torch.equal(got[n].amax, want[n].amax), n
        assert torch.allclose(got[n].mean_square(), want[n].mean_square(), rtol=2.0 ** -7, atol=0.0), n
    assert lm.loaded == 0
    return got.amax()


@pytest.mark.parametrize("model_type,outside", [
    ("bert", ["pooler.dense"]),  # after the encoder, on its first token
    ("opt", ["model.decoder.project_in", "model.decoder.project_out"]),  # before and after the blocks
    ("xlm-roberta", ["lm_head.dense"]),  # the head's dense layer, before the (never loaded) decoder
])
def test_outside_statistics_equal_the_whole_model(tmp_path, model_type, outside):
    if model_type == "bert":
        amax = compare_outside(zoo.build("bert", tmp_path / "bert"))
    else:
        amax = compare_outside(_tiny(model_type, tmp_path), vocab=tiny_configs.VOCAB)
    assert set(outside) <= set(amax)


def test_a_heads_input_after_its_dense_layer_is_the_whole_models(tmp_path):
    """XLM-RoBERTa's LM head: dense, gelu, norm, then the decoder (the output embedding): the decoder's
    input (``lm_head``) is taken through the head's own code."""
    import transformers as tf

    src = _tiny("xlm-roberta", tmp_path)
    tokens = torch.randint(3, tiny_configs.VOCAB, (3, 16), generator=torch.Generator().manual_seed(4))
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    obs = calibrate.Observers()
    lm.observe(tokens, obs, head=True, micro_batch=2, progress=False)
    model = tf.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []
    model.get_output_embeddings().register_forward_pre_hook(lambda _m, a: seen.append(a[0].abs().amax()))
    with torch.no_grad():
        for s in range(0, 3, 2):
            model(input_ids=tokens[s: s + 2])
    assert torch.equal(obs["lm_head"].amax, torch.stack(seen).amax())
    assert lm.loaded == 0


def test_the_tail_holds_the_weights_outside_the_blocks_at_most(tmp_path):
    """Peak parameter bytes with the pooler observed: one block's or the weights outside the blocks, the
    same for 2 and 4 layers."""
    peaks = []
    for layers in (2, 4):
        src = _bert(tmp_path / f"bert{layers}", layers)
        lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
        obs = calibrate.Observers()
        lm.observe(torch.randint(3, 128, (2, 8)), obs, progress=False, outside=["pooler.dense"])
        assert obs["pooler.dense"].amax is not None
        block = max(sum(p.numel() for p in b.parameters()) for b in lm.layers) * 4
        outside = sum(p.numel() for n, p in lm.model.named_parameters() if not n.startswith(lm.layers_name + ".")) * 4
        assert lm.peak_loaded == max(block, outside) and lm.loaded == 0
        peaks.append(lm.peak_loaded)
    assert peaks[0] == peaks[1]


# -- the phases of the model's own forward, on a toy ----------------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h):
        return h + self.lin(h)


class _Toy(torch.nn.Module):
    """A projection before the blocks, a linear between blocks 0 and 1, a norm and a linear after."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))
        self.mid = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0:
                h = self.mid(h)
        return self.out(self.norm(h))


class _ToyRun:
    """What :func:`tail.tail_pass` reads of a LayerwiseModel, around a toy whose weights are all loaded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.layers_name = model, "layers"
        self.layers = list(model.layers)
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.heads: list[str] = []
        self.towers: list[str] = []
        self._meta_buffers: set[str] = set()

    def load_outside(self) -> None:
        pass

    def free_outside(self) -> None:
        pass


def test_tail_pass_observes_before_and_after_the_blocks_not_between():
    torch.manual_seed(0)
    model = _Toy().eval()
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        h = model.mid(model.layers[0](model.inp(x)))
        final = model.layers[2](model.layers[1](h))  # the last block's output, as the runner carries it
        after = model.norm(final)
    obs = calibrate.Observers()
    reach = tail.tail_pass(_ToyRun(model), model, [x], None, False, obs, finals=[final])  # type: ignore[arg-type]
    assert reach.phases == {"inp": {tail.BEFORE}, "mid": {tail.BETWEEN}, "out": {tail.AFTER}}
    assert reach.between == ["mid"] and reach.stopped is None
    assert set(obs) == {"inp", "out"}  # the input "mid" got from the stand-ins is not a whole-model forward's
    assert torch.equal(obs["inp"].amax, x.abs().amax()) and torch.equal(obs["out"].amax, after.abs().amax())
    assert all("forward" not in vars(b) for b in model.layers)  # the blocks are themselves again


def test_tail_pass_stops_at_a_module_no_checkpoint_tensor_loads():
    torch.manual_seed(0)
    model = _Toy().eval()
    model.norm.weight = torch.nn.Parameter(torch.empty(4, device="meta"))  # never loaded
    reach = tail.tail_pass(_ToyRun(model), model, [torch.randn(1, 3, 4)], ["inp", "out"], False)  # type: ignore[arg-type]
    assert reach.stopped == "norm" and "out" not in reach.phases and reach.phases["inp"] == {tail.BEFORE}


def test_discovery_on_real_models_says_where_each_linear_runs(tmp_path):
    lm = calibrate.LayerwiseModel(open_source(str(_tiny("opt", tmp_path / "opt"))), torch.device("cpu"))
    reach = tail.discover(lm, lm._forward, ["model.decoder.project_in", "model.decoder.project_out"], head=True)
    assert reach.phases == {"model.decoder.project_in": {tail.BEFORE}, "model.decoder.project_out": {tail.AFTER},
                            "lm_head": {tail.AFTER}}
    assert reach.between == [] and lm.loaded == 0
    lm = calibrate.LayerwiseModel(open_source(str(_tiny("llava", tmp_path / "llava"))), torch.device("cpu"))
    projector = [n for n in tail.outside_linears(lm) if "projector" in n]
    assert projector  # a VLM's projector runs on image features only
    reach = tail.discover(lm, lm._forward, projector, head=False)
    assert reach.phases == {} and lm.loaded == 0


# -- end to end: W4A4 and GPTQ of a BERT encoder with a pooler ------------------------------------------

def test_w4a4_and_gptq_of_an_encoder_with_a_pooler(tmp_path):
    """The plan quantizes BERT's pooler: W4A4 converts with its measured amax (the whole model's, bf16
    ceil), and --method gptq quantizes it too (nothing left to round-to-nearest; bytes not the RTN run's)."""
    import transformers as tf
    from safetensors.torch import load_file

    src = add_tokenizer(zoo.build("bert", tmp_path / "bert"))
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    common = ["--format", "compressed-tensors", "--calibration-data", data, "--calibration-samples", 4,
              "--calibration-seq-len", 32]
    r = _cli(src, tmp_path / "w4a4", "--activations", "nvfp4", *common)
    assert r.exit_code == 0, r.output
    cal = json.loads((tmp_path / "w4a4" / "fp4convert.json").read_text())["activations"]["calibration"]
    tokens = calibrate.file_tokens(tf.AutoTokenizer.from_pretrained(str(src)), data, 4, 32)
    want = outside_reference(src, tokens, micro_batch=8)
    assert cal["measured_amax"]["pooler.dense"] == calibrate.bf16_ceil(float(want["pooler.dense"].amax))
    r = _cli(src, tmp_path / "gptq", "--method", "gptq", *common)
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "gptq" / "fp4convert.json").read_text())["method"]
    quantized = [n for n, t in json.loads((tmp_path / "gptq" / "fp4convert.json").read_text())["tensors"].items()
                 if t["action"] == "quantize"]
    assert rec["rtn"] == [] and rec["quantized"] == len(quantized) and "pooler.dense.weight" in quantized
    r = _cli(src, tmp_path / "rtn", *common)
    assert r.exit_code == 0, r.output
    g, n = (load_file(str(next((tmp_path / d).glob("*.safetensors")))) for d in ("gptq", "rtn"))
    assert not torch.equal(g["pooler.dense.weight_packed"], n["pooler.dense.weight_packed"])


# -- what cannot be observed: refused before any sample is made or any block runs ----------------------

def _nothing_runs(monkeypatch) -> None:
    def ran(*a, **kw):
        raise AssertionError("the model ran")

    monkeypatch.setattr(calibrate.LayerwiseModel, "blocks", ran)
    monkeypatch.setattr("fp4convert.calibrate.stage.generate", ran)


@pytest.mark.parametrize("model_type,tensor,why", [
    ("markuplm", "embeddings.xpath_embeddings.xpath_unitseq2_embeddings.weight",
     "the model's forward on token ids does not reach it"),
    ("modernvbert", "vision_model.", "which calibration on token ids does not run"),
])
def test_w4a4_of_an_input_no_pass_observes_is_refused_before_anything_runs(tmp_path, monkeypatch, model_type,
                                                                            tensor, why):
    src = add_tokenizer(_tiny(model_type, tmp_path / "build"))
    _nothing_runs(monkeypatch)
    dst = tmp_path / "out"
    data = tmp_path / "calib.txt"  # encoders: no self-generated samples (refused while planning, before this)
    data.write_text(TEXT)
    r = _cli(src, dst, "--format", "compressed-tensors", "--activations", "nvfp4", "--calibration-data", data,
             "--calibration-samples", 2, "--calibration-seq-len", 16)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    line = errors[0]
    assert line.startswith(f"Error: {tensor}") and why in line and "activation calibration cannot observe" in line, line
    assert "--ignore " in line and "--activation-scale constant" in line, line
    assert "the model ran" not in r.output and not dst.exists()


def test_the_way_out_the_refusal_names_converts(tmp_path):
    """MarkupLM with the unreached tensor kept (--ignore, as the refusal says): W4A4 converts, its pooler
    and the xpath projections that do run measured."""
    src = add_tokenizer(_tiny("markuplm", tmp_path / "build"))
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    r = _cli(src, tmp_path / "out", "--format", "compressed-tensors", "--activations", "nvfp4", "--calibration-data",
             data, "--calibration-samples", 2, "--calibration-seq-len", 16,
             "--ignore", "embeddings.xpath_embeddings.xpath_unitseq2_embeddings.weight")
    assert r.exit_code == 0, r.output
    cal = json.loads((tmp_path / "out" / "fp4convert.json").read_text())["activations"]["calibration"]
    assert {"pooler.dense", "embeddings.xpath_embeddings.inner2emb"} <= set(cal["measured_amax"])


def test_weights_run_between_two_blocks_are_refused_in_every_mode(tmp_path, monkeypatch):
    """FlauBERT keeps its attentions and its feed-forward layers in separate lists: the run would carry one
    list's outputs past the other. Refused before anything runs, naming the module, even where the
    unobserved inputs themselves would only be left unweighted (--input-weights random)."""
    src = _tiny("flaubert", tmp_path / "build")
    _nothing_runs(monkeypatch)
    dst = tmp_path / "out"
    r = _cli(src, dst, "--input-weights", "random", "--calibration-samples", 2, "--calibration-seq-len", 16)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "the layer-by-layer run cannot run this model: its forward runs " in errors[0], errors[0]
    assert "between two of its blocks (ffns)" in errors[0], errors[0]
    assert "the model ran" not in r.output and not dst.exists()


def test_gptq_lists_what_no_pass_observes_and_quantizes_the_rest(tmp_path):
    """--method gptq on MarkupLM: the linear its forward never calls is rounded to nearest and listed in the
    manifest's method.rtn; the pooler and the xpath projections that run are GPTQ's."""
    src = add_tokenizer(_tiny("markuplm", tmp_path / "build"))
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    r = _cli(src, tmp_path / "out", "--method", "gptq", "--calibration-data", data, "--calibration-samples", 2,
             "--calibration-seq-len", 16)
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "out" / "fp4convert.json").read_text())
    quantized = [n for n, t in m["tensors"].items() if t["action"] == "quantize"]
    assert m["method"]["rtn"] == ["embeddings.xpath_embeddings.xpath_unitseq2_embeddings"]
    assert m["method"]["quantized"] == len(quantized) - 1 and "pooler.dense.weight" in quantized
