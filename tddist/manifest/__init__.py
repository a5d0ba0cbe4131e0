"""The manifest: its model, every format version's parser, its checksum, rank 0's merge and chunk location.

``model`` is the in-memory manifest (leaves, chunks, objects, nodes);
``v1`` and ``v2`` parse the versions' bodies and ``v2`` encodes the current
one; ``parse`` reads any version from JSON and index bytes; ``checksum``
seals and checks it; ``merge`` builds it from the ranks' fragments on
rank 0; ``chunks`` and ``locate`` turn its columns into where each chunk's
bytes lie. Nothing here reads or writes a file.

May import: ``tddist.core``, ``tddist.errors``, ``tddist.format``,
``tddist.checksum``. Never storage, communication, saving or loading.
"""
