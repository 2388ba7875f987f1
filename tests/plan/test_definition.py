"""Tensor roles from the model's own definition (fp4convert/plan/definition.py), on real transformers classes.

Each family is a tiny real model saved with ``save_pretrained`` (the on-disk names users download);
the plan must quantize exactly its matmul weights along their input axis and keep the rest with a
reason naming the module class. The families are the ones the name rules got wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fp4convert.plan import definition as modeldef
from fp4convert.plan import model_build
from fp4convert import quantize  # noqa: E402
from fp4convert.config import ConvertConfig  # noqa: E402
from fp4convert.run.convert import convert, plan_conversion  # noqa: E402
from fp4convert.errors import PlanError  # noqa: E402
from fp4convert.plan.types import KEEP, QUANTIZE
from fp4convert.plan.knowledge import UNKNOWN_ROLE  # noqa: E402

from tests import checkpoints as ck  # noqa: E402

CT = ConvertConfig(device="cpu", format="compressed-tensors")


def _save(cls_name: str, cfg, path: Path) -> Path:
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    tf = transformers
    root = tmp_path_factory.mktemp("families")
    return {
        "gpt2": _save("GPT2LMHeadModel", tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                                                       bos_token_id=0, eos_token_id=0), root / "gpt2"),
        "gpt_neox": _save("GPTNeoXForCausalLM", tf.GPTNeoXConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=0), root / "neox"),
        "t5": _save("T5ForConditionalGeneration", tf.T5Config(
            d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=16, vocab_size=256), root / "t5"),
        "granitemoe": _save("GraniteMoeForCausalLM", tf.GraniteMoeConfig(
            hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, num_local_experts=4, num_experts_per_tok=2), root / "granitemoe"),
    }


def _plan(path: Path, config: ConvertConfig = CT):
    source, plan, _ = plan_conversion(str(path), config)
    return source, plan


def test_gpt2_conv1d_is_quantized_along_its_input_axis(families, tmp_path) -> None:
    """GPT-2's Conv1D stores [in, out]: blocks must run along `in`, written [out, in] (vLLM's layout)."""
    src = families["gpt2"]
    _, plan = _plan(src)
    q = {d.name: d for d in plan.decisions if d.action == QUANTIZE}
    assert len(q) == 8 and all(".h." in n and n.endswith(".weight") for n in q)
    assert plan.by_name["transformer.wte.weight"].action == KEEP and "Embedding" in plan.by_name["transformer.wte.weight"].reason
    convert(src, tmp_path / "q", CT)
    from safetensors.torch import load_file

    disk = load_file(str(src / "model.safetensors"))
    out = load_file(str(tmp_path / "q" / "model.safetensors"))
    for name in q:
        w = disk[name]  # [in, out]
        ref = quantize(w.t().contiguous(), "nvfp4", backend="reference")
        module = name.removesuffix(".weight")
        assert out[module + ".weight_packed"].shape == (w.shape[1], w.shape[0] // 2)
        assert torch.equal(out[module + ".weight_packed"], ref.packed)
        assert torch.equal(out[module + ".weight_scale"].view(torch.uint8), ref.scale.view(torch.uint8))


def test_gpt_neox_keeps_embed_in_and_names_the_head(families) -> None:
    source, plan = _plan(families["gpt_neox"])
    assert plan.by_name["gpt_neox.embed_in.weight"].action == KEEP
    assert "Embedding" in plan.by_name["gpt_neox.embed_in.weight"].reason
    assert plan.by_name["embed_out.weight"].action == KEEP
    ignore = plan.kept_modules(source.config())
    assert {"lm_head", "embed_out", "gpt_neox.embed_in"} <= set(ignore)  # transformers builds embed_out as lm_head
    assert all(d.action == QUANTIZE for d in plan.decisions if ".layers." in d.name and d.name.endswith("proj.weight")
               or "dense" in d.name and d.name.endswith(".weight") or "query_key_value.weight" in d.name)


def test_t5_keeps_shared_and_position_bias(families) -> None:
    source, plan = _plan(families["t5"])
    rel = [d for d in plan.decisions if "relative_attention_bias" in d.name]
    assert rel and all(d.action == KEEP and "Embedding" in d.reason for d in rel)  # 16 heads: 16 % 16 == 0
    assert plan.by_name["shared.weight"].action == KEEP
    assert "lm_head" in plan.kept_modules(source.config())  # tied head: no tensor on disk


def test_granitemoe_experts_split_per_expert(families) -> None:
    """GraniteMoE's 3-D input_linear [E, 2I, H] / output_linear [E, H, I]: split per expert (gate/up halves
    sharing a scale), written under the per-expert names vLLM's GraniteMoE loader reads (``experts.{e}.w1/w3/w2``:
    its make_expert_params_mapping(ckpt_gate_proj_name="w1", ...)); transformers cannot load FP4 experts of
    this model type in any layout, and the run says so."""
    _, plan = _plan(families["granitemoe"])
    d = plan.by_name["model.layers.0.block_sparse_moe.input_linear.weight"]
    assert d.action == QUANTIZE and len(d.matrices) == 8
    assert [m.module for m in d.matrices[:2]] == ["model.layers.0.block_sparse_moe.experts.0.w1",
                                                  "model.layers.0.block_sparse_moe.experts.0.w3"]
    assert d.matrices[0].group == d.matrices[1].group and not d.matrices[0].transpose
    down = plan.by_name["model.layers.0.block_sparse_moe.output_linear.weight"]
    assert down.action == QUANTIZE and down.matrices[0].module.endswith("experts.0.w2")
    assert plan.by_name["model.layers.0.block_sparse_moe.router.layer.weight"].action == KEEP
    warn = [w for w in plan.warnings if w.startswith("transformers cannot load 4 quantized tensor(s)")]
    assert warn and "input_linear" in warn[0] and "output_linear" in warn[0]


def test_definition_tracks_axes_of_transposed_expert_stacks() -> None:
    """An expert stack stored [E, H, 2I] whose class holds [E, 2I, H] (a Transpose in transformers'
    conversion) is split along its input axis: the disk tensor is in-features first."""
    from transformers.core_model_loading import Transpose

    class Conv:
        operations = [Transpose(1, 2)]

    class Checked:  # Qwen3-VL-MoE: transposed only when the disk shape is not the parameter's
        operations = [Transpose(1, 2, check_dims=True)]

    assert model_build.disk_axes(Conv(), (4, 64, 192), (4, 192, 64)) == [0, 2, 1]
    assert model_build.disk_axes(Checked(), (4, 64, 192), (4, 192, 64)) == [0, 2, 1]  # a release: [E, H, 2I]
    assert model_build.disk_axes(Checked(), (4, 192, 64), (4, 192, 64)) == [0, 1, 2]  # saved by transformers 5


def test_unknown_architecture_falls_back_with_a_warning(tmp_path) -> None:
    """Without a definition the name rules decide, every run says so, and a weight whose role they cannot
    establish is kept, never quantized on a guess."""
    cfg = ck.llama_config(model_type="fp4convert_test_unknown", architectures=["NoSuchForCausalLM"])
    t = ck.llama_tensors(ck.llama_config())
    t["model.layers.0.mlp.mystery.weight"] = ck.rand((64, 64), 3)
    ck.write(tmp_path / "src", t, cfg)
    _, plan = _plan(tmp_path / "src")
    assert plan.by_name["model.layers.0.mlp.mystery.weight"].reason == UNKNOWN_ROLE
    assert plan.by_name["model.layers.0.self_attn.q_proj.weight"].action == QUANTIZE
    assert any("not from the model definition" in w and "mystery" in w for w in plan.warnings)
    assert plan.to_json()["planned_from"]["source"] == "name rules"


def test_absurd_layer_counts_are_refused_before_building(tmp_path) -> None:
    """num_hidden_layers / num_nextn_predict_layers of 10**10: no per-layer allocation (it exhausted the
    machine), the plan falls back and still bounds the MTP range arithmetically."""
    cfg = ck.llama_config(num_nextn_predict_layers=10 ** 10)
    with pytest.raises(modeldef.Unknown, match="num_nextn_predict_layers"):
        modeldef.load(cfg, [])
    ck.write(tmp_path / "src", ck.llama_tensors(ck.llama_config()), cfg)
    _, plan = _plan(tmp_path / "src")
    assert plan.summary()["quantized"] == 14


def test_a_source_without_config_is_refused(tmp_path) -> None:
    ck.write(tmp_path / "src", ck.llama_tensors(ck.llama_config()), ck.llama_config())
    (tmp_path / "src" / "config.json").unlink()
    with pytest.raises(PlanError, match="no config.json"):
        plan_conversion(str(tmp_path / "src"), CT)
    _, plan, _ = plan_conversion(str(tmp_path / "src"), ConvertConfig(device="cpu", allow_no_config=True))
    assert any("not from the model definition" in w for w in plan.warnings)


def test_definitions_are_cached(tmp_path, monkeypatch) -> None:
    """A second plan of the same model reads the cache: no child process builds it again."""
    monkeypatch.setenv("FP4CONVERT_DEFINITION_CACHE", str(tmp_path / "cache"))
    cfg = ck.llama_config()
    ck.write(tmp_path / "src", ck.llama_tensors(cfg), cfg)
    _, first = _plan(tmp_path / "src")
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1

    def boom(*a, **k):
        raise AssertionError("definition rebuilt")

    monkeypatch.setattr(modeldef, "_build_in_child", boom)
    _, second = _plan(tmp_path / "src")
    assert json.dumps(first.to_json(), sort_keys=True) == json.dumps(second.to_json(), sort_keys=True)


def test_qwen35_in_proj_members_share_a_group() -> None:
    from fp4convert.plan import families as arch

    a = arch.fused_group_of("model.layers.0.linear_attn.in_proj_qkv.weight")
    assert a == arch.fused_group_of("model.layers.0.linear_attn.in_proj_z.weight") and a
    b = arch.fused_group_of("model.layers.0.linear_attn.in_proj_b.weight")
    assert b == arch.fused_group_of("model.layers.0.linear_attn.in_proj_a.weight") and b and b != a


@pytest.fixture(scope="module")
def more_families(tmp_path_factory) -> dict[str, Path]:
    tf = transformers
    root = tmp_path_factory.mktemp("more")
    out = {
        "dbrx": _save("DbrxForCausalLM", tf.DbrxConfig(
            d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=256,
            attn_config={"kv_n_heads": 2, "rope_theta": 10000},
            ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}), root / "dbrx"),
        "whisper": _save("WhisperForConditionalGeneration", tf.WhisperConfig(
            d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256, num_mel_bins=16, max_source_positions=32,
            max_target_positions=32, pad_token_id=1, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
            root / "whisper"),
    }
    text = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                vocab_size=256)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64,
                  num_position_embeddings=16, deepstack_visual_indexes=[0])
    out["qwen3_vl_moe"] = _save("Qwen3VLMoeForConditionalGeneration",
                                tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=3,
                                                    video_token_id=4, vision_start_token_id=5), root / "qwen3vlmoe")
    return out


def test_dbrx_attention_quantized_experts_kept_and_named(more_families) -> None:
    """DBRX: attention under ``norm_attn_norm`` is a Linear (the name rules called it a norm); the router is
    kept; the 2-D expert stacks of DbrxExpertGLU (a custom module whose layout the class does not state, and
    which vLLM cannot load as NVFP4) are kept, warned about and listed in ignore: never half a MoE layer."""
    source, plan = _plan(more_families["dbrx"])
    b = "transformer.blocks.0."
    assert plan.by_name[b + "norm_attn_norm.attn.Wqkv.weight"].action == QUANTIZE
    assert plan.by_name[b + "norm_attn_norm.attn.out_proj.weight"].action == QUANTIZE
    assert plan.by_name[b + "ffn.router.layer.weight"].action == KEEP
    for leaf in ("w1", "v1", "w2"):
        d = plan.by_name[b + "ffn.experts.mlp." + leaf]
        assert d.action == KEEP and "DbrxExpertGLU" in d.reason
    assert b + "ffn.experts.mlp" in plan.kept_modules(source.config())
    assert any("custom or unsplittable" in w and "experts.mlp.w1" in w for w in plan.warnings)


def test_whisper_tied_head_is_named_proj_out(more_families) -> None:
    source, plan = _plan(more_families["whisper"])
    ignore = plan.kept_modules(source.config())
    assert "proj_out" in ignore and "lm_head" not in ignore
    assert all(d.action == KEEP for d in plan.decisions if "conv" in d.name or "embed" in d.name)


def test_qwen3_vl_moe_release_layout_split_along_its_input_axis(more_families, tmp_path) -> None:
    """Qwen3-VL-MoE's releases store experts [E, H, 2I] / [E, I, H]; transformers 5 saves [E, 2I, H]. Both
    must be split along their input axis: transposed for the release, not for the transformers save (as
    transformers' own Transpose(check_dims=True) does; sizes chosen non-square, as in every release)."""
    from safetensors.torch import load_file, save_file

    src = more_families["qwen3_vl_moe"]
    _, saved = _plan(src)
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    d = saved.by_name[name]
    assert d.action == QUANTIZE and not d.matrices[0].transpose and d.matrices[0].shape == (96, 64)
    assert all(x.action == KEEP for x in saved.decisions if ".visual." in x.name or x.name.startswith("model.visual"))
    # the release layout: every expert stack transposed on disk
    release = tmp_path / "release"
    release.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(str(f))
            t = {k: (v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v) for k, v in t.items()}
            save_file(t, str(release / f.name), metadata={"format": "pt"})
        else:
            (release / f.name).write_bytes(f.read_bytes())
    _, rel = _plan(release)
    r = rel.by_name[name]
    assert r.action == QUANTIZE and r.matrices[0].transpose and r.matrices[0].shape == (96, 64)
    assert [m.module for m in r.matrices] == [m.module for m in d.matrices]
    down = rel.by_name["model.language_model.layers.0.mlp.experts.down_proj"]
    assert down.matrices[0].transpose and down.matrices[0].shape == (64, 96)


# --- issue 20: what transformers' own compressed-tensors loading can read decides the rest -----------------


@pytest.fixture(scope="module")
def sweep_families(tmp_path_factory):
    """Tiny checkpoints of the sweep's builder (tests/tiny_configs.py), planned with definitions built in
    this process (the planner's child would pay transformers' imports per family)."""
    from tests import tiny_configs

    root = tmp_path_factory.mktemp("sweep_families")
    mp = pytest.MonkeyPatch()

    def build_here(model_config, tensors):
        return modeldef._from_json(json.loads(json.dumps(modeldef._to_json(model_build.build(model_config, tensors)))))

    mp.setattr(modeldef, "_build_in_child", build_here)
    mp.setenv("FP4CONVERT_DEFINITION_CACHE", str(root / "definitions"))

    def get(model_type: str) -> Path:
        o = tiny_configs.build(model_type, root)
        assert o.ok, (model_type, o.error)
        return Path(o.path)

    yield get
    mp.undo()


def test_router_inside_a_gate_module_is_kept(sweep_families) -> None:
    """HunYuan-MoE's router is the Linear ``wg`` of a module named ``gate`` (HunYuanMoEV1Gate): a router,
    whatever the Linear's own name (it was quantized, and engines load routers unquantized)."""
    _, plan = _plan(sweep_families("hunyuan_v1_moe"))
    d = plan.by_name["model.layers.0.mlp.gate.wg.weight"]
    assert d.action == KEEP and d.reason == "MoE router (HunYuanMoEV1Gate gate)"


def test_a_gated_mlp_is_not_a_router(sweep_families) -> None:
    """MoshiGatingMLP is a gated MLP (its fc1/fc2 are half the model's linears), not a router: quantized."""
    _, plan = _plan(sweep_families("moshi"))
    for leaf in ("fc1", "fc2"):
        assert plan.by_name[f"model.layers.0.mlp.{leaf}.weight"].action == QUANTIZE


def test_linear_split_at_load_is_kept_for_both_consumers(sweep_families) -> None:
    """Nomic-BERT's ``attn.Wqkv`` is chunked into q/k/v by transformers at load, before any dequantization:
    an FP4 Wqkv cannot load there, and vLLM reads Wqkv under that name only. Kept (both load bf16), named in
    ignore in both spellings (transformers builds q_proj/k_proj/v_proj), and said in a warning."""
    source, plan = _plan(sweep_families("nomic_bert"))
    d = plan.by_name["encoder.layers.0.attn.Wqkv.weight"]
    assert d.action == KEEP and "transformers cannot load in FP4" in d.reason and "Chunk" in d.reason
    ignore = set(plan.kept_modules(source.config()))
    assert {"encoder.layers.0.attn.Wqkv", "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
            "layers.0.self_attn.v_proj"} <= ignore
    assert plan.by_name["encoder.layers.0.attn.out_proj.weight"].action == QUANTIZE
    assert any(w.startswith("2 linear weight(s) kept unquantized because transformers cannot load them")
               for w in plan.warnings)


def test_a_module_named_like_a_weight_is_kept(sweep_families) -> None:
    """transformers' compressed-tensors loader renames the first ``weight`` of a key: the FP4 tensors of a
    Linear named ``block_inject_weight`` load into nothing. Kept, so that the output loads everywhere."""
    _, plan = _plan(sweep_families("qwen4_exp_text"))
    d = plan.by_name["model.layers.0.attn_hyper_connection.block_inject_weight.weight"]
    assert d.action == KEEP and "not a parameter of the model" in d.reason
    assert plan.by_name["model.layers.0.linear_attn.in_proj_qkv.weight"].action == QUANTIZE


def test_conv1d_output_says_transformers_cannot_load_it(families) -> None:
    """GPT-2's Conv1D is written [out, in] for vLLM; transformers fills the [in, out] parameter as stored,
    so a square one (attn.c_proj) would even load without error, transposed. Every quantized Conv1D is
    named in the warning."""
    _, plan = _plan(families["gpt2"])
    w = [w for w in plan.warnings if w.startswith("transformers cannot load 8 quantized tensor(s)")]
    assert w and "Conv1D" in w[0] and "transformer.h.0.attn.c_proj.weight" in w[0]
    assert plan.knowledge.transformers_cannot_load("transformer.h.0.attn.c_proj.weight")  # the square one too


def test_whole_model_unloadable_in_transformers_is_said(sweep_families) -> None:
    """Kimi-Linear's conv1d (never FP4) goes through a converter transformers' quantizer makes dequantize
    first, which drops unquantized tensors; HRM's gate_up split cannot even be built once FP4 companions
    join. No compressed-tensors checkpoint of either loads in transformers: the output is written for vLLM
    (nothing kept for transformers' sake) and the run says so once."""
    for mt, name in (("kimi_linear", "model.layers.0.self_attn.q_proj.weight"),
                     ("hrm_text", "model.H_module.layers.0.mlp.gate_up_proj.weight")):
        _, plan = _plan(sweep_families(mt))
        assert plan.by_name[name].action == QUANTIZE, mt
        assert any(w.startswith("transformers cannot load this compressed-tensors output at all") for w in plan.warnings)
        assert not any("kept unquantized because transformers" in w for w in plan.warnings)


def test_a_speech_model_on_its_own_is_quantized(sweep_families) -> None:
    """GraniteSpeech5ForCTC is an audio encoder and a CTC head tied to it: no language model beside it, so
    the tower rule does not apply (it kept everything); its encoder's Linears are quantized."""
    _, plan = _plan(sweep_families("granite_speech5_ctc"))
    assert plan.by_name["encoder.layers.0.self_attn.q_proj.weight"].action == QUANTIZE
    assert plan.by_name["encoder.layers.0.feed_forward1.linear1.weight"].action == QUANTIZE
    assert plan.by_name["encoder.layers.0.conv.depthwise_conv.weight"].action == KEEP


def test_llama4_experts_come_from_the_modules_transformers_loads_them_into(sweep_families) -> None:
    """Llama4TextExperts states no layout; transformers swaps it for per-expert Linears to load a quantized
    checkpoint (SequentialLlama4TextExperts). The definition is that swapped model: the stack is an experts
    role (not a kept tensor the family table splits), split into those Linears' names and [out, in]."""
    _, plan = _plan(sweep_families("llama4_text"))
    name = "model.layers.0.feed_forward.experts.gate_up_proj"
    role = plan.knowledge.definition.role(name)
    assert role.kind == "experts" and role.transpose and role.names == ("gate_proj", "up_proj", "down_proj")
    d = plan.by_name[name]
    assert d.action == QUANTIZE and [m.module for m in d.matrices[:2]] == [
        "model.layers.0.feed_forward.experts.0.gate_proj", "model.layers.0.feed_forward.experts.0.up_proj"]
    assert not plan.knowledge.transformers_cannot_load(name)
    assert not any(w.startswith("transformers cannot load") for w in plan.warnings)


def test_experts_no_consumer_reads_in_fp4_are_kept_and_listed(sweep_families) -> None:
    """Aria: transformers cannot load FP4 experts of this model type, and vLLM's Aria loader reads no
    quantized experts: kept, per-expert names in ignore (vLLM resolves a FusedMoE's scheme by them)."""
    source, plan = _plan(sweep_families("aria_text"))
    d = plan.by_name["model.layers.0.mlp.experts.fc1.weight"]
    assert d.action == KEEP and "reads no quantized experts" in d.reason
    assert "model.layers.0.mlp.experts.0.gate_proj" in plan.kept_modules(source.config())
    assert any("custom or unsplittable" in w and "experts.fc1" in w for w in plan.warnings)


def test_the_base_model_is_never_a_tower(sweep_families) -> None:
    """Aya Vision's base model is an AyaVisionModel ("Vision" in its class name) holding both the vision
    tower and the language model: the tower rule must keep only the tower, not the base model (which kept
    the whole language model unquantized, silently)."""
    _, plan = _plan(sweep_families("aya_vision"))
    assert plan.by_name["language_model.model.layers.0.self_attn.q_proj.weight"].action == QUANTIZE
    tower = [d for d in plan.decisions if d.name.startswith("vision_tower.") and d.name.endswith("proj.weight")]
    assert tower and all(d.action == KEEP and "tower" in d.reason for d in tower)
