"""What a committed checkpoint is, and removing what interrupted saves left beside one.

Only the standard library is needed here, so the ``tddist`` command can list
and clean checkpoints without importing torch.
"""

from __future__ import annotations

import logging
import os
import zipfile

from .. import format as fmt
from .._fs import fsync_path, remove_tree
from .pins import expired_pins, referenced_beside

logger = logging.getLogger(__name__)


def is_tddist_dir(path: str) -> bool:
    """True if ``path`` holds only what tddist writes (a checkpoint, torn or not).

    Only such a directory may be replaced or removed: tddist never deletes foreign data.

    Args:
        path: an existing directory.

    Returns:
        Whether every entry of ``path`` is one tddist writes at the top of a checkpoint.

    Raises:
        OSError: ``path`` cannot be listed (it is missing or not a directory).
    """
    names = os.listdir(path)
    return all(fmt.is_checkpoint_entry_name(n) for n in names)


def is_committed(path: str) -> bool:
    """True if ``path`` is a committed checkpoint: a directory with a manifest, or a tddist archive.

    The manifest is written last, so its presence is the commit; its content
    is not validated here (``read_manifest`` does).

    Args:
        path: any path; a missing one is not committed.

    Returns:
        Whether ``path`` is a committed checkpoint.
    """
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, fmt.MANIFEST_NAME))
    return os.path.isfile(path) and is_tddist_archive(path)


def is_tddist_archive(path: str) -> bool:
    """True if ``path`` is a zip file holding a tddist manifest.

    Args:
        path: any path; a missing or unreadable file is not an archive.

    Returns:
        Whether ``path`` is a zip file with a ``tddist.json`` entry.
    """
    try:
        with zipfile.ZipFile(path) as zf:
            return fmt.MANIFEST_NAME in zf.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def recover(target: str) -> list[str]:
    """Remove leftovers of interrupted saves beside ``target``; returns what was done.

    Staging and trash directories are removed, but for a trash entry that a
    committed checkpoint beside it references (a deletion cut off between
    renaming it away and back, ``roots.remove_checkpoint``): it is moved back
    to the absent target. A backup of a replaced
    checkpoint is moved back to the target if the target lost its manifest
    (a crash in the middle of a replace without RENAME_EXCHANGE), otherwise
    removed. Pins of ``target`` that expired (an incremental save that died
    left them, ``pins.PIN_LEASE``) are removed, live ones kept. Committed
    checkpoints and foreign files are never touched. Call
    it only when no save to ``target`` is running.

    Args:
        target: the checkpoint path (directory or archive) whose leftovers to remove.

    Returns:
        One line per action taken, for a log; empty if there was nothing to do.

    Raises:
        OSError: a leftover could not be removed or moved back.
    """
    done: list[str] = []
    target_ok = is_committed(target)
    for kind, path in fmt.side_entries(target):
        if kind == "backup" and not target_ok and is_committed(path):
            if os.path.isdir(target) and is_tddist_dir(target):
                remove_tree(target)
            if not os.path.exists(target):
                os.rename(path, target)
                fsync_path(os.path.dirname(os.path.abspath(target)))
                target_ok = True
                done.append(f"restored {path} to {target}")
                continue
            done.append(
                f"kept {path}: it holds the only committed checkpoint, but {target} is occupied by something "
                f"that is not a checkpoint; move that away and run recover again"
            )
            logger.warning("recover: %s", done[-1])
            continue
        if kind == "trash" and referenced_trash(target, path):
            os.rename(path, target)
            fsync_path(os.path.dirname(os.path.abspath(target)))
            target_ok = True
            done.append(f"restored {path} to {target}: a committed checkpoint beside it references it")
            logger.warning("recover: %s", done[-1])
            continue
        remove_tree(path)
        done.append(f"removed {path}")
        logger.info("recover: removed %s", path)
    for pin in expired_pins(target):  # left by an incremental save that died; a live one's are kept
        os.unlink(pin)
        done.append(f"removed expired pin {pin}")
    return done


def referenced_trash(target: str, trash: str) -> bool:
    """Whether the trash entry ``trash`` of ``target`` must go back to ``target``: the target is absent, the
    entry is a committed checkpoint, and a committed checkpoint beside it references it by name.

    A deletion renames a checkpoint to a trash name, then renames it back when it finds such a reference (a
    save committed one after the deletion was decided); a crash between the two renames leaves it here.
    """
    return not os.path.lexists(target) and is_committed(trash) and referenced_beside(target)
