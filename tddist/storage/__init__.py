"""Where checkpoints live: the store of a prefix, its writer, its opened-checkpoint reader and its recovery.

``backends`` is the one place that maps a prefix (a directory, a ``.tdz``
archive, ``s3://bucket/key[.tdz]``) to its ``Store``; ``base`` holds the
protocols every store implements (``ShardWriter`` on the write side,
``Pin`` and ``ChunkFiles`` on the read side); ``directory`` and ``archive``
are the file-system stores (``writer`` and ``zipcodec`` their byte-level
code), ``pinned`` and ``opened`` open one generation, ``publish`` and
``recovery`` the renames of the commit and the clean-up of leftovers;
``s3`` the object-storage stores.

May import: ``tddist.core``, ``tddist.manifest`` and the ground floor. Never
``tddist.comm``, ``tddist.saving`` or ``tddist.loading``; only ``backends``
imports ``storage.s3``.
"""
