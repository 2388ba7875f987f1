"""Where a checkpoint comes from: a local folder or a Hugging Face Hub repo, read strictly and contained.

:mod:`.source` reads headers, the index and other files; :mod:`.prefetch` fetches Hub shards ahead of the
conversion; :mod:`.release` deletes a Hub source's cached shards once the run has read them.
"""
