"""Activation calibration for W4A4, one decoder layer at a time.

NVFP4 W4A4 engines quantize every linear's input per 16-block under a static per-tensor global scale
read from the checkpoint (docs/formats.md "W4A4"). That scale comes from the input's absolute maximum
(amax) on calibration tokens. Here the model is built from its config.json on the ``meta`` device
(transformers, no weights), and run one decoder layer at a time: the embedding first, then each
layer's weights loaded from the source safetensors, all samples' hidden states run through it, every
``nn.Linear`` input's amax recorded by a forward pre-hook, the layer freed and the hidden states
carried on. Peak memory is one layer plus the activations, whatever the number of layers.

Each layer runs through the base model's own ``forward`` as a one-layer model (the layer list, the
final norm and the config's layer count/types narrowed to it), so position embeddings and attention
masks are exactly those a whole-model forward computes: the amax equals that of the whole model run
normally (tests/test_calibrate.py checks it with ``torch.equal``). Everything runs in fp32 and the
amax is a max (order-free); the amax is then rounded up to
bf16 precision (at most 0.4% larger) so the last-bit GEMM differences between devices rarely reach
the stored scale.

With no ``--calibration-data`` the model writes its own samples (data-free calibration): seeded
sampling from the start token, one token for every sample per pass over the layers (a KV cache per
layer), so it costs ``seq_len`` passes over the weights; give a text file for large models.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import Cancelled, FP4ConvertError, PlanError, QuantizationError, RankStopped
from fp4convert.plan.types import QUANTIZE
from fp4convert.quantizer.backend import InputWeight

if TYPE_CHECKING:
    import torch

    from fp4convert.config import ConvertConfig
    from fp4convert.plan.planner import Plan
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)

WAYS_OUT = "or convert without the model run (--input-weights none; W4A4: --activation-scale constant)"
MICRO_BATCH = 8  # samples per forward (bounds the intermediates; the amax does not depend on it)
# Families whose checkpoint names equal the transformers module parameter names and whose base
# model forward takes inputs_embeds unchanged (checked against transformers 5.24).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json")
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|w1|w3|down_proj|w2)$")


# -- which modules share one activation scale ------------------------------------------------

def quantized_modules(plan: Plan) -> list[str]:
    """Every output module the plan quantizes (each gets an activation scale)."""
    return [m.module for d in plan.decisions if d.action == QUANTIZE for m in d.matrices]


def sharing_groups(plan: Plan) -> list[list[str]]:
    """Modules that must carry one activation scale: the plan's fused groups (q/k/v, gate/up, each
    expert's gate/up: the engines' fused GEMMs read one input scale) and, per MoE layer, all experts'
    gate/up (w13) and all experts' down (w2): vLLM reduces ``w13_input_scale``/``w2_input_scale`` to
    their max across experts, so an expert the calibration never routed to still gets a real scale."""
    modules = quantized_modules(plan)
    parent = {m: m for m in modules}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    for members in plan.all_groups().values():
        for m in members[1:]:
            union(members[0], m)
    by_layer: dict[tuple[str, str], str] = {}
    for m in modules:
        hit = _EXPERT.match(m)
        if hit:
            key = (hit.group(1), "w2" if hit.group(2) in ("down_proj", "w2") else "w13")
            union(by_layer.setdefault(key, m), m)
    out: dict[str, list[str]] = {}
    for m in modules:
        out.setdefault(find(m), []).append(m)
    return list(out.values())


def share(amax: dict[str, float], plan: Plan) -> dict[str, float]:
    """The per-module amax with every sharing group at its members' max."""
    out: dict[str, float] = {}
    for members in sharing_groups(plan):
        vals = [amax[m] for m in members if m in amax]
        if not vals:
            raise QuantizationError(f"calibration measured no input for {members[0]}; check the model runs these "
                                    "modules, or use --activation-scale constant")
        top = max(vals)
        if not top > 0:
            raise QuantizationError(f"{members[0]}: every calibration input was zero (amax 0): no activation scale "
                                    "can be derived; give more calibration data or use --activation-scale constant")
        for m in members:
            out[m] = top
    return out


# -- refusing what cannot be calibrated, before anything is written ----------------------------

def runs_model(config: ConvertConfig) -> bool:
    """Does this conversion run the model (W4A4 NVFP4 activation calibration, or input weights)?"""
    return activation_calibration(config) or config.input_weight_source != "none"


def activation_calibration(config: ConvertConfig) -> bool:
    return config.activations == "nvfp4" and config.activation_scale == "calibrate"


