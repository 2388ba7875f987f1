"""``fp4convert inspect``: check a quantized checkpoint and give a verdict."""

from __future__ import annotations

import json
import sys

import click

from fp4convert.cli.common import library_errors
from fp4convert.cli.options import (
    EXIT_CODE_HELP,
    json_option,
    quiet_option,
    revision_option,
    token_option,
)
from fp4convert.errors import InspectFailed


@click.command(epilog=EXIT_CODE_HELP)
@click.argument("checkpoint")
@click.option("--check-files", is_flag=True, help="Also read the data: sha256 against the manifest, every block scale.")
@click.option("--verify", "verify_src", metavar="SRC", default=None,
              help="Dequantize and compare with the original checkpoint SRC (after checking it is the one converted).")
@click.option("--max-error", type=click.FloatRange(min=0.0, min_open=True), default=None, show_default=False,
              help="With --verify: fail when a layer's relative error ||w - x|| / ||x|| exceeds this [default for "
                   "round-to-nearest output: 0.25; NVFP4 gives ~0.09-0.10, MXFP4 ~0.11-0.15, a wrong source ~1.4]. "
                   "Given, it judges any output (a calibrated one too).")
@click.option("--max-ratio", type=click.FloatRange(min=0.0, min_open=True), default=None, show_default=False,
              help="With --verify: fail when a layer's relative error exceeds this many times round-to-nearest's on "
                   "the same weights (recomputed from SRC) [default for a calibrated method's output: GPTQ 2.5, "
                   "GPTQ W4A4 5.0; GPTQ's worst layers measured 1.8 and 3.6, a layer from the wrong tensor 12-17, "
                   "one twice its source 5.6-6.7; docs/numerics.md]. Given, it judges any output.")
@click.option("--plot", "plot_path", metavar="FILE", default=None,
              help="With --verify: write a per-layer error chart (FILE.png needs matplotlib; else an HTML report).")
@revision_option
@token_option
@json_option
@quiet_option
@library_errors
def inspect(checkpoint, check_files, verify_src, max_error, max_ratio, plot_path, revision, token, as_json,
            quiet) -> None:
    """Check a quantized CHECKPOINT (folder or Hub repo id) and give a verdict (exit 0 only when it is OK).

    Reads headers, configs and global scales by default; --check-files reads all data; --verify SRC
    compares every dequantized weight with the source: round-to-nearest output by its error (--max-error),
    a calibrated method's (GPTQ) by its error over round-to-nearest's on the same weights (--max-ratio).

    \b
    Example:
      fp4convert inspect qwen3-nvfp4 --check-files --verify Qwen/Qwen3-8B
    """
    if plot_path and not verify_src:
        raise click.UsageError("--plot needs --verify SRC")
    if (max_error is not None or max_ratio is not None) and not verify_src:
        raise click.UsageError("--max-error and --max-ratio judge --verify: give --verify SRC")
    from fp4convert.checkpoint.inspect import inspect_checkpoint
    from fp4convert.checkpoint.render import render, render_errors, write_plot

    long = check_files or verify_src  # reads every byte: a bar (nothing with --json or --quiet)
    report = inspect_checkpoint(checkpoint, check_files=check_files, verify=verify_src, revision=revision,
                                max_error=max_error, max_ratio=max_ratio, token=token,
                                progress=bool(long) and not (quiet or as_json))
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
    elif quiet:  # errors only (--verify's failing layers are named in the problems)
        for line in render_errors(report):
            click.echo(line, err=True)
    else:
        for line in render(report):
            click.echo(line)
    if not report["ok"]:
        sys.exit(InspectFailed.exit_code)
