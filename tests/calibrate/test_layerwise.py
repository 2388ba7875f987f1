"""The block-by-block runner (fp4convert.calibrate.layerwise) against the whole model run normally.

For a tiny model of every architecture class (dense, MoE routed per-expert on disk, MoE stacked 3-D
on disk, hybrid attention/SSM, a VLM's text decoder, an encoder): the runner's statistics equal those
of the same observers hooked into the whole model loaded by transformers and run in one forward per
micro-batch (amax ``torch.equal``; mean squares within one bf16 step). Encoder-decoders are refused
before anything runs, naming why.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4convert import calibrate
from fp4convert.calibrate.capture import ExpertTap, is_expert_stack
from fp4convert.calibrate.model import find_blocks, model_class
from fp4convert.source.open import open_source
from tests import tiny_configs, zoo


def whole_model_stats(path: Path, tokens: torch.Tensor, micro_batch: int,
                      device: str = "cpu") -> calibrate.Observers:
    """The reference: the whole model loaded by transformers (fp32), the runner's observers hooked on
    every linear / expert stack of its blocks, one forward per micro-batch (on a GPU with the runner's
    TF32 matmuls)."""
    from fp4convert.calibrate.layerwise import fast_matmul

    import json

    import transformers as tf
    from transformers.pytorch_utils import Conv1D

    raw = json.loads((path / "config.json").read_text())
    cfg = tf.AutoConfig.from_pretrained(str(path))
    cls = model_class(tf, cfg, raw.get("architectures") or [])
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval().to(device)
    obs = calibrate.Observers(squares=True)
    name, blocks = find_blocks(model)
    for i, b in enumerate(blocks):
        for n, m in b.named_modules():
            full = f"{name}.{i}.{n}"
            if isinstance(m, (torch.nn.Linear, Conv1D)):
                m.register_forward_pre_hook(lambda _m, a, _n=full: obs.add(_n, a[0]))
            elif is_expert_stack(m):
                ExpertTap(full, m, obs)
    with torch.no_grad(), fast_matmul(torch.device(device)):
        for s in range(0, tokens.shape[0], micro_batch):
            model(input_ids=tokens[s: s + micro_batch].to(device), use_cache=False)
    return obs


def compare(path: Path, vocab: int = 100, device: str = "cpu") -> dict[str, torch.Tensor]:
    tokens = torch.randint(3, vocab, (5, 24), generator=torch.Generator().manual_seed(1))
    lm = calibrate.LayerwiseModel(open_source(str(path)), torch.device(device))
    got = calibrate.Observers(squares=True)
    lm.observe(tokens, got, micro_batch=2)
    want = whole_model_stats(path, tokens, micro_batch=2, device=device)
    assert set(got) == set(want) and len(want) > 0
    for n in want:
        assert torch.equal(got[n].amax, want[n].amax), n
        a, b = got[n].mean_square(), want[n].mean_square()
        assert torch.allclose(a, b, rtol=2.0 ** -7, atol=0.0), n
    assert lm.loaded == 0  # every weight released
    return got.amax()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "llama4", "gemma3",
                                    "bert"])
def test_runner_statistics_equal_the_whole_model(tmp_path, family):
    """dense (llama), MoE routed per expert on disk (qwen3_moe, mixtral, deepseek_v3: MLA attention and
    shared experts), MoE stacked on disk (gpt_oss, llama4), a VLM's text decoder (gemma3
    image-text-to-text), an encoder (BERT)."""
    src = zoo.build(family, tmp_path / family)
    amax = compare(src)
    if zoo.FAMILIES[family].moe:
        downs = [n for n in amax if ":down:" in n]
        ins = [n for n in amax if n.endswith(":in")]
        assert ins and downs  # every expert's down input, from every token
        layer0 = {n for n in downs if ".0." in n.split(":")[0]}
        assert len(layer0) == 4 or len(downs) % 4 == 0


def _gpu() -> bool:
    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
def test_runner_statistics_equal_the_whole_model_on_the_gpu(tmp_path, family):
    """On a GPU (blocks read into the pinned buffers, the next block read ahead, TF32 forwards on both
    sides): the same statistics as the whole model run there, every weight released."""
    import json

    src = zoo.build(family, tmp_path / family)
    cfg = json.loads((src / "config.json").read_text())
    key = next(k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in cfg)
    assert cfg[key] >= 2  # the read-ahead buffer is refilled at least once
    compare(src, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
def test_self_generation_on_the_gpu_is_seeded_and_streams(tokenized):
    """Samples drawn on the GPU: the same seed gives the same samples run to run, streaming one block at a
    time gives the resident run's samples, another seed other samples; nothing stays loaded."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(tokenized))

    def gen(seed, resident_bytes=None):
        lm = calibrate.LayerwiseModel(open_source(str(tokenized)), torch.device("cuda"))
        out = calibrate.generate(lm, tok, 3, 12, seed, resident_bytes=resident_bytes)
        assert lm.loaded == 0 and out.device.type == "cpu" and out.shape == (3, 12)
        return out

    a, b, streamed, other = gen(0), gen(0), gen(0, resident_bytes=0), gen(1)
    assert torch.equal(a, b) and torch.equal(a, streamed) and not torch.equal(a, other)


