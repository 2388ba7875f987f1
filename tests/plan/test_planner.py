"""Planning from headers alone: default exclusions (docs/formats.md), fused groups (docs/numerics.md), patterns, layout."""

from __future__ import annotations

import fnmatch
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp4convert.config import ConvertConfig
from fp4convert.errors import ConfigError, PlanError
from fp4convert.formats import get_format
from fp4convert.plan.types import KEEP, QUANTIZE
from fp4convert.plan.planner import make_plan

from tests.checkpoints import infos

FMT = get_format("fp4convert")
H = 64


def plan(spec, model_config=None, **cfg):
    return make_plan(infos(spec), ConvertConfig(**cfg), FMT, model_config or {})


def llama_spec(layers: int = 2, h: int = H) -> dict:
    spec = {"model.embed_tokens.weight": (96, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        spec.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (32, h),
            p + "self_attn.v_proj.weight": (32, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (128, h), p + "mlp.up_proj.weight": (128, h),
            p + "mlp.down_proj.weight": (h, 128),
        })
    spec.update({"model.norm.weight": (h,), "lm_head.weight": (96, h)})
    return spec


# --- docs/formats.md#which-tensors-are-quantized: what is never quantized by default, each with its reason -------------------

EXCLUDED = {
    "model.embed_tokens.weight": ((96, H), "BF16", "embedding"),
    "transformer.wte.weight": ((96, H), "BF16", "embedding"),
    "lm_head.weight": ((96, H), "BF16", "lm_head"),
    "model.layers.0.input_layernorm.weight": ((H,), "BF16", "norm"),
    "model.layers.0.self_attn.q_norm.weight": ((H, H), "BF16", "norm"),  # 2-D, still a norm
    "model.layers.0.self_attn.q_proj.bias": ((H,), "BF16", "not a weight"),
    "model.layers.0.mlp.gate.weight": ((8, H), "BF16", "router"),
    "model.layers.0.block_sparse_moe.gate.weight": ((8, H), "BF16", "router"),
    "model.layers.0.mlp.router.weight": ((8, H), "BF16", "router"),
    "model.layers.0.mlp.shared_expert_gate.weight": ((1, H), "BF16", "gate"),
    "model.layers.2.eh_proj.weight": ((H, 2 * H), "BF16", "MTP"),  # layer N of a 2-layer model
    "model.layers.2.self_attn.o_proj.weight": ((H, H), "BF16", "MTP"),
    "model.mtp.0.proj.weight": ((H, H), "BF16", "MTP"),
    "model.vision_tower.blocks.0.attn.qkv.weight": ((3 * H, H), "BF16", "vision"),
    "visual.blocks.0.mlp.fc1.weight": ((H, H), "BF16", "vision"),
    "model.multi_modal_projector.linear_1.weight": ((H, H), "BF16", "projector"),
    "model.layers.1.mlp.codebook.weight": ((16, H), "I32", "not floating point"),
    "model.layers.1.mlp.fp8_proj.weight": ((16, H), "F8_E4M3", "F8_E4M3"),
    "model.layers.1.mlp.stacked.weight": ((2, 32, H), "BF16", "3-D"),
    "model.layers.1.mlp.odd_proj.weight": ((H, 40), "BF16", "K=40"),
}


@pytest.mark.parametrize("name", list(EXCLUDED))
def test_default_exclusions_have_reasons(name: str) -> None:
    shape, dtype, why = EXCLUDED[name]
    spec = {name: (shape, dtype), "model.layers.0.mlp.down_proj.weight": (H, 128)}
    p = plan(spec, {"num_hidden_layers": 2, "num_nextn_predict_layers": 1})
    d = p.by_name[name]
    assert d.action == KEEP
    assert why.lower() in d.reason.lower(), d.reason
    assert [(e.name, e.dtype, e.shape) for e in d.outputs] == [(name, dtype, shape)]  # kept as is
    assert p.by_name["model.layers.0.mlp.down_proj.weight"].action == QUANTIZE


def test_mtp_only_with_nextn_in_config() -> None:
    spec = {"model.layers.2.self_attn.o_proj.weight": (H, H)}
    assert plan(spec, {"num_hidden_layers": 2}).by_name[next(iter(spec))].action == QUANTIZE
    assert plan(spec, {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}).decisions[0].action == QUANTIZE
    assert plan(spec, {"num_hidden_layers": 2, "num_nextn_predict_layers": 1}).decisions[0].action == KEEP


def test_block_divisibility_depends_on_scheme() -> None:
    spec = {"a.q_proj.weight": (H, 48), "a.k_proj.weight": (32, 48), "a.v_proj.weight": (32, 48),
            "a.o_proj.weight": (48, H)}
    nv = plan(spec)
    assert all(d.action == QUANTIZE for d in nv.decisions)
    mx = plan(spec, scheme="mxfp4")
    for n in ("a.q_proj.weight", "a.k_proj.weight", "a.v_proj.weight"):  # K=48: multiple of 16, not 32
        assert mx.by_name[n].action == KEEP and "mxfp4 block size 32" in mx.by_name[n].reason
    assert mx.by_name["a.o_proj.weight"].action == QUANTIZE


def test_llama_plan_outputs_and_order() -> None:
    p = plan(llama_spec())
    q = [d for d in p.decisions if d.action == QUANTIZE]
    assert len(q) == 14 and len(p.decisions) == 14 + 2 + 3
    d = p.by_name["model.layers.0.mlp.down_proj.weight"]
    assert [(e.name, e.dtype, e.shape) for e in d.outputs] == [
        ("model.layers.0.mlp.down_proj.weight_packed", "U8", (H, 64)),
        ("model.layers.0.mlp.down_proj.weight_scale", "F8_E4M3", (128, 8)),  # 128x4 padded: 64->128 rows
        ("model.layers.0.mlp.down_proj.weight_global_scale", "F32", (1,)),
    ]
    mx = plan(llama_spec(), scheme="mxfp4").by_name["model.layers.0.mlp.down_proj.weight"]
    assert [(e.name, e.dtype, e.shape) for e in mx.outputs] == [
        ("model.layers.0.mlp.down_proj.weight_packed", "U8", (H, 64)),
        ("model.layers.0.mlp.down_proj.weight_scale", "U8", (128, 4)),
    ]
    # A fused group is one work unit, its members adjacent (in the shard's name order).
    units = [[d.name for d in u] for u in p.units()]
    assert ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.self_attn.v_proj.weight"] in units
    assert ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"] in units


# --- docs/numerics.md#fused-groups-share-one-global-scale ---------------------------------------------------------------

def moe_spec(experts: int = 2) -> dict:
    p = "model.layers.0.mlp."
    spec = {p + "gate.weight": (experts, H)}
    for e in range(experts):
        spec.update({p + f"experts.{e}.gate_proj.weight": (32, H), p + f"experts.{e}.up_proj.weight": (32, H),
                     p + f"experts.{e}.down_proj.weight": (H, 32)})
    spec.update({p + "shared_expert.gate_proj.weight": (64, H), p + "shared_expert.up_proj.weight": (64, H),
                 p + "shared_expert.down_proj.weight": (H, 64), p + "shared_expert_gate.weight": (1, H)})
    return spec


def test_fused_groups_per_expert_and_shared_expert() -> None:
    p = plan(moe_spec(3))
    pre = "model.layers.0.mlp."
    groups = {g: sorted(m) for g, m in p.groups.items()}
    for e in range(3):
        members = sorted([pre + f"experts.{e}.gate_proj.weight", pre + f"experts.{e}.up_proj.weight"])
        assert members in groups.values()
    assert sorted([pre + "shared_expert.gate_proj.weight", pre + "shared_expert.up_proj.weight"]) in groups.values()
    assert len(groups) == 4  # never across experts, never with down_proj
    assert p.by_name[pre + "experts.0.gate_proj.weight"].group != p.by_name[pre + "experts.1.gate_proj.weight"].group
    assert p.by_name[pre + "experts.0.down_proj.weight"].group is None
    assert p.by_name[pre + "gate.weight"].action == KEEP
    assert p.by_name[pre + "shared_expert_gate.weight"].action == KEEP
    assert p.summary()["fused_groups"] == 4
    assert "sharing one global scale" in p.by_name[pre + "experts.2.up_proj.weight"].reason


def test_mixtral_and_mla_groups() -> None:
    spec = {"m.layers.0.self_attn.q_a_proj.weight": (32, H), "m.layers.0.self_attn.kv_a_proj_with_mqa.weight": (48, H),
            "m.layers.0.self_attn.q_b_proj.weight": (H, 32),
            "m.layers.0.block_sparse_moe.experts.0.w1.weight": (32, H),
            "m.layers.0.block_sparse_moe.experts.0.w3.weight": (32, H),
            "m.layers.0.block_sparse_moe.experts.0.w2.weight": (H, 32)}
    p = plan(spec)
    assert sorted(sorted(m) for m in p.groups.values()) == [
        ["m.layers.0.block_sparse_moe.experts.0.w1.weight", "m.layers.0.block_sparse_moe.experts.0.w3.weight"],
        ["m.layers.0.self_attn.kv_a_proj_with_mqa.weight", "m.layers.0.self_attn.q_a_proj.weight"],
    ]
    assert all(d.action == QUANTIZE for d in p.decisions)


@pytest.mark.parametrize("pattern", ["model.layers.0.self_attn.k_proj", "*.0.self_attn.k_proj.weight",
                                     "re:layers\\.0\\.self_attn\\.k_"])
def test_group_whole_or_nothing_with_ignore(pattern: str) -> None:
    p = plan(llama_spec(), ignore=(pattern,))
    k = p.by_name["model.layers.0.self_attn.k_proj.weight"]
    assert k.action == KEEP and k.reason == f"matched --ignore {pattern}"
    for n in ("q_proj", "v_proj"):
        d = p.by_name[f"model.layers.0.self_attn.{n}.weight"]
        assert d.action == KEEP and "stays whole" in d.reason and "k_proj" in d.reason
        assert d.outputs[0].name == d.name  # kept unchanged
    assert p.by_name["model.layers.1.self_attn.k_proj.weight"].action == QUANTIZE
    assert p.by_name["model.layers.0.self_attn.o_proj.weight"].action == QUANTIZE


def test_group_whole_or_nothing_with_unquantizable_member() -> None:
    spec = llama_spec(1)
    spec["model.layers.0.self_attn.v_proj.weight"] = ((32, H), "F8_E4M3")
    p = plan(spec)
    assert p.by_name["model.layers.0.self_attn.v_proj.weight"].action == KEEP
    for n in ("q_proj", "k_proj"):
        d = p.by_name[f"model.layers.0.self_attn.{n}.weight"]
        assert d.action == KEEP and "stays whole" in d.reason


def test_group_with_different_in_features_is_not_fused() -> None:
    """No engine fuses matrices of different in-features (cross-attention k/v, MobileBERT): each member is
    quantized with its own global scale, and the plan says so (it used to refuse the whole model)."""
    spec = {"a.gate_proj.weight": (32, H), "a.up_proj.weight": (32, 2 * H)}
    p = plan(spec)
    assert all(d.action == QUANTIZE and d.group is None for d in p.decisions)
    assert not p.all_groups() and any("different in-features" in w for w in p.warnings)


def test_group_with_different_in_features_fine_when_kept() -> None:
    """Nothing is quantized in that group, so nothing needs a shared scale: no reason to refuse."""
    spec = {"a.gate_proj.weight": (32, H), "a.up_proj.weight": (32, 2 * H), "a.down_proj.weight": (H, 32)}
    p = plan(spec, ignore=("a.gate_proj", "a.up_proj"))
    assert p.by_name["a.up_proj.weight"].action == KEEP
    assert p.by_name["a.down_proj.weight"].action == QUANTIZE


# --- --only / --ignore patterns ----------------------------------------------------------------

def test_only_glob_and_regex() -> None:
    p = plan(llama_spec(), only=("*.mlp.*",))
    got = {d.name for d in p.decisions if d.action == QUANTIZE}
    assert got == {f"model.layers.{i}.mlp.{n}_proj.weight" for i in range(2) for n in ("gate", "up", "down")}
    assert p.by_name["model.layers.0.self_attn.o_proj.weight"].reason == "not matched by --only"
    p = plan(llama_spec(), only=("re:layers\\.1\\..*(o_proj|down_proj)$",))
    assert {d.name for d in p.decisions if d.action == QUANTIZE} == {
        "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight"}
    # --only cannot override a default exclusion, and --ignore wins over --only.
    p = plan(llama_spec(), only=("lm_head", "*.mlp.*"), ignore=("re:\\.up_proj",))
    assert p.by_name["lm_head.weight"].action == KEEP and "lm_head" in p.by_name["lm_head.weight"].reason
    assert p.by_name["model.layers.0.mlp.gate_proj.weight"].action == KEEP  # its partner is ignored
    assert p.by_name["model.layers.0.mlp.down_proj.weight"].action == QUANTIZE


def test_only_one_member_of_a_group_keeps_the_group() -> None:
    p = plan(llama_spec(), only=("*.q_proj",))
    assert not [d for d in p.decisions if d.action == QUANTIZE]
    assert p.warnings and "no tensor is quantized" in p.warnings[0]


def test_bad_regex_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bad regex"):
        ConvertConfig(ignore=("re:(",))


# --- refusals ----------------------------------------------------------------------------------

def test_already_quantized_source_refused() -> None:
    with pytest.raises(PlanError, match="already quantized.*compressed-tensors"):
        plan(llama_spec(), {"quantization_config": {"quant_method": "compressed-tensors"}})


def test_name_collision_refused() -> None:
    spec = {"a.o_proj.weight": (H, H), "a.o_proj.weight_scale": ((1,), "F32")}
    with pytest.raises(PlanError, match="a.o_proj.weight_scale"):
        plan(spec)
    # Ignoring the weight removes the collision.
    assert plan(spec, ignore=("a.o_proj",)).by_name["a.o_proj.weight"].action == KEEP


# --- layout and summary ------------------------------------------------------------------------

@pytest.mark.parametrize("max_shard", [3000, 9000, 40000, 10**9])
def test_shard_layout_respects_max_size(max_shard: int) -> None:
    p = plan(llama_spec(), max_shard_size=max_shard)
    n = len(p.shards)
    if max_shard == 10**9:
        assert [f for f, _ in p.shards] == ["model.safetensors"]
    else:
        assert n > 1 and [f for f, _ in p.shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    outputs_of = [[e.name for e in d.outputs] for d in p.decisions]
    for _, entries in p.shards:
        size = sum(e.nbytes for e in entries)
        # Only one tensor's outputs, alone, may exceed the limit (a tensor is never split).
        assert size <= max_shard or [e.name for e in entries] in outputs_of, (size, [e.name for e in entries])
    written = [e.name for _, entries in p.shards for e in entries]
    assert written == [e.name for d in p.decisions for e in d.outputs]  # every output once, in order


def test_summary_bits_per_param() -> None:
    spec = {"a.o_proj.weight": (256, 128), "a.norm.weight": (128,)}
    s = plan(spec).summary()
    q_bytes = 256 * 64 + 256 * 8 + 4  # packed, E4M3 scales (256 rows, 8 blocks: no padding), global
    assert s["quantized"] == 1 and s["kept"] == 1 and s["params"] == 256 * 128 + 128
    assert s["bytes_in"] == 2 * (256 * 128 + 128) and s["bytes_out"] == q_bytes + 256
    assert s["bits_per_param_quantized"] == pytest.approx(8 * q_bytes / (256 * 128), abs=1e-4)
    assert s["bits_per_param"] == pytest.approx(8 * (q_bytes + 256) / (256 * 128 + 128), abs=1e-4)
    mx = plan(spec, scheme="mxfp4").summary()
    assert mx["bits_per_param_quantized"] == pytest.approx(8 * (256 * 64 + 256 * 4) / (256 * 128), abs=1e-4)


def test_plan_json_lists_every_tensor() -> None:
    p = plan(llama_spec(), ignore=("lm_head",))
    j = p.to_json()
    assert [t["name"] for t in j["tensors"]] == [d.name for d in p.decisions]
    assert j["settings"]["ignore"] == ["lm_head"] and j["summary"] == p.summary()
    t = next(t for t in j["tensors"] if t["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert t["action"] == "quantize" and t["group"] and t["shape"] == [H, H] and len(t["outputs"]) == 3


def test_kept_dtype_bf16_plans_each_kept_output() -> None:
    """--kept-dtype bf16: kept F32/F64 outputs are BF16 (half / a quarter the bytes) before any data is read;
    every other kept dtype and every quantized output stays as the default plan has it."""
    spec = {**{n: (s, "F32") for n, s in llama_spec(1).items()}, "model.rope.inv_freq": ((32,), "F64"),
            "model.layers.0.mlp.scale": ((H,), "F16"), "model.layers.0.mlp.bias": ((H,), "BF16"),
            "model.layers.0.mlp.codebook.weight": ((16, H), "I32"), "model.layers.0.mlp.mask": ((H,), "U8"),
            "model.layers.0.mlp.fp8_proj.weight": ((16, H), "F8_E4M3")}
    base, bf16 = plan(spec), plan(spec, kept_dtype="bf16")
    want = {"F32": "BF16", "F64": "BF16"}
    for a, b in zip(base.decisions, bf16.decisions):
        assert (a.name, a.action, a.reason, a.info) == (b.name, b.action, b.reason, b.info)
        if a.action == QUANTIZE:
            assert a.outputs == b.outputs
        else:
            assert [(e.name, e.dtype, e.shape) for e in a.outputs] == [(a.name, a.info.dtype, a.info.shape)]
            assert [(e.name, e.dtype, e.shape) for e in b.outputs] == [(a.name, want.get(a.info.dtype, a.info.dtype),
                                                                         a.info.shape)]
    kept = {d.name: d for d in bf16.decisions if d.action == KEEP}
    assert kept["model.norm.weight"].outputs[0].nbytes == H * 2 and kept["model.rope.inv_freq"].outputs[0].nbytes == 64
    saved = sum(d.info.nbytes - d.outputs[0].nbytes for d in kept.values())
    assert saved == sum(d.info.nbytes * {"F32": 1 / 2, "F64": 3 / 4}[d.info.dtype] for d in kept.values()
                        if d.info.dtype in want)
    assert base.summary()["bytes_out"] - bf16.summary()["bytes_out"] == saved
    assert [(f, [(e.name, e.dtype) for e in es]) for f, es in bf16.shards] != \
        [(f, [(e.name, e.dtype) for e in es]) for f, es in base.shards]
    assert bf16.to_json()["settings"]["kept_dtype"] == "bf16" and "kept_dtype" not in base.to_json()["settings"]


# --- invariants over random checkpoints (hypothesis) ---------------------------------------------

LEAVES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
          "q_a_proj", "kv_a_proj_with_mqa", "gate", "input_layernorm", "embed_tokens", "lm_head", "dense"]
GROUPS = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa")]


@st.composite
def random_checkpoint(draw):
    spec = {}
    for i in range(draw(st.integers(1, 3))):
        prefix = draw(st.sampled_from([f"model.layers.{i}.", f"model.layers.{i}.mlp.experts.{i}.",
                                       f"model.vision_tower.layers.{i}."]))
        k = draw(st.sampled_from([16, 32, 40, 48, 64]))
        for leaf in draw(st.lists(st.sampled_from(LEAVES), min_size=1, max_size=8, unique=True)):
            shape = draw(st.sampled_from([(32, k), (16, k), (k,), (2, 16, k)]))
            dtype = draw(st.sampled_from(["BF16", "BF16", "F16", "F32", "I32"]))
            spec[f"{prefix}{leaf}.weight"] = (shape, dtype)
    ignore = tuple(draw(st.lists(st.sampled_from(["*.k_proj", "re:up_proj", "model.layers.0.*", "*.w3"]), max_size=2)))
    only = tuple(draw(st.lists(st.sampled_from(["*.mlp.*", "re:proj"]), max_size=1)))
    return spec, ignore, only, draw(st.sampled_from(["nvfp4", "mxfp4"])), draw(st.sampled_from([2000, 10**9]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_checkpoint())
def test_plan_invariants(case) -> None:
    spec, ignore, only, scheme, max_shard = case
    p = plan(spec, ignore=ignore, only=only, scheme=scheme, max_shard_size=max_shard)
    names = list(spec)
    assert sorted(d.name for d in p.decisions) == sorted(names)  # every tensor decided exactly once
    bs = 16 if scheme == "nvfp4" else 32
    for d in p.decisions:
        shape, dtype = spec[d.name]
        assert d.reason
        if d.action == QUANTIZE:
            assert len(shape) == 2 and shape[-1] % bs == 0 and dtype in ("BF16", "F16", "F32")
            assert not any(w in d.name for w in ("vision", "norm", "embed", "lm_head", ".gate."))
            assert not any(matches_any(pat, d.name) for pat in ignore)
        else:
            assert [(e.name, e.dtype, e.shape) for e in d.outputs] == [(d.name, dtype, tuple(shape))]
    # Whole or nothing, per module prefix.
    by_name = p.by_name
    for fam in GROUPS:
        prefixes = {n.rsplit(".", 2)[0] for n in names if n.rsplit(".", 2)[1] in fam}
        for pre in prefixes:
            members = [f"{pre}.{leaf}.weight" for leaf in fam if f"{pre}.{leaf}.weight" in spec]
            actions = {by_name[m].action for m in members}
            assert len(actions) == 1, members
            if actions == {QUANTIZE}:
                assert len({spec[m][0][-1] for m in members}) == 1
                assert len({by_name[m].group for m in members}) == 1
    outs = [e.name for d in p.decisions for e in d.outputs]
    assert len(outs) == len(set(outs))
    assert [e.name for _, entries in p.shards for e in entries] == outs


def matches_any(pattern: str, name: str) -> bool:
    module = name[: -len(".weight")]
    if pattern.startswith("re:"):
        return bool(re.search(pattern[3:], name))
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(module, pattern)
