"""Generators of small test checkpoints (deterministic, seeded, tiny dims so the suite stays fast).

Every generator writes a Hugging Face style folder: safetensors shards (with an index when there is
more than one), ``config.json``, ``generation_config.json`` and a few other non-weight files, and
returns the tensors it wrote (name -> tensor) so tests can compare against them.

Shards are laid out explicitly (``list[list[name]]``), so a test knows which group is split across a
source shard boundary. ``infos()`` builds ``TensorInfo`` lists for pure planning tests (no files).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp4convert.storage.safetensors import ITEMSIZE, TensorInfo

BF16 = torch.bfloat16
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Non-weight files every generator writes; the converter must copy them all.
OTHER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": '{"model_max_length": 256}\n',
    "README.md": "# a tiny test model\n",
    "special/chat_template.jinja": "{{ messages }}\n",
}


def rand(shape, seed: int, dtype: torch.dtype = BF16, std: float = 0.02) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * std).to(dtype)


def _example_writer():
    """The shipped example's own checkpoint writer (one writer for the example and the tests)."""
    spec = importlib.util.spec_from_file_location("make_tiny_llama", EXAMPLES / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_checkpoint


def write(path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: list[list[str]] | None = None,
          other_files: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Write ``tensors`` into the given shard layout (default: one file) with index and config."""
    path = Path(path)
    shards = shards or [list(tensors)]
    assert sorted(n for s in shards for n in s) == sorted(tensors), "every tensor in exactly one shard"
    _example_writer()(path, tensors, config, shards)
    for rel, text in (OTHER_FILES if other_files is None else other_files).items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return tensors


# ---------------------------------------------------------------------------------------------
# Llama
# ---------------------------------------------------------------------------------------------

def llama_config(hidden: int = 64, layers: int = 2, tie: bool = False, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": hidden // 4, "tie_word_embeddings": tie, "torch_dtype": "bfloat16",
        **extra,
    }


def llama_tensors(cfg: dict, seed: int = 0, dtype: torch.dtype = BF16) -> dict[str, torch.Tensor]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    s = iter(range(seed * 1000, seed * 1000 + 1000))
    out = {"model.embed_tokens.weight": rand((vocab, h), next(s), dtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[p + "self_attn.q_proj.weight"] = rand((q_out, h), next(s), dtype)
        out[p + "self_attn.k_proj.weight"] = rand((kv_out, h), next(s), dtype)
        out[p + "self_attn.v_proj.weight"] = rand((kv_out, h), next(s), dtype)
        out[p + "self_attn.o_proj.weight"] = rand((h, q_out), next(s), dtype)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        out[p + "mlp.gate_proj.weight"] = rand((inter, h), next(s), dtype, std=0.05)
        out[p + "mlp.up_proj.weight"] = rand((inter, h), next(s), dtype)
        out[p + "mlp.down_proj.weight"] = rand((h, inter), next(s), dtype)
    out["model.norm.weight"] = torch.ones(h, dtype=dtype)
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = rand((vocab, h), next(s), dtype)
    return out


# Odd tensors that the default rules must keep, with the reason's key words.
ZOO_REASONS = {
    "model.layers.0.self_attn.q_proj.bias": "not a weight",
    "model.layers.1.mlp.codebook.weight": "not floating point",
    "model.layers.1.mlp.stacked.weight": "3-D",
    "model.layers.1.mlp.odd_proj.weight": "K=40",
}


def zoo_tensors(h: int, seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.self_attn.q_proj.bias": rand((h,), seed),
        "model.layers.1.mlp.codebook.weight": torch.randint(-100, 100, (16, h), generator=g, dtype=torch.int32),
        "model.layers.1.mlp.stacked.weight": rand((2, 32, h), seed + 1),
        "model.layers.1.mlp.odd_proj.weight": rand((h, 40), seed + 2),
    }


def llama(path: Path, *, hidden: int = 64, layers: int = 2, tie: bool = False, zoo: bool = False, seed: int = 0,
          dtype: torch.dtype = BF16, single: bool = False) -> dict[str, torch.Tensor]:
    """A Llama in 3 shards; layer 0's fused q/k/v group is split across the shard 1/2 boundary.

    ``zoo`` adds a bias, an int tensor, a 3-D tensor and a K=40 linear (all kept by default).
    ``tie`` writes tie_word_embeddings and no lm_head tensor.
    """
    cfg = llama_config(hidden, layers, tie)
    t = llama_tensors(cfg, seed, dtype)
    if zoo:
        t.update(zoo_tensors(hidden))
    names = list(t)
    cut1 = names.index("model.layers.0.self_attn.v_proj.weight")  # q, k | v
    cut2 = names.index(f"model.layers.{layers - 1}.mlp.up_proj.weight")  # gate | up
    shards = [names] if single else [names[:cut1], names[cut1:cut2], names[cut2:]]
    return write(path, t, cfg, shards)


DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}  # torch -> safetensors, the dtypes below

# F64 values whose correct rounding to BF16 (nearest even) a double rounding through F32 gets wrong, ties, and
# values near the ends of BF16's range (--kept-dtype bf16, docs/formats.md "Kept tensors").
F64_EDGES = [1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-40), 1 + 2**-8, 1 + 3 * 2**-8, 3 * 2**-9 * (1 + 2**-29), 0.0, -0.0,
             1e-300, 1e-40, -3e-39, 2.0**-133, 2.0**-134 * (1 + 2**-30), 3.3e38, float("inf"), float("nan")]


def mixed_kept(path: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """An fp32 Llama (its kept norms, embedding and lm_head F32) in 2 source shards, with kept tensors of
    every other kind: F64 (:data:`F64_EDGES`, then random values), F16, BF16 (the zoo's bias and 3-D tensor),
    I32, U8 and BOOL. config.json says ``float32``, as transformers writes an fp32 model."""
    cfg = llama_config(hidden, layers, torch_dtype="float32")
    t = llama_tensors(cfg, seed, torch.float32)
    t.update(zoo_tensors(hidden))
    g = torch.Generator().manual_seed(seed + 11)
    t["model.layers.0.extra.f64_table"] = torch.cat([torch.tensor(F64_EDGES, dtype=torch.float64),
                                                     torch.randn(2 * hidden, generator=g, dtype=torch.float64)])
    t["model.layers.0.extra.f16_scale"] = rand((hidden,), seed + 12, torch.float16, std=1.0)
    t["model.layers.1.extra.u8_mask"] = torch.randint(0, 255, (hidden,), generator=g, dtype=torch.uint8)
    t["model.layers.1.extra.bool_flag"] = torch.arange(hidden) % 3 == 0
    names = list(t)
    cut = names.index("model.layers.1.input_layernorm.weight")
    return write(path, t, cfg, [names[:cut], names[cut:]])


def wide_vocab(path: Path, *, vocab: int = 40000, hidden: int = 256, layers: int = 1, seed: int = 3
               ) -> dict[str, torch.Tensor]:
    """A Llama whose kept embedding and lm_head are 20 MB each (bf16), in 3 source shards: its output
    (one shard at the default size) spans several of the checksum's 16 MiB chunks and the copies several
    pieces."""
    cfg = llama_config(hidden, layers, vocab_size=vocab)
    t = llama_tensors(cfg, seed)
    names = list(t)
    return write(path, t, cfg, [names[:1], names[1:-1], names[-1:]])


# ---------------------------------------------------------------------------------------------
# MoE (Qwen2-MoE style: router, experts, shared expert with its gate)
# ---------------------------------------------------------------------------------------------

def moe(path: Path, *, hidden: int = 64, experts: int = 3, layers: int = 2, seed: int = 1,
        shards: int = 2) -> dict[str, torch.Tensor]:
    inter = 32
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 96,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_experts": experts, "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": 2 * inter, "num_attention_heads": 4, "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    }
    s = iter(range(seed * 1000, seed * 1000 + 1000))
    t = {"model.embed_tokens.weight": rand((96, hidden), next(s))}
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{proj}.weight"] = rand((hidden, hidden), next(s))
        t[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=BF16)
        t[p + "mlp.gate.weight"] = rand((experts, hidden), next(s))
        for e in range(experts):
            q = p + f"mlp.experts.{e}."
            # Experts get very different magnitudes, so a per-expert (not per-layer) scale is visible.
            t[q + "gate_proj.weight"] = rand((inter, hidden), next(s), std=0.01 * (e + 1))
            t[q + "up_proj.weight"] = rand((inter, hidden), next(s), std=0.02 * (e + 1))
            t[q + "down_proj.weight"] = rand((hidden, inter), next(s))
        t[p + "mlp.shared_expert.gate_proj.weight"] = rand((2 * inter, hidden), next(s), std=0.03)
        t[p + "mlp.shared_expert.up_proj.weight"] = rand((2 * inter, hidden), next(s))
        t[p + "mlp.shared_expert.down_proj.weight"] = rand((hidden, 2 * inter), next(s))
        t[p + "mlp.shared_expert_gate.weight"] = rand((1, hidden), next(s))
    t["model.norm.weight"] = torch.ones(hidden, dtype=BF16)
    t["lm_head.weight"] = rand((96, hidden), next(s))
    names = list(t)
    per = -(-len(names) // shards)
    return write(path, t, cfg, [names[i * per:(i + 1) * per] for i in range(shards)])


# ---------------------------------------------------------------------------------------------
# DeepSeek-style (MLA q_a/kv_a group, Mixtral-style w1/w3 experts, an MTP layer), vision tower
# ---------------------------------------------------------------------------------------------

def deepseek(path: Path, *, hidden: int = 64, seed: int = 2) -> dict[str, torch.Tensor]:
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": hidden,
           "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "vocab_size": 96,
           # MLA dimensions matching the tensors below (the model definition checks every shape)
           "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
           "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32, "moe_intermediate_size": 32,
           "intermediate_size": 32, "n_routed_experts": 2, "num_experts_per_tok": 1, "first_k_dense_replace": 0}
    s = iter(range(seed * 1000, seed * 1000 + 1000))
    t = {"model.embed_tokens.weight": rand((96, hidden), next(s))}
    for i in range(3):  # layers 0, 1 and the MTP layer 2
        p = f"model.layers.{i}."
        t[p + "self_attn.q_a_proj.weight"] = rand((32, hidden), next(s))
        t[p + "self_attn.q_a_layernorm.weight"] = torch.ones(32, dtype=BF16)
        t[p + "self_attn.kv_a_proj_with_mqa.weight"] = rand((48, hidden), next(s))
        t[p + "self_attn.q_b_proj.weight"] = rand((hidden, 32), next(s))
        t[p + "self_attn.o_proj.weight"] = rand((hidden, hidden), next(s))
        t[p + "block_sparse_moe.gate.weight"] = rand((2, hidden), next(s))
        for e in range(2):
            q = p + f"block_sparse_moe.experts.{e}."
            t[q + "w1.weight"] = rand((32, hidden), next(s))
            t[q + "w3.weight"] = rand((32, hidden), next(s))
            t[q + "w2.weight"] = rand((hidden, 32), next(s))
    t["model.layers.2.eh_proj.weight"] = rand((hidden, 2 * hidden), next(s))
    t["model.layers.2.enorm.weight"] = torch.ones(hidden, dtype=BF16)
    t["model.layers.2.shared_head.head.weight"] = rand((96, hidden), next(s))
    t["model.vision_tower.blocks.0.attn.qkv.weight"] = rand((3 * hidden, hidden), next(s))
    t["model.multi_modal_projector.linear_1.weight"] = rand((hidden, hidden), next(s))
    t["lm_head.weight"] = rand((96, hidden), next(s))
    return write(path, t, cfg)


def pickle_only(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.zeros(2, 2)}, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(llama_config()))


# ---------------------------------------------------------------------------------------------
# Pure planning inputs and byte-level helpers
# ---------------------------------------------------------------------------------------------

def infos(spec: dict[str, tuple[tuple[int, ...], str] | tuple[int, ...]], file: str = "model.safetensors"
          ) -> list[TensorInfo]:
    """TensorInfos laid out back to back from ``{name: shape}`` or ``{name: (shape, dtype)}`` (BF16 default)."""
    out, off = [], 0
    for name, v in spec.items():
        shape, dtype = (v if len(v) == 2 and isinstance(v[0], tuple) else (v, "BF16"))
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        out.append(TensorInfo(name, dtype, tuple(shape), file, off, off + n))
        off += n
    return out


def header(path: Path) -> tuple[int, dict]:
    """(data start, header dict) of a safetensors file, read independently of fp4convert."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8:8 + n])


def tensor_bytes(path: Path, name: str) -> bytes:
    start, h = header(path)
    b, e = h[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + b)
        return f.read(e - b)


def patch_tensor(path: Path, name: str, data: bytes, at: int = 0) -> None:
    """Overwrite bytes of tensor ``name`` in place (file size unchanged)."""
    start, h = header(path)
    b, e = h[name]["data_offsets"]
    assert b + at + len(data) <= e
    with open(path, "r+b") as f:
        f.seek(start + b + at)
        f.write(data)


def shard_with(root: Path, name: str) -> Path:
    """The output file that holds tensor ``name`` (from the index, or the single file)."""
    idx = Path(root) / "model.safetensors.index.json"
    if idx.exists():
        return Path(root) / json.loads(idx.read_text())["weight_map"][name]
    return Path(root) / "model.safetensors"


def chunked_sha256(data: bytes) -> str:
    """docs/formats.md's definition, written out independently of fp4convert.storage.checksum: the sha256 of
    the concatenated sha256 digests of the data's 16 MiB chunks."""
    return hashlib.sha256(b"".join(hashlib.sha256(data[o : o + (16 << 20)]).digest()
                                   for o in range(0, len(data), 16 << 20))).hexdigest()


def all_files(root: Path) -> dict[str, bytes]:
    """Every file under root (relative posix name -> bytes)."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def big(path: Path, *, layers: int = 16, dim: int = 1024, shards: int = 4, seed: int = 5) -> int:
    """A Llama-like MLP stack whose total size is many times its largest tensor: 3 x ``layers`` square
    bf16 weights of ``dim`` x ``dim`` (plus norms), in ``shards`` files. Returns the largest tensor's bytes.

    Written shard by shard, so the test process never holds the whole model either.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = [f"model.layers.{i}.{n}" for i in range(layers)
             for n in ("post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                       "mlp.down_proj.weight")]
    per = -(-len(names) // shards)
    weight_map = {}
    g = torch.Generator().manual_seed(seed)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for n in names[s * per:(s + 1) * per]:
            part[n] = (torch.ones(dim) if "norm" in n else torch.randn(dim, dim, generator=g) * 0.02).to(BF16)
            weight_map[n] = fname
        save_file(part, str(path / fname), metadata={"format": "pt"})
        del part
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # intermediate_size = dim: the model definition checks every shape (the MLP weights are square here)
    (path / "config.json").write_text(json.dumps(llama_config(dim, layers, intermediate_size=dim)))
    return dim * dim * 2


def nan_checkpoint(path: Path, bad: str = "model.layers.0.mlp.down_proj.weight") -> str:
    """A one-layer Llama whose tensor ``bad`` holds a NaN (quantized by default: exit 3; --ignore it: a warning)."""
    t = llama(path, layers=1, single=True)
    t[bad][3, 5] = float("nan")
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return bad


def tree(root: Path) -> dict[str, str]:
    """Every entry under root: relative name -> sha256 of a file, 'dir' or 'link:TARGET' (to assert a folder unchanged)."""
    import hashlib
    import os

    root = Path(root)
    out = {}
    if not root.exists() and not root.is_symlink():
        return out
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def crash_after_first_shard(monkeypatch, dst: Path, hard: bool = False) -> None:
    """Make a convert() die at the first quantized item after a shard has been finished; ``hard``: like a
    kill -9, no cleanup at all (.partial files stay behind)."""
    import fp4convert.run.work as work

    real = work.quantize

    def flaky(*a, **kw):
        if list(Path(dst).glob("*.safetensors")):
            raise RuntimeError("simulated crash")
        return real(*a, **kw)

    monkeypatch.setattr(work, "quantize", flaky)
    # Writes in the calling thread, so "after a shard has been finished" is exact (tests/run/test_pipeline.py
    # crashes the writer thread itself).
    inline_writes(monkeypatch)
    if hard:
        from fp4convert.output.shards import ShardFile

        monkeypatch.setattr(ShardFile, "abort", lambda self: True)


def inline_writes(monkeypatch) -> None:
    """Every write of a run (an item's writes, a kept copy's pieces, a finished chunk's hash, a finished
    shard's record, sync and rename) in the thread that queued it, in order: a run's writes are then
    done when the next item starts."""
    import fp4convert.run.writebehind as writebehind
    from fp4convert.output import shards

    monkeypatch.setattr(writebehind.WriteBehind, "submit", lambda self, job, light=False, held=True: job())
    monkeypatch.setattr(shards, "background", _inline)


def _inline(kind: str, fn):
    """shards.background, run in the calling thread (a finished shard is renamed before the next write)."""
    from concurrent.futures import Future

    fut: Future = Future()
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed over exactly as the helper thread would
        fut.set_exception(exc)
    return fut


# `python -m fp4convert ARGS` in a fresh interpreter that watches for torch: a meta-path finder
# records the stack of the first `import torch` (then lets the import go ahead), and the record is
# written to the file named by the first argument however the command exits (SystemExit included).
_WATCH_TORCH = """\
import runpy, sys, traceback
record, sys.argv = sys.argv[1], ["fp4convert"] + sys.argv[2:]
class WatchTorch:
    stack = ""
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch" and not WatchTorch.stack:
            WatchTorch.stack = "".join(traceback.format_stack())
        return None
sys.meta_path.insert(0, WatchTorch())
def write_record():
    with open(record, "w") as f:
        f.write(WatchTorch.stack or ("torch imported" if "torch" in sys.modules else ""))
import os
_exit = os._exit
def recorded_exit(code):  # the CLI ends a torch-free CUDA run with os._exit (no teardown): record first
    write_record()
    _exit(code)
os._exit = recorded_exit
try:
    runpy.run_module("fp4convert", run_name="__main__", alter_sys=True)
finally:
    write_record()
"""


def cli_watching_torch(tmp: Path, *args, env: dict | None = None):
    """Run the CLI in a subprocess; returns (CompletedProcess, the stack that imported torch or "")."""
    import subprocess
    import sys

    record = tmp / "torch-import.txt"
    record.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, "-c", _WATCH_TORCH, str(record), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, record.read_text() if record.exists() else "no record: the interpreter died"


def definitions_in_process(mp, like_child: bool = False) -> None:
    """Build model definitions in this process (the caller already imported transformers, or will pay
    for it once): the planner's child (``python -m fp4convert.plan.definition``) would cost a Python start and
    transformers' imports per model (1-2 s; the sweep builds one per architecture, the checkpoint fuzzer
    one per mutated config.json). The request and the answer still go through JSON, as they do through
    the child.

    ``like_child``: an unexpected exception while building becomes :class:`fp4convert.plan.definition.Unknown`
    with the message the planner gives for a child that failed, so a caller that judges the CLI's exit
    codes (the fuzzer) sees what a user would see; without it the exception propagates (the sweep wants
    the traceback).
    """
    from fp4convert.plan import definition as modeldef
    from fp4convert.plan import model_build, roles

    def build(model_config: dict, tensors: list) -> object:
        req = json.loads(json.dumps({"config": model_config, "tensors": [[t.name, list(t.shape)] for t in tensors]},
                                    default=str))
        infos = [TensorInfo(n, "BF16", tuple(shape), "", 0, 0) for n, shape in req["tensors"]]
        try:
            d = model_build.build(req["config"], infos)
        except modeldef.Unknown:
            raise
        except Exception as exc:  # noqa: BLE001 - the child would exit non-zero; the planner says so
            if not like_child:
                raise
            raise modeldef.Unknown(f"the model definition could not be built (exit 1: {type(exc).__name__}: "
                                   f"{roles.one_line(exc)})") from exc
        return modeldef._from_json(json.loads(json.dumps(modeldef._to_json(d))))

    mp.setattr(modeldef, "_build_in_child", build)


def progress_seen(monkeypatch) -> list[int]:
    """The bytes a run tells its (hidden) progress display, one entry per update, in order: the run loop
    updates the library's display (fp4convert.run.progress), a NoProgress unless progress is shown."""
    from fp4convert.run.progress import NoProgress

    seen: list[int] = []
    monkeypatch.setattr(NoProgress, "update", lambda self, n: seen.append(n))
    return seen
