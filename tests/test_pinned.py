"""A checkpoint path that is neither a directory nor a regular file (a FIFO, a device) is refused once: the
descriptor opened to look at it is closed exactly once, so no other file of the caller is closed behind its
back, and the command line prints no "Exception ignored" about a bad descriptor."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

import tddist
from tddist.storage.pinned import PinnedCheckpoint


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_a_device_is_refused_and_its_descriptor_closed_once(tmp_path, kind):
    path = str(tmp_path / "p")
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = "/dev/null"
    with pytest.raises(tddist.CheckpointNotFoundError, match="neither a directory nor a regular file"):
        tddist.load(path, shard=None)
    other = tmp_path / "mine"
    other.write_bytes(b"x")
    with pytest.raises(tddist.CheckpointNotFoundError) as refused:  # its traceback keeps the refused pin alive
        PinnedCheckpoint(path)
    with open(other, "rb") as f:  # the lowest free number: the one the refused open had
        del refused
        gc.collect()  # the refused pin is freed now: a second close of its number would close this file
        os.fstat(f.fileno())  # EBADF if it was closed behind our back
        assert f.read() == b"x"


def test_the_command_line_says_nothing_of_a_bad_descriptor(tmp_path):
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    for cmd in (["info", str(fifo)], ["verify", str(fifo)]):
        done = subprocess.run([sys.executable, "-m", "tddist.cli", *cmd], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done
        assert "neither a directory nor a regular file" in done.stderr + done.stdout, done
        assert "Exception ignored" not in done.stderr and "Bad file descriptor" not in done.stderr, done.stderr
