"""Self-generation's static-cache steps (fp4convert/calibrate/decode.py): what they compute, on the CPU.

The CUDA graph itself is tested on a GPU (tests/calibrate/test_layerwise.py); here the steps it captures, run
eagerly, must give the logits of the whole sequence's forward at every position: the position reaches the
model as device tensors, so a wrong one would show as other logits.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from fp4convert.calibrate.decode import GraphedSteps, graphed_steps


def tiny(model_type: str):
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    if model_type == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    else:  # sliding-window and full-attention layers mixed, as Gemma 3 has them
        cfg = tf.Gemma3TextConfig(**common, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
        cls = tf.Gemma3ForCausalLM
    torch.manual_seed(0)
    return cls(cfg).eval()


def cache_key(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_static_cache_steps_give_the_whole_sequences_logits(model_type):
    model = tiny(model_type)
    steps = GraphedSteps(model, 3, 12, torch.device("cpu"), 97, cache_key(model), capture=False)
    seq = torch.tensor([[1], [5], [9]])
    with torch.no_grad():
        for pos in range(9):
            logits = steps.step(seq[:, -1:], pos)
            whole = model(input_ids=seq).logits[:, -1, :97].float()
            torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)


def test_no_graph_on_a_cpu_or_for_short_samples():
    model = tiny("llama")
    assert graphed_steps(model, 2, 12, "cpu", 97, cache_key(model)) is None
    if torch.cuda.is_available():
        assert graphed_steps(model.cuda(), 2, 2, "cuda", 97, cache_key(model)) is None
