"""The pure core: types at the seams, box geometry, trees of leaves and structures.

Owns what every other wing shares and that touches no file, no process and
no communicator: the frozen dataclasses passed between modules (``types``),
boxes, placements and read planning (``sharding``), flattening and
rebuilding TensorDicts (``tree``) and the structure digest of a shard
(``structure``).

May import: ``tddist.errors``, ``tddist.format``, ``tddist._compat`` and
itself. Nothing else of tddist.
"""
