"""Deleting a Hub source's cached shards once the run has read them (``--delete-source-shards``).

The plan fixes the order of the work units, so the last unit that reads each shard is known before the
run starts; the run loop (:mod:`fp4convert.run.runner`) tells :class:`ShardReleaser` each unit it has
finished (its writes and every write before them done), by the unit's position in ``plan.units()``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fp4convert.errors import ConfigError

if TYPE_CHECKING:
    from fp4convert.plan.planner import Plan
    from fp4convert.source.source import Source

log = logging.getLogger(__name__)


def _files_read(unit) -> set[str]:
    """Every shard a work unit reads: its tensors' and what decoding them reads (an FP8 weight's scale
    may sit in another shard), so a shard is released only after the last unit that reads it."""
    return {t.file for d in unit for t in d.reads}


class ShardReleaser:
    """Deletes each cached Hub shard once the last work unit that reads it is finished.

    The run loop calls :meth:`unit_done` for every unit of ``plan.units()`` (a resume's skipped units
    included), each once its writes and every earlier write are done, which is what makes a shard's
    last unit its last read.
    """

    def __init__(self, source: Source, plan: Plan) -> None:
        if not source.is_hub:
            raise ConfigError("--delete-source-shards applies to Hub sources (it cleans the HF cache); "
                              "fp4convert never deletes a local folder's files")
        self.source = source
        self.units = plan.units()
        self.last: dict[str, int] = {}
        for i, unit in enumerate(self.units):
            for f in _files_read(unit):
                self.last[f] = i
        self.deleted: list[str] = []

    def unit_done(self, index: int) -> None:
        """Unit ``index`` of ``plan.units()`` is finished: remove the shards it was the last to read."""
        for f in sorted(_files_read(self.units[index])):
            if self.last.get(f) == index:
                self.release(f)

    def release(self, file: str) -> None:
        """Remove one shard (its blob and its snapshot link) from the HF cache, if it is there."""
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(self.source.repo_id, file, cache_dir=self.source.cache_dir,
                                        revision=self.source.commit)
        if not isinstance(cached, str):
            return
        link = Path(cached)
        blob = link.resolve()
        if not any(str(blob).startswith(r.rstrip(os.sep) + os.sep) for r in self.source.roots):
            log.warning("warning: %s resolves to %s, outside the repo's cache folder; not removed", file, blob)
            return
        for p in {link, blob}:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        self.deleted.append(file)
        log.info("removed %s from the HF cache", file)
