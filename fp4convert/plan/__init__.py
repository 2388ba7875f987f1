"""Planning: what happens to every tensor, decided from headers and the model's definition before any data is read.

:mod:`.types` holds the shared types every later stage reads (:class:`~.types.Decision`, :class:`~.types.Matrix`);
:mod:`.definition` has the model's definition (:mod:`.roles`: what it says of each tensor), built in a child process
by :mod:`.model_build` (transformers builds the model on ``meta``) with :mod:`.role_rules`, :mod:`.fp4_loading` and
:mod:`.parts`; :mod:`.families` holds what the definition does not say (fused groups, expert layouts) and
:mod:`.name_roles` what a name alone says; :mod:`.knowledge` answers the planner from either; :mod:`.planner` makes
the :class:`~.planner.Plan`.
"""
