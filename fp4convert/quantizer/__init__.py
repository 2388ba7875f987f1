"""Quantizing a run's work: the backend seam, the items a backend takes, and the backends themselves.

:mod:`.backend` is the seam (one :class:`~.backend.Backend` protocol, one :class:`~.backend.Result`);
:mod:`.items` turns a part's work units into the batches and complex items a backend quantizes;
:mod:`.matrices` holds the torch helpers of the torch backends; :mod:`.backends` has one module per
``--backend``.
"""
