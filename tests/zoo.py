"""A model zoo: tiny random models of real transformers classes, saved with ``save_pretrained``.

Each family is built from its own config class with tiny dimensions (every linear in-feature a
multiple of 32, so NVFP4 and MXFP4 can quantize everything), seeded, in bf16, and written as
safetensors exactly as transformers 5 writes them (its save reverses the load-time key conversion,
so the names on disk are the checkpoint names users download). A build takes well under a second.

Variants of a built checkpoint, written from its files (no model needed):

- :func:`fp8_block_variant`: DeepSeek-V3 style FP8 (``float8_e4m3fn`` ``weight`` plus fp32
  ``weight_scale_inv`` ``[ceil(M/bm), ceil(N/bn)]``, config ``quantization_config`` quant_method fp8).
- :func:`mxfp4_variant`: gpt-oss's release format (``*_blocks`` / ``*_scales`` for the 3-D experts,
  config ``quantization_config`` quant_method mxfp4), the layout transformers'
  ``integrations/mxfp4.py`` (``_convert_moe_packed_tensors``) decodes.

Both variants return the tensors of their fp32-dequantized twin (:func:`write_like` writes it), so a
test can compare the two conversion routes byte for byte.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Family:
    """How to build one family and how transformers loads it back."""

    name: str
    model_class: str  # transformers class used to build and to load
    auto_class: str  # the Auto class a user would load it with
    moe: str | None = None  # None, "per-expert" (2-D per expert on disk) or "stacked" (3-D on disk)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", "AutoModelForCausalLM"),
    Family("qwen3_tied", "Qwen3ForCausalLM", "AutoModelForCausalLM"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "AutoModelForCausalLM", "per-expert"),
    Family("mixtral", "MixtralForCausalLM", "AutoModelForCausalLM", "per-expert"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "AutoModelForCausalLM", "per-expert"),
    Family("gpt_oss", "GptOssForCausalLM", "AutoModelForCausalLM", "stacked"),
    Family("llama4", "Llama4ForCausalLM", "AutoModelForCausalLM", "stacked"),
    Family("gemma3", "Gemma3ForConditionalGeneration", "AutoModelForImageTextToText"),
    Family("bert", "BertModel", "AutoModel"),
)}


def _config(family: str):
    """The tiny config of a family (transformers config object)."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    if family == "llama":
        return tf.LlamaConfig(**common, intermediate_size=128, tie_word_embeddings=False)
    if family == "qwen3_tied":
        return tf.Qwen3Config(**common, intermediate_size=128, tie_word_embeddings=True)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                 tie_word_embeddings=False)
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False)
    if family == "deepseek_v3":
        c = {k: v for k, v in common.items() if k != "head_dim"}
        return tf.DeepseekV3Config(**c, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=4,
                                   n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                                   first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                                   qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                                   tie_word_embeddings=False)
    if family == "gpt_oss":
        return tf.GptOssConfig(**common, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=16, tie_word_embeddings=False)
    if family == "llama4":
        return tf.Llama4TextConfig(**common, intermediate_size=96, intermediate_size_mlp=128,
                                   num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1,
                                   tie_word_embeddings=False)
    if family == "gemma3":
        text = dict(common, intermediate_size=128, sliding_window=16)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=32, patch_size=16, vision_use_head=False)
        return tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                               image_token_index=127, boi_token_index=125, eoi_token_index=126)
    if family == "bert":
        return tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=128, max_position_embeddings=64)
    raise KeyError(family)


def build(family: str, path: Path, seed: int = 0, dtype: torch.dtype = BF16) -> Path:
    """Save a tiny random ``family`` model (bf16 safetensors unless ``dtype``, config.json) into ``path``."""
    import transformers as tf

    cls = getattr(tf, FAMILIES[family].model_class)
    torch.manual_seed(seed)
    model = cls(_config(family)).to(dtype).eval()
    path = Path(path)
    model.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# Reading a saved checkpoint
# ---------------------------------------------------------------------------------------------

