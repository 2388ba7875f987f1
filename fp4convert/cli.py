"""The ``fp4convert`` command line (a thin click layer over the library)."""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fp4convert")
def main() -> None:
    """Convert safetensors checkpoints to NVFP4 / MXFP4."""
