"""Step checkpoints under a root: their names, the newest committed one, retention and clean-up.

The rules that ``CheckpointManager`` applies on rank 0 and that the ``tddist``
command applies offline. Only the standard library is needed (the manifest is
JSON), so listing and cleaning a root does not import torch.
"""

from __future__ import annotations

import logging
import os
import re

from .. import format as fmt
from .._fs import fsync_path, remove_tree
from ..errors import TddistError
from ..storage.backends import read_manifest
from ..storage.recovery import is_committed, is_tddist_dir, recover

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d{9,})(\.tdz)?$")


def step_name(step: int, archive: bool = False) -> str:
    """The name of the checkpoint of ``step`` (zero-padded so names sort by step).

    Args:
        step: the training step.
        archive: name an archive (``.tdz``) instead of a directory.

    Returns:
        ``step-<step, at least 9 digits>``, with ``.tdz`` for an archive.
    """
    return f"step-{step:09d}" + (fmt.ARCHIVE_SUFFIX if archive else "")


def parse_step(name: str) -> int | None:
    """The step of a checkpoint name, or None if ``name`` is not one.

    Args:
        name: a file or directory name (not a path), as ``step_name`` makes them.

    Returns:
        The step, or None.
    """
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def step_entries(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step entry under ``root``, newest first (committed or not).

    Args:
        root: the directory holding the step checkpoints.

    Returns:
        Every entry whose name is a step name, by descending step; empty if
        ``root`` does not exist.
    """
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(parse_step(n), os.path.join(root, n)) for n in names]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def newest_checkpoint(root: str) -> tuple[str, int] | None:
    """(path, step) of the newest checkpoint under ``root`` with a valid manifest, or None.

    Staging leftovers, torn directories and unreadable manifests are skipped.
    The step is the one stored in the metadata (the name's, if absent).

    Args:
        root: the directory holding the step checkpoints.

    Returns:
        The newest readable checkpoint's path and step, or None if there is none.
    """
    for step, path in step_entries(root):
        try:
            manifest = read_manifest(path)
        except TddistError as e:
            logger.warning("skipping %s: %s", path, e)
            continue
        return path, int(manifest.metadata.get("step", step))
    return None


def delete_checkpoint(path: str) -> None:
    """Remove a checkpoint: first renamed away in one step (``recover`` removes a half-deleted one).

    So a crash in the middle never leaves a half-deleted checkpoint under
    its own name, where it could look valid.

    Args:
        path: the checkpoint (directory or archive).

    Raises:
        OSError: ``path`` could not be renamed or removed.
    """
    trash = fmt.trash_path(path)
    os.rename(path, trash)
    fsync_path(os.path.dirname(trash))
    remove_tree(trash)
    logger.info("deleted checkpoint %s", path)


def clean_root(root: str) -> list[str]:
    """Remove leftovers of crashed saves and deletions under ``root``; returns what was done.

    ``recover`` runs on every step name (staging, trash and backup entries);
    then a step directory without a manifest that holds only what tddist
    writes (a save cut off before its commit) is removed. A damaged manifest
    or foreign files are left alone (``newest_checkpoint`` skips them).

    Args:
        root: the directory holding the step checkpoints (created if missing).

    Returns:
        One line per action taken, for a log.

    Raises:
        OSError: a leftover could not be removed or restored.
    """
    os.makedirs(root, exist_ok=True)
    names: set[str] = set()
    for name in os.listdir(root):
        side = fmt.side_entry_kind(name)
        base = side[0] if side else name
        if parse_step(base) is not None:
            names.add(base)
    done: list[str] = []
    for name in sorted(names):
        path = os.path.join(root, name)
        done += recover(path)
        if os.path.isdir(path) and not is_committed(path):
            if is_tddist_dir(path):
                delete_checkpoint(path)
                done.append(f"removed torn checkpoint {path}")
            else:
                logger.warning("%s is not a committed checkpoint and holds foreign files; left alone", path)
    return done


def retired(root: str, keep_last: int, newest: int | None = None) -> list[tuple[int, str]]:
    """(step, path) of the committed checkpoints beyond the ``keep_last`` newest ones, never ``newest``.

    Uncommitted entries are not counted: retention never deletes a committed
    checkpoint to make room for a save that did not commit.

    Args:
        root: the directory holding the step checkpoints.
        keep_last: how many of the newest committed checkpoints to keep.
        newest: a step never to retire (the one just saved), or None.

    Returns:
        The checkpoints to delete, newest first.
    """
    committed = [(s, p) for s, p in step_entries(root) if is_committed(p)]
    return [(s, p) for s, p in committed[keep_last:] if s != newest]
