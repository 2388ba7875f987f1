"""transformers' failures to read, build or run a model from a config.json, as one ``Error:`` line.

A refusal names the folder and, where it can be told, the config.json key (named by the message, by
what transformers logged, or found by trying the config without each key); fp4convert's own errors,
memory errors, file errors naming a file and Ctrl-C pass unchanged.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from pathlib import Path

from fp4convert.errors import Cancelled, FP4ConvertError, PlanError, RankStopped

WAYS_OUT = "or convert without the model run (--input-weights none; W4A4: --activation-scale constant)"


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
def model_errors(root: Path, cfg: dict, doing: str, other: str, said: Said | None = None):
    """Any failure of transformers to read, build or run the model from this config.json as a one-line
    PlanError (exit 2: the checkpoint converts without the model run, ``other`` says how) naming the
    folder and, where it can be told, the config.json key; KeyboardInterrupt is no Exception and passes.
    ``said``: what transformers logs, kept across stages (it warns of a bad rope factor when it reads
    the config and fails on it when it builds the model)."""
    said = said if said is not None else Said()
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


class Said(logging.Handler):
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


def config_key(cfg: dict, exc: BaseException, doing: str = "read", said: list[str] | tuple[str, ...] = ()) -> tuple[str | None, bool]:
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
