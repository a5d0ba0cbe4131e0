"""Every use of a private or undocumented API of Python or torch, in one place.

Each shim has a test in ``tests/test_compat.py`` that fails loudly when an
upgrade removes or changes what it relies on, instead of letting tddist fail
in a user's job.
"""

from __future__ import annotations

import atexit
import threading
import zipfile
from collections.abc import Callable, Iterable
from typing import IO, Any


def register_exit_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, before ``concurrent.futures`` stops accepting work.

    threading's exit hooks run in reverse order of registration, before
    atexit's; concurrent.futures registers its own when it is imported, so a
    hook registered later runs first and may still use thread pools (the
    writer's are). ``threading._register_atexit`` is private (CPython >= 3.9);
    without it, ``atexit`` is the fallback (pools may then be shut already).
    """
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(fn)
    else:  # pragma: no cover - other interpreters
        atexit.register(fn)


def local_header(info: zipfile.ZipInfo) -> bytes:
    """The local file header zipfile writes for ``info`` (``ZipInfo.FileHeader``, undocumented)."""
    header: bytes = info.FileHeader()
    return header


def zip_lzma_compressor() -> Any:
    """A compressor producing a zip LZMA entry's payload (properties header included).

    ``zipfile.LZMACompressor`` is how zipfile writes method 14; it is not
    documented (and absent from typeshed), but writing the header by hand
    would repeat it.
    """
    return zipfile.LZMACompressor()  # type: ignore[attr-defined]


def write_central_directory(f: IO[bytes], start: int, infos: Iterable[zipfile.ZipInfo]) -> None:
    """Write the central directory (zip64 records when needed) for entries already in ``f``, at ``start``.

    zipfile has no public API to write a central directory for entries that
    other processes wrote; its ``ZipFile.close`` writes one from ``filelist``,
    ``NameToInfo`` and ``start_dir`` (internal attributes), so they are filled in here.
    """
    f.seek(start)
    f.truncate()
    zf = zipfile.ZipFile(f, mode="w")
    for info in infos:
        zf.filelist.append(info)
        zf.NameToInfo[info.filename] = info
    zf.start_dir = start
    zf.close()


def dtensor_local_box(d: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's local shard of DTensor ``d`` in its global tensor.

    ``DTensor.__create_chunk_list__`` is the hook torch.distributed.checkpoint
    uses for the same purpose; it is not a documented API. It costs about
    0.4 ms a leaf (torch builds an ``arange`` of the sharded dimension), which
    on a save's blocking path adds up over hundreds of leaves, so the box is
    cached: it depends only on the global shape, the placements, the mesh's
    shape and this rank's coordinate in it.
    """
    mesh = d.device_mesh
    coordinate = mesh.get_coordinate()
    cache_key = (
        tuple(d.shape),
        tuple(d.placements),
        tuple(mesh.shape),
        None if coordinate is None else tuple(coordinate),
    )
    box = _LOCAL_BOXES.get(cache_key)
    if box is None:
        (chunk,) = d.__create_chunk_list__()
        box = tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)
        if len(_LOCAL_BOXES) >= _LOCAL_BOXES_MAX:
            _LOCAL_BOXES.clear()
        _LOCAL_BOXES[cache_key] = box
    return box


_LOCAL_BOXES: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
_LOCAL_BOXES_MAX = 1 << 16


def dtensor_signature(d: Any) -> Any:
    """What a DTensor's placement on its mesh depends on, as one comparable value: its spec.

    ``DTensor._spec`` (a ``DTensorSpec``: the mesh, the placements and the
    global shape, stride and dtype) is not a documented API; the save's
    layout cache compares it between saves, which is cheap because a
    training state keeps its DTensors, and so their specs, from one save to
    the next. Where it is missing (another torch) the same facts are read
    through the public attributes.
    """
    spec = getattr(d, "_spec", None)
    if spec is not None:
        return spec
    return tuple(d.shape), d.dtype, tuple(d.placements), d.device_mesh


def dtensor_local(d: Any) -> Any:
    """DTensor ``d``'s local shard, without the autograd node that ``to_local()`` adds.

    ``to_local()`` goes through an autograd Function (about 30 us a call); a
    save only reads the values, so the local tensor itself is what it needs.
    ``_local_tensor`` is the attribute ``to_local()`` views; where it is
    missing (another torch), ``to_local()`` is used.
    """
    local = getattr(d, "_local_tensor", None)
    return local if local is not None else d.to_local()


def group_is_live(group: Any) -> bool:
    """Whether the torch.distributed ``group`` is still registered, i.e. not destroyed.

    ``destroy_process_group()`` removes groups from c10d's private registry
    (``_world.pg_map``); no public call tells whether a group object was
    destroyed. Where the registry is not found, the group is assumed live.
    """
    from torch.distributed import distributed_c10d as c10d

    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    return True if pg_map is None else group in pg_map
