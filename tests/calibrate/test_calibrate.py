"""Layer-by-layer activation calibration (fp4convert.calibrate)."""

from __future__ import annotations

from pathlib import Path


def add_tokenizer(path: Path) -> Path:
    """A character-level tokenizer (ids below the zoo's vocab of 128) saved beside a zoo checkpoint."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return Path(path)


import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from fp4convert import calibrate
from fp4convert.cli.main import main
from fp4convert.config import ConvertConfig
from fp4convert.source.open import open_source
from tests import zoo

ROOT = Path(__file__).resolve().parents[2]
TEXT = ("The quick brown fox jumps over the lazy dog. " * 40 + "Pack my box with five dozen liquor jugs. " * 40)


def cli(*args):
    return CliRunner().invoke(main, ["quantize", *[str(a) for a in args], "--device", "cpu"])


def gemma3_text(path: Path) -> Path:
    """A tiny Gemma 3 text model: a scaled embedding (a computed buffer), sandwich norms, q/k norms,
    sliding and full attention layers with two RoPE bases (window 4, shorter than the test samples)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                              intermediate_size=128, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    tf.Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    return Path(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("calib")
    out = {f: add_tokenizer(zoo.build(f, root / f)) for f in ("llama", "qwen3_tied")}
    out["gemma3_text"] = add_tokenizer(gemma3_text(root / "gemma3_text"))
    return out


def whole_model_amax(path: Path, tokens: torch.Tensor, micro_batch: int) -> dict[str, torch.Tensor]:
    """The reference: the whole model loaded normally (fp32), every nn.Linear input's amax by hooks."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    amax: dict[str, torch.Tensor] = {}

    def hook_for(name):
        def hook(_m, args):
            a = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return hook

    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            m.register_forward_pre_hook(hook_for(n))
    with torch.no_grad():
        for s in range(0, tokens.shape[0], micro_batch):
            model(tokens[s: s + micro_batch])
    return amax


@pytest.mark.parametrize("family", ["llama", "qwen3_tied", "gemma3_text"])
def test_layerwise_amax_equals_the_whole_model_run_normally(models, family):
    tokens = torch.randint(3, 98, (5, 24), generator=torch.Generator().manual_seed(1))
    lm = calibrate.LayerwiseModel(open_source(str(models[family])), torch.device("cpu"))
    got = calibrate.layerwise_amax(lm, tokens, micro_batch=2)
    want = whole_model_amax(models[family], tokens, micro_batch=2)
    assert set(got) == set(want) and len(want) == 14
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_mean_squares_equal_the_whole_model_run_normally(models, family):
    """E[x_j^2] per linear input (the input_weight of the weight scale rules), layer by layer, equals
    the whole model's, in fp64 rounded to bf16 the same way; micro-batching does not change it."""
    import transformers as tf

    tokens = torch.randint(3, 98, (5, 24), generator=torch.Generator().manual_seed(3))
    lm = calibrate.LayerwiseModel(open_source(str(models[family])), torch.device("cpu"))
    got: dict[str, torch.Tensor] = {}
    calibrate.layerwise_amax(lm, tokens, micro_batch=2, mean_square=got)
    model = tf.AutoModelForCausalLM.from_pretrained(str(models[family]), dtype=torch.float32).eval()
    xs: dict[str, list] = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n != "lm_head":
            m.register_forward_pre_hook(lambda _m, a, _n=n: xs.setdefault(_n, []).append(a[0].detach()))
    with torch.no_grad():
        model(tokens)
    assert set(got) == set(xs) and len(xs) == 14
    for n, parts in xs.items():
        x = torch.cat(parts).reshape(-1, parts[0].shape[-1]).double()
        want = (x * x).mean(0).to(torch.bfloat16).float()
        assert got[n].shape == want.shape and got[n].dtype == torch.float32
        # layer-wise and whole-model fp32 activations can differ in the last bit; bf16 absorbs that
        # except on a rounding boundary: at most one bf16 step apart
        assert torch.allclose(got[n], want, rtol=2.0**-7, atol=0.0), n
        assert bool((got[n] > 0).all()), n


def test_lm_head_input_is_the_final_norm_output(models):
    tokens = torch.randint(3, 98, (2, 16), generator=torch.Generator().manual_seed(2))
    lm = calibrate.LayerwiseModel(open_source(str(models["llama"])), torch.device("cpu"))
    got = calibrate.layerwise_amax(lm, tokens, wanted={"lm_head"})["lm_head"]
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(models["llama"]), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.model(tokens).last_hidden_state.abs().amax()
    assert torch.equal(got, want)


def test_calibration_files_plain_text_and_json_lines(tmp_path):
    (tmp_path / "a.txt").write_text("line one\n{not json\n")
    assert calibrate.read_texts(tmp_path / "a.txt") == ["line one\n{not json\n"]
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x y"}) + "\n\n" + json.dumps({"text": "z"}) + "\n")
    assert calibrate.read_texts(tmp_path / "b.jsonl") == ["x y", "z"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"txt": "x"}) + "\n")
    with pytest.raises(calibrate.PlanError, match="text"):
        calibrate.read_texts(tmp_path / "c.jsonl")


