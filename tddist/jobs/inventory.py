"""What a root holds: checkpoints and leftovers of interrupted saves, each with the command that clears it.

``scan(root)`` lists every checkpoint under a directory or an ``s3://bucket/prefix``
(a ``CheckpointManager`` root or any other) and flags what interrupted saves
left there, each with the command that removes it. ``newest(root)`` is the checkpoint a job would resume
from. This module only reads: removing what it lists is ``cleanup``'s
(``plan_gc``/``gc``, the manager's clean-up and retention rules offline).

No torch is needed (a manifest is JSON and, from format version 2 on, a small
binary index read with numpy), so the ``tddist`` command lists checkpoints
without importing torch. Sizes are what each checkpoint takes on
disk, whatever its files: rank data files (packing "packed"), rank directories
of one file per leaf (packing "memmap", version 1) or one archive; on object
storage, the sum of its objects' sizes.

On object storage (``storage.backends.root_for`` says which root is where),
what an interrupted save leaves lies inside the checkpoint's entry: a
generation its manifest does not name, an unfinished multipart upload
(``storage.roots.Leftover``); each is listed as a ``"staging"`` entry of its
checkpoint, and ``cleanup.gc`` removes it with the checkpoint's ``recover``.
"""

from __future__ import annotations

import datetime
import os
import stat
from dataclasses import dataclass

from .. import format as fmt
from ..errors import CheckpointNotFoundError, TddistError
from ..storage.backends import read_manifest, root_for, store_for
from ..storage.recovery import is_committed, is_tddist_dir
from ..storage.roots import LOCK_NAME, Leftover, Root
from ..storage.roots import disk_usage as _disk_usage
from .retention import parse_step, step_entries

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


def newest(root: str | os.PathLike, *, finite: bool = False) -> Entry | None:
    """The checkpoint a job would resume from: the newest valid one under ``root``, or None.

    Under a root with step names (``step-000000100``, as ``CheckpointManager``
    writes), the one with the highest step, by the manager's own rule
    (``retention.newest_checkpoint``: damaged and uncommitted entries are
    skipped). Under a root without step names, the valid checkpoint committed
    last (by the time in its manifest, then its modification time). With
    ``finite``, checkpoints whose recorded counts show NaN or Inf values are
    skipped (format version 4; uncounted older ones are not).

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
            if entry is not None and entry.committed and (not finite or _finite(entry)):
                return entry
        return None
    if where.local and not os.path.isdir(where.target):
        what = "does not exist" if not os.path.lexists(where.target) else "is not a directory"
        raise CheckpointNotFoundError(f"{shown!r} {what}")
    found = [e for e in scan(shown) if e.committed and (not finite or _finite(e))]
    if not found:
        return None
    return max(found, key=lambda e: (_parse_time(e.created) or e.mtime, e.mtime, e.path))


def _finite(entry: Entry) -> bool:
    """Whether a committed checkpoint's manifest records no NaN or Inf value (an unreadable one is not)."""
    try:
        return not read_manifest(entry.path).non_finite()
    except TddistError:
        return False


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
