"""Settings (fp4convert.config): the one size formatter; --kept-dtype's values, identity and dtype map."""

from __future__ import annotations

import pytest

from fp4convert.config import ConvertConfig, human_bytes, kept_output_dtype
from fp4convert.errors import ConfigError


@pytest.mark.parametrize("n,text", [(0, "0 B"), (999, "999 B"), (1000, "1.00 KB"), (1500, "1.50 KB"),
                                    (2_500_000, "2.50 MB"), (3.2e9, "3.20 GB"), (7e12, "7.00 TB"),
                                    (9e15, "9000.00 TB")])
def test_human_bytes_adapts_its_unit(n, text) -> None:
    assert human_bytes(n) == text


def test_kept_dtype_values_identity_and_map() -> None:
    assert ConvertConfig().kept_dtype == "source"
    assert "kept_dtype" not in ConvertConfig().identity()  # identities (and manifests) of default runs unchanged
    assert ConvertConfig(kept_dtype="source").identity() == ConvertConfig().identity()
    assert ConvertConfig(kept_dtype="bf16").identity() == {**ConvertConfig().identity(), "kept_dtype": "bf16"}
    with pytest.raises(ConfigError, match="--kept-dtype 'fp16'"):
        ConvertConfig(kept_dtype="fp16")
    want = {"F32": "BF16", "F64": "BF16", "F16": "F16", "BF16": "BF16", "I32": "I32", "U8": "U8", "BOOL": "BOOL",
            "F8_E4M3": "F8_E4M3", "F4": "F4"}
    assert {d: kept_output_dtype(d, "bf16") for d in want} == want
    assert {d: ConvertConfig(kept_dtype="bf16").kept_output_dtype(d) for d in want} == want
    assert all(kept_output_dtype(d, "source") == d for d in want)


def test_the_recipe_is_the_identity_and_run_options_never_change_it() -> None:
    """issue 29: the configuration is split into the recipe (what decides the bytes, what --resume compares)
    and the run options. Changing any run option leaves the identity as it is; changing any recipe field
    (to another valid value) changes it."""
    from dataclasses import fields, replace

    from fp4convert.calibrate.methods import settings
    from fp4convert.config import Recipe, RunOptions

    base = ConvertConfig()
    assert {f.name for f in fields(Recipe)}.isdisjoint(f.name for f in fields(RunOptions))
    assert {f.name for f in fields(ConvertConfig)} == {f.name for f in fields(Recipe)} | {f.name for f in fields(RunOptions)}
    run_changes = {"device": "cpu", "overwrite": True, "resume": True, "verify_source": True, "lanes": 3,
                   "backend": "cpu", "allow_no_config": True}
    assert set(run_changes) == {f.name for f in fields(RunOptions)}
    for name, value in run_changes.items():
        assert replace(base, **{name: value}).identity() == base.identity(), name
    recipe_changes = {"scheme": ("mxfp4",), "rotate": ("had16",), "scale_rule": ("max",), "format": ("modelopt",),
                      "ignore": (("x",),), "only": (("y",),), "max_shard_size": (10**6,), "revision": ("main",),
                      "base_model": ("org/name",), "kept_dtype": ("bf16",), "input_weights": ("random",),
                      "calibration_samples": (4,), "calibration_seq_len": (8,), "calibration_seed": (1,),
                      "activations": ("nvfp4",), "activation_scale": ("constant",), "calibration_data": ("c.txt",),
                      "method": (settings("gptq"),)}
    assert set(recipe_changes) == {f.name for f in fields(Recipe)}
    # fields that only count with others on (W4A4 NVFP4 with calibration / input weights) are changed with them
    w4a4 = replace(base, activations="nvfp4", format="compressed-tensors")
    iw = replace(base, input_weights="random")
    for name, (value,) in recipe_changes.items():
        start = w4a4 if name in ("activation_scale", "calibration_data") else \
            iw if name in ("calibration_samples", "calibration_seq_len", "calibration_seed") else base
        if name == "activations":
            start, changed = replace(base, format="compressed-tensors"), w4a4
        else:
            changed = replace(start, **{name: value})
        assert changed.identity() != start.identity(), name
        assert changed.recipe != start.recipe and changed.run_options == start.run_options, name


def test_every_method_setting_changes_the_identity() -> None:
    """Each field of a calibrated method's settings decides its bytes: changing it (to another valid value)
    changes the recipe's identity (what --resume compares and the manifest records)."""
    from dataclasses import fields, replace

    from fp4convert.calibrate.methods import get_method, method_names, settings

    other = {bool: lambda v: not v if v is not None else False, float: lambda v: 0.25, int: lambda v: 256}
    w4a4 = {"activations": "nvfp4", "format": "compressed-tensors"}
    for name in method_names():
        base = settings(name)
        kinds = {o.field: o.kind for o in get_method(name).Settings.options}
        assert {f.name for f in fields(base)} == set(kinds), name  # every setting has its option
        try:  # (W4A4, where every GPTQ setting counts; weight-only for a method that refuses it)
            recipe: dict = w4a4
            resolved = ConvertConfig(method=base, **recipe).method_settings  # (a default changed to its own value is no change)
        except ConfigError:
            recipe = {}
            resolved = ConvertConfig(method=base).method_settings
        for f in fields(base):
            changed = replace(base, **{f.name: other[kinds[f.name]](getattr(resolved, f.name))})
            a, b = ConvertConfig(method=base, **recipe), ConvertConfig(method=changed, **recipe)
            assert a.identity() != b.identity(), (name, f.name)