def _what(config: ConvertConfig) -> tuple[str, str]:
    """(what runs the model, the option that avoids it): the words of a refusal."""
    if activation_calibration(config):
        return "activation calibration", "or use --activation-scale constant"
    return f"--input-weights {config.input_weight_source}", "or use --input-weights none"


def check_runnable(source: Source, config: ConvertConfig) -> None:
    """Refuse (exit 2, the reason) a model run that cannot happen: called while planning, before
    anything is written. The activation calibration of W4A4 and the input weights' pass
    (``--input-weights``) have the same needs; random token ids need no tokenizer."""
    if not runs_model(config):
        return
    iw = config.input_weight_source
    what, other = _what(config)
    if source.is_hub:
        raise PlanError(f"{what} runs the model from a local folder: download the checkpoint first "
                        f"(huggingface-cli download), {other}")
    root = Path(source.root)
    cfg = source.config()
    if not cfg:
        raise PlanError(f"{root}: no config.json; {what} needs the model definition ({other})")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise PlanError(f"{root}: {what} runs the model layer by layer, which supports model types "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}, not {mt!r} (its checkpoint names or forward differ); "
                        f"{other}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise PlanError(f"{what} needs transformers (pip install transformers), {other}") from None
    text = activation_calibration(config) or iw == "calibration"
    if text and not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise PlanError(f"{root}: no tokenizer (tokenizer.json / tokenizer.model / vocab.json); {what} needs one "
                        f"to tokenize or generate its samples ({other})")
    vocab = vocab_size(root, cfg.get("vocab_size")) if iw == "random" else None
    if text and config.calibration_data is not None and not Path(config.calibration_data).is_file():
        raise PlanError(f"--calibration-data {config.calibration_data}: no such file")
    check_definition(source, cfg, other, vocab)


def vocab_size(root: Path, value: object) -> int:
    """config.json's vocab_size as the bound of random token ids: a positive int (``true`` is a bool to
    JSON, not 1, and ``128.0`` is no int: transformers would refuse either)."""
    if value is None:
        raise PlanError(f"{root}: config.json has no vocab_size; --input-weights random draws token ids below it; "
                        "fix config.json, or use --input-weights none")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{root}: config.json vocab_size={value!r} is not a positive integer; --input-weights random "
                        "draws token ids below it; fix config.json (vocab_size), or use --input-weights none")
    return value


def check_definition(source: Source, cfg: dict, other: str, vocab: int | None = None) -> None:
    """Build the config and the model (on ``meta``: no memory, ~0.1 s for 70B) as the layer-by-layer run
    will, and compare the parameters' shapes with the checkpoint's headers (no data read): a config.json
    transformers cannot read or build, or one that disagrees with the weights, is refused here, while
    planning, rather than failing mid-run (``vocab``: random ids are drawn below it, so the embedding
    must have that many rows)."""
    import torch
    import transformers as tf

    root = Path(source.root)
    said = _Said()
    with model_errors(root, cfg, "read", other, said):
        tcfg = tf.AutoConfig.from_pretrained(str(root), local_files_only=True)
    with model_errors(root, cfg, "build the model of", other, said), torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tcfg, dtype=torch.float32)
        embed = {id(m): n for n, m in model.named_modules()}[id(model.get_decoder().embed_tokens)] + ".weight"
    infos = {t.name: t for t in source.tensors()}
    rows = infos[embed].shape[0] if embed in infos and infos[embed].shape else None
    if vocab is not None and rows is not None and vocab > rows:
        raise PlanError(f"{root}: config.json vocab_size {vocab} is larger than the {rows} rows of {embed}: random "
                        "token ids would have no embedding; fix config.json (vocab_size), or use --input-weights none")
    for name, param in model.named_parameters():
        info = infos.get(name)
        if info is None:
            continue  # the run names a missing tensor itself (LayerwiseModel._read)
        want, got = tuple(param.shape), tuple(info.shape)
        # the embedding and head may hold more rows than vocab_size (padded); token ids stay below both
        ok = got[1:] == want[1:] and got[:1] >= want[:1] if name in (embed, "lm_head.weight") else got == want
        if not ok:
            raise PlanError(f"{root}: {name} is {list(got)} in the checkpoint but {list(want)} in the model "
                            f"config.json describes (its sizes disagree with the weights); fix config.json, {other}")


