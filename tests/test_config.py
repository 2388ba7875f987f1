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
