"""``fp4convert export``: re-layout a native checkpoint into an engine format."""

from __future__ import annotations

import json
import time

import click

from fp4convert.cli.common import (
    command_over,
    interrupted_after,
    library_errors,
    program_seconds,
    rank,
    setup_logging,
    warn_serving,
)
from fp4convert.cli.options import (
    EXIT_CODE_HELP,
    output_options,
    push_folder,
    push_options,
)
from fp4convert.config import ConvertConfig, human_bytes, parse_size
from fp4convert.formats import OUTPUT_FORMATS
from fp4convert.output.describe import loading_hint


@click.command(epilog=EXIT_CODE_HELP)
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@click.option("--format", "fmt", type=click.Choice(list(OUTPUT_FORMATS), case_sensitive=False), required=True,
              help="Target convention: compressed-tensors or modelopt (fp4convert re-shards).")
@output_options
@push_options
@library_errors
def export(src, dst, fmt, max_shard_size, overwrite, resume, verify_source, quiet, as_json, push_repo,
           private, token) -> None:
    """Re-layout a native fp4convert checkpoint SRC into an engine format in DST (lossless, no source weights).

    \b
    Example:
      fp4convert export qwen3-native qwen3-ct --format compressed-tensors
    """
    started = time.monotonic()
    from fp4convert.checkpoint.export import export as run_export

    config = ConvertConfig(format=fmt, max_shard_size=parse_size(max_shard_size), overwrite=overwrite, resume=resume,
                           verify_source=verify_source)
    if rank() > 0:
        quiet, as_json = True, False
    setup_logging(quiet, status=not as_json)
    result = run_export(src, dst, config, progress=not (quiet or as_json))
    if rank() > 0:
        return
    try:  # the export is complete: a Ctrl-C from here on says so
        if push_repo:
            push_folder(dst, push_repo, private, token, quiet)
        command_over()  # only the summary is left: a Ctrl-C now would stop nothing
        _report(result, dst, fmt, quiet, as_json, program_seconds(started))
    except KeyboardInterrupt:
        from fp4convert.errors import Interrupted

        raise Interrupted(interrupted_after(dst, push_repo)) from None


def _report(result, dst: str, fmt: str, quiet: bool, as_json: bool, seconds: float) -> None:
    s = result.to_json()
    rotate = result.plan.config.rotate
    if as_json:
        warn_serving(fmt, rotate, s.setdefault("warnings", []))
        click.echo(json.dumps(s, indent=2))
        return
    if not quiet:
        click.echo(f"{dst}: {s['quantized']} quantized weights and {s['kept']} other tensors as {fmt}, "
                   f"{human_bytes(s['bytes_out'])} in {s['shards_out']} shard(s); {seconds:.1f} s")
        click.echo(loading_hint(fmt, result.plan.config.scheme, dst))
    warn_serving(fmt, rotate)
