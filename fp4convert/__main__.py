"""``python -m fp4convert`` is the ``fp4convert`` command."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main()
