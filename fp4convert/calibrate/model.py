"""The model the block runner runs: built from ``config.json`` on ``meta``, its blocks found from the definition.

Parameters go to ``meta`` (nothing is read), computed buffers (RoPE frequencies, a scaled embedding's
factor) are made for real; the repeated blocks are the ``ModuleList`` holding the most weights of the
text decoder (``get_decoder()`` where the model has one, so a VLM's or an audio LM's language model,
never a vision/audio tower). :func:`structure_problem` says why a model cannot be run block by block.
"""

from __future__ import annotations

import inspect
import logging
import re
from contextlib import contextmanager
from pathlib import Path

from fp4convert.calibrate.diagnose import Said, model_errors
from fp4convert.errors import PlanError

log = logging.getLogger(__name__)

_TOWER_RX = re.compile(r"Vision|Visual|Audio|Speech|Image|Video|Siglip|Clip", re.IGNORECASE)


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
    towers = [n for n, m in model.named_modules() if n and is_tower(model, m)]
    best, size = None, 0
    for m in root.modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) == 0 or \
                isinstance(m[0], (torch.nn.ModuleList, torch.nn.ModuleDict)):  # a list of lists: no block forward
            continue
        n = names[id(m)]
        if any(n == t or n.startswith(t + ".") for t in towers):
            continue
        count = _block_weights(m)
        if count > size:
            best, size = m, count
    if best is None:
        return "", []
    return names[id(best)], list(best)


def _block_weights(blocks) -> int:
    """Parameters inside ``blocks`` outside embedding tables: the layers are the list holding the most,
    not a list of embeddings (MarkupLM's 50 xpath embedding tables outweigh its encoder layers)."""
    import torch

    count = 0
    for m in blocks.modules():
        if isinstance(m, torch.nn.Embedding) or "Embedding" in type(m).__name__:
            continue
        count += sum(p.numel() for p in m._parameters.values() if p is not None)
    return count


def is_tower(model, m) -> bool:
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


@contextmanager
def reports_device(model, device):
    """Every sub-model of ``model`` says it is on ``device`` (transformers' ``PreTrainedModel.device`` is
    its first parameter's: ``meta`` where that is a tower's, never loaded; Idefics3 moves its token
    embeddings there)."""
    from transformers import PreTrainedModel

    ours = {id(m) for m in model.modules() if isinstance(m, PreTrainedModel)}
    klass = next((k for k in PreTrainedModel.__mro__ if "device" in vars(k)), None)
    prop = vars(klass).get("device") if klass is not None else None
    if not isinstance(prop, property) or prop.fget is None:
        yield
        return
    fget = prop.fget

    def where(self):
        return device if id(self) in ours else fget(self)

    setattr(klass, "device", property(where))
    try:
        yield
    finally:
        setattr(klass, "device", prop)


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
