"""Convert checkpoints between tddist, torch.distributed.checkpoint (DCP), ``torch.save`` and safetensors.

``convert(src, dst)`` detects the source's format, reads it leaf by leaf
(one whole leaf in memory at a time: a sharded leaf is put together) and
writes the destination in the format ``to`` names or its suffix implies.
A tddist destination is written by ``tddist.save`` in one process (atomic,
checksummed); any other is written under a staging name beside ``dst`` and
renamed onto it at the end, so a failed conversion leaves nothing at
``dst``. The formats' readers and writers are in ``tddist.interop``.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import zipfile
from collections.abc import Callable
from typing import Any

import torch

from .. import format as fmt
from ..errors import CheckpointNotFoundError, InvalidArgumentError, InvalidDataError, TargetError, TddistError
from ..tools.pack import pack, staged, unpack
from . import FORMATS, Selection, Source, select
from .guard import DCP_METADATA_NAME, HF_INDEX_NAME, SAFETENSORS_SUFFIX, TORCH_SUFFIXES, hf_weights

logger = logging.getLogger(__name__)

_TORCH_SUFFIXES = TORCH_SUFFIXES
_SAFETENSORS_SUFFIX = SAFETENSORS_SUFFIX
#: Every suffix that names a format (``target_format``).
KNOWN_SUFFIXES = (fmt.ARCHIVE_SUFFIX, *TORCH_SUFFIXES, SAFETENSORS_SUFFIX)
#: What a DCP or sharded safetensors destination that ``overwrite`` may replace holds (nothing else).
_WRITTEN = {
    "dcp": re.compile(rf"{re.escape(DCP_METADATA_NAME)}|__\d+_\d+\.distcp"),
    "safetensors": re.compile(rf"model-\d{{5}}-of-\d{{5}}\.safetensors|{re.escape(HF_INDEX_NAME)}"),
}


def detect_format(path: str | os.PathLike) -> str:
    """The format of the checkpoint at ``path``: "tddist", "tdz", "dcp", "torch" or "safetensors".

    A directory is tddist (``tddist.json``), DCP (``.metadata``) or a Hugging
    Face directory (``model.safetensors``, as ``save_pretrained`` writes it,
    or shards and ``model.safetensors.index.json``); a file is a
    tddist archive (``.tdz``, or a zip holding ``tddist.json``), a
    ``torch.save`` file (``.pt``/``.pth``, or any other zip) or a
    ``.safetensors`` file.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        InvalidArgumentError: ``path`` is in none of these formats.
    """
    p = os.path.abspath(os.fspath(path))
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, fmt.MANIFEST_NAME)):
            return "tddist"
        if os.path.isfile(os.path.join(p, DCP_METADATA_NAME)):
            return "dcp"
        if hf_weights(p) is not None:
            return "safetensors"
        raise InvalidArgumentError(
            f"{p!r} is a directory without tddist.json, DCP's .metadata, model.safetensors or "
            f"model.safetensors.index.json; pass a tddist checkpoint, a DCP checkpoint directory or a Hugging Face "
            f"directory"
        )
    if not os.path.isfile(p):
        raise CheckpointNotFoundError(f"nothing to convert at {p!r}; check the source path")
    by_suffix = _format_of_suffix(p)
    if by_suffix is not None:
        return by_suffix
    if zipfile.is_zipfile(p):
        with zipfile.ZipFile(p) as z:
            return "tdz" if fmt.MANIFEST_NAME in z.namelist() else "torch"
    raise InvalidArgumentError(
        f"cannot tell the format of {p!r}; name it .tdz, .pt/.pth or .safetensors after what it holds"
    )


def target_format(dst: str | os.PathLike, to: str | None = None) -> str:
    """The format to write: ``to`` if given, else from the suffix of ``dst`` (a tddist directory when it has none).

    Raises:
        InvalidArgumentError: ``to`` is not a format, or ``to`` is None and
            ``dst`` ends in a suffix that names no format (``x.safetensor``):
            it is refused rather than taken for a tddist directory's name.
    """
    if to is not None:
        if to not in FORMATS:
            raise InvalidArgumentError(f"to={to!r} is not a format; use one of {', '.join(FORMATS)}")
        return to
    path = os.fspath(dst)
    found = _format_of_suffix(path)
    if found is not None:
        return found
    suffix = os.path.splitext(os.path.basename(path.rstrip(os.sep)))[1]
    if suffix:
        raise InvalidArgumentError(_unknown_suffix(path, suffix))
    return "tddist"


def _unknown_suffix(dst: str, suffix: str) -> str:
    """Why a destination ending in ``suffix`` is refused, with the suffix or ``to=`` that was probably meant."""
    close = difflib.get_close_matches(suffix.lower(), KNOWN_SUFFIXES, n=1, cutoff=0.6)
    if close:
        hint = f" (did you mean {close[0]}?)"
    elif suffix[1:].lower() in FORMATS:
        hint = f" (to={suffix[1:].lower()!r} writes that format)"
    else:
        hint = ""
    return (
        f"the destination {dst!r} ends in {suffix!r}, which names no format{hint}; end it in "
        f"{', '.join(KNOWN_SUFFIXES)}, or pass the format with to= (one of {', '.join(FORMATS)}; --to on the "
        f"command line): to='tddist' writes a tddist directory of that name"
    )


def _format_of_suffix(path: str) -> str | None:
    """The file format a path's suffix names (``.tdz``, ``.pt``/``.pth``, ``.safetensors``), or None."""
    lower = path.lower()
    if lower.endswith(fmt.ARCHIVE_SUFFIX):
        return "tdz"
    if lower.endswith(_TORCH_SUFFIXES):
        return "torch"
    if lower.endswith(_SAFETENSORS_SUFFIX):
        return "safetensors"
    return None


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str | None = None,
    *,
    prefix: str | None = None,
    dtype: torch.dtype | str | None = None,
    consolidate: bool | None = None,
    max_shard_size: int | str = "5GB",
    compression: Any = None,
    allow_pickle: bool = False,
    trust_pickle: bool = False,
    nested: bool = False,
    overwrite: bool = False,
    num_threads: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> str:
    """Convert the checkpoint ``src`` into ``dst`` in the format ``to``; returns ``dst``.

    Args:
        src: a tddist directory or ``.tdz`` archive, a DCP directory, a
            ``torch.save`` file, a ``.safetensors`` file or a Hugging Face
            sharded directory (detected, see ``detect_format``).
        dst: what to write; must not exist unless ``overwrite``.
        to: "tddist", "tdz", "dcp", "torch" or "safetensors"; None infers it
            from the suffix of ``dst`` (``.tdz``, ``.pt``/``.pth``,
            ``.safetensors``), a tddist directory when it has none (any other
            suffix is refused: pass ``to``). "safetensors"
            with a ``dst`` that has no ``.safetensors`` suffix writes a
            Hugging Face sharded directory.
        prefix: convert only the keys under this prefix, and strip it: key
            parts joined with "/" (``"model/"``), possibly ending inside a
            flat name (``"model."``).
        dtype: cast floating-point leaves to this dtype (``"bfloat16"``).
        consolidate: True (the default, except below) writes each sharded
            leaf as one full tensor. A tddist directory converted to an
            archive or back, without ``prefix`` or ``dtype``, keeps the
            saving ranks' shards (``pack``/``unpack``) unless ``consolidate=True``.
        max_shard_size: the largest shard file of a sharded safetensors
            directory: bytes, or a size such as ``"5GB"`` or ``"500MiB"``.
        compression: a ``.tdz`` destination's compression, as in ``save``.
        allow_pickle: read pickled objects (``torch.load`` without
            ``weights_only``, pickled tddist values), and store values that
            JSON cannot hold with pickle. Only for sources you trust.
        trust_pickle: unpickle a DCP source's ``.metadata`` even when it names
            objects beyond what DCP's metadata is made of (a pickle can run
            code). Without it, such metadata is refused; DCP's own metadata
            needs no trust (see ``tddist.interop.dcp``).
        nested: keep the nesting of a ``torch.save`` or DCP source as nested
            keys (``("model", "tok.weight")``) instead of one flat name per
            leaf (``"model.tok.weight"``), so that the result loads into the
            state it was saved from (``CheckpointManager.restore``). A tddist
            source is nested already; a safetensors one has flat names only.
        overwrite: replace an existing ``dst`` of the same format.
        num_threads: threads that read and write a tddist checkpoint.
        progress: called as ``progress(done_bytes, total_bytes)`` after each leaf.

    Returns:
        ``dst`` as an absolute path.

    Raises:
        CheckpointNotFoundError: nothing is at ``src``.
        InvalidArgumentError: an unknown format or destination suffix, an
            unreadable source format, a bad option, pickled objects without
            ``allow_pickle``, or DCP metadata that needs ``trust_pickle``.
        InvalidDataError: the source holds what the destination cannot store.
        TargetError: ``dst`` exists (without ``overwrite``) or may not be replaced.
        CorruptCheckpointError: a tddist source fails its checksums.
    """
    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    if src == dst:
        raise InvalidArgumentError(f"source and destination are both {src!r}; convert into another path")
    kind = detect_format(src)
    out = target_format(dst, to)
    cast = _dtype(dtype)
    if nested and kind == "safetensors":
        raise InvalidArgumentError(
            f"nested=True keeps the nesting of torch.save and DCP sources; the safetensors source {src!r} has flat "
            f"names only: drop nested (a safetensors file that tddist exported is read nested anyway)"
        )
    _check_destination(dst, out, overwrite)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if kind in ("tddist", "tdz") and out in ("tddist", "tdz") and prefix is None and cast is None and not consolidate:
        if kind == "tddist" and out == "tdz":
            pack(src, dst, compression=compression, num_threads=num_threads)
            return _done(src, dst, kind, out, progress)
        if kind == "tdz" and out == "tddist":
            unpack(src, dst, num_threads=num_threads)
            return _done(src, dst, kind, out, progress)
    if consolidate is False:
        raise InvalidArgumentError(
            f"consolidate=False keeps the saving ranks' shards only from a tddist directory to an archive or back "
            f"(without prefix or dtype); {kind} -> {out} always writes whole leaves: drop consolidate=False"
        )
    source = _open(src, kind, allow_pickle, trust_pickle, nested, num_threads)
    try:
        _convert(source, dst, out, prefix, cast, max_shard_size, compression, allow_pickle, num_threads, progress)
    finally:
        source.close()  # a tddist source's pinned generation, also when the conversion failed
    logger.info("converted %s (%s) into %s (%s)", src, kind, dst, out)
    return dst


