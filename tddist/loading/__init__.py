"""The path of a load: open one generation, choose each rank's share, read the boxes, fill or build.

``pipeline`` opens the checkpoint on every rank and reads it; ``share``
turns ``shard=`` into the box each rank reads; ``read`` reads boxes of
chunks through the opened checkpoint's ``storage.base.ChunkFiles``;
``into`` fills an existing TensorDict in place; ``per_rank`` resolves
per-rank state saved by another world size.

May import: ``tddist.core``, ``tddist.manifest``, ``tddist.comm``,
``tddist.storage`` and the ground floor. Never ``tddist.saving``.
"""
