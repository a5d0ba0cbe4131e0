"""Garbage collection of a root offline: what ``tddist gc`` removes, restores or deletes, and doing it.

``plan_gc(root, keep_last)`` applies ``CheckpointManager``'s rules without a
manager: the clean-up it runs at start (``retention.clean_root``: leftovers
of interrupted saves, deletions and replaces; torn step directories) and, with
``keep_last``, the retention after a save. It changes nothing and returns one
``Action`` per entry; ``gc`` does what ``plan_gc`` planned. Directories and
``s3://bucket/prefix`` roots alike (``storage.backends.root_for`` says which).

Apart from ``inventory`` (which only lists what a root holds) because this
module is the one that deletes: reading the listing never needs it. No torch.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from dataclasses import dataclass

from .. import format as fmt
from ..errors import CheckpointNotFoundError, CheckpointPinnedError, TddistError
from ..storage.backends import read_manifest, root_for, store_for
from ..storage.recovery import is_committed, is_tddist_dir, recover, referenced_trash
from ..storage.roots import Root
from . import root_lock
from .inventory import BACKUP, STAGING, TRASH, disk_usage
from .retention import committed_steps, delete_checkpoint, parse_step, referenced, step_entries

logger = logging.getLogger(__name__)


REMOVE = "remove"  # a leftover (staging, trash, backup) or a torn step directory
RESTORE = "restore"  # a committed backup moved back to its target
DELETE = "delete"  # a committed checkpoint beyond --keep-last
KEEP = "keep"  # left alone, with the reason (foreign files, a backup that cannot be restored)


@dataclass(frozen=True)
class Action:
    """One thing ``gc`` does (or, with ``plan_gc``, would do).

    Attributes:
        action: ``"remove"``, ``"restore"``, ``"delete"`` or ``"keep"``.
        path: the entry acted on.
        reason: why, in words.
        nbytes: the disk space it frees (0 for restore and keep).
        target: for ``"restore"``, where the backup goes back to; else None.
    """

    action: str
    path: str
    reason: str
    nbytes: int = 0
    target: str | None = None


def plan_gc(root: str | os.PathLike, keep_last: int | None = None) -> list[Action]:
    """What ``gc(root, keep_last)`` would do, without changing anything.

    The rules are ``CheckpointManager``'s (``retention.clean_root`` at start,
    then retention after a save): for every step name, the leftovers of
    interrupted saves beside it are removed (a committed backup whose target
    lost its checkpoint is moved back instead); a step directory without a
    manifest that holds only tddist's files is removed; one with foreign files
    is left alone. Then, with ``keep_last``, the committed checkpoints beyond
    the ``keep_last`` newest are deleted, never the newest valid one.

    On object storage (``s3://bucket/prefix``) the leftovers are inside each
    step's entry (generations no manifest names, unfinished uploads) and a
    torn entry is a prefix of generations without a manifest.
    """
    where = root_for(os.fspath(root))
    if not where.local:
        return _plan_gc_objects(where, keep_last)
    root = os.path.abspath(os.fspath(root))
    _check_root(root)
    actions: list[Action] = []
    bases = set()
    for name in os.listdir(root):
        side = fmt.side_entry_kind(name)
        base = side[0] if side else name
        if parse_step(base) is not None:
            bases.add(base)
    committed: dict[str, bool] = {}
    restored: dict[str, str] = {}  # target -> the backup that will be moved back to it
    for base in sorted(bases):
        target = os.path.join(root, base)
        target_ok = is_committed(target)
        target_gone = not os.path.lexists(target)
        for kind, path in fmt.side_entries(target):
            if kind == TRASH and target_gone and referenced_trash(target, path):
                actions.append(Action(RESTORE, path, "interrupted deletion of a referenced checkpoint", 0, target))
                target_ok, target_gone = True, False
                restored[target] = path
                continue
            if kind == BACKUP and not target_ok and is_committed(path):
                if os.path.isdir(target) and is_tddist_dir(target):
                    actions.append(
                        Action(REMOVE, target, "torn checkpoint in the way of its backup", disk_usage(target))
                    )
                    target_gone = True
                if target_gone:
                    actions.append(
                        Action(RESTORE, path, "backup of an interrupted replace: the only committed copy", 0, target)
                    )
                    target_ok, target_gone = True, False
                    restored[target] = path
                    continue
                actions.append(
                    Action(
                        KEEP,
                        path,
                        f"holds the only committed checkpoint, but {target} is occupied by something that is not "
                        f"a checkpoint; move that away and run gc again",
                    )
                )
                continue
            actions.append(Action(REMOVE, path, _SIDE_REASON[kind], disk_usage(path)))
        if not target_gone and os.path.isdir(target) and not target_ok:
            if is_tddist_dir(target):
                actions.append(
                    Action(REMOVE, target, "torn checkpoint: no manifest (a save cut off)", disk_usage(target))
                )
            else:
                actions.append(Action(KEEP, target, "not a committed checkpoint and holds foreign files; left alone"))
        committed[target] = target_ok
    if keep_last is not None:
        actions += _retirements(root, keep_last, committed, restored)
    return actions


def _retirements(root: str, keep_last: int, committed: dict[str, bool], restored: dict[str, str]) -> list[Action]:
    """The deletions of retention, less the checkpoints a kept one references (kept, saying why)."""
    doomed = _retired(root, keep_last, committed, restored)
    kept = [restored.get(p, p) for _s, p in step_entries(root) if p not in doomed and is_committed(p)]
    kept += [b for t, b in restored.items() if t not in doomed]
    needed = referenced(kept)
    out = []
    for path in doomed:
        if os.path.abspath(path) in needed:
            out.append(Action(KEEP, path, "beyond the newest, but a kept incremental checkpoint references it"))
        else:
            out.append(Action(DELETE, path, f"beyond the {keep_last} newest checkpoint(s)", disk_usage(path)))
    return out


_SIDE_REASON = {
    STAGING: "staging entry of an interrupted save",
    TRASH: "interrupted deletion",
    BACKUP: "backup of a replaced checkpoint, no longer needed",
}


def _check_root(root: str) -> None:
    if not os.path.isdir(root):
        what = "does not exist" if not os.path.lexists(root) else "is not a directory"
        raise CheckpointNotFoundError(f"checkpoint root {root!r} {what}")
    if is_committed(root):
        raise CheckpointNotFoundError(
            f"{root!r} is a checkpoint, not a checkpoint root; pass the directory that holds the step-NNNNNNNNN "
            f"checkpoints (or run tddist recover {shlex.quote(root)} for this one)"
        )


def _retired(root: str, keep_last: int, committed: dict[str, bool], restored: dict[str, str]) -> list[str]:
    """``retention.retired`` after the clean-up: committed checkpoints beyond the newest ``keep_last``,
    never the newest valid one. ``restored`` maps targets to the backups moved back to them."""
    steps = {p: s for s, p in step_entries(root)}
    for t in restored:
        steps[t] = parse_step(os.path.basename(t)) or 0
    ordered = sorted(((s, p) for p, s in steps.items()), reverse=True)
    entries = [(s, p) for s, p in ordered if committed.get(p, is_committed(p))]
    newest_step = None
    for s, p in entries:
        try:
            read_manifest(restored.get(p, p))
        except TddistError:
            continue
        newest_step = s
        break
    return [p for s, p in entries[keep_last:] if s != newest_step]


def gc(root: str | os.PathLike, keep_last: int | None = None) -> list[Action]:
    """Apply the manager's clean-up and retention to ``root`` offline; returns what was done.

    See ``plan_gc`` for the rules. Leftovers are handled by ``tddist.recover``
    on each step name, torn directories and retired checkpoints are deleted
    with ``retention.delete_checkpoint`` (renamed away first, then removed).
    Run it only when no job is saving to ``root``. On object storage it takes the root's lock
    (``root_lock``) for its duration, so it is refused while a ``CheckpointManager`` of another process holds it.

    Raises:
        RootLockedError: (object storage) a live job holds the root's lock.
    """
    where = root_for(os.fspath(root))
    if not where.local:
        # The root's lease keeps a manager's saves and this clean-up apart (a live job's lease refuses it:
        # RootLockedError); a direct incremental save's pins keep its holders (``storage/s3/holds.py``).
        root_lock.acquire(where.target)
        try:
            return _gc_objects(where, plan_gc(where.target, keep_last))
        finally:
            root_lock.release(where.target)
    root = os.path.abspath(os.fspath(root))
    actions = plan_gc(root, keep_last)
    recovered = set()
    done = []
    for a in actions:
        if a.action in (REMOVE, RESTORE) and a.path != a.target:
            target = a.target or _target_of(a.path)
            if target is not None and target not in recovered and fmt.side_entry_kind(os.path.basename(a.path)):
                recovered.add(target)
                for line in recover(target):
                    logger.info("gc: %s", line)
            if a.action == REMOVE and fmt.side_entry_kind(os.path.basename(a.path)) is None:
                if os.path.lexists(a.path) and not is_committed(a.path):
                    delete_checkpoint(a.path)
        elif a.action == DELETE:
            try:
                delete_checkpoint(a.path)
            except CheckpointPinnedError as e:  # an incremental save is about to reference it
                a = Action(KEEP, a.path, f"pinned: {e}")
        done.append(a)
    return done


def _target_of(path: str) -> str | None:
    side = fmt.side_entry_kind(os.path.basename(path))
    return os.path.join(os.path.dirname(path), side[0]) if side else None


def _plan_gc_objects(root: Root, keep_last: int | None) -> list[Action]:
    """``plan_gc`` of a root on object storage: leftovers inside each step entry, torn entries, retention."""
    if store_for(root.target).committed():
        raise CheckpointNotFoundError(
            f"{root.target!r} is a checkpoint, not a checkpoint root; pass the prefix that holds the "
            f"step-NNNNNNNNN checkpoints (or run tddist recover {shlex.quote(root.target)} for this one)"
        )
    actions: list[Action] = []
    for name in sorted({n for n in root.names() if parse_step(n) is not None}):
        path = root.join(name)
        for lo in root.leftovers(name):
            actions.append(Action(REMOVE, lo.path, _OBJECT_REASON[lo.what], lo.nbytes))
        if store_for(path).committed():
            continue
        ours = root.partial(name)
        if ours:
            reason = "torn checkpoint: generations without a manifest (a save or a deletion cut off)"
            actions.append(Action(REMOVE, path, reason, root.usage(name).nbytes))
        elif ours is not None:
            actions.append(Action(KEEP, path, "not a committed checkpoint and holds foreign objects; left alone"))
    if keep_last is not None:
        committed = committed_steps(root.target)
        newest = next((s for s, p in committed if _readable(p)), None)
        needed = referenced([p for s, p in committed[:keep_last]] + [p for s, p in committed if s == newest])
        for s, p in committed[keep_last:]:
            if s == newest:
                continue
            if store_for(p).target in needed:
                actions.append(Action(KEEP, p, "beyond the newest, but a kept incremental checkpoint references it"))
                continue
            name = p[len(root.target) + 1 :]
            reason = f"beyond the {keep_last} newest checkpoint(s)"
            actions.append(Action(DELETE, p, reason, root.usage(name).nbytes))
    return actions


_OBJECT_REASON = {
    "generation": "objects of an interrupted save that no committed manifest names",
    "upload": "unfinished multipart upload of an interrupted save",
}


def _readable(path: str) -> bool:
    try:
        read_manifest(path)
    except TddistError:
        return False
    return True


def _gc_objects(root: Root, actions: list[Action]) -> list[Action]:
    """Do what ``_plan_gc_objects`` planned: each step entry with leftovers is recovered once (``recover``),
    torn entries and retired checkpoints are deleted."""
    recovered: set[str] = set()
    leftover = set(_OBJECT_REASON.values())
    done = []
    for a in actions:
        target = root.join(re.split(r"[/?]", a.path[len(root.target) + 1 :], maxsplit=1)[0])
        if a.action == REMOVE and a.reason in leftover:
            if target not in recovered:
                recovered.add(target)
                for line in store_for(target).recover():
                    logger.info("gc: %s", line)
        elif a.action in (REMOVE, DELETE) and a.path == target:
            try:
                delete_checkpoint(target)
            except CheckpointPinnedError as e:  # an incremental save is about to reference it
                a = Action(KEEP, a.path, f"pinned: {e}")
        done.append(a)
    return done
