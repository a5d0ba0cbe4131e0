"""A load during an overwrite returns the old or the new checkpoint whole, or a retryable error; never a mix.

The checkpoint is pinned when it is opened (``tddist/pinned.py``): manifest and
data come from one generation whatever the writer renames meanwhile, and the
ranks of a multi-rank load agree on the generation they read.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from tensordict import TensorDict

import tddist
from tddist.core.sharding import full_box
from tddist.errors import CheckpointChangedError, CorruptCheckpointError, ManifestError
from tddist.loading.read import read_leaves
from tddist.storage.backends import open_checkpoint
from tests.launch_util import REPO

LAYOUTS = {
    "packed": ("ckpt", {}),
    "memmap": ("ckpt", {"layout": "memmap"}),
    "archive": ("ckpt.tdz", {}),
}


def generation_td(g: int, rows: int = 64) -> TensorDict:
    """Every element of every leaf is ``g``: a mix of two generations shows as two values."""
    return TensorDict(
        {
            "a": torch.full((rows, 256), float(g)),
            "b": torch.full((rows,), g, dtype=torch.int64),
            "n": {"c": torch.full((rows, 3, 7), float(g), dtype=torch.float64), "d": torch.full((rows,), g % 2 == 0)},
        },
        batch_size=[rows],
    )


def generations_in(td: TensorDict) -> set[float]:
    out = set()
    for key in ("a", "b", ("n", "c")):
        out.update(float(v) for v in td[key].unique())
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pinned_checkpoint_reads_the_generation_it_opened(tmp_path, layout):
    """Opened, then overwritten: the mapped data is the old generation whole; unopened files of a removed
    directory tree are a CheckpointChangedError (retry), never corruption."""
    name, kw = LAYOUTS[layout]
    target = str(tmp_path / name)
    tddist.save(generation_td(1), target, **kw)
    with open_checkpoint(target) as opened:
        m = opened.manifest
        leaves = list(m.leaves.values())
        first = read_leaves(opened, m, [(lf, full_box(lf.shape)) for lf in leaves], 1, True)
        tddist.save(generation_td(2), target, **kw)  # exchange, then the old generation's tree is removed
        assert all(t.float().unique().tolist() in ([1.0], [0.0]) for t in first), "mapped data stays the old one"
        if layout == "archive":  # the open archive file stays readable after it is replaced and unlinked
            again = read_leaves(opened, m, [(lf, full_box(lf.shape)) for lf in leaves], 1, True)
            assert all(t.float().unique().tolist() in ([1.0], [0.0]) for t in again)
        else:  # files of the removed tree that were not open yet: retry, not corruption
            with pytest.raises(CheckpointChangedError, match="load it again"):
                read_leaves(opened, m, [(lf, full_box(lf.shape)) for lf in leaves], 1, True)
    assert generations_in(tddist.load(target, shard=None)) == {2.0}


WRITER = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {repo!r})
    import tddist
    from tests.test_consistent_reads import generation_td
    target, stop, kw = sys.argv[1], sys.argv[2], eval(sys.argv[3])
    g = 2
    while not os.path.exists(stop):
        tddist.save(generation_td(g), target, **kw)
        with open(stop + ".count", "w") as f:
            f.write(str(g - 1))
        g += 1
    print(g - 2, flush=True)
    """
)


#: The writer's overwrites each concurrent test waits for, and its no-hang bound in seconds.
OVERWRITES, BOUND = 8, 240.0


