"""Training jobs: the checkpoint manager and what it stands on.

``manager`` (``CheckpointManager``: step directories, restore, preemption),
with ``options`` (its checked options), ``schedule`` (when it saves),
``restore`` (what it loads) and ``root_retention`` (what it deletes after a
save); ``retention`` (the rules), ``inventory`` (what a root holds) and
``cleanup`` (what to remove, offline), ``root_lock`` (one manager per root),
``preemption`` (signals), ``local_tier``, ``local_shards``, ``promotion``
and ``tiered`` (the node-local tier), ``state`` and ``train_state`` (model
and optimizer state).

May import: ``tddist.api`` and everything below it. Never ``tddist.tools``.
"""
