"""``fp4convert quantize``: convert a checkpoint (or print its plan with ``--dry-run``)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import click

from fp4convert.cli.common import (
    command_over,
    interrupted_after,
    library_errors,
    log,
    program_seconds,
    rank,
    setup_logging,
    warn_serving,
)
from fp4convert.cli.options import (
    EXIT_CODE_HELP,
    SCALE_RULES,
    activation_options,
    backend_help,
    kept_dtype_option,
    method_options,
    output_options,
    push_folder,
    push_options,
    revision_option,
    scale_rule_help,
)
from fp4convert.config import ConvertConfig, human_bytes, parse_size
from fp4convert.formats import DEFAULT_FORMAT, OUTPUT_FORMATS
from fp4convert.numerics.scheme import ROTATIONS, SCHEMES
from fp4convert.output.describe import loading_hint, run_note
from fp4convert.quantizer.backend import backend_names


@click.command(epilog=EXIT_CODE_HELP)
@click.argument("src")
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--scheme", type=click.Choice(list(SCHEMES), case_sensitive=False), default="nvfp4", show_default=True, help="FP4 scheme.")
@click.option("--rotate", type=click.Choice(list(ROTATIONS), case_sensitive=False), default=None,
              help="Rotate weights with a 16-point Hadamard first. Meant for W4A4 serving (activations quantized "
                   "too); weight-only it raised NVFP4's next-token KL 1.2-1.8x on the model measured (BENCHMARKS.md).")
@click.option("--scale-rule", type=click.Choice(SCALE_RULES, case_sensitive=False), default=None,
              help=scale_rule_help())
@click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS), case_sensitive=False), default=DEFAULT_FORMAT,
              show_default=True,
              help="On-disk convention: fp4convert (native, swizzled scales; export it for engines), "
                   "compressed-tensors (vLLM, transformers) or modelopt (vLLM/SGLang/TensorRT-LLM, NVFP4).")
@click.option("--device", default="auto", show_default=True,
              help="auto (a GPU if its kernels load, else the CPU), cpu, cuda or cuda:N.")
@click.option("--lanes", type=click.IntRange(min=0), default=0, show_default=True,
              help="Write this many output shards side by side in one process (0: the backend's choice, 2 for "
                   "cuda, 1 otherwise). The output bytes do not depend on it.")
@click.option("--backend", type=click.Choice(backend_names()), default=None, help=backend_help())
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
@click.option("--requantize", is_flag=True,
              help="An FP4 SRC (NVFP4/MXFP4: fp4convert's, compressed-tensors', ModelOpt's) is re-laid into --format "
                   "bit for bit by default; with this, its exactly decoded weights are quantized again instead.")
@kept_dtype_option
@output_options
@push_options
@method_options
@activation_options
@library_errors
def quantize(src: str, dst: str, **options) -> None:
    """Quantize checkpoint SRC (a local folder or a Hub repo id) into folder DST.

    \b
    Example:
      fp4convert quantize Qwen/Qwen3-8B qwen3-nvfp4 --format compressed-tensors
    """
    from fp4convert import timing

    ages = {"cli_start": timing.process_age()}  # where a run's seconds outside convert() go (--json)
    started = time.monotonic()
    from fp4convert.run.convert import start_early
    from fp4convert.source.open import open_source

    config = config_from_options(options)
    out = Voice.of(options)
    if options["delete_source_shards"] and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        from fp4convert.errors import ConfigError

        raise ConfigError("--delete-source-shards cannot be used under torchrun (another rank may still read a "
                          "shard); convert with one process, or keep the source shards")
    setup_logging(out.quiet, status=not out.as_json)
    if not options["dry_run"]:
        start_early(config)  # the GPU starts while the source is opened and planned
    source = open_source(src, config.revision, token=options["token"], cache_dir=options["cache_dir"])
    result = _plan_and_convert(source, dst, config, options, out, ages)
    if result is None or rank() > 0:
        return
    try:  # the conversion is complete: a Ctrl-C from here on says so
        if options["push_repo"]:
            push_folder(dst, options["push_repo"], options["private"], options["token"], out.quiet)
        command_over()  # only the summary is left: a Ctrl-C now would stop nothing
        ages["summary"] = timing.process_age()
        _report(result, dst, config, out, ages, program_seconds(started))
    except KeyboardInterrupt:
        from fp4convert.errors import Interrupted

        raise Interrupted(interrupted_after(dst, options["push_repo"])) from None


def config_from_options(options: dict) -> ConvertConfig:
    """The command line's options as the frozen settings of the run (what the library takes)."""
    return ConvertConfig(
        scheme=options["scheme"], rotate=options["rotate"], scale_rule=options["scale_rule"], format=options["fmt"],
        ignore=tuple(options["ignore"]), only=tuple(options["only"]),
        max_shard_size=parse_size(options["max_shard_size"]), device=options["device"],
        overwrite=options["overwrite"], resume=options["resume"], revision=options["revision"],
        verify_source=options["verify_source"], lanes=options["lanes"], backend=options["backend"],
        allow_no_config=options["allow_no_config"], base_model=options["base_model"],
        kept_dtype=options["kept_dtype"], **options["activation"], **options["rounding"],
    )


