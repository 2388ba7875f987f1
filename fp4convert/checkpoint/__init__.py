"""A converted checkpoint after the fact: recognise its layout, inspect and verify it, export it, push it.

Nothing here quantizes: :mod:`.layout` reads a checkpoint back, :mod:`.inspect` checks it and gives a
verdict, :mod:`.export` re-lays a native checkpoint into an engine format, :mod:`.push` publishes one.
"""
