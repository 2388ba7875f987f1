"""Issue 9's "Done when", per model family: convert a real transformers model with the CLI and load
the result with transformers + compressed-tensors.

Every family of tests/zoo.py is built (tiny, random, saved with ``save_pretrained``), converted with
``fp4convert quantize SRC DST --format compressed-tensors --device cpu --quiet`` and checked for:

- >= 95% of linear and expert parameters quantized (roles from fp4convert.plan.families, actions
  from the manifest);
- routers, embeddings, lm_head, norms, vision tower and projector kept;
- ``ignore`` naming modules as transformers builds them (plus ``lm_head`` when tied), and nothing
  that is not a module of the model;
- every group vLLM fuses (fp4convert.plan.families.FUSED_MODULES, and gate/up of each stacked
  expert) sharing one global scale, read from the output files;
- loading with no missing / unexpected / mismatched keys, both through the dequantizing path and
  through the compressed path (the one that applies ``ignore``);
- quantized weights that transformers decompresses equal fp4convert.dequantize of the files bit
  for bit; per-expert MoE weights are checked from the files, because transformers 5.23 drops
  ``weight_global_scale`` when it decompresses them (test_transformers_drops_expert_global_scale
  pins that behaviour: it decodes e2m1 * block scale with gs = 1, so experts come out gs times too
  large, ~3.6e4 on these weights).

What fails today is marked ``xfail(strict=True)`` with the reason, so each mark turns into an
XPASS failure the moment the planner work fixes it: remove the mark then.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from click.testing import CliRunner  # noqa: E402
from transformers import CompressedTensorsConfig  # noqa: E402

import fp4convert  # noqa: E402
from fp4convert.plan import families as arch  # noqa: E402
from fp4convert.plan import name_roles  # noqa: E402
from fp4convert.cli.main import main  # noqa: E402

from tests import zoo  # noqa: E402

FAMILIES = list(zoo.FAMILIES)
KEPT_ROLES = ("router", "embedding", "lm_head", "vision", "projector", "norm", "mtp")

# What a consumer cannot do, by check and family (strict: each mark fails the suite once it passes).
# gpt-oss experts are written per expert under the names vLLM reads; transformers 5.23 has no loader
# for per-expert gpt-oss tensors, a transformers limitation, not a converter bug.
GPT_OSS = ("transformers 5.23 cannot load per-expert gpt-oss weights (no gpt_oss entry in conversion_mapping.py, "
           "no per-expert module swap as for Llama 4): the per-expert keys vLLM reads are unexpected to it and its "
           "3-D experts missing; the experts are checked from the files instead")
XFAIL: dict[str, dict[str, str]] = {
    "share": {},
    "ignore": {},
    "groups": {},
    "load-dequantize": {
        "gpt_oss": GPT_OSS,
    },
    "load-compressed": {
        "gpt_oss": GPT_OSS,
    },
}


def xfail_for(check: str) -> list:
    """Parameters over FAMILIES, marked strict-xfail where XFAIL says the check fails today."""
    return [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=XFAIL[check][f]))
            if f in XFAIL.get(check, {}) else f for f in FAMILIES]


# ---------------------------------------------------------------------------------------------
# Shared, module-scoped artefacts: one build, one conversion and at most two loads per family
# ---------------------------------------------------------------------------------------------

class Converted:
    def __init__(self, family: str, root: Path) -> None:
        self.family = family
        self.src = zoo.build(family, root / family)
        self.dst = root / f"{family}-ct"
        result = CliRunner().invoke(main, ["quantize", str(self.src), str(self.dst), "--format",
                                           "compressed-tensors", "--device", "cpu", "--quiet"])
        assert result.exit_code == 0, result.output
        self.config = zoo.read_config(self.src)
        self.shapes = zoo.read_shapes(self.src)
        self.manifest = json.loads((self.dst / "fp4convert.json").read_text())
        self.out = zoo.read_tensors(self.dst)
        self.qc = zoo.read_config(self.dst)["quantization_config"]
        self._loaded: dict[bool, tuple] = {}

    def action(self, name: str) -> str:
        return self.manifest["tensors"][name]["action"]

    def load(self, dequantize: bool):
        if dequantize not in self._loaded:
            cls = getattr(transformers, zoo.FAMILIES[self.family].auto_class)
            self._loaded[dequantize] = cls.from_pretrained(
                self.dst, dtype=torch.bfloat16, output_loading_info=True,
                quantization_config=CompressedTensorsConfig(dequantize=dequantize))
        return self._loaded[dequantize]


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zoo")


_CACHE: dict[str, Converted] = {}


@pytest.fixture
def conv(request, zoo_root) -> Converted:
    family = request.param
    if family not in _CACHE:
        _CACHE[family] = Converted(family, zoo_root)
    return _CACHE[family]


@pytest.fixture(scope="module", autouse=True)
def _drop_cache():
    yield
    _CACHE.clear()


def family_params(check: str):
    return pytest.mark.parametrize("conv", xfail_for(check), indirect=True)


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------

@family_params("share")
def test_linear_and_expert_params_quantized(conv: Converted) -> None:
    eligible = {n: s for n, s in conv.shapes.items() if name_roles.role_of(n, s, conv.config) in ("linear", "expert")}
    assert eligible
    total = sum(numel(s) for s in eligible.values())
    quantized = sum(numel(s) for n, s in eligible.items() if conv.action(n) == "quantize")
    assert quantized / total >= 0.95, f"{quantized / total:.1%} of linear+expert params quantized"


@pytest.mark.parametrize("conv", FAMILIES, indirect=True)
def test_routers_embeddings_heads_towers_kept(conv: Converted) -> None:
    kept_roles = {n: name_roles.role_of(n, s, conv.config) for n, s in conv.shapes.items()}
    kept_roles = {n: r for n, r in kept_roles.items() if r in KEPT_ROLES}
    assert kept_roles, "every family has norms and embeddings"
    for name, role in kept_roles.items():
        assert conv.action(name) == "keep", f"{name} ({role}) was quantized"
        assert name in conv.out and not any(k.startswith(name.removesuffix(".weight") + ".weight_")
                                            for k in conv.out), name


@family_params("ignore")
def test_ignore_names_modules_as_transformers_builds_them(conv: Converted) -> None:
    ignore = set(conv.qc["ignore"])
    kept = {n.removesuffix(".weight") for n, s in conv.shapes.items()
            if n.endswith(".weight") and len(s) == 2 and conv.action(n) == "keep"}
    want = {arch.loaded_module_name(m, conv.config) for m in kept}
    if arch.tied_lm_head(conv.config):
        want.add("lm_head")
    assert want <= ignore, f"missing from ignore: {sorted(want - ignore)}"
    # ...and every plain entry names a kept module: as transformers builds it (meta device, no
    # memory) or as it is on disk (vLLM's spelling, see architectures.ignore_names).
    cls = getattr(transformers, zoo.FAMILIES[conv.family].model_class)
    cfg = transformers.AutoConfig.from_pretrained(conv.src)
    with torch.device("meta"):
        modules = {n for n, _ in cls(cfg).named_modules()}
    plain = {p for p in ignore if not p.startswith("re:")}
    assert plain <= modules | kept, f"ignore entries that are no module: {sorted(plain - modules - kept)}"


def fused_groups(conv: Converted) -> dict[str, list[str]]:
    """Group id -> output module names, from the source names (2-D members and stacked experts)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name, shape in conv.shapes.items():
        g = arch.fused_group_of(name, conv.config)
        if g:
            groups[g].append(name.removesuffix(".weight"))
        layout = arch.stacked_experts(name, shape, conv.config)
        if layout is not None:
            for gid, modules in layout.groups().items():
                groups[gid].extend(modules)
    return groups


