"""The converter's settings, frozen: the CLI builds one, the library only reads it.

Importing this module imports no torch: the CLI validates options and prints help without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol, runtime_checkable

from fp4convert.errors import ConfigError
from fp4convert.formats import DEFAULT_FORMAT, OUTPUT_FORMATS, get_format
from fp4convert.numerics.scheme import SCHEMES, check_rotation

DEFAULT_MAX_SHARD = 5 * 10**9
ACTIVATIONS = ("none", "nvfp4", "mxfp4")
ACTIVATION_SCALES = ("calibrate", "constant")
# Input weights (docs/numerics.md "Input weights"): where the per-input-channel mean squares that weight
# the search rules' block error come from. auto: the W4A4 calibration pass's own when it runs, else none.
INPUT_WEIGHTS = ("auto", "none", "random", "calibration")
WEIGHTED_RULE = "mse"  # the default rule when input weights are on: the best measured with them (BENCHMARKS.md)
# samples x tokens of a calibration pass (text file or self-generated). SmolLM2-135M W4A4 (BENCHMARKS.md, issue 30
# "The calibration default"): 64 x 512 file tokens (8x) lowered the KL by 3% for 3.8x the conversion time;
# self-generated, 128 x 512 ran past 24 minutes on the 2-core machine where 16 x 256 takes minutes.
CALIBRATION_SHAPE = (16, 256)
RANDOM_SHAPE = (16, 256)  # samples x tokens of random token ids (--input-weights random): cheap, data-free
# --kept-dtype: how the tensors the plan keeps (norms, embeddings, biases, lm_head, ...) are stored. source:
# their source bytes, unchanged; bf16: F32 and F64 ones rounded to BF16 (nearest even), docs/formats.md
# "Kept tensors". F16 stays F16 (BF16 has 3 fewer mantissa bits, and both are 2 bytes: nothing to gain),
# BF16 stays, and non-float tensors (ints, bool, U8, FP8, F4) are never changed.
KEPT_DTYPES = ("source", "bf16")
# --method: how the weights are rounded. rtn: each block on its own (data-free unless a model run
# measures input weights or activation scales; the recipe's ``method`` is None); any other is a calibrated
# method of fp4convert/calibrate/methods/, which owns the list of names and each method's settings.
RTN = "rtn"
KEPT_TO_BF16 = ("F32", "F64")


@runtime_checkable
class MethodSettings(Protocol):
    """A calibrated method's settings, as the recipe carries them: a frozen value whose type, defaults,
    checks and command-line options the method's own module defines (fp4convert/calibrate/methods/); the
    config only calls these four members, so it knows no method by name."""

    name: ClassVar[str]  # the method's --method name

    def check(self, recipe: Recipe) -> None:
        """Raise ConfigError for a setting this recipe cannot have (the recipe's other fields given)."""
        ...

    def resolved(self, recipe: Recipe) -> MethodSettings:
        """The settings in effect: every default that depends on the rest of the recipe filled in."""
        ...

    def identity(self) -> dict:
        """The resolved settings that decide the bytes (the manifest's and --resume's record)."""
        ...


def kept_output_dtype(dtype: str, kept_dtype: str) -> str:
    """The dtype a kept tensor of source ``dtype`` is written in under ``--kept-dtype kept_dtype``."""
    return "BF16" if kept_dtype == "bf16" and dtype in KEPT_TO_BF16 else dtype


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the output bytes: what ``--resume`` compares (:meth:`identity`) and the
    manifest records. Two runs with equal recipes on the same source write the same bytes, whatever
    their :class:`RunOptions`."""

    scheme: str = "nvfp4"
    rotate: str | None = None
    scale_rule: str | None = None  # None: the scheme's default (numerics/scheme.py: NVFP4 4over6, MXFP4 wmse)
    format: str = DEFAULT_FORMAT
    ignore: tuple[str, ...] = ()
    only: tuple[str, ...] = ()
    max_shard_size: int = DEFAULT_MAX_SHARD
    revision: str | None = None  # a Hub source's revision: other weights, other bytes
    base_model: str | None = None  # the model card's base_model (None: derived from the source)
    # W4A4 (docs/formats.md "W4A4"): activation quantization the engines apply, and how its static
    # scale is found. Part of the identity only when activations != "none" (W4A16 outputs unchanged).
    activations: str = "none"  # none | nvfp4 | mxfp4
    activation_scale: str = "calibrate"  # calibrate | constant (ModelOpt's amax 2688: input_scale 1.0)
    calibration_data: str | None = None  # text or JSON-lines file; None: the model generates its samples
    calibration_samples: int | None = None  # None: CALIBRATION_SHAPE / RANDOM_SHAPE, per pass
    calibration_seq_len: int | None = None
    calibration_seed: int = 0
    # Input-weighted scale rules: none | random (uniform random token ids, no data) | calibration (the
    # calibration samples: --calibration-data or self-generated) | auto (calibration when W4A4 NVFP4 is
    # calibrated, else none). Part of the identity only when weights are used (W4A16 outputs unchanged).
    input_weights: str = "auto"
    # How kept tensors are stored (KEPT_DTYPES). Part of the identity only when not "source" (outputs,
    # manifests and resumes of default runs unchanged).
    kept_dtype: str = "source"
    # How the weights are rounded: None is rtn; a calibrated method's settings otherwise (its module in
    # fp4convert/calibrate/methods/: ``methods.settings("gptq", damp=0.02)``). Part of the identity only for
    # a calibrated method (rtn outputs, manifests and resumes unchanged).
    method: MethodSettings | None = None


@dataclass(frozen=True)
class RunOptions:
    """How a run goes, never what it writes: where it computes, how it treats DST, how it checks the source."""

    device: str = "auto"
    overwrite: bool = False
    resume: bool = False
    verify_source: bool = False  # hash the source in full (recorded; --resume compares it)
    lanes: int = 0  # output shards written by this many lanes side by side in one process; 0: auto
    backend: str | None = None  # what quantizes (fp4convert.quantizer.backends); None: chosen from the device and the plan
    allow_no_config: bool = False  # convert a source without config.json (nothing can load the output)


@dataclass(frozen=True)
class ConvertConfig(RunOptions, Recipe):
    """A conversion's settings, frozen: its :class:`Recipe` (the bytes) and its :class:`RunOptions` (the
    rest). The CLI builds one; the library only reads it. :attr:`recipe` is the part ``--resume`` compares."""

    @property
    def recipe(self) -> Recipe:
        return Recipe(**{f.name: getattr(self, f.name) for f in fields(Recipe)})

    @property
    def run_options(self) -> RunOptions:
        return RunOptions(**{f.name: getattr(self, f.name) for f in fields(RunOptions)})

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        SCHEMES[self.scheme].check_rule(self.scale_rule)
        check_rotation(self.rotate)
        if self.format not in OUTPUT_FORMATS:
            raise ConfigError(f"unknown format {self.format!r}; choose one of {', '.join(OUTPUT_FORMATS)}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|(cpu|cuda)(:\d+)?", self.device):
            # checked here, without torch (resolve_device, at run time, finds whether the GPU is there)
            raise ConfigError(f"--device {self.device!r} is not supported; use auto, cpu or cuda[:N]")
        if self.backend is not None and not (isinstance(self.backend, str) and re.fullmatch(r"[a-z][a-z0-9-]*", self.backend)):
            # a name only: which backends exist is the quantize stage's registry, checked when it opens one
            raise ConfigError(f"--backend {self.backend!r} is not a backend name (see --help for the choices)")
        if not isinstance(self.lanes, int) or self.lanes < 0:
            raise ConfigError(f"--lanes {self.lanes!r}: give a number of lanes (1 or more), or 0 to choose automatically")
        if self.base_model is not None:
            from fp4convert.storage.names import valid_repo_id

            if not valid_repo_id(self.base_model):
                raise ConfigError(f"--base-model {self.base_model!r} is not a Hub model id (org/name)")
        self._check_method()
        self._check_activations()
        if self.kept_dtype not in KEPT_DTYPES:
            raise ConfigError(f"--kept-dtype {self.kept_dtype!r}: choose one of {', '.join(KEPT_DTYPES)}")
        if self.max_shard_size <= 0:
            raise ConfigError("--max-shard-size must be positive")
        if self.overwrite and self.resume:
            raise ConfigError("--overwrite and --resume contradict each other; pick one")
        for p in (*self.ignore, *self.only):
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as exc:
                    raise ConfigError(f"bad regex in pattern {p!r}: {exc}") from exc

    def _check_activations(self) -> None:
        """W4A4 settings: only the scheme/format pairs whose engines read activation scales."""
        if self.activations not in ACTIVATIONS:
            raise ConfigError(f"--activations {self.activations!r}: choose one of {', '.join(ACTIVATIONS)}")
        if self.activation_scale not in ACTIVATION_SCALES:
            raise ConfigError(f"--activation-scale {self.activation_scale!r}: choose one of {', '.join(ACTIVATION_SCALES)}")
        if (self.calibration_samples is not None and self.calibration_samples < 1) or (
                self.calibration_seq_len is not None and self.calibration_seq_len < 2):
            raise ConfigError("--calibration-samples must be >= 1 and --calibration-seq-len >= 2")
        self._check_input_weights()
        if self.activations == "none":
            return
        if self.activations != self.scheme:
            raise ConfigError(f"--activations {self.activations} needs --scheme {self.activations} "
                              f"(weights and activations in one FP4 format), not --scheme {self.scheme}")
        allowed = [name for name in OUTPUT_FORMATS if self.activations in get_format(name).activation_modes]
        if self.format not in allowed:
            raise ConfigError(f"--activations {self.activations} is written for --format {' or '.join(allowed)} "
                              f"only (the engines' W4A4 conventions), not --format {self.format}")

    def _check_method(self) -> None:
        if self.method is None:
            return
        if not isinstance(self.method, MethodSettings):
            raise ConfigError(f"method={self.method!r}: give a calibrated method's settings "
                              "(fp4convert.calibrate.methods.settings(name, ...)), or None for rtn")
        if self.input_weights not in ("auto", "none"):
            raise ConfigError(f"--input-weights {self.input_weights} does not apply to --method {self.method.name}: "
                              "it weights the search rules' block error by its own statistics (GPTQ: its Hessian's "
                              "diagonal); drop --input-weights")
        self.method.check(self)

    def _check_input_weights(self) -> None:
        if self.input_weights not in INPUT_WEIGHTS:
            raise ConfigError(f"--input-weights {self.input_weights!r}: choose one of {', '.join(INPUT_WEIGHTS)}")
        if self.input_weights in ("random", "calibration") and not self._rule_searches():
            raise ConfigError(f"--input-weights {self.input_weights} changes only the search scale rules; "
                              f"--scale-rule {self.scale_rule} has no search (drop one of them)")

    def _rule_searches(self) -> bool:
        """The rule asked for searches (None: the default, resolved later, counts as searching)."""
        return self.scale_rule is None or SCHEMES[self.scheme].rule(self.scale_rule).searches

    @property
    def input_weight_source(self) -> str:
        """Where the input weights come from: none, random or calibration (``auto`` resolved): a W4A4
        NVFP4 conversion with calibrated scales weights by the calibration pass's own mean squares,
        unless the rule asked for has no search."""
        if self.input_weights != "auto":
            return self.input_weights
        if self.method is not None:
            return "none"  # a calibrated method weights the search rules itself (GPTQ: its Hessian's diagonal)
        if (self.activations == "nvfp4" and self.activation_scale == "calibrate"
                and self._rule_searches()):
            return "calibration"
        return "none"

    @property
    def calibration_shape(self) -> tuple[int, int]:
        """(samples, tokens per sample) of a calibration pass (text file or self-generated)."""
        return (self.calibration_samples or CALIBRATION_SHAPE[0], self.calibration_seq_len or CALIBRATION_SHAPE[1])

    @property
    def random_shape(self) -> tuple[int, int]:
        """(samples, tokens per sample) of the random token ids of ``--input-weights random``."""
        return (self.calibration_samples or RANDOM_SHAPE[0], self.calibration_seq_len or RANDOM_SHAPE[1])

    @property
    def rule(self) -> str:
        """The scale rule in effect: the one asked for, else ``mse`` when input weights are on (the best
        measured with them; GPTQ's are its Hessian's diagonal), else the scheme's default."""
        if self.scale_rule is None and (self.input_weight_source != "none" or self.method is not None):
            return SCHEMES[self.scheme].check_rule(WEIGHTED_RULE)
        return SCHEMES[self.scheme].check_rule(self.scale_rule)

    def identity(self) -> dict:
        """The settings that determine the output bytes; resume refuses when these change."""
        return {
            "scheme": self.scheme,
            "rotate": self.rotate,
            "scale_rule": self.rule,
            "format": self.format,
            "ignore": list(self.ignore),
            "only": list(self.only),
            "max_shard_size": self.max_shard_size,
            "revision": self.revision,
            **self.activation_identity(),
            **self.input_weight_identity(),
            **self.method_identity(),
            **({"kept_dtype": self.kept_dtype} if self.kept_dtype != "source" else {}),
            **({"base_model": self.base_model} if self.base_model is not None else {}),
        }

    def kept_output_dtype(self, dtype: str) -> str:
        """The dtype a kept tensor of source ``dtype`` is written in."""
        return kept_output_dtype(dtype, self.kept_dtype)

    def activation_identity(self) -> dict:
        """The W4A4 settings in the identity ({} for W4A16, whose identity stays as it was)."""
        if self.activations == "none":
            return {}
        out = {"activations": self.activations}
        if self.activations == "nvfp4":  # MXFP4 activations are dynamic: nothing is calibrated
            out["activation_scale"] = self.activation_scale
            if self.activation_scale == "calibrate":
                out["calibration"] = self._calibration_identity()
        return out

    @property
    def method_name(self) -> str:
        """The --method name: rtn, or the calibrated method's."""
        return RTN if self.method is None else self.method.name

    @property
    def method_settings(self) -> MethodSettings | None:
        """The calibrated method's settings in effect (its recipe-dependent defaults resolved), or None (rtn)."""
        return None if self.method is None else self.method.resolved(self)

    def method_identity(self) -> dict:
        """A calibrated method's settings in the identity ({} for rtn: identities of earlier runs unchanged)."""
        settings = self.method_settings
        if settings is None:
            return {}
        return {"method": {"name": settings.name, **settings.identity(), "calibration": self._calibration_identity()}}

    def _calibration_identity(self) -> dict:
        samples, seq_len = self.calibration_shape
        return {"data": self.calibration_data, "samples": samples, "seq_len": seq_len, "seed": self.calibration_seed}

    def input_weight_identity(self) -> dict:
        """The input weights' settings in the identity ({} without: identities of earlier runs unchanged)."""
        src = self.input_weight_source
        if src == "none":
            return {}
        if src == "random":
            samples, seq_len = self.random_shape
            return {"input_weights": {"source": "random", "samples": samples, "seq_len": seq_len,
                                      "seed": self.calibration_seed}}
        return {"input_weights": {"source": "calibration", **self._calibration_identity()}}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000B' -> bytes.

    A unit is required: a bare ``10`` (which would mean 10 bytes, one shard per tensor) is refused,
    since ``--max-shard-size 10`` almost always meant 10 GB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*", text.upper())
    if not m:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or 2GiB")
    if not m.group(2) and float(m.group(1)) > 0:
        raise ConfigError(f"size {text.strip()!r} has no unit (it would mean {text.strip()} bytes); write e.g. "
                          f"{text.strip()}GB or {text.strip()}MB, or {text.strip()}B if you mean bytes")
    num, unit = float(m.group(1)), (m.group(2) or "B")
    unit = unit if unit.endswith("B") else unit + "B"
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "KB": 1, "MB": 2, "GB": 3, "TB": 4}[unit.replace("I", "")]
    return int(num * base**power)


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB': decimal units, as parse_size reads them, adapted to the size (a small need
    never reads '0.00 GB'). The one size formatter of the CLI, the logs and the errors."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"
