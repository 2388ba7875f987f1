"""Calibration: what W4A4 activation scales and input-weighted scale rules measure on the model.

- :mod:`~fp4convert.calibrate.layerwise`: the block-by-block runner (any model transformers builds; one
  block's weights resident at a time: :mod:`~fp4convert.calibrate.weights`; the model on ``meta`` and its
  blocks: :mod:`~fp4convert.calibrate.model`; progress: :mod:`~fp4convert.calibrate.progress`).
- :mod:`~fp4convert.calibrate.methods`: calibrated rounding methods (``--method gptq``), their results kept
  in a :mod:`~fp4convert.calibrate.store` until written.
- :mod:`~fp4convert.calibrate.capture`: each block's arguments from the model's own forward; the
  experts' inputs of 3-D expert stacks.
- :mod:`~fp4convert.calibrate.stats`: amax / mean-square / ``X^T X`` accumulators, on the device.
- :mod:`~fp4convert.calibrate.samples`: calibration input (a file, random ids, self-generated).
- :mod:`~fp4convert.calibrate.checks`: refusals while planning; sharing groups of activation scales.
- :mod:`~fp4convert.calibrate.stage`: the conversion's statistics stage; :mod:`~fp4convert.calibrate.keep`
  keeps its result for ``--resume``.
"""

from __future__ import annotations

from fp4convert.calibrate.checks import (
    WAYS_OUT,
    activation_calibration,
    check_definition,
    check_destination,
    check_runnable,
    config_key,
    model_errors,
    quantized_modules,
    runs_model,
    share,
    sharing_groups,
    vocab_size,
)
from fp4convert.calibrate.model import build_meta, find_blocks, structure_problem
from fp4convert.calibrate.layerwise import MICRO_BATCH, LayerwiseModel
from fp4convert.calibrate.samples import TOKENIZER_FILES, file_tokens, generate, random_tokens, read_texts, start_token, tokenizer_digest
from fp4convert.calibrate.stage import Statistics, activation_amax, input_weights_for, layerwise_amax, plan_inputs, statistics
from fp4convert.calibrate.stats import Observer, Observers, bf16_ceil
from fp4convert.errors import PlanError, QuantizationError

__all__ = [
    "MICRO_BATCH", "TOKENIZER_FILES", "WAYS_OUT", "LayerwiseModel", "Observer", "Observers", "PlanError",
    "QuantizationError", "Statistics", "activation_amax", "activation_calibration", "bf16_ceil", "build_meta",
    "check_definition", "check_destination", "check_runnable", "config_key", "file_tokens", "find_blocks", "generate",
    "input_weights_for", "layerwise_amax", "model_errors", "plan_inputs", "quantized_modules", "random_tokens",
    "read_texts", "runs_model", "share", "sharing_groups", "start_token", "statistics", "structure_problem",
    "tokenizer_digest", "vocab_size",
]