def test_file_calibration_is_recorded_and_reproducible(models, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    outs = []
    for k in range(2):
        dst = tmp_path / f"o{k}"
        r = cli(models["llama"], dst, "--format", "compressed-tensors", "--activations", "nvfp4",
                "--calibration-data", data, "--calibration-samples", 4, "--calibration-seq-len", 32)
        assert r.exit_code == 0, r.output
        outs.append(dst)
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()
    cal = json.loads((outs[0] / "fp4convert.json").read_text())["activations"]["calibration"]
    assert cal["data"]["source"] == "file" and cal["data"]["name"] == "calib.txt"
    assert cal["samples"] == 4 and cal["seq_len"] == 32 and cal["seed"] == 0
    assert cal["tokenizer_sha256"] == calibrate.tokenizer_digest(models["llama"])
    assert len(cal["amax"]) == 14 and all(v > 0 for v in cal["amax"].values())


def test_self_generated_samples_are_seeded_and_deterministic(models):
    import transformers as tf

    src = open_source(str(models["llama"]))
    tok = tf.AutoTokenizer.from_pretrained(str(models["llama"]))
    runs = [calibrate.generate(calibrate.LayerwiseModel(src, torch.device("cpu")), tok, 3, 10, seed)
            for seed in (0, 0, 1)]
    assert runs[0].shape == (3, 10) and (runs[0][:, 0] == tok.bos_token_id).all()
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert len({tuple(r.tolist()) for r in runs[0]}) == 3  # sampled: the samples differ


@pytest.mark.parametrize("family", ["qwen3_tied", "gemma3_text"])
def test_self_generated_tokens_are_what_the_whole_model_would_sample(models, family):
    """Each generated token is drawn from the whole model's next-token distribution (KV cache per
    layer; Gemma 3: the sliding window shorter than the samples)."""
    import transformers as tf

    src = open_source(str(models[family]))
    tok = tf.AutoTokenizer.from_pretrained(str(models[family]))
    tokens = calibrate.generate(calibrate.LayerwiseModel(src, torch.device("cpu")), tok, 2, 8, 0)
    model = tf.AutoModelForCausalLM.from_pretrained(str(models[family]), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        logits = model(tokens).logits
    for t in range(7):
        probs = torch.softmax(logits[:, t, : len(tok)].float(), dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        assert torch.equal(nxt[:, 0], tokens[:, t + 1]), t


def test_refusals_exit_2_before_anything_is_written(models, tmp_path):
    bare = zoo.build("llama", tmp_path / "notok")  # no tokenizer
    r = cli(bare, tmp_path / "o1", "--format", "compressed-tensors", "--activations", "nvfp4")
    assert r.exit_code == 2 and "tokenizer" in r.output and not (tmp_path / "o1").exists()
    moe = add_tokenizer(zoo.build("mixtral", tmp_path / "mixtral"))
    r = cli(models["llama"], tmp_path / "o3", "--format", "modelopt", "--activations", "nvfp4",
            "--calibration-data", tmp_path / "missing.txt")
    assert r.exit_code == 2 and "missing.txt" in r.output and not (tmp_path / "o3").exists()
    noconf = tmp_path / "noconf"
    noconf.mkdir()
    for f in models["llama"].iterdir():
        if f.name != "config.json":
            (noconf / f.name).write_bytes(f.read_bytes())
    r = cli(noconf, tmp_path / "o4", "--format", "compressed-tensors", "--activations", "nvfp4")
    assert r.exit_code == 2 and "config.json" in r.output and not (tmp_path / "o4").exists()
    # the same refused models convert with the explicit constant scale
    r = cli(moe, tmp_path / "o5", "--format", "compressed-tensors", "--activations", "nvfp4",
            "--activation-scale", "constant")
    assert r.exit_code == 0, r.output


def _deep(path: Path, layers: int, hidden: int = 64, inter: int = 128) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    return add_tokenizer(path)


def test_materialized_weights_do_not_grow_with_layer_count(tmp_path):
    """Deterministic measure: the most parameter bytes ever materialized at once is one layer's or
    the weights outside the layers (embedding, final norm: freed before the first layer), the same for
    2 and 16 layers."""
    tokens = torch.randint(3, 98, (2, 16), generator=torch.Generator().manual_seed(3))
    peaks = {}
    for n in (2, 16):
        lm = calibrate.LayerwiseModel(open_source(str(_deep(tmp_path / f"d{n}", n))), torch.device("cpu"))
        calibrate.layerwise_amax(lm, tokens)
        peaks[n] = lm.peak_loaded
        assert lm.loaded == 0  # everything freed
    layer = sum(p.numel() for p in lm.layers[0].parameters()) * 4
    outside = (128 * 64 + 64) * 4  # embedding and final norm
    assert peaks[2] == peaks[16] == max(layer, outside)


# VmHWM (this process image's own high-water mark), not ru_maxrss: Linux carries the parent's resident
# size at fork/vfork into the child's ru_maxrss across exec, so a big test process would inflate it.
RSS_SCRIPT = r"""
import sys, torch
from fp4convert import calibrate
from fp4convert.source.open import open_source
lm = calibrate.LayerwiseModel(open_source(sys.argv[1]), torch.device("cpu"))
tokens = torch.randint(3, 98, (4, 64), generator=torch.Generator().manual_seed(0))
calibrate.layerwise_amax(lm, tokens)
print(next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:")))
"""


def peak_rss(path: Path) -> int:
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}  # nothing a parent set
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path)], capture_output=True, text=True, check=True,
                         cwd=ROOT, env=env)
    return int(out.stdout.split()[-1])


