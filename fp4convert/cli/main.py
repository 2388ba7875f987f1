"""The ``fp4convert`` command line: parses options into a frozen config and calls the library.

Library errors (``FP4ConvertError`` subclasses) become one-line messages with their class's exit
code (the table is ``fp4convert.errors.EXIT_CODES``, printed at the end of ``--help``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import wraps

import click
from tqdm import tqdm

from fp4convert.config import (
    CALIBRATION_SHAPE,
    DEFAULT_MAX_SHARD,
    INPUT_WEIGHTS,
    KEPT_DTYPES,
    RANDOM_SHAPE,
    WEIGHTED_RULE,
    ConvertConfig,
    human_bytes,
    parse_size,
)
from fp4convert.errors import EXIT_CODES, STDOUT_CLOSED, FP4ConvertError, InspectFailed, Interrupted, RankFailed
from fp4convert.formats import DEFAULT_FORMAT, OUTPUT_FORMATS
from fp4convert.numerics.scheme import ROTATIONS, SCHEMES
from fp4convert.quantize.backend import backend_names
from fp4convert.version import __version__

SCALE_RULES = sorted({r for s in SCHEMES.values() for r in s.scale_rules})

log = logging.getLogger("fp4convert")


class _CliHandler(logging.Handler):
    """The command line's one log handler: lines that do not tear the progress bar.

    It sits on the ROOT logger while a command runs and is removed when it ends; the library's own
    ``fp4convert`` logger is never touched (no handler, level or propagation change), so an application
    or a test that embeds the library keeps seeing its records. fp4convert's records pass from
    ``ours``, other libraries' (huggingface_hub, transformers) from ``others``.
    """

    def __init__(self, ours: int, others: int) -> None:
        super().__init__(logging.NOTSET)
        self.ours, self.others = ours, others
        self.setFormatter(logging.Formatter("%(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        mine = record.name == "fp4convert" or record.name.startswith("fp4convert.")
        if mine and str(record.msg).startswith(ROTATION_WARNING_START):
            return False  # the command prints its own, even with --quiet (_warn_rotation)
        return record.levelno >= (self.ours if mine else self.others)

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


ROTATION_WARNING_START = "Had16-rotated compressed-tensors checkpoint"
ROTATION_WARNING = (f"{ROTATION_WARNING_START}: vLLM rotates activations from transform_config (tensor parallel 1 "
                    "only); transformers ignores transform_config and computes WRONG outputs from these weights "
                    "(serve it with vLLM, or convert without --rotate for transformers)")


def _warn_rotation(fmt: str, rotate: str | None, warnings: list | None = None) -> None:
    """A had16 compressed-tensors output loads in transformers without error and computes garbage. That
    is too easy to miss for ``--quiet`` to hide: the warning goes to stderr in every mode (--quiet
    included; it is one line), and into --json's "warnings"."""
    if fmt != "compressed-tensors" or not rotate or _rank() > 0:
        return
    click.echo(f"warning: {ROTATION_WARNING}", err=True)
    if warnings is not None and ROTATION_WARNING not in warnings:
        warnings.append(ROTATION_WARNING)


_installed: list[tuple[_CliHandler, int]] = []  # (handler, the root level before it), while a command runs


def _setup_logging(quiet: bool, status: bool = True) -> None:
    """--quiet: errors only (huggingface_hub's bars too); --json: warnings and errors; else status lines.

    Undone by :func:`_teardown_logging` when the command ends (``_library_errors``)."""
    _teardown_logging()
    ours = logging.ERROR if quiet else logging.INFO if status else logging.WARNING
    others = logging.ERROR if quiet else logging.WARNING
    root = logging.getLogger()
    handler = _CliHandler(ours, others)
    _installed.append((handler, root.level))
    root.addHandler(handler)
    root.setLevel(min(ours, others))
    if quiet or not sys.stderr.isatty():
        from fp4convert.checkpoint.push import disable_hub_progress_bars

        disable_hub_progress_bars()


def _teardown_logging() -> None:
    root = logging.getLogger()
    while _installed:
        handler, level = _installed.pop()
        root.removeHandler(handler)
        root.setLevel(level)


PROGRESS_ENV = "FP4CONVERT_PROGRESS_INTERVAL"  # seconds between progress lines when stderr is not a TTY