@family_params("groups")
def test_fused_groups_share_one_global_scale(conv: Converted) -> None:
    groups = fused_groups(conv)
    checked = 0
    for gid, modules in groups.items():
        sources = [m + ".weight" for m in modules if m + ".weight" in conv.shapes]
        if sources and all(conv.action(s) == "keep" for s in sources):
            continue  # kept whole (e.g. a vision tower's q/k/v)
        scales = [conv.out.get(m + ".weight_global_scale") for m in modules]
        assert all(s is not None for s in scales), f"{gid}: not every member is quantized: {modules}"
        assert all(torch.equal(s, scales[0]) for s in scales), f"{gid}: {[s.item() for s in scales]}"
        checked += 1
    assert checked, "the family has fused groups"


@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantize", "compressed"])
@pytest.mark.parametrize("conv", FAMILIES, indirect=True)
def test_loads_without_missing_or_unexpected_keys(conv: Converted, dequantize: bool, request) -> None:
    check = "load-dequantize" if dequantize else "load-compressed"
    if conv.family in XFAIL[check]:
        request.applymarker(pytest.mark.xfail(strict=True, reason=XFAIL[check][conv.family]))
    _, info = conv.load(dequantize)
    problems = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    assert not problems and not info.get("error_msgs"), problems


def dequantized_from_files(conv: Converted, module: str, gs: bool = True) -> torch.Tensor:
    g = conv.out[module + ".weight_global_scale"].reshape(()) if gs else torch.tensor(1.0)
    q = fp4convert.QuantizedTensor(conv.out[module + ".weight_packed"], conv.out[module + ".weight_scale"], g, "nvfp4")
    return fp4convert.dequantize(q, torch.bfloat16)


