"""Planning: what happens to every tensor, decided from headers and the model's definition before any data is read.

:mod:`.types` holds the shared types every later stage reads (:class:`~.types.Decision`, :class:`~.types.Matrix`);
:mod:`.definition` builds the model on ``meta`` with transformers and reads each tensor's role;
:mod:`.families` holds what the definition does not say (fused groups, expert layouts);
:mod:`.planner` makes the :class:`~.planner.Plan`.
"""
