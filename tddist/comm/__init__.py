"""Communicators: the ``Communicator`` protocol, its transports and the collective step every save uses.

``base`` is the protocol and the in-process communicators, ``collective``
the "every rank ends the same way" primitives, ``resolve`` detects the
communicator of a job, ``gloo`` runs tddist's private torch.distributed
group, ``mpi`` a ``Dup()`` of an mpi4py communicator, ``threads`` the
thread ranks used by tests and examples.

May import: ``tddist.core``, ``tddist.errors``, ``tddist._compat``. Never
storage, manifests, saving or loading.
"""