def overwrites(stop) -> int:
    try:
        return int((stop.parent / (stop.name + ".count")).read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loads_during_overwrites_are_never_mixed(tmp_path, layout):
    """A writer process overwrites the checkpoint in a loop while this process loads it, verified and not:
    every load is one generation whole; no false CorruptCheckpointError; retries hide replacements."""
    name, kw = LAYOUTS[layout]
    target = str(tmp_path / name)
    tddist.save(generation_td(1), target, **kw)
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(repo=str(REPO)), target, str(stop), repr(kw)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    loads, seen, changed = 0, set(), 0
    deadline = time.monotonic() + BOUND
    try:
        while overwrites(stop) < OVERWRITES or loads < 10:
            assert time.monotonic() < deadline, f"no progress: {overwrites(stop)} overwrites, {loads} loads"
            try:
                td = tddist.load(target, shard=None, verify=loads % 2 == 0)
            except CheckpointChangedError:
                changed += 1  # replaced three times during one load: retryable, and said so
                continue
            found = generations_in(td)
            assert len(found) == 1, f"load {loads} mixed generations {sorted(found)}"
            seen |= found
            loads += 1
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err[-3000:]
    saves = int(out.split()[-1])
    assert saves >= OVERWRITES and loads >= 10, (saves, loads)
    assert len(seen) >= 2, f"{loads} loads during {saves} overwrites saw only generations {seen}"
    assert changed <= loads, (changed, loads)


def test_multi_rank_load_reads_one_generation(tmp_path):
    """Thread ranks load while another process overwrites: the ranks' parts always come from one generation."""
    target = str(tmp_path / "ckpt")
    tddist.save(generation_td(1), target)
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(repo=str(REPO)), target, str(stop), "{}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    rounds = 0
    deadline = time.monotonic() + BOUND
    try:
        while overwrites(stop) < OVERWRITES or rounds < 5:
            assert time.monotonic() < deadline, f"no progress: {overwrites(stop)} overwrites, {rounds} rounds"

            def load(comm):
                try:
                    return generations_in(tddist.load(target, comm=comm, verify=True))
                except CheckpointChangedError:
                    return None

            results = tddist.run_threads(2, load)
            errors = [r for r in results if isinstance(r, BaseException)]
            assert not errors, f"a load during an overwrite raised {errors[0]!r}"
            if results[0] is None:
                assert results == [None, None], "ranks must end the same way"
                continue
            assert len(results[0] | results[1]) == 1, f"ranks read different generations: {results}"
            rounds += 1
    finally:
        stop.touch()
        _out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err[-3000:]
    assert rounds >= 5
    assert overwrites(stop) >= OVERWRITES


def test_edited_manifest_fails_its_own_checksum(tmp_path):
    """A dtype edited in tddist.json would reinterpret the data: the manifest's checksum refuses it."""
    target = tmp_path / "ckpt"
    tddist.save(generation_td(1), str(target))
    path = target / "tddist.json"
    raw = path.read_bytes()
    assert raw.startswith(b'{"manifest_checksum":"')
    edited = raw.replace(b'"float32"', b'"int32"', 1)
    assert edited != raw
    path.write_bytes(edited)
    with pytest.raises(ManifestError, match="fails its own checksum"):
        tddist.load(str(target))
    stripped = b"{" + raw[raw.index(b'",') + 2 :]  # the checksum removed: a version-3 manifest must carry it
    path.write_bytes(stripped)
    with pytest.raises(ManifestError, match="lacks its manifest_checksum"):
        tddist.load(str(target))


def test_corrupt_manifest_is_not_reported_as_data_corruption(tmp_path):
    """The manifest's checksum is checked before parsing: a flipped byte is a ManifestError."""
    target = tmp_path / "ckpt"
    tddist.save(generation_td(1), str(target))
    path = target / "tddist.json"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ManifestError):
        tddist.load(str(target))
    assert not issubclass(ManifestError, CorruptCheckpointError)
    assert os.path.isdir(target)


SAVER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    import tddist
    from tests.test_consistent_reads import generation_td, generations_in

    me, saves, targets = int(sys.argv[1]), int(sys.argv[2]), eval(sys.argv[3])
    wrong, errors = dict.fromkeys(targets, 0), dict.fromkeys(targets, 0)
    for i in range(saves):
        g = me * 100000 + i  # this process's generations only
        for target, kw in targets.items():
            try:
                got = tddist.save(generation_td(g, rows=4), target, **kw)
            except tddist.TddistError as e:
                errors[target] += 1
                print("error:", type(e).__name__, e, file=sys.stderr)
                continue
            wrong[target] += generations_in(got) != {{float(g)}}
    print(repr({{t: (wrong[t], errors[t]) for t in targets}}))
    """
)


def race_two_savers(targets: dict[str, dict], saves: int) -> None:
    """Two processes save to every one of ``targets`` in turn, ``saves`` times: every save must return its own
    generation and none may raise; the target ends as the last save of one of them."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER.format(repo=str(REPO)), str(me), str(saves), repr(targets)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in (1, 2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
        for target, (wrong, errors) in eval(out).items():
            assert (wrong, errors) == (0, 0), (
                f"{target}: {wrong} saves returned another's data, {errors} raised:\n{err[-3000:]}"
            )
    for target in targets:
        found = generations_in(tddist.load(target, shard=None, verify=True))
        assert found <= {100000 + saves - 1, 200000 + saves - 1}, (target, found)


def test_a_save_returns_what_it_committed_while_another_process_saves_to_the_same_path(tmp_path):
    """Two processes save to one target in a loop (each of the three file-system stores): each save returns
    exactly its own data (read back through the staging area it pinned before publishing, or from memory),
    and none raises, although every commit races with the other process's overwrite and its removal of
    what it replaced."""
    race_two_savers({str(tmp_path / f"{layout}-{name}"): kw for layout, (name, kw) in LAYOUTS.items()}, saves=40)