@dataclass(frozen=True)
class Voice:
    """What this process prints: ``quiet`` (errors only), ``as_json`` (the result on stdout), ``plan`` (a
    dry run's plan). Under torchrun only rank 0 speaks; the others report their own errors only."""

    quiet: bool
    as_json: bool
    plan: bool = True

    @classmethod
    def of(cls, options: dict) -> Voice:
        if rank() > 0:
            return cls(True, False, False)
        return cls(options["quiet"], options["as_json"])


def _plan_and_convert(source, dst: str, config: ConvertConfig, options: dict, out: Voice, ages: dict):
    """Plan, then print the plan (``--dry-run``: None) or convert (the result)."""
    from fp4convert import timing
    from fp4convert.checkpoint.export import plan_relayout, relayout
    from fp4convert.errors import PlanError
    from fp4convert.run.convert import convert, plan_conversion
    from fp4convert.run.runner import plan_warnings

    # An FP4 source is re-laid, not quantized again (issue 44; fp4convert.checkpoint.export), unless --requantize.
    requantize = options["requantize"]
    relaid = None if requantize else plan_relayout(source, config)
    planned = relaid or plan_conversion(source, config, fetch_ahead=not options["dry_run"], requantize=requantize)
    try:  # a Hub source is downloading since planning: stopped on any refusal before convert() owns it
        plan = planned[1]
        nothing = plan.summary()["quantized"] == 0 and not options["allow_nothing_quantized"]
        if options["dry_run"]:
            _dry_run(plan, config, out, nothing)
            return None
        if nothing:
            for w in plan_warnings(plan):
                log.warning("warning: %s", w)
            raise PlanError("the plan quantizes no tensor: check --only / --ignore and the layer names "
                            "(--dry-run shows every decision); --allow-nothing-quantized writes the copy anyway")
        ages["convert_start"] = timing.process_age()
        progress, delete = not (out.quiet or out.as_json), options["delete_source_shards"]
        if relaid is not None:
            return relayout(relaid, dst, progress=progress, delete_source_shards=delete)
        return convert(source, dst, config, progress=progress, delete_source_shards=delete, plan=planned)
    except BaseException:
        source.stop_prefetch()
        raise


def _dry_run(plan, config: ConvertConfig, out: Voice, nothing: bool) -> None:
    from fp4convert.errors import PlanError

    if not out.plan:
        return
    if out.as_json:
        click.echo(json.dumps(plan.to_json(), indent=2))
    else:
        print_plan(plan, out.quiet)
        print_calibration(plan, config)
    warn_serving(config.format, config.rotate)
    if nothing:
        raise PlanError("the plan quantizes no tensor (see the warnings); pass --allow-nothing-quantized "
                        "to write an unquantized copy anyway")


def _report(result, dst: str, config: ConvertConfig, out: Voice, ages: dict, seconds: float) -> None:
    """The run's summary: --json's object, or one line and how to load what was written (nothing with -q
    but the serving warning)."""
    s = result.to_json()
    if out.as_json:
        warn_serving(config.format, config.rotate, s.setdefault("warnings", []))
        if None not in ages.values():
            s["process_s"] = {k: round(v, 3) for k, v in ages.items()}
        click.echo(json.dumps(s, indent=2))
        return
    if out.quiet:
        warn_serving(config.format, config.rotate)
        return
    click.echo(
        f"{dst}: {s['quantized']} tensors quantized ({config.scheme}{', had16' if config.rotate else ''}"
        f"{run_note(config.activations, config.activation_scale)}), {s['kept']} kept; "
        f"{human_bytes(s['bytes_in'])} -> {human_bytes(s['bytes_out'])} in {s['shards_out']} shard(s), "
        f"{s['bits_per_param']} bits/param ({s['bits_per_param_quantized']} in quantized layers); "
        f"{seconds:.1f} s, peak memory {human_bytes(s['peak_rss_bytes'])}"
        + (f"; reused {len(s['reused_files'])} finished shard(s)" if s["reused_files"] else "")
    )
    click.echo(loading_hint(config.format, config.scheme, dst))
    for w in s.get("warnings", []):
        click.echo(f"warning: {w}", err=True)
    warn_serving(config.format, config.rotate)


def print_plan(plan, quiet: bool = False) -> None:
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


def print_calibration(plan, config: ConvertConfig) -> None:
    """A dry run of a calibrated recipe: what the calibration will do and a rough time (measured on this machine)."""
    cal = plan.calibration
    if cal is None or not cal.runs_model:
        return
    from fp4convert.calibrate.estimate import plan_lines

    device = config.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    for line in plan_lines(cal, plan, device):
        click.echo(f"calibration: {line}")

