"""The path of a save: prepare the shard, snapshot it, write it, commit it, open what was committed.

``pipeline`` names these steps in order, for synchronous and
``return_early`` saves alike; ``prepare`` flattens the user's data into a
``LocalShard``; ``snapshot``, ``stream`` and ``background`` copy it and run
the commit on a worker thread; ``writer_process`` and ``writer_main`` run it
in a writer process instead; ``commit`` is the two-phase protocol over a
``storage.base.ShardWriter``.

May import: ``tddist.core``, ``tddist.manifest``, ``tddist.comm``,
``tddist.storage`` (through ``storage.backends`` for the choice of store),
``tddist.loading`` (to open what a save committed), and the ground floor.
Never ``tddist.api``.
"""
