"""Settings (fp4convert.config): the one size formatter."""

from __future__ import annotations

import pytest

from fp4convert.config import human_bytes


@pytest.mark.parametrize("n,text", [(0, "0 B"), (999, "999 B"), (1000, "1.00 KB"), (1500, "1.50 KB"),
                                    (2_500_000, "2.50 MB"), (3.2e9, "3.20 GB"), (7e12, "7.00 TB"),
                                    (9e15, "9000.00 TB")])
def test_human_bytes_adapts_its_unit(n, text) -> None:
    assert human_bytes(n) == text
