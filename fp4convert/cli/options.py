"""The options commands share (sqlite-utils style: one decorator per group of options), and their help texts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps

import click

from fp4convert.calibrate.methods import Option, all_options, method_names, settings
from fp4convert.config import (
    CALIBRATION_SHAPE,
    DEFAULT_MAX_SHARD,
    INPUT_WEIGHTS,
    KEPT_DTYPES,
    RANDOM_SHAPE,
    RTN,
    WEIGHTED_RULE,
)
from fp4convert.errors import EXIT_CODES
from fp4convert.numerics.scheme import SCHEMES
from fp4convert.quantizer.backend import backend_names

SCALE_RULES = sorted({r for s in SCHEMES.values() for r in s.scale_rules})


def options(*opts: Callable) -> Callable[[Callable], Callable]:
    """Apply click options in the order they are listed (the order --help shows)."""

    def apply(fn: Callable) -> Callable:
        for opt in reversed(opts):
            fn = opt(fn)
        return fn

    return apply


token_option = click.option(
    "--token", default=None, envvar="HF_TOKEN", show_envvar=True,
    help="Hub token for a gated or private repo and for uploads (default: your `hf auth login`).")
revision_option = click.option("--revision", default=None,
                               help="Hub revision (branch, tag or commit) when the checkpoint is a Hub repo id.")
quiet_option = click.option("--quiet", "-q", is_flag=True, help="Errors only: no progress, status lines or warnings.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
kept_dtype_option = click.option(
    "--kept-dtype", type=click.Choice(KEPT_DTYPES), default="source", show_default=True,
    help="How the tensors left unquantized (embeddings, norms, biases, lm_head, ...) are stored. source: their "
         "source bytes, unchanged. bf16: F32 and F64 ones rounded to BF16 (nearest even); use it for an fp32 "
         "checkpoint, whose kept tensors then take half the space (config.json's float32 dtype becomes bfloat16). "
         "BF16 and F16 tensors stay as they are (F16 -> BF16 saves nothing and drops 3 mantissa bits), and so do "
         "non-float ones (ints, bool, U8, FP8, F4) and every quantized tensor.")


def scale_rule_help() -> str:
    rules = "; ".join(f"{s.name.upper()}: {s.default_rule} (default), "
                      + ", ".join(r for r in s.scale_rules if r != s.default_rule) for s in SCHEMES.values())
    return (f"How block scales are chosen. {rules}. With input weights (--input-weights; W4A4 NVFP4 calibrated) "
            f"the default is {WEIGHTED_RULE}. The defaults gave the lowest KL on a real LM (BENCHMARKS.md; "
            "docs/numerics.md defines each rule).")


def backend_help() -> str:
    return (f"What quantizes: {', '.join(backend_names())} (default: cuda for plain 2-D weights on a GPU, "
            "stacked for the rest on a GPU; cpu-native for plain 2-D weights on the CPU, cpu for the rest). "
            "The output bytes do not depend on it.")


# The options every command that writes a checkpoint shares (quantize, export).
output_options = options(
    click.option("--max-shard-size", default=f"{DEFAULT_MAX_SHARD // 10**9}GB", show_default=True,
                 help="Largest output shard (e.g. 5GB, 500MB, 2GiB)."),
    click.option("--overwrite", is_flag=True, help="Replace the outputs of an earlier run in DST."),
    click.option("--resume", is_flag=True, help="Continue an interrupted run with the same settings."),
    click.option("--verify-source", is_flag=True,
                 help="Hash every source file in full (recorded; with --resume, compared with the interrupted "
                      "run's hashes) instead of the default sampled fingerprint."),
    quiet_option,
    json_option,
)

# Publishing the output: --push-to-hub REPO [--private] (the token is the command's --token).
push_options = options(
    click.option("--push-to-hub", "push_repo", metavar="REPO", default=None,
                 help="Upload DST to this Hub repo when done (created if needed; rerun to resume an upload)."),
    click.option("--private", is_flag=True, help="With --push-to-hub: create the repo private."),
    token_option,
)


def push_folder(dst, repo, private: bool, token, quiet: bool) -> None:
    from fp4convert.checkpoint.push import push_to_hub

    url = push_to_hub(dst, repo, private=private, token=token)
    if not quiet:
        click.echo(f"pushed {dst} to {repo} ({url})", err=True)


EXIT_CODE_HELP = "\b\nExit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES.items())


def method_options(fn: Callable) -> Callable:
    """--method and every calibrated method's own options (declared by its settings type,
    fp4convert.calibrate.methods), parsed into one ``rounding`` dict: ``{"method": settings or None}``. An option
    of another method than the one chosen is refused, naming the method it belongs to."""
    owned = all_options()
    opts = [click.option("--method", type=click.Choice([RTN, *method_names()]), default=RTN, show_default=True,
                         help="How weights are rounded. rtn: each block on its own (data-free). gptq: GPTQ on "
                              "calibration samples (--calibration-data, else self-generated), block by block on the "
                              "model (the GPU when there is one), each column's rounding error pushed onto the columns "
                              "not yet quantized. Measured (BENCHMARKS.md): SmolLM2-135M NVFP4 next-token KL 0.049 "
                              "against 0.186 for rtn (llm-compressor's GPTQ: 0.070), NVFP4 W4A4 0.180 (llm-compressor's: "
                              "0.235); it runs the model first (H200, 8 Llama-3-8B layers: 7.6x the data-free run; on the "
                              "same tokens 0.68x llm-compressor's GPTQ time). With --rotate had16: MR-GPTQ.")]
    params: dict[str, tuple[str, Option]] = {}  # click parameter name -> (its method, its spec)
    for name, specs in owned.items():
        for spec in specs:
            param = f"{name.replace('-', '_')}__{spec.field}"
            params[param] = (name, spec)
            opts.append(_click_option(spec, param))

    @wraps(fn)
    def wrapper(*args, **kwargs):
        chosen = kwargs.pop("method")
        given: dict[str, dict] = {}
        for param, (name, spec) in params.items():
            value = kwargs.pop(param)
            if value is not None:
                given.setdefault(name, {})[spec.field] = (spec, value)
        for name, values in given.items():
            if name != chosen:
                flags = " / ".join(spec.flags.replace("/", " / ") for spec, _ in values.values())
                raise click.UsageError(f"{flags} {'apply' if len(values) > 1 else 'applies'} to --method {name} only")
        chosen_values = {f: v for f, (_, v) in given.get(chosen, {}).items()}
        kwargs["rounding"] = {"method": None if chosen == RTN else settings(chosen, **chosen_values)}
        return fn(*args, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


def _click_option(spec: Option, param: str) -> Callable:
    """The click option of a method's option spec (default None: the method's default applies)."""
    if spec.kind is bool:
        return click.option(spec.flags, param, default=None, help=spec.help)
    if spec.low is None and spec.high is None:
        kind: click.ParamType = click.FLOAT if spec.kind is float else click.INT
    elif spec.kind is float:
        kind = click.FloatRange(min=spec.low, max=spec.high, min_open=spec.low_open, max_open=spec.high_open)
    else:
        kind = click.IntRange(min=None if spec.low is None else int(spec.low), max=None if spec.high is None else int(spec.high),
                              min_open=spec.low_open, max_open=spec.high_open)
    return click.option(spec.flags, param, type=kind, default=None, help=spec.help)


def activation_options(fn: Callable) -> Callable:
    """W4A4 (docs/formats.md "W4A4"): --activations and its calibration, gathered into one
    ``activation`` dict of ConvertConfig fields."""
    opts = [
        click.option("--activations", type=click.Choice(["none", "nvfp4", "mxfp4"]), default="none", show_default=True,
                     help="Also quantize activations (W4A4, Blackwell FP4 GEMMs). nvfp4: with --scheme nvfp4 and "
                          "--format compressed-tensors or modelopt, a calibrated static scale per linear; mxfp4: with "
                          "--scheme mxfp4 and --format compressed-tensors, dynamic (nothing calibrated)."),
        click.option("--activation-scale", type=click.Choice(["calibrate", "constant"]), default="calibrate",
                     show_default=True,
                     help="calibrate: measure each linear's input amax, layer by layer. constant: ModelOpt's "
                          "constant amax 2688 (input_scale 1.0) with no calibration; RISKY: blocks above 2688 "
                          "clip and small activations underflow FP8 block scales (accuracy loss)."),
        click.option("--calibration-data", type=click.Path(dir_okay=False), default=None,
                     help="Calibration text: plain text, or JSON lines with a 'text' field. Default: the model "
                          "generates its own samples from its tokenizer (seeded; one pass over the weights per token)."),
        click.option("--calibration-samples", type=click.IntRange(min=1), default=None,
                     help=f"Calibration samples [default: {CALIBRATION_SHAPE[0]}; {RANDOM_SHAPE[0]} for "
                          "--input-weights random]."),
        click.option("--calibration-seq-len", type=click.IntRange(min=2), default=None,
                     help=f"Tokens per calibration sample [default: {CALIBRATION_SHAPE[1]}; {RANDOM_SHAPE[1]} for "
                          "--input-weights random]."),
        click.option("--calibration-seed", type=int, default=0, show_default=True,
                     help="Seed of self-generated samples and of random token ids."),
        click.option("--input-weights", type=click.Choice(INPUT_WEIGHTS), default="auto", show_default=True,
                     help="Weight each search scale rule's block error by the mean square of the layer's input "
                          "channel, measured by running the model block by block (decoders, MoEs, VLM text decoders; "
                          "local folder, transformers). random: on seeded random token ids (no data; about one pass over "
                          "the weights); calibration: on the calibration samples; auto: the W4A4 NVFP4 calibration "
                          "pass's own, else none (data-free, no model run). With weights the default rule is mse. "
                          "The most accurate weight-only setting, not the default because it runs the model first "
                          "(H100 host, 8 Llama-3-8B layers: 10x the GPU conversion's time, 35x on the CPU). Measured "
                          "(BENCHMARKS.md): random gives NVFP4 0.585x / 0.527x and MXFP4 0.949x / 0.885x "
                          "llm-compressor's KL on SmolLM2-135M / Gemma 3 270M (no weights: 0.924x / 0.845x, "
                          "0.996x / 0.996x)."),
    ]
    keys = ("activations", "activation_scale", "calibration_data", "calibration_samples", "calibration_seq_len",
            "calibration_seed", "input_weights")

    @wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs["activation"] = {k: kwargs.pop(k) for k in keys}
        return fn(*args, **kwargs)

    for opt in reversed(opts):
        wrapper = opt(wrapper)
    return wrapper