def _passes(exc: BaseException) -> bool:
    """Errors of the run that are not the model definition's: fp4convert's own (already one line, with
    their exit code), memory, file I/O naming a file (the CLI names it), and internal control flow."""
    if isinstance(exc, (FP4ConvertError, MemoryError, RankStopped, Cancelled)):
        return True
    if isinstance(exc, OSError) and exc.filename is not None:
        return True
    import torch

    return isinstance(exc, (getattr(torch, "OutOfMemoryError", MemoryError), getattr(torch, "AcceleratorError", MemoryError)))


@contextmanager
def model_errors(root: Path, cfg: dict, doing: str, other: str, said: _Said | None = None):
    """Any failure of transformers to read, build or run the model from this config.json as a one-line
    PlanError (exit 2: the checkpoint converts without the model run, ``other`` says how) naming the
    folder and, where it can be told, the config.json key; KeyboardInterrupt is no Exception and passes.
    ``said``: what transformers logs, kept across stages (it warns of a bad rope factor when it reads
    the config and fails on it when it builds the model)."""
    said = said if said is not None else _Said()
    tf_log = logging.getLogger("transformers")
    tf_log.addHandler(said)
    try:
        yield
    except Exception as exc:
        if _passes(exc):
            raise
        key, named = config_key(cfg, exc, doing, said.texts)
        where = "" if key is None else f" (key {key!r})" if named else \
            f" (it {'reads' if doing == 'read' else 'builds'} without key {key!r})"
        raise PlanError(f"{root}: transformers cannot {doing} this config.json{where}: {type(exc).__name__}: "
                        f"{_one_line(exc)}; fix config.json, {other}") from exc
    finally:
        tf_log.removeHandler(said)


