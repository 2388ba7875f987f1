"""The package version (one place; pyproject.toml reads it)."""

__version__ = "0.1.0"


def producer() -> dict[str, str]:
    """How fp4convert names itself in the files it writes (manifest, configs)."""
    return {"name": "fp4convert", "version": __version__}
