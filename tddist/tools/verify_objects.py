"""``verify`` of a checkpoint on object storage: its holders, then every chunk read back and hashed.

A checkpoint there has no files to stat or map: its chunks are read through
the store's reader (ranged GETs), as a load reads them, each referenced one
from its holder (docs/format.md 5.10 and 13.3). A holder that is missing,
unreadable or replaced is a ``holder`` problem (its chunks are not read); a
chunk whose bytes fail their checksum a ``checksum`` problem; one that cannot
be read (a data object missing or of another size) an ``unreadable`` one.
``quick`` reads the manifest and opens the holders, and reads no data.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpointError
from ..manifest.model import Leaf
from ..storage.backends import open_checkpoint
from .report import CHECKSUM, HOLDER, UNREADABLE, Problem, VerifyReport, chunk_count, stored_bytes

if TYPE_CHECKING:
    from ..loading.read import ChunkSource


def verify_objects(path: str, *, quick: bool, num_threads: int, progress: Callable[[int], None] | None) -> VerifyReport:
    """Check the committed checkpoint at ``path`` (an ``s3://`` URL); return every problem found."""
    from ..loading.read import ChunkSource, open_holder  # imports torch

    tick = progress or (lambda n: None)
    problems: list[Problem] = []
    with open_checkpoint(path) as opened:
        m = opened.manifest
        bad: set[int] = set()
        for h, holder in enumerate(m.referenced(), start=1):
            try:
                open_holder(opened.path, m, h).close()
            except CorruptCheckpointError as e:
                problems.append(Problem(HOLDER, None, None, holder.name, f"{e}"))
                bad.add(h)
        if not quick:
            source = ChunkSource(opened, m)
            pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tddist-verify") if num_threads > 1 else None
            try:
                for leaf in m.leaves.values():
                    problems += _leaf_problems(source, leaf, bad, pool, tick)
            finally:
                if pool is not None:
                    pool.shutdown()
        return VerifyReport(
            path=opened.path,
            mode="quick" if quick else "full",
            layout=m.layout,
            world_size=m.world_size,
            chunks=chunk_count(m),
            nbytes=stored_bytes(m),
            problems=tuple(problems),
            packing=m.packing,
            non_finite=tuple(m.non_finite()),
        )


def _leaf_problems(
    source: ChunkSource, leaf: Leaf, bad: set[int], pool: ThreadPoolExecutor | None, tick: Callable[[int], None]
) -> list[Problem]:
    """The problems of ``leaf``'s chunks: each read (from its holder) and hashed, unless its holder is bad."""
    out = []
    for i, chunk in enumerate(leaf.chunks):
        if leaf.holder_of(i) in bad:
            continue
        try:
            source.verify(leaf, chunk, pool)
        except CorruptCheckpointError as e:
            kind = CHECKSUM if str(e).startswith("checksum mismatch") else UNREADABLE
            out.append(Problem(kind, leaf.key, chunk.rank, source.relpath(leaf, chunk), f"{e}"))
        tick(chunk.nbytes)
    source.release(leaf)
    return out
