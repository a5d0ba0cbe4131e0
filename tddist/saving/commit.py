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

One round: a writer that ``stages_alone`` (an atomic directory on a file
system) skips step 1 on every save after the first of its communicator:
every rank derives the staging path from rank 0's seed (learnt in the first
save's step 1) and a count (``_StagingNames``), creates it, writes, and sends
its plan with its vote (``StagedVote``); rank 0 checks the plans, the
structures and the target in step 4 (``ShardWriter.check_staged``) before it
writes the manifest. A save then makes two collectives: the votes and the
decision (docs/format.md, section 8.2.1, says why each one and each fsync is
needed).

Without RENAME_EXCHANGE the old checkpoint is first renamed to
``.<target>.tddist-backup-<uuid>``; ``recover`` puts it back if a crash struck
before the new one was in place (``publish.py``).

The fault-injection points in protocol order (``_faults``; "all" runs on
every rank, "0" on rank 0 only):

============  =====  ==========================================================
``begin``     all    before the first round (nothing staged yet)
``prepare``   0      the staging area exists, nothing written (one round:
                     nothing written by rank 0)
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

Beside the commit, an incremental save and a deletion (``storage/pins.py``)
have theirs: ``pin`` (all; rank 0 pinned the base and its holders, before
the rank reads the base), ``unpin`` (all; after ``publish``, the pins
removed), and, in a deletion (``roots.remove_checkpoint``, as rank 0),
``delete`` (the pins checked, before the rename), ``trash`` (the checkpoint
renamed to its trash name, before the second check) and ``untrash``
(renamed back, durably, for a pin or a reference).

With ``atomic=False`` (directories only) the ranks write into the target
itself and the manifest is still written last, so an interrupted save leaves
a directory that readers refuse instead of misread.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .. import format as fmt
from .._faults import fault_point
from ..comm.base import Communicator
from ..comm.collective import agree, contribute, decide_on_rank0
from ..core.structure import describe_difference
from ..core.types import Contribution, Fragment, ManifestFiles, SavePlan, StagedVote, Staging, Structure
from ..errors import CommError, InvalidArgumentError, ShardingError, TargetError
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
    share: Callable[[], Any] | None = None,
    wants_shared: bool = True,
    after_vote: Callable[[], None] | None = None,
) -> Published:
    """Run the protocol above; return on every rank, once it is committed, what rank 0 published.

    ``build_manifest(fragments, structure)`` (rank 0): the manifest's files. ``on_staged(staging)`` runs on
    every rank before it writes (its failure is the rank's vote). ``share()`` (rank 0, once the manifest is
    built, before it is written): a value every rank receives with the decision (``Published.shared``);
    in the one-round path rank 0 calls it only if some rank ``wants_shared`` (else every rank gets None).
    ``after_vote()``: see ``_decide_round``. ``writer.retirement()`` removes the replaced checkpoint after
    the announcement, at once or via ``retire`` (a ``return_early`` save's worker). Raises the same error on
    every rank otherwise.
    """
    what, rank = f"save to {writer.target!r}", comm.rank
    fault_point("begin", rank)
    names = _names_of(comm)
    committed: list[bool] = []
    try:
        staged = _stage_and_vote(comm, what, writer, names, on_staged, wants_shared)
        published = _decide_round(comm, what, writer, staged, _Build(build_manifest, share), committed, after_vote)
    except BaseException as e:
        if names is not None:
            names.forget()  # every rank ends the same way: the next save runs the first round again
        if committed and isinstance(e, CommError):  # rank 0 knows better than the generic advice
            raise _committed_untold(e, writer.target) from e
        raise
    finally:
        removal = writer.retirement() if committed else None
        if removal is not None:
            (retire or _at_once)(removal)
    fault_point("announce", rank)
    return published


@dataclass(frozen=True)
class Published:
    """What every rank learns of a committed save: the generation rank 0 published, and what it shared
    (``two_phase_commit``'s ``share``; None without one)."""

    generation: str
    shared: Any = None


@dataclass(frozen=True)
class _Build:
    """(rank 0) How the decision is built: the manifest's files, and what is shared with every rank."""

    manifest: ManifestBuilder
    share: Callable[[], Any] | None


@dataclass(frozen=True)
class _Staged:
    """Where this rank wrote, and its vote (its fragment, or its error)."""

    staging: Staging
    vote: Contribution[Any]


def _stage_and_vote(
    comm: Communicator,
    what: str,
    writer: ShardWriter,
    names: _StagingNames | None,
    on_staged: Callable[[Staging], None] | None,
    wants_shared: bool,
) -> _Staged:
    """Steps 1 and 2: with rank 0 opening the staging area (the first round), or without (the one-round
    path: the writer ``stages_alone`` and every rank knows the staging path from ``names``)."""
    rank = comm.rank
    path = names.next_path(writer.target) if names is not None and writer.stages_alone else None
    if path is not None:
        staging = Staging(path)
        return _Staged(staging, contribute(lambda: _stage_and_write(writer, staging, rank, on_staged, wants_shared)))
    opened: Staging = decide_on_rank0(comm, what, lambda plans: _open(writer, plans), contribute(writer.plan))
    if names is not None:
        names.learn(opened.seed)
    return _Staged(opened, contribute(lambda: _write(writer, opened, rank, on_staged)))


