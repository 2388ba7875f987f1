"""``--method tuned`` end to end on tiny models (fp4convert/calibrate/methods/tuned.py, docs/numerics.md "Tuned
rounding"): no tuning is the start's bytes, tuning lowers a block's loss or keeps the start, the bytes repeat, an
interrupted pass resumes to the same bytes, the output loads in transformers + compressed-tensors, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp4convert.calibrate.methods import settings
from fp4convert.config import ConvertConfig
from fp4convert.errors import ConfigError
from tests import checkpoints as ck
from tests import zoo
from tests.calibrate.test_calibrate import TEXT, add_tokenizer
from tests.calibrate.test_gptq import _tensors, cli, kl, logits, quantize
from tests.calibrate.test_resume import _model, _run, loading

FAST = ("--tuned-iters", "12", "--tuned-batch", "2", "--tuned-lr", "0.05")  # (a tiny model from few steps)


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("text") / "calibration.txt"
    p.write_text(TEXT)
    return p


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return add_tokenizer(zoo.build("llama", tmp_path_factory.mktemp("llama") / "llama", dtype=torch.float32))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("scheme,start,peer", [
    ("nvfp4", "gptq", ("--method", "gptq")),
    ("mxfp4", "gptq", ("--method", "gptq")),
    ("mxfp4", "rtn", ("--scale-rule", "mse")),
])
def test_no_tuning_writes_the_starts_bytes(tmp_path, src, text, scheme, start, peer):
    """--tuned-iters 0: GPTQ's bytes (``--method gptq`` at its defaults) or round-to-nearest's under the same scale
    rule, tensor for tensor."""
    m = quantize(src, tmp_path / "tuned", text, "--scheme", scheme, "--method", "tuned", "--tuned-iters", "0",
                 f"--tuned-start-{start}")
    quantize(src, tmp_path / "peer", text, "--scheme", scheme, *peer)
    assert m["method"]["start"] == start and m["method"]["blocks_tuned"] == 0 and m["method"]["quantized"] > 0
    assert _same(_tensors(tmp_path / "tuned"), _tensors(tmp_path / "peer"))


@pytest.mark.parametrize("scheme,start", [("mxfp4", "rtn"), ("nvfp4", "rtn"), ("mxfp4", "gptq")])
def test_tuning_lowers_each_blocks_loss_or_keeps_the_start_and_the_output_loads(tmp_path, src, text, scheme, start):
    """Every block's record: the tuned weights kept only where their calibration loss is below the start's; from
    round-to-nearest some block is tuned, and the checkpoint (loaded by transformers + compressed-tensors) is
    closer to the model on the calibration text than the start's; its bytes differ from the start's."""
    common = ("--scheme", scheme, "--format", "compressed-tensors", "--method", "tuned", f"--tuned-start-{start}")
    m = quantize(src, tmp_path / "tuned", text, *common, *FAST)
    quantize(src, tmp_path / "start", text, *common, "--tuned-iters", "0")
    blocks = m["method"]["blocks"]
    assert set(blocks) == {"0", "1"}
    for b in blocks.values():
        assert b["kept"] in ("tuned", "start")
        if b["kept"] == "tuned":
            assert b["tuned_loss"] < b["start_loss"]
    assert m["method"]["blocks_tuned"] == sum(b["kept"] == "tuned" for b in blocks.values())
    import transformers as tf

    ids = tf.AutoTokenizer.from_pretrained(str(src))(TEXT[:400], return_tensors="pt").input_ids[:, :96]
    base = logits(src, ids)
    got, before = kl(base, logits(tmp_path / "tuned", ids)), kl(base, logits(tmp_path / "start", ids))
    if start == "rtn":
        assert m["method"]["blocks_tuned"] >= 1
        assert got < before
    if m["method"]["blocks_tuned"]:
        assert not _same(_tensors(tmp_path / "tuned"), _tensors(tmp_path / "start"))
    else:
        assert _same(_tensors(tmp_path / "tuned"), _tensors(tmp_path / "start")) and got == before


def test_the_same_run_writes_the_same_bytes(tmp_path, src, text):
    """Deterministic on one device: the same settings and seed twice (scale moves on), every file the same; another
    seed draws other samples."""
    args = ("--method", "tuned", "--tuned-start-rtn", "--tuned-scale-lr", "0.02", *FAST)
    a = quantize(src, tmp_path / "a", text, *args)
    quantize(src, tmp_path / "b", text, *args)
    assert a["method"]["blocks_tuned"] >= 1 and any(b.get("scales_moved") for b in a["method"]["blocks"].values())
    assert ck.all_files(tmp_path / "a") == ck.all_files(tmp_path / "b")
    c = quantize(src, tmp_path / "c", text, *args, "--tuned-seed", "1")
    assert c["method"]["blocks"] != a["method"]["blocks"]


@pytest.mark.parametrize("start", ["rtn", "gptq"])
def test_an_interrupted_pass_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, monkeypatch, start):
    """A Ctrl-C while block 2 of 4 loads, then --resume: blocks 0 and 1 are not tuned again, and every file (the
    manifest's per-block record included) is the uninterrupted run's."""
    src = _model(tmp_path / "src", "llama")
    data = tmp_path / "t.txt"
    data.write_text(TEXT)
    extra = ("--method", "tuned", f"--tuned-start-{start}", *FAST)
    with monkeypatch.context() as mp:
        mp.setenv("FP4CONVERT_CALIBRATION_CACHE", str(tmp_path / "other-cache"))
        r = _run(src, tmp_path / "whole", data, *extra)
    assert r.exit_code == 0, r.output
    with monkeypatch.context() as mp:
        loading(mp, stop_at=2)
        r = _run(src, tmp_path / "out", data, *extra)
    assert r.exit_code == 130 and "--resume" in r.output, r.output
    with monkeypatch.context() as mp:
        loaded = loading(mp)
        r = _run(src, tmp_path / "out", data, *extra, "--resume")
    assert r.exit_code == 0, r.output
    assert loaded and min(loaded) == 2, loaded
    whole = json.loads((tmp_path / "whole" / "fp4convert.json").read_text())
    assert whole["method"]["blocks_tuned"] >= 1 or start == "gptq"  # (GPTQ's start may be kept everywhere)
    assert ck.all_files(tmp_path / "out") == ck.all_files(tmp_path / "whole")


@pytest.mark.parametrize("kwargs,match", [
    ({"activations": "nvfp4", "format": "compressed-tensors"}, "weight-only.*use --method gptq"),
    ({"rotate": "had16"}, r"does not tune rotated weights \(--rotate had16\)"),
    ({"method": {"iters": -1}}, "--tuned-iters -1"),
    ({"method": {"lr": 0.0}}, "--tuned-lr 0.0"),
    ({"method": {"scale_lr": 2.0}}, "--tuned-scale-lr 2.0"),
    ({"method": {"batch": 0}}, "--tuned-batch 0"),
    ({"method": {"seed": -2}}, "--tuned-seed -2"),
])
def test_recipes_and_settings_it_cannot_take_are_refused(kwargs, match):
    method = settings("tuned", **kwargs.pop("method", {}))
    with pytest.raises(ConfigError, match=match):
        ConvertConfig(method=method, **kwargs)


def test_moe_experts_are_refused_naming_the_method_to_use(tmp_path, text):
    src = add_tokenizer(zoo.build("qwen3_moe", tmp_path / "moe"))
    r = cli("quantize", src, tmp_path / "out", "--device", "cpu", "--calibration-data", text, "--calibration-samples", 4,
            "--calibration-seq-len", 48, "-q", "--method", "tuned")
    assert r.exit_code != 0 and "MoE expert stacks" in r.output and "use --method gptq" in r.output, r.output
    assert not any((tmp_path / "out").glob("*.safetensors"))


def test_its_options_belong_to_it_on_the_command_line(tmp_path):
    r = cli("quantize", tmp_path / "src", tmp_path / "dst", "--method", "gptq", "--tuned-iters", "3")
    assert r.exit_code == 2 and "--tuned-iters applies to --method tuned only" in r.output, r.output


def test_defaults_and_identity():
    """The resolved defaults (GPTQ start, the measured steps, samples and rate, scales fixed) and what decides the
    bytes: the start's GPTQ settings are --method gptq's weight-only defaults."""
    from fp4convert.calibrate.methods.gptq import GPTQSettings
    from fp4convert.calibrate.methods.tuned import BATCH, ITERS, LR, start_gptq

    c = ConvertConfig(method=settings("tuned"))
    s = c.method_settings
    assert (s.iters, s.lr, s.scale_lr, s.batch, s.from_gptq, s.seed) == (ITERS, LR, 0.0, BATCH, True, 0)
    assert start_gptq() == GPTQSettings().resolved(ConvertConfig(method=settings("gptq")))
    assert c.identity()["method"] == {"name": "tuned", "iters": ITERS, "lr": LR, "scale_lr": 0.0,
                                      "batch": BATCH, "seed": 0, "start": "gptq", "gptq": start_gptq().identity(),
                                      "calibration": c.identity()["method"]["calibration"]}
    rtn = ConvertConfig(method=settings("tuned", from_gptq=False, iters=0)).identity()["method"]
    assert rtn["start"] == "rtn" and "gptq" not in rtn and rtn["iters"] == 0
    assert c.rule == "mse" and c.input_weight_source == "none"


def test_a_tensor_of_row_slices_is_tuned_whole_only_when_they_tile_it():
    """A fused tensor cut into row slices (q/k/v in one tensor) is put together in row order; slices that leave a gap,
    overlap, stride or cut experts are not (those matrices keep their start)."""
    from fp4convert.calibrate.methods.tuned import _row_order
    from fp4convert.plan.types import Matrix

    q, k, v = (Matrix(n, (4, 8), rows=r) for n, r in (("q", (0, 4, 1)), ("k", (4, 6, 1)), ("v", (6, 8, 1))))
    assert _row_order([v, q, k], (8, 8)) == [q, k, v]
    assert _row_order([Matrix("w", (8, 8))], (8, 8)) == [Matrix("w", (8, 8))]
    assert _row_order([q, v], (8, 8)) is None  # (a gap)
    assert _row_order([q, k], (8, 8)) is None  # (rows left over)
    assert _row_order([q, Matrix("k", (4, 8), rows=(2, 6, 1)), v], (8, 8)) is None
    assert _row_order([Matrix("e", (4, 8), expert=0)], (2, 4, 8)) is None
    assert _row_order([Matrix("s", (4, 8), rows=(0, 8, 2))], (8, 8)) is None


def test_a_recorded_call_is_cut_to_the_samples_drawn():
    """Tensors of two or more dimensions led by the micro-batch are indexed; a 1-D tensor of that length (a cache
    position over as many tokens) and other values stay as recorded."""
    from fp4convert.calibrate.methods.tuned import _take

    h, mask, pos = torch.randn(4, 3, 2), torch.randn(4, 1, 3, 3), torch.arange(4)
    (args, kw) = _take(((h,), {"attention_mask": mask, "cache_position": pos, "position_embeddings": (h, h),
                               "flag": True}), [3, 1], 4)
    assert torch.equal(args[0], h[[3, 1]]) and torch.equal(kw["attention_mask"], mask[[3, 1]])
    assert kw["cache_position"] is pos and kw["flag"] is True and torch.equal(kw["position_embeddings"][1], h[[3, 1]])