class _LineProgress:
    """Progress for logs and pipes: one line every N seconds (a ticker thread, so long downloads show too)."""

    def __init__(self, total: int, desc: str, interval: float) -> None:
        self.total, self.desc, self.interval = total, desc, interval
        self.done = 0
        self._clock = time.monotonic
        self._t0 = self._clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp4convert-progress", daemon=True)

    def update(self, n: int) -> None:
        self.done += n

    def line(self) -> str:
        elapsed = self._clock() - self._t0
        pct = 100 * self.done / self.total if self.total else 100.0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = f", ETA {(self.total - self.done) / rate:.0f} s" if rate > 0 and self.done < self.total else ""
        return (f"{self.desc}: {human_bytes(self.done)} of {human_bytes(self.total)} ({pct:.0f}%), "
                f"{elapsed:.0f} s, {human_bytes(rate)}/s{eta}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            click.echo(self.line(), err=True)

    def __enter__(self) -> _LineProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class _NoProgress:
    total = 0

    def update(self, n: int) -> None:
        pass


def _progress(total: int, desc: str, quiet: bool):
    """A tqdm bar on a terminal, a line every N seconds otherwise, nothing with --quiet/--json."""
    if quiet:
        return contextlib.nullcontext(_NoProgress())
    if sys.stderr.isatty():
        return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)
    try:
        interval = float(os.environ.get(PROGRESS_ENV, "10"))
    except ValueError:
        interval = 10.0
    return _LineProgress(total, desc, max(interval, 0.01))


def _rank() -> int:
    """This process's rank under torchrun (0 otherwise): only rank 0 prints plans and summaries."""
    import os

    return int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0


