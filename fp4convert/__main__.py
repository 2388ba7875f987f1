"""``python -m fp4convert`` (and ``torchrun ... -m fp4convert``): the same command line as ``fp4convert``."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main(prog_name="fp4convert")
