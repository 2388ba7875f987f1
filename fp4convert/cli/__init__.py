"""The ``fp4convert`` command line: thin click commands that parse options into frozen configs and call the library.
"""
