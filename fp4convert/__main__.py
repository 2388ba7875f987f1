"""``python -m fp4convert`` (and ``torchrun ... -m fp4convert``): the same command line as ``fp4convert``."""

from __future__ import annotations

from fp4convert.cli.main import entry

if __name__ == "__main__":
    entry()