def test_peak_rss_is_flat_in_layer_count(tmp_path):
    """Real process peak RSS: 16 layers of 13.6 MB (fp32) each would add ~200 MB if they accumulated."""
    rss = {n: peak_rss(_deep(tmp_path / f"r{n}", n, hidden=512, inter=1536)) for n in (2, 16)}
    assert rss[16] < rss[2] * 1.05 + (32 << 20), rss


def test_random_tokens_are_seeded_uniform_ids_in_the_vocabulary():
    a = calibrate.random_tokens(50, 3, 40, seed=7)
    assert a.shape == (3, 40) and a.dtype == torch.long
    assert int(a.min()) >= 0 and int(a.max()) < 50
    assert torch.equal(a, calibrate.random_tokens(50, 3, 40, seed=7))
    assert not torch.equal(a, calibrate.random_tokens(50, 3, 40, seed=8))
    assert len(set(a.reshape(-1).tolist())) > 40  # spread over the vocabulary, not a constant
    with pytest.raises(Exception, match="random calibration tokens"):
        calibrate.random_tokens(0, 1, 1)


# -- a config.json transformers cannot read, build or run: refused (exit 2), one line, nothing written --

def _edited(src: Path, dst: Path, edit: dict) -> Path:
    """A copy of checkpoint ``src`` whose config.json has the keys of ``edit`` set."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(edit)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _refusal(r, folder: Path) -> str:
    """The run's one error line (exit 2), which names the folder."""
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert r.exit_code == 2 and len(lines) == 1, (r.exit_code, r.output)
    assert lines[0].startswith(f"Error: {folder}: "), lines[0]
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    return lines[0]