def _library_errors(fn: Callable) -> Callable:
    """The error boundary: every failure becomes one line on stderr and its exit code (errors.EXIT_CODES);
    ``--debug`` adds the full traceback. OS errors name the file (DST: 5, SRC: 4); anything unexpected
    is an internal error (1)."""

    @click.option("--debug", is_flag=True, help="On an error, also print the full traceback.")
    @wraps(fn)
    def wrapper(*args, debug: bool = False, **kwargs):
        import signal
        import threading

        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:  # SIGTERM stops a run like Ctrl-C does (kept shards, --resume hint)
            old_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            return fn(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except BaseException as exc:  # noqa: BLE001 - the boundary: classify, one line, exit code
            if isinstance(exc, SystemExit):
                raise
            if isinstance(exc, BrokenPipeError) and exc.filename is None:
                _stdout_closed()
            if isinstance(exc, RankFailed) and _rank() > 0:  # under torchrun rank 0 names the failing rank
                sys.exit(exc.exit_code)
            err = _classify(exc, kwargs.get("src"), kwargs.get("dst"), command=fn.__name__)
            if debug:
                import traceback

                traceback.print_exc(file=sys.stderr)
            click.echo(f"Error: {' '.join(str(err).split())}", err=True)
            sys.exit(err.exit_code)
        finally:
            _teardown_logging()
            if main_thread:
                signal.signal(signal.SIGTERM, old_term)

    return wrapper


def _stdout_closed() -> None:
    """Whoever read our stdout stopped (``| head``): not an error. Exit 141 (128 + SIGPIPE, what a shell
    reports for a command a closed pipe stopped) without a message or traceback; stdout is pointed at
    /dev/null first so that the interpreter's final flush cannot complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    os._exit(STDOUT_CLOSED) if _rank() > 0 else sys.exit(STDOUT_CLOSED)


# What Ctrl-C (or SIGTERM) means for each command: only the writing ones keep finished shards for --resume.
INTERRUPTED = {
    "quantize": "interrupted; finished shards are kept: run the same command with --resume to continue",
    "export": "interrupted; finished shards are kept: run the same export with --resume to continue",
    "inspect": "interrupted; inspect writes nothing: run it again",
    "push": "interrupted; run the same push again: only what is missing is uploaded",
}


def _classify(exc: BaseException, src: str | None, dst: str | None, command: str = "quantize") -> FP4ConvertError:
    """Any exception as the FP4ConvertError the user sees."""
    import errno

    if isinstance(exc, FP4ConvertError):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(INTERRUPTED.get(command, "interrupted"))
    if isinstance(exc, RuntimeError) and str(exc).startswith("Symlink loop from "):  # pathlib.resolve()
        from fp4convert.errors import OutputError, SourceError

        where = str(exc)[len("Symlink loop from "):].strip("'")
        full = os.path.abspath(where)
        if dst and (full + os.sep).startswith(os.path.abspath(dst) + os.sep) or dst and \
                (os.path.abspath(dst) + os.sep).startswith(full + os.sep):
            return OutputError(f"{where}: a symlink loop in the destination path; choose another DST")
        return SourceError(f"{where}: a symlink loop; fix the path")
    if isinstance(exc, OSError):
        from fp4convert.errors import OutputError, SourceError

        name = exc.filename or ""
        what = f"{exc.strerror or exc}" + (f", {errno.errorcode[exc.errno]}" if exc.errno in errno.errorcode else "")
        full = os.path.abspath(name) if name else ""
        if dst and full and (full + os.sep).startswith(os.path.abspath(dst) + os.sep):
            return OutputError(f"{name}: cannot write ({what}); check the destination folder")
        if src and full and (full + os.sep).startswith(os.path.abspath(src) + os.sep):
            return SourceError(f"{name}: cannot read ({what}); check the source files")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return OutputError(f"{name or dst}: {what}; free some space, then run the same command with --resume")
        return FP4ConvertError(f"internal error: {type(exc).__name__}: {name + ': ' if name else ''}{what}; "
                               "please report it (rerun with --debug for the traceback)")
    if isinstance(exc, MemoryError):
        return FP4ConvertError("out of host memory; close other programs or use a machine with more memory "
                               "(rerun with --debug for the traceback)")
    text = " ".join(str(exc).split())[:300]
    return FP4ConvertError(f"internal error: {type(exc).__name__}: {text}; please report it "
                           "(rerun with --debug for the traceback)")


# -- options several commands share: each declared once (sqlite-utils' cli.py keeps them the same way) --

def _options(*opts: Callable) -> Callable[[Callable], Callable]:
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


def _scale_rule_help() -> str:
    rules = "; ".join(f"{s.name.upper()}: {s.default_rule} (default), "
                      + ", ".join(r for r in s.scale_rules if r != s.default_rule) for s in SCHEMES.values())
    return (f"How block scales are chosen. {rules}. With input weights (--input-weights; W4A4 NVFP4 calibrated) "
            f"the default is {WEIGHTED_RULE}. The defaults gave the lowest KL on a real LM (BENCHMARKS.md; "
            "docs/numerics.md defines each rule).")


def _backend_help() -> str:
    return (f"What quantizes: {', '.join(backend_names())} (default: cuda for plain 2-D weights on a GPU, "
            "stacked for the rest on a GPU; cpu-native for plain 2-D weights on the CPU, cpu for the rest). "
            "The output bytes do not depend on it.")


# The options every command that writes a checkpoint shares (quantize, export).
_output_options = _options(
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
_push_options = _options(
    click.option("--push-to-hub", "push_repo", metavar="REPO", default=None,
                 help="Upload DST to this Hub repo when done (created if needed; rerun to resume an upload)."),
    click.option("--private", is_flag=True, help="With --push-to-hub: create the repo private."),
    token_option,
)


def _push(dst, repo, private: bool, token, quiet: bool) -> None:
    from fp4convert.checkpoint.push import push_to_hub

    url = push_to_hub(dst, repo, private=private, token=token)
    if not quiet:
        click.echo(f"pushed {dst} to {repo} ({url})", err=True)


EXIT_CODE_HELP = "\b\nExit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES.items())


def _activation_options(fn: Callable) -> Callable:
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
                          "channel, measured by running the model layer by layer (Llama/Mistral/Qwen2/Qwen3/Gemma 3 text, "
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


def entry() -> None:
    """The ``fp4convert`` program (console script and ``python -m fp4convert``): :func:`main`, then exit.

    A process that ran the torch-free CUDA path exits without the interpreter's teardown (``os._exit``
    once stdout, stderr and the logs are flushed): tearing down the CUDA context and the pinned pool's
    mappings costs ~0.25 s on the H100 machine, 10% of converting a 3 GB MoE, for nothing, since the
    kernel reclaims both and every output file is closed and synced by then. Anything else (torch loaded,
    torchrun) exits normally: torch and torch.distributed register exit handlers."""
    try:
        main(prog_name="fp4convert")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if isinstance(code, int) and "fp4convert.kernels.cuda.runtime" in sys.modules and "torch" not in sys.modules \
            and not int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODE_HELP)
@click.version_option(__version__, prog_name="fp4convert")
def main() -> None:
    """Convert Hugging Face safetensors checkpoints to NVFP4 / MXFP4 weights.

    \b
      fp4convert quantize MODEL_DIR_OR_REPO OUT_DIR     convert a checkpoint
      fp4convert quantize MODEL OUT --dry-run           show the plan, write nothing
      fp4convert inspect CHECKPOINT                     summarize and check a converted checkpoint
      fp4convert export NATIVE_DIR OUT --format compressed-tensors   re-layout for an engine
    """


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--scheme", type=click.Choice(list(SCHEMES), case_sensitive=False), default="nvfp4", show_default=True, help="FP4 scheme.")
@click.option("--rotate", type=click.Choice(list(ROTATIONS), case_sensitive=False), default=None,
              help="Rotate weights with a 16-point Hadamard first. Meant for W4A4 serving (activations quantized "
                   "too); weight-only it raised NVFP4's next-token KL 1.2-1.8x on the model measured (BENCHMARKS.md).")
@click.option("--scale-rule", type=click.Choice(SCALE_RULES, case_sensitive=False), default=None,
              help=_scale_rule_help())
@click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS), case_sensitive=False), default=DEFAULT_FORMAT,
              show_default=True,
              help="On-disk convention: fp4convert (native, swizzled scales; export it for engines), "
                   "compressed-tensors (vLLM, transformers) or modelopt (vLLM/SGLang/TensorRT-LLM, NVFP4).")
@click.option("--device", default="auto", show_default=True,
              help="auto (a GPU if its kernels load, else the CPU), cpu, cuda or cuda:N.")
@click.option("--lanes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Write this many output shards side by side in one process (0: the backend's choice, 2 for "
                   "cuda, 1 otherwise). The output bytes do not depend on it.")
@click.option("--backend", type=click.Choice(backend_names()), default=None, help=_backend_help())
@click.option("--ignore", multiple=True, metavar="PATTERN", help="Keep matching tensors unquantized (glob, or re:REGEX). Repeatable.")
@click.option("--only", multiple=True, metavar="PATTERN", help="Quantize only matching tensors (glob, or re:REGEX). Repeatable.")
@click.option("--allow-nothing-quantized", is_flag=True,
              help="Write the output even when the plan quantizes no tensor (otherwise exit 2).")
@click.option("--allow-no-config", is_flag=True,
              help="Convert a source that has no config.json (otherwise exit 2: nothing can load the output, and "
                   "tensor roles then come from names alone).")
@revision_option
@click.option("--cache-dir", default=None, type=click.Path(file_okay=False),
              help="Hub cache folder for SRC's files (default: HF_HUB_CACHE).")
@click.option("--delete-source-shards", is_flag=True,
              help="Hub SRC: remove each source shard from the HF cache once it is converted (saves disk).")
@click.option("--dry-run", is_flag=True, help="Print the plan (decisions, sizes) and write nothing.")
@click.option("--base-model", metavar="REPO", default=None,
              help="The model card's base_model (default: the Hub repo id, or a Hub id config.json names).")
@kept_dtype_option
@_output_options
@_push_options
@_activation_options
@_library_errors
def quantize(src, dst, scheme, rotate, scale_rule, fmt, device, lanes, backend, max_shard_size, ignore, only,
             allow_nothing_quantized, allow_no_config, revision, cache_dir, delete_source_shards, dry_run, base_model,
             kept_dtype, overwrite, resume, verify_source, quiet, as_json, push_repo, private, token, activation) -> None:
    """Quantize checkpoint SRC (a local folder or a Hub repo id) into folder DST.

    \b
    Example:
      fp4convert quantize Qwen/Qwen3-8B qwen3-nvfp4 --format compressed-tensors
    """
    from fp4convert import stages

    ages = {"cli_start": stages.process_age()}  # where a run's seconds outside convert() go (--json)
    from fp4convert.errors import PlanError
    from fp4convert.run.convert import convert, plan_conversion, prewarm_device
    from fp4convert.run.runner import plan_warnings
    from fp4convert.source.source import open_source

    config = ConvertConfig(
        scheme=scheme, rotate=rotate, scale_rule=scale_rule, format=fmt, ignore=tuple(ignore), only=tuple(only),
        max_shard_size=parse_size(max_shard_size), device=device, overwrite=overwrite, resume=resume,
        revision=revision, verify_source=verify_source, lanes=lanes, backend=backend,
        allow_no_config=allow_no_config, base_model=base_model, kept_dtype=kept_dtype,
        **activation,
    )
    dry_run_out = True
    if _rank() > 0:  # torchrun: one voice (rank 0); the others only report their own errors
        quiet, as_json, dry_run_out = True, False, False
    if delete_source_shards and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        from fp4convert.errors import ConfigError

        raise ConfigError("--delete-source-shards cannot be used under torchrun (another rank may still read a "
                          "shard); convert with one process, or keep the source shards")
    _setup_logging(quiet, status=not as_json)
    if not dry_run:
        prewarm_device(config)  # the GPU starts while the source is opened and planned
    source = open_source(src, revision, token=token, cache_dir=cache_dir)
    planned = plan_conversion(source, config, fetch_ahead=not dry_run)
    try:  # a Hub source is downloading since planning: stopped on any refusal before convert() owns it
        plan = planned[1]
        nothing = plan.summary()["quantized"] == 0 and not allow_nothing_quantized
        if dry_run:
            if not dry_run_out:
                return
            if as_json:
                click.echo(json.dumps(plan.to_json(), indent=2))
            else:
                _print_plan(plan, quiet)
            _warn_rotation(fmt, rotate)
            if nothing:
                raise PlanError("the plan quantizes no tensor (see the warnings); pass --allow-nothing-quantized "
                                "to write an unquantized copy anyway")
            return
        if nothing:
            for w in plan_warnings(plan):
                log.warning("warning: %s", w)
            raise PlanError("the plan quantizes no tensor: check --only / --ignore and the layer names "
                            "(--dry-run shows every decision); --allow-nothing-quantized writes the copy anyway")
        progress_fn = None
        with _progress(plan.summary()["bytes_in"], "quantize", quiet or as_json) as bar:
            progress_fn = bar.update
            if delete_source_shards:
                from fp4convert.source.release import ShardReleaser

                progress_fn = ShardReleaser(source, plan, bar.update)
            ages["convert_start"] = stages.process_age()
            result = convert(source, dst, config, progress=progress_fn, plan=planned)
    except BaseException:
        source.stop_prefetch()
        raise
    if _rank() > 0:
        return
    if push_repo:
        _push(dst, push_repo, private, token, quiet)
    if as_json:
        ages["summary"] = stages.process_age()
        s = result.to_json()
        _warn_rotation(fmt, rotate, s.setdefault("warnings", []))
        if None not in ages.values():
            s["process_s"] = {k: round(v, 3) for k, v in ages.items()}
        click.echo(json.dumps(s, indent=2))
        return
    s = result.to_json()
    if quiet:
        _warn_rotation(fmt, rotate)
        return
    click.echo(
        f"{dst}: {s['quantized']} tensors quantized ({scheme}{', had16' if rotate else ''}), {s['kept']} kept; "
        f"{human_bytes(s['bytes_in'])} -> {human_bytes(s['bytes_out'])} in {s['shards_out']} shard(s), "
        f"{s['bits_per_param']} bits/param ({s['bits_per_param_quantized']} in quantized layers); "
        f"{s['wall_s']:.1f} s, peak memory {human_bytes(s['peak_rss_bytes'])}"
        + (f"; reused {len(s['reused_files'])} finished shard(s)" if s["reused_files"] else "")
    )
    for w in s.get("warnings", []):
        click.echo(f"warning: {w}", err=True)
    _warn_rotation(fmt, rotate)


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS), case_sensitive=False), required=True,
              help="Target convention: compressed-tensors or modelopt (fp4convert re-shards).")
@_output_options
@_push_options
@_library_errors
def export(src, dst, fmt, max_shard_size, overwrite, resume, verify_source, quiet, as_json, push_repo,
           private, token) -> None:
    """Re-layout a native fp4convert checkpoint SRC into an engine format in DST (lossless, no source weights).

    \b
    Example:
      fp4convert export qwen3-native qwen3-ct --format compressed-tensors
    """
    from fp4convert.checkpoint.export import export as run_export

    config = ConvertConfig(format=fmt, max_shard_size=parse_size(max_shard_size), overwrite=overwrite, resume=resume,
                           verify_source=verify_source)
    if _rank() > 0:
        quiet, as_json = True, False
    _setup_logging(quiet, status=not as_json)
    with _progress(0, "export", quiet or as_json) as bar:
        result = run_export(src, dst, config, bar=bar)
    if _rank() > 0:
        return
    if push_repo:
        _push(dst, push_repo, private, token, quiet)
    s = result.to_json()
    rotate = result.plan.config.rotate
    if as_json:
        _warn_rotation(fmt, rotate, s.setdefault("warnings", []))
        click.echo(json.dumps(s, indent=2))
        return
    if not quiet:
        click.echo(f"{dst}: {s['quantized']} quantized weights and {s['kept']} other tensors as {fmt}, "
                   f"{human_bytes(s['bytes_out'])} in {s['shards_out']} shard(s); {s['wall_s']:.1f} s")
    _warn_rotation(fmt, rotate)


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.argument("repo")
@click.option("--private", is_flag=True, help="Create the repo private.")
@token_option
@quiet_option
@_library_errors
def push(folder, repo, private, token, quiet) -> None:
    """Upload a finished output FOLDER to Hub repo REPO (rerun after an interruption: only what is missing goes).

    \b
    Example:
      fp4convert push qwen3-ct my-org/Qwen3-8B-NVFP4 --private
    """
    _setup_logging(quiet)
    _push(folder, repo, private, token, quiet)


def _print_plan(plan, quiet: bool = False) -> None:
    from fp4convert.run.runner import plan_warnings

    s = plan.summary()
    width = max((len(d.name) for d in plan.decisions), default=10)
    dtypes = [d.info.dtype if d.action != "keep" or d.outputs[0].dtype == d.info.dtype
              else f"{d.info.dtype}->{d.outputs[0].dtype}" for d in plan.decisions]  # --kept-dtype bf16: F32->BF16
    dw = max([5, *(len(t) for t in dtypes if "->" in t)])
    for d, dtype in zip(plan.decisions, dtypes):
        shape = "x".join(map(str, d.info.shape))
        click.echo(f"{d.action:<8} {d.name:<{width}}  {dtype:<{dw}} {shape:<12} {d.reason}")
    for w in [] if quiet else plan_warnings(plan):
        click.echo(f"warning: {w}", err=True)
    click.echo(
        f"\n{s['quantized']} to quantize ({s['fused_groups']} fused groups), {s['kept']} to keep; "
        f"{human_bytes(s['bytes_in'])} -> {human_bytes(s['bytes_out'])} projected in {s['shards_out']} shard(s); "
        f"{s['bits_per_param']} bits/param ({s['bits_per_param_quantized']} in quantized layers)"
    )


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("checkpoint")
@click.option("--check-files", is_flag=True, help="Also read the data: sha256 against the manifest, every block scale.")
@click.option("--verify", "verify_src", metavar="SRC", default=None,
              help="Dequantize and compare with the original checkpoint SRC (after checking it is the one converted).")
@click.option("--max-error", type=float, default=None, show_default=False,
              help="With --verify: fail when a layer's relative error ||w - x|| / ||x|| exceeds this "
                   "[default: 0.25; NVFP4 gives ~0.09-0.10, MXFP4 ~0.11-0.15, a wrong source ~1.4].")
@click.option("--plot", "plot_path", metavar="FILE", default=None,
              help="With --verify: write a per-layer error chart (FILE.png needs matplotlib; else an HTML report).")
@revision_option
@token_option
@json_option
@quiet_option
@_library_errors
def inspect(checkpoint, check_files, verify_src, max_error, plot_path, revision, token, as_json, quiet) -> None:
    """Check a quantized CHECKPOINT (folder or Hub repo id) and give a verdict (exit 0 only when it is OK).

    Reads headers, configs and global scales by default; --check-files reads all data; --verify SRC
    compares every dequantized weight with the source (the report is printed even with --quiet).

    \b
    Example:
      fp4convert inspect qwen3-nvfp4 --check-files --verify Qwen/Qwen3-8B
    """
    if plot_path and not verify_src:
        raise click.UsageError("--plot needs --verify SRC")
    from fp4convert.checkpoint.inspect import DEFAULT_MAX_ERROR, inspect_checkpoint, render, write_plot

    long = check_files or verify_src  # reads every byte: a bar (nothing with --json or --quiet)
    with _progress(0, "inspect", quiet or as_json or not long) as bar:
        report = inspect_checkpoint(checkpoint, check_files=check_files, verify=verify_src, revision=revision,
                                    max_error=DEFAULT_MAX_ERROR if max_error is None else max_error, token=token,
                                    progress=None if isinstance(bar, _NoProgress) else bar)
    if plot_path:
        try:
            written = write_plot(report, plot_path)
            report["plot"] = written
            if written != plot_path:
                click.echo(f"matplotlib is not installed: wrote {written} instead of {plot_path}", err=True)
        except ValueError as exc:
            click.echo(f"no plot: {exc}", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        for line in render(report):
            click.echo(line)
    if not report["ok"]:
        sys.exit(InspectFailed.exit_code)