def shard_files(path: Path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in shard_files(path):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in shard_files(path):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = tuple(h.get_slice(k).get_shape())
    return out


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = read_config(src)
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# FP8 block-scaled variant (DeepSeek-V3 / R1, Kimi K2, Qwen3-FP8 release format)
# ---------------------------------------------------------------------------------------------

FP8_MAX = 448.0


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 ``weight_scale_inv``): W ~= fp8 * scale_inv per (bm, bn) block.

    Partial edge blocks get their own scale from their own elements (as DeepSeek's release does).
    """
    m, n = w.shape
    bm, bn = block
    gm, gn = math.ceil(m / bm), math.ceil(n / bn)
    wf = w.float()
    pad = torch.zeros(gm * bm, gn * bn)
    pad[:m, :n] = wf.abs()
    amax = pad.reshape(gm, bm, gn, bn).amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale_inv.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:m, :n]
    q = (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv.float()


def fp8_block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The exact fp32 value of an FP8 block-scaled weight (fp8 -> fp32, times its block's scale)."""
    m, n = q.shape
    full = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:m, :n]
    return q.float() * full


def fp8_block_variant(src: Path, dst: Path, block: tuple[int, int] = (128, 128),
                      quantize: callable = None) -> dict[str, torch.Tensor]:
    """Write ``src`` as an FP8 block-scaled checkpoint; returns what its fp32-dequantized twin holds
    (FP8 weights as their exact fp32 values, every other tensor unchanged).

    ``quantize(name, shape) -> bool`` picks the weights stored in FP8 (default: every 2-D ``.weight``
    except embeddings, norms, routers and lm_head, as DeepSeek-V3 ships it).
    """
    def default(name: str, shape: tuple[int, ...]) -> bool:
        leaf = name.lower()
        return (name.endswith(".weight") and len(shape) == 2 and "embed" not in leaf and "norm" not in leaf
                and "lm_head" not in leaf and not name.endswith(("mlp.gate.weight", "router.weight")))

    pick = quantize or default
    out, exact = {}, {}
    for name, t in read_tensors(src).items():
        if pick(name, tuple(t.shape)):
            q, s = fp8_block_quantize(t, block)
            out[name], out[name + "_scale_inv"] = q, s
            exact[name] = fp8_block_dequantize(q, s, block)
        else:
            out[name] = exact[name] = t
    _rewrite(src, dst, out, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": list(block)})
    return exact


# ---------------------------------------------------------------------------------------------
# gpt-oss MXFP4 release variant (*_blocks / *_scales)
# ---------------------------------------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_blocks_quantize(w_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss blocks/scales of ``[..., out, in]``: U8 ``[..., out, in/32, 16]`` and U8 ``[..., out, in/32]``.

    Scale byte = 127 + floor(log2(block amax)) - 2 (OCP rule); codes by nearest E2M1 value (ties to
    the lower index, which is all this test format needs: the decode below is what defines the value).
    """
    *lead, o, i = w_out_in.shape
    x = w_out_in.float().reshape(*lead, o, i // 32, 32)
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    scaled = x / torch.exp2(e).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (e + 127).to(torch.uint8)


def mxfp4_blocks_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``[..., out, in]`` of gpt-oss blocks/scales (low nibble first, times 2**(scale-127))."""
    lo, hi = E2M1[(blocks & 0xF).long()], E2M1[(blocks >> 4).long()]
    vals = torch.stack([lo, hi], -1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return vals.reshape(*blocks.shape[:-2], -1)


def mxfp4_variant(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Write a gpt-oss checkpoint as released (experts as MXFP4 ``*_blocks``/``*_scales``).

    Returns the fp32-dequantized twin: experts as their exact fp32 values in the bf16 checkpoint's
    own layout (``[E, in, out]``, what transformers' dequantizing loader rebuilds), the rest unchanged.
    """
    out, exact = {}, {}
    for name, t in read_tensors(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_blocks_quantize(t.transpose(1, 2))  # on disk: [E, out, in]
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            exact[name] = mxfp4_blocks_dequantize(blocks, scales).transpose(1, 2).contiguous()
        else:
            out[name] = exact[name] = t
    _rewrite(src, dst, out, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return exact


def write_like(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint with ``src``'s config (minus any quantization_config) and other files, holding ``tensors``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = read_config(src)
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst
