"""The block-by-block runner: any model transformers builds, one block's weights at a time.

The model is built from ``config.json`` on ``meta`` (parameters there, computed buffers such as RoPE
frequencies made for real); its repeated blocks are found from the definition (the largest
``ModuleList`` of the text decoder: ``get_decoder()`` where the model has one, so a VLM's or an audio
LM's language model, never a vision/audio tower); checkpoint names are mapped to parameters with
transformers' own key conversion (the renames and per-expert merges its loader applies, as
``fp4convert/modeldef.py`` does for the plan). Then:

1. the weights outside the blocks that the forward needs before block 0 (embeddings, rotary tables,
   norms; never the heads nor the towers) are read, and the model's forward runs once per micro-batch
   with recorders in place of the blocks (:func:`~fp4convert.calibrate.capture.block_calls`): each
   block's exact arguments (masks, position embeddings; no cache); those weights are released;
2. for each block: its weights are read from the checkpoint (through the converters where transformers
   merges or renames them), it runs on every micro-batch, every ``nn.Linear`` / GPT-2 ``Conv1D``
   input and every 3-D expert stack's inputs are observed (all tokens through every expert for the
   statistics, the router's choice for the output), its outputs become the next block's inputs, and
   its weights go back to ``meta``.

One block's weights are resident at a time: memory does not grow with depth. Everything runs in
fp32 on the given device (the GPU when there is one). An architecture this cannot run (an
encoder-decoder, no repeated blocks) is refused by :func:`structure_problem` while planning.
"""

from __future__ import annotations

import inspect
import logging
import re
import time
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.calibrate.capture import ExpertTap, block_calls, block_output, is_expert_stack, replace_hidden
from fp4convert.calibrate.diagnose import WAYS_OUT, Said, model_errors
from fp4convert.errors import PlanError, StopForward

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from fp4convert.calibrate.stats import Observers
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)

MICRO_BATCH = 8  # samples per forward (bounds the intermediates; the statistics do not depend on it)
_TOWER_RX = re.compile(r"Vision|Visual|Audio|Speech|Image|Video|Siglip|Clip", re.IGNORECASE)
_EXPERT_INDEX = re.compile(r"\.(\d+)\.[^.]+$")


def model_class(tf, config, archs: list[str]):
    """The class config.json names (``architectures``), else the causal-LM / base class of its config."""
    from transformers import PreTrainedModel

    for a in archs:
        c = getattr(tf, a, None)
        if isinstance(c, type) and issubclass(c, PreTrainedModel):
            return c
    for auto in ("MODEL_FOR_CAUSAL_LM_MAPPING", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", "MODEL_MAPPING"):
        mapping = getattr(tf, auto, None)
        try:
            return mapping[type(config)] if mapping is not None else None
        except KeyError:
            continue
    return None


def build_meta(root: Path, raw: dict, other: str, buffers_real: bool = True):
    """(transformers config, model with parameters on ``meta``) from ``root``'s config.json; any failure
    of transformers is a one-line refusal naming the key (:func:`~fp4convert.calibrate.checks.model_errors`)."""
    import torch
    import transformers as tf

    said = Said()
    with model_errors(root, raw, "read", other, said):
        cfg = tf.AutoConfig.from_pretrained(str(root), local_files_only=True)
    with model_errors(root, raw, "build the model of", other, said), \
            (_parameters_on_meta() if buffers_real else torch.device("meta")):
        cls = model_class(tf, cfg, list(raw.get("architectures") or []))
        if cls is None:
            raise PlanError(f"{root}: transformers {tf.__version__} has no model class for "
                            f"{raw.get('architectures') or raw.get('model_type')!r}; {other}")
        model = cls._from_config(cfg, dtype=torch.float32)
        if buffers_real:
            _init_buffers(model)
    model.eval()
    return cfg, model


def _init_buffers(model) -> None:
    """Computed buffers as a loaded model has them: transformers' loader runs ``_init_weights`` on modules
    whose buffers no checkpoint holds (CodeGen's sin/cos table is filled there, not in ``__init__``);
    the parameters are on ``meta``, where the same initializers do nothing."""
    import torch

    init = getattr(model, "_init_weights", None)
    if init is None:
        return
    for m in model.modules():
        if any(b is not None for b in m._buffers.values()):
            try:
                with torch.no_grad():
                    init(m)
            except Exception:  # noqa: BLE001 - an initializer that needs real parameters: keep __init__'s buffers
                log.debug("_init_weights(%s) failed on meta; its buffers stay as built", type(m).__name__)


def find_blocks(model) -> tuple[str, list]:
    """(name, blocks) of the model's repeated blocks: the ``ModuleList`` holding the most parameters in
    the text decoder (``get_decoder()``) or, without one, in the model outside its towers."""
    import torch

    names = {id(m): n for n, m in model.named_modules()}
    root = model
    try:
        dec = model.get_decoder()
        if isinstance(dec, torch.nn.Module) and id(dec) in names:
            root = dec
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        pass
    towers = [n for n, m in model.named_modules() if n and _is_tower(model, m)]
    best, size = None, 0
    for m in root.modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) == 0:
            continue
        n = names[id(m)]
        if any(n == t or n.startswith(t + ".") for t in towers):
            continue
        count = sum(p.numel() for p in m.parameters())
        if count > size:
            best, size = m, count
    if best is None:
        return "", []
    return names[id(best)], list(best)


def _is_tower(model, m) -> bool:
    from transformers import PreTrainedModel

    return m is not model and isinstance(m, PreTrainedModel) and bool(_TOWER_RX.search(type(m).__name__)) \
        and m is not getattr(model, model.base_model_prefix, None)


def structure_problem(model, cfg) -> str | None:
    """Why the block runner cannot run this model (None: it can)."""
    if getattr(cfg, "is_encoder_decoder", False):
        return ("an encoder-decoder (its decoder blocks take the encoder's output, which the block-by-block run "
                "does not carry)")
    name, blocks = find_blocks(model)
    if not blocks:
        return "no repeated blocks (a ModuleList of layers) in the model definition"
    try:
        emb = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        emb = None
    if emb is None:
        return "no token embedding (calibration runs token ids; a vision/audio/other-input model)"
    params = inspect.signature(model.forward).parameters
    if "input_ids" not in params:
        return "its forward takes no input_ids"
    needs = [n for n, p in params.items() if n != "input_ids" and p.default is p.empty
             and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if needs:
        return f"its forward requires {', '.join(needs)} besides token ids"
    return None


@dataclass
class Visit:
    """One block of :meth:`LayerwiseModel.blocks`, observed and still loaded: its index and name prefix."""

    index: int
    prefix: str
    reloaded: bool = False


class LayerwiseModel:
    """A model built on ``meta``; weights materialized from the source one block at a time."""

    def __init__(self, source: Source, device: torch.device, other: str = WAYS_OUT) -> None:
        import torch

        self.root = Path(source.root)
        self.device = torch.device(device)
        self.other = other
        self.infos = {t.name: t for t in source.tensors()}
        self.raw = source.config()
        self.cfg, self.model = build_meta(self.root, self.raw, other)
        why = structure_problem(self.model, self.cfg)
        if why is not None:
            raise PlanError(f"{self.root}: the layer-by-layer run cannot run this model: {why}; {other}")
        self.layers_name, self.layers = find_blocks(self.model)
        self.modules = dict(self.model.named_modules(remove_duplicate=False))
        self.names = {id(m): n for n, m in self.model.named_modules()}
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        self.heads = [self.names[id(head)]] if head is not None and id(head) in self.names else []
        self.towers = [n for n, m in self.model.named_modules() if n and _is_tower(self.model, m)]
        emb = self.model.get_input_embeddings()
        self.embed_name = self.names.get(id(emb), "")
        for m in self.model.modules():  # computed buffers to the device (parameters stay on meta until loaded)
            for n, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[n] = b.to(self.device)
        self._key_map()
        self.loaded = 0  # parameter bytes materialized now, and the most at once (tests check it is flat)
        self.peak_loaded = 0
        self._ahead: dict = {}  # checkpoint key -> Future of its bytes (the next block's, read ahead)
        self._replaced: dict = {}  # checkpoint key -> tensor loaded instead (reload_block)
        self._reader: ThreadPoolExecutor | None = None

    # -- checkpoint names -> parameters (transformers' own conversion) ------------------------------

    def _key_map(self) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

        conversions = get_model_conversion_mapping(self.model)
        self._renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        self._converter_of = {p: c for c in converters for p in c.source_patterns}
        meta = dict(self.model.named_parameters(remove_duplicate=False))
        meta.update(dict(self.model.named_buffers(remove_duplicate=False)))
        self.targets = meta
        self.keymap: dict[str, tuple[str, str | None]] = {}
        for name in sorted(self.infos, key=dot_natural_key):
            target, pattern = rename_source_key(name, self._renamings, converters, self.model.base_model_prefix, meta)
            if target not in meta and name in meta:
                target, pattern = name, None
            if target in meta:
                self.keymap[name] = (target, pattern)
        self.disk_of = {t: k for k, (t, _) in self.keymap.items()}  # (the last source of a merged target)

    def _read(self, name: str) -> torch.Tensor:
        """One checkpoint tensor, read with plain reads at its header offsets (no mmap: pages of
        blocks already done are not kept mapped, so resident memory stays one block's)."""
        import torch

        from fp4convert.storage.safetensors import torch_dtypes

        info = self.infos[name]
        got = self._replaced.get(name)
        if got is not None:
            return got.to(self.device, torch.float32)
        if info.dtype not in ("F32", "F16", "BF16"):
            raise PlanError(f"{name}: dtype {info.dtype}; the layer-by-layer run reads F32/F16/BF16 checkpoints")
        ahead = self._ahead.pop(name, None)
        buf = ahead.result() if ahead is not None else self._bytes(name)
        t = torch.frombuffer(buf, dtype=torch_dtypes()[info.dtype]).reshape(info.shape)
        return t.to(self.device, torch.float32)

    def _bytes(self, name: str) -> bytearray:
        info = self.infos[name]
        with open(self.root / info.file, "rb") as f:
            f.seek(info.begin)
            return bytearray(f.read(info.nbytes))

    def read_ahead(self, i: int) -> None:
        """Start reading block ``i``'s checkpoint bytes on a thread (file reads release the GIL), so the
        next block's weights arrive while this one runs; at most one block is read ahead."""
        from concurrent.futures import ThreadPoolExecutor

        if i >= len(self.layers):
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="fp4convert-calibrate-read")
        for k in self._keys_under(f"{self.layers_name}.{i}."):
            if k not in self._ahead and self.infos[k].dtype in ("F32", "F16", "BF16"):
                self._ahead[k] = self._reader.submit(self._bytes, k)

    def close(self) -> None:
        """Drop what was read ahead and stop the reader thread."""
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None

    def _keys_under(self, prefix: str | None) -> list[str]:
        """Checkpoint keys loading into parameters under ``prefix`` (None: those outside the blocks,
        the heads and the towers)."""
        out = []
        skip = [self.layers_name + ".", *(h + "." for h in self.heads), *(t + "." for t in self.towers)]
        for k, (target, _) in self.keymap.items():
            if prefix is not None:
                if target.startswith(prefix):
                    out.append(k)
            elif not any(target.startswith(s) for s in skip):
                out.append(k)
        return out

    def _load_keys(self, keys: list[str]) -> None:
        """Materialize the parameters ``keys`` load into: plain renames read directly, merged/converted
        ones through a fresh copy of transformers' converter (as its loader does, one per target)."""
        import torch

        groups: dict[str, object] = {}
        for k in keys:
            target, pattern = self.keymap[k]
            if pattern is None:
                self._set(target, self._read(k))
            else:
                conv = groups.get(target)
                if conv is None:
                    conv = groups[target] = deepcopy(self._converter_of[pattern])
                conv.add_tensor(target, k, pattern, partial(self._read, k))  # type: ignore[attr-defined]
        for target, conv in groups.items():
            with torch.no_grad():
                made = conv.convert(target, model=self.model, config=self.model.config)  # type: ignore[attr-defined]
            for name, value in made.items():
                value = value[0] if isinstance(value, list) else value
                if name not in self.targets:
                    raise PlanError(f"{self.root}: transformers' conversion of {target} made {name}, not a parameter "
                                    f"of the model; the layer-by-layer run cannot load it ({self.other})")
                self._set(name, value.to(self.device, torch.float32))

    def _set(self, name: str, t: torch.Tensor) -> None:
        import torch

        owner, leaf = _owner(self.model, name)
        if leaf in owner._parameters:
            want = tuple(owner._parameters[leaf].shape)
            if tuple(t.shape) != want:
                raise PlanError(f"{self.root}: {self.disk_of.get(name, name)} loads as {list(t.shape)} but the model "
                                f"config.json describes has {name} {list(want)}; fix config.json, {self.other}")
            owner._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
            self.loaded += t.numel() * t.element_size()
            self.peak_loaded = max(self.peak_loaded, self.loaded)
        else:
            owner._buffers[leaf] = t.to(owner._buffers[leaf].dtype)

    def _check_loaded(self, module, prefix: str) -> None:
        for n, p in module.named_parameters():
            if p.device.type == "meta":
                raise PlanError(f"{self.root}: no checkpoint tensor loads {prefix}{n} (its names differ from the "
                                f"transformers model's); the layer-by-layer run cannot load it ({self.other})")

    def _free_params(self, params: list[tuple[str, object]]) -> None:
        import torch

        for name, p in params:
            owner, leaf = _owner(self.model, name)
            q = owner._parameters.get(leaf)
            if q is None or q.device.type == "meta":
                continue
            self.loaded -= q.numel() * q.element_size()
            owner._parameters[leaf] = torch.nn.Parameter(torch.empty(q.shape, dtype=q.dtype, device="meta"),
                                                         requires_grad=False)
        _trim_heap()

    def load_block(self, i: int) -> None:
        prefix = f"{self.layers_name}.{i}."
        self._load_keys(self._keys_under(prefix))
        self._check_loaded(self.layers[i], prefix)

    def free_block(self, i: int) -> None:
        prefix = f"{self.layers_name}.{i}."
        self._free_params([(prefix + n, p) for n, p in self.layers[i].named_parameters()])

    def load_outside(self) -> None:
        self._load_keys(self._keys_under(None))

    def free_outside(self) -> None:
        inside = [self.layers_name + ".", *(h + "." for h in self.heads)]
        self._free_params([(n, p) for n, p in self.model.named_parameters()
                           if not any(n.startswith(s) for s in inside)])

    # -- running ------------------------------------------------------------------------------------

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Token ids must be rows of the embedding (an IndexError mid-run, a device assert on CUDA)."""
        name = self.embed_name + ".weight"
        disk = self.disk_of.get(name)
        info = self.infos.get(disk) if disk else None
        top = int(tokens.max()) if tokens.numel() else -1
        if info is not None and info.shape and top >= info.shape[0]:
            raise PlanError(f"{self.root}: token id {top} is not below the {info.shape[0]} rows of {info.name} "
                            "(config.json vocab_size or the tokenizer is larger than the embedding); fix config.json "
                            f"or the tokenizer, {self.other}")

    def _forward(self, ids: torch.Tensor, **kw):
        return self.model(input_ids=ids, use_cache=False, **kw)

    def capture(self, batches: list[torch.Tensor]) -> list[list[tuple[tuple, dict]]]:
        """Every block's call per micro-batch (:func:`~fp4convert.calibrate.capture.block_calls`)."""
        import torch

        self.load_outside()
        try:
            with torch.no_grad():
                return block_calls(self.model, self.layers, lambda k: self._forward(batches[k]), len(batches))
        finally:
            self.free_outside()

    def run_layer(self, i: int, args: tuple, kwargs: dict) -> torch.Tensor:
        """Block ``i`` on one recorded call; its hidden-states output."""
        import torch

        with torch.no_grad():
            return block_output(self.layers[i](*args, **kwargs))

    def observe(self, tokens: torch.Tensor, observers: Observers, head: bool = False,
                micro_batch: int = MICRO_BATCH, progress: bool = True) -> None:
        """Run the calibration tokens block by block, feeding ``observers`` with every linear's input
        (names: the module's; expert stacks ``{path}:in`` and ``{path}:down:{e}``; ``lm_head``'s input with
        ``head``). Raises PlanError when a block's output is not finite."""
        for _ in self.blocks(tokens, observers, head=head, micro_batch=micro_batch, progress=progress):
            pass

    def blocks(self, tokens: torch.Tensor, observers: Observers, head: bool = False,
               micro_batch: int = MICRO_BATCH, progress: bool = True, desc: str = "calibrate: blocks"):
        """:meth:`observe` as a generator: after block ``i`` has run on every micro-batch with its inputs
        observed, it yields a :class:`Visit` while the block's weights are still loaded. The caller may
        quantize them and :meth:`reload_block` the block with the quantized weights (GPTQ's sequential
        pass); the block then runs again, so the next block's inputs are the quantized block's outputs."""
        import torch
        from transformers.pytorch_utils import Conv1D

        self.check_tokens(tokens)
        batches = [tokens[s: s + micro_batch].to(self.device) for s in range(0, tokens.shape[0], micro_batch)]
        calls = self.capture(batches)
        hs = [self._hidden_of(0, *calls[0][k]) for k in range(len(batches))]
        try:
            bar = progress_bar(len(self.layers), desc, progress)
            never: list[str] = []
            for i, block in enumerate(self.layers):
                prefix = f"{self.layers_name}.{i}."
                self.load_block(i)
                self.read_ahead(i + 1)
                handles = []
                taps = []
                for n, m in block.named_modules():
                    if isinstance(m, (torch.nn.Linear, Conv1D)):
                        handles.append(m.register_forward_pre_hook(
                            lambda _m, a, _n=prefix + n: observers.add(_n, a[0])))
                    elif is_expert_stack(m):
                        taps.append(ExpertTap(prefix + n, m, observers))
                try:
                    outs = self._run_block(i, block, calls[i], hs)
                finally:
                    for hd in handles:
                        hd.remove()
                    for t in taps:
                        t.remove()
                for t in taps:
                    if t.routed is not None:
                        never += [f"{t.name}.{e}" for e in (t.routed == 0).nonzero().flatten().tolist()]
                visit = Visit(i, prefix)
                yield visit
                if visit.reloaded:
                    outs = self._run_block(i, block, calls[i], hs)
                bad = not bool(torch.stack([torch.isfinite(o).all() for o in outs]).all())
                self.free_block(i)
                if bad:
                    raise PlanError(f"{self.root}: block {i} ({prefix[:-1]}) produced NaN/Inf on the calibration input; "
                                    f"no activation statistics can be taken from it: give other calibration data, {self.other}")
                hs = outs
                calls[i] = []  # this block's recorded arguments are not needed again
                bar.update(1)
            bar.close()
        finally:
            self.close()  # nothing read ahead outlives the pass (an error included)
        if never:
            log.warning("%d experts were never chosen by the router on the calibration tokens (e.g. %s); their "
                        "statistics come from every token sent through them", len(never), never[0])
        if head and self.heads:
            self._observe_head(batches, hs, observers)

    def _run_block(self, i: int, block, calls: list, hs: list) -> list:
        outs = []
        for k in range(len(hs)):
            a, kw = calls[k]
            args, kw = replace_hidden(block, a, kw, hs[k])
            outs.append(self.run_layer(i, args, kw))
        return outs

    def block_keys(self, i: int) -> list[str]:
        """The checkpoint keys that load block ``i``."""
        return self._keys_under(f"{self.layers_name}.{i}.")

    def read_fp32(self, name: str) -> torch.Tensor:
        """Checkpoint tensor ``name`` as fp32 on the run's device (a plain read; not read ahead)."""
        import torch

        from fp4convert.storage.safetensors import torch_dtypes

        info = self.infos[name]
        t = torch.frombuffer(self._bytes(name), dtype=torch_dtypes()[info.dtype]).reshape(info.shape)
        return t.to(self.device, torch.float32)

    def reload_block(self, visit: Visit, replaced: dict[str, torch.Tensor]) -> None:
        """Load the visited block again with some checkpoint tensors replaced (``replaced``: key -> the
        tensor in its on-disk shape, e.g. the quantized weights dequantized): through transformers'
        converters, as the checkpoint's own tensors load."""
        self._replaced = replaced
        try:
            self.free_block(visit.index)
            self.load_block(visit.index)
        finally:
            self._replaced = {}
        visit.reloaded = True

    def _hidden_of(self, i: int, args: tuple, kwargs: dict):
        from fp4convert.calibrate.capture import hidden_slot

        return args[0] if args else kwargs[hidden_slot(self.layers[i])]

    def _observe_head(self, batches, finals, observers: Observers) -> None:
        """The head's input: the model's own code after the blocks (final norm...), on the last block's
        outputs (the blocks stand aside: identity, the last one returns the carried hidden states)."""
        import torch

        head = self.modules[self.heads[0]]
        last = len(self.layers) - 1
        current = {"k": 0}

        def stop(_m, a):
            observers.add("lm_head", a[0])
            raise StopForward

        def stand_in(i):
            def forward(*args, **kwargs):
                if i == last:
                    return finals[current["k"]]
                return args[0] if args else next(iter(kwargs.values()))
            return forward

        for i, b in enumerate(self.layers):
            b.forward = stand_in(i)
        h = head.register_forward_pre_hook(stop)
        self.load_outside()
        try:
            for k, ids in enumerate(batches):
                current["k"] = k
                try:
                    with torch.no_grad():
                        self._forward(ids)
                except StopForward:
                    pass
        finally:
            h.remove()
            for b in self.layers:
                del b.forward
            self.free_outside()

    # -- generation (self-generated samples) ----------------------------------------------------------

    def total_bytes(self) -> int:
        """The fp32 bytes of every weight the model loads (what :meth:`whole` holds when resident)."""
        return sum(4 * _numel(self.infos[k]) for k in self.keymap)

    @contextmanager
    def whole(self, resident: bool):
        """The whole model runnable: every weight resident (``resident``), or each block loaded before its
        forward and released after (one block at a time, re-read at every call)."""
        import torch

        handles = []
        tied = set()
        self.load_outside()
        self._load_keys([k for h in self.heads for k in self._keys_under(h + ".")])
        for h in self.heads:
            head = self.modules[h]
            w = getattr(head, "weight", None)
            if w is not None and w.device.type == "meta":  # tied to the input embedding
                emb = self.model.get_input_embeddings()
                head.weight = emb.weight
                tied.add(h)
        if resident:
            for i in range(len(self.layers)):
                self.load_block(i)
        else:
            for i, b in enumerate(self.layers):
                handles.append(b.register_forward_pre_hook(lambda _m, _a, _i=i: self.load_block(_i)))
                handles.append(b.register_forward_hook(lambda _m, _a, _o, _i=i: self.free_block(_i)))
        try:
            yield self.model
        finally:
            for hd in handles:
                hd.remove()
            for i in range(len(self.layers)):
                self.free_block(i)
            for h in self.heads:
                head = self.modules[h]
                if h in tied:  # the embedding's weight, accounted (and freed) with it
                    w = head.weight
                    head.weight = torch.nn.Parameter(torch.empty(w.shape, device="meta"), requires_grad=False)
                else:
                    self._free_params([(f"{h}.{n}", p) for n, p in head.named_parameters()])
            self.free_outside()


def _numel(info) -> int:
    n = 1
    for s in info.shape:
        n *= int(s)
    return n


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar (blocks done, time left) on a terminal; a silent stand-in elsewhere."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n: int = 1) -> None:
                pass

            def close(self) -> None:
                pass
        return _Null()
    return tqdm(total=total, desc=desc, unit="block", disable=None, leave=False)


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
    """Give freed heap pages back to the OS (glibc): a freed block's tensors below malloc's mmap
    threshold otherwise stay resident as fragments, and resident memory creeps up block by block."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _MALLOC_TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)  # type: ignore[operator]


_MALLOC_TRIM: object = None


def elapsed(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f} s"