@pytest.mark.cuda
@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
def test_self_generation_replayed_as_a_cuda_graph_gives_the_eager_samples(tokenized, monkeypatch, caplog):
    """The resident run replays one captured step (it says so); its samples are those of the same
    steps run eagerly (the capture refused), and the run is deterministic."""
    import logging

    import transformers as tf

    from fp4convert.calibrate import decode

    tok = tf.AutoTokenizer.from_pretrained(str(tokenized))

    def gen():
        lm = calibrate.LayerwiseModel(open_source(str(tokenized)), torch.device("cuda"))
        return calibrate.generate(lm, tok, 4, 40, 7)

    with caplog.at_level(logging.INFO, logger="fp4convert.calibrate.samples"):
        graphed = gen()
    assert "replayed as a CUDA graph" in caplog.text
    assert torch.equal(graphed, gen())
    monkeypatch.setattr(decode.GraphedSteps, "_capture", lambda self: False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp4convert.calibrate.samples"):
        eager = gen()
    assert "replayed as a CUDA graph" not in caplog.text
    assert torch.equal(graphed, eager)


@pytest.mark.parametrize("model_type", ["jamba", "lfm2"])
def test_runner_statistics_equal_the_whole_model_hybrid(tmp_path, model_type):
    """Hybrid attention/SSM decoders (the SSM mixers run their own forward; no cache)."""
    out = tiny_configs.build(model_type, tmp_path)
    if not out.ok:
        pytest.skip(f"{model_type}: tiny build failed ({out.error})")
    compare(Path(out.path), vocab=tiny_configs.VOCAB)


def test_all_experts_see_every_token_while_the_output_uses_the_router(tmp_path):
    """Statistics of every expert's down input come from every calibration token (an expert the
    router never picks still gets a real scale); the hidden states carried on are the routed ones."""
    import transformers as tf

    src = zoo.build("qwen3_moe", tmp_path / "moe")
    model = tf.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(7, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(0))
    obs = calibrate.Observers(squares=True)
    tap = ExpertTap("e", experts, obs)
    idx = torch.zeros(7, 1, dtype=torch.long)  # the router sends every token to expert 0 only
    with torch.no_grad():
        routed = experts(x, idx, torch.ones(7, 1))
    tap.remove()
    with torch.no_grad():
        for e in range(experts.down_proj.shape[0]):
            gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = experts.act_fn(gate) * up
            assert torch.equal(obs[f"e:down:{e}"].amax, h.abs().amax()), e
        want = torch.nn.functional.linear(
            experts.act_fn(torch.nn.functional.linear(x, experts.gate_up_proj[0]).chunk(2, -1)[0])
            * torch.nn.functional.linear(x, experts.gate_up_proj[0]).chunk(2, -1)[1], experts.down_proj[0])
    assert torch.allclose(routed, want, atol=1e-6)  # the output is the routed one
    assert torch.equal(obs["e:in"].amax, x.abs().amax())
    assert tap.routed.tolist()[0] == 7 and sum(tap.routed.tolist()[1:]) == 0


def test_weights_outside_the_blocks_and_one_block_at_most(tmp_path):
    """Deterministic memory measure on a MoE with converted (merged) experts: the most parameter bytes
    materialized at once is one block's or the prefix's, whatever the depth."""
    src = zoo.build("qwen3_moe", tmp_path / "moe")
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    lm.observe(torch.randint(3, 100, (2, 8)), calibrate.Observers())
    block = max(sum(p.numel() for p in b.parameters()) for b in lm.layers) * 4
    outside = sum(p.numel() for n, p in lm.model.named_parameters()
                  if not n.startswith(lm.layers_name + ".") and not any(n.startswith(h + ".") for h in lm.heads)) * 4
    assert lm.peak_loaded == max(block, outside) and lm.loaded == 0


def test_encoder_decoder_is_refused_naming_why(tmp_path):
    out = tiny_configs.build("t5", tmp_path)
    if not out.ok:
        pytest.skip(f"t5: tiny build failed ({out.error})")
    with pytest.raises(calibrate.PlanError, match="encoder-decoder"):
        calibrate.LayerwiseModel(open_source(out.path), torch.device("cpu"))


def test_nan_activations_are_a_one_line_refusal(tmp_path):
    from safetensors.torch import load_file, save_file

    src = zoo.build("llama", tmp_path / "l")
    f = zoo.shard_files(src)[0]
    t = load_file(str(f))
    t["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(t, str(f), metadata={"format": "pt"})
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    with pytest.raises(calibrate.PlanError, match="NaN/Inf") as got:
        lm.observe(torch.randint(3, 100, (2, 8)), calibrate.Observers())
    assert "\n" not in str(got.value)


# -- bad calibration input and a destination that would be refused: one line, before the model runs --

def _cli(*args):
    from click.testing import CliRunner

    from fp4convert.cli.main import main

    return CliRunner().invoke(main, ["quantize", *[str(a) for a in args], "--device", "cpu"])


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> Path:
    from tests.calibrate.test_calibrate import add_tokenizer

    return add_tokenizer(zoo.build("llama", tmp_path_factory.mktemp("bad") / "llama"))


BAD_FILES = [
    ("empty.txt", b"", "empty"),
    ("blank.txt", b"  \n\n ", "empty"),
    ("binary.txt", b"text\x00\x01\x02more", "binary"),
    ("latin1.txt", "caf\u00e9 ".encode("latin-1") * 50, "not UTF-8"),
    ("shape.jsonl", b'{"txt": "x"}\n', "'text'"),
    ("list.jsonl", b'{"text": ["a"]}\n', "'text'"),
    ("broken.jsonl", b'{"text": "a"}\n{"text": \n', "not a JSON line"),
    ("short.txt", b"only a few words", "fewer than the"),
]


@pytest.mark.parametrize("name,data,says", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_calibration_input_is_one_line_before_anything_is_written(tokenized, tmp_path, monkeypatch, name, data,
                                                                      says):
    f = tmp_path / name
    f.write_bytes(data)

    def no_run(*a, **kw):
        raise AssertionError("the model ran")

    monkeypatch.setattr(calibrate.LayerwiseModel, "observe", no_run)
    r = _cli(tokenized, tmp_path / "out", "--format", "compressed-tensors", "--activations", "nvfp4",
             "--calibration-data", f, "--calibration-samples", 4, "--calibration-seq-len", 32)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert says in lines[0] and name in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_a_destination_the_writer_refuses_is_refused_before_the_model_runs(tokenized, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "something.txt").write_text("x")

    def no_run(*a, **kw):
        raise AssertionError("the model ran")

    monkeypatch.setattr(calibrate.LayerwiseModel, "__init__", no_run)
    r = _cli(tokenized, dst, "--format", "compressed-tensors", "--activations", "nvfp4", "--calibration-samples", 2,
             "--calibration-seq-len", 8)
    assert r.exit_code != 0 and "exists and is not empty" in r.output, r.output
    assert "the model ran" not in r.output
    assert sorted(p.name for p in dst.iterdir()) == ["something.txt"]


def test_self_generation_streaming_one_block_at_a_time_equals_resident(tokenized):
    """A model too large to keep resident generates the same samples, re-reading one block at a time."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(tokenized))
    lm = calibrate.LayerwiseModel(open_source(str(tokenized)), torch.device("cpu"))
    resident = calibrate.generate(lm, tok, 2, 6, 0)
    assert lm.loaded == 0
    lm = calibrate.LayerwiseModel(open_source(str(tokenized)), torch.device("cpu"))
    streamed = calibrate.generate(lm, tok, 2, 6, 0, resident_bytes=0)
    assert torch.equal(resident, streamed) and lm.loaded == 0
    block = max(sum(p.numel() for p in b.parameters()) for b in lm.layers) * 4
    assert len(lm.layers) > 1 and lm.peak_loaded <= lm.total_bytes() - block * (len(lm.layers) - 1)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "gpt_oss"])
def test_w4a4_and_input_weights_of_vlm_and_moe_use_the_runner_statistics(tmp_path, family):
    """End to end (CLI): every quantized module of a VLM's text decoder / a MoE (experts included) gets
    its measured amax under the plan's (checkpoint) name, equal to the whole model's for that module
    (bf16 ceil); --input-weights random weights every matrix."""
    import json

    import transformers as tf

    from fp4convert.calibrate import bf16_ceil, file_tokens
    from tests.calibrate.test_calibrate import TEXT, add_tokenizer

    src = add_tokenizer(zoo.build(family, tmp_path / family))
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    r = _cli(src, tmp_path / "w4a4", "--format", "compressed-tensors", "--activations", "nvfp4",
             "--calibration-data", data, "--calibration-samples", 4, "--calibration-seq-len", 32)
    assert r.exit_code == 0, r.output
    cal = json.loads((tmp_path / "w4a4" / "fp4convert.json").read_text())["activations"]["calibration"]
    assert set(cal["measured_amax"]) == set(cal["amax"]) and len(cal["amax"]) > 0
    tokens = file_tokens(tf.AutoTokenizer.from_pretrained(str(src)), data, 4, 32)
    want = whole_model_stats(src, tokens, micro_batch=8)
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import plan_conversion

    _, plan, _ = plan_conversion(str(src), ConvertConfig(format="compressed-tensors"))
    inputs = calibrate.plan_inputs(lm, plan)
    assert set(inputs) == set(cal["amax"])
    for module, name in inputs.items():
        assert cal["measured_amax"][module] == bf16_ceil(float(want[name].amax)), module
    r = _cli(src, tmp_path / "iw", "--input-weights", "random", "--calibration-samples", 2, "--calibration-seq-len", 16)
    assert r.exit_code == 0, r.output
    record = _find_record(json.loads((tmp_path / "iw" / "fp4convert.json").read_text()))
    assert record is not None and record["unweighted"] == [] and record["weighted"] == len(cal["amax"])


def _find_record(obj):
    """The input-weight record (the dict with ``weighted``/``unweighted``) anywhere in a manifest."""
    if isinstance(obj, dict):
        if "weighted" in obj and "unweighted" in obj:
            return obj
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            got = _find_record(v)
            if got is not None:
                return got
    return None


def test_ctrl_c_during_calibration_says_nothing_was_written(tokenized, tmp_path, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate.LayerwiseModel, "observe", interrupted)
    r = _cli(tokenized, tmp_path / "out", "--input-weights", "random", "--calibration-samples", 2,
             "--calibration-seq-len", 8)
    assert r.exit_code == 130 and "during calibration, before anything was written" in r.output, r.output
    assert "finished shards are kept" not in r.output and not (tmp_path / "out").exists()


def test_observer_accumulates_amax_mean_squares_and_hessian_over_batches():
    """What GPTQ-style methods read next: (1/n) X^T X in fp64 over every token of every batch; the
    amax and bf16 mean squares as the W4A4 scales and input weights use them."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g) * 3]
    obs = calibrate.Observers(squares=True, hessian=True)
    for p in parts:
        obs.add("x", p)
    x = torch.cat([p.reshape(-1, 32) for p in parts]).double()
    o = obs["x"]
    assert torch.equal(o.amax, torch.cat([p.reshape(-1) for p in parts]).abs().amax())
    assert o.count == 25
    assert torch.allclose(o.hessian_matrix(), x.T @ x / 25, rtol=1e-12, atol=1e-12)
    assert torch.equal(o.mean_square(), (x * x).mean(0).to(torch.bfloat16).float())
    obs.add("x", torch.empty(0, 32))  # a call no token reached changes nothing
    assert o.count == 25


def test_a_visited_block_runs_again_observing_only_the_inputs_named(tmp_path):
    """Visit.again (GPTQ's true-sequential steps): the block runs again on the same inputs with its
    weights as reloaded, and only the named inputs are observed. Reloaded as read, the statistics come
    back the same; with v_proj reloaded as zeros, o_proj's input (the attention's output) is zero; the
    other inputs' statistics are not touched."""
    src = zoo.build("llama", tmp_path / "llama")
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    tokens = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))
    obs = calibrate.Observers(squares=True)
    visits = lm.blocks(tokens, obs, micro_batch=2, progress=False, keep_reads=True)
    visit = next(visits)
    o_proj, q_proj = visit.prefix + "self_attn.o_proj", visit.prefix + "self_attn.q_proj"
    before = {n: (o.amax.clone(), o.sum_sq.clone(), o.count) for n, o in obs.items()}
    assert float(before[o_proj][0]) > 0
    read = dict(visit.reads)
    assert read and all(k.startswith(visit.prefix) for k in read)  # the block's checkpoint tensors, as read
    lm.reload_block(visit, read)
    obs.drop([o_proj])
    visit.again([o_proj])
    assert torch.equal(obs[o_proj].amax, before[o_proj][0]) and obs[o_proj].count == before[o_proj][2]
    assert torch.allclose(obs[o_proj].sum_sq, before[o_proj][1], rtol=1e-12, atol=0)
    v = visit.prefix + "self_attn.v_proj.weight"
    lm.reload_block(visit, {**read, v: torch.zeros_like(read[v])})
    obs.drop([o_proj])
    visit.again([o_proj])
    assert float(obs[o_proj].amax) == 0.0
    for n, (a, sq, count) in before.items():
        if n != o_proj:
            assert torch.equal(obs[n].amax, a) and torch.equal(obs[n].sum_sq, sq) and obs[n].count == count, n
    assert q_proj in obs and obs.only is None
    visits.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_rerun_without_outputs_stops_once_its_inputs_are_observed(tmp_path, family):
    """Visit.again(names, outputs=False) (GPTQ's true-sequential reruns): each micro-batch's block call ends once
    every named input is observed, the rest of the block is not run, and the statistics are the same bits as a
    rerun to the end. An input a call feeds other than once (an expert the router may skip) runs to the end."""
    src = zoo.build(family, tmp_path / family)
    lm = calibrate.LayerwiseModel(open_source(str(src)), torch.device("cpu"))
    tokens = torch.randint(3, 100, (4, 16), generator=torch.Generator().manual_seed(2))
    obs = calibrate.Observers(hessian=True)
    visits = lm.blocks(tokens, obs, micro_batch=2, progress=False)
    visit = next(visits)
    block = lm.layers[visit.index]
    ran: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda *_a, _n=n: ran.append(_n)) for n, m in block.named_modules() if n]
    o_proj = visit.prefix + "self_attn.o_proj"
    for outputs in (True, False):
        ran.clear()
        obs.drop([o_proj])
        got = visit.again([o_proj], outputs=outputs)
        assert obs[o_proj].count == 4 * 16 and len(got) == (2 if outputs else 0)
        if outputs:
            full, full_ran = obs[o_proj].xtx.clone(), list(ran)
        else:
            assert torch.equal(obs[o_proj].xtx, full)
            assert ran == [n for n in full_ran[:full_ran.index("self_attn.o_proj") + 1]] * 2  # (each micro-batch)
            assert len(ran) < len(full_ran)
    if family == "qwen3_moe":  # an expert's input: the router decides whether a call feeds it, so no early stop
        expert = next(n for n in obs if ":down:" in n)
        ran.clear()
        obs.drop([expert])
        visit.again([expert], outputs=False)
        assert ran == full_ran
    for h in hooks:
        h.remove()
    visits.close()