def _convert(
    source: Source,
    dst: str,
    out: str,
    prefix: str | None,
    cast: torch.dtype | None,
    max_shard_size: int | str,
    compression: Any,
    allow_pickle: bool,
    num_threads: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Write the selection of the opened ``source`` into ``dst``, reporting ``progress`` after each leaf."""
    done = 0
    sel: Selection

    def step(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, sel.total_bytes)

    sel = select(source, prefix, cast, step)
    _write(sel, dst, out, max_shard_size, compression, allow_pickle, num_threads)


def _done(src: str, dst: str, kind: str, out: str, progress: Callable[[int, int], None] | None) -> str:
    if progress is not None:
        from ..storage.backends import read_manifest
        from ..tools.verify import stored_bytes

        total = stored_bytes(read_manifest(dst))
        progress(total, total)
    logger.info("converted %s (%s) into %s (%s)", src, kind, dst, out)
    return dst


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidArgumentError(
            f"dtype={dtype!r} is not a floating-point torch dtype; use one such as 'bfloat16', 'float16' or 'float32'"
        )
    return value


def _check_destination(dst: str, out: str, overwrite: bool) -> None:
    """Refuse an existing ``dst`` unless ``overwrite``, and then only one of the format being written."""
    if not os.path.lexists(dst):
        return
    if not overwrite:
        raise TargetError(f"{dst!r} exists; pass overwrite=True (--force) to replace it, or choose another destination")
    if os.path.islink(dst):
        raise TargetError(f"{dst!r} is a symbolic link; pass the real path or another destination")
    if out in ("tddist", "tdz"):
        return  # save (or pack/unpack) replaces only a tddist checkpoint
    try:
        existing = detect_format(dst)
    except InvalidArgumentError:
        existing = None
    same_shape = os.path.isfile(dst) == _writes_file(dst, out)
    if existing != out or not same_shape or (os.path.isfile(dst) and not _file_content_is(dst, out)):
        raise TargetError(
            f"{dst!r} exists and is not a {out} checkpoint; tddist replaces only a checkpoint of the format it "
            f"writes: choose another destination or remove it yourself"
        )
    if os.path.isdir(dst):
        others = sorted(n for n in os.listdir(dst) if not _WRITTEN[out].fullmatch(n))
        if others:
            raise TargetError(
                f"{dst!r} holds {others[:5]} beside the {out} checkpoint, which replacing it would delete; choose "
                f"another destination or move them away"
            )


def _file_content_is(path: str, out: str) -> bool:
    """Whether the file at ``path`` starts as format ``out`` does (a zip or a pickle; a safetensors header)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if out == "torch":
        return zipfile.is_zipfile(path) or head[:1] == b"\x80"
    size = os.path.getsize(path)
    return len(head) == 9 and int.from_bytes(head[:8], "little") <= size - 8 and head[8:9] == b"{"


def _writes_file(dst: str, out: str) -> bool:
    """Whether format ``out`` at ``dst`` is one file (a DCP or sharded safetensors checkpoint is a directory)."""
    return out == "torch" or (out == "safetensors" and dst.lower().endswith(_SAFETENSORS_SUFFIX))


def _open(src: str, kind: str, allow_pickle: bool, trust_pickle: bool, nested: bool, num_threads: int) -> Source:
    if kind in ("tddist", "tdz"):
        from .native import TddistSource

        return TddistSource(src, allow_pickle, num_threads)
    if kind == "dcp":
        from .dcp import DcpSource

        return DcpSource(src, allow_pickle, trust_pickle, nested)
    if kind == "torch":
        from .torch_file import TorchFileSource

        return TorchFileSource(src, allow_pickle, nested)
    from .hf import SafetensorsSource

    return SafetensorsSource(src)


def _write(
    sel: Selection,
    dst: str,
    out: str,
    max_shard_size: int | str,
    compression: Any,
    allow_pickle: bool,
    num_threads: int,
) -> None:
    if out in ("tddist", "tdz"):
        from .native import write_tddist

        write_tddist(
            sel, dst, archive=out == "tdz", compression=compression, allow_pickle=allow_pickle, num_threads=num_threads
        )
        return
    if compression is not None:
        raise InvalidArgumentError(f"compression={compression!r} is for .tdz destinations; {out} has none")
    write: Callable[[Selection, str], None]
    if out == "torch":
        from .torch_file import write_torch

        write = write_torch
    elif out == "dcp":
        from .dcp import write_dcp

        write = write_dcp
    elif _writes_file(dst, out):
        from .hf import write_safetensors

        write = write_safetensors
    else:
        from .hf import parse_size, write_sharded

        size = parse_size(max_shard_size)
        write = lambda s, path: write_sharded(s, path, size)
    with staged(dst) as staging:
        try:
            write(sel, staging)
        except TddistError:
            raise
        except (RuntimeError, ValueError) as e:  # torch's and DCP's own errors, named
            raise InvalidDataError(f"writing {out} into {dst!r} failed: {e}") from e