@pytest.mark.parametrize("conv", FAMILIES, indirect=True)
def test_quantized_linears_bit_exact_in_transformers(conv: Converted) -> None:
    model, _ = conv.load(True)
    params = dict(model.named_parameters())
    checked = 0
    for name, rec in conv.manifest["tensors"].items():
        if rec["action"] != "quantize" or len(rec["shape"]) != 2:
            continue
        module = name.removesuffix(".weight")
        loaded = arch.loaded_module_name(module, conv.config) + ".weight"
        if loaded not in params:
            assert name_roles.role_of(name, tuple(rec["shape"]), conv.config) == "expert", f"{loaded} not in the model"
            continue  # per-expert weights merged into a 3-D parameter: see the next test
        got = params[loaded].data
        want = dequantized_from_files(conv, module)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
        checked += 1
    assert checked


MERGED = [f for f, fam in zoo.FAMILIES.items() if fam.moe == "per-expert"]


@pytest.mark.parametrize("conv", MERGED, indirect=True)
def test_experts_from_files_and_transformers_drops_expert_global_scale(conv: Converted) -> None:
    """Experts checked from the files; transformers' merged experts are gs times too large (a known bug)."""
    model, _ = conv.load(True)
    params = dict(model.named_parameters())
    src = zoo.read_tensors(conv.src)
    checked = 0
    for name in conv.shapes:
        gid = arch.fused_group_of(name, conv.config)
        if not (gid and name_roles.role_of(name, conv.shapes[name], conv.config) == "expert"):
            continue
        module = name.removesuffix(".weight")
        parent, _, leaf = module.rpartition(".")
        first = leaf in ("gate_proj", "w1")
        if not first:
            continue
        up = parent + "." + {"gate_proj": "up_proj", "w1": "w3"}[leaf]
        experts, _, e = parent.rpartition(".")
        merged = arch.loaded_module_name(experts, conv.config) + ".gate_up_proj"
        gate_f, up_f = dequantized_from_files(conv, module), dequantized_from_files(conv, up)
        # From the files: a faithful NVFP4 copy of the source (relative error of an FP4 weight).
        for q, s in ((gate_f, src[name]), (up_f, src[up + ".weight"])):
            rel = ((q.float() - s.float()).norm() / s.float().norm()).item()
            assert rel < 0.15, (name, rel)
        # transformers 5.23: gate then up, decoded with gs = 1 (CompressedTensorsDequantize's expert
        # path builds a module without weight_global_scale).
        got = params[merged].data[int(e)]
        no_gs = torch.cat([dequantized_from_files(conv, module, gs=False), dequantized_from_files(conv, up, gs=False)])
        assert torch.equal(got.view(torch.int16), no_gs.view(torch.int16)), name
        assert not torch.equal(got, torch.cat([gate_f, up_f]))
        checked += 1
    assert checked


# ---------------------------------------------------------------------------------------------
# Inputs: FP8 block-scaled and gpt-oss MXFP4 checkpoints convert like their fp32-dequantized twins
# ---------------------------------------------------------------------------------------------

def convert_cli(src: Path, dst: Path) -> int:
    return CliRunner().invoke(main, ["quantize", str(src), str(dst), "--format", "compressed-tensors",
                                     "--device", "cpu", "--quiet"]).exit_code


def same_outputs(a: Path, b: Path) -> None:
    fa, fb = sorted(p.name for p in zoo.shard_files(a)), sorted(p.name for p in zoo.shard_files(b))
    assert fa == fb
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


@pytest.mark.parametrize("family,variant", [
    ("deepseek_v3", lambda src, dst: zoo.fp8_block_variant(src, dst, block=(128, 128))),
    ("gpt_oss", zoo.mxfp4_variant),
], ids=["fp8_block", "gpt_oss_mxfp4"])
def test_quantized_input_equals_fp32_dequantized_route(tmp_path: Path, family, variant) -> None:
    src = zoo.build(family, tmp_path / "bf16")
    twin = variant(src, tmp_path / "input")
    zoo.write_like(src, tmp_path / "fp32", twin)
    assert convert_cli(tmp_path / "fp32", tmp_path / "out-fp32") == 0
    assert convert_cli(tmp_path / "input", tmp_path / "out-input") == 0
    same_outputs(tmp_path / "out-fp32", tmp_path / "out-input")