class _Said(logging.Handler):
    """What transformers logged (warnings and above) while reading or building the model."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.texts.append(record.getMessage())
        except Exception:  # noqa: BLE001 - a message that does not format names no key
            pass


# config keys transformers renames when it reads them (an error names the new name)
_RENAMED = {"rope_parameters": ("rope_scaling", "rope_theta")}
BISECT_SECONDS = 10.0  # at most this long finding which key fails (each try builds the config/model on meta)


def config_key(cfg: dict, exc: BaseException, doing: str = "read", said: list[str] = ()) -> tuple[str | None, bool]:
    """(the config.json key a failure is about, whether a message named it): the earliest key the
    exception's message names (quoted, or a snake_case word), else one transformers' log named while it
    failed, else the key holding a KeyError's unknown value (an activation, a rope type); else, not
    named, the first key without which the config reads (and the model builds; tried within
    BISECT_SECONDS); (None, False) when none."""
    for text in (str(exc), *reversed(said)):
        key = _named_key(cfg, text)
        if key is not None:
            return key, True
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], str):
        for k, v in cfg.items():
            if _holds(v, exc.args[0]):
                return k, True
    return _bisect_key(cfg, doing != "read"), False


def _named_key(cfg: dict, text: str) -> str | None:
    """The top-level config key ``text`` names first (transformers' renamed keys as the one config.json has)."""
    hits = []
    for k in [*cfg, *_RENAMED]:
        if not isinstance(k, str):
            continue
        quoted = re.search(rf"['\"`]{re.escape(k)}['\"`]", text)
        word = re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", text) if "_" in k else None
        hit = quoted or word
        real = next((r for r in _RENAMED.get(k, (k,)) if r in cfg), None)
        if hit and real is not None:
            hits.append((hit.start(), real))
    return min(hits)[1] if hits else None


def _holds(value: object, wanted: str) -> bool:
    if isinstance(value, dict):
        return any(_holds(v, wanted) for v in value.values())
    if isinstance(value, list):
        return any(_holds(v, wanted) for v in value)
    return value == wanted


def _bisect_key(cfg: dict, build: bool) -> str | None:
    """The first key whose removal (transformers' default instead) lets the config read (and the model
    build on meta): the value it cannot take. None when the whole config reads here (another cause)."""
    import time
    import warnings

    import torch
    import transformers as tf

    mt = cfg.get("model_type")
    if not isinstance(mt, str) or mt not in tf.CONFIG_MAPPING:  # (its .get() finds nothing: a lazy mapping)
        return None
    cls = tf.CONFIG_MAPPING[mt]

    def works(d: dict) -> bool:
        try:
            c = cls.from_dict(d)
            if build:
                with torch.device("meta"):
                    tf.AutoModelForCausalLM.from_config(c, dtype=torch.float32)
            return True
        except Exception:  # noqa: BLE001 - a trial: any failure means this key is not the only cause
            return False

    verbosity = tf.logging.get_verbosity()
    tf.logging.set_verbosity_error()  # the trials' own warnings would repeat the first failure's
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if works(dict(cfg)):
                return None
            end = time.monotonic() + BISECT_SECONDS
            for k in cfg:
                if k in ("model_type", "architectures") or time.monotonic() > end:
                    continue
                if works({n: v for n, v in cfg.items() if n != k}):
                    return k
    finally:
        tf.logging.set_verbosity(verbosity)
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


# -- samples ------------------------------------------------------------------------------------

def read_texts(path: Path) -> list[str]:
    """A calibration file: JSON lines with a ``text`` field, or plain text (one document)."""
    raw = Path(path).read_text(encoding="utf-8", errors="replace")
    lines = [ln for ln in raw.splitlines() if ln.strip()]
    if lines and all(ln.lstrip().startswith("{") for ln in lines):
        texts = []
        for i, ln in enumerate(lines, 1):
            try:
                obj = json.loads(ln)
            except json.JSONDecodeError as exc:
                raise PlanError(f"{path}:{i}: not a JSON line ({exc.msg}); give JSON lines with a 'text' field or plain text") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise PlanError(f"{path}:{i}: a JSON line without a string 'text' field")
            texts.append(obj["text"])
        return texts
    return [raw]


def tokenizer_digest(root: Path) -> str:
    """sha256 over the tokenizer files present (name and bytes, sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(TOKENIZER_FILES):
        p = Path(root) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def file_tokens(tokenizer, path: Path, samples: int, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]`` consecutive token windows of the file's documents (joined by blank lines)."""
    import torch

    ids = tokenizer("\n\n".join(read_texts(path)), add_special_tokens=False)["input_ids"]
    n = min(samples, len(ids) // seq_len)
    if n < 1:
        raise PlanError(f"{path}: {len(ids)} tokens, fewer than one sample of --calibration-seq-len {seq_len}")
    if n < samples:
        log.warning("%s holds %d samples of %d tokens, not %d: calibrating on %d", path, n, seq_len, samples, n)
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def start_token(tokenizer) -> int:
    for tid in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id):
        if tid is not None:
            return int(tid)
    raise PlanError("the tokenizer has no BOS/EOS/PAD token to start self-generated samples; give --calibration-data")


# -- the layer-wise runner ------------------------------------------------------------------------

class LayerwiseModel:
    """A causal LM built on ``meta``; weights loaded one module at a time from the source."""

    def __init__(self, source: Source, device: torch.device, other: str = WAYS_OUT) -> None:
        import torch
        import transformers as tf

        self.root = Path(source.root)
        self.device = device
        self.other = other  # how to convert without this run, for a refusal's message
        self.infos = {t.name: t for t in source.tensors()}
        raw = source.config()
        said = _Said()
        with model_errors(self.root, raw, "read", other, said):
            self.cfg = tf.AutoConfig.from_pretrained(str(self.root), local_files_only=True)
        # Parameters on ``meta`` (no memory), buffers real: buffers are what a model computes at init
        # rather than loads (RoPE frequencies, Gemma's embedding scale), made here on the CPU exactly as
        # a loaded model makes them, then moved to the device.
        with model_errors(self.root, raw, "build the model of", other, said), _parameters_on_meta():
            self.model = tf.AutoModelForCausalLM.from_config(self.cfg, dtype=torch.float32)
        self.model.eval()
        self.base = self.model.get_decoder()
        names = {id(m): n for n, m in self.model.named_modules()}
        self.layers = list(self.base.layers)
        self.layers_name = names[id(self.base.layers)]
        self.base_name = names[id(self.base)]
        self.embed_name = names[id(self.base.embed_tokens)]
        for m in self.model.modules():  # the buffers to the device (parameters stay on meta until loaded)
            for n, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[n] = b.to(device)
        self.loaded = 0  # parameter bytes materialized now, and the most at once (tests check it is flat)
        self.peak_loaded = 0

    def _read(self, name: str) -> torch.Tensor:
        """One checkpoint tensor, read with plain reads at its header offsets (no mmap: pages of
        layers already done are not kept mapped, so resident memory stays one layer's)."""
        import torch

        from fp4convert.storage.safetensors import torch_dtypes

        info = self.infos.get(name)
        if info is None:
            raise PlanError(f"{self.root}: {name} is not in the checkpoint: its names differ from the transformers "
                            "model's; activation calibration cannot load it (use --activation-scale constant)")
        if info.dtype not in ("F32", "F16", "BF16"):
            raise PlanError(f"{name}: dtype {info.dtype}; activation calibration reads F32/F16/BF16 checkpoints")
        with open(self.root / info.file, "rb") as f:
            f.seek(info.begin)
            buf = bytearray(f.read(info.nbytes))
        t = torch.frombuffer(buf, dtype=torch_dtypes()[info.dtype]).reshape(info.shape)
        return t.to(self.device, torch.float32)

    def load(self, module, prefix: str) -> None:
        """Materialize ``module``'s parameters (on meta) from its checkpoint tensors ``prefix + name``;
        a persistent buffer the checkpoint holds is read too, the others keep their computed values."""
        import torch

        params = dict(module.named_parameters())
        stored = {n for n, _ in module.named_buffers() if prefix + n in self.infos}
        extra = [n for n in self.infos if n.startswith(prefix) and n[len(prefix):] not in params
                 and n[len(prefix):] not in stored]
        if extra:
            raise PlanError(f"{extra[0]}: a checkpoint tensor the transformers module has no parameter for; "
                            "the layer-by-layer run cannot map this family (use --activation-scale constant "
                            "or --input-weights none)")
        for n in params:
            owner, leaf = _owner(module, n)
            owner._parameters[leaf] = torch.nn.Parameter(self._read(prefix + n), requires_grad=False)
        for n in stored:
            owner, leaf = _owner(module, n)
            owner._buffers[leaf] = self._read(prefix + n).to(owner._buffers[leaf].dtype)
        self.loaded += sum(p.numel() * p.element_size() for p in module.parameters())
        self.peak_loaded = max(self.peak_loaded, self.loaded)

    def free(self, module) -> None:
        """Back to meta (the parameters only: computed buffers are needed again by the next call)."""
        import torch

        self.loaded -= sum(p.numel() * p.element_size() for p in module.parameters())
        for n, p in list(module.named_parameters()):
            owner, leaf = _owner(module, n)
            owner._parameters[leaf] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                         requires_grad=False)
        _trim_heap()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch

        e = self.base.embed_tokens
        info = self.infos.get(self.embed_name + ".weight")
        top = int(tokens.max()) if tokens.numel() else -1
        if info is not None and info.shape and top >= info.shape[0]:
            # would be an IndexError mid-run (a device-side assert on CUDA): ids from vocab_size or the tokenizer
            raise PlanError(f"{self.root}: token id {top} is not below the {info.shape[0]} rows of {info.name} "
                            "(config.json vocab_size or the tokenizer is larger than the embedding); fix config.json "
                            f"or the tokenizer, {self.other}")
        self.load(e, self.embed_name + ".")
        with torch.no_grad():
            out = e(tokens.to(self.device))
        self.free(e)
        return out

    def run_layer(self, i: int, h: torch.Tensor, cache=None, position_ids=None) -> torch.Tensor:
        """Layer ``i`` through the base model's own forward, narrowed to that one layer."""
        import torch

        layer = self.layers[i]
        saved = (self.base.layers, self.base.norm, self.cfg.num_hidden_layers, getattr(self.cfg, "layer_types", None))
        attn = getattr(layer, "self_attn", None)
        saved_idx = getattr(attn, "layer_idx", None)
        try:
            self.base.layers = torch.nn.ModuleList([layer])
            self.base.norm = torch.nn.Identity()
            self.cfg.num_hidden_layers = 1
            if saved[3] is not None:
                self.cfg.layer_types = [saved[3][i]]
            if attn is not None and saved_idx is not None:
                attn.layer_idx = 0  # the one-layer cache below
            with torch.no_grad():
                out = self.base(inputs_embeds=h, cache=cache, use_cache=cache is not None, position_ids=position_ids)
            return out.last_hidden_state
        finally:
            self.base.layers, self.base.norm, self.cfg.num_hidden_layers = saved[0], saved[1], saved[2]
            if saved[3] is not None:
                self.cfg.layer_types = saved[3]
            if attn is not None and saved_idx is not None:
                attn.layer_idx = saved_idx

    def one_layer_cache(self, i: int):
        from transformers import DynamicCache

        saved = (self.cfg.num_hidden_layers, getattr(self.cfg, "layer_types", None))
        try:
            self.cfg.num_hidden_layers = 1
            if saved[1] is not None:
                self.cfg.layer_types = [saved[1][i]]
            return DynamicCache(config=self.cfg)
        finally:
            self.cfg.num_hidden_layers = saved[0]
            if saved[1] is not None:
                self.cfg.layer_types = saved[1]

    def head(self, weight: bool = True) -> tuple:
        """(final norm, lm_head weight) loaded; the weight is the embedding's when tied."""
        import torch

        norm = self.base.norm
        self.load(norm, self.base_name + ".norm.")
        if not weight:
            return norm, None
        name = "lm_head.weight" if "lm_head.weight" in self.infos else self.embed_name + ".weight"
        with torch.no_grad():
            w = self._read(name)
        return norm, w


