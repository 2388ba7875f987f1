"""Bytes on disk, below any conversion: the safetensors format, file checksums, and the names of the files we write.

Torch-free and model-free: the source, the writer and ``inspect`` all read and write through here.
"""