def test_variants_are_what_transformers_reads(tmp_path: Path) -> None:
    """The MXFP4 variant decodes (transformers' own gpt-oss loader) to the twin the tests compare with."""
    src = zoo.build("gpt_oss", tmp_path / "bf16")
    twin = zoo.mxfp4_variant(src, tmp_path / "mxfp4")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "mxfp4", dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    params = dict(model.named_parameters())
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(params[name].data, twin[name]), name
    fp8 = zoo.fp8_block_variant(src, tmp_path / "fp8", block=(128, 128))
    h = zoo.read_tensors(tmp_path / "fp8")
    w = "model.layers.0.self_attn.q_proj.weight"
    assert h[w].dtype == torch.float8_e4m3fn and h[w + "_scale_inv"].shape == (1, 1)
    assert torch.equal(zoo.fp8_block_dequantize(h[w], h[w + "_scale_inv"]), fp8[w])
    rel = ((fp8[w] - zoo.read_tensors(src)[w].float()).norm() / fp8[w].norm()).item()
    assert rel < 0.05


# ---------------------------------------------------------------------------------------------
# The stacked-expert layout itself, proven on a consumer before the planner writes it
# ---------------------------------------------------------------------------------------------

def test_llama4_expert_layout_is_what_transformers_reads(tmp_path: Path) -> None:
    """The converter writes Llama 4's 3-D experts per expert (transposed, gate/up split, one global
    scale per expert's gate/up): its files equal an independent per-matrix quantization of the layout
    architectures.stacked_experts describes, transformers loads them with no missing or unexpected
    keys, and its per-expert Linears equal our dequantization bit for bit."""
    src = zoo.build("llama4", tmp_path / "src")
    dst = tmp_path / "ct"
    assert convert_cli(src, dst) == 0
    cfg = zoo.read_config(src)
    out = zoo.read_tensors(dst)
    expected: dict[str, torch.Tensor] = {}
    for name, t in zoo.read_tensors(src).items():
        layout = arch.stacked_experts(name, tuple(t.shape), cfg)
        if layout is None:
            continue
        assert name not in out  # no 3-D tensor is written
        w = t.float()
        group_amax = {g: max(fp4convert.amax(layout.extract(w, m)) for m in layout.matrices if m.group == g)
                      for g in layout.groups()}
        for m in layout.matrices:
            x = layout.extract(w, m).contiguous()
            q = fp4convert.quantize(x, "nvfp4", global_amax=group_amax.get(m.group))
            assert torch.equal(out[m.module + ".weight_packed"], q.packed), m.module
            assert torch.equal(out[m.module + ".weight_scale"].view(torch.uint8), q.scale.view(torch.uint8)), m.module
            assert torch.equal(out[m.module + ".weight_global_scale"], q.global_scale.reshape(1).float()), m.module
            expected[m.module + ".weight"] = fp4convert.dequantize(q, torch.bfloat16)
    models = {}
    for dequantize in (True, False):
        models[dequantize], info = transformers.AutoModelForCausalLM.from_pretrained(
            dst, dtype=torch.bfloat16, output_loading_info=True,
            quantization_config=CompressedTensorsConfig(dequantize=dequantize))
        assert not any(v for v in info.values()), info
    assert len(expected) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    params = dict(models[True].named_parameters())
    for name, want in expected.items():
        assert torch.equal(params[name].data.view(torch.int16), want.view(torch.int16)), name
    # Independently of the layout code: Llama4TextExperts computes x @ gate_up[e] and chunks the last
    # dim (gate first), so expert e's gate Linear is gate_up[e][:, :I].T (an FP4 copy of it).
    src_t = zoo.read_tensors(src)
    for layer in range(2):
        p = f"model.layers.{layer}.feed_forward.experts"
        gate_up, down = src_t[p + ".gate_up_proj"].float(), src_t[p + ".down_proj"].float()
        inter = down.shape[1]
        for e in range(4):
            for proj, ref in (("gate_proj", gate_up[e][:, :inter].T), ("up_proj", gate_up[e][:, inter:].T),
                              ("down_proj", down[e].T)):
                got = params[f"{p}.{e}.{proj}.weight"].float()
                assert ((got - ref).norm() / ref.norm()).item() < 0.15, (layer, e, proj)
