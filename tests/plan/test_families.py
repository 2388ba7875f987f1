"""fp4convert.plan.families (and the name rules of fp4convert.plan.name_roles) on real names: every table and function
against checkpoints saved by the transformers classes themselves (tests/zoo.py), and against the modules transformers builds."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fp4convert.plan import families as arch  # noqa: E402
from fp4convert.plan import name_roles  # noqa: E402

from tests import zoo  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """family -> (config.json dict, {tensor name: shape}) of a saved zoo checkpoint."""
    root = tmp_path_factory.mktemp("arch-zoo")
    out = {}
    for family in zoo.FAMILIES:
        p = zoo.build(family, root / family)
        out[family] = (zoo.read_config(p), zoo.read_shapes(p))
    return out


def groups_of(cfg: dict, shapes: dict) -> dict[str, list[str]]:
    g: dict[str, list[str]] = defaultdict(list)
    for name in shapes:
        gid = arch.fused_group_of(name, cfg)
        if gid:
            g[gid].append(name.rsplit(".", 2)[-2])
    return dict(g)


def test_pure_import() -> None:
    """The module stands alone: loaded from its file, it imports neither torch nor transformers."""
    import subprocess
    import sys

    path = Path(__file__).parents[2] / "fp4convert" / "plan" / "families.py"
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('arch', {str(path)!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['arch'] = m; spec.loader.exec_module(m); "
            "print(sorted(x for x in ('torch', 'transformers', 'safetensors', 'fp4convert') if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_every_table_entry_is_sourced() -> None:
    for f in arch.FUSED_MODULES:
        assert f.source and len(f.members) >= 2, f
        assert re.search(r"\.py\b", f.source), f"{f.fused} cites no file"


# --- fused groups ------------------------------------------------------------------------------

EXPECTED_GROUPS = {  # family -> {group leaf set: count}
    "llama": {("q_proj", "k_proj", "v_proj"): 2, ("gate_proj", "up_proj"): 2},
    "qwen3_tied": {("q_proj", "k_proj", "v_proj"): 2, ("gate_proj", "up_proj"): 2},
    "qwen3_moe": {("q_proj", "k_proj", "v_proj"): 2, ("gate_proj", "up_proj"): 8},  # 4 experts x 2 layers
    "mixtral": {("q_proj", "k_proj", "v_proj"): 2, ("w1", "w3"): 8},
    # DeepSeek-V3 gate/up: layer 0 dense, layer 1's four experts and its shared expert.
    "deepseek_v3": {("q_a_proj", "kv_a_proj_with_mqa"): 2, ("gate_proj", "up_proj"): 1 + 4 + 1},
    "gpt_oss": {("q_proj", "k_proj", "v_proj"): 2},
    "llama4": {("q_proj", "k_proj", "v_proj"): 2, ("gate_proj", "up_proj"): 2},  # shared experts
    "gemma3": {("q_proj", "k_proj", "v_proj"): 2 + 1, ("gate_proj", "up_proj"): 2},  # + the vision tower's
    "bert": {("query", "key", "value"): 2},
}


@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_fused_groups_on_saved_names(saved, family: str) -> None:
    cfg, shapes = saved[family]
    groups = groups_of(cfg, shapes)
    counts: dict[tuple[str, ...], int] = defaultdict(int)
    for gid, leaves in groups.items():
        members = tuple(gid[gid.rindex("{") + 1:-1].split(","))  # in the engine's order
        assert sorted(members) == sorted(leaves), (gid, leaves)  # every member is on disk
        counts[members] += 1
    assert dict(counts) == EXPECTED_GROUPS[family]


def test_per_expert_groups_keep_the_expert_index(saved) -> None:
    cfg, shapes = saved["qwen3_moe"]
    a = arch.fused_group_of("model.layers.0.mlp.experts.1.gate_proj.weight", cfg)
    b = arch.fused_group_of("model.layers.0.mlp.experts.2.up_proj.weight", cfg)
    assert a == "model.layers.0.mlp.experts.1.{gate_proj,up_proj}" and b.startswith("model.layers.0.mlp.experts.2.")
    assert "model.layers.0.mlp.experts.1.gate_proj.weight" in shapes


def test_bert_query_key_value_only_under_attention_self(saved) -> None:
    cfg, shapes = saved["bert"]
    assert arch.fused_group_of("encoder.layer.1.attention.self.key.weight", cfg) == \
        "encoder.layer.1.attention.self.{query,key,value}"
    assert "encoder.layer.1.attention.self.key.weight" in shapes
    assert arch.fused_group_of("encoder.layer.1.attention.self.key.bias", cfg) is None
    assert arch.fused_group_of("model.layers.0.cross.query.weight", cfg) is None  # not BERT's attention.self


def test_every_fused_member_exists_in_transformers_as_a_linear(saved) -> None:
    """Group members are Linear modules of the model transformers builds (names after its conversion)."""
    for family in ("llama", "deepseek_v3", "gemma3", "bert", "llama4"):
        cfg, shapes = saved[family]
        cls = getattr(transformers, zoo.FAMILIES[family].model_class)
        with torch.device("meta"):
            model = cls(transformers.AutoConfig.for_model(**cfg) if family != "llama4"
                        else transformers.Llama4TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        for name in shapes:  # per-expert members are merged into 3-D parameters by transformers 5
            if arch.fused_group_of(name, cfg) and not re.search(r"experts\.\d+\.", name):
                assert arch.loaded_module_name(name.removesuffix(".weight"), cfg) in linears, (family, name)


# --- stacked experts ----------------------------------------------------------------------------

@pytest.mark.parametrize("family,split", [("gpt_oss", "interleaved"), ("llama4", "concatenated")])
def test_stacked_expert_layouts(saved, family: str, split: str) -> None:
    cfg, shapes = saved[family]
    stacked = {n: s for n, s in shapes.items() if len(s) == 3}
    assert stacked
    layouts = {n: arch.stacked_experts(n, s, cfg) for n, s in stacked.items()}
    for name, lay in layouts.items():
        assert lay is not None, name
        e, a, b = stacked[name]
        assert lay.transpose and lay.num_experts == e == 4
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("gate_up_proj"):
            assert lay.kind == "gate_up" and lay.split == split
            assert [m.module for m in lay.matrices[:2]] == [f"{prefix}.0.gate_proj", f"{prefix}.0.up_proj"]
            assert all(m.shape == (b // 2, a) for m in lay.matrices)
            assert set(lay.groups()) == {f"{prefix}.{x}.{{gate_proj,up_proj}}" for x in range(e)}
            assert lay.bias == (name + "_bias" if family == "gpt_oss" else None)
            if lay.bias:
                assert shapes[lay.bias] == (e, b)
        else:
            assert lay.kind == "down" and lay.split is None and not lay.groups()
            assert [m.module for m in lay.matrices] == [f"{prefix}.{x}.down_proj" for x in range(e)]
            assert all(m.shape == (b, a) for m in lay.matrices)


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_extract_matches_what_the_model_computes(saved, tmp_path: Path, family: str) -> None:
    """Each extracted [N, K] matrix reproduces the model's own expert projections (its forward math)."""
    p = zoo.build(family, tmp_path / family)
    cfg, shapes = saved[family]
    tensors = zoo.read_tensors(p)
    x = torch.randn(5, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    for name, t in tensors.items():
        lay = arch.stacked_experts(name, tuple(t.shape), cfg)
        if lay is None or lay.kind != "gate_up":
            continue
        w = t.float()
        for e in range(lay.num_experts):
            fused = x @ w[e]  # the model: hidden @ gate_up_proj[e] -> [5, 2I]
            if family == "gpt_oss":
                gate_ref, up_ref = fused[..., ::2], fused[..., 1::2]  # GptOssExperts
            else:
                gate_ref, up_ref = fused.chunk(2, dim=-1)  # Llama4TextExperts
            mats = {m.proj: lay.extract(w, m) for m in lay.matrices if m.expert == e}
            assert mats["gate"].shape == mats["up"].shape == (w.shape[2] // 2, w.shape[1])
            torch.testing.assert_close(x @ mats["gate"].T, gate_ref, rtol=0, atol=0)
            torch.testing.assert_close(x @ mats["up"].T, up_ref, rtol=0, atol=0)


def test_out_first_stacked_experts_from_hidden_size() -> None:
    """transformers-5 classes holding [E, 2I, H] (no transpose, gate then up); ambiguous shapes refused."""
    cfg = {"model_type": "qwen3_5_moe", "hidden_size": 64}
    lay = arch.stacked_experts("model.layers.0.mlp.experts.gate_up_proj", (4, 192, 64), cfg)
    assert lay is not None and not lay.transpose and lay.split == "concatenated"
    gate = [m for m in lay.matrices if m.proj == "gate"][0]
    assert (gate.row_start, gate.row_stop, gate.row_step, gate.shape) == (0, 96, 1, (96, 64))
    down = arch.stacked_experts("model.layers.0.mlp.experts.down_proj", (4, 64, 96), cfg)
    assert down is not None and not down.transpose and down.matrices[0].shape == (64, 96)
    assert arch.stacked_experts("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 64), cfg) is None  # square
    # An unknown family in-features first could interleave gate/up (like gpt-oss): not guessed.
    assert arch.stacked_experts("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 192), cfg) is None
    assert arch.stacked_experts("model.layers.0.mlp.experts.down_proj", (4, 96, 64), cfg) is None
    assert arch.stacked_experts("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 64), {}) is None
    # A documented in-first family whose shapes contradict its documented layout is refused, not guessed.
    assert arch.stacked_experts("model.layers.0.mlp.experts.gate_up_proj", (4, 192, 64),
                                {"model_type": "gpt_oss", "hidden_size": 64}) is None


def test_stacked_experts_ignores_other_tensors(saved) -> None:
    cfg, shapes = saved["gpt_oss"]
    for name, shape in shapes.items():
        if len(shape) != 3:
            assert arch.stacked_experts(name, shape, cfg) is None, name


# --- names as transformers builds them ------------------------------------------------------------

@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_loaded_module_names_are_modules_of_the_model(saved, family: str) -> None:
    """Every on-disk 2-D ``.weight`` maps to a module transformers builds (the names ``ignore`` needs)."""
    cfg, shapes = saved[family]
    cls = getattr(transformers, zoo.FAMILIES[family].model_class)
    config = transformers.AutoConfig.for_model(**cfg) if family != "llama4" else \
        transformers.Llama4TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        modules = dict(cls(config).named_modules())
    for name, shape in shapes.items():
        if name.endswith(".weight") and len(shape) == 2 and not re.search(r"experts\.\d+\.", name):
            assert arch.loaded_module_name(name.removesuffix(".weight"), cfg) in modules, name


RENAMES = [  # (model_type, on-disk module, module transformers 5.23 builds)
    ("gemma3", "vision_tower.vision_model.encoder.layers.0.mlp.fc1",  # Google's release (SigLIP level)
     "model.vision_tower.encoder.layers.0.mlp.fc1"),
    ("gemma3", "vision_tower.encoder.layers.0.mlp.fc1", "model.vision_tower.encoder.layers.0.mlp.fc1"),
    ("gemma3", "language_model.model.layers.0.mlp.up_proj", "model.language_model.layers.0.mlp.up_proj"),
    ("gemma3", "language_model.lm_head", "lm_head"),
    ("gemma3", "multi_modal_projector.mm_soft_emb_norm", "model.multi_modal_projector.mm_soft_emb_norm"),
    ("mixtral", "model.layers.0.block_sparse_moe.gate", "model.layers.0.mlp.gate"),
] + [(mt, "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj")
     for mt in ("llama", "qwen3_moe", "gpt_oss", "bert", "deepseek_v3", "llama4")]


@pytest.mark.parametrize("model_type,disk,loaded", RENAMES)
def test_loaded_module_name_renames(model_type: str, disk: str, loaded: str) -> None:
    assert arch.loaded_module_name(disk, {"model_type": model_type}) == loaded


def test_ignore_names_both_spellings(saved) -> None:
    cfg, shapes = saved["gemma3"]
    assert "vision_tower.encoder.layers.0.mlp.fc1.weight" in shapes
    assert arch.ignore_names("vision_tower.encoder.layers.0.mlp.fc1", cfg) == [
        "vision_tower.encoder.layers.0.mlp.fc1", "model.vision_tower.encoder.layers.0.mlp.fc1"]
    cfg, shapes = saved["llama"]
    assert arch.ignore_names("model.embed_tokens", cfg) == ["model.embed_tokens"]


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen3_tied", True), ("qwen3_moe", False),
                                         ("mixtral", False), ("deepseek_v3", False), ("gpt_oss", False),
                                         ("llama4", False), ("gemma3", True), ("bert", False)])
def test_tied_lm_head(saved, family: str, tied: bool) -> None:
    cfg, shapes = saved[family]
    assert arch.tied_lm_head(cfg) is tied
    if tied:  # exactly the models that have an lm_head module but no lm_head tensor on disk
        assert not any("lm_head" in n for n in shapes)


def test_tied_lm_head_text_config_wins() -> None:
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "tie_word_embeddings": True,
           "text_config": {"tie_word_embeddings": False}}
    assert arch.tied_lm_head(cfg) is False
    assert arch.tied_lm_head({"architectures": ["LlamaForCausalLM"]}) is True  # transformers' default
    assert arch.tied_lm_head({"architectures": ["BertModel"], "tie_word_embeddings": True}) is False


# --- roles, norms and reasons ---------------------------------------------------------------------

def test_norms_case_insensitive(saved) -> None:
    cfg, shapes = saved["bert"]
    norms = [n for n in shapes if "LayerNorm" in n]
    assert norms and all(name_roles.is_norm(n) and name_roles.role_of(n, shapes[n], cfg) == "norm" for n in norms)
    assert not name_roles.is_norm("encoder.layer.0.attention.self.query.weight")
    assert name_roles.is_norm("transformer.ln_f.weight") and name_roles.is_norm("model.layers.0.self_attn.q_norm.weight")


REASONS = {  # family -> {tensor name: words the reason must contain}
    "bert": {"encoder.layer.0.attention.self.query.weight": "attention query projection",
             "encoder.layer.0.attention.output.dense.weight": "attention output projection",
             "encoder.layer.0.intermediate.dense.weight": "MLP up projection",
             "encoder.layer.0.output.dense.weight": "MLP down projection",
             "embeddings.LayerNorm.weight": "normalization"},
    "gpt_oss": {"model.layers.0.mlp.experts.gate_up_proj": "MoE expert gate/up projection (3-D stacked [E, in, out], "
                                                           "4 experts, gate/up interleaved)",
                "model.layers.0.mlp.experts.down_proj": "MoE expert down projection (3-D stacked",
                "model.layers.0.mlp.router.weight": "MoE router",
                "model.layers.0.mlp.experts.gate_up_proj_bias": "expert bias"},
    "llama4": {"model.layers.0.feed_forward.experts.gate_up_proj": "4 experts, gate then up",
               "model.layers.0.feed_forward.router.weight": "MoE router",
               "model.layers.0.feed_forward.shared_expert.up_proj.weight": "shared expert up projection"},
    "gemma3": {"vision_tower.encoder.layers.0.mlp.fc1.weight": "vision tower",
               "multi_modal_projector.mm_input_projection_weight": "multimodal projector",
               "language_model.model.embed_tokens.weight": "embedding"},
    "mixtral": {"model.layers.0.block_sparse_moe.experts.0.w1.weight": "MoE expert 0 gate projection",
                "model.layers.0.block_sparse_moe.gate.weight": "MoE router"},
    "deepseek_v3": {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight": "MLA key/value down-projection",
                    "model.layers.1.mlp.gate.e_score_correction_bias": "MoE router",
                    "model.layers.1.mlp.experts.3.down_proj.weight": "MoE expert 3 down projection"},
    "llama": {"lm_head.weight": "lm_head", "model.layers.1.self_attn.v_proj.weight": "attention value projection"},
}


@pytest.mark.parametrize("family", list(REASONS))
def test_describe_says_what_a_tensor_is(saved, family: str) -> None:
    cfg, shapes = saved[family]
    for name, words in REASONS[family].items():
        assert name in shapes, name
        assert words in name_roles.describe(name, shapes[name], cfg), (name, name_roles.describe(name, shapes[name], cfg))


@pytest.mark.parametrize("family", list(zoo.FAMILIES))
def test_roles_partition_the_checkpoint(saved, family: str) -> None:
    cfg, shapes = saved[family]
    roles = {n: name_roles.role_of(n, s, cfg) for n, s in shapes.items()}
    assert set(roles.values()) <= {"vision", "projector", "embedding", "lm_head", "router", "norm", "mtp",
                                   "expert", "linear", "other"}
    for n, r in roles.items():
        if r == "other":  # only non-matrix tensors are left over: biases, sinks, stacked biases
            assert not (n.endswith(".weight") and len(shapes[n]) == 2), n
    if zoo.FAMILIES[family].moe:
        assert "expert" in roles.values() and "router" in roles.values()
    assert "lm_head" in roles.values() or arch.tied_lm_head(cfg) or family == "bert"


def test_mtp_layers_from_config() -> None:
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    assert name_roles.role_of("model.layers.2.eh_proj.weight", (64, 128), cfg) == "mtp"
    assert name_roles.role_of("model.layers.1.self_attn.o_proj.weight", (64, 64), cfg) == "linear"
