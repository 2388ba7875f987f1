"""The ``fp4convert`` command line: parses options into a frozen config and calls the library.

Library errors (``FP4ConvertError`` subclasses) become one-line messages with their class's exit
code (the table is ``fp4convert.errors.EXIT_CODES``, printed at the end of ``--help``).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from functools import wraps

import click
from tqdm import tqdm

from .config import ConvertConfig, parse_size
from .errors import EXIT_CODES, FP4ConvertError, InspectFailed, Interrupted, RankFailed
from .formats import OUTPUT_FORMATS
from .scheme import SCHEMES
from .version import __version__

log = logging.getLogger("fp4convert")


class _TqdmHandler(logging.Handler):
    """Log lines that do not tear the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def _setup_logging(quiet: bool) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    log.propagate = False


def _rank() -> int:
    """This process's rank under torchrun (0 otherwise): only rank 0 prints plans and summaries."""
    import os

    return int(os.environ.get("RANK", "0") or 0) if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 else 0


def _library_errors(fn: Callable) -> Callable:
    """FP4ConvertError -> 'Error: ...' on stderr and the error's exit code (no traceback)."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            exc = Interrupted("interrupted; finished shards are kept: run the same command with --resume to continue")
            click.echo(f"Error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except FP4ConvertError as exc:
            if not (isinstance(exc, RankFailed) and _rank() > 0):  # under torchrun rank 0 names the failing rank
                click.echo(f"Error: {exc}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def _output_options(fn: Callable) -> Callable:
    """The options every command that writes a checkpoint shares (quantize, export)."""
    for opt in reversed([
        click.option("--max-shard-size", default="5GB", show_default=True,
                     help="Largest output shard (e.g. 5GB, 500MB, 2GiB)."),
        click.option("--overwrite", is_flag=True, help="Replace the outputs of an earlier run in DST."),
        click.option("--resume", is_flag=True, help="Continue an interrupted run with the same settings."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar or status lines."),
        click.option("--json", "as_json", is_flag=True, help="Print the plan or the summary as JSON on stdout."),
    ]):
        fn = opt(fn)
    return fn


EXIT_CODE_HELP = "\b\nExit codes:\n" + "\n".join(f"  {code:>3}  {text}" for code, text in EXIT_CODES.items())


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


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
@click.option("--scheme", type=click.Choice(list(SCHEMES)), default="nvfp4", show_default=True, help="FP4 scheme.")
@click.option("--rotate", type=click.Choice(["had16"]), default=None, help="Rotate weights with a 16-point Hadamard first.")
@click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS)), default="fp4convert", show_default=True,
              help="On-disk convention: fp4convert (native, swizzled scales), compressed-tensors or modelopt.")
@click.option("--device", default="auto", show_default=True,
              help="auto (a GPU if its kernels load, else the CPU), cpu, cuda or cuda:N.")
@click.option("--ignore", multiple=True, metavar="PATTERN", help="Keep matching tensors unquantized (glob, or re:REGEX). Repeatable.")
@click.option("--only", multiple=True, metavar="PATTERN", help="Quantize only matching tensors (glob, or re:REGEX). Repeatable.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) when SRC is a repo id.")
@click.option("--dry-run", is_flag=True, help="Print the plan (decisions, sizes) and write nothing.")
@_output_options
@_library_errors
def quantize(src, dst, scheme, rotate, fmt, device, max_shard_size, ignore, only, revision, dry_run,
             overwrite, resume, quiet, as_json) -> None:
    """Quantize checkpoint SRC (a local folder or a Hub repo id) into folder DST."""
    from .convert import convert, plan_conversion

    config = ConvertConfig(
        scheme=scheme, rotate=rotate, format=fmt, ignore=tuple(ignore), only=tuple(only),
        max_shard_size=parse_size(max_shard_size), device=device, overwrite=overwrite, resume=resume,
        revision=revision,
    )
    if _rank() > 0:  # torchrun: one voice (rank 0); the others only report their own errors
        quiet, as_json, dry_run_out = True, False, False
    else:
        dry_run_out = True
    _setup_logging(quiet or as_json)
    planned = plan_conversion(src, config)
    plan = planned[1]
    if dry_run:
        if not dry_run_out:
            return
        if as_json:
            click.echo(json.dumps(plan.to_json(), indent=2))
        else:
            _print_plan(plan)
        return
    bar = tqdm(total=plan.summary()["bytes_in"], unit="B", unit_scale=True, desc="quantize",
               disable=quiet or as_json or not sys.stderr.isatty(), file=sys.stderr)
    with bar:
        result = convert(src, dst, config, progress=bar.update, plan=planned)
    if _rank() > 0:
        return
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    s = result.to_json()
    click.echo(
        f"{dst}: {s['quantized']} tensors quantized ({scheme}{', had16' if rotate else ''}), {s['kept']} kept; "
        f"{_human_bytes(s['bytes_in'])} -> {_human_bytes(s['bytes_out'])} in {s['shards_out']} shard(s), "
        f"{s['bits_per_param']} bits/param ({s['bits_per_param_quantized']} in quantized layers); "
        f"{s['wall_s']:.1f} s, peak memory {_human_bytes(s['peak_rss_bytes'])}"
        + (f"; reused {len(s['reused_files'])} finished shard(s)" if s["reused_files"] else "")
    )


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS)), required=True,
              help="Target convention: compressed-tensors or modelopt (fp4convert re-shards).")
@_output_options
@_library_errors
def export(src, dst, fmt, max_shard_size, overwrite, resume, quiet, as_json) -> None:
    """Re-layout a native fp4convert checkpoint SRC into an engine format in DST (lossless, no source weights)."""
    from .export import export as run_export

    config = ConvertConfig(format=fmt, max_shard_size=parse_size(max_shard_size), overwrite=overwrite, resume=resume)
    _setup_logging(quiet or as_json or _rank() > 0)
    result = run_export(src, dst, config)
    if _rank() > 0:
        return
    s = result.to_json()
    if as_json:
        click.echo(json.dumps(s, indent=2))
    else:
        click.echo(f"{dst}: {s['quantized']} quantized weights and {s['kept']} other tensors as {fmt}, "
                   f"{_human_bytes(s['bytes_out'])} in {s['shards_out']} shard(s); {s['wall_s']:.1f} s")


def _print_plan(plan) -> None:
    s = plan.summary()
    width = max((len(d.name) for d in plan.decisions), default=10)
    for d in plan.decisions:
        shape = "x".join(map(str, d.info.shape))
        click.echo(f"{d.action:<8} {d.name:<{width}}  {d.info.dtype:<5} {shape:<12} {d.reason}")
    for w in plan.warnings:
        click.echo(f"warning: {w}", err=True)
    click.echo(
        f"\n{s['quantized']} to quantize ({s['fused_groups']} fused groups), {s['kept']} to keep; "
        f"{_human_bytes(s['bytes_in'])} -> {_human_bytes(s['bytes_out'])} projected in {s['shards_out']} shard(s); "
        f"{s['bits_per_param']} bits/param ({s['bits_per_param_quantized']} in quantized layers)"
    )


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("checkpoint")
@click.option("--check-files", is_flag=True, help="Also read the data: sha256 against the manifest, every block scale.")
@click.option("--verify", "verify_src", metavar="SRC", default=None,
              help="Dequantize and compare with the original checkpoint SRC (relative error, SNR).")
@click.option("--revision", default=None, help="Hub revision when CHECKPOINT is a repo id.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_library_errors
def inspect(checkpoint, check_files, verify_src, revision, as_json) -> None:
    """Summarize and check a quantized CHECKPOINT (folder or Hub repo id); reads headers only by default."""
    from .inspect import inspect_checkpoint

    report = inspect_checkpoint(checkpoint, check_files=check_files, verify=verify_src, revision=revision)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    if not report["ok"]:
        sys.exit(InspectFailed.exit_code)


def _print_report(r: dict) -> None:
    click.echo(f"{r['path']}: format {r['format']}, scheme {r['scheme']}, rotation {r['rotate'] or 'none'}")
    click.echo(
        f"  {r['quantized']} quantized weights, {r['kept']} kept tensors, {r['fused_groups']} fused groups; "
        f"{_human_bytes(r['bytes'])}, {r['params']:,} params, {r['bits_per_param']} bits/param "
        f"({r['bits_per_param_quantized']} in quantized layers)"
    )
    click.echo(f"  {'layer':<28} {'quantized':>9} {'kept':>5} {'size':>10}")
    for name, row in r["layers"].items():
        click.echo(f"  {name:<28} {row['quantized']:>9} {row['kept']:>5} {_human_bytes(row['bytes']):>10}")
    checks = r["checks"]
    click.echo(f"  files: {checks['checksums']}; block scales {'checked' if checks['block_scales_checked'] else 'not read (use --check-files)'}")
    if "verify" in r:
        click.echo("  verify (dequantized vs source):")
        for m, v in r["verify"].items():
            if "error" in v:
                click.echo(f"    {m}: {v['error']}")
            else:
                click.echo(f"    {m:<44} rel.err {v['rel_error']:.4f}  SNR {v['snr_db']:.1f} dB")
    if checks["problems"]:
        click.echo(f"  {len(checks['problems'])} problem(s):")
        for p in checks["problems"]:
            click.echo(f"    - {p}")
    else:
        click.echo("  checks: OK")
