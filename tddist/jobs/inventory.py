"""What a root holds: checkpoints, leftovers of interrupted saves, and what clean-up would do.

``scan(root)`` lists every checkpoint under a directory or an ``s3://bucket/prefix``
(a ``CheckpointManager`` root or any other) and flags what interrupted saves
left there, each with the command that removes it. ``newest(root)`` is the checkpoint a job would resume
from. ``plan_gc``/``gc`` apply the manager's clean-up and retention rules
(``tddist.jobs.retention``) offline; ``plan_gc`` only says what ``gc`` would do.

No torch is needed (a manifest is JSON and, from format version 2 on, a small
binary index read with numpy), so the ``tddist`` command lists and cleans
checkpoints without importing torch. Sizes are what each checkpoint takes on
disk, whatever its files: rank data files (packing "packed"), rank directories
of one file per leaf (packing "memmap", version 1) or one archive; on object
storage, the sum of its objects' sizes.

On object storage (``storage.backends.root_for`` says which root is where),
what an interrupted save leaves lies inside the checkpoint's entry: a
generation its manifest does not name, an unfinished multipart upload
(``storage.roots.Leftover``); each is listed as a ``"staging"`` entry of its
checkpoint, and ``gc`` removes it with the checkpoint's ``recover``.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import stat
from dataclasses import dataclass

from .. import format as fmt
from ..errors import CheckpointNotFoundError, TddistError
from ..storage.backends import read_manifest, root_for, store_for
from ..storage.recovery import is_committed, is_tddist_dir, recover
from ..storage.roots import LOCK_NAME, Leftover, Root
from ..storage.roots import disk_usage as _disk_usage
from .retention import committed_steps, delete_checkpoint, parse_step, step_entries

logger = logging.getLogger(__name__)

#: Kinds of ``Entry``: a valid checkpoint, and everything that is not one.
CHECKPOINT = "checkpoint"  # committed, with a valid manifest
DAMAGED = "damaged"  # has a manifest that does not validate
PARTIAL = "partial"  # a directory of tddist's own without a manifest: a save cut off before its commit
STAGING = "staging"  # beside a target: the checkpoint an interrupted save was writing
TRASH = "trash"  # beside a target: a checkpoint whose deletion was interrupted
BACKUP = "backup"  # beside a target: the old checkpoint of an interrupted replace
FOREIGN = "foreign"  # a step directory that holds files tddist did not write
KINDS = (CHECKPOINT, DAMAGED, PARTIAL, STAGING, TRASH, BACKUP, FOREIGN)


@dataclass(frozen=True)
class Entry:
    """One item of a directory listing (``scan``).

    Attributes:
        path: the entry's path.
        kind: one of ``KINDS``: ``"checkpoint"`` (committed and valid), ``"damaged"``
            (its manifest does not validate), ``"partial"`` (a save cut off before its
            commit), ``"staging"``, ``"trash"``, ``"backup"`` (left beside ``target`` by an
            interrupted save, deletion or replace), ``"foreign"`` (a step name holding
            files tddist did not write).
        step: the step in the name (``step-000000100``), or the target's step for a
            leftover; None for other names.
        layout: ``"directory"`` or ``"archive"`` (of the entry itself).
        world_size: the number of ranks that saved it (valid checkpoints only).
        nbytes: the space it takes on disk (allocated blocks, like ``du``).
        mtime: its modification time (seconds since the epoch).
        created: the commit time recorded in the manifest (ISO 8601), or None.
        target: for a leftover, the checkpoint path it belongs to; else None.
        problem: for anything but a valid checkpoint, what is wrong, in words.
        fix: the shell command that removes or repairs it, or None when nothing
            does it safely (a damaged checkpoint, foreign files).
    """

    path: str
    kind: str
    step: int | None
    layout: str
    world_size: int | None
    nbytes: int
    mtime: float
    created: str | None
    target: str | None
    problem: str | None
    fix: str | None

    @property
    def committed(self) -> bool:
        """True for a valid committed checkpoint."""
        return self.kind == CHECKPOINT

    @property
    def age_seconds(self) -> float:
        """Seconds since the checkpoint was committed (its manifest's time), or since ``mtime``."""
        return max(0.0, _now() - (_parse_time(self.created) or self.mtime))


def _now() -> float:
    return datetime.datetime.now(datetime.timezone.utc).timestamp()


def _parse_time(created: str | None) -> float | None:
    if not created:
        return None
    try:
        t = datetime.datetime.fromisoformat(created)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def disk_usage(path: str) -> int:
    """Bytes allocated on disk for ``path`` and everything below it (symbolic links not followed)."""
    return _disk_usage(path)


def _quote(path: str) -> str:
    import shlex

    return shlex.quote(path)


def _leftover_fix(shown_root: str, target: str) -> str:
    name = os.path.basename(target)
    if parse_step(name) is not None:
        return f"tddist gc {_quote(shown_root)}"
    return f"tddist recover {_quote(os.path.join(shown_root, name))}"


@dataclass(frozen=True)
class _OnDisk:
    """What ``describe`` learns of a path before telling what it is, shared by every kind of ``Entry``.

    Attributes:
        path: the absolute path.
        name: its last component (a step name, a side entry's name, or any other).
        root: the directory being listed, as the commands in ``Entry.fix`` name it.
        is_dir: a directory (else a file: an archive).
        mtime: its modification time (seconds since the epoch).
    """

    path: str
    name: str
    root: str
    is_dir: bool
    mtime: float

    @property
    def layout(self) -> str:
        """``Entry.layout``: ``"directory"`` or ``"archive"``."""
        return "directory" if self.is_dir else "archive"

    def entry(
        self,
        kind: str,
        step: int | None,
        *,
        world_size: int | None = None,
        created: str | None = None,
        target: str | None = None,
        problem: str | None = None,
        fix: str | None = None,
    ) -> Entry:
        """The ``Entry`` of this path as ``kind``; what only some kinds have is passed by name."""
        return Entry(
            path=self.path,
            kind=kind,
            step=step,
            layout=self.layout,
            world_size=world_size,
            nbytes=disk_usage(self.path),
            mtime=self.mtime,
            created=created,
            target=target,
            problem=problem,
            fix=fix,
        )


#: What each kind of side entry is, in words (``Entry.problem``).
_LEFTOVER_PROBLEMS = {
    STAGING: "staging entry of an interrupted save (or of a save running now)",
    TRASH: "a checkpoint whose deletion was interrupted",
    BACKUP: "the previous checkpoint of an interrupted replace",
}


def describe(path: str | os.PathLike, root: str | os.PathLike | None = None) -> Entry | None:
    """The ``Entry`` for ``path``, or None if it is neither a checkpoint nor something tddist left.

    ``root`` is the directory being listed, as the commands in ``Entry.fix``
    name it; default: ``path``'s parent.
    """
    path = os.path.abspath(os.fspath(path))
    root = os.fspath(root) if root is not None else os.path.dirname(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return None
    found = _OnDisk(
        path=path, name=os.path.basename(path), root=root, is_dir=stat.S_ISDIR(st.st_mode), mtime=st.st_mtime
    )
    side = fmt.side_entry_kind(found.name)
    if side is not None:
        base, kind = side
        return _leftover_entry(found, base, kind)
    if is_committed(path):
        return _committed_entry(found)
    if not found.is_dir:
        return None
    return _uncommitted_entry(found)


def _leftover_entry(found: _OnDisk, base: str, kind: str) -> Entry:
    """A side entry (staging, trash, backup) beside the checkpoint ``base``, with the command that clears it.

    A committed backup whose target lost its checkpoint is the only copy left:
    the problem says so, as ``recover`` restores it rather than removing it.
    """
    target = os.path.join(os.path.dirname(found.path), base)
    problem = _LEFTOVER_PROBLEMS[kind]
    if kind == BACKUP and is_committed(found.path) and not is_committed(target):
        problem += "; it is the only committed copy and recover moves it back"
    return found.entry(kind, parse_step(base), target=target, problem=problem, fix=_leftover_fix(found.root, target))


def _committed_entry(found: _OnDisk) -> Entry:
    """A committed checkpoint: valid (with its world size and commit time) or damaged (with the reason).

    Nothing repairs a damaged manifest safely, so a damaged entry has no fix.
    """
    step = parse_step(found.name)
    try:
        m = read_manifest(found.path)
    except TddistError as e:
        return found.entry(DAMAGED, step, problem=str(e))
    return found.entry(CHECKPOINT, step, world_size=m.world_size, created=m.created or None)


def _uncommitted_entry(found: _OnDisk) -> Entry | None:
    """A directory without a manifest: a save cut off (tddist's own files), foreign files under a step name,
    or None for anything else (an empty or unrelated directory is not listed)."""
    step = parse_step(found.name)
    try:
        ours = is_tddist_dir(found.path)
        empty = not os.listdir(found.path)
    except OSError:
        return None
    if ours and (step is not None or not empty):
        fix = (
            f"tddist gc {_quote(found.root)}"
            if step is not None
            else f"rm -r {_quote(os.path.join(found.root, found.name))}"
        )
        return found.entry(
            PARTIAL, step, problem="no manifest: a save cut off before its commit (atomic=False), or a removal", fix=fix
        )
    if step is not None:
        return found.entry(
            FOREIGN, step, problem="a step name without a manifest that holds files tddist did not write; left alone"
        )
    return None


def scan(root: str | os.PathLike) -> list[Entry]:
    """Every checkpoint and leftover directly under ``root``, in step order (then by name).

    If ``root`` is itself a checkpoint (or a leftover), it is listed alone, with
    the leftovers beside it.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist or is not a directory or checkpoint (on object
            storage: its bucket does not exist).
        StorageError: object storage could not be listed.
    """
    shown = os.fspath(root)
    where = root_for(shown)
    if not where.local:
        return _sorted(_scan_objects(where, shown))
    root = os.path.abspath(shown)
    if not os.path.lexists(root):
        raise CheckpointNotFoundError(f"{shown!r} does not exist")
    if is_committed(root) or not os.path.isdir(root):
        own = describe(root, os.path.dirname(shown))
        if own is None:
            raise CheckpointNotFoundError(
                f"{shown!r} is neither a directory nor a tddist checkpoint; pass a checkpoint root or a checkpoint"
            )
        side = [describe(p, os.path.dirname(shown)) for _k, p in fmt.side_entries(root)]
        entries = [own] + [e for e in side if e is not None]
    else:
        try:
            names = sorted(os.listdir(root))
        except OSError as e:
            raise CheckpointNotFoundError(f"cannot list {shown!r}: {e.strerror}") from None
        found = (describe(os.path.join(root, n), shown) for n in names)
        entries = [entry for entry in found if entry is not None]
    return _sorted(entries)


def _sorted(entries: list[Entry]) -> list[Entry]:
    """By step (entries without one last), each leftover after its checkpoint, then by path."""
    return sorted(
        entries, key=lambda e: (e.step is None, e.step or 0, e.target or e.path, e.target is not None, e.path)
    )


def newest(root: str | os.PathLike) -> Entry | None:
    """The checkpoint a job would resume from: the newest valid one under ``root``, or None.

    Under a root with step names (``step-000000100``, as ``CheckpointManager``
    writes), the one with the highest step, by the manager's own rule
    (``retention.newest_checkpoint``: damaged and uncommitted entries are
    skipped). Under a root without step names, the valid checkpoint committed
    last (by the time in its manifest, then its modification time).

    Raises:
        CheckpointNotFoundError: a root on a file system that does not exist or
            is not a directory, or a bucket that does not exist.
    """
    shown = os.fspath(root)
    where = root_for(shown)
    steps = step_entries(where.target)
    if steps:
        for _step, path in steps:
            entry = describe(path, shown) if where.local else _object_entry(where, os.path.basename(path), shown)
            if entry is not None and entry.committed:
                return entry
        return None
    if where.local and not os.path.isdir(where.target):
        what = "does not exist" if not os.path.lexists(where.target) else "is not a directory"
        raise CheckpointNotFoundError(f"{shown!r} {what}")
    found = [e for e in scan(shown) if e.committed]
    if not found:
        return None
    return max(found, key=lambda e: (_parse_time(e.created) or e.mtime, e.mtime, e.path))


# --- on object storage -------------------------------------------------------------------------

#: What each kind of leftover inside an entry on object storage is, in words (``Entry.problem``).
_OBJECT_LEFTOVERS = {
    "generation": "objects no committed manifest names: an interrupted save (or a save running now)",
    "upload": "an unfinished multipart upload: an interrupted save (or a save running now)",
}


def _scan_objects(root: Root, shown: str) -> list[Entry]:
    """``scan`` of a root on object storage: each name under it, or the checkpoint ``root`` names itself."""
    if store_for(root.target).committed():
        parent, _, name = root.target.rpartition("/")
        return _object_entries(root_for(parent), name, parent)
    entries: list[Entry] = []
    for name in root.names():
        if name != LOCK_NAME:
            entries += _object_entries(root, name, shown)
    return entries


def _object_entry(root: Root, name: str, shown: str) -> Entry | None:
    """The entry ``name`` under a root on object storage, without its leftovers."""
    found = [e for e in _object_entries(root, name, shown, leftovers=False) if e.target is None]
    return found[0] if found else None


def _object_entries(root: Root, name: str, shown: str, leftovers: bool = True) -> list[Entry]:
    """The entry ``name`` under a root on object storage (checkpoint, damaged, partial or foreign, if it is
    one of these) and what interrupted saves left in it."""
    path, step = root.join(name), parse_step(name)
    layout = "archive" if name.endswith(fmt.ARCHIVE_SUFFIX) else "directory"
    fix = f"tddist gc {_quote(shown)}" if step is not None else f"tddist recover {_quote(path)}"
    out: list[Entry] = []
    usage = None
    if store_for(path).committed():
        usage = root.usage(name)
        try:
            m = read_manifest(path)
        except TddistError as e:
            out.append(Entry(path, DAMAGED, step, layout, None, usage.nbytes, usage.mtime, None, None, str(e), None))
        else:
            out.append(
                Entry(path, CHECKPOINT, step, layout, m.world_size, usage.nbytes, usage.mtime, m.created or None,
                      None, None, None)
            )  # fmt: skip
    else:
        ours = root.partial(name)
        if ours is not None and (ours or step is not None):
            usage = root.usage(name)
            kind, problem, cure = (
                (PARTIAL, "no manifest: a save or a deletion cut off before it ended", fix)
                if ours
                else (FOREIGN, "a step name without a manifest that holds objects tddist did not write; left alone",
                      None)
            )  # fmt: skip
            out.append(Entry(path, kind, step, layout, None, usage.nbytes, usage.mtime, None, None, problem, cure))
    if leftovers:
        out += [_leftover_object(lo, path, step, fix) for lo in root.leftovers(name)]
    return out


def _leftover_object(lo: Leftover, target: str, step: int | None, fix: str) -> Entry:
    layout = "archive" if lo.what == "upload" and target.endswith(fmt.ARCHIVE_SUFFIX) else "directory"
    return Entry(lo.path, STAGING, step, layout, None, lo.nbytes, lo.mtime, None, target, _OBJECT_LEFTOVERS[lo.what],
                 fix)  # fmt: skip


# --- clean-up and retention offline ------------------------------------------------------

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
        for path in _retired(root, keep_last, committed, restored):
            actions.append(Action(DELETE, path, f"beyond the {keep_last} newest checkpoint(s)", disk_usage(path)))
    return actions


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
            f"checkpoints (or run tddist recover {_quote(root)} for this one)"
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
    Run it only when no job is saving to ``root``.
    """
    where = root_for(os.fspath(root))
    if not where.local:
        return _gc_objects(where, plan_gc(where.target, keep_last))
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
            delete_checkpoint(a.path)
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
            f"step-NNNNNNNNN checkpoints (or run tddist recover {_quote(root.target)} for this one)"
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
        for s, p in committed[keep_last:]:
            if s != newest:
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
    for a in actions:
        target = root.join(re.split(r"[/?]", a.path[len(root.target) + 1 :], maxsplit=1)[0])
        if a.action == REMOVE and a.reason in leftover:
            if target not in recovered:
                recovered.add(target)
                for line in store_for(target).recover():
                    logger.info("gc: %s", line)
        elif a.action in (REMOVE, DELETE) and a.path == target:
            delete_checkpoint(target)
    return actions
