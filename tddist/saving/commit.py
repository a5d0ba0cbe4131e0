"""The two-phase commit that makes a multi-rank checkpoint appear atomically.

The commit drives a ``storage.base.ShardWriter`` (the store's writer: a
directory or an archive, on a file system or object storage) through two rounds in which rank 0 decides and every rank learns
the decision or the same error (``comm.decide_on_rank0``). Steps (the names in
brackets are the fault-injection points of ``_faults``):

1. Open. (all ranks) Prepare the local shard in memory (``plan``: for an
   archive, hash and compress the entries and size the region) and send the
   plan, or the error, to rank 0. (rank 0) Refuse plans that disagree on the
   target, container or atomicity; check the target (a file, a symbolic link or a
   foreign non-empty directory is refused, never deleted); create missing
   parent directories durably and the staging area beside the target, on the
   same file system, named ``.<target>.tddist-staging-<uuid>`` (a directory,
   or a file pre-sized for every rank's region); broadcast it, or the
   errors, so no rank waits forever.                                [prepare]
2. Write. (all ranks) Write the local shard into the staging area; every file
   and directory is fsynced (one ``syncfs`` instead when a rank writes many
   small files). The fragment, or the error, is the rank's vote.     [write]
3. Vote. (all ranks -> rank 0) Gather the votes.                      [vote]
4. Decide. (rank 0) Any failure: remove the staging area and decide ABORT
   with every failing rank's error. Otherwise merge and validate the
   fragments (they must tile every global tensor) [validate], write and fsync
   the manifest (for an archive: the manifest entry and the central
   directory) and fsync the staging directory [manifest], then publish: a
   ``rename`` onto an absent target, or a ``renameat2(RENAME_EXCHANGE)`` with
   an existing one, then fsync the parent directory. The rename is the commit
   point [replace, publish].
5. Announce. (rank 0 -> all) Broadcast the decision. Every rank returns only
   after COMMITTED, so a save that returned is durable.          [announce]
6. Retire. (rank 0) Remove the old checkpoint, now at the staging name
   [discard]; failing to remove it only warns (``recover`` removes it later).
   It follows the announcement, so no rank waits for it: a synchronous save
   does it before returning on rank 0, a ``return_early`` save on its worker
   after resolving the future (the next save on the channel waits for it).

Without RENAME_EXCHANGE the old checkpoint is first renamed to
``.<target>.tddist-backup-<uuid>``; ``recover`` puts it back if a crash struck
before the new one was in place (``publish.py``).

The fault-injection points in protocol order (``_faults``; "all" runs on
every rank, "0" on rank 0 only):

============  =====  ==========================================================
``begin``     all    before the first round (nothing staged yet)
``prepare``   0      the staging area exists, nothing written
``midwrite``  all    part of the rank's bytes written, none fsynced
                     (``writer.write_packed``, ``zipcodec.write_region``)
``write``     all    the rank's part is written and durable, not yet sent
``vote``      all    the votes reached rank 0 (after the gather)
``validate``  0      fragments merged and validated; before the manifest
``manifest``  0      manifest written, staging area fsynced; before publish
``backup``    0      without RENAME_EXCHANGE: between the two renames (the
                     old checkpoint is at the backup name, the target absent)
``renamed``   0      the commit rename done; before the parent's fsync
``replace``   0      the parent fsynced; the old copy not yet removed
``publish``   0      committed and durable; before the announcement
``discard``   0      part of the old copy (or of a staging area) removed
                     (``_fs.remove_tree``, before a file is unlinked): after
                     the announcement (or in an abort, before it)
``announce``  all    the decision received; before ``save`` returns
============  =====  ==========================================================

With ``atomic=False`` (directories only) the ranks write into the target
itself and the manifest is still written last, so an interrupted save leaves
a directory that readers refuse instead of misread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from .._faults import fault_point
from ..comm.base import Communicator
from ..comm.collective import contribute, decide_on_rank0
from ..core.types import Fragment, ManifestFiles, SavePlan, Staging, Structure
from ..errors import CommError, InvalidArgumentError, TargetError
from ..manifest import checksum
from ..storage.base import ShardWriter

ManifestBuilder = Callable[[list[Fragment], Structure], ManifestFiles]


#: Runs a clean-up of a committed save: at once (a synchronous save) or later (``background.Worker.defer``).
Retire = Callable[[Callable[[], None]], None]


def two_phase_commit(
    comm: Communicator,
    writer: ShardWriter,
    build_manifest: ManifestBuilder,
    retire: Retire | None = None,
    on_staged: Callable[[Staging], None] | None = None,
) -> str:
    """Run the protocol above; return on every rank, once it is committed, the generation rank 0 published.

    ``build_manifest(fragments, structure)`` (rank 0): the manifest's files. ``on_staged(staging)`` runs on
    every rank before it writes (its failure is the rank's vote). ``writer.retirement()`` removes the
    replaced checkpoint after the announcement, at once or via ``retire`` (a ``return_early`` save's
    worker). Raises the same error on every rank otherwise.
    """
    what, rank = f"save to {writer.target!r}", comm.rank
    fault_point("begin", rank)
    staging: Staging = decide_on_rank0(comm, what, lambda plans: _open(writer, plans), contribute(writer.plan))
    vote = contribute(lambda: _write(writer, staging, rank, on_staged))
    committed: list[bool] = []
    try:
        generation: str = decide_on_rank0(
            comm,
            what,
            lambda fragments: _decide(writer, staging, fragments, build_manifest, committed),
            vote,
            after_gather=lambda: fault_point("vote", rank),
            on_failure=lambda: writer.abort(staging),
        )
    except CommError as e:
        if committed:  # rank 0 knows better than the generic advice
            raise _committed_untold(e, writer.target) from e
        raise
    finally:
        removal = writer.retirement() if committed else None
        if removal is not None:
            (retire or _at_once)(removal)
    fault_point("announce", rank)
    return generation


def _committed_untold(e: CommError, target: str) -> CommError:
    """Rank 0's transport error of the decision round when it had committed: it says so."""
    return type(e)(
        f"{e}\nrank 0 had already committed {target!r}: it holds the new checkpoint, but not every rank could be told"
    )


def _at_once(clean_up: Callable[[], None]) -> None:
    clean_up()


def _open(writer: ShardWriter, plans: list[SavePlan]) -> Staging:
    """(rank 0) Step 1: compare the plans, then check the target and create the staging area.

    When a rank's structure digest differs from rank 0's, the staging area
    carries rank 0's structure, so that rank can say what differs (and vote no).
    """
    _check_plans(plans)
    try:
        staging = writer.open(plans)
    except OSError as e:
        raise TargetError(f"cannot prepare a save to {writer.target!r}: {e} (the target was left untouched)") from e
    if any(p.digest != plans[0].digest for p in plans):
        staging = replace(staging, reference=plans[0].structure)
    try:
        fault_point("prepare", 0)
    except BaseException:
        writer.abort(staging)
        raise
    return staging


def _check_plans(plans: list[SavePlan]) -> None:
    """Every rank must save to the same target, in the same container, packing and mode."""
    first = plans[0]
    for r, p in enumerate(plans):
        for name in ("target", "container", "atomic", "packing"):
            if getattr(p, name) != getattr(first, name):
                shown = "layout" if name == "container" else name  # the manifest's word for it
                raise InvalidArgumentError(
                    f"the ranks disagree on the save's {shown}: rank 0 has {getattr(first, name)!r}, rank {r} has "
                    f"{getattr(p, name)!r}; every rank must call save with the same path and options"
                )


def _write(writer: ShardWriter, staging: Staging, rank: int, on_staged: Callable[[Staging], None] | None) -> Fragment:
    """(all ranks) Step 2: this rank's vote."""
    if on_staged is not None:
        on_staged(staging)
    fragment = writer.write(staging)
    fault_point("write", rank)
    return fragment


def _decide(
    writer: ShardWriter, staging: Staging, fragments: list[Fragment], build: ManifestBuilder, committed: list[bool]
) -> str:
    """(rank 0) Step 4 when every rank voted yes: validate, write the manifest, publish; the generation."""
    structure = writer.structure
    assert structure is not None  # plan() set it
    manifest = build(fragments, structure)
    generation, _sealed = checksum.generation(manifest.manifest, f"the manifest of {writer.target!r}")
    fault_point("validate", 0)
    writer.finalize(staging, manifest, fragments)
    fault_point("manifest", 0)
    writer.publish(staging)
    fault_point("publish", 0)
    committed.append(True)
    return generation