def _decide_round(
    comm: Communicator,
    what: str,
    writer: ShardWriter,
    staged: _Staged,
    build: _Build,
    committed: list[bool],
    after_vote: Callable[[], None] | None = None,
) -> Published:
    """Steps 3 to 5: gather the votes, rank 0 decides and publishes, every rank learns the outcome.

    ``after_vote()`` runs on every rank once its vote is cast, while it waits:
    on rank 0 before it gathers the others' votes, on the others once theirs
    is sent, before they wait for the decision (work the decision would
    otherwise wait for; it must not raise).

    A vote of the one-round path (``StagedVote``) carries the plan the first
    round would have compared; a rank whose structure differs from rank 0's is
    then told rank 0's, names the difference itself, and every rank raises it
    (one more collective, on that failure only).
    """
    rank, staging = comm.rank, staged.staging
    if rank == 0 and after_vote is not None:
        after_vote()

    def voted() -> None:
        fault_point("vote", rank)
        if rank != 0 and after_vote is not None:
            after_vote()

    outcome: Published | Structure = decide_on_rank0(
        comm,
        what,
        lambda votes: _decide(writer, staging, votes, build, committed),
        staged.vote,
        after_gather=voted,
        on_failure=lambda: writer.abort(staging),
        after_failure=lambda: _abort_own(writer, staging, rank),
    )
    if isinstance(outcome, Published):
        return outcome
    mine = writer.structure
    differs = None if mine is None or mine.digest == outcome.digest else describe_difference(mine, rank, outcome)
    agree(comm, what, differs)
    raise ShardingError(f"rank {rank}: {what} failed: some rank's structure differs from rank 0's")  # not reached


class _StagingNames:
    """The staging paths of one communicator's saves, which every rank derives alike without a message.

    Rank 0 draws a random seed in the first round of a save and every rank
    learns it; each later save of a writer that ``stages_alone`` names its
    staging area from the seed and a count that every rank advances alike
    (all ranks take part in every commit, in the same order), and skips the
    first round. A failed commit forgets the seed on every rank, so the next
    save runs the first round again.
    """

    def __init__(self) -> None:
        self.seed = ""
        self.count = 0

    def learn(self, seed: str) -> None:
        self.seed, self.count = seed, 0

    def forget(self) -> None:
        self.seed = ""

    def next_path(self, target: str) -> str | None:
        """The next save's staging path, or None before a seed is known."""
        if not self.seed:
            return None
        self.count += 1
        return fmt.staging_path(target, f"{self.seed}-{self.count}")


_NAMES: weakref.WeakKeyDictionary[Communicator, _StagingNames] = weakref.WeakKeyDictionary()


def _names_of(comm: Communicator) -> _StagingNames | None:
    """The staging names of ``comm``'s saves; None for a communicator that cannot be weakly referenced (every
    save then runs the first round)."""
    try:
        return _NAMES.setdefault(comm, _StagingNames())
    except TypeError:
        return None


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
    _same_path(plans, SavePlan)
    _check_plans(plans)
    try:
        staging = replace(writer.open(plans), seed=uuid.uuid4().hex)
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


def _fragments(votes: list[Any]) -> list[Fragment]:
    """The fragments of the one-round path's votes, once their plans agree (every rank took that path)."""
    _same_path(votes, StagedVote)
    _check_plans([v.plan for v in votes])
    return [v.fragment for v in votes]


def _same_path(contributions: list[Any], expected: type) -> None:
    """Every rank took the same path through the protocol (they can differ only if their options do)."""
    if not all(isinstance(c, expected) for c in contributions):
        raise InvalidArgumentError(
            "the ranks disagree on how to commit this save (some staged without rank 0, some did not): every "
            "rank must call save with the same path and options"
        )


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


def _stage_and_write(
    writer: ShardWriter,
    staging: Staging,
    rank: int,
    on_staged: Callable[[Staging], None] | None,
    wants_shared: bool,
) -> StagedVote:
    """(all ranks, one-round path) Steps 1 and 2 without rank 0: the plan, the staging area, the write."""
    plan = writer.plan()
    created = writer.stage(staging.path)
    if rank == 0:
        fault_point("prepare", 0)
    fragment = _write(writer, staging, rank, on_staged)
    return StagedVote(replace(plan, structure=None), fragment, created, wants_shared)


def _abort_own(writer: ShardWriter, staging: Staging, rank: int) -> None:
    """(ranks other than 0, on a decided failure of the one-round path) Remove this rank's staging area when
    rank 0 did not: it is another path (the ranks disagreed on the target), or rank 0 failed to remove it.

    Only after rank 0's decision: a rank that merely lost contact must never remove what rank 0 may publish.
    """
    if rank != 0 and writer.stages_alone:
        writer.abort(staging)


def _decide(
    writer: ShardWriter, staging: Staging, votes: list[Any], build: _Build, committed: list[bool]
) -> Published | Structure:
    """(rank 0) Step 4 when every rank voted yes: validate, write the manifest, publish; what every rank learns.

    In the one-round path, first what step 1 checks: the plans, the
    structures (rank 0's structure when one differs: the outcome every rank
    then compares with its own), the target.
    """
    structure = writer.structure
    assert structure is not None  # plan() set it
    one_round = isinstance(votes[0], StagedVote)
    fragments = _fragments(votes) if one_round else votes
    if one_round:
        if any(f.digest != structure.digest for f in fragments):
            writer.abort(staging)
            return structure
        writer.check_staged(min((v.created for v in votes if v.created), key=len, default=None))
    manifest = build.manifest(fragments, structure)
    generation, _sealed = checksum.generation(manifest.manifest, f"the manifest of {writer.target!r}")
    wanted = not one_round or any(v.wants_shared for v in votes)
    shared = build.share() if build.share is not None and wanted else None
    fault_point("validate", 0)
    writer.finalize(staging, manifest, fragments)
    fault_point("manifest", 0)
    writer.publish(staging)
    fault_point("publish", 0)
    committed.append(True)
    return Published(generation, shared)