def _owner(module, name: str):
    """(the submodule holding parameter/buffer ``name``, its last name part)."""
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, leaf


@contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to ``meta``; buffers stay where they are made.

    ``torch.device("meta")`` would put the buffers there too, and those are computed at init, not
    loaded (RoPE frequencies, a scaled embedding's factor): they would be lost.
    """
    import torch

    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc): a freed layer's tensors below malloc's mmap
    threshold otherwise stay resident as fragments, and resident memory creeps up layer by layer."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def random_tokens(vocab_size: int, samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """``[samples, seq_len]`` uniformly random token ids in [0, vocab_size), from a seeded CPU generator.

    Data-free input statistics for the weight scale rules' ``input_weight``: on SmolLM2-135M the
    per-channel mean squares of linear inputs on 16 x 256 random ids gave NVFP4 ``mse`` 0.586x
    llm-compressor's KL, against 0.544x with a calibration text (BENCHMARKS.md). No generation pass:
    the massive-activation channels and norm gains that dominate these statistics do not depend on
    the text. The same seed gives the same ids on every machine (torch's CPU generator).
    """
    import torch

    if vocab_size < 1 or samples < 1 or seq_len < 1:
        raise PlanError(f"random calibration tokens need a vocabulary and a shape, got {vocab_size}, {samples}x{seq_len}")
    return torch.randint(0, vocab_size, (samples, seq_len), generator=torch.Generator().manual_seed(seed))


def generate(lm: LayerwiseModel, tokenizer, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """``[samples, seq_len]`` tokens the model samples itself from its start token (seeded, on the CPU
    from fp32 probabilities), one token for all samples per pass over the layers."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.full((samples, 1), start_token(tokenizer), dtype=torch.long)
    caches = [lm.one_layer_cache(i) for i in range(len(lm.layers))]
    norm, w = lm.head()
    vocab = min(w.shape[0], len(tokenizer))
    for t in range(seq_len - 1):
        pos = torch.full((1, 1), t, dtype=torch.long, device=lm.device)
        h = lm.embed(tokens[:, -1:])
        for i, layer in enumerate(lm.layers):
            lm.load(layer, f"{lm.layers_name}.{i}.")
            h = lm.run_layer(i, h, caches[i], pos)
            lm.free(layer)
        with torch.no_grad():
            logits = (norm(h[:, -1]) @ w.T)[:, :vocab].float().cpu()
        cap = getattr(lm.cfg, "final_logit_softcapping", None)
        if cap:  # what the model's own head does to its logits (Gemma 2)
            logits = torch.tanh(logits / cap) * cap
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        tokens = torch.cat([tokens, nxt], dim=1)
    lm.free(norm)
    return tokens


def bf16_ceil(x: float) -> float:
    """The smallest bf16 value >= x (x finite, >= 0)."""
    import struct

    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if bits & 0xFFFF:
        bits = (bits & 0xFFFF0000) + 0x10000
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def layerwise_amax(lm: LayerwiseModel, tokens: torch.Tensor, wanted: set[str] | None = None,
                   micro_batch: int = MICRO_BATCH,
                   mean_square: dict[str, torch.Tensor] | None = None,
                   rotate: str | None = None) -> dict[str, torch.Tensor]:
    """The fp32 amax of every ``nn.Linear`` input (by module name), one layer at a time.

    Also ``lm_head`` (the final norm's output) when ``wanted`` names it. Raw fp32 maxima (no rounding).
    ``mean_square`` (a dict to fill): each linear input's per-channel mean square E[x_j^2] over every
    calibration token (fp64 sums, rounded to bf16 at the end), the ``input_weight`` that makes the
    weight scale rules' block error track the layer's output error (reference.block_error). bf16
    rounding keeps the weights the same across devices unless a value lands on a rounding boundary.
    ``rotate`` ("had16"): the mean squares are those of the rotated inputs ``x H`` (the weights are
    quantized as ``W H``, and ``y = (x H)(W H)^T``), the domain the block error is computed in; the
    amax stays that of the plain inputs.
    """
    import torch

    from fp4convert.numerics.reference import had16

    amax: dict[str, torch.Tensor] = {}
    sums: dict[str, list] = {}

    def hook_for(name: str):
        def hook(_mod, args):
            x = args[0].detach()
            a = x.abs().amax().float().cpu()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
            if mean_square is not None:
                x2 = (had16(x) if rotate == "had16" else x).reshape(-1, x.shape[-1]).double()
                sq = (x2 * x2).sum(0).cpu()
                if name in sums:
                    sums[name][0] += sq
                    sums[name][1] += x2.shape[0]
                else:
                    sums[name] = [sq, x2.shape[0]]
        return hook

    hs = [lm.embed(tokens[s: s + micro_batch]) for s in range(0, tokens.shape[0], micro_batch)]
    for i, layer in enumerate(lm.layers):
        prefix = f"{lm.layers_name}.{i}."
        lm.load(layer, prefix)
        handles = [m.register_forward_pre_hook(hook_for(prefix + n)) for n, m in layer.named_modules()
                   if isinstance(m, torch.nn.Linear)]
        try:
            hs = [lm.run_layer(i, h) for h in hs]
        finally:
            for hd in handles:
                hd.remove()
        lm.free(layer)
    if wanted and "lm_head" in wanted:
        norm, _ = lm.head(weight=False)
        record = hook_for("lm_head")
        with torch.no_grad():
            for h in hs:
                record(norm, (norm(h),))
        lm.free(norm)
    if mean_square is not None:
        for name, (sq, n) in sums.items():
            mean_square[name] = (sq / n).to(torch.bfloat16).float()
    return amax


@dataclass
class Statistics:
    """What the layer-by-layer stage measured, for the conversion that follows.

    ``amax`` / ``calibration``: W4A4 NVFP4's activation amax per quantized module (fused and expert
    groups at their max) and its manifest record; ``input_weights``: each quantized matrix's input
    weight (module -> :class:`~fp4convert.quantizer.backend.InputWeight`; fused members share one object) and
    ``input_weight_record``, the identity entry that describes them (source, tokens, seed, digest).
    """

    amax: dict[str, float] | None = None
    calibration: dict | None = None
    input_weights: dict[str, InputWeight] | None = None
    input_weight_record: dict | None = None


def statistics(source: Source, plan: Plan, config: ConvertConfig, device) -> Statistics:
    """Run what this conversion needs, before anything is written: the activation calibration of W4A4
    NVFP4 (the mean squares are recorded in the same pass when the input weights come from it) and,
    for ``--input-weights random``, a pass over seeded random token ids."""
    out = Statistics()
    modules = quantized_modules(plan)
    amax_pass = config.activations == "nvfp4"
    if amax_pass and config.activation_scale == "constant":
        from fp4convert.formats.base import CONSTANT_AMAX

        out.amax = {m: CONSTANT_AMAX for m in modules}
        out.calibration = {"method": "constant", "amax": CONSTANT_AMAX}
        amax_pass = False
    iw = config.input_weight_source
    if not amax_pass and iw == "none":
        return out
    import torch

    check_runnable(source, config)
    if any(d.decode is not None for d in plan.decisions):
        what = "activation calibration" if amax_pass else f"--input-weights {iw}"
        raise PlanError(f"{what} runs the model on bf16/fp16/fp32 weights; this checkpoint's weights are quantized "
                        "(FP8/MXFP4) inputs" + (": use --activation-scale constant" if amax_pass else
                                                ": use --input-weights none"))
    dev = torch.device(device) if device is not None else torch.device("cpu")
    root = Path(source.root)
    what, other = _what(config)
    lm = LayerwiseModel(source, dev, other)

    def running():
        """The forward's failures the plan-time check cannot see, as the same refusal."""
        return model_errors(root, source.config(), "run the model of", other)

    mean_square: dict[str, torch.Tensor] = {}
    described: dict = {}
    if amax_pass or iw == "calibration":
        import transformers as tf

        try:
            tok = tf.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any loader failure is the same refusal, with its reason
            raise PlanError(f"{root}: the tokenizer does not load ({type(exc).__name__}: {exc}); {what} needs it "
                            f"to tokenize or generate its samples ({other})") from None
        samples, seq_len = config.calibration_shape
        if config.calibration_data is not None:
            data = Path(config.calibration_data)
            tokens = file_tokens(tok, data, samples, seq_len)
            data_record = {"source": "file", "name": data.name, "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}
        else:
            with running():
                tokens = generate(lm, tok, samples, seq_len, config.calibration_seed)
            data_record = {"source": "self-generated", "start_token": int(tokens[0, 0])}
        with running():
            raw = layerwise_amax(lm, tokens, set(modules), mean_square=mean_square if iw == "calibration" else None,
                                 rotate=config.rotate)
        calibrated = {"data": data_record, "samples": int(tokens.shape[0]), "seq_len": int(tokens.shape[1]),
                      "seed": config.calibration_seed, "tokenizer_sha256": tokenizer_digest(root)}
        if amax_pass:
            out.amax, out.calibration = _activation_record(raw, modules, plan, calibrated)
        described = {"source": "calibration", **calibrated}
    if iw == "random":
        samples, seq_len = config.random_shape
        vocab = vocab_size(root, source.config().get("vocab_size"))
        tokens = random_tokens(vocab, samples, seq_len, config.calibration_seed)
        with running():
            layerwise_amax(lm, tokens, set(modules), mean_square=mean_square, rotate=config.rotate)
        described = {"source": "random", "samples": samples, "seq_len": seq_len, "seed": config.calibration_seed,
                     "vocab_size": vocab}
    if iw != "none":
        out.input_weights, out.input_weight_record = input_weights_for(plan, mean_square, described, config.rotate)
    return out


def _activation_record(raw: dict, modules: list[str], plan: Plan, calibrated: dict) -> tuple[dict[str, float], dict]:
    measured = {m: bf16_ceil(float(v)) for m, v in raw.items()}
    missing = [m for m in modules if m not in measured]
    if missing:
        raise PlanError(f"{missing[0]}: a quantized module the model's forward never runs as an nn.Linear; "
                        "activation calibration cannot measure it (use --activation-scale constant)")
    shared = share(measured, plan)
    record = {
        "method": "calibrate",
        **calibrated,
        "amax_rounding": "bf16 ceil of the fp32 max; fused/expert groups at their max",
        "measured_amax": {m: measured[m] for m in modules},
        "amax": {m: shared[m] for m in modules},
    }
    return shared, record


def activation_amax(source: Source, plan: Plan, config: ConvertConfig, device) -> tuple[dict[str, float], dict]:
    """(module -> shared amax for every quantized module, the calibration record for the manifest)."""
    from dataclasses import replace

    st = statistics(source, plan, replace(config, input_weights="none"), device)
    assert st.amax is not None and st.calibration is not None
    return st.amax, st.calibration


def input_weights_for(plan: Plan, mean_square: dict, described: dict,
                      rotate: str | None = None) -> tuple[dict[str, InputWeight], dict]:
    """Each quantized matrix's input weight from the measured mean squares, and their record.

    Fused members (one group: q/k/v, gate/up, an expert's gate/up halves) share one input, so they
    share one weight: the first member's that was measured. A matrix whose input the pass never saw
    (stacked experts, which no nn.Linear of the layer-by-layer run computes) is quantized unweighted
    and listed in the record's ``unweighted``.
    """
    import torch

    group_of = {m: g for g, members in plan.all_groups().items() for m in members}
    groups = plan.all_groups()
    made: dict[str, InputWeight] = {}
    out: dict[str, InputWeight] = {}
    unweighted: list[str] = []
    for d in plan.decisions:
        if d.action != QUANTIZE:
            continue
        for m in d.matrices:
            g = group_of.get(m.module)
            members = groups[g] if g else [m.module]
            src = next((x for x in members if x in mean_square), None)
            if src is None:
                unweighted.append(m.module)
                continue
            w = mean_square[src]
            if w.dim() != 1 or w.numel() != m.shape[1]:
                raise QuantizationError(f"{src}: its measured input has {w.numel()} channels but {m.module} has "
                                        f"K={m.shape[1]}; use --input-weights none")
            if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                raise QuantizationError(f"{src}: the mean square of its input is not finite (the activations "
                                        "overflowed); use --input-weights none")
            if src not in made:
                made[src] = InputWeight(src, array("f", w.to(torch.float32).tolist()).tobytes())
            out[m.module] = made[src]
    if unweighted:
        log.warning("%d quantized matrices (e.g. %s) have no measured input (only nn.Linear inputs are recorded): "
                    "quantized without input weights", len(unweighted), unweighted[0])
    digest = hashlib.sha256()
    for name in sorted(out):
        digest.update(name.encode() + b"\0" + out[name].data)
    record = {**described, "rotated": rotate,
              "statistic": "per-channel mean square of each linear input (fp64 sums, rounded to bf16)",
              "weighted": len(out), "unweighted": unweighted, "sha256": digest.hexdigest()}
    return out, record
