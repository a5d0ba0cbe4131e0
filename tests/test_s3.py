"""Checkpoints on S3-compatible object storage, against a real S3 server (SeaweedFS on loopback).

The server is the session fixture ``s3_env`` (tests/conftest.py,
tests/s3_server.py); each test gets its own prefix in one bucket (the ``s3`` fixture there). Multi-rank saves run on
the thread communicator (``tddist.run_threads``), one job on torchrun (gloo)
and one with a killed rank on separate processes (``tests/launch_util.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from tensordict import NonTensorData, TensorDict

import tddist
from tddist._faults import inject
from tddist.errors import CheckpointPinnedError
from tddist.storage.backends import store_for
from tddist.storage.s3.root import delete_prefix
from tests.helpers import assert_td_equal
from tests.launch_util import REPO, run_job

LAYOUTS = ["directory", "archive"]


def url(bucket: str, layout: str, name: str = "ckpt") -> str:
    return f"s3://{bucket}/run/{name}" + (".tdz" if layout == "archive" else "")


def keys(client, where: str) -> list[str]:
    """The keys under ``where`` ("BUCKET/PREFIX"), relative to the prefix."""
    return sorted(sizes(client, where))


def sizes(client, where: str) -> dict[str, int]:
    bucket, prefix = where.split("/")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1 :]: o["Size"] for page in pages for o in page.get("Contents", [])}


def uploads(client, where: str) -> list[str]:
    """The keys of the unfinished multipart uploads under ``where``, relative to the prefix."""
    bucket, prefix = where.split("/")
    found = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    return [u["Key"][len(prefix) + 1 :] for u in found]


def sample(rank: int = 0, n: int = 5) -> TensorDict:
    """Several dtypes, nested nodes (sharded rows under ``batch``), replicated and non-tensor values."""
    g = torch.Generator().manual_seed(rank)
    batch = TensorDict(
        obs=torch.randn(n, 3, generator=g),
        done=torch.rand(n, generator=g) > 0.5,
        nested=TensorDict(ids=torch.arange(n) + 10 * rank, half=torch.randn(n, 2, generator=g).bfloat16(),
                          batch_size=[n]),
        batch_size=[n],
    )  # fmt: skip
    model = TensorDict(w=torch.linspace(0, 1, 7), step=torch.tensor(3))
    return TensorDict(batch=batch, model=model, tag=NonTensorData("run-1"), batch_size=[])


def joined(parts: list[TensorDict]) -> TensorDict:
    """The global TensorDict of ranks that saved ``parts``: rows concatenated, replicas from rank 0."""
    out = parts[0].clone()
    out["batch"] = torch.cat([p["batch"] for p in parts])
    return out


@pytest.mark.parametrize("layout", [*LAYOUTS, "memmap"])
def test_one_process_round_trip_is_bit_exact(s3, layout):
    client, bucket = s3
    target = url(bucket, layout)
    td = sample()
    saved = tddist.save(td, target, layout="memmap" if layout == "memmap" else None)
    size = sizes(client, bucket).get("run/ckpt.tdz", 0)
    assert_td_equal(saved, td, "returned by save")
    assert_td_equal(tddist.load(target, shard=None, verify=True), td, "loaded")
    m = tddist.read_manifest(target)
    assert m.layout == ("archive" if layout == "archive" else "directory") and m.world_size == 1
    if layout == "archive":  # one small rank: one PUT, no padding to S3's 5 MiB part size
        assert list(sizes(client, bucket).items()) == [("run/ckpt.tdz", size)] and size < 64 * 1024
    else:  # the manifest, and under one generation the index and the data
        found = keys(client, bucket)
        assert found[-1] == "run/ckpt/tddist.json" and all(k.startswith("run/ckpt/tddist-gen-") for k in found[:-1])
    assert uploads(client, bucket) == []


def test_downloaded_archive_loads_from_a_file(s3, tmp_path):
    """The object is a .tdz of docs/format.md section 3: a copy on disk loads, verified, with tddist.load."""
    client, bucket = s3
    td = sample(n=1_500_000)  # about 30 MiB of rows
    tddist.save(td, url(bucket, "archive"), compression="zstd")
    b, prefix = bucket.split("/")
    client.download_file(b, f"{prefix}/run/ckpt.tdz", str(tmp_path / "copy.tdz"))
    assert_td_equal(tddist.load(tmp_path / "copy.tdz", shard=None, verify=True), td, "downloaded")
    assert_td_equal(tddist.load(url(bucket, "archive"), shard=None, verify=True), td, "from S3")


@pytest.mark.parametrize("saving_ranks", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_save_three_ranks_and_one_process_load(s3, layout, saving_ranks):
    """Saved by 2 or 4 ranks (uneven rows), loaded on 3 ranks and in one process, verified, bit-exact."""
    _client, bucket = s3
    target = url(bucket, layout, f"ckpt{saving_ranks}")
    parts = (
        [sample(0, 4), sample(1, 7)] if saving_ranks == 2 else [sample(0, 4), sample(1, 1), sample(2, 3), sample(3, 3)]
    )
    whole = joined(parts)

    def save(comm):
        tddist.save(parts[comm.rank], target, comm=comm, num_threads=2)

    assert not any(isinstance(r, BaseException) for r in tddist.run_threads(saving_ranks, save))
    everything = tddist.load(target, shard=None, verify=True)
    assert_td_equal(everything, whole, "one process")
    got = tddist.run_threads(3, lambda comm: tddist.load(target, comm=comm, verify=True))
    assert not any(isinstance(r, BaseException) for r in got), got
    rows = torch.tensor_split(torch.arange(11), 3)
    for r, td in enumerate(got):
        expected = whole.clone()
        expected["batch"] = whole["batch"][rows[r]]
        assert_td_equal(td, expected, f"rank {r} of 3")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_listing_during_a_save_never_shows_a_partial_checkpoint(s3, layout):
    """Listings taken all through a save (rank 0 waits a second between the votes and the commit): before
    the commit they show staged data or an open upload but no manifest (directory) and no object (archive);
    whenever the manifest or the object shows, everything it needs shows too, at its final size."""
    client, bucket = s3
    target = url(bucket, layout)
    seen: list[tuple[dict[str, int], list[str]]] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append((sizes(client, bucket), uploads(client, bucket)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with inject("validate", 0, "delay"):
            results = tddist.run_threads(2, lambda comm: tddist.save(sample(comm.rank), target, comm=comm))
    finally:
        done.set()
        watcher.join()
    assert not any(isinstance(r, BaseException) for r in results), results
    final = sizes(client, bucket)
    assert uploads(client, bucket) == []
    if layout == "archive":
        committed = [listed for listed, _ in seen if "run/ckpt.tdz" in listed]
        assert all(listed["run/ckpt.tdz"] == final["run/ckpt.tdz"] for listed in committed)
        in_progress = [listed for listed, ups in seen if "run/ckpt.tdz" in ups]
        assert in_progress and all("run/ckpt.tdz" not in listed for listed in in_progress)
    else:
        manifest = "run/ckpt/tddist.json"
        needed = {k: v for k, v in final.items() if k != manifest}
        assert len(needed) == 3  # the index and two data files, of one generation
        for listed, _ in seen:
            if manifest in listed:
                assert all(listed.get(k) == v for k, v in needed.items()), "a partial checkpoint was listed"
        staged = [listed for listed, _ in seen if manifest not in listed and any(k in listed for k in needed)]
        assert staged, "no listing was taken while the save was in progress"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_failure_on_one_rank_leaves_nothing_and_keeps_the_old_checkpoint(s3, layout):
    client, bucket = s3
    target = url(bucket, layout)
    old = [sample(0), sample(1)]
    assert not any(
        isinstance(r, BaseException) for r in tddist.run_threads(2, lambda c: tddist.save(old[c.rank], target, comm=c))
    )
    before = keys(client, bucket)
    with inject("write", 1, "raise"):
        results = tddist.run_threads(2, lambda c: tddist.save(sample(c.rank + 5), target, comm=c))
    assert all(isinstance(r, tddist.errors.InjectedFault) for r in results), results  # every rank, the same error
    assert keys(client, bucket) == before and uploads(client, bucket) == []  # aborted: nothing staged is left
    assert_td_equal(tddist.load(target, shard=None, verify=True), joined(old), "the old checkpoint")
    assert tddist.recover(target) == []


@pytest.mark.multirank
def test_a_killed_rank_leaves_nothing_visible_and_recover_cleans_up(s3, s3_env, tmp_path):
    """Rank 0 is SIGKILLed after writing its part (one job per layout, both at once): nothing is committed,
    the survivor raises, and the leftovers (staged objects, or the open multipart upload) are there until
    ``recover`` removes them."""
    client, bucket = s3
    jobs = {}

    def crash(layout: str) -> None:
        jobs[layout] = run_job(
            "spawn", 2, REPO / "tests" / "s3_rank.py", ["crash", bucket, url(bucket, layout)], tmp_path / layout,
            timeout=120, env={**s3_env, "TDDIST_FAULT": "write:0:kill"},
        )  # fmt: skip

    threads = [threading.Thread(target=crash, args=(layout,)) for layout in LAYOUTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for layout, job in jobs.items():
        assert job.returncodes[0] == -9 and job.returncodes[1] == 0, (layout, job.reports, job.output[-3000:])
        assert job.reports[1]["status"] == "ok" and "Error" in job.reports[1]["error"], job.reports
        with pytest.raises(tddist.CheckpointNotFoundError):
            tddist.load(url(bucket, layout), shard=None)
    listed = keys(client, bucket)
    assert uploads(client, bucket) == ["run/ckpt.tdz"] and "run/ckpt.tdz" not in listed
    assert any("/tddist-gen-" in k for k in listed) and not any(k.endswith("tddist.json") for k in listed)
    for layout in LAYOUTS:
        assert tddist.recover(url(bucket, layout)), layout
    assert keys(client, bucket) == [] and uploads(client, bucket) == []
    assert all(tddist.recover(url(bucket, layout)) == [] for layout in LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_overwrite_keeps_readers_consistent(s3, layout):
    """Loads running while a writer overwrites the checkpoint get one generation whole (every value equal to
    that generation's number) or CheckpointChangedError; old generations are deleted after each commit."""
    client, bucket = s3
    target = url(bucket, layout)

    def gen(i: int) -> TensorDict:
        return TensorDict(a=torch.full((64, 1024), float(i)), b=torch.full((8,), float(i)), batch_size=[])

    tddist.save(gen(0), target)
    stop = threading.Event()
    written = []

    def overwrite():
        for i in range(1, 6):
            tddist.save(gen(i), target)
            written.append(i)
        stop.set()

    w = threading.Thread(target=overwrite)
    w.start()
    seen, changed = set(), 0
    try:
        while not stop.is_set():
            try:
                td = tddist.load(target, shard=None, verify=True)
            except tddist.CheckpointChangedError:
                changed += 1
                continue
            values = torch.cat([td["a"].flatten(), td["b"]]).unique()
            assert len(values) == 1, f"a load mixed generations: {values}"
            seen.add(int(values.item()))
    finally:
        w.join()
    assert written == [1, 2, 3, 4, 5] and seen, (written, seen)
    assert_td_equal(tddist.load(target, shard=None), gen(5), "the last generation")
    if layout == "directory":  # only the committed generation is left
        assert len({k.split("/")[2] for k in keys(client, bucket) if "/tddist-gen-" in k}) == 1


def test_throttling_503_is_retried(s3):
    """A 503 SlowDown for the first requests (injected at the transport, before anything is sent) is retried
    by botocore's standard retry mode, and the save and load succeed."""
    from botocore.awsrequest import AWSResponse

    client, bucket = s3
    target = url(bucket, "directory")
    refused = []

    class Body:
        def stream(self, **_kw):
            yield b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"

    def slow_down(request, **_kw):
        if len(refused) < 3:
            refused.append(request.url)
            return AWSResponse(request.url, 503, {}, Body())
        return None

    client.meta.events.register_first("before-send.s3", slow_down)
    try:
        tddist.save(sample(), target)
    finally:
        client.meta.events.unregister("before-send.s3", slow_down)
    assert len(refused) == 3
    assert_td_equal(tddist.load(target, shard=None, verify=True), sample(), "after retries")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unreachable_endpoint_missing_bucket_refused_credentials(s3, monkeypatch, layout):
    """Each is a TddistError on every rank saying what failed and how to fix it."""
    _client, bucket = s3

    def both_ranks(target: str) -> list:
        return tddist.run_threads(2, lambda c: tddist.save(sample(c.rank), target, comm=c))

    got = both_ranks(url("tddist-no-such-bucket/x", layout))
    assert all(isinstance(e, tddist.TargetError) and "does not exist" in str(e) for e in got), got
    with pytest.raises(tddist.CheckpointNotFoundError, match="does not exist"):
        tddist.load(url("tddist-no-such-bucket/x", layout), shard=None)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    got = both_ranks(url(bucket, layout))
    assert all(isinstance(e, tddist.TargetError) and "credentials were refused" in str(e) for e in got), got
    with pytest.raises(tddist.StorageError, match="credentials were refused"):
        tddist.load(url(bucket, layout), shard=None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    got = both_ranks(url(bucket, layout))
    assert all(isinstance(e, tddist.TargetError) and "cannot be reached" in str(e) for e in got), got
    assert "rank 0" in str(got[0]) and "AWS_ENDPOINT_URL" in str(got[0])


def test_without_boto3_tddist_works_and_s3_says_how_to_install():
    code = (
        "import sys; sys.modules['boto3'] = None\n"
        "import torch, tddist\n"
        "tddist.save({'w': torch.ones(2)}, 'local')\n"
        "assert torch.equal(tddist.load('local', shard=None)['w'], torch.ones(2))\n"
        "try:\n"
        "    tddist.save({'w': torch.ones(2)}, 's3://bucket/key')\n"
        "except tddist.TddistError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=os.environ.get("TMPDIR", "/tmp")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pip install 'tddist[s3]'" in r.stdout


@pytest.mark.multirank
def test_torchrun_job_saves_and_loads_both_layouts(s3, s3_env, tmp_path):
    _client, bucket = s3
    job = run_job(
        "torchrun", 2, REPO / "tests" / "s3_rank.py", ["roundtrip", bucket], tmp_path, timeout=180, env=s3_env
    )
    job.assert_ok(2)
    assert job.returncodes == [0]
    full = tddist.load(f"s3://{bucket}/job.tdz", shard=None, verify=True)
    assert full["batch", "x"].shape == (7, 4) and full["batch", "x"][3:, 0].tolist() == [100.0, 104.0, 108.0, 112.0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_gets_only_the_bytes_it_reads(s3, layout):
    """A row range is fetched with ranged GETs of those rows (plus the manifest and index; in an archive, the end
    of the object and the entry's local header); with verify=True the whole chunk is fetched, since its checksum
    covers all of it."""
    client, bucket = s3
    target = url(bucket, layout)
    rows = torch.arange(1000 * 1024, dtype=torch.float32).reshape(1000, 1024)  # 4 MiB, one chunk
    tddist.save(TensorDict(x=rows, batch_size=[1000]), target)
    got: list[int] = []

    def count(parsed, **_kw):
        got.append(int(parsed.get("ContentLength", 0)))

    client.meta.events.register("after-call.s3.GetObject", count)
    try:
        part = tddist.load(target, shard=(100, 200))
        data_bytes = sum(got)
        got.clear()
        verified = tddist.load(target, shard=(100, 200), verify=True)
    finally:
        client.meta.events.unregister("after-call.s3.GetObject", count)
    assert torch.equal(part["x"], rows[100:200]) and torch.equal(verified["x"], rows[100:200])
    slack = (64 if layout == "directory" else 128) * 1024  # an archive's pin reads the last 64 KiB of it
    assert 100 * 4096 <= data_bytes < 100 * 4096 + slack, data_bytes
    assert sum(got) >= 1000 * 4096


def test_return_early_and_refused_options(s3):
    """An asynchronous save commits in the background; options object storage cannot honour are refused."""
    _client, bucket = s3
    target = url(bucket, "directory")
    fut = tddist.save(sample(), target, return_early=True)
    assert_td_equal(fut.result(timeout=60), sample(), "returned by the future")
    assert_td_equal(tddist.load(target, shard=None), sample(), "loaded")
    for kwargs in ({"atomic": False}, {"archive": True}, {"return_early": True, "snapshot_budget": 1 << 30}):
        with pytest.raises(tddist.InvalidArgumentError):
            tddist.save(sample(), target, **kwargs)
    with pytest.raises(tddist.InvalidArgumentError, match="does not name a checkpoint"):
        tddist.save(sample(), f"s3://{bucket.split('/')[0]}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_returns_its_shard_without_downloading_it(s3, layout):
    """save returns this rank's shard read back from what it uploaded (a copy in memory), not a download; the
    returned tensors are not the caller's."""
    client, bucket = s3
    td = TensorDict(x=torch.randn(1024, 1024), batch_size=[1024])  # 4 MiB
    got: list[int] = []

    def count(parsed, **_kw):
        got.append(int(parsed.get("ContentLength", 0)))

    client.meta.events.register("after-call.s3.GetObject", count)
    try:
        saved = tddist.save(td, url(bucket, layout))
    finally:
        client.meta.events.unregister("after-call.s3.GetObject", count)
    assert torch.equal(saved["x"], td["x"]) and saved["x"].data_ptr() != td["x"].data_ptr()
    assert sum(got) < 128 * 1024, got  # the manifest, the index (and an archive's central directory) only


def test_load_into_a_target_reshards_in_place(s3):
    """load(into=...) fills a target of another world size's shape in place, as on a file system."""
    _client, bucket = s3
    target = url(bucket, "archive")
    parts = [sample(0, 4), sample(1, 7)]
    assert not any(
        isinstance(r, BaseException)
        for r in tddist.run_threads(2, lambda c: tddist.save(parts[c.rank], target, comm=c))
    )
    into = joined(parts).apply(torch.zeros_like)
    report = tddist.load(target, into=into, shard=None, verify=True)
    assert report.ok, report
    assert_td_equal(into.exclude("tag"), joined(parts).exclude("tag"), "filled in place")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_pinned_before_an_overwrite_never_reads_the_new_one(s3, layout):
    """A load that opened the checkpoint before an overwrite committed reads no byte of the new one: the old
    generation is gone (directory) or the ETag no longer matches (archive, If-Match): CheckpointChangedError."""
    from tddist.loading.read import read_leaves
    from tddist.storage.backends import open_checkpoint

    _client, bucket = s3
    target = url(bucket, layout)
    tddist.save(TensorDict(a=torch.zeros(1000, 100), batch_size=[]), target)
    with open_checkpoint(target) as opened:
        tddist.save(TensorDict(a=torch.ones(1000, 100), batch_size=[]), target)
        leaf = opened.manifest.leaves[("a",)]
        with pytest.raises(tddist.CheckpointChangedError, match="was replaced while it was being read"):
            read_leaves(opened, opened.manifest, [(leaf, ((0, 0), (1000, 100)))], 4, True)
    assert tddist.load(target, shard=None)["a"].eq(1).all()


def test_cli_info_and_recover_on_s3_file_commands_refuse(s3, capsys):
    from tddist.cli import main

    _client, bucket = s3
    for layout in LAYOUTS:
        tddist.save(sample(), url(bucket, layout))
        assert main(["info", url(bucket, layout)]) == 0
        assert f"tddist checkpoint, {layout}" in capsys.readouterr().out
        assert main(["recover", url(bucket, layout)]) == 0
        assert "nothing to recover" in capsys.readouterr().out
    assert main(["verify", url(bucket, "directory")]) == 0
    assert main(["pack", url(bucket, "directory"), "copy.tdz"]) == 1
    assert "'tddist verify' and 'tddist materialize' (from it) support" in capsys.readouterr().err


def test_an_archive_completed_whose_answer_was_lost_is_committed(s3):
    """The service completes the multipart upload but the answer is lost (a connection closed after the
    request, injected after the call): rank 0 finds the object is its upload (the multipart ETag of its parts)
    and the save succeeds on every rank instead of reporting a failure of a committed checkpoint."""
    from botocore.exceptions import ConnectionClosedError

    client, bucket = s3
    target = url(bucket, "archive")
    lost = []

    def lose_answer(**_kw):
        if not lost:
            lost.append(True)
            raise ConnectionClosedError(endpoint_url="injected")

    client.meta.events.register("after-call.s3.CompleteMultipartUpload", lose_answer)
    try:
        results = tddist.run_threads(2, lambda c: tddist.save(sample(c.rank), target, comm=c))
    finally:
        client.meta.events.unregister("after-call.s3.CompleteMultipartUpload", lose_answer)
    assert lost and not any(isinstance(r, BaseException) for r in results), results
    assert_td_equal(tddist.load(target, shard=None, verify=True), joined([sample(0), sample(1)]), "committed")


def test_a_save_returns_what_it_committed_while_another_process_saves_to_the_same_key(s3):
    """Two processes save to one key in a loop (a directory and an archive): each save returns exactly its own
    data (its generation is compared with the one it committed; another save's makes it return its shard
    from memory), and none raises."""
    from tests.test_consistent_reads import race_two_savers

    _client, bucket = s3
    race_two_savers({url(bucket, layout): {} for layout in ("directory", "archive")}, saves=25)


# --- incremental saves (docs/format.md 13.3) ------------------------------------------------------------


class Uploads:
    """The bytes of every PUT and part this process sends, by key (tddist's client is shared in a process)."""

    def __init__(self, client):
        self.client, self.by_key = client, {}

    def __enter__(self):
        for op in ("PutObject", "UploadPart"):
            self.client.meta.events.register(f"before-parameter-build.s3.{op}", self.count)
        return self

    def __exit__(self, *exc):
        for op in ("PutObject", "UploadPart"):
            self.client.meta.events.unregister(f"before-parameter-build.s3.{op}", self.count)

    def count(self, params, **_kw):
        body = params.get("Body", b"")
        self.by_key[params["Key"]] = self.by_key.get(params["Key"], 0) + len(body)

    def data(self) -> int:
        """The bytes of data objects (every rank's), not the index or the manifest."""
        return sum(n for k, n in self.by_key.items() if k.endswith(".data"))


def lora_shard(rank: int, step: int) -> TensorDict:
    """A frozen part (sharded rows and a replicated matrix) that never changes, and an adapter that does."""
    g = torch.Generator().manual_seed(rank)
    return TensorDict(
        {
            "base": TensorDict({"w": torch.randn(64, 256, generator=g)}, [64]),
            "frozen": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
            "adapter": torch.full((8, 8), float(step)),
        },
        [],
    )


def lora_whole(step: int) -> TensorDict:
    parts = [lora_shard(r, step) for r in range(2)]
    out = parts[0].clone()
    out["base"] = torch.cat([p["base"] for p in parts])
    return out


def save_lora(target: str, step: int, **kwargs) -> None:
    got = tddist.run_threads(2, lambda c: tddist.save(lora_shard(c.rank, step), target, comm=c, **kwargs), timeout=60)
    assert not any(isinstance(r, BaseException) for r in got), got


def test_incremental_saves_upload_only_the_changed_chunks_and_load_bit_exact(s3):
    """A save with base= uploads only the chunks whose bytes changed (the base's compared by bytes the first
    time, by identity after); its data objects keep only those; loads on 1, 2 and 3 ranks follow the references
    to the holder (one hop: the third names the first, which holds the frozen part); verify finds a deleted
    holder; a base in another bucket is refused."""
    from tddist.tools.verify import verify

    client, bucket = s3
    s1, s2, s3_ = (url(bucket, "directory", f"step{i}") for i in (1, 2, 3))
    save_lora(s1, 1)
    with Uploads(client) as up2:
        save_lora(s2, 2, base=s1)
    with Uploads(client) as up3:
        save_lora(s3_, 3, base=s2)
    adapter = 8 * 8 * 4  # one chunk of 256 bytes, a multiple of 64: nothing else changed
    assert up2.data() == adapter and up3.data() == adapter, (up2.by_key, up3.by_key)
    assert (
        sum(n for k, n in sizes(client, bucket).items() if k.startswith("run/step3/") and k.endswith(".data"))
        == adapter
    )
    m3 = tddist.read_manifest(s3_)
    assert [h.name for h in m3.referenced()] == ["step1"]
    for target, step in ((s2, 2), (s3_, 3)):
        assert_td_equal(tddist.load(target, shard=None, verify=True), lora_whole(step), f"step {step}")
        for world in (2, 3):
            got = tddist.run_threads(world, lambda c, t=target: tddist.load(t, comm=c, shard=None, verify=True))
            assert not any(isinstance(r, BaseException) for r in got), got
            for r in got:
                assert_td_equal(r, lora_whole(step), f"step {step} on {world} ranks")
        mine = tddist.run_threads(2, lambda c, t=target: tddist.load(t, comm=c, shard="saved", verify=True))
        assert torch.equal(mine[1]["base", "w"], lora_shard(1, step)["base", "w"])
    assert verify(s3_).ok and verify(s2, quick=True).ok
    archive, a2 = url(bucket, "archive", "arch1"), url(bucket, "directory", "arch2")
    save_lora(archive, 1)
    with Uploads(client) as up:
        save_lora(a2, 2, base=archive)  # an archive beside it holds the references: read through its entries
    assert up.data() == adapter and [h.name for h in tddist.read_manifest(a2).referenced()] == ["arch1.tdz"]
    assert_td_equal(tddist.load(a2, shard=None, verify=True), lora_whole(2), "an archive's references")
    from tddist.jobs.retention import delete_checkpoint

    save_lora(s1, 9)  # replaced: another generation than the one referenced
    replaced = verify(s3_)
    assert [p.kind for p in replaced.problems] == ["holder"] and "generation" in replaced.problems[0].message
    with pytest.raises(CheckpointPinnedError, match="referenced by a checkpoint beside it"):
        delete_checkpoint(s1)  # step3 names it among its holders
    b, p = bucket.split("/")
    delete_prefix(client, b, f"{p}/run/step1/")  # lost outside tddist
    report = verify(s3_)
    assert [p.kind for p in report.problems] == ["holder"] and "step1" in report.problems[0].message, report
    with pytest.raises(tddist.CorruptCheckpointError, match="step1"):
        tddist.load(s3_, shard=None)
    other = "s3://another-bucket/run/step1"
    for base in (other, "local/step1"):  # a path: on this file system
        with pytest.raises(tddist.InvalidArgumentError, match="same bucket"):
            tddist.save(lora_shard(0, 4), url(bucket, "directory", "step4"), base=base)


def test_a_direct_incremental_save_and_a_clean_up_never_leave_a_dangling_reference(s3, monkeypatch):
    """Pins and deletion markers (docs/format.md 13.3), each interleaving run exactly through a fault point:
    a deletion between the save's check of its holders and its commit finds the save's pin and deletes
    nothing; once committed, the reference keeps the holder; a save that checks its holders while a deletion
    of one is under way (its marker beside it) commits nothing; a marker past its lease (a deletion cut off)
    is ignored, and recover removes it; no mark is left behind."""
    from tddist import format as fmt
    from tddist.jobs.retention import delete_checkpoint
    from tddist.storage.s3 import holds

    client, bucket = s3
    b, p = bucket.split("/")
    h1, h2, h3, h4 = (url(bucket, "directory", f"pins{i}") for i in (1, 2, 3, 4))
    save_lora(h1, 1)
    refused: list[BaseException] = []

    def clean_up() -> None:  # another process's clean-up, run between rank 0's check and its commit
        try:
            delete_checkpoint(h1)
        except CheckpointPinnedError as e:
            refused.append(e)

    with inject("manifest", 0, clean_up):
        save_lora(h2, 2, base=h1)
    assert len(refused) == 1 and "pinned by an incremental save" in str(refused[0]), refused
    assert_td_equal(tddist.load(h2, shard=None, verify=True), lora_whole(2), "the holder was kept")
    with pytest.raises(CheckpointPinnedError, match="referenced by a checkpoint beside it"):
        delete_checkpoint(h1)

    failed: list[BaseException] = []

    def save_meanwhile() -> None:  # a save of another process, run while this deletion's marker is beside h3
        got = tddist.run_threads(2, lambda c: tddist.save(lora_shard(c.rank, 4), h4, comm=c, base=h3), timeout=60)
        failed.extend(r for r in got if isinstance(r, BaseException))

    save_lora(h3, 3)
    with inject("delete", 0, save_meanwhile):
        delete_checkpoint(h3)  # unreferenced: deleted once the save that failed has removed its pin
    assert len(failed) == 2 and all(isinstance(e, tddist.TargetError) for e in failed), failed
    assert "is being deleted by a clean-up" in str(failed[0]), failed
    assert not store_for(h4).committed() and not store_for(h3).committed()

    marker = f"{p}/run/{fmt.deletion_name('pins1')}"  # a deletion cut off after its marker
    client.put_object(Bucket=b, Key=marker, Body=b"")
    got = tddist.run_threads(2, lambda c: tddist.save(lora_shard(c.rank, 4), h4, comm=c, base=h1), timeout=60)
    assert all(isinstance(r, tddist.TargetError) and "being deleted" in str(r) for r in got), got
    monkeypatch.setattr(holds, "DELETION_LEASE", 1.0)
    time.sleep(2.5)  # the store's modification times have whole seconds
    save_lora(h4, 4, base=h1)
    assert_td_equal(tddist.load(h4, shard=None, verify=True), lora_whole(4), "past the marker's lease")
    assert any(marker in line for line in tddist.recover(h1))
    assert [k for k in keys(client, bucket) if k.startswith("run/.")] == []


def test_manager_incremental_on_s3_keeps_what_it_references_and_materializes(s3, tmp_path):
    """CheckpointManager(incremental=True) on an s3:// root saves against the last checkpoint; retention and
    'tddist gc' keep the checkpoint a kept one references (the first, which holds the frozen part); verify
    and materialize follow the references; the copy references nothing and loads alone."""
    from tddist import CheckpointManager
    from tddist.cli import main
    from tddist.jobs.cleanup import plan_gc

    client, bucket = s3
    root = f"s3://{bucket}/mgr"

    def state(step: int) -> TensorDict:
        return TensorDict({"frozen": torch.arange(65536, dtype=torch.float32), "adapter": torch.full((16,), step)})

    with Uploads(client) as up, CheckpointManager(root, keep_last=1, incremental=True) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(step))
        mgr.wait()
    saved = [
        sum(n for k, n in up.by_key.items() if f"step-00000000{s}/" in k and k.endswith(".data")) for s in range(1, 5)
    ]
    assert saved[0] >= 65536 * 4 and saved[1:] == [128, 128, 128], saved  # the int64 adapter alone
    names = sorted({k.split("/")[1] for k in keys(client, bucket) if k.startswith("mgr/step-")})
    assert names == ["step-000000001", "step-000000004"], names
    newest = f"{root}/step-000000004"
    assert [h.name for h in tddist.read_manifest(newest).referenced()] == ["step-000000001"]
    assert [(a.action, a.path.rsplit("/", 1)[1]) for a in plan_gc(root, keep_last=1)] == [("keep", "step-000000001")]
    assert main(["gc", root, "--keep-last", "1"]) == 0
    assert tddist.read_manifest(f"{root}/step-000000001").world_size == 1
    assert main(["verify", newest]) == 0 and main(["verify", "--quick", "--json", newest]) == 0
    assert main(["info", newest]) == 0
    copy = tmp_path / "copy"
    assert main(["materialize", newest, str(copy)]) == 0
    assert tddist.read_manifest(copy).referenced() == ()
    assert_td_equal(tddist.load(copy, shard=None, verify=True), state(4), "materialized")
    assert_td_equal(tddist.load(newest, shard=None, verify=True), state(4), "from S3")
