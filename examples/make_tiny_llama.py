"""Write the example checkpoint that ships with the repo: a tiny Llama in two bf16 safetensors shards.

Deterministic (seeded), ~3.7 MB, every dimension a multiple of 32 so both NVFP4 and MXFP4 apply.
It is a real ``LlamaForCausalLM`` checkpoint (config, index, shards) that transformers can load.

    python examples/make_tiny_llama.py examples/tiny-llama
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def llama_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with realistic magnitudes (std ~0.02, a few outliers per matrix)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(out: int, inp: int) -> torch.Tensor:
        t = torch.randn(out, inp, generator=g) * 0.02
        idx = torch.randint(0, t.numel(), (max(1, t.numel() // 4096),), generator=g)
        t.view(-1)[idx] *= 8.0  # outliers, as real weights have
        return t.to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(q_out, h)
        out[p + "self_attn.k_proj.weight"] = w(kv_out, h)
        out[p + "self_attn.v_proj.weight"] = w(kv_out, h)
        out[p + "self_attn.o_proj.weight"] = w(h, q_out)
        out[p + "mlp.gate_proj.weight"] = w(inter, h)
        out[p + "mlp.up_proj.weight"] = w(inter, h)
        out[p + "mlp.down_proj.weight"] = w(h, inter)
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out["lm_head.weight"] = w(vocab, h)
    return out


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict,
                     shards: int | list[list[str]] = 2) -> None:
    """Split ``tensors`` into safetensors files with an index, as the Hub does.

    ``shards`` is a count (names cut evenly, in order) or the tensor names of each file.
    """
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(shards, int):
        names = list(tensors)
        per = -(-len(names) // shards)
        shards = [names[s * per : (s + 1) * per] for s in range(shards)]
    n = len(shards)
    weight_map, total = {}, 0
    for s, names in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
        part = {k: tensors[k].contiguous() for k in names}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        for k, t in part.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config.get("bos_token_id", 1), "eos_token_id": config.get("eos_token_id", 2)}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "tiny-llama")
    write_checkpoint(dest, llama_tensors(CONFIG), CONFIG)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
