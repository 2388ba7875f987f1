"""Writing a checkpoint safely: the passive end of a run (:mod:`fp4convert.runner` drives it).

One module per concept:

- :mod:`~fp4convert.writer.files`: every file created, opened, renamed or removed inside DST, contained
  (never through a symlink), and OS errors as one-line errors naming the file;
- :mod:`~fp4convert.writer.destination`: what a run may write into DST (refuse / ``--overwrite`` /
  ``--resume``, the space it needs) and the lock that makes it the only run there;
- :mod:`~fp4convert.writer.record`: the run's identity and each part's progress record (a shard is
  recorded with its checksum before its rename), merged, and what ``--resume`` may reuse;
- :mod:`~fp4convert.writer.shards`: the output shards, written where the plan put every byte;
- :mod:`~fp4convert.writer.finish`: the other files, the format's files, the index, the model card,
  and the manifest last (its presence means "finished").

Files are written as ``*.partial`` and renamed when complete. The names below are the ones other
modules use (``hub``, ``inspect``, ``export``).
"""

from __future__ import annotations

from .files import dst_dir, write_new, writing
from .record import run_identity, source_fingerprint

__all__ = ["dst_dir", "run_identity", "source_fingerprint", "write_new", "writing"]
