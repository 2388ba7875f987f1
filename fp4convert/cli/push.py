"""``fp4convert push``: upload a finished output folder to the Hub."""

from __future__ import annotations

import click

from fp4convert.cli.common import library_errors, setup_logging
from fp4convert.cli.options import (
    EXIT_CODE_HELP,
    push_folder,
    quiet_option,
    token_option,
)


@click.command(epilog=EXIT_CODE_HELP)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.argument("repo")
@click.option("--private", is_flag=True, help="Create the repo private.")
@token_option
@quiet_option
@library_errors
def push(folder, repo, private, token, quiet) -> None:
    """Upload a finished output FOLDER to Hub repo REPO (rerun after an interruption: only what is missing goes).

    \b
    Example:
      fp4convert push qwen3-ct my-org/Qwen3-8B-NVFP4 --private
    """
    setup_logging(quiet)
    push_folder(folder, repo, private, token, quiet)
