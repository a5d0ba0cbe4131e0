"""Tools over committed checkpoints: ``verify`` (every chunk against its checksum), ``diff`` (two
checkpoints compared) and ``pack`` (a directory into one ``.tdz`` archive and back).

May import: ``tddist.loading``, ``tddist.storage``, ``tddist.manifest``,
``tddist.core`` and the ground floor. Never ``tddist.jobs`` nor
``tddist.api``.
"""