BAD_CONFIGS = [  # (family, config.json edit, what the message names) -- each failed with exit 1 before
    ("llama", {"vocab_size": 128 * 50}, "vocab_size 6400 is larger than the 128 rows of model.embed_tokens.weight"),
    ("llama", {"rope_scaling": "linear"}, "'rope_scaling'"),
    ("llama", {"num_attention_heads": 0}, "'num_attention_heads'"),
    ("llama", {"vocab_size": True}, "vocab_size=True is not a positive integer"),
    ("llama", {"head_dim": 8}, "q_proj.weight is"),
    ("gemma3_text", {"vocab_size": 100000}, "vocab_size 100000 is larger"),
    ("gemma3_text", {"rope_scaling": [1, 2]}, "'rope_scaling'"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "nonsense", "factor": 2.0}}, "'rope_scaling'"),
    ("gemma3_text", {"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "'rope_scaling'"),
    ("gemma3_text", {"sliding_window": "4"}, "'sliding_window'"),
    ("gemma3_text", {"num_hidden_layers": 3}, "'num_hidden_layers'"),
    ("gemma3_text", {"layer_types": ["weird_attention", "full_attention"]}, "'layer_types'"),
    ("gemma3_text", {"hidden_activation": "nope"}, "'hidden_activation'"),
    ("gemma3_text", {"query_pre_attn_scalar": 0}, "'query_pre_attn_scalar'"),
    ("gemma3_text", {"final_logit_softcapping": "x"}, "'final_logit_softcapping'"),
    ("gemma3_text", {"head_dim": 16}, "q_proj.weight is [64, 64] in the checkpoint but [32, 64]"),
]


@pytest.mark.parametrize("family,edit,names", BAD_CONFIGS, ids=[f"{f}-{next(iter(e))}-{i}"
                                                               for i, (f, e, _) in enumerate(BAD_CONFIGS)])
def test_input_weights_random_refuses_a_config_the_model_cannot_be_built_or_run_from(models, tmp_path, family,
                                                                                       edit, names):
    """Refused while planning, before the model runs or anything is written: the folder, the key (or the
    tensor the config disagrees with), what to do."""
    src = _edited(models[family], tmp_path / "src", edit)
    r = cli(src, tmp_path / "out", "--input-weights", "random", "--calibration-samples", 2,
            "--calibration-seq-len", 8)
    line = _refusal(r, src)
    assert names in line and "fix config.json" in line and line.endswith("or use --input-weights none"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit,names", [({"rope_scaling": "linear"}, "'rope_scaling'"),
                                        ({"hidden_act": "nope"}, "'hidden_act'"),
                                        ({"intermediate_size": 64}, "mlp.gate_proj.weight is")])
def test_activation_calibration_refuses_the_same_configs(models, tmp_path, edit, names):
    """W4A4's calibration runs the same layer-by-layer stage: the same refusal, its own way out."""
    src = _edited(models["llama"], tmp_path / "src", edit)
    r = cli(src, tmp_path / "out", "--format", "compressed-tensors", "--activations", "nvfp4",
            "--calibration-samples", 2, "--calibration-seq-len", 8)
    line = _refusal(r, src)
    assert names in line and "fix config.json" in line and line.endswith("or use --activation-scale constant"), line
    assert not (tmp_path / "out").exists()


def test_token_ids_beyond_the_embedding_are_refused_not_an_index_error(models):
    """The forward's guard (ids from a tokenizer larger than the embedding): a refusal naming the tensor."""
    lm = calibrate.LayerwiseModel(open_source(str(models["llama"])), torch.device("cpu"))
    with pytest.raises(calibrate.PlanError, match=r"token id 128 is not below the 128 rows of "
                                                  r"model\.embed_tokens\.weight") as got:
        lm.check_tokens(torch.tensor([[1, 128]]))
    assert "\n" not in str(got.value) and str(models["llama"]) in str(got.value)


def test_a_failing_forward_is_a_refusal_and_other_errors_pass_unchanged(models, tmp_path, monkeypatch):
    """Whatever transformers raises while the layers run is the same refusal (exit 2, nothing written);
    fp4convert's own errors, MemoryError and Ctrl-C are not rewritten."""
    from fp4convert.errors import QuantizationError

    def failing(exc):
        def run_layer(self, *a, **kw):
            raise exc
        return run_layer

    monkeypatch.setattr(calibrate.LayerwiseModel, "run_layer", failing(RuntimeError("size of tensor a (3)\nmismatch")))
    r = cli(models["llama"], tmp_path / "o1", "--input-weights", "random", "--calibration-samples", 2,
            "--calibration-seq-len", 8)
    line = _refusal(r, models["llama"])
    assert "cannot run the model of this config.json" in line and "RuntimeError: size of tensor a (3) mismatch" in line
    assert not (tmp_path / "o1").exists()
    src = open_source(str(models["llama"]))
    for exc in (QuantizationError("x"), MemoryError(), KeyboardInterrupt(), OSError(5, "EIO", "w.safetensors")):
        monkeypatch.setattr(calibrate.LayerwiseModel, "run_layer", failing(exc))
        with pytest.raises(type(exc)) as got:
            calibrate.layerwise_amax(calibrate.LayerwiseModel(src, torch.device("cpu")), torch.ones(1, 4, dtype=torch.long))
        assert got.value is exc
        with pytest.raises(type(exc)) as got, calibrate.model_errors(src.root, {}, "run the model of", "or not"):
            raise exc
        assert got.value is exc
