"""Writing a checkpoint safely: the passive end of a run (:mod:`fp4convert.run.runner` drives it).

One module per concept:

- :mod:`~fp4convert.output.files`: every file created, opened, renamed or removed inside DST, contained
  (never through a symlink), and OS errors as one-line errors naming the file;
- :mod:`~fp4convert.output.destination`: what a run may write into DST (refuse / ``--overwrite`` /
  ``--resume``, the space it needs) and the lock that makes it the only run there;
- :mod:`~fp4convert.output.record`: the run's identity and each part's progress record (a shard is
  recorded with its checksum before its rename), merged, and what ``--resume`` may reuse;
- :mod:`~fp4convert.output.shards`: the output shards, written where the plan put every byte;
- :mod:`~fp4convert.output.finish`: the other files, the format's files, the index, the model card,
  and the manifest last (its presence means "finished").

- :mod:`~fp4convert.output.manifest`: the manifest ``fp4convert.json`` (every decision, the settings, checksums);
- :mod:`~fp4convert.output.card`: the model card.

Files are written as ``*.partial`` and renamed when complete.
"""
