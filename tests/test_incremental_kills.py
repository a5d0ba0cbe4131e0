"""Incremental saves SIGKILLed at steps of the commit while another process's retention runs over the root:
0 torn checkpoints, 0 dangling references, 0 referenced holders removed (``tests/incremental_kills.py``;
``scripts/incremental_campaign.py`` runs many more random cases)."""

from __future__ import annotations

import pytest

from tests import incremental_kills as ik


@pytest.mark.parametrize(
    ("point", "delay"),
    [(None, 0.0), (None, 0.05), ("midwrite", 0.05), ("vote", 0.05), ("manifest", 0.0), ("publish", 0.05)],
)
def test_incremental_save_killed_during_a_concurrent_clean_up(point, delay, tmp_path):
    """Whatever the clean-up removed first (the holder before the save pinned it, or nothing it pinned), and
    wherever the job died, every guarantee holds; a save that ran to its end committed."""
    out = ik.run_case(tmp_path, point, delay)
    assert out.problems == [], out
    assert ik.name(ik.NEWEST) in out.committed
    if point is None:
        assert out.exit_code in (0, 2), out  # 2: it failed, the holder changed under it before its pin
        assert out.exit_code == 2 or ik.name(ik.NEW) in out.committed
    else:
        assert out.exit_code in (-9, 2), out


def test_a_committed_reference_keeps_its_holder_through_the_clean_up(tmp_path):
    """The clean-up starts once the job pinned its holder: the save commits, references the holder, and the
    holder outlives every pass of a retention that would delete it but for the reference."""
    out = ik.run_case(tmp_path, None, 0.2)
    assert out.problems == [] and out.exit_code == 0, out
    assert out.committed == [ik.name(ik.HOLDER), ik.name(ik.NEW), ik.name(ik.NEWEST)]
